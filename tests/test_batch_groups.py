"""N of the user's batches decoded at once (generation/batch_groups.py, joined_sample.py): which tasks join their
batches (a model built on the task and prepared for inference, the static beam search the task built for it, read as
the first batch is drawn), what a joined sample's source tokens state, that the static beam search decodes each user
batch of it on its own thread as it decodes that batch alone, and that a sample rebuilt from a joined batch's tensors
(fairseq-interactive's) is decoded so too. The CLIs end to end: test_native_search_variants.py."""
import argparse
import logging
import threading

import numpy as np
import pytest
import torch
from fairseq.data import LanguagePairDataset, iterators
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.sequence_generator import SequenceGenerator
from fairseq.tasks import FairseqTask
from helpers import build_model, make_dictionary, parse_args, random_batch

from rfa_fairseq import fairseq_compat
from rfa_fairseq.generation import StaticBeamSearchGenerator, batch_groups, joined_sample

PER_JOIN = 2 * batch_groups.BATCHES_PER_THREAD  # the user's batches in a joined batch at 2 threads
BEAM = argparse.Namespace(beam=4, max_len_b=3)


class DictionaryTask(FairseqTask):
    """fairseq's base task with the dictionaries a model is built on (its batch iterator, generator and inference_step
    are FairseqTask's, as the plugin patches them)."""

    def __init__(self, dictionary):
        super().__init__(argparse.Namespace())
        self.dictionary = dictionary

    @property
    def source_dictionary(self):
        return self.dictionary

    @property
    def target_dictionary(self):
        return self.dictionary


@pytest.fixture
def threads():
    """Set torch's thread count for the test; the caller's afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def model_on_task(task_class=DictionaryTask):
    """(model, dictionary, task): a tiny rfa_transformer built on a task as fairseq builds it (the model's
    build_model records it on the task), not yet prepared for inference."""
    d = make_dictionary()
    task = task_class(d)
    torch.manual_seed(1)
    model = ARCH_MODEL_REGISTRY["rfa_transformer"].build_model(parse_args([]), task)
    model.eval()
    return model, d, task


def prepare(model):
    model.prepare_for_inference_(argparse.Namespace(generation=argparse.Namespace(beam=4)))


def dataset_of(d, count, seed=3):
    """A LanguagePairDataset of `count` sentences of 2-11 tokens (sources and targets the same)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (count,), generator=g)
    sources = [torch.cat([torch.randint(d.nspecial, len(d), (int(n) - 1,), generator=g), torch.tensor([d.eos()])])
               for n in lengths]
    return LanguagePairDataset(sources, np.array(lengths), d, sources, np.array(lengths), d)


OPTIONS = dict(max_sentences=4, required_batch_size_multiple=1, disable_iterator_cache=True)


def epoch_of(task, dataset):
    return task.get_batch_iterator(dataset, **OPTIONS).next_epoch_itr(shuffle=False)


def users_of(task, dataset):
    """fairseq's own batches of `dataset` (the get_batch_iterator the plugin wraps)."""
    unwrapped = fairseq_compat.APPLIED["batches-at-once"]
    return list(unwrapped(task, dataset, **OPTIONS).next_epoch_itr(shuffle=False))


def ids(batches):
    return [b["id"].tolist() for b in batches]


def test_batches_at_once_is_the_static_generators_on_the_native_step(threads, monkeypatch):
    model, d = build_model([])
    model.eval()
    generator = StaticBeamSearchGenerator(model, d, beam_size=4)
    threads(1)
    assert batch_groups.batches_at_once(generator) == 1
    threads(2)
    assert batch_groups.batches_at_once(generator) == 2
    monkeypatch.setattr(generator, "parts", 3)  # --rfa-decode-parts 3
    assert batch_groups.batches_at_once(generator) == 3
    monkeypatch.setattr(generator, "parts", 1)
    assert batch_groups.batches_at_once(generator) == 1
    monkeypatch.setattr(generator, "parts", 0)
    monkeypatch.setattr(model.decoder.rfa, "rfa_decode_kernel", "torch")  # no native step: one batch at a time
    assert batch_groups.batches_at_once(generator) == 1
    monkeypatch.setattr(model.decoder.rfa, "rfa_decode_kernel", "auto")
    assert batch_groups.batches_at_once(generator) == 2
    assert batch_groups.batches_at_once(SequenceGenerator([model], d, beam_size=4)) == 1
    assert batch_groups.batches_at_once(None) == 1


