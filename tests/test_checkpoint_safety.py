"""Checkpoints are read with torch's weights_only unpickler only: a pickled object that a fairseq
checkpoint does not contain is refused with a message naming the file and the class (and its code
never runs), while real fairseq/rfa_fairseq checkpoints from many kinds of runs load."""
import argparse
import os
import pickle

import pytest
import torch
from cli_support import TINY_MODEL, TINY_TRAIN, assert_exit_code, run, synthetic_data
from conftest import PLUGIN_DIR
from tiny_models import tiny_model_fields

import rfa_fairseq  # noqa: F401  (allowlists the checkpoint classes, installs the fairseq wrappers)
from fairseq import checkpoint_utils
from rfa_fairseq.checkpoints import (
    FAIRSEQ_CHECKPOINT_CLASSES,
    PLUGIN_MARKER_KEY,
    CheckpointLoadError,
    safe_load,
)


class Payload:
    """An arbitrary user class: nothing a checkpoint needs."""

    def __init__(self):
        self.value = 1


class RunsCommand:
    """The classic pickle attack: unpickling calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def fairseq_like_checkpoint(path, extra):
    state = {"args": None, "cfg": {"model": argparse.Namespace(arch="transformer", _name="transformer")},
             "model": {"encoder.weight": torch.zeros(2, 2)}, "optimizer_history": [{"num_updates": 0}],
             "extra_state": {"train_iterator": {"epoch": 1}, "payload": extra}}
    torch.save(state, path)
    return path


def payloads(tmp_path):
    marker = tmp_path / "pwned"
    return {
        "custom_class": (Payload(), f"{Payload.__module__}.Payload", marker),
        "os_system": (RunsCommand(marker), f"{os.system.__module__}.system", marker),
    }


@pytest.mark.parametrize("kind", ["custom_class", "os_system"])
def test_pickled_payload_is_refused_with_file_and_class(tmp_path, kind):
    payload, class_name, marker = payloads(tmp_path)[kind]
    path = fairseq_like_checkpoint(tmp_path / "evil.pt", payload)
    expected = f"refusing to load checkpoint {path}: it pickles {class_name}, which a fairseq/rfa_fairseq checkpoint does not contain"
    with pytest.raises(CheckpointLoadError) as ours:
        safe_load(str(path))
    assert str(ours.value).startswith(expected), str(ours.value)
    # fairseq's own loader (fairseq-train --restore-file/--finetune-from-model, fairseq-generate, ...)
    with pytest.raises(CheckpointLoadError) as fairseqs:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert str(fairseqs.value).startswith(expected)
    assert isinstance(fairseqs.value, pickle.UnpicklingError)  # handlers of torch's own error still apply
    # plain torch.load is still refused too: the plugin allowlisted nothing beyond fairseq's classes
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(path)
    assert not marker.exists(), "the payload ran"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic_data(tmp_path_factory)


@pytest.mark.slow
def test_fairseq_generate_refuses_a_payload_checkpoint(data, tmp_path):
    payload, class_name, marker = payloads(tmp_path)["os_system"]
    path = fairseq_like_checkpoint(tmp_path / "evil.pt", payload)
    proc = run("fairseq-generate", data / "bin", "--user-dir", PLUGIN_DIR, "--path", path, "--gen-subset", "test",
               "--required-batch-size-multiple", "1", "--cpu", check=False)
    assert_exit_code(proc, 1)
    assert f"CheckpointLoadError: refusing to load checkpoint {path}: it pickles {class_name}" in proc.stderr
    assert not marker.exists(), "the payload ran"


def allowlisted_names():
    names = set()
    for entry in FAIRSEQ_CHECKPOINT_CLASSES:
        obj, name = entry if isinstance(entry, tuple) else (entry, None)
        names.add(name or f"{obj.__module__}.{obj.__qualname__}")
    return names


def globals_needed(path):
    """Classes the checkpoint pickles that torch does not allow by default."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        return set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    finally:
        torch.serialization.add_safe_globals(saved)


# the CLI tests' model (tiny_models.CLI_TINY_MODEL) as YAML fields
HYDRA_TINY_MODEL = ", ".join(f"{name}: {value}" for name, value in
                             tiny_model_fields(embed_dim=16, ffn_dim=32, heads=2, encoder_layers=1, decoder_layers=1).items())
