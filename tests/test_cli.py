"""End to end through the real CLIs: preprocess -> train -> generate / interactive -> sacrebleu."""
import pytest
import sacrebleu
from cli_support import assert_exit_code, run, synthetic_data
from conftest import PLUGIN_DIR
from tiny_models import tiny_model_flags

TINY_MODEL = tiny_model_flags(embed_dim=32, ffn_dim=64, heads=2, encoder_layers=1, decoder_layers=2)
TRAIN = [
    "--optimizer", "adam", "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "2000", "--num-workers", "0", "--seed", "3", "--no-epoch-checkpoints",
    "--log-format", "simple", "--log-interval", "5",
]


def hypotheses(generate_stdout):
    rows = [line.split("\t") for line in generate_stdout.splitlines() if line.startswith("H-")]
    return [text for _, text in sorted((int(r[0][2:]), r[2]) for r in rows)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """This module's work directory (checkpoints, hypotheses) over the session's shared corpus."""
    corpus = synthetic_data(tmp_path_factory)
    root = tmp_path_factory.mktemp("cli")
    for name in ("raw", "bin"):
        (root / name).symlink_to(corpus / name, target_is_directory=True)
    return root


def train(data, name, arch_flags, updates=12):
    save_dir = data / name
    run("fairseq-train", data / "bin", "--user-dir", PLUGIN_DIR, *arch_flags, *TINY_MODEL, *TRAIN,
        "--max-update", updates, "--save-dir", save_dir)
    return save_dir / "checkpoint_last.pt"


def generate(data, checkpoint, *extra):
    return run("fairseq-generate", data / "bin", "--user-dir", PLUGIN_DIR, "--path", checkpoint,
               "--gen-subset", "test", "--beam", "4", "--batch-size", "16", "--max-len-b", "30",
               "--required-batch-size-multiple", "1", *extra).stdout


@pytest.mark.slow
@pytest.mark.parametrize("gate", [False, True], ids=["ungated", "gated"])
def test_train_generate_score(data, gate):
    flags = ["--arch", "rfa_transformer", "--rfa-num-features", "16", "--rfa-gate" if gate else "--no-rfa-gate"]
    checkpoint = train(data, f"rfa_{'gated' if gate else 'ungated'}", flags)
    out = generate(data, checkpoint)
    hyps = hypotheses(out)
    refs = (data / "raw/test.tgt").read_text().splitlines()
    assert len(hyps) == len(refs) == 40
    # a second generate run from the same checkpoint gives identical hypotheses
    assert hypotheses(generate(data, checkpoint)) == hyps
    hyp_file = data / f"hyp_{gate}.txt"
    hyp_file.write_text("\n".join(hyps) + "\n")
    score = run("sacrebleu", data / "raw/test.tgt", "-i", hyp_file, "-m", "bleu", "-b").stdout.strip()
    # sacrebleu's command line scores these hypotheses as its library does (fairseq's output was read back whole)
    assert float(score) == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 1), score


@pytest.mark.slow
def test_interactive_and_plain_transformer_checkpoint(data):
    checkpoint = train(data, "rfa_interactive", ["--arch", "rfa_transformer", "--rfa-feature-map", "positive"], updates=6)
    out = run("fairseq-interactive", data / "bin", "--user-dir", PLUGIN_DIR, "--path", checkpoint,
              "--source-lang", "src", "--target-lang", "tgt", "--beam", "4", "--max-len-b", "20",
              stdin="the red cat sees\na dog likes the bird\n").stdout
    assert sum(line.startswith("H-") for line in out.splitlines()) == 2

    # a plain fairseq transformer checkpoint also loads (and decodes) with the plugin loaded
    softmax = train(data, "softmax", ["--arch", "transformer"], updates=3)
    assert len(hypotheses(generate(data, softmax))) == 40


def valid_losses(log_text):
    """The `loss` of every "valid on 'valid' subset" line of a fairseq log, in order."""
    return [float(line.split("| loss ")[1].split(" ")[0]) for line in log_text.splitlines() if "valid on 'valid'" in line]


@pytest.mark.slow
def test_every_validation_of_a_training_run_scores_the_current_weights(data):
    """fairseq-train validates in eval mode without autograd, where the encoder runs on packed weights
    (its native pass), and fairseq's Adam updates the weights through .data between validations: each logged
    valid loss must be the model's at that update, so the last one is fairseq-validate's on the checkpoint saved
    with it (the loss of stale packed weights differs by far more than the log's rounding)."""
    save_dir = data / "validate_every_4"
    proc = run("fairseq-train", data / "bin", "--user-dir", PLUGIN_DIR, "--arch", "rfa_transformer", *TINY_MODEL,
               *TRAIN, "--max-update", "12", "--validate-interval-updates", "4", "--save-dir", save_dir)
    logged = valid_losses(proc.stdout + proc.stderr)
    assert len(logged) >= 3 and logged[0] != logged[-1], logged
    proc = run("fairseq-validate", data / "bin", "--user-dir", PLUGIN_DIR, "--path", save_dir / "checkpoint_last.pt",
               "--task", "translation", "--valid-subset", "valid", "--max-tokens", "2000", "--num-workers", "0")
    (validated,) = valid_losses(proc.stdout + proc.stderr)
    assert validated == pytest.approx(logged[-1], abs=2e-3), (validated, logged)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags,code,message",
    [
        (["--rfa-feature-map", "gaussian"], 2, "--rfa-feature-map: invalid choice"),
        (["--rfa-num-features", "0"], 2, "argument --rfa-num-features: must be a positive integer, got 0"),
        (["--rfa-chunk-size", "-1"], 2, "argument --rfa-chunk-size: must be a positive integer, got -1"),
        (["--cross-self-attention"], 1, "--cross-self-attention contradicts RFA"),
    ],
)
def test_bad_flags_fail_before_training(data, flags, code, message, tmp_path):
    proc = run("fairseq-train", data / "bin", "--user-dir", PLUGIN_DIR, "--arch", "rfa_transformer", *TINY_MODEL,
               *TRAIN, "--max-update", "2", "--save-dir", tmp_path / "ckpt", *flags, check=False)
    assert_exit_code(proc, code)  # 2: argparse, 1: our check when the model is built
    assert message in proc.stderr
    assert "begin training" not in proc.stdout + proc.stderr
    assert not list(tmp_path.glob("ckpt/*.pt"))
