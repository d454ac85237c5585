"""The fused C++ kernels (every .cpp in cpu/csrc and the CPU kernels' levels, compiled into one module), loaded in
one place.

    load_fused_extension()     the module, or None (one warning saying why; callers use the torch path)
    require_fused_extension()  the module, or a RuntimeError saying why (--rfa-decode-kernel cpp)

Where the module comes from, first that works:

1. Prebuilt: `pip install` (scripts/setup_env.sh) compiles the sources ahead of time into
   `rfa_fairseq.cpu._cpp_kernels` (setup.py) when torch is importable in the build environment.
   Importing it takes no lock. It carries `build_hash`, a hash of the sources, the compiler flags and
   the torch version it was built from (BUILD_HASH_DEFINE); a module whose hash differs from that of
   the files now in csrc/ is stale and not used (logged), nor is one that does not import.
2. Just in time (JIT): torch.utils.cpp_extension.load, built once and cached in the build directory
   JIT_NAME under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions/py3XX_cpu/). torch's load runs in a child
   process, whose environment names the pinned ninja first on PATH (jit_build_environment); this process then
   imports the built library.

Up to torch 2.13, torch's load takes the file `lock` in that directory (O_CREAT|O_EXCL,
torch/utils/file_baton.py) on every call, cached build or not, and a process that finds the file sleeps
until it is gone: forever when a killed process left it. (From torch 2.14 that file is a kernel-released
file lock, left in place after every load and harmless: torch_internals.torch_build_lock_is_a_baton.) So
the JIT path here first takes a lock of its own, an fcntl.flock on BUILD_LOCK_NAME in the same directory,
which the kernel releases when its holder dies (SIGKILL included), and waits for it at most
BUILD_LOCK_TIMEOUT_S. Every process that builds in this directory takes that flock first (no version of the
package without it used JIT_NAME), so while it is held a baton `lock` file can only be stale: it is removed,
with a warning naming it, before torch's load runs. When the flock cannot be had in time (another live
process is building), the kernels are unavailable: the torch path runs (auto) or a RuntimeError says so
(cpp), naming the lock file; nothing waits forever.

The CPU kernels (csrc/levels/level_kernels.cpp) are one source compiled once per instruction-set level of the
architecture (cpu/levels.py's table: each level's instructions and torch's CPU_CAPABILITY, as torch compiles its own
CPU kernels),
in parallel, into objects linked into the module (`compile_level_objects`, both builds); the module picks a level
when a runtime is built (csrc/cpu_kernels.h, --rfa-cpu-isa). An object whose source, headers and flags are unchanged
is not compiled again.

Importing this file needs only the standard library: setup.py loads it by path for the source list and
the flags, so the ahead-of-time and the JIT build compile the same files with the same flags.
"""
import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

CSRC_DIR = Path(__file__).with_name("csrc")
PREBUILT_MODULE = "rfa_fairseq.cpu._cpp_kernels"  # setup.py's setuptools extension
JIT_NAME = "rfa_fairseq_cpp_kernels"  # torch's build directory and module name for JIT builds
# -g0: setuptools compiles with Python's own CFLAGS, whose -g makes a 10 MB module instead of 0.3 MB
EXTRA_CFLAGS = ["-O3", "-fopenmp", "-g0"]
EXTRA_LDFLAGS = ["-fopenmp"]
# csrc/*.cpp are the module's sources, csrc/levels/level_kernels.cpp the levels'; every file of these suffixes under
# csrc enters the hash (and the package data)
HASHED_SUFFIXES = (".cpp", ".h", ".hpp")
LEVEL_SOURCE = CSRC_DIR / "levels" / "level_kernels.cpp"
LEVEL_DIR_NAME = "rfa_levels"  # the level objects' directory inside a build directory
LEVEL_STD = "-std=c++20"  # torch's own C++ standard for its extensions (2.13 and newer)
BUILD_HASH_DEFINE = "RFA_BUILD_HASH"

BUILD_LOCK_NAME = "rfa_build.flock"
TORCH_LOCK_NAME = "lock"  # torch.utils.cpp_extension's lock file in the build directory
# a JIT build takes about a minute on 2 busy cores: 5 minutes is well past a slow one
BUILD_LOCK_TIMEOUT_S = 300.0
BUILD_LOCK_POLL_S = 0.1

logger = logging.getLogger(__name__)


class BuildLockTimeout(RuntimeError):
    """Another live process held BUILD_LOCK_NAME for longer than the wait allowed."""


