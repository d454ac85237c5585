"""The project's own waits on other processes end: a command that runs past its limit is stopped (its
children too) and the error names the command and the limit (scripts/quality_study.py, the benchmark
workers). data-prep's worker processes: tests/test_data_prep.py."""
import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import benchmark_common  # noqa: E402
import quality_study  # noqa: E402

# a script whose child outlives a plain kill of the script, and which ignores SIGTERM itself
STUBBORN_SCRIPT = "trap '' TERM; sleep 311 & sleep 312; wait"


def processes_running(pattern):
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=60)
    return [line for line in ps.stdout.splitlines() if line.startswith(pattern)]


def test_quality_study_stops_a_command_past_its_limit_with_its_children(tmp_path, monkeypatch):
    monkeypatch.setattr(quality_study, "STOP_GRACE_S", 1)
    log_path = tmp_path / "train_sh.log"
    with pytest.raises(RuntimeError) as error:  # the script sleeps 312 s: only its limit ends it
        quality_study.run(["bash", "-c", STUBBORN_SCRIPT], log_path=str(log_path), timeout_s=1.8,
                          limit_name="--train-timeout-h")
    assert str(error.value) == f"bash -c did not finish within 0.0005 h (--train-timeout-h): stopped; log {log_path}"
    time.sleep(0.5)
    assert processes_running("sleep 31") == [], "the script's child was left running"
    assert not quality_study.RUNNING

    quality_study.run(["bash", "-c", "exit 0"], log_path=str(log_path), timeout_s=60)  # in time: no error
    with pytest.raises(RuntimeError, match="bash exited with 3"):
        quality_study.run(["bash", "-c", "exit 3"], log_path=str(log_path), timeout_s=60)


def test_quality_study_starts_nothing_once_stopping(tmp_path, monkeypatch):
    monkeypatch.setattr(quality_study, "STOPPING", threading.Event())
    quality_study.stop_all()
    with pytest.raises(RuntimeError, match="bash -c not started: the study is stopping"):
        quality_study.run(["bash", "-c", "exit 0"], log_path=str(tmp_path / "log"), timeout_s=60)


def test_quality_study_refuses_a_non_positive_limit(capsys):
    with pytest.raises(SystemExit) as exit_info:
        quality_study.main(["--train-timeout-h", "0"])
    assert exit_info.value.code == 2
    assert "--train-timeout-h and --decode-timeout-h must be positive" in capsys.readouterr().err


def test_a_benchmark_worker_past_its_limit_is_killed_and_named():
    cmd = [sys.executable, "-c", "import time; time.sleep(300)"]
    with pytest.raises(RuntimeError) as error:  # the worker sleeps 300 s: only its limit ends it
        benchmark_common.run_worker(cmd, timeout_s=1)
    assert str(error.value) == f"benchmark worker did not finish within 1 s (killed): {' '.join(cmd)}"

