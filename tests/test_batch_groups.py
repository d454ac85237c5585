"""N of the user's batches decoded at once (generation/batch_groups.py): which tasks get joined batches, what a joined
batch holds, and that the static beam search decodes each user batch of it on its own thread as it decodes that
batch alone (the CLIs end to end: test_native_search_variants.py)."""
import argparse
import threading

import numpy as np
import pytest
import torch
from fairseq.data import LanguagePairDataset
from fairseq.tasks import FairseqTask
from helpers import build_model, random_batch

from rfa_fairseq import fairseq_compat
from rfa_fairseq.generation import StaticBeamSearchGenerator, batch_groups
from rfa_fairseq.models import rfa_transformer


class DictionaryTask(FairseqTask):
    """fairseq's base task with the dictionaries a model is built on (its batch iterator is FairseqTask's)."""

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


@pytest.fixture
def prepared():
    """A tiny model prepared for inference (as fairseq-generate prepares it) and its task; unregistered after."""
    model, d = build_model([])
    model.eval()
    model.prepare_for_inference_(argparse.Namespace(generation=argparse.Namespace(beam=4)))
    yield model, d, DictionaryTask(d)
    rfa_transformer.PREPARED_FOR_INFERENCE.discard(model)


def test_batches_at_once_for_a_prepared_model_on_the_native_step(prepared, threads, monkeypatch):
    model, d, task = prepared
    threads(1)
    assert batch_groups.batches_at_once(task) == 1
    threads(2)
    assert batch_groups.batches_at_once(task) == 2
    monkeypatch.setattr(model.decoder.rfa, "rfa_decode_parts", 3)
    assert batch_groups.batches_at_once(task) == 3
    monkeypatch.setattr(model.decoder.rfa, "rfa_decode_parts", 1)
    assert batch_groups.batches_at_once(task) == 1
    monkeypatch.setattr(model.decoder.rfa, "rfa_decode_parts", 0)
    monkeypatch.setattr(model.decoder.rfa, "rfa_decode_kernel", "torch")  # no native step: one batch at a time
    assert batch_groups.batches_at_once(task) == 1
    monkeypatch.setattr(model.decoder.rfa, "rfa_decode_kernel", "auto")
    monkeypatch.setattr(model.decoder.rfa, "rfa_static_beam_search", False)
    assert batch_groups.batches_at_once(task) == 1
    monkeypatch.setattr(model.decoder.rfa, "rfa_static_beam_search", True)
    assert batch_groups.batches_at_once(task) == 2
    assert batch_groups.batches_at_once(DictionaryTask(model.decoder.dictionary.__class__())) == 1  # another task's
    other, _ = build_model([], dictionary=d)  # a second model on the task's dictionaries: an ensemble
    other.prepare_for_inference_(argparse.Namespace(generation=argparse.Namespace(beam=4)))
    try:
        assert batch_groups.batches_at_once(task) == 1
    finally:
        rfa_transformer.PREPARED_FOR_INFERENCE.discard(other)


def test_a_model_not_prepared_for_inference_leaves_the_tasks_batches_alone(threads):
    """fairseq-train validates through the same get_batch_iterator: its models are never prepared for inference."""
    model, d = build_model([])
    model.eval()
    threads(2)
    assert batch_groups.batches_at_once(DictionaryTask(d)) == 1
    assert batch_groups.batches_at_once(FairseqTask(argparse.Namespace())) == 1  # a task without dictionaries


