"""configs/*.yaml (fairseq-hydra-train) and their command-line twin scripts/train.sh.

Fast tests check the files themselves: flat, complete (every model field written out), the
published hyperparameters, each RFA config and its softmax twin the same size, and train.sh
building the same fairseq arguments as the config. Slow tests train every config for 2 updates
on a tiny synthetic corpus (model shrunk by overrides, architecture kept) and inspect the
checkpoint, and check that a re-run of train.sh resumes from checkpoint_last.pt.
"""
import argparse
import os
import shlex
import subprocess
import sys
import time

import pytest
import torch
from omegaconf import OmegaConf

from conftest import PLUGIN_DIR, REPO
from tiny_models import as_flags, tiny_model_fields

import rfa_fairseq  # noqa: F401  (registers the architectures, allowlists checkpoint classes for torch.load)
from fairseq import options
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_NAME_REGISTRY
from fairseq.models.transformer import DEFAULT_MIN_PARAMS_TO_WRAP, base_architecture
from rfa_fairseq.config import RFA_DEFAULTS as _RFA_DATACLASS_DEFAULTS

BIN = os.path.dirname(sys.executable)
CONFIG_DIR = os.path.join(REPO, "configs")
TRAIN_SH = os.path.join(REPO, "scripts", "train.sh")

# The published recipes (fairseq examples/translation + scaling_nmt READMEs, Vaswani et al. 2017):
# (arch, (embed dim, ffn dim, layers, heads), dropout, lr, weight decay, max tokens, share all, languages)
RECIPES = {
    "iwslt14_de_en": ("rfa_transformer_iwslt_de_en", (512, 1024, 6, 4), 0.3, 5e-4, 1e-4, 4096, False, ("de", "en")),
    "wmt14_en_de": ("rfa_transformer_wmt_en_de", (512, 2048, 6, 8), 0.1, 7e-4, 0.0, 3584, True, ("en", "de")),
    "wmt14_en_de_big": ("rfa_transformer_vaswani_wmt_en_de_big", (1024, 4096, 6, 16), 0.3, 5e-4, 0.0, 3584, True, ("en", "de")),
    "wmt14_en_fr_big": ("rfa_transformer_vaswani_wmt_en_fr_big", (1024, 4096, 6, 16), 0.1, 5e-4, 0.0, 3584, True, ("en", "fr")),
    "multi30k_en_de": ("rfa_transformer", (256, 1024, 3, 4), 0.3, 5e-4, 1e-4, 4096, True, ("en", "de")),
    "multi30k_en_fr": ("rfa_transformer", (256, 1024, 3, 4), 0.3, 5e-4, 1e-4, 4096, True, ("en", "fr")),
}
CONFIGS = [name + suffix for name in RECIPES for suffix in ("", "_softmax")]
RFA_DEFAULTS = {k: v for k, v in _RFA_DATACLASS_DEFAULTS.items() if k.startswith("rfa_")}  # not "_name"
SIZE_FIELDS = [f"{side}_{f}" for side in ("encoder", "decoder") for f in ("embed_dim", "ffn_embed_dim", "layers", "attention_heads")]


def load(config_name):
    return OmegaConf.to_container(OmegaConf.load(os.path.join(CONFIG_DIR, config_name + ".yaml")), resolve=False)


def recipe_of(config_name):
    return config_name[: -len("_softmax")] if config_name.endswith("_softmax") else config_name


def is_rfa(config_name):
    return not config_name.endswith("_softmax")


def base_architecture_fields():
    ns = argparse.Namespace()
    base_architecture(ns)
    return set(vars(ns)) | {"max_source_positions", "max_target_positions"}


def env():
    return dict(os.environ, OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + os.environ.get("PATH", ""))


# ------------------------------------------------------------------ the files


def test_one_config_per_recipe_and_model():
    assert sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml")) == sorted(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_is_flat_and_lists_every_model_field(name):
    cfg = load(name)
    assert "defaults" not in cfg, "a defaults list interferes with fairseq-hydra-train's own defaults"
    assert cfg["task"]["data"] == "???" and "user_dir" not in cfg.get("common", {}), "machine paths belong on the command line"
    assert cfg["hydra"]["job"]["chdir"] is False and cfg["hydra"]["run"]["dir"] == "${checkpoint.save_dir}"
    assert cfg["checkpoint"]["save_dir"] == f"checkpoints/{name}"
    model = cfg["model"]
    missing = base_architecture_fields() - set(model)
    assert not missing, f"model fields left to the architecture function: {sorted(missing)}"
    rfa_fields = {k for k in model if k.startswith("rfa_")}
    if is_rfa(name):
        assert rfa_fields == set(RFA_DEFAULTS)
        assert ARCH_MODEL_NAME_REGISTRY[model["_name"]] == "rfa_transformer"
    else:
        assert not rfa_fields
        assert ARCH_MODEL_NAME_REGISTRY[model["_name"]] == "transformer"
    for key, value in model.items():  # a null would hide an architecture default (not a plugin option's own null)
        if value is None:
            assert key.endswith(("_path", "_to_keep", "_cutoff")) or (key in RFA_DEFAULTS and RFA_DEFAULTS[key] is None), key