def source_files():
    """The .cpp files compiled into the one module with the module's flags (csrc/*.cpp), in a fixed order."""
    sources = sorted(CSRC_DIR.glob("*.cpp"))
    if not sources:
        raise FileNotFoundError(f"no C++ sources (*.cpp) in {CSRC_DIR}")
    return sources


def _levels_table():
    """cpu/levels.py (the levels' one table): imported from the package, or by path where this file was (setup.py)."""
    try:
        from . import levels
    except ImportError:  # loaded by path, outside the package
        spec = importlib.util.spec_from_file_location("rfa_fairseq_cpu_levels", Path(__file__).with_name("levels.py"))
        levels = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(levels)
    return levels


LEVELS_TABLE = _levels_table()


def machine_levels(machine: str = "") -> dict:
    """{level: the flags that compile LEVEL_SOURCE for it} of an architecture (platform.machine() by default), lowest
    level first (cpu/levels.py)."""
    return {level.name: LEVELS_TABLE.compile_flags(level) for level in LEVELS_TABLE.machine_levels(machine)}


def hashed_files():
    """Every source and header under csrc/, in a fixed order."""
    return sorted(p for p in CSRC_DIR.rglob("*") if p.suffix in HASHED_SUFFIXES)


def build_hash(torch_version: str) -> str:
    """sha256 of every source and header under csrc/ (paths and contents), the compiler flags (the levels' too) and
    the torch version: what the compiled module depends on. Compiled into it, compared at import."""
    digest = hashlib.sha256()
    for part in (torch_version, *EXTRA_CFLAGS, "|", *EXTRA_LDFLAGS, "|", LEVEL_STD):
        digest.update(part.encode() + b"\0")
    for name, flags in sorted(machine_levels().items()):
        digest.update(("\0".join([name, *flags]) + "\0").encode())
    for path in hashed_files():
        digest.update(path.relative_to(CSRC_DIR).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def level_compile_command(compiler: str, level: str, include_dirs, abi_flag: str, output: Path, machine: str = ""):
    """The command that compiles LEVEL_SOURCE for `level` into the object `output`."""
    return [compiler, *EXTRA_CFLAGS, LEVEL_STD, "-fPIC", abi_flag, *machine_levels(machine)[level],
            *(f"-I{d}" for d in include_dirs), "-c", str(LEVEL_SOURCE), "-o", str(output)]


def compile_level_objects(out_dir: Path, include_dirs, abi_flag: str, compiler: str = "", jobs: int = 0,
                          machine: str = ""):
    """Compile the CPU kernels for every level of an architecture (this one's by default; another's with its cross
    compiler) into out_dir/<level>.o, at once (`jobs` compilers, default one per core); an object whose command and
    inputs are those of its stamp is kept.
    -> the objects, lowest level first; RuntimeError naming the level and the compiler's message on failure."""
    compiler = compiler or os.environ.get("CXX", "c++")
    out_dir.mkdir(parents=True, exist_ok=True)
    inputs = b"".join(p.read_bytes() for p in hashed_files() if p.suffix in (".h", ".hpp") or p == LEVEL_SOURCE)

    def build(level):
        output = out_dir / f"{level}.o"
        command = level_compile_command(compiler, level, include_dirs, abi_flag, output, machine)
        stamp = hashlib.sha256(shlex.join(command).encode() + b"\0" + inputs).hexdigest()
        stamp_file = out_dir / f"{level}.o.stamp"
        if output.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
            return output
        stamp_file.unlink(missing_ok=True)
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the {level} level's CPU kernels failed ({shlex.join(command)}):\n"
                               f"{proc.stderr[-3000:]}")
        stamp_file.write_text(stamp)
        return output

    levels = list(machine_levels(machine))
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        return list(pool.map(build, levels))


