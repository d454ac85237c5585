"""Loading the fused C++ kernels never hangs (issue 18): the prebuilt module takes no lock and a stale
one is refused; the JIT path removes the `lock` file a killed process left in torch's build directory (where
torch's lock is a baton, torch <= 2.13; from 2.14 torch's own lock is released by the kernel and the file is
harmless), waits for another live builder only a bounded time, then falls back (auto) or fails clearly (cpp).

JIT builds run in subprocesses only, from copies of one build (fixture jit_build; a compile takes one to
two minutes here): torch's in-process versioner would rebuild when a process loads from a second directory.
"""
import dataclasses
import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from cli_support import TESTS, TINY_MODEL, TINY_TRAIN, assert_exit_code, env, run, synthetic_data
from conftest import PLUGIN_DIR, REPO

from rfa_fairseq.cpu import extension
from rfa_fairseq.cpu.extension import load_fused_extension, require_fused_extension
from rfa_fairseq.kernel_choice import step_kernels
from rfa_fairseq.torch_internals import torch_build_lock_is_a_baton

# torch <= 2.13: a left `lock` file blocks every later load, and the JIT path removes it; torch >= 2.14: torch's
# lock is released by the kernel, the file stays after every load and blocks nothing
BATON = torch_build_lock_is_a_baton()

GENERATE_JIT = os.path.join(TESTS, "fairseq_generate_jit.py")
CPP = ["--model-overrides", "{'rfa_decode_kernel': 'cpp'}"]
TEST_SENTENCES = 40  # synthetic_data's test split
JIT_BUILD_CACHE_PREFIX = "rfa_jit_build_"  # pytest's cache directory of the session's JIT build

# one decoding step with the C++ kernels from the JIT path (kernel="cpp": an error, not the torch path,
# when they cannot be had), checked against the torch path; prints the module's file
JIT_STEP = textwrap.dedent("""
    import torch
    from rfa_fairseq.cpu import extension
    from rfa_fairseq.kernel_choice import step_kernels
    extension.import_prebuilt = lambda: (None, "skipped by the test")
    g = torch.Generator().manual_seed(0)
    phi_q, phi_k = torch.rand(3, 16, generator=g), torch.rand(3, 16, generator=g)
    v, state, order = torch.randn(3, 8, generator=g), torch.rand(3, 2, 8, 5, generator=g), torch.tensor([2, 0, 0])
    cpp = step_kernels("cpp", torch.device("cpu"), torch.float32)  # the native step's kernels, from the JIT build
    out, new_state = torch.empty(3, 8), torch.empty(3, 2, 8, 5)
    cpp.ext.causal_layer_step(phi_q, phi_k, v, None, None, state, order, new_state, out, 1e-3, "features", None, None)
    want_state = torch.empty(3, 2, 8, 5)
    want = step_kernels("torch", torch.device("cpu"), torch.float32).causal_layer_step(
        phi_q, phi_k, v, None, None, state, order, want_state, 1e-3)
    torch.testing.assert_close((out, new_state), (want, want_state))
    print("module", extension.require_fused_extension().__file__)
""")

# the JIT path up to torch's load (in its build process), which then stops inside, holding torch's lock file, until
# killed: the pinned ninja (ninja.BIN_DIR, first on the build process's PATH) is argv[2]'s, which never ends a build
HANG_INSIDE_TORCH_LOAD = textwrap.dedent("""
    import sys
    import ninja
    from rfa_fairseq.cpu import extension

    ninja.BIN_DIR = sys.argv[2]
    extension.build_jit()
""")
# a ninja that answers --version and tells the test (a file, argv[1]) that a build started, then never ends it
NINJA_THAT_NEVER_ENDS = textwrap.dedent("""\
    #!/bin/sh
    if [ "$1" = --version ]; then echo 1.13.2; exit 0; fi
    : > {inside}
    exec sleep 600
""")


# holds our build flock, as a live process building the kernels does, until killed
HOLD_BUILD_LOCK = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(600)
""")


def python(code, *args, timeout=300, **env_extra):
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          env=env(**env_extra), timeout=timeout, cwd=REPO)


def toolchain_missing():
    return [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]


def build_dir(extensions_dir: Path) -> Path:
    """torch's JIT build directory of the kernels under TORCH_EXTENSIONS_DIR=extensions_dir."""
    return extensions_dir / extension.JIT_NAME