HYDRA_CONFIG = """
common: {{seed: 3, cpu: true, log_format: simple, log_interval: 1, user_dir: {plugin}}}
task: {{_name: translation, data: {data}, source_lang: src, target_lang: tgt}}
model: {{_name: rfa_transformer, {tiny_model}, share_all_embeddings: true, rfa_num_features: 8}}
criterion: {{_name: label_smoothed_cross_entropy, label_smoothing: 0.1}}
optimizer: {{_name: adam}}
lr_scheduler: {{_name: fixed}}
optimization: {{max_update: 2, lr: [0.001]}}
dataset: {{max_tokens: 500, num_workers: 0}}
checkpoint: {{save_dir: {save_dir}, no_epoch_checkpoints: true}}
hydra: {{run: {{dir: .}}, job: {{chdir: false}}}}
"""


@pytest.mark.slow
def test_checkpoints_of_many_kinds_of_runs_load_and_need_only_the_allowlist(data, tmp_path):
    common = [data / "bin", "--user-dir", PLUGIN_DIR, *TINY_MODEL, *TINY_TRAIN, "--max-update", "3",
              "--no-epoch-checkpoints", "--log-format", "simple"]
    runs = {
        # --eval-bleu stores sacrebleu's n-gram counts as numpy arrays in the checkpoint's meters
        "rfa_amp_bleu_best": ["--arch", "rfa_transformer", "--rfa-num-features", "8", "--amp", "--eval-bleu",
                              "--eval-bleu-args", '{"beam": 1, "max_len_b": 10}', "--best-checkpoint-metric", "bleu",
                              "--maximize-best-checkpoint-metric", "--keep-best-checkpoints", "1"],
        "transformer_adafactor_ema": ["--arch", "transformer", "--optimizer", "adafactor", "--lr", "1e-3",
                                      "--ema-decay", "0.99", "--store-ema", "--lr-scheduler", "cosine",
                                      "--warmup-updates", "1"],
        "rfa_gated_sgd_plateau": ["--arch", "rfa_transformer", "--rfa-num-features", "8", "--rfa-gate",
                                  "--optimizer", "nag", "--lr", "1e-3", "--lr-scheduler", "reduce_lr_on_plateau"],
    }
    checkpoints = {}
    for name, flags in runs.items():
        run("fairseq-train", *common, *flags, "--save-dir", tmp_path / name)
        checkpoints[name] = sorted((tmp_path / name).glob("*.pt"))
    config_dir = tmp_path / "hydra"
    config_dir.mkdir()
    (config_dir / "tiny.yaml").write_text(HYDRA_CONFIG.format(plugin=PLUGIN_DIR, data=data / "bin",
                                                              save_dir=tmp_path / "hydra_rfa", tiny_model=HYDRA_TINY_MODEL))
    run("fairseq-hydra-train", "--config-dir", config_dir, "--config-name", "tiny", cwd=tmp_path)
    checkpoints["hydra_rfa"] = sorted((tmp_path / "hydra_rfa").glob("*.pt"))

    needed_anywhere = set()
    for name, paths in checkpoints.items():
        assert paths, f"{name} wrote no checkpoint"
        for path in paths:
            needed = globals_needed(path)
            needed_anywhere |= needed
            assert needed <= allowlisted_names(), f"{path} needs {needed - allowlisted_names()}"
            state = safe_load(str(path))
            is_rfa = name.startswith(("rfa", "hydra_rfa"))
            # rfa_* checkpoints start with the marker that names the plugin when it is missing
            assert (next(iter(state)) == PLUGIN_MARKER_KEY) is is_rfa, f"{path}: first key {next(iter(state))}"
            loaded = checkpoint_utils.load_checkpoint_to_cpu(str(path))
            assert loaded["optimizer_history"][-1]["num_updates"] == (2 if name == "hydra_rfa" else 3)
    # every allowlisted class is used by some checkpoint (numpy's dtype classes arrive by REDUCE,
    # so get_unsafe_globals lists numpy.dtype rather than numpy.dtypes.Int64DType)
    assert {"argparse.Namespace", "rfa_fairseq.checkpoint_safety.NeedsUserDirRfaFairseq",
            "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype"} <= needed_anywhere

    # fp16/bf16 runs (GPU-only in fairseq 0.12.3) store half-precision tensors and a float
    # "loss_scale" in the optimizer state; nothing beyond the allowlist either
    state = safe_load(str(checkpoints["rfa_amp_bleu_best"][0]))
    for dtype in (torch.float16, torch.bfloat16):
        state["model"] = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state["model"].items()}
        state["last_optimizer_state"]["loss_scale"] = 128.0
        half = tmp_path / f"half_{dtype}.pt"
        torch.save(state, half)
        assert globals_needed(half) <= allowlisted_names()
        assert checkpoint_utils.load_checkpoint_to_cpu(str(half))["model"]["decoder.embed_tokens.weight"].dtype == dtype
