"""Vocabulary shortlists: per source token the target tokens likely to translate it, from the training data.

Marian's lexical shortlist and CTranslate2's vocabulary map (`use_vmap`) restrict each batch's output projection and
log-softmax to the union of its sources' candidate target tokens. This module builds that table from a binarized
fairseq data-bin (`rfa-build-shortlist`, rfa_fairseq/cli/build_shortlist.py), writes and reads its file, and computes a
batch's union for the decoder.

Building: an IBM Model 1 lexical table p(target token | source token) over the subword ids of the training split,
estimated by a few EM iterations (with a NULL source word, as fast_align and Marian's lexical tables have), written
with numpy over the distinct co-occurring (source, target) pairs only; per source token the K most probable target
tokens are kept, plus the N most frequent target tokens of the training targets.

The file (`.npz`: a zip of .npy arrays, readable with `numpy.load(path, allow_pickle=False)`):

  header.npy         a 0-d unicode array holding JSON: {"format": "rfa-fairseq-shortlist", "version": 1,
                     "source_dictionary": {"size": ..., "sha256": ...}, "target_dictionary": {...}, "k": K, "n": N,
                     "alignment": {...}, "data": {...}}; sha256 is dictionary_fingerprint()'s
  candidates.npy     int32 (source dictionary size, K): row s = source token s's candidates, most probable first,
                     -1 where s has fewer than K (special tokens and unseen source tokens have none)
  probabilities.npy  float32 (source dictionary size, K): p(candidate | s), 0 where the candidate is -1
  frequent.npy       int32 (N,): the training targets' most frequent tokens, most frequent first

Since candidates and frequent tokens are ordered best first, any k <= K and n <= N are the first columns and entries:
`Shortlist.load(..., k=, n=)` picks them without rebuilding. The file is written deterministically (the same inputs
give the same bytes) and atomically.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

FORMAT_NAME = "rfa-fairseq-shortlist"
FORMAT_VERSION = 1
# Marian's "first 100, best 100" (its lexical shortlist's usual setting): the starting point the measurements
# in benchmarks/shortlist_sizes.py refine
DEFAULT_K = 100
DEFAULT_N = 100
# fast_align's and most IBM Model 1 estimates' count: the table's ranking stops moving after a few
DEFAULT_ITERATIONS = 5
# co-occurring (target position, source position) pairs handled at once: bounds the EM's memory (~100 bytes a pair)
DEFAULT_CHUNK_PAIRS = 1_000_000
# up to this many pairs in all, each pair's index into the table is kept between EM iterations (8 bytes a pair)
CACHED_PAIRS = 16_000_000

_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed, so that the same table gives the same bytes


class ShortlistError(ValueError):
    """A shortlist that cannot be built or used as asked: bad data, a mismatched dictionary or file; the message
    names the file."""


# ---------------------------------------------------------------- dictionaries


def special_token_ids(dictionary) -> list[int]:
    """A fairseq Dictionary's special tokens: bos, pad, eos, unk and every id below nspecial (the extra special
    symbols a Dictionary is built with come right after the four)."""
    ids = {dictionary.bos(), dictionary.pad(), dictionary.eos(), dictionary.unk(), *range(dictionary.nspecial)}
    return sorted(i for i in ids if 0 <= i < len(dictionary))


def dictionary_fingerprint(dictionary) -> str:
    """sha256 of a fairseq Dictionary's symbols in id order and its special ids: what token ids mean. Counts are left
    out (the model's dictionary and the data-bin's may differ there and still agree on every id)."""
    digest = hashlib.sha256()
    digest.update(f"specials {special_token_ids(dictionary)} nspecial {dictionary.nspecial}\n".encode())
    for symbol in dictionary.symbols:
        digest.update(symbol.encode("utf-8", "surrogatepass"))
        digest.update(b"\n")
    return digest.hexdigest()


def _dictionary_record(dictionary) -> dict:
    return {"size": len(dictionary), "sha256": dictionary_fingerprint(dictionary)}


# ---------------------------------------------------------------- binarized data


# fairseq's mmap index (fairseq/data/indexed_dataset.py, MMapIndexedDataset.Index, fairseq-preprocess's default
# --dataset-impl): magic, <Q version 1, <B dtype code, <Q count, int32 sizes[count], int64 byte pointers[count]
_MMAP_MAGIC = b"MMIDIDX\x00\x00"
_MMAP_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16, 9: np.uint32,
                10: np.uint64}


@dataclass
class Sentences:
    """A binarized split's one side: every sentence's tokens in one array, sentence i = tokens[offsets[i]:offsets[i+1]]."""

    tokens: np.ndarray
    offsets: np.ndarray  # int64, len(sentences) + 1

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def read_binarized(prefix: str) -> Sentences:
    """PREFIX.idx / PREFIX.bin written by fairseq-preprocess (the mmap format), read with numpy."""
    index_path, data_path = prefix + ".idx", prefix + ".bin"
    for path in (index_path, data_path):
        if not os.path.isfile(path):
            raise ShortlistError(f"{path}: file not found")
    with open(index_path, "rb") as handle:
        header = handle.read(9 + 8 + 1 + 8)
    if header[:9] != _MMAP_MAGIC:
        raise ShortlistError(f"{index_path}: not fairseq's mmap index (fairseq-preprocess --dataset-impl mmap, its "
                             "default, writes it); binarize the data again with --dataset-impl mmap")
    if len(header) < 26:
        raise ShortlistError(f"{index_path}: truncated index header")
    (version,) = struct.unpack("<Q", header[9:17])
    (code,) = struct.unpack("<B", header[17:18])
    (count,) = struct.unpack("<Q", header[18:26])
    if version != 1 or code not in _MMAP_DTYPES:
        raise ShortlistError(f"{index_path}: unsupported mmap index (version {version}, dtype code {code})")
    dtype = np.dtype(_MMAP_DTYPES[code])
    expected_index_size = 26 + count * (4 + 8)
    if os.path.getsize(index_path) < expected_index_size:
        raise ShortlistError(f"{index_path}: truncated ({os.path.getsize(index_path)} bytes, its header describes "
                             f"{count} sentences in {expected_index_size} bytes)")
    index = np.memmap(index_path, mode="r", dtype=np.uint8)
    sizes = np.frombuffer(index, dtype=np.int32, count=count, offset=26).astype(np.int64)
    pointers = np.frombuffer(index, dtype=np.int64, count=count, offset=26 + 4 * count)
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if not np.array_equal(pointers, offsets[:-1] * dtype.itemsize):
        raise ShortlistError(f"{index_path}: sentences are not stored one after the other in {data_path} (not "
                             "written by fairseq-preprocess?)")
    expected = int(offsets[-1]) * dtype.itemsize
    actual = os.path.getsize(data_path)
    if actual != expected:
        raise ShortlistError(f"{data_path}: {actual} bytes, but {index_path} describes {expected}: the .bin was cut "
                             "short or comes from another fairseq-preprocess run; binarize the data again")
    tokens = np.fromfile(data_path, dtype=dtype) if expected else np.zeros(0, dtype=dtype)
    return Sentences(tokens=tokens.astype(np.int64, copy=False), offsets=offsets)


def file_sha256(path: str, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def drop_tokens(sentences: Sentences, dropped: Iterable[int]) -> Sentences:
    """The same sentences without the given token ids (the special tokens: eos ends every binarized sentence)."""
    keep = ~np.isin(sentences.tokens, np.fromiter(dropped, dtype=np.int64))
    sentence_of_token = np.repeat(np.arange(len(sentences)), sentences.lengths)
    lengths = np.bincount(sentence_of_token[keep], minlength=len(sentences))
    offsets = np.zeros(len(sentences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Sentences(tokens=sentences.tokens[keep], offsets=offsets)


# ---------------------------------------------------------------- IBM Model 1


@dataclass
class LexicalTable:
    """A sparse p(target | source): one entry per distinct co-occurring pair; source id `null_id` is NULL."""

    source: np.ndarray  # int64
    target: np.ndarray  # int64
    probability: np.ndarray  # float64
    null_id: int


def _chunk_bounds(source: Sentences, target: Sentences, chunk_pairs: int) -> list[tuple[int, int]]:
    """Sentence ranges [start, stop) of about `chunk_pairs` co-occurring pairs each (at least one sentence)."""
    cumulative = np.cumsum(target.lengths * (source.lengths + 1))
    bounds, start, done = [], 0, 0
    while start < len(source):
        stop = start + max(1, int(np.searchsorted(cumulative[start:] - done, chunk_pairs, side="right")))
        bounds.append((start, stop))
        done, start = int(cumulative[stop - 1]), stop
    return bounds


def _pairs(source: Sentences, target: Sentences, null_id: int, start: int, stop: int):
    """Sentences [start, stop)'s co-occurring pairs: each target position with every source position of its sentence
    and with NULL. Returns (source ids, target ids, each pair's target position counted from the range's first,
    number of target positions)."""
    src_len = source.lengths
    rows = np.arange(start, stop)
    position_sentence = np.repeat(rows, target.lengths[rows])
    position_token = target.tokens[target.offsets[start]:target.offsets[stop]]
    fan = src_len[position_sentence] + 1  # the sentence's source positions and NULL
    total = int(fan.sum())
    position_of_pair = np.repeat(np.arange(len(position_token)), fan)
    rank = np.arange(total) - np.repeat(np.cumsum(fan) - fan, fan)  # 0: NULL; r: source position r - 1
    src_ids = np.full(total, null_id, dtype=np.int64)
    real = rank > 0
    src_ids[real] = source.tokens[source.offsets[position_sentence[position_of_pair[real]]] + rank[real] - 1]
    return src_ids, position_token[position_of_pair], position_of_pair, len(position_token)


def _distinct_sorted(values: np.ndarray) -> np.ndarray:
    """A sorted array without its repeats."""
    if len(values) < 2:
        return values
    return values[np.concatenate(([True], values[1:] != values[:-1]))]


def ibm_model1(source: Sentences, target: Sentences, source_size: int, target_size: int,
               iterations: int = DEFAULT_ITERATIONS, chunk_pairs: int = DEFAULT_CHUNK_PAIRS,
               progress_bar: bool = False) -> LexicalTable:
    """IBM Model 1's p(target token | source token) over a bitext of token ids, by `iterations` EM iterations from
    uniform: each target token is generated by one of its sentence's source tokens or by NULL (id `source_size`).
    The bitext is handled `chunk_pairs` co-occurrences at a time (bounded memory); progress_bar: a tqdm bar on
    stderr, one step per chunk and pass."""
    from tqdm import tqdm

    if len(source) != len(target):
        raise ShortlistError(f"{len(source)} source sentences but {len(target)} target sentences")
    if iterations < 1:
        raise ShortlistError(f"iterations must be at least 1, got {iterations}")
    null_id = source_size
    width = np.int64(target_size)
    bounds = _chunk_bounds(source, target, chunk_pairs)
    with tqdm(total=len(bounds) * (iterations + 1), desc="IBM Model 1", unit="chunk", disable=not progress_bar,
              leave=False) as bar:
        # the distinct pairs as sorted keys source * target_size + target: a pair's index is a binary search
        keys = np.zeros(0, dtype=np.int64)
        for start, stop in bounds:
            src_ids, tgt_ids, _, _ = _pairs(source, target, null_id, start, stop)
            # merge two sorted runs (timsort: linear); np.union1d's hashing np.unique is ~5x slower here
            keys = _distinct_sorted(np.sort(np.concatenate([keys, _distinct_sorted(np.sort(src_ids * width + tgt_ids))]),
                                            kind="stable"))
            bar.update(1)
        pair_source, pair_target = np.divmod(keys, width)
        # uniform start: the first E-step shares each target token equally among its sentence's source tokens and NULL
        probability = np.ones(len(keys), dtype=np.float64)
        # each chunk's pair indices and target positions, computed in the first iteration and kept for the next ones
        # while they fit CACHED_PAIRS (8 bytes a pair), else recomputed each time
        keep = sum(int((target.lengths[a:b] * (source.lengths[a:b] + 1)).sum()) for a, b in bounds) <= CACHED_PAIRS
        cache = {}
        for _ in range(iterations):
            counts = np.zeros(len(keys), dtype=np.float64)
            for start, stop in bounds:
                if start in cache:
                    pair, position, n_positions = cache[start]
                else:
                    src_ids, tgt_ids, position, n_positions = _pairs(source, target, null_id, start, stop)
                    pair = np.searchsorted(keys, src_ids * width + tgt_ids)
                    del src_ids, tgt_ids
                    if keep:
                        pair, position = pair.astype(np.int32), position.astype(np.int32)
                        cache[start] = pair, position, n_positions
                score = probability[pair]
                # E-step: each target position's alignment posterior over its source positions and NULL
                total = np.bincount(position, weights=score, minlength=n_positions)
                counts += np.bincount(pair, weights=score / total[position], minlength=len(keys))
                bar.update(1)
            # M-step: p(t | s) = count(s, t) / count(s)
            per_source = np.bincount(pair_source, weights=counts, minlength=null_id + 1)
            probability = counts / per_source[pair_source]
    return LexicalTable(source=pair_source, target=pair_target, probability=probability, null_id=null_id)


def top_candidates(table: LexicalTable, source_size: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per source token (NULL left out) its k most probable target tokens, most probable first (ties: lower id
    first), -1 / 0.0 past the ones it has: (candidates int32 (source_size, k), probabilities float32 (source_size, k))."""
    candidates = np.full((source_size, k), -1, dtype=np.int32)
    probabilities = np.zeros((source_size, k), dtype=np.float32)
    keep = table.source < source_size
    source, target, probability = table.source[keep], table.target[keep], table.probability[keep]
    order = np.lexsort((target, -probability, source))
    source, target, probability = source[order], target[order], probability[order]
    first = np.searchsorted(source, source, side="left")
    rank = np.arange(len(source)) - first
    chosen = rank < k
    candidates[source[chosen], rank[chosen]] = target[chosen]
    probabilities[source[chosen], rank[chosen]] = probability[chosen]
    return candidates, probabilities