def generate(data, checkpoint, *extra, tool="fairseq-generate", launcher_args=(), timeout=300, **env_extra):
    """fairseq-generate (or a launcher of it, with launcher_args first) on the test split: the process and
    its hypotheses."""
    proc = run(tool, *launcher_args, data / "bin", "--user-dir", PLUGIN_DIR, "--path", checkpoint,
               "--gen-subset", "test", "--beam", "2", "--batch-size", "16", "--required-batch-size-multiple", "1",
               "--cpu", *extra, check=False, timeout=timeout, **env_extra)
    return proc, [line for line in proc.stdout.splitlines() if line.startswith("H-")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic_data(tmp_path_factory)


@pytest.fixture(scope="module")
def checkpoint(data, tmp_path_factory):
    """A tiny rfa_transformer (decoder self-attention decodes with the fused step)."""
    save_dir = tmp_path_factory.mktemp("extension_ckpt")
    run("fairseq-train", data / "bin", "--user-dir", PLUGIN_DIR, "--arch", "rfa_transformer", *TINY_MODEL,
        "--rfa-num-features", "8", *TINY_TRAIN, "--max-update", "2", "--save-dir", save_dir, "--no-epoch-checkpoints")
    return save_dir / "checkpoint_last.pt"


@pytest.fixture(scope="session")
def jit_build(request, tmp_path_factory):
    """A TORCH_EXTENSIONS_DIR holding a finished JIT build of the kernels. Kept in pytest's cache, keyed by
    the sources, flags, torch, Python and checkout, so that only the first session pays the compile (one
    to two minutes here); the tests use copies, and a second session's load of it is a no-op."""
    if toolchain_missing():
        pytest.skip(f"no JIT build without a C++ toolchain: {', '.join(toolchain_missing())} not on PATH")
    key = hashlib.sha256("\0".join([extension.build_hash(torch.__version__), sys.prefix, REPO]).encode()).hexdigest()
    cache = getattr(request.config, "cache", None)  # None with -p no:cacheprovider
    if cache is None:
        extensions_dir = tmp_path_factory.mktemp("torch_extensions_built")
    else:
        extensions_dir = Path(cache.mkdir(f"{JIT_BUILD_CACHE_PREFIX}{key[:16]}"))
        for stale in extensions_dir.parent.glob(f"{JIT_BUILD_CACHE_PREFIX}*"):  # builds of other sources
            if stale != extensions_dir:
                shutil.rmtree(stale, ignore_errors=True)
    proc = python(JIT_STEP, timeout=900, TORCH_EXTENSIONS_DIR=extensions_dir)
    assert proc.returncode == 0, f"the JIT build failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return extensions_dir


@pytest.fixture
def jit_extensions_dir(jit_build, tmp_path):
    """A private copy of the session's JIT build; copy2 keeps the mtimes, so ninja finds it up to date."""
    return Path(shutil.copytree(jit_build, tmp_path / "torch_extensions"))


@pytest.fixture
def prebuilt():
    """The prebuilt module (setup.py); skipped only where no C++ compiler could have built it."""
    module, why_not = extension.import_prebuilt()
    if module is None:
        if toolchain_missing():
            pytest.skip(f"no prebuilt module without a C++ toolchain ({why_not})")
        pytest.fail(f"the prebuilt module is not usable ({why_not}): install with bash scripts/setup_env.sh")
    return module


@pytest.fixture
def fresh_loader():
    """The process-wide loading results are cached: start and end each test without them."""
    extension._loaded_once.cache_clear()
    extension.load_fused_extension.cache_clear()
    yield
    extension._loaded_once.cache_clear()
    extension.load_fused_extension.cache_clear()


# ---------------------------------------------------------------- the prebuilt module


def test_build_hash_covers_every_source_header_flag_and_torch(tmp_path, monkeypatch):
    csrc = Path(shutil.copytree(extension.CSRC_DIR, tmp_path / "csrc"))
    monkeypatch.setattr(extension, "CSRC_DIR", csrc)
    hashes = [extension.build_hash("2.13.0")]
    assert extension.build_hash("2.13.0") == hashes[0]  # a function of the files, not of the call

    (csrc / "rfa_more_kernels.cpp").write_text("// another kernel\n")
    hashes.append(extension.build_hash("2.13.0"))
    (csrc / "rfa_more_kernels.cpp").write_text("// another kernel, edited\n")
    hashes.append(extension.build_hash("2.13.0"))
    (csrc / "rfa_common.h").write_text("#pragma once\n")
    hashes.append(extension.build_hash("2.13.0"))
    (csrc / "levels" / "simd.h").write_text((csrc / "levels" / "simd.h").read_text() + "// edited\n")
    hashes.append(extension.build_hash("2.13.0"))
    edited = tuple(dataclasses.replace(level, flags=(*level.flags, "-DEDITED")) for level in extension.LEVELS_TABLE.LEVELS)
    monkeypatch.setattr(extension.LEVELS_TABLE, "LEVELS", edited)  # a level's flags (cpu/levels.py) changed
    hashes.append(extension.build_hash("2.13.0"))
    hashes.append(extension.build_hash("2.14.0"))
    monkeypatch.setattr(extension, "EXTRA_CFLAGS", [*extension.EXTRA_CFLAGS, "-ffast-math"])
    hashes.append(extension.build_hash("2.14.0"))
    assert len(set(hashes)) == len(hashes), hashes
    assert extension.compile_flags("2.14.0")[-1] == f"-D{extension.BUILD_HASH_DEFINE}={hashes[-1]}"


def test_every_cpp_file_is_a_source(tmp_path, monkeypatch):
    csrc = Path(shutil.copytree(extension.CSRC_DIR, tmp_path / "csrc"))
    (csrc / "a_new_kernel.cpp").write_text("")
    (csrc / "notes.txt").write_text("")
    monkeypatch.setattr(extension, "CSRC_DIR", csrc)
    assert extension.source_files() == sorted(csrc.glob("*.cpp"))
    assert csrc / "a_new_kernel.cpp" in extension.source_files()
    for path in csrc.glob("*.cpp"):
        path.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"no C++ sources (*.cpp) in {csrc}")):
        extension.source_files()


