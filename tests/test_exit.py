"""fairseq's background data thread at exit (rfa_fairseq/fairseq_compat.py).

Training that stops mid-epoch (--max-update) used to abort at exit with "terminate called without an
active exception" (SIGABRT, exit code 134) when fairseq's data thread was inside torch as the
interpreter finalized. The plugin stops and joins that thread first; these tests check that it does,
that the iterator still yields the same batches and still prefetches, and that short mid-epoch runs
of fairseq-train exit with 0."""
import os
import sys
import textwrap
import time

import pytest
import torch
from cli_support import TINY_MODEL, TINY_TRAIN, run, synthetic_data
from conftest import PLUGIN_DIR

import rfa_fairseq  # noqa: F401  (installs StoppableConsumer)
from fairseq.data import iterators
from rfa_fairseq.fairseq_compat import StoppableConsumer, stop_data_threads


class Endless:
    """An epoch that never ends; counts the batches asked for."""

    def __init__(self, delay=0.0):
        self.delay, self.made = delay, 0

    def __len__(self):
        return 10**9

    def __iter__(self):
        while True:
            time.sleep(self.delay)
            self.made += 1
            yield torch.full((2,), self.made)


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_plugin_installs_the_stoppable_consumer():
    assert iterators.BackgroundConsumer is StoppableConsumer
    itr = iterators.BufferedIterator(3, [torch.tensor([1])])
    next(itr)
    assert isinstance(itr._consumer, StoppableConsumer) and itr._consumer.daemon


def test_same_batches_in_the_same_order():
    batches = [torch.full((3,), i) for i in range(25)]
    itr = iterators.BufferedIterator(4, batches)
    assert [int(b[0]) for b in itr] == list(range(25))  # ends with StopIteration (the sentinel)
    itr = iterators.BufferedIterator(4, batches).take(7)  # fairseq's take() still cuts the epoch short
    assert [int(b[0]) for b in itr] == list(range(7))


def test_a_data_error_still_reaches_training():
    def broken():
        yield torch.zeros(1)
        raise ValueError("bad batch")

    class Source:
        def __len__(self):
            return 5

        def __iter__(self):
            return broken()

    itr = iterators.BufferedIterator(2, Source())
    next(itr)
    with pytest.raises(ValueError, match="bad batch"):
        next(itr)


def test_prefetches_while_training_holds_the_batch():
    source = Endless()
    itr = iterators.BufferedIterator(5, source)
    next(itr)
    # nobody takes from the queue, yet the thread fills it (batches 2-6) and makes batch 7, which
    # waits for room: the buffer works ahead as in fairseq, and no further
    wait_until(lambda: itr._queue.full() and source.made == 7)
    time.sleep(0.3)
    assert source.made == 7 and itr._queue.qsize() == 5
    assert stop_data_threads(timeout=5) == []


def test_stop_joins_a_thread_waiting_on_its_full_queue():
    itr = iterators.BufferedIterator(2, Endless())
    next(itr)
    wait_until(lambda: itr._queue.full())
    assert stop_data_threads(timeout=5) == []  # [] : every thread joined (none left waiting on its queue)
    assert not itr._consumer.is_alive()


def test_stop_lets_the_batch_in_progress_finish_and_makes_no_more():
    source = Endless(delay=0.3)  # a slow batch: the thread is busy making one when told to stop
    itr = iterators.BufferedIterator(10, source)
    next(itr)
    wait_until(lambda: source.made >= 2)
    assert stop_data_threads(timeout=5) == []
    made = source.made
    time.sleep(0.4)
    assert source.made == made, "the stopped thread made another batch"
    assert not itr._consumer.is_alive()


# Batches made inside torch, endlessly: the data thread is always busy in a torch call.
BUSY_BATCHES = """
class Batches:
    def __len__(self):
        return 10**9

    def __iter__(self):
        while True:
            x = torch.zeros(4096)
            for _ in range(2000):
                x = x + 1
            yield x
"""

# The interpreter exits while the data thread is inside torch making a batch: without the plugin's fix
# this aborts (exit 134) every time on Python 3.11/3.12 with torch 2.13.
BUSY_AT_EXIT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {repo!r})
    import rfa_fairseq  # as --user-dir does
    from fairseq.data.iterators import BufferedIterator
""") + BUSY_BATCHES + textwrap.dedent("""
    next(BufferedIterator(10, Batches()))
    print("exiting")
""")


def test_exit_while_the_data_thread_is_inside_torch():
    script = BUSY_AT_EXIT.format(repo=os.path.dirname(PLUGIN_DIR))
    proc = run(sys.executable, "-c", script, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "exiting", f"exit code {proc.returncode}:\n{proc.stderr[-2000:]}"


# fairseq's distributed_main runs in processes started by torch.multiprocessing.spawn (a fresh
# interpreter that imports the plugin through --user-dir, then exits with sys.exit): the same exit.
SPAWNED = textwrap.dedent("""
    import sys, torch
    import torch.multiprocessing as mp
    sys.path.insert(0, {repo!r})
""") + BUSY_BATCHES + textwrap.dedent("""
    def worker(rank):
        import rfa_fairseq  # as fairseq's main() does in each worker (utils.import_user_module)
        from fairseq.data.iterators import BufferedIterator
        next(BufferedIterator(10, Batches()))

    if __name__ == "__main__":
        mp.spawn(worker, nprocs=1, join=True)  # raises if the worker died of a signal
        print("workers exited")
""")


def test_spawned_worker_exits_while_its_data_thread_is_inside_torch(tmp_path):
    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED.format(repo=os.path.dirname(PLUGIN_DIR)))
    proc = run(str(script), check=False)
    assert proc.returncode == 0 and "workers exited" in proc.stdout, f"exit code {proc.returncode}:\n{proc.stderr[-3000:]}"


# ---------------------------------------------------------------- fairseq-train, stopped mid-epoch

RUNS_PER_ARCH = 3
ARCHS = {"transformer": [], "rfa_transformer": ["--rfa-num-features", "8"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic_data(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_training_stopped_mid_epoch_exits_cleanly(data, tmp_path, arch):
    """Short fairseq-train runs that stop at update 2 of a 16-batch epoch, with fairseq's default data
    buffer (10 batches) and OMP_NUM_THREADS=1 (cli_support.env). --max-tokens 1000 (about 100
    sentences a batch) makes each batch slow enough that the data thread is still filling its
    buffer when the run exits, so without the fix (nearly) every run aborts, as short runs do on a
    loaded machine with smaller batches."""
    failures = []
    for attempt in range(RUNS_PER_ARCH):
        save_dir = tmp_path / f"run{attempt}"
        proc = run("fairseq-train", data / "bin", "--user-dir", PLUGIN_DIR, "--arch", arch, *ARCHS[arch],
                   *TINY_MODEL, *TINY_TRAIN, "--max-tokens", "1000", "--max-update", "2",
                   "--save-dir", save_dir, "--no-epoch-checkpoints", check=False)
        finished = "done training" in proc.stdout and (save_dir / "checkpoint_last.pt").is_file()
        if proc.returncode != 0 or not finished:
            failures.append(f"run {attempt}: exit code {proc.returncode}, finished: {finished}\n{proc.stderr[-1500:]}")
    assert not failures, f"{len(failures)} of {RUNS_PER_ARCH} runs failed:\n" + "\n".join(failures)