def most_frequent(tokens: np.ndarray, size: int, n: int, excluded: Iterable[int] = ()) -> np.ndarray:
    """The n most frequent ids of `tokens` (ids < size, `excluded` left out), most frequent first (ties: lower id
    first); fewer when fewer occur."""
    counts = np.bincount(tokens, minlength=size)[:size].astype(np.int64)
    excluded = np.fromiter(excluded, dtype=np.int64)
    counts[excluded[(excluded >= 0) & (excluded < size)]] = 0
    order = np.lexsort((np.arange(size), -counts))
    order = order[counts[order] > 0]
    return order[:n].astype(np.int32)


# ---------------------------------------------------------------- the file


@dataclass
class ShortlistTable:
    """The file's contents: header (dict), candidates (int32 (S, K), -1 padded), probabilities (float32 (S, K)),
    frequent (int32 (N,))."""

    header: dict
    candidates: np.ndarray
    probabilities: np.ndarray
    frequent: np.ndarray


def build_table(source: Sentences, target: Sentences, source_dictionary, target_dictionary, k: int = DEFAULT_K,
                n: int = DEFAULT_N, iterations: int = DEFAULT_ITERATIONS, chunk_pairs: int = DEFAULT_CHUNK_PAIRS,
                progress_bar: bool = False, data: Optional[dict] = None) -> ShortlistTable:
    """The shortlist of a bitext of token ids (special tokens are dropped before aligning). `data`: what the header
    records of the inputs (rfa-build-shortlist records the files' hashes, to tell an up-to-date file)."""
    if k < 1 or n < 0:
        raise ShortlistError(f"K must be at least 1 and N at least 0, got K={k}, N={n}")
    source_size, target_size = len(source_dictionary), len(target_dictionary)
    source = drop_tokens(source, special_token_ids(source_dictionary))
    target = drop_tokens(target, special_token_ids(target_dictionary))
    lexical = ibm_model1(source, target, source_size, target_size, iterations, chunk_pairs, progress_bar)
    candidates, probabilities = top_candidates(lexical, source_size, k)
    frequent = most_frequent(target.tokens, target_size, n)
    header = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION,
        "source_dictionary": _dictionary_record(source_dictionary),
        "target_dictionary": _dictionary_record(target_dictionary),
        "k": int(k), "n": int(n),
        "alignment": {"model": "ibm1", "iterations": int(iterations), "null": True,
                      "sentences": len(source), "distinct_pairs": int(len(lexical.source))},
        "data": data or {},
    }
    return ShortlistTable(header=header, candidates=candidates, probabilities=probabilities, frequent=frequent)