def test_the_prebuilt_module_is_what_decoding_loads(prebuilt, fresh_loader):
    assert prebuilt.__name__ == extension.PREBUILT_MODULE
    assert prebuilt.build_hash == extension.build_hash(torch.__version__)
    # where `import rfa_fairseq` finds it: next to extension.py (in the source tree for editable installs)
    assert Path(prebuilt.__file__).parent == Path(extension.__file__).parent
    assert load_fused_extension() is prebuilt
    assert require_fused_extension() is prebuilt
    if Path(prebuilt.__file__).is_relative_to(REPO) and (Path(REPO) / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", prebuilt.__file__], cwd=REPO, timeout=60)
        assert ignored.returncode == 0, f"{prebuilt.__file__} is compiled into the source tree but not git-ignored"


def test_a_stale_prebuilt_module_is_refused_and_the_jit_path_used(prebuilt, tmp_path, monkeypatch, caplog):
    csrc = Path(shutil.copytree(extension.CSRC_DIR, tmp_path / "csrc"))
    (csrc / "rfa_more_kernels.cpp").write_text("// a kernel added after the install\n")
    monkeypatch.setattr(extension, "CSRC_DIR", csrc)
    module, why_not = extension.import_prebuilt()
    assert module is None
    assert why_not.startswith(f"{prebuilt.__file__} is stale: it was built from other sources, flags or torch")
    assert "reinstall (bash scripts/setup_env.sh) to rebuild it" in why_not

    jit_builds = []
    monkeypatch.setattr(extension, "build_jit", lambda lock_timeout_s=None: jit_builds.append(1) or ("jit", None))
    with caplog.at_level("WARNING", logger=extension.__name__):
        assert extension.load_extension() == ("jit", None)
    assert jit_builds == [1]
    assert any("the prebuilt fused C++ kernels are not used" in r.getMessage() and "is stale" in r.getMessage()
               for r in caplog.records), caplog.text


@pytest.mark.slow
def test_generate_decodes_with_the_prebuilt_module_without_torch_lock(prebuilt, data, checkpoint, tmp_path):
    """An empty TORCH_EXTENSIONS_DIR stays empty: no JIT build directory, no lock file was made."""
    extensions_dir = tmp_path / "torch_extensions"
    extensions_dir.mkdir()
    proc, hypotheses = generate(data, checkpoint, *CPP, TORCH_EXTENSIONS_DIR=extensions_dir)
    assert_exit_code(proc, 0)
    assert len(hypotheses) == TEST_SENTENCES
    assert list(extensions_dir.iterdir()) == []


# ---------------------------------------------------------------- the JIT path


@pytest.mark.slow
def test_a_stale_torch_lock_is_removed_and_the_step_runs(jit_extensions_dir):
    torch_lock = build_dir(jit_extensions_dir) / extension.TORCH_LOCK_NAME
    torch_lock.touch()  # what a process killed inside torch's load leaves
    objects = {p: p.stat().st_mtime_ns for p in build_dir(jit_extensions_dir).glob("*.o")}
    assert {p.name for p in objects} == {p.stem + ".o" for p in extension.source_files()}  # every .cpp, one module
    proc = python(JIT_STEP, timeout=180, TORCH_EXTENSIONS_DIR=jit_extensions_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    removed = f"removed the stale lock file {torch_lock}, left by a process that was killed" in proc.stderr
    assert removed == BATON
    assert torch_lock.exists() != BATON
    assert f"module {build_dir(jit_extensions_dir)}" in proc.stdout
    assert {p: p.stat().st_mtime_ns for p in objects} == objects, "the copied build was compiled again"


@pytest.mark.slow
def test_sigkill_inside_torch_load_does_not_block_the_next_generate(jit_extensions_dir, data, checkpoint, tmp_path):
    torch_lock = build_dir(jit_extensions_dir) / extension.TORCH_LOCK_NAME
    inside = tmp_path / "inside_torch_load"
    fake_ninja_dir = tmp_path / "ninja_bin"
    fake_ninja_dir.mkdir()
    (fake_ninja_dir / "ninja").write_text(NINJA_THAT_NEVER_ENDS.format(inside=inside))
    (fake_ninja_dir / "ninja").chmod(0o755)
    # its own process group: the SIGKILL reaches the process, torch's load in its build process, and ninja
    killed = subprocess.Popen([sys.executable, "-c", HANG_INSIDE_TORCH_LOAD, str(inside), str(fake_ninja_dir)],
                              cwd=REPO, env=env(TORCH_EXTENSIONS_DIR=jit_extensions_dir), start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not inside.exists():
            assert killed.poll() is None, f"the process ended before torch's load:\n{killed.stdout.read()}"
            assert time.monotonic() < deadline, "the process did not reach torch's load within 120 s"
            time.sleep(0.05)
        assert torch_lock.exists(), "torch's load holds its lock file while it builds"
        os.killpg(killed.pid, signal.SIGKILL)
        assert killed.wait(timeout=60) == -signal.SIGKILL
    finally:
        if killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
            killed.wait(timeout=60)
        killed.stdout.close()
    assert torch_lock.exists(), "the SIGKILL left torch's lock file behind"

    proc, hypotheses = generate(data, checkpoint, *CPP, tool=GENERATE_JIT, timeout=300,
                                TORCH_EXTENSIONS_DIR=jit_extensions_dir)
    assert_exit_code(proc, 0)
    assert len(hypotheses) == TEST_SENTENCES
    assert (f"removed the stale lock file {torch_lock}" in proc.stderr) == BATON
    assert torch_lock.exists() != BATON


@pytest.mark.parametrize("breakage", ["failing compiler", "unusable TORCH_EXTENSIONS_DIR"])
@pytest.mark.slow
def test_cpp_kernel_without_a_buildable_extension_fails_clearly(breakage, data, checkpoint, tmp_path):
    if breakage == "failing compiler":
        extensions_dir = tmp_path / "torch_extensions"
        broken = {"TORCH_EXTENSIONS_DIR": extensions_dir, "CXX": "/bin/false"}
        cause = f"the just-in-time build in {build_dir(extensions_dir)} failed: "
    else:
        (tmp_path / "a_file").write_text("")
        broken = {"TORCH_EXTENSIONS_DIR": tmp_path / "a_file" / "torch_extensions"}  # no directory can be made
        cause = "the just-in-time build failed: NotADirectoryError: "
    proc, _ = generate(data, checkpoint, *CPP, tool=GENERATE_JIT, timeout=300, **broken)
    assert_exit_code(proc, 1)
    assert ("RuntimeError: --rfa-decode-kernel cpp: the fused C++ decoding step is not available (the prebuilt "
            "module is skipped by tests/fairseq_generate_jit.py; " + cause) in proc.stderr
    assert "use --rfa-decode-kernel torch (or auto, which falls back to it)" in proc.stderr


def test_the_build_process_gets_the_pinned_ninja_first_and_this_process_keeps_its_path(monkeypatch):
    """torch's load runs ninja from its process's PATH: the JIT build's process gets the pinned ninja first, and this
    process's environment is not changed for it."""
    ninja = pytest.importorskip("ninja", reason="the ninja package is not installed (nothing is pinned)")
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin"]))
    before = dict(os.environ)
    build_env = extension.jit_build_environment()
    assert build_env["PATH"] == os.pathsep.join([ninja.BIN_DIR, "/usr/bin", "/bin"])
    assert dict(os.environ) == before
    assert {k: v for k, v in build_env.items() if k != "PATH"} == {k: v for k, v in before.items() if k != "PATH"}
    monkeypatch.setenv("PATH", os.pathsep.join([ninja.BIN_DIR, "/usr/bin"]))  # first already: kept as it is
    assert extension.jit_build_environment()["PATH"] == os.environ["PATH"]


@pytest.fixture
def build_lock_held(tmp_path, monkeypatch):
    """(TORCH_EXTENSIONS_DIR, our flock file) with the flock held by another live process."""
    extensions_dir = tmp_path / "torch_extensions"
    build_dir(extensions_dir).mkdir(parents=True)
    lock_path = build_dir(extensions_dir) / extension.BUILD_LOCK_NAME
    holder = subprocess.Popen([sys.executable, "-c", HOLD_BUILD_LOCK, str(lock_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions_dir))
        yield extensions_dir, lock_path
    finally:
        holder.kill()
        holder.wait(timeout=60)
        holder.stdout.close()


def test_a_live_builder_is_waited_for_a_bounded_time_then_auto_falls_back_and_cpp_fails(
        build_lock_held, monkeypatch, fresh_loader):
    extensions_dir, lock_path = build_lock_held
    torch_lock = build_dir(extensions_dir) / extension.TORCH_LOCK_NAME
    torch_lock.touch()  # the live builder's: must not be removed while it holds our flock

    module, why_not = extension.build_jit(lock_timeout_s=1.0)
    assert module is None
    assert why_not == (f"another process is building or loading the fused C++ kernels and held {lock_path} "
                       "for more than 1 s")
    assert not any(build_dir(extensions_dir).glob("*.o")), "nothing was built"
    assert torch_lock.exists()

    # the public path: the prebuilt module unusable, the default wait shortened
    monkeypatch.setattr(extension, "import_prebuilt", lambda: (None, "skipped by the test"))
    monkeypatch.setattr(extension, "BUILD_LOCK_TIMEOUT_S", 1.0)
    cpu = torch.device("cpu")
    with pytest.warns(UserWarning) as warned:
        chosen = [step_kernels("auto", cpu, torch.float32) for _ in range(2)]  # two batches
    with pytest.raises(RuntimeError) as error:
        step_kernels("cpp", cpu, torch.float32)
    messages = [str(w.message) for w in warned]
    assert len(messages) == 1, messages  # one warning per process, not one per batch
    assert str(lock_path) in messages[0] and "--rfa-decode-kernel torch" in messages[0]
    assert [kernels.name for kernels in chosen] == ["torch", "torch"]  # auto falls back on the torch kernels
    assert str(lock_path) in str(error.value) and "--rfa-decode-kernel torch" in str(error.value)
    assert str(error.value).startswith("--rfa-decode-kernel cpp: the fused C++ decoding step is not available")
    assert torch_lock.exists()


@pytest.mark.slow
def test_generate_falls_back_while_another_process_builds(build_lock_held, data, checkpoint):
    extensions_dir, lock_path = build_lock_held
    short_wait = ["--build-lock-timeout-s", "2"]
    proc, hypotheses = generate(data, checkpoint, tool=GENERATE_JIT, launcher_args=short_wait,
                                TORCH_EXTENSIONS_DIR=extensions_dir)
    assert_exit_code(proc, 0)
    assert len(hypotheses) == TEST_SENTENCES
    assert proc.stderr.count("the fused C++ decoding step is not available") == 1
    assert f"held {lock_path} for more than 2 s" in proc.stderr and "--rfa-decode-kernel torch" in proc.stderr

    proc, _ = generate(data, checkpoint, *CPP, tool=GENERATE_JIT, launcher_args=short_wait,
                       TORCH_EXTENSIONS_DIR=extensions_dir)
    assert_exit_code(proc, 1)
    assert f"held {lock_path} for more than 2 s" in proc.stderr


def test_a_dead_holder_releases_the_build_lock(tmp_path):
    """flock is released by the kernel when its holder is SIGKILLed: the next process gets it at once."""
    lock_path = tmp_path / extension.BUILD_LOCK_NAME
    holder = subprocess.Popen([sys.executable, "-c", HOLD_BUILD_LOCK, str(lock_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(extension.BuildLockTimeout):
            with extension.build_lock(tmp_path, timeout_s=0.3):
                pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=60)
        holder.stdout.close()
    with extension.build_lock(tmp_path, timeout_s=0.0) as held:  # free at once: no wait allowed
        assert held.path == lock_path
        fd = os.open(lock_path, os.O_RDWR)
        try:  # held now: another open file description cannot take it
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


# ---------------------------------------------------------------- install: setup.py and setup_env.sh


def test_setup_py_skips_the_kernels_without_torch():
    """An isolated pip build has no torch: the install is pure Python (JIT at first use), not a failure."""
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version']; "
            "runpy.run_path('setup.py', run_name='__main__')")
    proc = python(code, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == __import__("rfa_fairseq").__version__
    assert "torch is not importable in this build environment" in proc.stderr
    assert "the fused C++ kernels are not built now" in proc.stderr


def test_setup_py_installs_without_the_kernels_when_the_compiler_fails(tmp_path):
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "temp")], capture_output=True, text=True, cwd=REPO,
                          env=env(CC="/bin/false", CXX="/bin/false"), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "rfa-fairseq setup.py: the fused C++ kernels were not built (" in proc.stderr
    assert not list(tmp_path.glob("lib/**/*.so"))


def test_setup_env_stamp_changes_with_the_cpp_sources(tmp_path):
    """A changed or added kernel makes scripts/setup_env.sh reinstall, which rebuilds the module."""
    for name in ("scripts/constraints.txt", "setup.cfg", "setup.py", "pyproject.toml", "scripts/setup_env.sh",
                 "rfa_fairseq/cpu/extension.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(REPO, name), tmp_path / name)
    shutil.copytree(extension.CSRC_DIR, tmp_path / "rfa_fairseq/cpu/csrc")

    def stamp():
        proc = subprocess.run(["bash", str(tmp_path / "scripts/setup_env.sh"), "--print-stamp"], capture_output=True,
                              text=True, timeout=60, env=env(RFA_VENV=tmp_path / "no_venv"))
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    stamps = [stamp()]
    assert stamp() == stamps[0] and re.fullmatch(r"[0-9a-f]{64}", stamps[0])
    (tmp_path / "rfa_fairseq/cpu/csrc/rfa_more_kernels.cpp").write_text("// another kernel\n")
    stamps.append(stamp())
    source = tmp_path / "rfa_fairseq/cpu/csrc/step_kernels.cpp"
    source.write_text(source.read_text() + "// edited\n")
    stamps.append(stamp())
    level_header = tmp_path / "rfa_fairseq/cpu/csrc/levels/simd.h"
    level_header.write_text(level_header.read_text() + "// edited\n")
    stamps.append(stamp())
    assert len(set(stamps)) == 4, stamps
    assert not (tmp_path / "no_venv").exists()
