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


@pytest.mark.slow
def test_memory_generate_reports_each_stage_and_the_weights_copies(tmp_path_factory):
    """benchmarks/memory_generate.py's rfa process on a tiny trained model: every stage in order with its resident
    and peak memory, and the tensors behind the weights: the parameters, the packed weights and the few-rows blocks
    (where the CPU has them) beside them, int8's codes smaller than fp32's packed weights."""
    import json

    from cli_support import synthetic_data, train_generate_model

    data = synthetic_data(tmp_path_factory)
    checkpoint = train_generate_model(data, tmp_path_factory.mktemp("memory_model"), max_update=5)
    prep = tmp_path_factory.mktemp("memory_prep")  # data-prep's layout: the binarized data under data-bin
    (prep / "data-bin").symlink_to(data / "bin")
    packed = {}
    for precision in ("fp32", "int8"):
        proc = subprocess.run(
            [sys.executable, os.path.join(SCRIPTS, "memory_generate.py"), "--child", "rfa", "--precision", precision,
             "--model", str(checkpoint), "--prep", str(prep), "--batch-size", "8"],
            capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if precision == "int8" and proc.returncode != 0 and "int8" in proc.stderr and "use fp32" in proc.stderr:
            print(f"int8 decoding is unavailable here: {proc.stderr.strip().splitlines()[-1]}")
            continue
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        stages = result["stages"]
        assert [s["stage"] for s in stages] == ["python", "import torch", "import fairseq and the plugin",
                                                "load the checkpoint", "load the test set", "build the generator",
                                                "decode the test set"]
        assert all(s["peak_mb"] >= s["rss_mb"] > 0 for s in stages)
        assert stages[1]["rss_mb"] > stages[0]["rss_mb"] + 50  # importing torch is not free
        tensors = result["tensors"]
        assert tensors["parameters and buffers"] > 0
        packed[precision] = tensors["packed weights (the library's layout or int8 codes)"]
        assert packed[precision] > 0
    if "int8" in packed:
        assert packed["int8"] < packed["fp32"]


@pytest.mark.slow
def test_scaling_generate_times_one_thread_two_threads_and_two_processes(tmp_path_factory):
    """benchmarks/scaling_generate.py on a tiny trained model: a row per run (one thread, two threads in one process,
    two processes), the two threads' work timed on both threads, the processes' work summed; a --prep without
    data-bin is an error naming it."""
    from cli_support import synthetic_data, train_generate_model

    data = synthetic_data(tmp_path_factory)
    checkpoint = train_generate_model(data, tmp_path_factory.mktemp("scaling_model"), max_update=5)
    prep = tmp_path_factory.mktemp("scaling_prep")
    (prep / "data-bin").symlink_to(data / "bin")
    csv_path = prep / "scaling.csv"
    script = os.path.join(SCRIPTS, "scaling_generate.py")
    proc = subprocess.run([sys.executable, script, "--prep", str(prep), "--path", str(checkpoint), "--threads", "2",
                           "--batch-sizes", "8", "--precisions", "fp32", "--csv", str(csv_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["run"]: r for r in _rows(csv_path)}
    assert set(rows) == {"one thread", "2 threads", "2 processes"}
    assert float(rows["one thread"]["scaling"]) == 1.0 and float(rows["one thread"]["tail_s"]) == 0.0
    for row in rows.values():
        assert float(row["span_s"]) > 0 and float(row["work_s"]) > 0 and float(row["sentences_per_s"]) > 0
    # each process decodes the test set (two sets), the threads share one; the work is set against one thread's per
    # set (the times themselves vary with the machine's load: benchmarks/scaling_generate.py measures them)
    assert [rows[run]["test_sets"] for run in ("one thread", "2 threads", "2 processes")] == ["1", "1", "2"]
    one = float(rows["one thread"]["work_s"])
    for row in rows.values():
        want = float(row["work_s"]) / (int(row["test_sets"]) * one)
        assert abs(float(row["work_vs_one_thread"]) - want) <= 0.002 * max(1.0, want), row
    bad = subprocess.run([sys.executable, script, "--prep", str(tmp_path_factory.mktemp("empty")), "--path",
                          str(checkpoint)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "has no data-bin" in bad.stderr