@pytest.mark.parametrize("recipe", RECIPES)
def test_published_hyperparameters(recipe):
    arch, (dim, ffn, layers, heads), dropout, lr, wd, max_tokens, share_all, (src, tgt) = RECIPES[recipe]
    cfg = load(recipe)
    model = cfg["model"]
    assert model["_name"] == arch
    assert [model[f] for f in SIZE_FIELDS] == [dim, ffn, layers, heads] * 2
    assert model["decoder_input_dim"] == model["decoder_output_dim"] == dim
    assert model["dropout"] == dropout and model["attention_dropout"] == 0.0
    assert model["share_all_embeddings"] is share_all and model["share_decoder_input_output_embed"] is True
    assert {k: model[k] for k in RFA_DEFAULTS} == RFA_DEFAULTS  # the plugin's defaults, written out
    assert cfg["optimizer"] == {**cfg["optimizer"], "_name": "adam", "adam_betas": "(0.9,0.98)", "weight_decay": wd}
    assert cfg["lr_scheduler"]["_name"] == "inverse_sqrt" and cfg["lr_scheduler"]["warmup_updates"] == 4000
    assert cfg["criterion"] == {"_name": "label_smoothed_cross_entropy", "label_smoothing": 0.1}
    assert cfg["optimization"]["lr"] == [lr] and cfg["optimization"]["clip_norm"] == 0.0
    assert cfg["dataset"]["max_tokens"] == max_tokens
    assert (cfg["task"]["source_lang"], cfg["task"]["target_lang"]) == (src, tgt)
    assert cfg["common"]["fp16"] is recipe.startswith("wmt")


@pytest.mark.parametrize("recipe", [r for r in RECIPES if RECIPES[r][0] != "rfa_transformer"])
def test_sizes_are_those_of_the_named_architecture(recipe):
    model = load(recipe)["model"]
    for name in (model["_name"], load(recipe + "_softmax")["model"]["_name"]):
        ns = argparse.Namespace()
        ARCH_CONFIG_REGISTRY[name](ns)
        assert {f: getattr(ns, f) for f in SIZE_FIELDS} == {f: model[f] for f in SIZE_FIELDS}, name


@pytest.mark.parametrize("recipe", RECIPES)
def test_softmax_twin_differs_only_in_attention(recipe):
    rfa, softmax = load(recipe), load(recipe + "_softmax")
    assert softmax["model"]["_name"] == rfa["model"]["_name"].replace("rfa_", "", 1)
    strip = lambda model: {k: v for k, v in model.items() if k != "_name" and not k.startswith("rfa_")}  # noqa: E731
    assert strip(rfa["model"]) == strip(softmax["model"])
    others = lambda cfg: {k: v for k, v in cfg.items() if k not in ("model", "checkpoint")}  # noqa: E731
    assert others(rfa) == others(softmax)


# ------------------------------------------------------------------ train.sh (no training)


@pytest.fixture
def fake_data(tmp_path):
    """What train.sh checks for; fairseq's argument parser never opens it."""
    for name in ("dict.src.txt", "dict.tgt.txt", "train.src-tgt.src.idx", "valid.src-tgt.src.idx"):
        (tmp_path / name).write_text("")
    return tmp_path


TRAIN_SH_VARIABLES = ("DATA", "RECIPE", "MODEL", "ARCH", "SAVE_DIR", "SRC_LANG", "TGT_LANG", "MAX_UPDATE",
                      "MAX_TIME_HOURS", "UPDATE_FREQ", "FP16", "USER_DIR", "DRY_RUN")


