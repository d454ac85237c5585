"""Data-parallel training with 2 CPU processes (gloo, one process per rank, as torchrun/SLURM
launch them): the ranks draw identical random matrices without communicating, new ones at every
update, and keep identical parameters; resuming loads the checkpoint on rank 0 and broadcasts it."""
import subprocess
import sys

import pytest
from cli_support import DEBUG_LOG_TRAIN, TINY_MODEL, TINY_TRAIN, debug_log, env, free_port, synthetic_data
from conftest import PLUGIN_DIR

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic_data(tmp_path_factory)


def train_two_ranks(data, save_dir, debug_path, max_update, timeout=300):
    """Launch fairseq-train (with the tests' debug-log hooks) once per rank (--distributed-no-spawn) and wait for both."""
    port = free_port()
    procs, logs = [], []
    for rank in range(WORLD_SIZE):
        log = open(save_dir.parent / f"{save_dir.name}_rank{rank}.log", "w")
        command = [
            sys.executable, DEBUG_LOG_TRAIN, str(data / "bin"), "--user-dir", PLUGIN_DIR,
            "--arch", "rfa_transformer", *TINY_MODEL, "--rfa-feature-map", "sincos", "--rfa-num-features", "8", "--no-rfa-softmax-cross-attn", *TINY_TRAIN,
            "--max-update", str(max_update), "--save-dir", str(save_dir), "--save-interval-updates", "4",
            "--no-epoch-checkpoints", "--log-format", "json", "--log-interval", "1",
            "--ddp-backend", "legacy_ddp", "--distributed-backend", "gloo",
            "--distributed-world-size", str(WORLD_SIZE), "--distributed-no-spawn",
            "--distributed-init-method", f"tcp://127.0.0.1:{port}",
            "--distributed-rank", str(rank), "--device-id", str(rank),
        ]
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
