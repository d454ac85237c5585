"""The benchmark scripts run end to end on tiny settings and report real properties
(not timings: those belong to the benchmark runs, see README)."""
import csv
import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPTS = os.path.join(REPO, "benchmarks")


def _run(script, *args, tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, script), *args, "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_benchmark_decode_small_run_writes_csv_png_and_rfa_state_does_not_grow(tmp_path):
    models = ["softmax", "rfa", "floor", "floor_proj"]
    have_ct2 = importlib.util.find_spec("ctranslate2") is not None
    if have_ct2:
        models.append("ct2")
    else:
        print("ctranslate2 not installed: the optional CTranslate2 peer is not exercised (pip install ctranslate2==4.8.5)")
    _run("benchmark_decode.py", "--dims", "small", "--vocab", "200", "--src-len", "6", "--lengths", "4", "16",
         "--batch-sizes", "2", "--threads", "1", "--models", *models, tmp_path=tmp_path)
    rows = {(r["model"], int(r["length"])): r for r in _rows(tmp_path / "decode_cpu_small.csv")}
    assert set(rows) == {(m, n) for m in models for n in (4, 16)}
    assert (tmp_path / "decode_cpu_small.png").stat().st_size > 0
    for (model, length), r in rows.items():
        expected_len = length if model == "ct2" else length + 1  # fairseq counts the final EOS
        assert float(r["out_len"]) == expected_len, (model, length, r["out_len"])  # forced lengths hold
        assert float(r["total_s"]) > 0
    state = {key: float(r["attn_state_mb"]) for key, r in rows.items()}
    assert state[("rfa", 4)] == state[("rfa", 16)] > 0  # constant-size RFA state
    assert state[("softmax", 16)] > state[("softmax", 4)] > 0  # the KV cache grows
    assert state[("floor", 4)] == state[("floor_proj", 4)] == 0
    assert float(rows[("rfa", 16)]["time_vs_softmax"]) > 0 and float(rows[("rfa", 16)]["step_vs_floor"]) > 0


@pytest.mark.slow
def test_benchmark_train_small_run_writes_csv(tmp_path):
    _run("benchmark_train.py", "--dims", "small", "--lengths", "64", "256", "--kinds", "softmax", "rfa",
         "--repeats", "1", "--threads", "1", "--skip-e2e", tmp_path=tmp_path)
    csvs = [p for p in os.listdir(tmp_path) if p.endswith(".csv")]
    assert len(csvs) == 1, os.listdir(tmp_path)
    rows = _rows(tmp_path / csvs[0])
    assert {(r["kind"], int(r["length"])) for r in rows} == {(k, n) for k in ("softmax", "rfa") for n in (64, 256)}
    assert all(float(r["ms_fwd_bwd"]) > 0 for r in rows)
