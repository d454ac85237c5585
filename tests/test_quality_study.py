"""scripts/quality_study.py --conversion: what it measures for a budget is the checkpoint of that budget."""
import argparse
import os
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import quality_study  # noqa: E402


@pytest.fixture
def fake_training(tmp_path, monkeypatch):
    """A work dir whose checkpoint_last.pt stands at `state['updates']`; train.sh calls are recorded."""
    state = {"updates": None, "calls": []}
    (tmp_path / "checkpoint_last.pt").write_bytes(b"")
    monkeypatch.setattr(quality_study, "_updates_of", lambda path: state["updates"])
    monkeypatch.setattr(quality_study, "run", lambda cmd, env=None, **kwargs: state["calls"].append(env["MAX_UPDATE"]))
    args = argparse.Namespace(train_timeout_h=1.0)
    return state, tmp_path, args


def test_a_run_short_of_the_budget_is_continued(fake_training):
    state, work, args = fake_training
    state["updates"] = 100
    quality_study._train_to({}, [], str(work), 200, args)
    assert state["calls"] == ["200"]


def test_a_run_at_the_budget_is_not_rerun(fake_training):
    """fairseq-train restarted on a finished run trains one more update before it stops."""
    state, work, args = fake_training
    state["updates"] = 200
    assert quality_study._train_to({}, [], str(work), 200, args) == 0.0
    assert state["calls"] == []


def test_a_run_past_the_budget_is_refused(fake_training):
    state, work, args = fake_training
    state["updates"] = 500
    with pytest.raises(RuntimeError, match=r"checkpoint_last.pt is past 200 updates \(500\).*delete"):
        quality_study._train_to({}, [], str(work), 200, args)
    assert state["calls"] == []


def test_conversion_rows_are_keyed_by_teacher_seed_method_d_lr_and_budget(tmp_path):
    path = str(tmp_path / "conversion.csv")
    row = {"teacher_updates": "1000", "seed": "1", "method": "distill_ce", "num_features": "16", "finetune_lr": "0.001",
           "finetune_updates": "50", "bleu": "30.1"}
    quality_study.write_rows(path, [row], quality_study.CONVERSION_FIELDS)
    (read,) = quality_study.read_rows(path)
    assert quality_study.conversion_key(read) == (1000, 1, "distill_ce", "16", "0.001", 50) and read["bleu"] == "30.1"
    assert list(read) == quality_study.CONVERSION_FIELDS


def test_conversion_key_of_rows_without_d_or_lr():
    """Rows written before D and the fine-tuning lr were columns are D = 64 at train.sh's learning rate; the lr
    keys only fine-tuned rows of converted models, D every row but the teacher's."""
    key = quality_study.conversion_key
    base = {"teacher_updates": "1000", "seed": "1"}
    assert key(dict(base, method="distill_ce", finetune_updates="200")) == \
        (1000, 1, "distill_ce", "64", quality_study.DEFAULT_FINETUNE_LR, 200)
    assert key(dict(base, method="swap", finetune_updates="0", finetune_lr="0.001")) == (1000, 1, "swap", "64", "", 0)
    assert key(dict(base, method="scratch", finetune_updates="200", num_features="16", finetune_lr="0.001")) == \
        (1000, 1, "scratch", "16", "", 200)
    assert key(dict(base, method="teacher", finetune_updates="0", num_features="16")) == (1000, 1, "teacher", "", "", 0)


def test_the_default_finetuning_lr_is_train_sh_s():
    text = open(os.path.join(REPO, "scripts", "train.sh")).read()
    assert f"FINETUNE_ARGS=(--lr {quality_study.DEFAULT_FINETUNE_LR} " in text


