"""The multi30k_en_fr recipe end to end on a slice of the real Multi30k EN-FR data:
data-prep/prepare-multi30k.sh --pair en-fr -> scripts/train.sh RECIPE=multi30k_en_fr (both models) ->
scripts/generate.sh -> scripts/score.sh; and scripts/quality_study.py's EN-FR wiring."""
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import quality_study  # noqa: E402

SHARED_MULTI30K = Path(REPO).parent / "shared" / "data" / "multi30k"
BIN = os.path.dirname(sys.executable)
SLICE = {"train": 1500, "val": 50, "test_2016_flickr": 30}  # sentences taken from the start of each split
UPDATES = 20


def env(**extra):
    out = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), PYTHON=sys.executable)
    out.pop("MULTI30K_DIR", None)
    out.update({k: str(v) for k, v in extra.items()})
    return out


def run(*cmd, **extra):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env(**extra), cwd=REPO, timeout=900)
    assert proc.returncode == 0, f"{cmd[:2]} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def slice_of_real_data(dest: Path) -> Path:
    dest.mkdir()
    for name, lines in SLICE.items():
        for lang in ("en", "fr"):
            with gzip.open(SHARED_MULTI30K / f"{name}.{lang}.gz", "rt", encoding="utf-8") as src:
                head = [next(src) for _ in range(lines)]
            with gzip.open(dest / f"{name}.{lang}.gz", "wt", encoding="utf-8") as out:
                out.writelines(head)
    return dest


def train_losses(log: str):
    """fairseq's simple log format: 'epoch 001:      5 / 17 loss=9.123, nll_loss=...' every --log-interval updates."""
    return [float(x) for x in re.findall(r"epoch \d+:\s+\d+ / \d+ loss=([\d.]+)", log)]


@pytest.mark.slow
def test_multi30k_en_fr_recipe_on_real_data(tmp_path):
    if not (SHARED_MULTI30K / "train.fr.gz").exists():
        print(f"SKIP reason: real Multi30k not found at {SHARED_MULTI30K}")
        pytest.skip(f"real Multi30k data not found at {SHARED_MULTI30K}")
    local = slice_of_real_data(tmp_path / "raw")
    prep = tmp_path / "prep"
    # --no-checksum: a slice, not the published sizes; a small vocabulary for a small slice
    run("bash", Path(REPO) / "data-prep" / "prepare-multi30k.sh", "--pair", "en-fr", "--local-dir", local,
        "--no-checksum", "--vocab-size", "1000", "--workers", "1", prep)
    assert (prep / "data-bin" / "dict.fr.txt").exists() and (prep / "test.raw.fr").exists()

    for model in ("softmax", "rfa"):
        save = tmp_path / f"ckpt_{model}"
        proc = run("bash", Path(REPO) / "scripts" / "train.sh", "--lr", "0.002", "--warmup-updates", "10",
                   "--max-tokens", "1000", "--log-interval", "5", "--no-epoch-checkpoints", "--cpu",
                   DATA=prep / "data-bin", RECIPE="multi30k_en_fr", MODEL=model, MAX_UPDATE=UPDATES, SAVE_DIR=save)
        command = next(line for line in proc.stdout.splitlines() if line.startswith("train.sh: 20"))
        arch = "rfa_transformer" if model == "rfa" else "transformer"
        assert f"--arch {arch} " in command and "--source-lang en --target-lang fr" in command
        losses = train_losses(proc.stdout)
        print(f"{model}: train loss every 5 updates {losses}")
        assert len(losses) >= 4 and losses[-1] < losses[0] - 1.0, "training on real EN-FR pairs must lower the loss"

        hyp = tmp_path / f"{model}.hyp.fr"
        run("bash", Path(REPO) / "scripts" / "generate.sh", "--data-bin", prep / "data-bin", "--checkpoint",
            save / "checkpoint_last.pt", "--recipe", "multi30k_en_fr", "--beam", "4", "--cpu", "--output", hyp)
        hypotheses = hyp.read_text(encoding="utf-8").splitlines()
        assert len(hypotheses) == SLICE["test_2016_flickr"]
        scores = tmp_path / f"{model}.json"
        run("bash", Path(REPO) / "scripts" / "score.sh", "--hyp", hyp, "--ref", prep / "test.raw.fr", "--json", scores)
        result = json.loads(scores.read_text())
        assert result["bleu"]["signature"].startswith("nrefs:1")
        # score.sh's BLEU is sacreBLEU's on the detokenized hypotheses and the published references
        references = (prep / "test.raw.fr").read_text(encoding="utf-8").splitlines()
        assert abs(result["bleu"]["score"] - sacrebleu.corpus_bleu(hypotheses, [references]).score) < 0.01


