"""Bad input gets a clear error naming the flag, file or line: contradictory RFA flags, an RFA
checkpoint loaded without the plugin, a checkpoint loaded with other RFA options than it was trained
with, and broken parallel data (rfa-check-data, also run by scripts/train.sh)."""
import os
import shutil
import subprocess

import pytest
import torch
from cli_support import BIN, REPO, TINY_MODEL, TINY_TRAIN, assert_exit_code, env, run, synthetic_data
from conftest import PLUGIN_DIR
from helpers import build_model, make_dictionary

import rfa_fairseq  # noqa: F401
from fairseq import checkpoint_utils
from rfa_fairseq.cli import check_data
from rfa_fairseq.checkpoints import CheckpointLoadError, safe_load
from rfa_fairseq.config import RFAOptionMismatchError

# ---------------------------------------------------------------- flags


def test_temperature_with_arccos_is_rejected_before_building():
    with pytest.raises(ValueError) as error:
        build_model(["--rfa-feature-map", "arccos", "--rfa-temperature", "2"])
    assert str(error.value) == (
        "--rfa-temperature=2.0 has no effect with --rfa-feature-map=arccos (the arc-cosine kernel is "
        "scale-invariant for the uniform initial sigma); drop it or use sincos/positive")
    build_model(["--rfa-feature-map", "arccos"])  # the default temperature is fine


# ---------------------------------------------------------------- checkpoints vs. RFA options


@pytest.mark.parametrize(
    "trained,requested,message",
    [
        (["--rfa-num-features", "8", "--no-rfa-softmax-cross-attn"], ["--rfa-num-features", "16", "--no-rfa-softmax-cross-attn"],
         "--rfa-num-features: the checkpoint was trained with 8, the model was built with 16 "
         "(decoder.layers.0.encoder_attn.eval_random_matrix: (4, 8, 8) vs (4, 16, 8))"),
        ([], ["--no-rfa-gate"], "--rfa-gate: the checkpoint was trained with it, the model was built without it"),
        ([], ["--rfa-encoder-self-attn"],
         "--rfa-encoder-self-attn: the checkpoint was trained without it, the model was built with it"),
        ([], ["--no-rfa-softmax-cross-attn"],
         "--rfa-softmax-cross-attn: the checkpoint was trained with it, the model was built without it"),
    ],
    ids=["num_features", "gate", "encoder_self_attn", "softmax_cross_attn"],
)
def test_state_dict_from_other_rfa_options_names_the_option(trained, requested, message):
    d = make_dictionary()
    source, _ = build_model(trained, dictionary=d)
    target, _ = build_model(requested, dictionary=d)
    with pytest.raises(RFAOptionMismatchError) as error:
        target.load_state_dict(source.state_dict())
    assert str(error.value) == (
        f"the checkpoint was trained with other RFA options than this model: {message}. Use the options the "
        "checkpoint was trained with (drop them from --model-overrides or the command line).")


def test_softmax_state_dict_into_rfa_model_says_convert_first():
    d = make_dictionary()
    softmax, _ = build_model(arch="transformer", dictionary=d)
    rfa, _ = build_model(dictionary=d)
    with pytest.raises(RFAOptionMismatchError, match="it is a softmax transformer checkpoint. Convert it first: "
                                                     "rfa-convert-transformer --input CKPT --output RFA_CKPT"):
        rfa.load_state_dict(softmax.state_dict())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic_data(tmp_path_factory)


