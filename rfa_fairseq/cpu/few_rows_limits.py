"""How many rows the few-rows kernels take, per instruction-set level, library and product shape: measured on the
machine, not taken from one machine's table, and kept.

A oneDNN library's products of few rows (a sentence's beam: 4 rows) run faster on the level's few-rows kernels
(csrc/levels/level_kernels.cpp), where oneDNN's call costs more than the arithmetic; with more rows oneDNN's
blocking wins. Where the two cross depends on the CPU, the level and the shape (docs/benchmarks.md): `ensure_limit`
times both on one thread at 1, 4, 8, ... MEASURED_ROWS[-1] rows (the best of a few products, interleaved; a loss
timed twice before it counts) and the kernel takes the rows up to the last count where it won before oneDNN first
did. The limits are kept in a small JSON record per machine (RECORD_NAME under RFA_CACHE_DIR, else
$XDG_CACHE_HOME/rfa_fairseq, else ~/.cache/rfa_fairseq), keyed by the CPU's name, the level, the library (and oneDNN's
own cap), the kernels' build (the C++ module's build hash: a later release's kernels measure again), torch's version
and the shape: a machine measures a shape once (about a millisecond to a few tens for the vocabulary's
projection), and every later process takes the same kernels, so fp32 decoding, whose two kernels may sum in other
orders, gives the same hypotheses run after run. Writers take an exclusive lock on the record and replace it whole; a
record that cannot be read or written is measured again in each process (logged once).
"""
import contextlib
import fcntl
import json
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, Optional

import torch

from . import extension
from .isa import ONEDNN_ENV, cpu_name

CACHE_ENV = "RFA_CACHE_DIR"
RECORD_NAME = "few_rows_limits.json"
MEASURED_ROWS = (1, 4, 8, 16, 32, 64, 128, 256)
REPEATS = 5  # products timed per kernel and round (time_products: 2 rounds, the best counts)

logger = logging.getLogger(__name__)

_known: Dict[str, int] = {}  # this process's limits, by key
_lock = threading.Lock()
_unwritable_logged = False


def record_path() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "rfa_fairseq")
    return Path(base) / RECORD_NAME


def key_of(library, code: str, packed) -> str:
    # oneDNN's own cap (ONEDNN_MAX_CPU_ISA, read by oneDNN at the process's first primitive) sets the other side of
    # the comparison: a limit measured against an uncapped oneDNN is not one for a capped one
    onednn = os.environ.get(ONEDNN_ENV) or "the CPU's"
    return (f"{cpu_name()} | {library.level} | {code} (oneDNN ISA {onednn}) | kernels {kernels_build(library)} | "
            f"torch {torch.__version__} | {packed.in_features}x{packed.out_features}")


def kernels_build(library) -> str:
    """The build hash (its first 16 digits) of the C++ module whose library this is, or the library's own
    `build_hash` (a stand-in's)."""
    build = getattr(library, "build_hash", None) or getattr(sys.modules.get(type(library).__module__), "build_hash", None)
    if build is None:  # a JIT build: torch's load does not enter it in sys.modules; the process's one module
        module, _ = extension.load_extension_once()
        build = getattr(module, "build_hash", None)
    if build is None:
        raise ValueError(f"{type(library).__name__} comes from no module with a build_hash: its few-rows limits "
                         "cannot be keyed by the kernels' build")
    return str(build)[:16]


def ensure_limit(library, code: str, packed) -> int:
    """Set the few-rows limit of `packed`'s shape on the C++ `library` (its level; `code`: the library's kind), from
    this process's limits, the machine's record or a measurement (recorded). -> the limit (rows)."""
    key = key_of(library, code, packed)
    with _lock:
        limit = _known.get(key)
        if limit is None:
            limit = _recorded_or_measured(key, library, packed)
            _known[key] = limit
    library.set_few_rows_limit(packed.in_features, packed.out_features, limit)
    return limit


def measure_limit(library, packed, rows=MEASURED_ROWS, repeats: int = REPEATS) -> int:
    """The most rows (of `rows`) up to which the few-rows kernel beat the library's oneDNN product at every count,
    timed on one thread; 0 when it lost at the first."""
    limit = 0
    for count in rows:
        few, other = library.time_products(packed, count, repeats)
        if few > other:  # a loss counts when a second timing agrees
            few_again, other_again = library.time_products(packed, count, repeats)
            if min(few, few_again) > min(other, other_again):
                break
        limit = count
    return limit


def _recorded_or_measured(key: str, library, packed) -> int:
    path = record_path()
    try:
        with _record_lock(path):
            record = _read(path)
            if key in record:
                return record[key]
            limit = measure_limit(library, packed)
            logger.info("rfa_fairseq: few-rows limit measured for %s: %d rows", key, limit)
            record[key] = limit
            _write(path, record)
            return limit
    except OSError as error:
        _log_unwritable(path, error)
        return measure_limit(library, packed)


@contextlib.contextmanager
def _record_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process measuring: its results are read after it
        yield
    finally:
        os.close(fd)


def _read(path: Path) -> Dict[str, int]:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:  # damaged: measured again, then replaced whole
        logger.warning("rfa_fairseq: the few-rows limits' record %s does not read (%s): measuring again", path, error)
        return {}
    if not isinstance(record, dict):
        return {}
    return {k: v for k, v in record.items() if isinstance(k, str) and isinstance(v, int) and v >= 0}


def _write(path: Path, record: Dict[str, int]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(record, out, indent=1, sort_keys=True)
            out.write("\n")
        os.replace(tmp, path)  # readers see the old record or the new one, never half of one
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _log_unwritable(path: Path, error: OSError) -> None:
    global _unwritable_logged
    if not _unwritable_logged:
        _unwritable_logged = True
        logger.warning("rfa_fairseq: the few-rows limits' record %s cannot be used (%s): each process measures its "
                       "shapes again (set %s to a writable directory)", path, error, CACHE_ENV)


def known_limits() -> Dict[str, int]:
    """This process's limits (benchmarks report them)."""
    with _lock:
        return dict(_known)


def forget_known(prefix: Optional[str] = None) -> None:
    """Drop this process's limits (all, or those whose key starts with prefix): the next ensure_limit reads the record
    again (tests)."""
    with _lock:
        for key in [k for k in _known if prefix is None or k.startswith(prefix)]:
            del _known[key]