def write_atomic(path: str, write: Callable[[io.BufferedWriter], None]) -> None:
    """write(handle) into a temporary file beside `path`, then renamed over it: `path` is never half-written."""
    directory = os.path.dirname(os.path.abspath(path))
    handle = tempfile.NamedTemporaryFile(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                         delete=False)
    try:
        with handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(handle.name, 0o644)
        os.replace(handle.name, path)
    except BaseException:
        try:
            os.unlink(handle.name)
        except FileNotFoundError:
            pass
        raise


def save(path: str, table: ShortlistTable) -> None:
    """Write `table` to `path` (an .npz), atomically and deterministically."""
    arrays = {
        "header": np.array(json.dumps(table.header, sort_keys=True)),
        "candidates": np.ascontiguousarray(table.candidates, dtype=np.int32),
        "probabilities": np.ascontiguousarray(table.probabilities, dtype=np.float32),
        "frequent": np.ascontiguousarray(table.frequent, dtype=np.int32),
    }

    def write(handle):
        with zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for name, array in arrays.items():
                buffer = io.BytesIO()
                np.lib.format.write_array(buffer, array, allow_pickle=False)
                info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_DATE)
                info.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(info, buffer.getvalue())

    write_atomic(path, write)


def read(path: str) -> ShortlistTable:
    """The file at `path`, its format and shapes checked (not yet against any dictionary: see check_dictionaries)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            names = set(archive.files)
            missing = {"header", "candidates", "probabilities", "frequent"} - names
            if missing:
                raise ShortlistError(f"{path}: not a shortlist file (no {', '.join(sorted(missing))})")
            header = json.loads(str(archive["header"]))
            arrays = {name: archive[name] for name in ("candidates", "probabilities", "frequent")}
    except FileNotFoundError:
        raise ShortlistError(f"{path}: file not found (rfa-build-shortlist DATA writes it)") from None
    except (OSError, ValueError, zipfile.BadZipFile, json.JSONDecodeError) as error:
        if isinstance(error, ShortlistError):
            raise
        raise ShortlistError(f"{path}: not a shortlist file ({type(error).__name__}: {error})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        found = header.get("format") if isinstance(header, dict) else header
        raise ShortlistError(f"{path}: not a shortlist file (format {found!r})")
    if header.get("version") != FORMAT_VERSION:
        raise ShortlistError(f"{path}: shortlist format version {header.get('version')}, this rfa-fairseq reads "
                             f"version {FORMAT_VERSION}: build it again with this version's rfa-build-shortlist")
    try:
        source_size, target_size = header["source_dictionary"]["size"], header["target_dictionary"]["size"]
        header["source_dictionary"]["sha256"], header["target_dictionary"]["sha256"], header["k"], header["n"]
    except (KeyError, TypeError):
        raise ShortlistError(f"{path}: damaged shortlist file (its header lacks the dictionaries, K or N)") from None
    candidates, frequent = arrays["candidates"], arrays["frequent"]
    shape_ok = (candidates.shape == (source_size, header["k"]) and arrays["probabilities"].shape == candidates.shape
                and frequent.ndim == 1 and len(frequent) <= header["n"])
    if not shape_ok or (candidates.size and (candidates.max() >= target_size or candidates.min() < -1)) or \
            (frequent.size and (frequent.max() >= target_size or frequent.min() < 0)):
        raise ShortlistError(f"{path}: damaged shortlist file (its arrays do not agree with its header)")
    return ShortlistTable(header=header, **arrays)


def check_dictionaries(table: ShortlistTable, source_dictionary, target_dictionary, path: str) -> None:
    """Refuse a shortlist built for other dictionaries than these (a ShortlistError naming the file and the side)."""
    for side, dictionary in (("source", source_dictionary), ("target", target_dictionary)):
        recorded = table.header[f"{side}_dictionary"]
        actual = _dictionary_record(dictionary)
        if recorded != actual:
            what = (f"{recorded['size']} symbols, the model's has {actual['size']}" if recorded["size"] != actual["size"]
                    else f"{recorded['size']} symbols like the model's, but other symbols or ids (sha256 "
                         f"{recorded['sha256'][:12]}... vs {actual['sha256'][:12]}...)")
            raise ShortlistError(f"{path}: built for another {side} dictionary ({what}): build it from the model's "
                                 "data-bin with rfa-build-shortlist")


# ---------------------------------------------------------------- decoding


class Shortlist:
    """A loaded shortlist, ready to give each batch its candidate target tokens (`union`).

    Its first k candidates per source token and n frequent target tokens (the file's K and N by default), the target
    dictionary's special tokens always."""

    def __init__(self, candidates: np.ndarray, frequent: np.ndarray, target_size: int, always: Sequence[int],
                 path: str = "<memory>", header: Optional[dict] = None):
        import torch

        self.path = path
        self.header = header or {}
        self.source_size, self.k = candidates.shape
        self.target_size = target_size
        self.n = len(frequent)
        always = sorted(set(int(i) for i in always))
        if not always:
            raise ShortlistError("a shortlist needs at least one always-on token (the special tokens)")
        # a missing candidate (-1) points at an always-on token: the union needs no filtering
        table = np.where(candidates >= 0, candidates, always[0]).astype(np.int64)
        self._table = torch.from_numpy(table)
        base = torch.zeros(target_size, dtype=torch.bool)
        base[torch.as_tensor(always, dtype=torch.long)] = True
        base[torch.from_numpy(frequent.astype(np.int64))] = True
        self._always = base
        self._on_device = {}

    @classmethod
    def load(cls, path: str, source_dictionary, target_dictionary, k: Optional[int] = None,
             n: Optional[int] = None) -> "Shortlist":
        """The shortlist file at `path`, checked against the model's dictionaries (a ShortlistError naming the file
        when it was built for others), restricted to its first k candidates per source token and n frequent targets
        (default: all the file has)."""
        table = read(path)
        check_dictionaries(table, source_dictionary, target_dictionary, path)
        stored_k, stored_n = table.header["k"], table.header["n"]
        k = stored_k if k is None else k
        n = stored_n if n is None else n
        if not 1 <= k <= stored_k or not 0 <= n <= stored_n:
            raise ShortlistError(f"{path}: asked for K={k}, N={n}, but the file holds K={stored_k}, N={stored_n} "
                                 "(K from 1, N from 0, up to those; build with larger --k / --n for more)")
        return cls(table.candidates[:, :k], table.frequent[:n], len(target_dictionary),
                   special_token_ids(target_dictionary), path=path, header=table.header)

    def _tables(self, device):
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = (self._table.to(device), self._always.to(device))
        return self._on_device[key]

    def union(self, src_tokens, extra_tokens=None):
        """The sorted distinct target ids a batch may produce: every source token's candidates (padding included,
        which has none), the frequent targets, the special tokens, and `extra_tokens` (ids a caller forces: a prefix,
        constraints; any shape, a tensor or a sequence). src_tokens: a (B, S) LongTensor (any shape works). Returns a
        LongTensor on src_tokens' device; vectorised (no loop over tokens)."""
        import torch

        table, always = self._tables(src_tokens.device)
        flat = src_tokens.reshape(-1)
        if flat.device.type == "cpu" and flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.source_size):
            raise ShortlistError(f"{self.path}: a source token id outside the source dictionary "
                                 f"(0..{self.source_size - 1}): {int(flat.min())}..{int(flat.max())}")
        # each distinct source token once: a batch repeats tokens (and padding) many times
        seen = torch.zeros(self.source_size, dtype=torch.bool, device=flat.device)
        seen[flat] = True
        mask = always.clone()
        mask[table[seen].reshape(-1)] = True
        if extra_tokens is not None:
            extra = torch.as_tensor(extra_tokens, dtype=torch.long, device=mask.device).reshape(-1)
            if extra.numel():
                if extra.device.type == "cpu" and (int(extra.min()) < 0 or int(extra.max()) >= self.target_size):
                    raise ShortlistError(f"forced target token ids must be in 0..{self.target_size - 1}, got "
                                         f"{int(extra.min())}..{int(extra.max())}")
                mask[extra] = True
        return mask.nonzero().reshape(-1)