def test_a_task_joins_its_batches_only_for_its_static_generator_of_a_model_prepared_for_inference(threads):
    """fairseq-train's task (a model never prepared for inference) gets fairseq's iterator; a generating task's
    iterator joins 2 * BATCHES_PER_THREAD batches at 2 threads once the task built the static beam search, also when
    the iterator was made before the generator (fairseq-generate's order), and none for fairseq's generator."""
    model, d, task = model_on_task()
    assert model in batch_groups.joining_of(task).models  # recorded by the model's build_model
    dataset = dataset_of(d, 4 * (PER_JOIN + 2) - 1)  # batches of 4: a join of PER_JOIN batches, then one of 2
    users = users_of(task, dataset)
    assert len(users) == PER_JOIN + 2
    threads(2)
    assert isinstance(task.get_batch_iterator(dataset, **OPTIONS), iterators.EpochBatchIterator)  # not prepared

    prepare(model)
    assert model.prepared_for_inference
    epoch = epoch_of(task, dataset)  # no generator yet: fairseq's batches, one at a time
    assert ids(epoch) == ids(users)

    early = epoch_of(task, dataset)  # made before the generator, drawn after (fairseq-generate)
    generator = task.build_generator([model], BEAM)
    assert isinstance(generator, StaticBeamSearchGenerator)
    assert len(early) == 2  # what the task's generator joins
    joined = list(early)
    assert [len(joined_sample.user_batches(b)) for b in joined] == [PER_JOIN, 2]
    for group, batch in zip([users[:PER_JOIN], users[PER_JOIN:]], joined):
        assert [batch["id"][rows].tolist() for rows, _ in joined_sample.user_batches(batch)] == ids(group)

    epoch = epoch_of(task, dataset)  # made at 2 threads, drawn at 1: the threads as the first batch is drawn
    threads(1)
    assert ids(epoch) == ids(users)

    threads(2)
    sampling = task.build_generator([model], argparse.Namespace(beam=4, sampling=True))
    assert isinstance(sampling, SequenceGenerator)  # fairseq's generator: the task's batches come one at a time
    assert ids(epoch_of(task, dataset)) == ids(users)


class TaskWithItsOwnInferenceStep(DictionaryTask):
    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        return generator.generate(models, {"net_input": dict(sample["net_input"])})  # a dict of its own


def test_a_task_whose_inference_step_is_its_own_decodes_joined_batches_by_the_users_batches(threads, monkeypatch):
    """The record rides on the source tokens: a task's own inference_step that hands its generator a dict of its own
    still decodes each user batch of a joined batch on its own thread."""
    model, d, task = model_on_task(TaskWithItsOwnInferenceStep)
    prepare(model)
    generator = task.build_generator([model], BEAM)
    threads(2)
    assert batch_groups.batches_at_once(generator) == 2
    (joined,) = list(epoch_of(task, dataset_of(d, 11)))  # batches of 4, 4 and 3
    _, seen = _decode_recorded(model, lambda: task.inference_step(generator, [model], joined), monkeypatch)
    assert sorted(shape[0] for name, shape, _ in seen if name.startswith("rfa-decode-part")) == [3, 4, 4], seen


def test_one_batch_is_not_joined(threads, caplog):
    """An epoch of one batch (fairseq-interactive at --buffer-size 1) hands out fairseq's batch: no record, no log."""
    model, d, task = model_on_task()
    prepare(model)
    generator = task.build_generator([model], BEAM)  # held here: the task holds it weakly
    threads(2)
    assert batch_groups.batches_at_once(generator) == 2
    with caplog.at_level(logging.INFO, logger=batch_groups.__name__):
        batches = list(epoch_of(task, dataset_of(d, 1)))
    assert len(batches) == 1 and joined_sample.user_batches(batches[0]) is None
    assert "decoded at once" not in caplog.text
    with caplog.at_level(logging.INFO, logger=batch_groups.__name__):
        assert len(list(epoch_of(task, dataset_of(d, 9)))) == 1  # three batches, joined
    assert "2 batches decoded at once" in caplog.text