def train_sh(*args, check=True, cwd=None, **variables):
    base = {k: v for k, v in env().items() if k not in TRAIN_SH_VARIABLES}  # only what the test sets
    proc = subprocess.run(["bash", TRAIN_SH, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env={**base, **{k: str(v) for k, v in variables.items()}}, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.sh failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.mark.parametrize("name", CONFIGS)
def test_train_sh_builds_the_config(name, fake_data):
    """fairseq-train's parse of train.sh's command == every value in the config."""
    command = train_sh(DRY_RUN=1, DATA=fake_data, SRC_LANG="src", TGT_LANG="tgt", RECIPE=recipe_of(name),
                       MODEL="rfa" if is_rfa(name) else "softmax").stdout
    argv = shlex.split(command)
    assert argv[0] == "fairseq-train" and argv[argv.index("--user-dir") + 1] == PLUGIN_DIR
    args = options.parse_args_and_arch(options.get_training_parser(), argv[1:])
    # set by TransformerModel.build_model, not by the parser or the architecture function
    args.min_params_to_wrap = getattr(args, "min_params_to_wrap", DEFAULT_MIN_PARAMS_TO_WRAP)
    cfg = load(name)
    cfg["task"].update(data=str(fake_data), source_lang="src", target_lang="tgt")
    if cfg["common"]["fp16"] and not torch.cuda.is_available():  # train.sh trains in fp32 where no GPU is
        cfg["common"]["fp16"] = False
    del cfg["hydra"]
    cfg["common"]["user_dir"] = PLUGIN_DIR
    name_fields = {"task": "task", "model": "arch", "criterion": "criterion", "optimizer": "optimizer",
                   "lr_scheduler": "lr_scheduler"}
    mismatches = []
    for section, values in cfg.items():
        for key, value in values.items():
            attr = name_fields[section] if key == "_name" else key
            got = getattr(args, attr, "<missing>")
            if got != value:
                mismatches.append(f"{section}.{key}: config {value!r}, train.sh {got!r}")
    assert not mismatches, "\n".join(mismatches)


def test_train_sh_trains_a_wmt_recipe_in_fp16_only_where_cuda_is(fake_data):
    """The WMT recipes train in fp16 on a GPU; where torch sees none, in fp32 with a line saying so, and FP16=1 is an
    error naming FP16=0 (fairseq's fp16 training on the CPU dies in torch)."""
    common = dict(DRY_RUN=1, DATA=fake_data, SRC_LANG="src", TGT_LANG="tgt", RECIPE="wmt14_en_de", MODEL="rfa")
    default = train_sh(**common)
    if torch.cuda.is_available():
        assert "--fp16" in shlex.split(default.stdout) and "trains in fp32" not in default.stderr
        return
    assert "--fp16" not in shlex.split(default.stdout)
    assert "torch sees no CUDA GPU: RECIPE=wmt14_en_de trains in fp32, not its fp16" in default.stderr
    insisted = train_sh(FP16=1, check=False, **common)
    assert insisted.returncode == 1 and insisted.stdout == ""
    assert "FP16=1 trains in fp16, which needs a CUDA GPU, and torch sees none here: set FP16=0" in insisted.stderr
    assert "--fp16" not in shlex.split(train_sh(FP16=0, **common).stdout)


def test_train_sh_bf16_trains_through_rfa_train(fake_data):
    """fairseq-train reads --bf16 as a TPU run: train.sh hands such a run to rfa_fairseq.cli.train (rfa-train),
    which keeps every other argument; without --bf16 the command is fairseq-train's."""
    common = dict(DRY_RUN=1, DATA=fake_data, SRC_LANG="src", TGT_LANG="tgt", RECIPE="multi30k_en_de", MODEL="rfa")
    plain = shlex.split(train_sh(**common).stdout)
    bf16 = shlex.split(train_sh("--bf16", **common).stdout)
    assert plain[0] == "fairseq-train"
    start = bf16.index("-m")
    assert bf16[0] == "env" and bf16[1] == f"PYTHONPATH={os.path.dirname(PLUGIN_DIR)}" + (
        f":{os.environ['PYTHONPATH']}" if os.environ.get("PYTHONPATH") else "")
    assert bf16[start + 1] == "rfa_fairseq.cli.train" and bf16[start + 2:] == plain[1:] + ["--bf16"]


def test_train_sh_runs_to_its_end_when_edited_while_it_runs(fake_data, tmp_path):
    """A study's trainings run train.sh for an hour; an edit of the file meanwhile must not change or break
    the runs (bash reads a plain script as it goes: an edit used to end them with a syntax error)."""
    script = tmp_path / "scripts" / "train.sh"
    script.parent.mkdir()
    script.write_text(open(TRAIN_SH).read())
    stub = tmp_path / "bin" / "fairseq-train"  # stands in for training: long enough to edit the script under it
    stub.parent.mkdir()
    stub.write_text("#!/usr/bin/env bash\nsleep 3\necho stub-trained\n")
    stub.chmod(0o755)
    base = {k: v for k, v in env().items() if k not in TRAIN_SH_VARIABLES}
    variables = dict(DATA=fake_data, SRC_LANG="src", TGT_LANG="tgt", RECIPE="multi30k_en_de", MODEL="rfa",
                     USER_DIR=PLUGIN_DIR, SAVE_DIR=tmp_path / "save", CHECK_DATA=0)
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**base, **{k: str(v) for k, v in variables.items()},
                                 "PATH": f"{stub.parent}{os.pathsep}{base['PATH']}"})
    deadline = time.time() + 60
    while not (tmp_path / "save" / "train.log").exists() and time.time() < deadline:
        time.sleep(0.05)
    # an edit that leaves text after the point bash has read to (here: a line with an open quote)
    script.write_text(open(TRAIN_SH).read() + 'echo "an edit\n')
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "stub-trained" in out, (proc.returncode, out[-2000:], err[-2000:])