@pytest.fixture(scope="module")
def rfa_checkpoint(data, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("bad_input_ckpt")
    run("fairseq-train", data / "bin", "--user-dir", PLUGIN_DIR, "--arch", "rfa_transformer", *TINY_MODEL,
        "--rfa-num-features", "8", *TINY_TRAIN, "--max-update", "2", "--save-dir", save_dir, "--no-epoch-checkpoints")
    return save_dir / "checkpoint_last.pt"


def generate(data, checkpoint, *extra, user_dir=True):
    plugin = ["--user-dir", PLUGIN_DIR] if user_dir else []
    return run("fairseq-generate", data / "bin", *plugin, "--path", checkpoint, "--gen-subset", "test", "--beam", "2",
               "--batch-size", "16", "--required-batch-size-multiple", "1", "--cpu", *extra, check=False)


@pytest.mark.slow
def test_rfa_checkpoint_without_the_plugin_names_the_plugin(data, rfa_checkpoint):
    proc = generate(data, rfa_checkpoint, user_dir=False)
    assert_exit_code(proc, 1)
    # the only text we control in a process that never imported the plugin: the marker's name
    assert ("Unsupported global: GLOBAL rfa_fairseq.checkpoint_safety.NeedsUserDirRfaFairseq was not an allowed "
            "global by default") in proc.stderr
    assert_exit_code(generate(data, rfa_checkpoint), 0)  # with --user-dir it decodes

    # where the plugin is imported but its classes are not allowlisted, our loader says it in words
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(CheckpointLoadError) as error:
            safe_load(str(rfa_checkpoint))
    finally:
        torch.serialization.add_safe_globals(saved)
    assert str(error.value) == (f"cannot load {rfa_checkpoint}: it is an rfa_fairseq checkpoint; load this checkpoint "
                                "with --user-dir path/to/rfa_fairseq (the rfa_fairseq plugin)")


@pytest.mark.slow
def test_model_overrides_of_trained_rfa_options_are_refused(data, rfa_checkpoint):
    proc = generate(data, rfa_checkpoint, "--model-overrides", "{'rfa_num_features': 16}")
    assert_exit_code(proc, 1)
    assert (f"RFAOptionMismatchError: --model-overrides sets rfa_num_features=16, but checkpoint {rfa_checkpoint} "
            "was trained with --rfa-num-features 8 (rfa_num_features=8); its weights only work with that value. "
            "Drop rfa_num_features from --model-overrides") in proc.stderr

    # same shapes, different kernel: would decode garbage silently without the check
    # (the default hedgehog map and relu have the same (H, D, d) weight)
    with pytest.raises(RFAOptionMismatchError, match=r"--model-overrides sets rfa_feature_map='relu', but checkpoint "
                                                     r".* was trained with --rfa-feature-map hedgehog"):
        checkpoint_utils.load_model_ensemble_and_task(
            [str(rfa_checkpoint)], arg_overrides={"data": str(data / "bin"), "rfa_feature_map": "relu"})
    # options that only matter in training may be overridden
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [str(rfa_checkpoint)], arg_overrides={"data": str(data / "bin"), "rfa_chunk_size": 4})
    assert models[0].rfa_modules()[0].chunk_size == 4


@pytest.mark.slow
def test_resuming_with_other_rfa_options_names_the_option(data, rfa_checkpoint, tmp_path):
    proc = run("fairseq-train", data / "bin", "--user-dir", PLUGIN_DIR, "--arch", "rfa_transformer", *TINY_MODEL,
               "--rfa-num-features", "16", *TINY_TRAIN, "--max-update", "4", "--save-dir", tmp_path,
               "--restore-file", rfa_checkpoint, check=False)
    assert_exit_code(proc, 1)
    assert "--rfa-num-features: the checkpoint was trained with 8, the model was built with 16" in proc.stderr


# ---------------------------------------------------------------- data


def write(path, text):
    path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return path