def _user_batch(d, rows, width, seed, ids):
    src, lengths, prev = random_batch(d, bsz=rows, src_len=width, tgt_len=width - 1, seed=seed)
    target = torch.cat([prev[:, 1:], torch.full((rows, 1), d.eos())], dim=1)
    target[-1, -2:] = d.pad()  # right-padded targets
    return {"id": torch.tensor(ids), "nsentences": rows, "ntokens": int(target.ne(d.pad()).sum()),
            "net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev}, "target": target}


@pytest.mark.parametrize("left_pad_source", [True, False])
def test_a_joined_sample_states_each_user_batchs_rows_and_columns(left_pad_source):
    _, d = build_model([])
    batches = [_user_batch(d, 3, 9, 0, [4, 7, 1]), _user_batch(d, 2, 5, 1, [0, 2]), _user_batch(d, 4, 7, 2, [3, 5, 6, 8])]
    if not left_pad_source:  # right-padded sources: the same tokens, the padding moved to the end
        for b in batches:
            src = b["net_input"]["src_tokens"]
            b["net_input"]["src_tokens"] = torch.stack([torch.cat([r[r.ne(d.pad())], r[r.eq(d.pad())]]) for r in src])
    joined = joined_sample.join_batches(batches, d.pad(), {"source": left_pad_source, "target": False})
    src = joined["net_input"]["src_tokens"]
    assert src.shape == (9, 9) and joined["target"].shape == (9, 8)
    assert joined["id"].tolist() == [4, 7, 1, 0, 2, 3, 5, 6, 8]
    assert joined["nsentences"] == 9 and joined["ntokens"] == sum(b["ntokens"] for b in batches)
    parts = joined_sample.user_batches(joined)
    assert parts == getattr(src, joined_sample.USER_BATCHES) and len(parts) == 3  # stated by the source tokens
    for b, (rows, columns) in zip(batches, parts):
        torch.testing.assert_close(src[rows][:, columns], b["net_input"]["src_tokens"], rtol=0, atol=0)
        torch.testing.assert_close(joined["net_input"]["src_lengths"][rows], b["net_input"]["src_lengths"])
        width = b["target"].size(1)
        torch.testing.assert_close(joined["target"][rows][:, :width], b["target"], rtol=0, atol=0)
        assert joined["target"][rows][:, width:].eq(d.pad()).all()  # targets pad on the right
        outside = src[rows].clone()
        outside[:, columns] = d.pad()
        assert outside.eq(d.pad()).all()  # the joined columns are padding, on the side the dataset pads
    assert joined_sample.user_batches(batches[0]) is None  # a batch of its own
    assert joined_sample.user_batches(_copied_source(joined)) is None  # a copy of the tokens states nothing
    assert joined_sample.join_batches(batches[:1], d.pad(), {"source": True, "target": False}) is batches[0]
    with pytest.raises(ValueError, match="'alignments'"):
        joined_sample.join_batches([dict(b, alignments=torch.zeros(2)) for b in batches], d.pad(),
                                   {"source": True, "target": False})


def test_a_record_that_does_not_cover_the_source_is_an_error_naming_it():
    _, d = build_model([])
    joined = joined_sample.join_batches([_user_batch(d, 3, 9, 0, [0, 1, 2]), _user_batch(d, 2, 5, 1, [3, 4])],
                                        d.pad(), {"source": True, "target": False})
    (first, columns), second = joined_sample.user_batches(joined)
    for record, message in [
        ([(first, columns)], r"hold 3 rows, its source tokens 5"),  # a user batch missing
        ([second, (first, columns)], r"rfa_user_batches\[0\] .* rows 3:5 .* \(from 0\)"),  # out of order
        ([(first, slice(9, 12)), second], r"rfa_user_batches\[0\] .* columns 9:12"),  # outside the source
        ([(first, columns), (slice(3, 9), slice(4, 9))], r"rfa_user_batches\[1\] .* rows 3:9"),  # past its last row
        ([(first, columns), ("rows", "columns")], r"rfa_user_batches\[1\] .* is \('rows', 'columns'\)"),
    ]:
        src_tokens = joined_sample.state_user_batches(joined["net_input"]["src_tokens"].clone(), record)
        with pytest.raises(ValueError, match=message):
            joined_sample.user_batches({"net_input": {"src_tokens": src_tokens}})


def _decode_recorded(model, generate, monkeypatch):
    """Run `generate()` with the encoder's passes recorded: (hypotheses, [(thread, source shape, its torch threads)])."""
    seen = []
    encode = type(model.encoder).forward_torchscript

    def recorded(self, net_input):
        seen.append((threading.current_thread().name, tuple(net_input["src_tokens"].shape), torch.get_num_threads()))
        return encode(self, net_input)

    monkeypatch.setattr(type(model.encoder), "forward_torchscript", recorded)
    with torch.no_grad():
        hypotheses = generate()
    monkeypatch.setattr(type(model.encoder), "forward_torchscript", encode)
    return hypotheses, seen


def _varied_model(precision="fp32", monkeypatch=None):
    model, d = build_model([])
    model.eval()
    if monkeypatch is not None:
        monkeypatch.setattr(model.decoder.rfa, "rfa_decode_precision", precision)
    with torch.no_grad():  # an EOS logit that ends the sentences at different steps
        W = model.decoder.output_projection.weight
        W[d.eos()] = 0.7 * torch.randn(W.size(1), generator=torch.Generator().manual_seed(0))
    return model, d


def _copied_source(sample):
    """`sample` with a copy of its source tokens."""
    return {**sample, "net_input": {**sample["net_input"], "src_tokens": sample["net_input"]["src_tokens"].clone()}}


def _assert_same(want, got):
    assert len(want) == len(got)
    for sentence, (w, g) in enumerate(zip(want, got)):
        assert [h["tokens"].tolist() for h in w] == [h["tokens"].tolist() for h in g], f"sentence {sentence}"
        assert [float(h["score"]) for h in w] == [float(h["score"]) for h in g], f"sentence {sentence}"
    assert len({tuple(h[0]["tokens"].tolist()) for h in want}) > 4  # sentences that differ: rows matched rightly


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_joined_batch_decodes_each_user_batch_on_its_own_thread_as_alone(threads, monkeypatch, precision):
    """Each user batch of a joined sample: encoder and search on a part's thread, hypotheses and scores bit for bit
    those of that batch decoded alone at one thread (its own width: max_len and the encoder's padding are its own)."""
    model, d = _varied_model(precision, monkeypatch)
    batches = [_user_batch(d, 5, 9, 0, list(range(5))), _user_batch(d, 3, 4, 1, [5, 6, 7]),
               _user_batch(d, 4, 6, 2, [8, 9, 10, 11])]
    joined = joined_sample.join_batches(batches, d.pad(), {"source": True, "target": False})
    threads(1)
    alone = StaticBeamSearchGenerator(model, d, beam_size=4, max_len_a=1, max_len_b=3)
    with torch.no_grad():
        want = [h for b in batches for h in alone.generate([model], b)]
    threads(2)
    generator = StaticBeamSearchGenerator(model, d, beam_size=4, max_len_a=1, max_len_b=3)
    got, seen = _decode_recorded(model, lambda: generator.generate([model], joined), monkeypatch)
    assert sorted(shape for _, shape, _ in seen) == sorted(tuple(b["net_input"]["src_tokens"].shape) for b in batches)
    assert all(name.startswith("rfa-decode-part") and teams == 1 for name, _, teams in seen), seen
    assert len(want) == 12
    _assert_same(want, got)


def test_a_sample_rebuilt_from_a_joined_batchs_tensors_is_decoded_by_the_users_batches(threads, monkeypatch):
    """fairseq-interactive's loop: a joined batch drawn from the task's iterator, its dict rebuilt from its source
    tokens and lengths (fairseq_cli.interactive hands the tensors on as they came), decoded through task.inference_step
    by the user's batches, as one thread decodes them one at a time; a sample rebuilt from copies of them states no
    parts and is decoded as one batch."""
    model, d, task = model_on_task()
    with torch.no_grad():  # an EOS logit that ends the sentences at different steps
        W = model.decoder.output_projection.weight
        W[d.eos()] = 0.7 * torch.randn(W.size(1), generator=torch.Generator().manual_seed(0))
    prepare(model)
    dataset = dataset_of(d, 11)  # batches of 4, 4 and 3
    threads(1)
    generator = task.build_generator([model], BEAM)
    with torch.no_grad():
        want = [h for b in epoch_of(task, dataset) for h in task.inference_step(generator, [model], b)]
    threads(2)
    generator = task.build_generator([model], BEAM)
    (joined,) = list(epoch_of(task, dataset))

    def rebuilt(batch):  # fairseq_cli.interactive.main's sample (its Batch namedtuple's tensors)
        return {"net_input": {"src_tokens": batch["net_input"]["src_tokens"],
                              "src_lengths": batch["net_input"]["src_lengths"]}}

    got, seen = _decode_recorded(model, lambda: task.inference_step(generator, [model], rebuilt(joined)), monkeypatch)
    assert sorted(shape[0] for name, shape, _ in seen if name.startswith("rfa-decode-part")) == [3, 4, 4], seen
    _assert_same(want, got)

    copied = rebuilt(_copied_source(joined))
    _, seen = _decode_recorded(model, lambda: task.inference_step(generator, [model], copied), monkeypatch)
    assert [(name, shape[0]) for name, shape, _ in seen] == [("MainThread", 11)], seen