def test_train_sh_clear_errors(fake_data, tmp_path):
    cases = [
        ({}, "DATA is not set"),
        ({"DATA": tmp_path / "nowhere"}, "does not exist"),
        ({"DATA": fake_data}, "no dictionary"),  # the iwslt14 recipe wants dict.de.txt
        ({"DATA": fake_data, "SRC_LANG": "src", "TGT_LANG": "xx"}, "dict.xx.txt"),
        ({"DATA": fake_data, "RECIPE": "wmt15"}, "unknown RECIPE"),
        ({"DATA": fake_data, "MODEL": "performer"}, "unknown MODEL"),
    ]
    for variables, message in cases:
        proc = train_sh(check=False, **variables)
        assert proc.returncode == 1 and message in proc.stderr, (variables, proc.returncode, proc.stderr)
    os.remove(fake_data / "valid.src-tgt.src.idx")
    proc = train_sh(check=False, DATA=fake_data, SRC_LANG="src", TGT_LANG="tgt")
    assert proc.returncode == 1 and "no 'valid' split" in proc.stderr


# ------------------------------------------------------------------ real training, 2 updates


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    subprocess.run([sys.executable, os.path.join(REPO, "data-prep", "make_synthetic_corpus.py"), root / "raw",
                    "--train", "500", "--valid", "50", "--test", "50"], check=True, capture_output=True)
    subprocess.run([os.path.join(BIN, "fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
                    "--trainpref", root / "raw/train", "--validpref", root / "raw/valid", "--testpref", root / "raw/test",
                    "--destdir", root / "bin", "--joined-dictionary", "--workers", "1"],
                   check=True, capture_output=True, env=env())
    return root / "bin"


# Small enough that the big configs cost no more than the others; every other field stays.
TINY_FIELDS = tiny_model_fields(embed_dim=32, ffn_dim=64, heads=2, encoder_layers=1, decoder_layers=2)
TINY = {**TINY_FIELDS, "decoder_input_dim": 32, "decoder_output_dim": 32}
TINY_RFA = {"rfa_num_features": 8}
RUN = {"task.source_lang": "src", "task.target_lang": "tgt", "common.fp16": False, "common.log_interval": 1,
       "optimization.max_update": 2, "dataset.max_tokens": 1000, "dataset.num_workers": 0}


def check_model(state, model_cfg, rfa):
    sd = state["model"]
    layers = lambda side: {k.split(".")[2] for k in sd if k.startswith(f"{side}.layers.")}  # noqa: E731
    assert len(layers("encoder")) == model_cfg["encoder_layers"] and len(layers("decoder")) == model_cfg["decoder_layers"]
    assert sd["encoder.embed_tokens.weight"].shape[1] == model_cfg["encoder_embed_dim"]
    shared = torch.equal(sd["encoder.embed_tokens.weight"], sd["decoder.embed_tokens.weight"])
    assert shared is model_cfg["share_all_embeddings"]
    assert torch.equal(sd["decoder.output_projection.weight"], sd["decoder.embed_tokens.weight"]) is \
        model_cfg["share_decoder_input_output_embed"]
    random = sorted(k for k in sd if k.endswith("eval_random_matrix"))
    if not rfa:
        assert not random
        return
    heads = model_cfg["decoder_attention_heads"]
    roles = ("self_attn",) if model_cfg["rfa_softmax_cross_attn"] else ("encoder_attn", "self_attn")
    expected = [f"decoder.layers.{i}.{a}.eval_random_matrix" for i in range(model_cfg["decoder_layers"])
                for a in roles]  # encoder self-attention stays softmax
    assert random == expected
    assert sd[expected[0]].shape == (heads, model_cfg["rfa_num_features"], model_cfg["decoder_embed_dim"] // heads)


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_config_trains_and_builds_what_it_says(name, data, tmp_path):
    rfa = is_rfa(name)
    model_overrides = {**TINY, **(TINY_RFA if rfa else {})}
    # relative paths: the configs keep Hydra from changing the working directory (hydra.job.chdir)
    overrides = {**RUN, "task.data": os.path.relpath(data, tmp_path), "common.user_dir": PLUGIN_DIR,
                 "checkpoint.save_dir": "ckpt", **{f"model.{k}": v for k, v in model_overrides.items()}}
    argv = [os.path.join(BIN, "fairseq-hydra-train"), "--config-dir", CONFIG_DIR, "--config-name", name,
            *(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items())]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=600)
    log = proc.stdout + proc.stderr
    hint = ""
    if "invalid argument rfa_" in log:
        hint = ("\nrfa_* fields lost under Hydra: TransformerConfig.from_namespace copies only its own fields "
                "from a DictConfig; RFATransformerModel.build_model must convert it to a Namespace first")
    assert proc.returncode == 0 and "done training" in log, log[-5000:] + hint

    checkpoint = tmp_path / "ckpt" / "checkpoint_last.pt"
    assert checkpoint.is_file() and (tmp_path / "ckpt" / ".hydra" / "config.yaml").is_file()
    state = torch.load(checkpoint)  # weights_only: the plugin import allowlisted fairseq's classes
    assert state["optimizer_history"][-1]["num_updates"] == 2
    saved = state["cfg"]
    cfg = load(name)
    expected_model = {**cfg["model"], **model_overrides}
    assert {k: saved["model"].get(k, "<missing>") for k in expected_model} == expected_model
    for section in ("optimizer", "lr_scheduler", "criterion", "optimization", "dataset", "common"):
        for key, value in cfg[section].items():
            if f"{section}.{key}" not in overrides:
                assert saved[section][key] == value, f"{section}.{key}"
    check_model(state, expected_model, rfa)


@pytest.mark.slow
def test_an_fp16_config_without_cuda_stops_naming_common_fp16_false(data, tmp_path):
    """A WMT config (common.fp16: true) under fairseq-hydra-train where torch sees no GPU: one clear error before the
    trainer is built (fairseq_compat's fp16-needs-cuda), not torch's "Torch not compiled with CUDA enabled"."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the config trains in fp16")
    overrides = {**RUN, "common.fp16": True, "task.data": os.path.relpath(data, tmp_path),
                 "common.user_dir": PLUGIN_DIR, "checkpoint.save_dir": "ckpt",
                 **{f"model.{k}": v for k, v in {**TINY, **TINY_RFA}.items()}}
    argv = [os.path.join(BIN, "fairseq-hydra-train"), "--config-dir", CONFIG_DIR, "--config-name", "wmt14_en_de",
            *(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items())]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert "fp16 training needs a CUDA GPU, and torch sees none here: train in fp32 with common.fp16=false" in log, \
        log[-3000:]
    assert "FP16=0 (scripts/train.sh)" in log and "Torch not compiled with CUDA" not in log
    assert not (tmp_path / "ckpt" / "checkpoint_last.pt").exists()


@pytest.mark.slow
def test_train_sh_trains_and_resumes(data, tmp_path):
    save_dir = tmp_path / "ckpt"
    tiny = [*as_flags(TINY_FIELDS), "--rfa-num-features", 8, "--max-tokens", 1000, "--num-workers", 0]
    variables = dict(DATA=data, SRC_LANG="src", TGT_LANG="tgt", RECIPE="iwslt14_de_en", MODEL="rfa", SAVE_DIR=save_dir)

    first = train_sh(*tiny, MAX_UPDATE=2, **variables).stdout
    assert "done training" in first and "Loaded checkpoint" not in first and "resuming" not in first
    state = torch.load(save_dir / "checkpoint_last.pt")
    assert state["optimizer_history"][-1]["num_updates"] == 2
    saved_model = state["cfg"]["model"]  # an argparse.Namespace for fairseq-train runs
    assert saved_model.arch == "rfa_transformer_iwslt_de_en" and saved_model.share_decoder_input_output_embed

    second = train_sh(*tiny, MAX_UPDATE=4, **variables).stdout
    assert f"resuming from {save_dir}/checkpoint_last.pt" in second
    assert f"Loaded checkpoint {save_dir}/checkpoint_last.pt (epoch 1 @ 2 updates)" in second
    assert torch.load(save_dir / "checkpoint_last.pt")["optimizer_history"][-1]["num_updates"] == 4
    log = (save_dir / "train.log").read_text()
    assert log.count("done training") == 2 and "Loaded checkpoint" in log
