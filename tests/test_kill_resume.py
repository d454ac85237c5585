"""Kill training at random instants and inside every step of a checkpoint save, re-run the same
command each time, and check what a preempted cluster job needs:

- after every kill, every checkpoint name in the save directory holds a complete checkpoint (its
  checksums verify and it loads): the old file or the new one, never a part (checkpoints.save_atomic,
  copy_atomic);
- every re-run resumes from the newest intact checkpoint there (rfa_fairseq/resume.py), never from
  update 0 while one is there;
- every chain of killed runs ends, with the same command, at --max-update with the parameters of an
  uninterrupted run, bit for bit (resume is exact within an epoch, tests/test_resume.py; the run stays
  in epoch 1 because fairseq 0.12.3 itself continues slightly differently from a checkpoint written at
  or after the end of an epoch, docs/reliability.md).

Targeted kills come from tests/fairseq_train_kill.py (RFA_KILL_AT=POINT:N), random ones from this
test (SIGKILL after a random delay, seeded). A chain ends when a run is not killed (its kill point
is never reached, or its delay outlasts the training); the next chain starts in a new directory, and
a kill point that was not reached is tried again there."""
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from cli_support import TINY_MODEL, TINY_TRAIN, env, synthetic_data
from conftest import PLUGIN_DIR

from rfa_fairseq.checkpoints import CheckpointLoadError, num_updates, safe_load
from rfa_fairseq.resume import CHECKPOINT_NAME

KILL_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fairseq_train_kill.py")
MAX_UPDATE = 28  # within epoch 1 (31 updates)
SAVE_EVERY = 4
KILLS = 16
# targeted kills: each step of a save, at its first to third occurrence in a run
POINTS = ("write", "copy", "publish", "prune")
TARGETED = [f"{point}:{n}" for n in (1, 2, 3) for point in POINTS]
RANDOM_KILLS = 4
# after the run has loaded its checkpoint; the tiny training takes about a second, so some kills land
# after its end (while it exits) and some runs finish first (which ends a chain)
RANDOM_DELAY_S = (0.0, 1.2)
SEED = 26
LOADED = re.compile(r"Loaded checkpoint \S+ \(epoch (\d+) @ (\d+) updates\)")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic_data(tmp_path_factory)


def train_command(data, save_dir):
    return [sys.executable, KILL_LAUNCHER, str(data / "bin"), "--user-dir", PLUGIN_DIR, "--arch", "rfa_transformer",
            *TINY_MODEL, "--rfa-num-features", "8", *TINY_TRAIN, "--max-update", str(MAX_UPDATE),
            "--save-interval-updates", str(SAVE_EVERY), "--keep-interval-updates", "2",
            "--save-dir", str(save_dir), "--log-format", "simple", "--log-interval", "10"]


def saved_checkpoints(save_dir):
    """{name: update count} of every checkpoint name in save_dir; fails the test on one that does not load."""
    found = {}
    for name in sorted(os.listdir(save_dir)) if save_dir.is_dir() else []:
        if CHECKPOINT_NAME.fullmatch(name):
            try:
                found[name] = num_updates(safe_load(str(save_dir / name)))
            except CheckpointLoadError as exc:
                pytest.fail(f"{save_dir / name} is not a complete checkpoint after a kill: {exc}")
    return found


def run_once(command, log_path, kill_at=None, delay=None, timeout=300):
    """Run `command` to its end, or SIGKILL it: RFA_KILL_AT=kill_at, or `delay` s after it loaded its
    checkpoint. Returns (exit code, log text)."""
    extra = {"RFA_KILL_AT": kill_at} if kill_at else {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env(**extra))
        try:
            if delay is not None:
                deadline = time.monotonic() + timeout
                while proc.poll() is None and not re.search(r"Loaded checkpoint|No existing checkpoint found",
                                                            log_path.read_text()):
                    assert time.monotonic() < deadline, "the run did not start training in time"
                    time.sleep(0.02)
                time.sleep(delay)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode, log_path.read_text()


def final_parameters(save_dir):
    state = safe_load(str(save_dir / "checkpoint_last.pt"))
    return num_updates(state), state["model"]


@pytest.mark.slow
def test_killed_anywhere_the_same_command_resumes_from_the_newest_intact_checkpoint(data, tmp_path):
    started = time.monotonic()
    code, log = run_once(train_command(data, tmp_path / "reference"), tmp_path / "reference.log")
    assert code == 0 and "done training" in log, log[-3000:]
    reference_updates, reference_model = final_parameters(tmp_path / "reference")
    assert reference_updates == MAX_UPDATE

    rng = random.Random(SEED)
    planned = [("kill_at", spec) for spec in TARGETED] + [("delay", rng.uniform(*RANDOM_DELAY_S))
                                                            for _ in range(RANDOM_KILLS)]
    rng.shuffle(planned)
    kills, chains, resumes = [], 0, []
    while len(kills) < KILLS:
        save_dir = tmp_path / f"chain{chains}"
        command = train_command(data, save_dir)
        runs = 0
        while True:
            newest = max(saved_checkpoints(save_dir).values(), default=None)
            # the planned kills, then random ones until there were KILLS; then runs that are not killed,
            # as is a run with nothing left to train (killed while it exited)
            if len(kills) >= KILLS or newest == MAX_UPDATE:
                kind, value = None, None
            else:
                kind, value = planned.pop() if planned else ("delay", rng.uniform(*RANDOM_DELAY_S))
            code, log = run_once(command, tmp_path / f"chain{chains}_run{runs}.log",
                                 kill_at=value if kind == "kill_at" else None, delay=value if kind == "delay" else None)
            runs += 1
            loaded = LOADED.search(log)
            # resumed from the newest intact checkpoint, or from scratch only when there was none
            if newest is None:
                assert "No existing checkpoint found" in log, log[-3000:]
            elif code == -signal.SIGKILL and not loaded:
                # killed before it loaded: inside resume's own copy of the newest checkpoint to checkpoint_last.pt
                assert "No existing checkpoint found" not in log, log[-3000:]
            else:
                assert loaded and int(loaded[2]) == newest, (f"chain {chains} run {runs}: newest intact checkpoint "
                                                             f"at update {newest}, the run resumed:\n{log[-3000:]}")
                resumes.append(newest)
            after = saved_checkpoints(save_dir)  # every name complete, whatever the instant of the kill
            if code == -signal.SIGKILL:
                kills.append(f"{kind}={value if kind == 'kill_at' else f'{value:.2f}s'}")
                continue
            assert code == 0 and "done training" in log, f"exit {code}:\n{log[-3000:]}"
            if kind == "kill_at":  # the run ended before its kill point: try that point again in the next chain
                planned.append((kind, value))
            assert after["checkpoint_last.pt"] == MAX_UPDATE
            updates, model = final_parameters(save_dir)
            assert updates == reference_updates and model.keys() == reference_model.keys()
            for key, value in model.items():
                assert torch.equal(value, reference_model[key]), f"chain {chains}: parameter {key} differs"
            break
        chains += 1
    print(f"{len(kills)} kills in {chains} chains, {len(resumes)} resumes (from updates {resumes}), "
          f"{time.monotonic() - started:.0f} s: {', '.join(kills)}")
    targeted = {kill.split("=")[1].split(":")[0] for kill in kills if kill.startswith("kill_at")}
    assert targeted == set(POINTS), f"kill points never reached: {set(POINTS) - targeted}"
    assert sum(kill.startswith("kill_at") for kill in kills) == len(TARGETED), kills
    assert sum(kill.startswith("delay") for kill in kills) >= RANDOM_KILLS // 2, kills