def check(capsys, *argv):
    code = check_data.main([str(a) for a in argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "src,tgt,expected",
    [
        ("a b\n\nc\n", "x\ny\nz\n", ["{src}:2: empty line (fairseq would train on an empty sentence)"]),
        ("a b\nc\n", "x\ny\nz\n",
         ["{tgt}:3: no counterpart in {src}, which ends after 2 lines ({src}: 2 lines, {tgt}: 3 lines)"]),
        ("a\n" + "w " * 9 + "\n", "x\ny\n",
         ["{src}:2: 9 tokens (+1 end-of-sentence = 10) > --max-positions 8 (fairseq-train drops such training "
          "pairs silently and fails on validation ones)"]),
        ("a\nb\rc\n", "x\ny\n",
         ["{src}:2: carriage return (\\r) inside the line: fairseq-preprocess reads it as a line break, which "
          "shifts every later line against the other language"]),
        ("a\n", b"\xff\n", ["{tgt}:1: not valid UTF-8 (byte 0xff at column 1)"]),
    ],
    ids=["empty", "line_counts", "too_long", "carriage_return", "utf8"],
)
def test_raw_corpus_problems_name_file_and_line(tmp_path, capsys, src, tgt, expected):
    src_path, tgt_path = write(tmp_path / "train.de", src), write(tmp_path / "train.en", tgt)
    code, err = check(capsys, "raw", tmp_path / "train", "-s", "de", "-t", "en", "--max-positions", 8)
    assert code == 1
    lines = err.strip().splitlines()
    assert lines[:-1] == [e.format(src=src_path, tgt=tgt_path) for e in expected]
    assert lines[-1].startswith(f"rfa-check-data: {len(expected)} problem(s) found")


def test_clean_raw_corpus_passes(data, capsys):
    code, err = check(capsys, "raw", data / "raw/train", data / "raw/valid", "-s", "src", "-t", "tgt")
    assert code == 0 and err.strip() == (f"rfa-check-data: OK ({data / 'raw/train'}: 1500 pairs, "
                                         f"{data / 'raw/valid'}: 60 pairs)")


@pytest.fixture
def bin_copy(data, tmp_path):
    return shutil.copytree(data / "bin", tmp_path / "bin")


def test_binarized_data_problems(bin_copy, capsys):
    code, err = check(capsys, "bin", bin_copy, "-s", "src", "-t", "tgt")
    assert code == 0 and "rfa-check-data: OK (train: 1500 pairs, valid: 60 pairs, test: 40 pairs)" in err

    # a missing dictionary
    os.rename(bin_copy / "dict.tgt.txt", bin_copy / "saved.txt")
    code, err = check(capsys, "bin", bin_copy, "-s", "src", "-t", "tgt")
    assert code == 1
    assert f"{bin_copy}/dict.tgt.txt: dictionary not found (fairseq-preprocess writes dict.<lang>.txt into --destdir)" in err
    # a malformed dictionary line
    lines = (bin_copy / "saved.txt").read_text().splitlines()
    write(bin_copy / "dict.tgt.txt", "\n".join(lines[:3] + ["brokenline"] + lines[3:]) + "\n")
    code, err = check(capsys, "bin", bin_copy, "-s", "src", "-t", "tgt")
    assert f"{bin_copy}/dict.tgt.txt:4: expected '<token> <count> [#fairseq:overwrite]', got 'brokenline'" in err
    # a dictionary smaller than the one the data was binarized with
    write(bin_copy / "dict.tgt.txt", "\n".join(lines[:5]) + "\n")
    code, err = check(capsys, "bin", bin_copy, "-s", "src", "-t", "tgt")
    assert f"{bin_copy}/train.src-tgt.tgt.bin: contains token id" in err
    assert "but dict.tgt.txt gives only 9 symbols: it was binarized with another dictionary" in err
    os.replace(bin_copy / "saved.txt", bin_copy / "dict.tgt.txt")

    # too long sentences, by line of the text they came from
    code, err = check(capsys, "bin", bin_copy, "-s", "src", "-t", "tgt", "--max-positions", 12, "--max-errors", 1)
    assert code == 1
    first = err.splitlines()[0]
    assert first.startswith(f"{bin_copy}/train.src-tgt.src.bin:") and "of the text it was binarized from) has" in first
    assert f"{bin_copy}/train.src-tgt.src.bin: ... and" in err  # the rest is counted, not listed


def test_train_sh_refuses_misaligned_data_before_writing_anything(bin_copy, tmp_path):
    # the target side of 'train' replaced by another split's: fairseq-preprocess never compares sides
    for ext in ("idx", "bin"):
        shutil.copy(bin_copy / f"valid.src-tgt.tgt.{ext}", bin_copy / f"train.src-tgt.tgt.{ext}")
    save_dir = tmp_path / "checkpoints"
    proc = run("bash", os.path.join(REPO, "scripts", "train.sh"), "--max-update", "1", check=False,
               DATA=bin_copy, SRC_LANG="src", TGT_LANG="tgt", RECIPE="multi30k_en_de", SAVE_DIR=save_dir)
    assert_exit_code(proc, 1)
    assert (f"{bin_copy}/train.src-tgt.tgt.idx: 60 sentences, but {bin_copy}/train.src-tgt.src.idx has 1500: the two "
            "sides were binarized from files with different line counts") in proc.stderr
    assert f"train.sh: error: problems in DATA='{bin_copy}' (listed above)" in proc.stderr
    assert not save_dir.exists(), "nothing may be written when the data check fails"


# ---------------------------------------------------------------- files that are not what they should be


def last_line(text):
    return text.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_text_file_as_checkpoint_is_named_by_every_tool(data, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello world\n")
    expected = f"{text} is not a torch checkpoint (12 bytes, starting with 'hello world\\n'; a checkpoint written by "
    runs = {
        "fairseq-generate": generate(data, text),
        "rfa-convert-transformer": run("rfa-convert-transformer", "--input", text, "--output", tmp_path / "rfa.pt",
                                       check=False),
        "rfa-average-checkpoints": run("rfa-average-checkpoints", "--inputs", text, "--output", tmp_path / "avg.pt",
                                       check=False),
    }
    for tool, proc in runs.items():
        assert_exit_code(proc, 1)
        assert expected in last_line(proc.stderr), f"{tool}: {last_line(proc.stderr)}"
    assert not (tmp_path / "rfa.pt").exists() and not (tmp_path / "avg.pt").exists()


def test_truncated_bin_is_named_by_check_data(bin_copy, capsys):
    bin_path = bin_copy / "test.src-tgt.tgt.bin"
    size = os.path.getsize(bin_path)
    with open(bin_path, "r+b") as handle:
        handle.truncate(size - 10)
    code, err = check(capsys, "bin", bin_copy, "-s", "src", "-t", "tgt")
    assert code == 1
    assert (f"{bin_path}: {size - 10} bytes, but {bin_copy}/test.src-tgt.tgt.idx describes {size} bytes: the .bin is "
            "truncated") in err
    assert last_line(err).endswith(f"the first in {bin_path} (all listed above)")


def test_output_that_is_a_directory_is_refused(tmp_path, capsys):
    from rfa_fairseq.cli import average_checkpoints, convert

    missing = tmp_path / "missing.pt"  # never read: the output is checked first
    assert convert.main(["--input", str(missing), "--output", str(tmp_path)]) == 1
    assert last_line(capsys.readouterr().err) == (f"rfa-convert-transformer: error: --output {tmp_path} is a directory; "
                                                  f"give a file name, e.g. --output {tmp_path}/checkpoint.pt")
    assert average_checkpoints.main(["--inputs", str(missing), "--output", str(tmp_path)]) == 1
    assert last_line(capsys.readouterr().err) == (f"rfa-average-checkpoints: error: --output {tmp_path} is a directory; "
                                                  f"give a file name, e.g. --output {tmp_path}/checkpoint.pt")
    from rfa_fairseq.cli import scoring

    hyp = write(tmp_path / "hyp.txt", "a b\n")
    assert scoring.main(["--hyp", str(hyp), "--save-hyp", str(tmp_path), "--extract-only"]) == 1
    assert last_line(capsys.readouterr().err) == (f"rfa-score: error: --save-hyp {tmp_path} is a directory; give a "
                                                  f"file name, e.g. --save-hyp {tmp_path}/out.txt")


def test_unreasonable_number_of_features_is_refused_with_its_cost():
    with pytest.raises(ValueError) as error:
        build_model(["--rfa-num-features", "1000000"])
    assert str(error.value) == (
        "--rfa-num-features=1000000 is above the limit of 2048: every token would keep 2 x 1000000 fp32 features per "
        "head (30.5 MiB per token and layer with 4 heads, for queries and again for keys). The paper uses 64 and "
        "docs/quality.md finds 32 enough; pick a value <= 2048")
    build_model(["--rfa-num-features", "2048"])


# ---------------------------------------------------------------- text that is not UTF-8


def test_rfa_score_names_the_file_and_line_of_bytes_that_are_not_utf8(tmp_path, capsys):
    from rfa_fairseq.cli import scoring

    hyp, ref = write(tmp_path / "hyp.txt", b"a b\nc \xe9 d\n"), write(tmp_path / "ref.txt", "a b\nc d\n")
    assert scoring.main(["--hyp", str(hyp), "--ref", str(ref)]) == 1
    assert last_line(capsys.readouterr().err) == (
        f"rfa-score: error: hypothesis file {hyp}:2: not valid UTF-8 (byte 0xe9 at column 3): input must be UTF-8; "
        "convert the file (e.g. iconv -f latin1 -t utf-8) or list every such line with rfa-check-data raw")


@pytest.mark.slow
def test_fairseq_interactive_names_the_line_that_is_not_utf8_from_a_file_or_stdin(data, rfa_checkpoint, tmp_path):
    source = write(tmp_path / "input.src", b"w1 w2\nw3 \xff w4\n")
    common = [data / "bin", "--user-dir", PLUGIN_DIR, "--path", rfa_checkpoint, "--source-lang", "src",
              "--target-lang", "tgt", "--cpu", "--beam", "2"]
    from_file = run("fairseq-interactive", *common, "--input", source, check=False)
    # the same bytes on standard input (as bytes: run() would encode text as UTF-8)
    from_stdin = subprocess.run([os.path.join(BIN, "fairseq-interactive"), *map(str, common)], input=source.read_bytes(),
                                capture_output=True, env=env(), timeout=600)
    for proc, name in ((from_file, source), (from_stdin, "<stdin>")):
        assert_exit_code(proc, 1)
        stderr = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode("utf-8", "replace")
        assert last_line(stderr) == (
            f"rfa_fairseq.textio.InputEncodingError: {name}:2: not valid UTF-8 (byte 0xff at column 4): input must be "
            "UTF-8; convert the file (e.g. iconv -f latin1 -t utf-8) or list every such line with rfa-check-data raw")
    # valid input still translates
    ok = run("fairseq-interactive", *common, "--input", write(tmp_path / "ok.src", "w1 w2\n"))
    assert "H-0" in ok.stdout