def torch_level_build_args() -> dict:
    """compile_level_objects' include directories, C++ ABI flag and compiler: those torch compiles its extensions
    with."""
    import torch
    import torch.utils.cpp_extension as cpp_extension

    compiler = getattr(cpp_extension, "get_cxx_compiler", lambda: os.environ.get("CXX", "c++"))()
    return {"include_dirs": cpp_extension.include_paths(), "compiler": compiler,
            "abi_flag": f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"}


def compile_flags(torch_version: str):
    """Compiler flags of both builds: EXTRA_CFLAGS and the build hash (a bare token: ninja runs the
    command through a shell, which would strip quotes; the C++ side makes it a string)."""
    return [*EXTRA_CFLAGS, f"-D{BUILD_HASH_DEFINE}={build_hash(torch_version)}"]


def import_prebuilt():
    """(the prebuilt module, None), or (None, why it cannot be used)."""
    import torch  # the compiled module links against libtorch: load it first

    try:
        module = importlib.import_module(PREBUILT_MODULE)
    except ModuleNotFoundError as error:
        if error.name != PREBUILT_MODULE:
            raise
        return None, f"{PREBUILT_MODULE} was not built at install time"
    except ImportError as error:  # another torch or Python than it was built for, a damaged file
        return None, f"{PREBUILT_MODULE} does not import ({_first_line(error)})"
    built, expected = getattr(module, "build_hash", None), build_hash(torch.__version__)
    if built != expected:
        return None, (f"{module.__file__} is stale: it was built from other sources, flags or torch than "
                      f"{CSRC_DIR} and torch {torch.__version__} now give (build hash {str(built)[:12]}, "
                      f"expected {expected[:12]}); reinstall (bash scripts/setup_env.sh) to rebuild it")
    return module, None


class HeldBuildLock(NamedTuple):
    path: Path
    fd: int


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout_s: float):
    """Hold an exclusive flock on build_dir/BUILD_LOCK_NAME, waiting at most timeout_s for it. -> HeldBuildLock: a
    process given its fd (the JIT build's) holds the lock too, until the last holder closes it or dies."""
    path = build_dir / BUILD_LOCK_NAME
    # never removed: a process waiting on the old file would hold a lock nobody else sees
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout_s
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BuildLockTimeout(
                        f"another process is building or loading the fused C++ kernels and held {path} "
                        f"for more than {timeout_s:g} s") from None
                if not waiting:
                    logger.info("waiting up to %g s for %s: another process is building the fused C++ kernels",
                                timeout_s, path)
                    waiting = True
                time.sleep(BUILD_LOCK_POLL_S)
        yield HeldBuildLock(path, fd)
    finally:
        os.close(fd)  # releases the flock


def remove_stale_torch_lock(build_dir: Path) -> bool:
    """Remove torch's `lock` file where it is a baton (torch <= 2.13), which only a killed process can have left
    while we hold build_lock. (From torch 2.14 the file is a kernel-released lock that every load leaves: kept.)"""
    from ..torch_internals import torch_build_lock_is_a_baton

    if not torch_build_lock_is_a_baton():
        return False
    torch_lock = build_dir / TORCH_LOCK_NAME
    try:
        torch_lock.unlink()
    except FileNotFoundError:
        return False
    warnings.warn(f"rfa_fairseq: removed the stale lock file {torch_lock}, left by a process that was killed "
                  "while it built or loaded the fused C++ kernels (torch would have waited for it forever)")
    return True


def build_jit(lock_timeout_s=None):
    """(the JIT-built module, None), or (None, why not); waits at most lock_timeout_s (default
    BUILD_LOCK_TIMEOUT_S) for another process's build."""
    timeout_s = BUILD_LOCK_TIMEOUT_S if lock_timeout_s is None else lock_timeout_s
    build_dir = None
    try:
        import torch

        from ..torch_internals import cpp_extension_build_directory

        build_dir = Path(cpp_extension_build_directory(JIT_NAME, verbose=False))
        with build_lock(build_dir, timeout_s) as lock:
            remove_stale_torch_lock(build_dir)
            logger.info("building/loading the fused C++ kernels just in time in %s (built once, then cached)",
                        build_dir)
            objects = compile_level_objects(build_dir / LEVEL_DIR_NAME, **torch_level_build_args())
            library = _torch_load_in_child(lock, name=JIT_NAME, sources=[str(p) for p in source_files()],
                                           extra_cflags=compile_flags(torch.__version__),
                                           extra_ldflags=[*EXTRA_LDFLAGS, *map(str, objects)],
                                           build_directory=str(build_dir), verbose=False)
            module = _import_library(library)
        return module, None
    except BuildLockTimeout as error:
        return None, str(error)
    except JitBuildFailed as error:
        return None, f"the just-in-time build in {build_dir} failed: {error}"
    except Exception as error:  # no compiler, an unwritable TORCH_EXTENSIONS_DIR, ...
        where = f" in {build_dir}" if build_dir is not None else ""
        return None, f"the just-in-time build{where} failed: {type(error).__name__}: {_first_line(error)}"


class JitBuildFailed(RuntimeError):
    """torch's load failed in the JIT build's process; the message is its error's type and first line."""