def _user_batch(d, rows, width, seed, ids):
    src, lengths, prev = random_batch(d, bsz=rows, src_len=width, tgt_len=width - 1, seed=seed)
    target = torch.cat([prev[:, 1:], torch.full((rows, 1), d.eos())], dim=1)
    target[-1, -2:] = d.pad()  # right-padded targets
    return {"id": torch.tensor(ids), "nsentences": rows, "ntokens": int(target.ne(d.pad()).sum()),
            "net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev}, "target": target}


@pytest.mark.parametrize("left_pad_source", [True, False])
def test_joined_batches_pad_to_the_widest_and_record_each_user_batchs_rows_and_columns(left_pad_source):
    _, d = build_model([])
    batches = [_user_batch(d, 3, 9, 0, [4, 7, 1]), _user_batch(d, 2, 5, 1, [0, 2]), _user_batch(d, 4, 7, 2, [3, 5, 6, 8])]
    if not left_pad_source:  # right-padded sources: the same tokens, the padding moved to the end
        for b in batches:
            src = b["net_input"]["src_tokens"]
            b["net_input"]["src_tokens"] = torch.stack([torch.cat([r[r.ne(d.pad())], r[r.eq(d.pad())]]) for r in src])
    joined = batch_groups.join_batches(batches, d.pad(), {"source": left_pad_source, "target": False})
    src = joined["net_input"]["src_tokens"]
    assert src.shape == (9, 9) and joined["target"].shape == (9, 8)
    assert joined["id"].tolist() == [4, 7, 1, 0, 2, 3, 5, 6, 8]
    assert joined["nsentences"] == 9 and joined["ntokens"] == sum(b["ntokens"] for b in batches)
    parts = batch_groups.user_batches(src)
    assert len(parts) == 3
    for b, (rows, columns) in zip(batches, parts):
        torch.testing.assert_close(src[rows][:, columns], b["net_input"]["src_tokens"], rtol=0, atol=0)
        torch.testing.assert_close(joined["net_input"]["src_lengths"][rows], b["net_input"]["src_lengths"])
        width = b["target"].size(1)
        torch.testing.assert_close(joined["target"][rows][:, :width], b["target"], rtol=0, atol=0)
        assert joined["target"][rows][:, width:].eq(d.pad()).all()  # targets pad on the right
        outside = src[rows].clone()
        outside[:, columns] = d.pad()
        assert outside.eq(d.pad()).all()  # the joined columns are padding, on the side the dataset pads
    assert batch_groups.user_batches(batches[0]["net_input"]["src_tokens"]) is None  # a batch of its own
    assert batch_groups.join_batches(batches[:1], d.pad(), {"source": True, "target": False}) is batches[0]
    with pytest.raises(ValueError, match="'alignments'"):
        batch_groups.join_batches([dict(b, alignments=torch.zeros(2)) for b in batches], d.pad(),
                                  {"source": True, "target": False})


def test_the_task_iterator_joins_n_batches_of_the_users_in_order(prepared, threads):
    """The wrapped get_batch_iterator of a prepared model's task at 2 threads: every 2 * BATCHES_PER_THREAD of fairseq's
    batches joined (the rest after them), each user batch's sentences the rows user_batches names; at 1 thread
    fairseq's batches."""
    model, d, task = prepared
    g = torch.Generator().manual_seed(3)
    per_join = 2 * batch_groups.BATCHES_PER_THREAD
    count = 4 * (per_join + 2) - 1  # batches of 4: one join of per_join batches, then one of 2 (the last of 3 sentences)
    lengths = torch.randint(2, 12, (count,), generator=g)
    sources = [torch.cat([torch.randint(d.nspecial, len(d), (int(n) - 1,), generator=g), torch.tensor([d.eos()])])
               for n in lengths]
    dataset = LanguagePairDataset(sources, np.array(lengths), d, sources, np.array(lengths), d)
    unwrapped = fairseq_compat.APPLIED["batches-at-once"]
    options = dict(max_sentences=4, required_batch_size_multiple=1, disable_iterator_cache=True)
    users = list(unwrapped(task, dataset, **options).next_epoch_itr(shuffle=False))
    assert len(users) == per_join + 2
    threads(1)
    assert [b["id"].tolist() for b in task.get_batch_iterator(dataset, **options).next_epoch_itr(shuffle=False)] == \
        [b["id"].tolist() for b in users]
    threads(2)
    iterator = task.get_batch_iterator(dataset, **options)
    assert len(iterator) == 2
    epoch = iterator.next_epoch_itr(shuffle=False)
    assert len(epoch) == 2
    joined = list(epoch)
    assert len(joined) == 2
    for group, batch in zip([users[:per_join], users[per_join:]], joined):
        parts = batch_groups.user_batches(batch["net_input"]["src_tokens"])
        assert [batch["id"][rows].tolist() for rows, _ in parts] == [b["id"].tolist() for b in group]
        for b, (rows, columns) in zip(group, parts):
            assert torch.equal(batch["net_input"]["src_tokens"][rows][:, columns], b["net_input"]["src_tokens"])


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_joined_batch_decodes_each_user_batch_on_its_own_thread_as_alone(threads, monkeypatch, precision):
    """Each user batch of a joined one: encoder and search on a part's thread, hypotheses and scores bit for bit those
    of that batch decoded alone at one thread (its own width: max_len and the encoder's padding are its own)."""
    model, d = build_model([])
    model.eval()
    monkeypatch.setattr(model.decoder.rfa, "rfa_decode_precision", precision)
    with torch.no_grad():  # an EOS logit that ends the sentences at different steps
        W = model.decoder.output_projection.weight
        W[d.eos()] = 0.7 * torch.randn(W.size(1), generator=torch.Generator().manual_seed(0))
    batches = [_user_batch(d, 5, 9, 0, list(range(5))), _user_batch(d, 3, 4, 1, [5, 6, 7]),
               _user_batch(d, 4, 6, 2, [8, 9, 10, 11])]
    joined = batch_groups.join_batches(batches, d.pad(), {"source": True, "target": False})
    seen = []
    encode = type(model.encoder).forward_torchscript

    def recorded(self, net_input):
        seen.append((threading.current_thread().name, net_input["src_tokens"].shape, torch.get_num_threads()))
        return encode(self, net_input)

    monkeypatch.setattr(type(model.encoder), "forward_torchscript", recorded)
    with torch.no_grad():
        threads(1)
        alone = StaticBeamSearchGenerator(model, d, beam_size=4, max_len_a=1, max_len_b=3)
        want = [h for b in batches for h in alone.generate([model], b)]
        threads(2)
        seen.clear()
        got = StaticBeamSearchGenerator(model, d, beam_size=4, max_len_a=1, max_len_b=3).generate([model], joined)
    assert sorted(shape for _, shape, _ in seen) == sorted(b["net_input"]["src_tokens"].shape for b in batches)
    assert all(name.startswith("rfa-decode-part") and teams == 1 for name, _, teams in seen), seen
    assert len(want) == len(got) == 12
    for sentence, (w, g) in enumerate(zip(want, got)):
        assert [h["tokens"].tolist() for h in w] == [h["tokens"].tolist() for h in g], f"sentence {sentence}"
        assert [float(h["score"]) for h in w] == [float(h["score"]) for h in g], f"sentence {sentence}"
    assert len({tuple(h[0]["tokens"].tolist()) for h in want}) > 4  # sentences that differ: rows matched rightly