def test_bad_conversion_options_are_refused(capsys):
    for argv, message in ((["--num-features", "0"], "--num-features must be positive"),
                          (["--finetune-lr", "fast"], "--finetune-lr must be a positive number")):
        with pytest.raises(SystemExit) as exit_info:
            quality_study.main(["--conversion", *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_run_continues_the_furthest_shorter_run_of_the_same_model(tmp_path, monkeypatch):
    """_continue_from copies the checkpoint (and train.log) of the source that got furthest without passing the
    target, and leaves a run that has its own checkpoint alone."""
    monkeypatch.setattr(quality_study, "_updates_of", lambda path: int(open(path).read()))
    sources = []
    for updates in (500, 1000, 1500):
        source = tmp_path / f"u{updates}"
        source.mkdir()
        (source / "checkpoint_last.pt").write_text(str(updates))
        (source / "train.log").write_text(f"log of {updates}")
        sources.append(str(source))
    work = tmp_path / "work"
    quality_study._continue_from(str(work), sources, 1200)
    assert (work / "checkpoint_last.pt").read_text() == "1000" and (work / "train.log").read_text() == "log of 1000"
    quality_study._continue_from(str(work), sources, 2000)  # has its own checkpoint now: untouched
    assert (work / "checkpoint_last.pt").read_text() == "1000"
    fresh = tmp_path / "fresh"
    quality_study._continue_from(str(fresh), sources, 400)  # every source is past 400: nothing to continue
    assert not fresh.exists()


def test_train_seconds_add_every_run_of_a_continued_and_resumed_log():
    """A continued run's train.log holds its shorter run's log, then one part per fairseq-train run (train.sh's
    line first); fairseq's `wall` restarts at 0 on resume, so the time is fairseq's "done training in" of each
    finished run plus a killed run's first-to-last line."""
    log = "\n".join([
        "train.sh: 2026-11-25T10:00:00Z: fairseq-train ...",
        "2026-11-25 10:00:02 | INFO | train | epoch 001 | wall 100",
        "2026-11-25 11:00:00 | INFO | fairseq_cli.train | done training in 3598.0 seconds",
        "train.sh: 2026-11-25T12:00:00Z: fairseq-train ...",  # killed after 10 minutes
        "2026-11-25 12:00:05 | INFO | train_inner | epoch 002: wall=0",
        "2026-11-25 12:10:00 | INFO | train_inner | epoch 002: wall=0",
        "train.sh: 2026-11-25T13:00:00Z: fairseq-train ...",
        "2026-11-25 13:30:00 | INFO | train | epoch 003 | wall 0",
        "2026-11-25 13:30:01 | INFO | fairseq_cli.train | done training in 1800.5 seconds",
    ])
    assert quality_study.train_seconds_of(log) == 3598.0 + 600.0 + 1800.5
    assert quality_study.train_seconds_of("") == 0.0


def _fake_prep(prep, leave_out=()):
    for name in ("data-bin/dict.en.txt", "data-bin/dict.de.txt", "test.raw.de", "valid.raw.de", "spm.model"):
        if name not in leave_out:
            (prep / name).parent.mkdir(parents=True, exist_ok=True)
            (prep / name).write_text("")


def test_a_prep_dir_without_the_valid_reference_is_refused_with_the_command_that_adds_it(tmp_path, capsys):
    _fake_prep(tmp_path, leave_out=("valid.raw.de",))
    with pytest.raises(SystemExit) as exit_info:
        quality_study.main(["--prep", str(tmp_path), "--device", "cpu", "--variants", "softmax",
                            "--csv", str(tmp_path / "rows.csv"), "--work-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"--prep {tmp_path} has no valid.raw.de: run data-prep/prepare-multi30k.sh --pair en-de" in err


def test_a_row_scores_test_2016_flickr_and_the_valid_split_each_against_its_own_reference(tmp_path, monkeypatch):
    """Every row carries BLEU and chrF of both splits: each translated with --subset and scored against the
    published reference prepare-multi30k.sh writes for it, the decoding time from the test split's log."""
    prep, work = tmp_path / "prep", tmp_path / "work"
    scores_by_reference = {"test.raw.de": (36.5, 60.1), "valid.raw.de": (37.25, 61.5)}
    commands = []

    def fake_run(cmd, env=None, log_path=None, **kwargs):
        commands.append(cmd)
        option = dict(zip(cmd[2::2], cmd[3::2]))
        if cmd[1].endswith("generate.sh"):
            open(option["--output"], "w").write("hyp\n")
            seconds = "4.5" if option["--subset"] == "test" else "5.5"
            open(option["--output"] + ".generate.log", "w").write(f"Translated 1,000 sentences (9 tokens) in {seconds}s\n")
        else:
            bleu, chrf = scores_by_reference[os.path.basename(option["--ref"])]
            json_text = f'{{"bleu": {{"score": {bleu}, "signature": "b"}}, "chrf": {{"score": {chrf}, "signature": "c"}}}}'
            open(option["--json"], "w").write(json_text)

    def fake_train_to(env, extra, work_dir, updates, args):
        open(os.path.join(work_dir, "train.log"), "w").write(
            "valid on 'valid' subset | loss 4.100 | nll_loss 3 | num_updates 200\n")
        return 12.0

    monkeypatch.setattr(quality_study, "run", fake_run)
    monkeypatch.setattr(quality_study, "_train_to", fake_train_to)
    args = argparse.Namespace(prep=str(prep), work_dir=str(work), max_update=200, seed=1, train_args="", device="cpu",
                              device_name="cpu (2 cores)", decode_timeout_h=1.0, pair="en-de")
    row = quality_study.train_and_score("softmax", args, {}, 2)
    assert (row["bleu"], row["chrf"], row["valid_bleu"], row["valid_chrf"]) == ("36.50", "60.10", "37.25", "61.50")
    assert row["decode_seconds"] == "4.5" and set(row) == set(quality_study.FIELDS)
    generated = [dict(zip(c[2::2], c[3::2])) for c in commands if c[1].endswith("generate.sh")]
    assert [(g["--subset"], os.path.basename(g["--output"])) for g in generated] == \
        [("test", "test.hyp.de"), ("valid", "valid.hyp.de")]


def test_the_rule_shows_the_valid_splits_gap_over_the_seeds_that_have_it(tmp_path, capsys):
    d16 = quality_study.DEFAULT_MODEL_VARIANTS[16]
    rows = [dict(variant=v, max_update=1000, seed=s, bleu=b, valid_bleu=vb)
            for v, s, b, vb in (("softmax", 1, 30.0, 31.0), (d16, 1, 29.0, 31.4), ("softmax", 2, 30.0, ""),
                                (d16, 2, 30.4, ""))]
    quality_study.write_rows(str(tmp_path / "de.csv"), rows)
    quality_study.write_rows(str(tmp_path / "fr.csv"), [dict(r, valid_bleu="") for r in rows])
    table, _, passing = quality_study.rule_table({"en-de": str(tmp_path / "de.csv"), "en-fr": str(tmp_path / "fr.csv")})
    de, fr = table
    assert de["gap"] == pytest.approx(-0.3) and de["valid_seeds"] == [1] and de["valid_gap"] == pytest.approx(0.4)
    assert fr["valid_gap"] is None and fr["valid_seeds"] == []
    assert passing == 16  # the verdict stays on test_2016_flickr
    quality_study.print_rule({"en-de": str(tmp_path / "de.csv"), "en-fr": str(tmp_path / "fr.csv")})
    out = capsys.readouterr().out.splitlines()
    assert "valid gap (seeds)" in out[0] and " +0.40 (1) " in out[1] and " — " in out[2]


@pytest.mark.parametrize("argv, sharing, threads", [([], 1, "2"), (["--runs-sharing-device", "2"], 2, "1")])
def test_runs_sharing_device_sets_the_threads_and_the_row(tmp_path, monkeypatch, argv, sharing, threads):
    """Two studies started side by side on one CPU say so: each run gets its share of the cores and its row says 2."""
    prep = tmp_path / "prep"
    _fake_prep(prep)
    seen = []

    def fake_train_and_score(name, args, shared_env, runs_sharing):
        seen.append((shared_env["OMP_NUM_THREADS"], runs_sharing))
        return {"variant": name, "max_update": args.max_update, "seed": args.seed, "bleu": "1", "chrf": "1",
                "valid_loss": "1", "train_seconds": "1", "decode_seconds": "1", "runs_sharing_device": runs_sharing}

    monkeypatch.setattr(quality_study, "train_and_score", fake_train_and_score)
    monkeypatch.setattr(quality_study, "plot", lambda *a, **k: None)
    monkeypatch.setattr(quality_study, "plot_bleu_by_updates", lambda *a, **k: None)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    csv_path = tmp_path / "rows.csv"
    assert quality_study.main(["--prep", str(prep), "--device", "cpu", "--variants", "softmax",
                               "--csv", str(csv_path), *argv]) == 0
    assert seen == [(threads, sharing)]
    assert quality_study.read_rows(str(csv_path))[0]["runs_sharing_device"] == str(sharing)


def test_runs_sharing_device_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        quality_study.main(["--runs-sharing-device", "0"])
    assert exit_info.value.code == 2 and "--runs-sharing-device must be at least 1" in capsys.readouterr().err


def _rows(path, rows):
    quality_study.write_rows(str(path), [dict(variant=v, max_update=u, seed=s, bleu=b) for v, u, s, b in rows])
    return str(path)


def test_the_rule_compares_paired_seeds_at_each_pairs_longest_budget(tmp_path):
    d16, d32 = quality_study.DEFAULT_MODEL_VARIANTS[16], quality_study.DEFAULT_MODEL_VARIANTS[32]
    en_de = _rows(tmp_path / "de.csv", [
        ("softmax", 1000, 1, 30.0), ("softmax", 1000, 2, 31.0), (d16, 1000, 1, 29.0), (d16, 1000, 2, 32.0),
        ("softmax", 2000, 1, 36.0), ("softmax", 2000, 2, 37.0), (d16, 2000, 1, 35.0), (d16, 2000, 2, 36.2),
        (d32, 2000, 1, 35.9), (d32, 2000, 2, 36.8),
        (d16, 4000, 1, 40.0),  # no softmax row at 4,000 updates: not a measured budget
    ])
    en_fr = _rows(tmp_path / "fr.csv", [
        ("softmax", 1000, 1, 44.0), ("softmax", 1000, 2, 45.0), (d16, 1000, 1, 44.0),  # seed 2 not paired
        (d32, 1000, 1, 44.1), (d32, 1000, 2, 44.7),
    ])
    table, longest, passing = quality_study.rule_table({"en-de": en_de, "en-fr": en_fr})
    assert longest == {"en-de": 2000, "en-fr": 1000}
    at = {(r["pair"], r["max_update"], r["d"]): r for r in table}
    assert at[("en-de", 2000, 16)]["gap"] == pytest.approx(-0.9) and not at[("en-de", 2000, 16)]["within"]
    assert at[("en-de", 2000, 16)]["seed_gaps"] == pytest.approx([-1.0, -0.8])
    assert at[("en-de", 2000, 32)]["gap"] == pytest.approx(-0.15)
    assert at[("en-fr", 1000, 16)]["seeds"] == [1] and at[("en-fr", 1000, 16)]["gap"] == pytest.approx(0.0)
    assert ("en-de", 4000, 16) not in at
    assert passing == 32  # D = 16 trails by 0.9 on EN-DE at 2,000 updates; D = 32 holds on both pairs
    # a pair without any paired row: no verdict
    assert quality_study.rule_table({"en-de": en_de, "en-fr": _rows(tmp_path / "empty.csv", [])})[2] is None


def test_a_larger_d_is_measured_only_where_a_smaller_one_misses(tmp_path, capsys):
    """The study trains D = 32 only at the budget where D = 16 misses: on the other pair D = 16's rows stand for it,
    but never where D = 16 misses or where D = 32's own rows miss."""
    d16, d32 = quality_study.DEFAULT_MODEL_VARIANTS[16], quality_study.DEFAULT_MODEL_VARIANTS[32]
    en_fr = _rows(tmp_path / "fr.csv", [("softmax", 2000, 1, 54.0), (d16, 2000, 1, 54.2)])
    de_rows = [("softmax", 4000, 1, 39.0), ("softmax", 4000, 2, 38.5), (d16, 4000, 1, 38.3), (d16, 4000, 2, 38.1)]
    d32_holds = _rows(tmp_path / "de.csv", de_rows + [(d32, 4000, 1, 38.8), (d32, 4000, 2, 38.6)])
    table, longest, passing = quality_study.rule_table({"en-de": d32_holds, "en-fr": en_fr})
    assert passing == 32
    assert [quality_study.holds_at_longest(table, longest, 32, p) for p in ("en-de", "en-fr")] == [32, 16]
    assert quality_study.holds_at_longest(table, longest, 16, "en-de") is None
    assert quality_study.print_rule({"en-de": d32_holds, "en-fr": en_fr}) == 32
    assert "  en-fr: D = 32 has no row at 2000 updates; D = 16 holds there" in capsys.readouterr().out.splitlines()
    d32_misses = _rows(tmp_path / "de2.csv", de_rows + [(d32, 4000, 1, 38.2), (d32, 4000, 2, 38.2)])
    assert quality_study.rule_table({"en-de": d32_misses, "en-fr": en_fr})[2] is None
    # D = 16 misses on EN-FR too: D = 32 without EN-FR rows does not hold there
    fr_misses = _rows(tmp_path / "fr2.csv", [("softmax", 2000, 1, 54.0), (d16, 2000, 1, 53.0)])
    assert quality_study.rule_table({"en-de": d32_holds, "en-fr": fr_misses})[2] is None


def test_the_rule_names_the_pair_it_has_no_verdict_for(tmp_path, capsys):
    d16 = quality_study.DEFAULT_MODEL_VARIANTS[16]
    en_de = _rows(tmp_path / "de.csv", [("softmax", 1000, 1, 30.0), (d16, 1000, 1, 30.2)])
    en_fr = _rows(tmp_path / "fr.csv", [("softmax", 1000, 1, 44.0)])  # no default-model row to pair with
    assert quality_study.print_rule({"en-de": en_de, "en-fr": en_fr}) is None
    out = capsys.readouterr().out
    assert "+0.20  +0.20  <- longest budget" in out
    assert f"no verdict: no budget with both softmax and the default model for en-fr (in {en_fr})" in out


def _put_rows(path, seed, count):
    for update in range(count):
        quality_study.put_row(path, dict(variant="softmax", max_update=update, seed=seed, bleu="1"), quality_study.key)


def test_studies_side_by_side_on_one_csv_keep_every_row(tmp_path):
    """Two studies writing one CSV at the same moments (they finish together) lose no row: put_row's lock covers
    the read and the write. Without it, a row read before the other process's rename is dropped."""
    import multiprocessing

    path = str(tmp_path / "rows.csv")
    processes = [multiprocessing.get_context("fork").Process(target=_put_rows, args=(path, seed, 60)) for seed in (1, 2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [process.exitcode for process in processes] == [0, 0]
    rows = quality_study.read_rows(path)
    assert sorted((int(r["seed"]), int(r["max_update"])) for r in rows) == [(s, u) for s in (1, 2) for u in range(60)]