def load(path: str, source_dictionary, target_dictionary, k: Optional[int] = None, n: Optional[int] = None) -> Shortlist:
    """Shortlist.load."""
    return Shortlist.load(path, source_dictionary, target_dictionary, k=k, n=n)


# ---------------------------------------------------------------- CTranslate2


def ct2_token(symbol: str) -> str:
    """A fairseq dictionary symbol as CTranslate2's fairseq converter writes it into the model's vocabulary
    (ctranslate2/converters/fairseq.py, _get_vocab: <pad> becomes <blank>)."""
    return "<blank>" if symbol == "<pad>" else symbol


def write_ct2_vmap(path: str, table: ShortlistTable, source_dictionary, target_dictionary, k: Optional[int] = None,
                   n: Optional[int] = None) -> None:
    """The shortlist as a CTranslate2 vocabulary map (ct2-*-converter --vocab_mapping, translate with use_vmap=True),
    written atomically: a first line `<TAB>` + the always-on target tokens (the N frequent and the special tokens),
    then one line `source token<TAB>candidates` per source token that has candidates (its first k), tokens spelled as
    in the converted model's vocabularies and separated by single spaces (CTranslate2's VocabularyMap format)."""
    k = table.header["k"] if k is None else k
    n = table.header["n"] if n is None else n
    target_symbols = [ct2_token(symbol) for symbol in target_dictionary.symbols]
    source_symbols = [ct2_token(symbol) for symbol in source_dictionary.symbols]
    for side, symbols, dictionary in (("source", source_symbols, source_dictionary),
                                      ("target", target_symbols, target_dictionary)):
        for token_id, symbol in enumerate(symbols):
            if not symbol or any(c in symbol for c in " \t\r\n"):
                raise ShortlistError(f"the {side} dictionary's symbol {token_id} ({symbol!r}) holds a space, tab or "
                                     "line break (or is empty): a CTranslate2 vocabulary map cannot spell it")
    always = sorted(set(special_token_ids(target_dictionary)) | set(int(i) for i in table.frequent[:n]))
    lines = ["\t" + " ".join(target_symbols[i] for i in always)]
    specials = set(special_token_ids(source_dictionary))
    candidates = table.candidates[:, :k]
    for source_id in range(len(source_symbols)):
        row = candidates[source_id]
        row = row[row >= 0]
        if len(row) and source_id not in specials:
            lines.append(source_symbols[source_id] + "\t" + " ".join(target_symbols[i] for i in row))
    text = "".join(line + "\n" for line in lines).encode("utf-8")
    write_atomic(path, lambda handle: handle.write(text))
