"""Which tensors live in a file's mapping: the weights of a checkpoint loaded mapped (fairseq_compat's
checked-checkpoint-loading maps the file; the model's parameters then share its pages: models/rfa_transformer.py's
load_state_dict), pages the system can drop and read again from the file, and which nobody else writes.

Linux: the process's mappings as /proc/self/maps lists them now (`FileMappings.now()`: a caller reads them once for
what it checks together; an address range can be a file's mapping at one time and memory at another). Elsewhere no
tensor is known to be file-backed: weights are copied and kept, none released.
"""
import bisect
from typing import List, Optional, Tuple

from torch import Tensor

MAPS = "/proc/self/maps"
RELEASE_ALIGNMENT = 2 << 20  # the largest unit of the page cache on x86-64 and aarch64 with 4 KB pages


class FileMappings:
    """The regular files' mappings of this process at one moment."""

    def __init__(self, ranges: List[Tuple[int, int, int]]):
        self.ranges = sorted(ranges)  # (start, end, the file offset at start)
        self._starts = [start for start, _, _ in self.ranges]

    @classmethod
    def now(cls) -> "FileMappings":
        ranges = []
        try:
            with open(MAPS, encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) < 6 or fields[4] == "0":  # anonymous memory: no inode
                        continue
                    path = fields[5].strip()
                    # a regular file's pages (not a device's, shared memory's or a memfd's: memory themselves)
                    if not path.startswith("/") or path.startswith(("/dev/", "/memfd:")):
                        continue
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end, int(fields[2], 16)))
        except OSError:
            pass
        return cls(ranges)

    def holds(self, tensor: Tensor) -> bool:
        """Whether every byte of `tensor`'s storage lies in one mapping of a regular file (a CPU tensor)."""
        return self.mapping_of(tensor) is not None

    def mapping_of(self, tensor: Tensor) -> Optional[Tuple[int, int, int]]:
        """The (start, end, file offset at start) of the file mapping (mappings of one file side by side count as one)
        that holds every byte of `tensor`'s storage, or None."""
        if tensor.device.type != "cpu":
            return None
        storage = tensor.untyped_storage()
        begin = storage.data_ptr()
        end = begin + storage.nbytes()
        if begin == 0 or end == begin:
            return None
        i = bisect.bisect_right(self._starts, begin) - 1
        if i < 0 or not self.ranges[i][0] <= begin < self.ranges[i][1]:
            return None
        first = i
        while self.ranges[i][1] < end:
            if i + 1 < len(self.ranges) and self.ranges[i + 1][0] == self.ranges[i][1]:
                i += 1
                continue
            return None
        return self.ranges[first][0], self.ranges[i][1], self.ranges[first][2]

    def release_range(self, tensor: Tensor) -> Optional[Tuple[int, int]]:
        """The addresses whose pages to give back once `tensor` is no longer read (None: it is not a file's mapping):
        its bytes widened to whole RELEASE_ALIGNMENT units of the file within its mapping, since the system keeps a page of
        a larger unit of its cache (a folio, up to 2 MB, aligned in the file) that a request covers only in part."""
        mapping = self.mapping_of(tensor)
        if mapping is None:
            return None
        start, stop, offset = mapping
        begin = tensor.data_ptr() - start + offset  # in the file
        end = begin + tensor.numel() * tensor.element_size()
        begin, end = begin // RELEASE_ALIGNMENT * RELEASE_ALIGNMENT, -(-end // RELEASE_ALIGNMENT) * RELEASE_ALIGNMENT
        return max(start, start + begin - offset), min(stop, start + end - offset)
