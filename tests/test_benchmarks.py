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
def test_memory_generate_reports_each_stage_and_the_packed_weights(tmp_path_factory):
    """benchmarks/memory_generate.py's rfa process on a tiny trained model, every hypothesis forced to 6 tokens: every
    stage in order with its resident and peak memory, the split the CSV gets (imports, weights, runtime, a batch's
    working memory, decoding's own peak) consistent with them, and the bytes the runtimes decode with: int8's codes
    smaller than fp32's packed weights."""
    import json

    from cli_support import synthetic_data, train_generate_model

    sys.path.insert(0, SCRIPTS)
    import memory_generate

    data = synthetic_data(tmp_path_factory)
    checkpoint = train_generate_model(data, tmp_path_factory.mktemp("memory_model"), max_update=5)
    packed = {}
    for precision in ("fp32", "int8"):
        proc = subprocess.run(
            [sys.executable, os.path.join(SCRIPTS, "memory_generate.py"), "--child", "rfa", "--precision", precision,
             "--model", str(checkpoint), "--data-bin", str(data / "bin"), "--split", "test", "--sentences", "40",
             "--forced-length", "6", "--batch-size", "8"],
            capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if precision == "int8" and proc.returncode != 0 and "int8" in proc.stderr and "use fp32" in proc.stderr:
            print(f"int8 decoding is unavailable here: {proc.stderr.strip().splitlines()[-1]}")
            continue
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        stages = result["stages"]
        assert [name for name, _ in stages] == ["python", "imports", "weights", "runtime", "decode"]
        assert all(at["peak"] >= at["rss"] > 0 for _, at in stages)
        assert stages[1][1]["rss"] > stages[0][1]["rss"] + 50  # importing torch is not free
        split = memory_generate.split_of(stages)
        assert split["imports_mb"] == stages[1][1]["rss"]
        assert split["own_peak_mb"] == pytest.approx(stages[-1][1]["peak"] - stages[1][1]["rss"], abs=0.11)
        assert split["batch_working_mb"] <= split["own_peak_mb"]
        assert result["packed_mb"] > 0 and result["embedding_mb"] > 0
        packed[precision] = result["packed_mb"]
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
        work = float(row["work_s"])
        want = work / (int(row["test_sets"]) * one)
        # the CSV's times carry 3 decimals (half a millisecond each way), the ratio 3 decimals too
        rounding = 0.0005 + want * (0.0005 / work + 0.0005 / one)
        assert abs(float(row["work_vs_one_thread"]) - want) <= rounding * 1.01, row
    bad = subprocess.run([sys.executable, script, "--prep", str(tmp_path_factory.mktemp("empty")), "--path",
                          str(checkpoint)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "has no data-bin" in bad.stderr


# ---------------------------------------------------------------- the users' sizes: checkpoints, benchmark, floor
# (their logic, cheaply: the checkpoints themselves take minutes to train, the benchmark hours; docs/benchmarks.md)


def _bench_module(name):
    """A benchmarks/ script imported as a module (the folder on sys.path, as the scripts put it)."""
    import importlib

    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    return importlib.import_module(name)


def test_padded_dictionary_keeps_the_real_pieces_first_and_fills_to_the_size(tmp_path):
    from fairseq.data import Dictionary

    user_size = _bench_module("user_size_checkpoints")
    real = ["▁a 120", "▁the 99", "s 7", "madeupword0000 0"]  # fairseq's own 4-digit filler is a real entry here
    lines = user_size.padded_dictionary(real, 12)
    assert lines[:4] == real and len(lines) == 12
    assert lines[4:] == [f"madeupword{i:05d} 0" for i in range(8)]
    (tmp_path / "dict.txt").write_text("\n".join(lines) + "\n")
    loaded = Dictionary.load(str(tmp_path / "dict.txt"))
    assert len(loaded) == 12 + user_size.FAIRSEQ_SPECIALS  # the model's vocabulary rows
    assert loaded.index("▁the") == user_size.FAIRSEQ_SPECIALS + 1  # the real pieces keep their ids
    assert user_size.padded_dictionary(real, 4) == real  # exactly full: no filler
    for bad, message in ((real, "more than the 3"), (["▁a 1", "▁a 2"], "repeats the symbol"),
                         (["▁a"], "line 1 is not 'symbol count'"),
                         (["madeupword00001 3"], "already in the dictionary")):
        with pytest.raises(ValueError, match=message):
            user_size.padded_dictionary(bad, 3 if bad is real else 5)


def test_user_size_files_are_named_per_size_and_settings_are_checked(tmp_path, capsys):
    user_size = _bench_module("user_size_checkpoints")
    files = user_size.size_files("big", prep=str(tmp_path / "prep"), out_dir=str(tmp_path / "out"), make=False)
    assert files.checkpoints == {m: str(tmp_path / "out" / "big" / m / "checkpoint.pt") for m in ("rfa", "softmax")}
    assert files.ct2_models["int8"] == str(tmp_path / "out" / "big" / "softmax" / "ctranslate2_int8")
    assert files.data_bin == str(tmp_path / "out" / "data-bin") and files.source.endswith("prep/test.spm.en")
    with pytest.raises(ValueError, match="no size named 'huge'"):
        user_size.size_files("huge", make=False)
    # a prep without the recipe's pieces: an error naming what is missing and how to make it
    with pytest.raises(user_size.UserSizeError, match="has no train.spm.en.*prepare-multi30k.sh"):
        user_size.size_files("base", prep=str(tmp_path / "prep"), out_dir=str(tmp_path / "out"))
    # the folder remembers its settings: the same ones pass, others are an error, never a mix
    user_size.check_manifest(str(tmp_path / "out"), vocab_size=32000, updates=2, max_tokens=1024)
    user_size.check_manifest(str(tmp_path / "out"), vocab_size=32000, updates=2, max_tokens=1024)
    with pytest.raises(user_size.UserSizeError, match="vocab_size: made with 32000, asked for 16000"):
        user_size.check_manifest(str(tmp_path / "out"), vocab_size=16000, updates=2, max_tokens=1024)
    for argv, message in ((["--updates", "0"], "--updates must be at least 1"),
                          (["--vocab-size", "-3"], "--vocab-size must be positive"),
                          (["--sizes", "huge"], "invalid choice: 'huge'")):
        with pytest.raises(SystemExit) as exit_:
            user_size.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv


def test_user_size_training_is_the_wmt_recipe_on_the_cpu(tmp_path):
    """The checkpoints are trained by scripts/train.sh's wmt14 recipes (their shared embeddings, optimizer, schedule),
    with the architectures asked for, fp32 on the CPU, a few updates: its dry run prints the fairseq-train command."""
    user_size = _bench_module("user_size_checkpoints")
    data = tmp_path / "data-bin"
    data.mkdir()
    for name in ("dict.en.txt", "dict.de.txt", "train.en-de.en.idx", "valid.en-de.en.idx"):
        (data / name).write_text("")
    for size, model, arch in (("base", "rfa", "rfa_transformer_wmt_en_de"),
                              ("big", "softmax", "transformer_wmt_en_de_big")):
        env, argv = user_size.train_command(size, model, str(data), str(tmp_path / "save"), updates=3, max_tokens=512)
        proc = subprocess.run(argv, env=dict(env, DRY_RUN="1"), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        command = proc.stdout.split()
        assert command[command.index("--arch") + 1] == arch
        assert command[command.index("--max-update") + 1] == "3" and "--fp16" not in command
        for flag in ("--share-all-embeddings", "--cpu", "--no-save-optimizer-state", "--disable-validation"):
            assert flag in command, (flag, command)
        assert command[len(command) - 1 - command[::-1].index("--max-tokens") + 1] == "512"  # the last one wins


def test_user_size_checkpoint_steps_skip_what_exists(tmp_path, monkeypatch):
    """A checkpoint that exists is kept; a finished training's checkpoint_last.pt (a run stopped before its move) is
    moved into place without training again; a conversion that exists is kept: nothing is run for any of them."""
    import torch

    user_size = _bench_module("user_size_checkpoints")
    monkeypatch.setattr(user_size, "run_logged", lambda *a, **k: pytest.fail(f"ran {a[0]}"))
    done = tmp_path / "base" / "rfa" / "checkpoint.pt"
    done.parent.mkdir(parents=True)
    done.write_bytes(b"kept")
    user_size.train_checkpoint("base", "rfa", str(tmp_path), str(done), updates=2, max_tokens=1024)
    assert done.read_bytes() == b"kept"
    target = tmp_path / "big" / "softmax" / "checkpoint.pt"
    (target.parent / "train").mkdir(parents=True)
    torch.save({"optimizer_history": [{"num_updates": 2}]}, target.parent / "train" / "checkpoint_last.pt")
    user_size.train_checkpoint("big", "softmax", str(tmp_path), str(target), updates=2, max_tokens=1024)
    assert target.exists() and user_size.updates_in(str(target)) == 2
    converted = tmp_path / "ct2"
    converted.mkdir()
    (converted / "model.bin").write_bytes(b"")
    assert user_size.convert_for_ctranslate2(str(target), str(tmp_path), "int8", str(converted)) == str(converted)
    # a checkpoint_last.pt of fewer updates is trained again (here: the training's command is what would run)
    short = tmp_path / "base" / "softmax" / "checkpoint.pt"
    (short.parent / "train").mkdir(parents=True)
    torch.save({"optimizer_history": [{"num_updates": 1}]}, short.parent / "train" / "checkpoint_last.pt")
    with pytest.raises(pytest.fail.Exception, match="ran"):
        user_size.train_checkpoint("base", "softmax", str(tmp_path), str(short), updates=2, max_tokens=1024)
    assert not (short.parent / "train" / "checkpoint_last.pt").exists() and not short.exists()


def test_test_subset_writes_the_first_sentences_once(tmp_path):
    import torch
    from fairseq.data import Dictionary, data_utils, indexed_dataset

    user_size = _bench_module("user_size_checkpoints")
    dictionary = Dictionary()
    for word in ("a", "b", "c"):
        dictionary.add_symbol(word)
    for lang in ("en", "de"):
        dictionary.save(str(tmp_path / f"dict.{lang}.txt"))
        builder = indexed_dataset.make_builder(str(tmp_path / f"test.en-de.{lang}.bin"), impl="mmap",
                                               vocab_size=len(dictionary))
        for i in range(5):
            builder.add_item(torch.tensor([4 + i % 3] * (i + 1) + [dictionary.eos()], dtype=torch.int32))
        builder.finalize(str(tmp_path / f"test.en-de.{lang}.idx"))
    assert user_size.test_subset(str(tmp_path), 0) == "test" and user_size.test_subset(str(tmp_path), 5) == "test"
    assert user_size.test_subset(str(tmp_path), 3) == "test_first3"
    full = data_utils.load_indexed_dataset(str(tmp_path / "test.en-de.de"), dictionary)
    subset = data_utils.load_indexed_dataset(str(tmp_path / "test_first3.en-de.de"), dictionary)
    assert len(subset) == 3 and all(torch.equal(subset[i], full[i]) for i in range(3))
    stamp = os.stat(tmp_path / "test_first3.en-de.en.idx").st_mtime_ns
    assert user_size.test_subset(str(tmp_path), 3) == "test_first3"
    assert os.stat(tmp_path / "test_first3.en-de.en.idx").st_mtime_ns == stamp  # made once
    with pytest.raises(ValueError, match="sentences must be 0"):
        user_size.test_subset(str(tmp_path), -1)


def test_benchmark_generate_skips_the_rows_it_has_and_checks_the_user_size_arguments(tmp_path, capsys):
    bench = _bench_module("benchmark_generate")
    # a row of a CSV written before the size, level and length columns: the recipe model, native, natural lengths
    old = {"device": "cpu", "threads": "1", "batch_size": "32", "model": "rfa", "sentences": "1000"}
    assert bench.row_key(old) == ("cpu", "recipe", "native", "0", "1000", "1", "32", "rfa", "")
    point = {"device": "cpu", "size": "recipe", "cpu_isa": "native", "forced_length": 0, "sentences": 1000,
             "threads": 1, "batch_size": 32}
    key_of = lambda model, **change: bench.row_key({**point, **change, "model": model})  # noqa: E731
    models = ["rfa", "rfa_int8"]
    assert bench.models_to_measure([old], key_of, models) == ["rfa_int8"]
    assert bench.models_to_measure([old], key_of, models, redo=True) == models
    for change in ({"size": "base"}, {"cpu_isa": "avx2"}, {"forced_length": 16}, {"sentences": 100}):
        assert bench.models_to_measure([old], lambda m: key_of(m, **change), models) == models, change
    assert bench.csv_name("cpu", "recipe", ["avx2"], [16]) == "generate_multi30k_cpu_avx2_forced16.csv"
    assert bench.csv_name("cpu", "recipe", ["native"], [0]) == "generate_multi30k_cpu.csv"
    assert bench.csv_name("cpu", "base", ["native", "avx2"], [16, 32]) == "generate_user_base_cpu.csv"
    for argv, message in ((["--size", "base"], "--forced-length L is required"),
                          (["--size", "big", "--forced-length", "0", "16"], "has no meaning for checkpoints"),
                          (["--size", "base", "--forced-length", "16", "--models", "rfa_d16"], "quality-study variant"),
                          (["--forced-length", "16", "--sentences", "-1"], "--sentences must be 0"),
                          (["--size", "base", "--forced-length", "16", "--variant", "rfa=x"], "--variant picks")):
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--prep", str(tmp_path), *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv


def test_user_size_benchmarks_plans_every_point_once(tmp_path, capsys):
    driver = _bench_module("user_size_benchmarks")
    argv = ["--sizes", "base", "--cpu-isas", "native", "--forced-lengths", "16", "--batch-sizes", "1",
            "--threads", "1", "2", "--sentences", "20", "--results-dir", str(tmp_path), "--dry-run"]
    args = driver.parse_args(argv)
    # 1 thread: rfa, rfa_int8 and CTranslate2's two models once each; 2 threads: CTranslate2 as 2 x 1 and 1 x 2
    assert driver.planned_runs(args, "base") == 2 * (4 + 6)
    done = {"device": "cpu", "size": "base", "cpu_isa": "native", "forced_length": "16", "sentences": "20",
            "threads": "2", "batch_size": "1"}
    rows = [dict(done, model="ct2_softmax"), dict(done, model="rfa", sentences="100")]  # the second: another set
    assert driver.planned_runs(args, "base", rows) == 2 * (4 + 4)
    assert driver.main(argv) == 0
    out = capsys.readouterr().out
    assert "base: 20 engine runs" in out and "--size base" in out and "--sentences 20" in out
    with pytest.raises(SystemExit):
        driver.main(["--sentences", "0", "--dry-run"])
    assert "--sentences and --repeats must be positive" in capsys.readouterr().err


def test_weight_floor_counts_the_weights_each_step_reads():
    """The floor's bytes are those of the linear layers the step reads: the rfa runtime's packed products (its fused
    input projection with the feature map folded in, the cross-attention's query and output, the FFN, the output
    projection) and the softmax transformer's per-step ones, for small models built as the benchmarks build them."""
    floor = _bench_module("weight_floor")
    common = _bench_module("benchmark_common")
    from rfa_fairseq.modules.decoding import DecodingRuntime
    from rfa_fairseq.ops.step import TORCH_KERNELS

    dims = floor.Dims(layers=3, embed=256, ffn=1024, heads=4, vocab=300)
    dictionary = common.make_dictionary(300)
    rfa = common.build_model("rfa", "small", dictionary, 64, "cpu")
    runtime = DecodingRuntime(rfa.decoder, TORCH_KERNELS)
    packed = [runtime.output]
    for layer in runtime.layers:
        packed += [layer.self_attn.proj, layer.self_attn.out_proj, layer.cross.q_proj, layer.cross.out_proj,
                   layer.fc1, layer.fc2]
    read = sum(4 * p.weight.numel() + (4 * p.bias.numel() if p.bias is not None else 0) for p in packed)
    assert floor.step_weight_bytes(dims, "rfa", "fp32") == read
    softmax = common.build_model("softmax", "small", dictionary, 64, "cpu").decoder
    linears = [softmax.output_projection]
    for layer in softmax.layers:
        linears += [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.out_proj,
                    layer.encoder_attn.q_proj, layer.encoder_attn.out_proj, layer.fc1, layer.fc2]
    assert floor.step_weight_bytes(dims, "softmax", "fp32") == sum(4 * p.numel() for m in linears
                                                                    for p in m.parameters())
    # int8: a byte a weight, a scale and a bias a row; the output projection has no bias
    weights = sum(o * i for _, o, i, _ in floor.step_products(dims, "rfa"))
    rows = sum(o for _, o, _, _ in floor.step_products(dims, "rfa"))
    assert floor.step_weight_bytes(dims, "rfa", "int8") == weights + 4 * rows + 4 * (rows - dims.vocab)
    with pytest.raises(ValueError, match="no precision 'fp16'"):
        floor.step_weight_bytes(dims, "rfa", "fp16")


def test_weight_floor_arithmetic_and_the_measured_rows(tmp_path):
    floor = _bench_module("weight_floor")
    base = floor.SIZE_DIMS["base"]
    # base, softmax, fp32: 6 layers of (3 + 1 + 2) x 512^2 + 2 x 512 x 2048 weights, 32,004 x 512 output rows
    layer = 6 * 512 * 512 + 2 * 512 * 2048
    biases = 4 * 6 * (3 * 512 + 512 + 512 + 512 + 2048 + 512)
    assert floor.step_weight_bytes(base, "softmax", "fp32") == 4 * (6 * layer + 32004 * 512) + biases
    assert 0.4 < floor.output_projection_share(base, "softmax", "fp32") < 0.45
    assert floor.floor_ms(150_000_000, 15.0) == pytest.approx(10.0)  # 150 MB at 15 GB/s
    # 16 forced tokens, 17 counted a sentence: fairseq-generate runs 17 steps for them, CTranslate2 16
    assert floor.step_ms(400.0, 16, floor.decoder_steps("rfa_int8", 16)) == pytest.approx(2.5)
    assert floor.step_ms(400.0, 16, floor.decoder_steps("ct2_softmax", 16)) == pytest.approx(2.5 * 17 / 16)
    # 20 sentences: 16 tokens (17 steps each) in 3.4 s, 64 tokens (65 steps) in 8.2 s -> 4.8 s over 20 x 48 steps
    assert floor.marginal_step_ms([(16, 20, 3.4), (64, 20, 8.2), (32, 20, 5.0)]) == pytest.approx(5.0)
    assert floor.marginal_step_ms([(16, 20, 3.4)]) is None
    with pytest.raises(ValueError, match="not one set"):
        floor.marginal_step_ms([(16, 20, 3.4), (64, 100, 8.2)])
    with pytest.raises(ValueError):
        floor.floor_ms(1, 0.0)
    # the CSV rows that count: batch 1, one thread, forced lengths, this machine, the size's own
    here = "Test CPU, 2 cores"
    rows = [{"size": "base", "model": "rfa", "batch_size": "1", "threads": "1", "forced_length": "16",
             "sentences": "20", "tokens": "340", "seconds": "3.4", "tokens_per_s": "100.0", "machine": here,
             "cpu_isa": "native"}]
    rows += [dict(rows[0], batch_size="32"), dict(rows[0], threads="2"), dict(rows[0], forced_length="0"),
             dict(rows[0], machine="Another CPU"), dict(rows[0], size="big"),
             dict(rows[0], tokens="300"),  # the forced length did not hold
             dict(rows[0], model="ct2_softmax_int8", forced_length="64", tokens="1300", seconds="8.2",
                  tokens_per_s="160.0")]
    common = _bench_module("benchmark_common")
    common.write_csv(str(tmp_path / "base.csv"), rows)
    measured = floor.measured_steps({"base": str(tmp_path / "base.csv")}, here)
    assert [(m["model"], m["step"], m["precision"], m["forced_length"]) for m in measured] == [
        ("rfa", "rfa", "fp32", 16), ("ct2_softmax_int8", "softmax", "int8", 64)]
    weights = {floor.step_weight_bytes(floor.SIZE_DIMS[s], step, p) for s in ("base",) for step in ("rfa", "softmax")
               for p in floor.PRECISIONS}
    out = floor.floor_rows(["base"], measured, {"native": (10.0, "torch.mv")},
                           {("native", w): (40.0, "torch.sum") for w in weights}, here)
    by = {(r["step"], r["precision"]): r for r in out}
    assert set(by) == {(s, p) for s in ("rfa", "softmax") for p in floor.PRECISIONS}  # floor-only rows too
    rfa = by["rfa", "fp32"]
    expected_floor = floor.step_weight_bytes(base, "rfa", "fp32") / 10e9 * 1e3
    assert float(rfa["floor_ms"]) == pytest.approx(expected_floor, rel=1e-3)
    assert float(rfa["step_ms"]) == pytest.approx(10.0)
    assert float(rfa["step_vs_floor"]) == pytest.approx(10.0 / expected_floor, rel=1e-2)
    assert float(rfa["cached_floor_ms"]) == pytest.approx(expected_floor / 4, rel=1e-3)
    assert "step_ms" not in by["rfa", "int8"]  # not measured: the floor alone


def test_weight_floor_reads_memory(capsys):
    """The bandwidth measurement runs (a small buffer: no timing is asserted, only that it reads)."""
    floor = _bench_module("weight_floor")
    gb_s, read = floor.read_bandwidth_gb_s(8 * 2**20, 2)
    assert gb_s > 0 and read in ("torch.sum", "torch.mv", "numpy.sum")
    assert floor.last_level_cache_bytes() >= 0
    for argv, message in ((["--repeats", "0"], "--repeats must be at least 1"),
                          (["--generate-csv", "huge=x.csv"], "expected SIZE=PATH")):
        with pytest.raises(SystemExit) as exit_:
            floor.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv
