"""The weights held once (issue 71): a checkpoint loaded for decoding (fairseq's load_model_ensemble_and_task, which
fairseq-generate, fairseq-interactive and the hub use) lends the model's parameters its mapped pages instead of copies
(checkpoints.share_mapped_tensors), the model is built without filling parameters the checkpoint then sets
(checkpoints.parameters_left_unset), and the decoding runtime, once it has packed a weight into its blocks, gives the
weight's file pages back (cpu/native.py): the process holds the packed copy alone. The hypotheses are those of a model
whose parameters were copied, and a model prepared for decoding still trains (copy-on-write: the file keeps its
weights)."""
import os
import platform
import re

import pytest
import torch
from cli_support import run, synthetic_data
from conftest import PLUGIN_DIR
from helpers import cpp_extension, resident_pages
from tiny_models import tiny_model_flags

from rfa_fairseq import checkpoints
from rfa_fairseq.file_mappings import FileMappings

# wide enough that each linear layer spans many pages (a 256 x 1,024 weight: 256 pages of 4 KB)
MODEL = tiny_model_flags(embed_dim=256, ffn_dim=1024, heads=4, encoder_layers=2, decoder_layers=2)


def _kernel_pages_out() -> bool:
    release = tuple(int(part) for part in re.findall(r"\d+", platform.release())[:2])
    return platform.system() == "Linux" and release >= (5, 4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(corpus, checkpoint) of an rfa_transformer of 256 x 1,024, 2 + 2 layers, after 2 updates, on disk."""
    data = synthetic_data(tmp_path_factory)
    save_dir = tmp_path_factory.mktemp("weights_once")
    run("fairseq-train", data / "bin", "--user-dir", PLUGIN_DIR, "--arch", "rfa_transformer", *MODEL,
        "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "2000", "--num-workers", "0", "--seed", "1",
        "--max-update", "2", "--no-epoch-checkpoints", "--save-dir", save_dir, "--cpu")
    checkpoint = save_dir / "checkpoint_last.pt"
    with open(checkpoint, "rb") as saved:  # on disk: pages the system can drop (written ones it must write first)
        os.fsync(saved.fileno())
    return data, checkpoint


def _load(data, checkpoint, **overrides):
    from fairseq import checkpoint_utils

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data / "bin"), **overrides})
    return models[0], cfg, task


def _translate(model, cfg, task, sentences=24, prepare=True):
    cfg.generation.beam = 4
    if prepare:  # fairseq-generate's, fairseq-interactive's and the hub's (no training after it: fairseq's rule)
        model.prepare_for_inference_(cfg)
    generator = task.build_generator([model], cfg.generation)
    task.load_dataset("test")
    batches = task.get_batch_iterator(dataset=task.dataset("test"), max_sentences=8,
                                      required_batch_size_multiple=1).next_epoch_itr(shuffle=False)
    out = {}
    with torch.no_grad():
        for batch in batches:
            for i, hyps in zip(batch["id"].tolist(), task.inference_step(generator, [model], batch)):
                out[i] = (hyps[0]["tokens"].tolist(), float(hyps[0]["score"]))
            if len(out) >= sentences:
                break
    return out


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_checkpoint_loaded_for_decoding_lends_its_pages_and_the_runtime_gives_them_back(trained, precision):
    cpp_extension()
    if not _kernel_pages_out():
        pytest.skip(f"pages are given back on Linux 5.4 and later (MADV_PAGEOUT); this is {platform.system()} "
                    f"{platform.release()}")
    data, checkpoint = trained
    model, cfg, task = _load(data, checkpoint, rfa_decode_precision=precision)
    mappings = FileMappings.now()
    named = dict(model.named_parameters())
    assert all(mappings.holds(p) for p in named.values()), [n for n, p in named.items() if not mappings.holds(p)]
    # the linear layers the runtimes pack (the embedding is read row by row, the norms at every step)
    packed = {name: p for name, p in named.items() if p.dim() == 2 and "embed" not in name and p.numel() >= 65536}
    assert len(packed) >= 8, sorted(named)
    # built without filling them, the parameters' own memory was never written; the checkpoint's pages not yet read
    assert sum(resident_pages(p)[0] for p in packed.values()) <= sum(p.numel() for p in packed.values()) * 4 // 4096 // 20
    hypotheses = _translate(model, cfg, task)
    with torch.no_grad():
        runtime = model.decoder.decoding_runtime()
    assert runtime.program is not None and runtime.kernels.precision == precision
    left = {name: resident_pages(p)[0] for name, p in packed.items()}
    assert sum(left.values()) <= sum(p.numel() for p in packed.values()) * 4 // 4096 // 20, left

    # the same model with its parameters copied (not a file's pages): the same hypotheses and scores
    copied, cfg2, task2 = _load(data, checkpoint, rfa_decode_precision=precision)
    for p in copied.parameters():
        p.data = p.data.clone()
    assert not any(FileMappings.now().holds(p) for p in copied.parameters())
    assert _translate(copied, cfg2, task2) == hypotheses


@pytest.mark.slow
def test_a_model_that_decoded_trains_and_its_file_keeps_the_weights(trained):
    """Decoding gave the pages back; training afterwards reads them from the file and writes the process's own copies
    (the mapping is private): the parameters change, the checkpoint does not, and the next decoding packs the new
    weights. (A model prepared for inference, as fairseq-generate and the hub prepare it, refuses to train: fairseq's
    own "cannot train after make_generation_fast".)"""
    cpp_extension()
    data, checkpoint = trained
    model, cfg, task = _load(data, checkpoint)
    before = _translate(model, cfg, task, sentences=8, prepare=False)
    weight = model.decoder.layers[0].fc1.weight
    original = weight.detach().clone()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    task.load_dataset("train")
    batch = next(iter(task.get_batch_iterator(dataset=task.dataset("train"), max_sentences=8).next_epoch_itr()))
    loss = model(**batch["net_input"])[0].float().logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    assert not torch.equal(weight.detach(), original)
    model.eval()
    after = _translate(model, cfg, task, sentences=8, prepare=False)
    assert after != before  # the runtime packed the trained weights
    reloaded = checkpoints.safe_load(str(checkpoint))["model"]
    assert torch.equal(reloaded["decoder.layers.0.fc1.weight"], original)
    model.prepare_for_inference_(cfg)
    with pytest.raises(RuntimeError, match="cannot train after make_generation_fast"):
        model.train()


def test_only_a_strict_checkpoint_load_builds_models_without_filling_their_parameters():
    """parameters_left_unset skips torch.nn.init's fills inside loading_checkpoint (fairseq_compat's
    model-built-for-its-checkpoint: strict loads only) and nowhere else; the fills come back after."""
    fills = {name: getattr(torch.nn.init, name) for name in ("normal_", "xavier_uniform_", "kaiming_uniform_", "ones_")}
    t = torch.zeros(8, 8)
    with checkpoints.parameters_left_unset():  # not loading a checkpoint: the fills run
        torch.nn.init.normal_(t)
    assert t.abs().sum() > 0
    t.zero_()
    with checkpoints.loading_checkpoint(), checkpoints.parameters_left_unset():
        for fill in ("normal_", "xavier_uniform_", "kaiming_uniform_", "ones_"):
            assert getattr(torch.nn.init, fill)(t) is t
        assert torch.nn.Linear(8, 8).weight.data_ptr() != 0
    assert t.abs().sum() == 0
    assert {name: getattr(torch.nn.init, name) for name in fills} == fills


@pytest.mark.slow
def test_fairseq_load_model_ensemble_builds_bare_only_when_strict(trained, monkeypatch):
    """The patch sets loading_checkpoint for strict loads: a non-strict one (where a missing parameter would keep
    whatever its memory held) builds the model as fairseq does, filled."""
    from fairseq import checkpoint_utils

    data, checkpoint = trained
    seen = []
    original = checkpoints.parameters_left_unset.__wrapped__

    def spy():
        seen.append(checkpoints._LOADING_CHECKPOINT.get())
        return original()

    monkeypatch.setattr(checkpoints, "parameters_left_unset", checkpoints.contextlib.contextmanager(spy))
    for strict in (True, False):
        checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)], arg_overrides={"data": str(data / "bin")},
                                                      strict=strict)
    assert seen == [True, False]
