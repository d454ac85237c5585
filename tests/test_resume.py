"""Kill training with SIGKILL after a checkpoint was written, resume with the same command, and
compare with an uninterrupted run: the same losses at every update and the same random matrices.

The kill lands mid-epoch (update 10 of 31 in epoch 1): fairseq saves the data iterator's position,
the optimizer, the lr scheduler and the meters; dropout is seeded from (seed, update); and the RFA
matrices are drawn from (seed, update, module). So a resumed run must match exactly, not roughly."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from cli_support import (DEBUG_LOG_TRAIN, TINY_MODEL, TINY_TRAIN, assert_exit_code, debug_log, env, json_losses, run,
                         synthetic_data)
from conftest import PLUGIN_DIR

MAX_UPDATE = 40
SAVE_EVERY = 5
KILL_AFTER = 10  # the checkpoint after which the first run is killed (mid-epoch)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic_data(tmp_path_factory)


def train_command(data, save_dir):
    # the same arguments for all runs; the launcher only stops fairseq from rounding the logged loss and
    # logs random-matrix draws and parameter checksums
    return [
        sys.executable, DEBUG_LOG_TRAIN, "--unrounded", str(data / "bin"), "--user-dir", PLUGIN_DIR, "--arch", "rfa_transformer",
        *TINY_MODEL, "--rfa-feature-map", "sincos", "--rfa-num-features", "8", "--rfa-gate", *TINY_TRAIN, "--max-update", str(MAX_UPDATE),
        "--save-interval-updates", str(SAVE_EVERY), "--save-dir", str(save_dir),
        "--log-format", "json", "--log-interval", "1",
    ]


def run_to_end(command, debug_path, log_path):
    with open(log_path, "w") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env(RFA_DEBUG_LOG=debug_path), timeout=600)
    text = log_path.read_text()
    assert proc.returncode == 0 and "done training" in text, text[-4000:]
    return text


def run_and_kill(command, debug_path, log_path, saved_line, timeout=300):
    """Start training, SIGKILL it as soon as `saved_line` (logged after the checkpoint and its
    copies are complete) appears in its log."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env(RFA_DEBUG_LOG=debug_path))
        deadline = time.monotonic() + timeout
        try:
            while saved_line not in log_path.read_text():
                assert proc.poll() is None, f"training ended before the checkpoint:\n{log_path.read_text()[-4000:]}"
                assert time.monotonic() < deadline, "no checkpoint within the time limit"
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run was not killed mid-training (exit {proc.returncode})"
    return log_path.read_text()


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(data, tmp_path):
    reference_log = run_to_end(train_command(data, tmp_path / "reference"), tmp_path / "reference.debug",
                               tmp_path / "reference.log")
    reference = json_losses(reference_log)
    assert sorted(reference) == list(range(1, MAX_UPDATE + 1))

    save_dir = tmp_path / "interrupted"
    command = train_command(data, save_dir)
    killed_log = run_and_kill(command, tmp_path / "killed.debug", tmp_path / "killed.log",
                              saved_line=f"Saved checkpoint {save_dir}/checkpoint_1_{KILL_AFTER}.pt")
    resumed_log = run_to_end(command, tmp_path / "resumed.debug", tmp_path / "resumed.log")
    assert f"Loaded checkpoint {save_dir}/checkpoint_last.pt (epoch 1 @ {KILL_AFTER} updates)" in resumed_log

    killed, resumed = json_losses(killed_log), json_losses(resumed_log)
    assert set(range(1, KILL_AFTER + 1)) <= set(killed)
    assert sorted(resumed) == list(range(KILL_AFTER + 1, MAX_UPDATE + 1))
    worst = max(abs(loss - reference[update]) for part in (killed, resumed) for update, loss in part.items())
    print(f"largest loss difference to the uninterrupted run over {len(killed) + len(resumed)} updates: {worst:.3g}")
    assert worst <= 1e-6

    # random matrices: every draw of both processes equals the uninterrupted run's draw for that
    # (update, module); the resumed process draws from update KILL_AFTER on, not from 0
    reference_draws, reference_params = debug_log(tmp_path / "reference.debug")
    for name in ("killed", "resumed"):
        draws, params = debug_log(tmp_path / f"{name}.debug")
        for key, sums in draws[0].items():
            assert sums == reference_draws[0][key], f"{name} run, (update, module) {key}: {sums} vs {reference_draws[0][key]}"
        # the last checksum logged at an update is the state that update trained from
        for update, checksums in params[0].items():
            assert checksums[-1] == reference_params[0][update][-1], f"{name} run, parameters at update {update}"
    resumed_draws, _ = debug_log(tmp_path / "resumed.debug")
    assert min(update for update, _ in resumed_draws[0]) == KILL_AFTER
    assert {update for update, _ in resumed_draws[0]} == set(range(KILL_AFTER, MAX_UPDATE))

    # checkpoint_last.pt cut short (as fairseq's own non-atomic copy could leave it, or a disk): the same
    # command resumes from the newest intact checkpoint, copies it to checkpoint_last.pt, keeps the damaged
    # file, and has nothing left to train (fairseq alone would train one more update past --max-update)
    truncated = save_dir / "checkpoint_last.pt"
    with open(truncated, "r+b") as handle:
        handle.truncate(os.path.getsize(truncated) // 2)
    proc = run("fairseq-train", *command[3:], check=False)  # the real console script (no launcher, no --unrounded)
    assert_exit_code(proc, 0)
    log = proc.stdout + proc.stderr  # fairseq logs to stdout
    assert re.search(rf"WARNING \| rfa_fairseq.resume \| {truncated} cannot be loaded \(checkpoint {truncated} is "
                     rf"truncated .*; kept as {truncated}.damaged\); resuming from {save_dir}/checkpoint\S+.pt "
                     rf"\({MAX_UPDATE} updates\), the newest intact checkpoint in {save_dir}, now also {truncated}",
                     log), log[-3000:]
    assert "nothing left to train" in log
    assert f"Loaded checkpoint {truncated} (epoch 2 @ {MAX_UPDATE} updates)" in log
    assert (save_dir / "checkpoint_last.pt.damaged").is_file()

    # no checkpoint intact: one error listing every file tried, and no training from update 0
    for path in save_dir.glob("*.pt"):
        with open(path, "r+b") as handle:
            handle.truncate(os.path.getsize(path) // 2)
    proc = run("fairseq-train", *command[3:], check=False)
    assert_exit_code(proc, 1)
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"rfa_fairseq.resume.ResumeError: no checkpoint in --save-dir {save_dir} is intact, so "
                            "training cannot resume; tried: "), error
    for path in save_dir.glob("*.pt"):
        assert f"{path}: checkpoint {path} is truncated" in error
