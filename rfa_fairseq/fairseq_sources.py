"""The source of a fairseq function, fingerprinted: what the plugin's fairseq patches (fairseq_compat.PATCHES) and the
native encoder's mirrors of fairseq functions (fairseq_mirrors.NATIVE_ENCODER_MIRRORS) were checked against. A record
names its attribute (`module`, `attribute`: possibly Class.method) and the fingerprint of its source in
CHECKED_FAIRSEQ; `source_difference` says how the attribute found now differs, or None."""
import hashlib
import importlib
import inspect
from typing import Optional

CHECKED_FAIRSEQ = "ve-fairseq 0.12.3"
ALL_TAGS = "fairseq v0.12.2, v0.12.3 (git tags) and main (3d262bb)"


def source_fingerprint(obj) -> Optional[str]:
    """The first 16 hex digits of the sha256 of `obj`'s source (inspect.getsource: the text of its def or
    class, decorators included, from its file) and of the number of functools.wraps layers over it (a
    wrapper installed by another package adds one); None where its source cannot be read."""
    obj, layers = unwrapped(obj)
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        return None
    return hashlib.sha256(f"{layers}\0{source}".encode()).hexdigest()[:16]


def unwrapped(obj):
    """(what the functools.wraps layers over obj wrap, how many layers)."""
    layers = 0
    while hasattr(obj, "__wrapped__") and layers < 8:  # a bound: a Mock has every attribute
        obj, layers = obj.__wrapped__, layers + 1
    return obj, layers


def owner_of(record):
    """(the module or class holding `record`'s attribute (a FairseqPatch, a FairseqMirror), the attribute's name)."""
    owner = importlib.import_module(record.module)
    *path, name = record.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def defined_in(obj) -> str:
    obj, layers = unwrapped(obj)
    code = getattr(obj, "__code__", None)
    where = (f"{code.co_filename}:{code.co_firstlineno}" if code is not None else
             f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}")
    return where + (f" under {layers} functools.wraps wrapper(s)" if layers else "")


def source_difference(current, fingerprint: str) -> Optional[str]:
    """None where `current`'s source fingerprint is `fingerprint`; else how it differs, and where it comes from."""
    found = source_fingerprint(current)
    if found == fingerprint:
        return None
    return (f"has no readable source ({defined_in(current)})" if found is None else
            f"has source fingerprint {found} ({defined_in(current)})")


def record_table(header: str, records, cells) -> str:
    """docs/design.md's table of fingerprinted records: `header` (the first cells), one row per record of its
    `cells(record)` and the versions checked (CHECKED_FAIRSEQ with the record's fingerprint; its same_source_in)."""
    columns = header.count("|") - 1
    rows = [header, "|" + "---|" * columns]
    for record in records:
        rows.append(f"| {' | '.join(cells(record))} | {CHECKED_FAIRSEQ} (`{record.fingerprint}`); "
                    f"same source: {record.same_source_in} |")
    return "\n".join(rows) + "\n"