def test_quality_study_pairs_have_their_recipe_and_csv():
    assert quality_study.recipe_of("en-fr") == "multi30k_en_fr" and quality_study.recipe_of("en-de") == "multi30k_en_de"
    assert quality_study.csv_for_pair("results/q.csv", "en-de") == "results/q.csv"
    assert quality_study.csv_for_pair("results/q.csv", "en-fr") == "results/q_en_fr.csv"
    text = open(os.path.join(REPO, "scripts", "train.sh")).read()
    assert re.search(r"^\s+multi30k_en_de \| multi30k_en_fr\)", text, re.MULTILINE)


def test_quality_study_refuses_a_prep_dir_of_the_other_pair(tmp_path):
    prep = tmp_path / "prep"
    (prep / "data-bin").mkdir(parents=True)
    for name in ("data-bin/dict.en.txt", "data-bin/dict.de.txt", "test.raw.de", "spm.model"):
        (prep / name).write_text("")
    with pytest.raises(SystemExit):
        quality_study.main(["--pair", "en-fr", "--prep", str(prep), "--variants", "softmax", "--csv", str(tmp_path / "q.csv")])


def test_a_longer_budget_continues_the_furthest_shorter_run(tmp_path, monkeypatch):
    """train_and_score for 2,000 updates starts from the 1,000-update run of the same variant and seed,
    not from another variant's or seed's run, and not from a run past its budget."""
    work = tmp_path / "runs"
    reached = {"softmax_u1000_s1": 1000, "softmax_u500_s1": 500, "softmax_u1000_s2": 1000,
               "hedgehog_gate_softmax_cross_d16_u1500_s1": 1500, "softmax_u3000_s1": 3000}
    for name, updates in reached.items():
        (work / name).mkdir(parents=True)
        (work / name / "checkpoint_last.pt").write_text(name)  # the file's text says which run it is
        (work / name / "train.log").write_text(f"{name}\n")

    def updates_of(path):
        return reached.get(Path(path).read_text(), 0)

    def fake_train_sh(cmd, env=None, **kwargs):
        log = Path(env["SAVE_DIR"]) / "train.log"
        log.write_text(log.read_text() + "valid on 'valid' subset | loss 4.500 | nll_loss 3 | num_updates 2000\n")

    monkeypatch.setattr(quality_study, "_updates_of", updates_of)
    monkeypatch.setattr(quality_study, "run", fake_train_sh)
    monkeypatch.setattr(quality_study, "translate_and_score", lambda *a, **k: {
        "bleu": "30.00", "chrf": "55.00", "decode_seconds": "1.0", "bleu_signature": "nrefs:1", "chrf_signature": "nrefs:1"})
    args = quality_study.argparse.Namespace(work_dir=str(work), max_update=2000, seed=1, pair="en-fr", prep=str(tmp_path),
                                            train_args="", device="cpu", device_name="cpu", train_timeout_h=1.0)
    row = quality_study.train_and_score("softmax", args, {}, 1)
    continued = work / "softmax_u2000_s1"
    assert (continued / "checkpoint_last.pt").read_text() == "softmax_u1000_s1"
    assert (continued / "train.log").read_text().startswith("softmax_u1000_s1\n")
    assert row["max_update"] == 2000 and row["bleu_signature"] == "nrefs:1"