# torch.utils.cpp_extension.load (keyword arguments: argv[2], JSON) run in a process of its own (the same Python and
# torch: argv[1]), which prints the built library's path after _BUILT_LIBRARY (whatever else the build prints); an
# error's type and first line are its stderr's last line
_BUILT_LIBRARY = "rfa-jit-built-library: "
_TORCH_LOAD_CHILD = """
import json, sys
sys.path.append(sys.argv[1])  # where this process found torch (a child started without its sys.path)
from torch.utils.cpp_extension import load
try:
    print(%r + load(**json.loads(sys.argv[2])).__file__)
except Exception as error:
    print(str(error), file=sys.stderr)
    print(f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}", file=sys.stderr)
    sys.exit(1)
""" % _BUILT_LIBRARY


def _torch_load_in_child(lock: HeldBuildLock, **load_args) -> Path:
    """Build with torch's load in a child process whose environment is jit_build_environment()'s (torch runs ninja
    with a copy of its process's environment: the child's PATH reaches ninja and the compilers, this process's stays
    as it is). The child holds `lock` too: killed mid-build, this process leaves the lock held until the child ends.
    -> the built library; JitBuildFailed naming the error."""
    import torch

    torch_root = os.path.dirname(os.path.dirname(torch.__file__))
    proc = subprocess.run([sys.executable, "-c", _TORCH_LOAD_CHILD, torch_root, json.dumps(load_args)],
                          capture_output=True, text=True, env=jit_build_environment(), pass_fds=(lock.fd,))
    if proc.returncode != 0:
        logger.warning("the just-in-time build of the fused C++ kernels failed:\n%s", proc.stderr[-4000:])
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        raise JitBuildFailed(last if proc.returncode == 1 and last else
                             f"its process ended with exit status {proc.returncode}: {last}")
    built = [line[len(_BUILT_LIBRARY):] for line in proc.stdout.splitlines() if line.startswith(_BUILT_LIBRARY)]
    if not built:
        raise JitBuildFailed(f"its process named no built library (its output: {proc.stdout[-500:]!r})")
    return Path(built[-1])


def _import_library(path: Path):
    """The extension module built at `path` (as torch's load imports it)."""
    spec = importlib.util.spec_from_file_location(JIT_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_extension(use_prebuilt: bool = True, lock_timeout_s=None):
    """(the compiled module, None) or (None, why not): the prebuilt module when usable, else a JIT build."""
    if not use_prebuilt:
        return build_jit(lock_timeout_s)
    module, why_not = import_prebuilt()
    if module is not None:
        return module, None
    log = logger.info if why_not.endswith("not built at install time") else logger.warning
    log("the prebuilt fused C++ kernels are not used: %s; building them just in time", why_not)
    module, jit_why_not = build_jit(lock_timeout_s)
    return module, None if module is not None else f"{why_not}; {jit_why_not}"


@functools.lru_cache(maxsize=None)
def _loaded_once():
    # every argument from the module's globals, read now: tests' launchers set them before the first step
    return load_extension()


def load_extension_once():
    """(the process's compiled module, None) or (None, why not): loaded at the first call, then the same."""
    return _loaded_once()


@functools.lru_cache(maxsize=None)
def load_fused_extension():
    """The compiled module, or None when it cannot be had (warned once: decoding uses the torch path)."""
    extension, error = _loaded_once()
    if extension is None:
        warnings.warn(
            f"rfa_fairseq: the fused C++ decoding step is not available ({error}); decoding uses the torch "
            "path instead (same results, slower). --rfa-decode-kernel torch skips the C++ step."
        )
    return extension


def require_fused_extension():
    """The compiled module (--rfa-decode-kernel cpp), or a RuntimeError saying why not."""
    extension, error = _loaded_once()
    if extension is None:
        raise RuntimeError(f"--rfa-decode-kernel cpp: the fused C++ decoding step is not available ({error}); "
                           "use --rfa-decode-kernel torch (or auto, which falls back to it)")
    return extension


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def jit_build_environment() -> dict:
    """This process's environment for the JIT build's process, with the pinned `ninja` package's binary first on PATH
    where that package is installed and another ninja (or none) comes first. torch.utils.cpp_extension runs `ninja`
    from PATH and has no way to name the binary, and ninja versions keep incompatible build logs (1.11 and 1.13 hash
    commands differently): a process finding the system ninja and the next one the package's would each rebuild."""
    env = dict(os.environ)
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
        return env
    path = env.get("PATH", os.defpath)
    found = shutil.which("ninja", path=path)
    if found is None or os.path.realpath(found) != os.path.realpath(os.path.join(bin_dir, "ninja")):
        env["PATH"] = bin_dir + os.pathsep + path
    return env
