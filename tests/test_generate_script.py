"""End to end on a tiny synthetic Multi30k: prepare-multi30k.sh -> fairseq-train (a plain
fairseq transformer, not the RFA plugin) -> scripts/generate.sh (with checkpoint
averaging) -> scripts/score.sh."""
import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data_prep_fixtures import build_multi30k  # noqa: E402
from tiny_models import CLI_TINY_MODEL  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PYTHON_BIN = Path(sys.executable).parent

TINY_TRANSFORMER = ["--arch", "transformer", *CLI_TINY_MODEL]


def env():
    return dict(os.environ, PATH=f"{PYTHON_BIN}{os.pathsep}{os.environ.get('PATH', '')}", PYTHON=sys.executable)


def run(command, expect_ok=True):
    proc = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env(), timeout=600)
    if expect_ok:
        assert proc.returncode == 0, f"{command[:2]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def load(path):
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    build_multi30k(root / "multi30k", sizes=(300, 20, 20))
    prep = root / "prep"
    run(["bash", REPO / "data-prep" / "prepare-multi30k.sh", "--local-dir", root / "multi30k",
         "--no-checksum", "--vocab-size", "120", prep])
    checkpoints = root / "checkpoints"
    run([PYTHON_BIN / "fairseq-train", prep / "data-bin", "-s", "en", "-t", "de", *TINY_TRANSFORMER,
         "--optimizer", "adam", "--lr", "0.005", "--max-tokens", "2000", "--max-epoch", "2",
         "--save-dir", checkpoints, "--cpu", "--num-workers", "0", "--seed", "1", "--no-progress-bar"])
    return root, prep, checkpoints


@pytest.mark.slow
def test_generate_with_averaging_then_score(trained):
    root, prep, checkpoints = trained
    output = root / "results" / "test.hyp.de"
    proc = run(["bash", REPO / "scripts" / "generate.sh", "--data-bin", prep / "data-bin",
                "--checkpoint-dir", checkpoints, "--average-last", "2", "--recipe", "multi30k",
                "--no-user-dir", "--cpu", "--output", output])
    assert "--beam 4 --lenpen 1.0" in proc.stderr
    hyps = output.read_text(encoding="utf-8").split("\n")[:-1]
    assert len(hyps) == 20 and not any("\u2581" in h for h in hyps)
    log = (root / "results" / "test.hyp.de.generate.log").read_text(encoding="utf-8")
    assert len(re.findall(r"^D-\d+\t", log, flags=re.M)) == 20
    assert not list((root / "results").glob("*.tmp"))

    # The decoded model is the parameter mean of the last two epoch checkpoints.
    averaged = load(checkpoints / "checkpoint.avg_last2.pt")["model"]
    first, second = load(checkpoints / "checkpoint1.pt")["model"], load(checkpoints / "checkpoint2.pt")["model"]
    for key in ("encoder.embed_tokens.weight", "decoder.layers.0.fc1.weight"):
        torch.testing.assert_close(averaged[key], (first[key] + second[key]) / 2)

    scores_json = root / "results" / "scores.json"
    proc = run(["bash", REPO / "scripts" / "score.sh", "--hyp", output, "--ref", prep / "test.raw.de",
                "--json", scores_json])
    refs = (prep / "test.raw.de").read_text(encoding="utf-8").split("\n")[:-1]
    scores = json.loads(scores_json.read_text())
    assert scores["bleu"]["score"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert "nrefs:1|case:mixed|eff:no|tok:13a" in proc.stdout


@pytest.mark.slow
def test_generate_recipe_defaults_and_errors(trained):
    root, prep, checkpoints = trained
    output = root / "wmt-style" / "test.hyp.de"
    proc = run(["bash", REPO / "scripts" / "generate.sh", "--data-bin", prep / "data-bin",
                "--checkpoint", checkpoints / "checkpoint_last.pt", "--recipe", "wmt14_en_de_big", "--beam", "2",
                "--no-user-dir", "--cpu", "--output", output])
    assert "--beam 2 --lenpen 0.6" in proc.stderr  # WMT14: Vaswani et al.'s length penalty
    assert len(output.read_text(encoding="utf-8").splitlines()) == 20

    missing = root / "no-such-dir"
    proc = run(["bash", REPO / "scripts" / "generate.sh", "--data-bin", prep / "data-bin",
                "--checkpoint-dir", missing, "--output", root / "failed" / "hyp"], expect_ok=False)
    assert proc.returncode == 1
    assert f"checkpoint not found: {missing}/checkpoint_best.pt" in proc.stderr
    assert not (root / "failed").exists()
    proc = run(["bash", REPO / "scripts" / "generate.sh", "--data-bin", prep / "data-bin",
                "--checkpoint-dir", checkpoints, "--average-last", "5", "--no-user-dir",
                "--output", root / "failed" / "hyp"], expect_ok=False)
    assert proc.returncode == 1 and "found 2 epoch checkpoints" in proc.stderr and "but need 5" in proc.stderr
    assert not (root / "failed" / "hyp").exists()
