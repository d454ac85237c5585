"""Data-parallel training with 2 CPU processes (gloo, one process per rank, as torchrun/SLURM
launch them): the ranks draw identical random matrices without communicating, new ones at every
update, and keep identical parameters; resuming loads the checkpoint on rank 0 and broadcasts it."""
import os
import signal
import subprocess
import sys

import pytest
from cli_support import DEBUG_LOG_TRAIN, TINY_MODEL, TINY_TRAIN, debug_log, env, free_port, synthetic_data
from conftest import PLUGIN_DIR

KILL_TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fairseq_train_kill.py")

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic_data(tmp_path_factory)


def rank_command(data, save_dir, max_update, rank, port, launcher=DEBUG_LOG_TRAIN):
    return [
        sys.executable, launcher, str(data / "bin"), "--user-dir", PLUGIN_DIR,
        "--arch", "rfa_transformer", *TINY_MODEL, "--rfa-feature-map", "sincos", "--rfa-num-features", "8", "--no-rfa-softmax-cross-attn", *TINY_TRAIN,
        "--max-update", str(max_update), "--save-dir", str(save_dir), "--save-interval-updates", "4",
        "--no-epoch-checkpoints", "--log-format", "json", "--log-interval", "1",
        "--ddp-backend", "legacy_ddp", "--distributed-backend", "gloo",
        "--distributed-world-size", str(WORLD_SIZE), "--distributed-no-spawn",
        "--distributed-init-method", f"tcp://127.0.0.1:{port}",
        "--distributed-rank", str(rank), "--device-id", str(rank),
    ]


def train_two_ranks(data, save_dir, debug_path, max_update, timeout=300):
    """Launch fairseq-train (with the tests' debug-log hooks) once per rank (--distributed-no-spawn) and wait for both."""
    port = free_port()
    procs, logs = [], []
    for rank in range(WORLD_SIZE):
        log = open(save_dir.parent / f"{save_dir.name}_rank{rank}.log", "w")
        command = rank_command(data, save_dir, max_update, rank, port)
        procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                      env=env(RFA_DEBUG_LOG=debug_path)))
        logs.append(log)
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:  # one rank died and the other waits for it forever
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    outputs = [(save_dir.parent / f"{save_dir.name}_rank{rank}.log").read_text() for rank in range(WORLD_SIZE)]
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed ({proc.returncode}):\n{out[-4000:]}"
    # fairseq logs INFO on rank 0 only; the other ranks' progress shows in the debug log
    assert "done training" in outputs[0], outputs[0][-4000:]
    return outputs


def assert_ranks_agree(debug_path, updates):
    draws, params = debug_log(debug_path)
    assert sorted(draws) == sorted(params) == list(range(WORLD_SIZE))
    modules = sorted({module for _, module in draws[0]})
    assert modules == [0, 1], "tiny model: decoder self-attention and cross-attention"
    for update in updates:
        for module in modules:
            sums = [draws[rank][(update, module)] for rank in range(WORLD_SIZE)]
            assert sums[0] and sums[0] == sums[1], f"update {update} module {module}: ranks drew {sums}"
        # the last checksum logged for an update is the one training continued from
        checksums = [params[rank][update][-1] for rank in range(WORLD_SIZE)]
        assert checksums[0] == checksums[1], f"update {update}: parameter checksums differ across ranks {checksums}"
    for module in modules:
        per_update = [draws[0][(update, module)][0] for update in updates]
        assert len(set(per_update)) == len(per_update), f"module {module} reused a random matrix: {per_update}"
    # inverse_sqrt warms up from lr 0, so update 0 leaves the parameters as they are
    trained = [params[0][update][-1] for update in updates if update > 0]
    assert len(set(trained)) == len(trained), f"the parameters must change at every update: {trained}"
    return draws, params


@pytest.mark.slow
def test_two_ranks_share_random_matrices_and_parameters_then_resume(data, tmp_path):
    save_dir = tmp_path / "ckpt"
    first_log = tmp_path / "debug_first.log"
    outputs = train_two_ranks(data, save_dir, first_log, max_update=8)
    assert "distributed init (rank 1)" in outputs[1]
    assert_ranks_agree(first_log, updates=range(8))
    assert (save_dir / "checkpoint_last.pt").is_file()

    # resume with both ranks: rank 0 reads checkpoint_last.pt, rank 1 receives it by broadcast
    # (a torch.load of omegaconf objects that only the plugin's scoped allowlist permits)
    resumed_log = tmp_path / "debug_resumed.log"
    outputs = train_two_ranks(data, save_dir, resumed_log, max_update=12)
    assert "Loaded checkpoint" in outputs[0] and "(epoch 1 @ 8 updates)" in outputs[0]
    # rank 1 trained on from the broadcast state: same checksums as rank 0 at every update
    draws, params = assert_ranks_agree(resumed_log, updates=range(8, 12))
    assert min(update for update, _ in draws[1]) == 8, "the resumed run continues the update numbering"
    first_draws, _ = debug_log(first_log)
    assert draws[0][(8, 0)][0] not in {sums[0] for sums in first_draws[0].values()}


@pytest.mark.slow
def test_rank_0_killed_inside_a_save_then_both_ranks_resume_from_the_newest_intact_checkpoint(data, tmp_path):
    """Rank 0 writes the checkpoints (through the plugin's atomic writes in its process too): killed
    half-way through copying the first checkpoint to checkpoint_best.pt, before checkpoint_last.pt
    existed. The other rank then waits in a collective and is killed as a scheduler would. The same
    command on both ranks resumes from checkpoint_1_4.pt, chosen on rank 0 and broadcast."""
    save_dir = tmp_path / "ckpt"
    port = free_port()
    with open(tmp_path / "killed_rank0.log", "w") as log0, open(tmp_path / "killed_rank1.log", "w") as log1:
        procs = [subprocess.Popen(rank_command(data, save_dir, 8, rank, port, launcher=KILL_TRAIN), stdout=log,
                                  stderr=subprocess.STDOUT, env=env(RFA_KILL_AT="copy:1"))
                 for rank, log in enumerate((log0, log1))]
        try:
            assert procs[0].wait(timeout=300) == -signal.SIGKILL, (tmp_path / "killed_rank0.log").read_text()[-3000:]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
    names = sorted(path.name for path in save_dir.glob("checkpoint*.pt"))
    assert names == ["checkpoint_1_4.pt"], names  # no torn checkpoint_best.pt, no checkpoint_last.pt yet

    outputs = train_two_ranks(data, save_dir, tmp_path / "debug_resumed.log", max_update=8)
    assert (f"WARNING | rfa_fairseq.resume | {save_dir}/checkpoint_last.pt is missing (the run was stopped before "
            f"writing it); resuming from {save_dir}/checkpoint_1_4.pt (4 updates)") in outputs[0]
    assert f"Loaded checkpoint {save_dir}/checkpoint_last.pt (epoch 1 @ 4 updates)" in outputs[0]
    assert_ranks_agree(tmp_path / "debug_resumed.log", updates=range(4, 8))
    assert sorted(path.name for path in save_dir.iterdir() if ".tmp" in path.name) == []
