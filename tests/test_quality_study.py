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


def test_conversion_rows_are_keyed_by_teacher_seed_method_and_budget(tmp_path):
    path = str(tmp_path / "conversion.csv")
    row = {"teacher_updates": "1000", "seed": "1", "method": "distill_ce", "finetune_updates": "50", "bleu": "30.1"}
    quality_study.write_rows(path, [row], quality_study.CONVERSION_FIELDS)
    (read,) = quality_study.read_rows(path)
    assert quality_study.conversion_key(read) == (1000, 1, "distill_ce", 50) and read["bleu"] == "30.1"
    assert list(read) == quality_study.CONVERSION_FIELDS
