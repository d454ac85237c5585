"""A joined batch: several of the user's batches in one sample, which states its parts itself.

`join_batches` joins LanguagePairDataset batches into one sample, each collated as fairseq collates it alone and
padded to the widest on the side the dataset pads, and states which rows and columns of the source tokens hold each
user batch on the source tokens tensor itself (its attribute USER_BATCHES): the statement travels with the tensor
wherever a CLI takes it, fairseq-interactive included, which rebuilds each batch's dict from its tensors.
`user_batches(sample)` reads and checks it (the static beam search decodes each part on a thread of its own). The
task's side (which batches are joined, and when) is batch_groups.py.
"""
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

# the attribute of a joined sample's source tokens that lists each user batch's (rows, columns) of them, in order
USER_BATCHES = "rfa_user_batches"

# the keys of a LanguagePairDataset batch that join_batches joins along the sentences (it refuses others;
# batch_groups.joinable leaves the datasets whose batches have others, alignments and constraints, to fairseq)
TOKEN_KEYS = {"src_tokens": "source", "prev_output_tokens": "target", "target": "target"}  # -> whose padding side
ROW_KEYS = ("id", "src_lengths", "src_lang_id", "tgt_lang_id")
COUNT_KEYS = ("nsentences", "ntokens")


def user_batches(sample: dict) -> Optional[List[Tuple[slice, slice]]]:
    """For a joined batch (join_batches): each user batch's (rows, columns) of its source tokens, as its source tokens
    state them (USER_BATCHES); None for any other batch. A record that does not cover the source tokens, row after
    row, is an error naming the part that does not fit."""
    src_tokens = sample["net_input"]["src_tokens"]
    parts = getattr(src_tokens, USER_BATCHES, None)
    if parts is None:
        return None
    rows_total, width = src_tokens.shape[:2]
    next_row = 0
    for i, part in enumerate(parts):
        rows, columns = part
        if not (isinstance(rows, slice) and isinstance(columns, slice)) or rows.step not in (None, 1):
            raise ValueError(f"rfa_fairseq: {USER_BATCHES}[{i}] of a joined batch is {part!r}, not a (rows, columns) "
                             f"pair of slices")
        if (rows.start != next_row or rows.stop is None or not rows.start < rows.stop <= rows_total
                or len(range(width)[columns]) == 0):
            raise ValueError(f"rfa_fairseq: {USER_BATCHES}[{i}] of a joined batch, rows {rows.start}:{rows.stop} and "
                             f"columns {columns.start}:{columns.stop}, does not follow the rows before it (from "
                             f"{next_row}) inside its source tokens of shape ({rows_total}, {width})")
        next_row = rows.stop
    if next_row != rows_total:
        raise ValueError(f"rfa_fairseq: the {len(parts)} user batches of a joined batch ({USER_BATCHES}) hold "
                         f"{next_row} rows, its source tokens {rows_total}")
    return list(parts)


def state_user_batches(src_tokens: Tensor, parts: List[Tuple[slice, slice]]) -> Tensor:
    """`src_tokens`, stating that its rows and columns `parts` hold one user batch each (USER_BATCHES). -> src_tokens"""
    setattr(src_tokens, USER_BATCHES, list(parts))
    return src_tokens


def _pad_to(tokens: Tensor, width: int, pad: int, left: bool) -> Tensor:
    extra = width - tokens.size(1)
    if extra == 0:
        return tokens
    filler = tokens.new_full((tokens.size(0), extra), pad)
    return torch.cat([filler, tokens] if left else [tokens, filler], dim=1)


def join_batches(batches: List[dict], pad: int, left_pad: Dict[str, bool]) -> dict:
    """LanguagePairDataset batches -> one batch of all their sentences in order, each token tensor padded to the
    widest (left_pad: "source" / "target" -> whether that side pads on the left), its source tokens stating each
    batch's rows and columns (USER_BATCHES). One batch is returned as it is."""
    if len(batches) == 1:
        return batches[0]

    def join(key: str, values: list):
        if key in COUNT_KEYS:
            return sum(values)
        if all(v is None for v in values):
            return None
        if key in TOKEN_KEYS:
            width = max(v.size(1) for v in values)
            return torch.cat([_pad_to(v, width, pad, left_pad[TOKEN_KEYS[key]]) for v in values])
        if key in ROW_KEYS:
            return torch.cat(values)
        raise ValueError(f"rfa_fairseq: cannot join batches with the key {key!r}")

    joined = {key: join(key, [b[key] for b in batches]) for key in batches[0] if key != "net_input"}
    joined["net_input"] = {key: join(key, [b["net_input"][key] for b in batches]) for key in batches[0]["net_input"]}
    joined_width = joined["net_input"]["src_tokens"].size(1)
    parts, row = [], 0
    for b in batches:
        rows, width = b["net_input"]["src_tokens"].shape
        columns = slice(joined_width - width, joined_width) if left_pad["source"] else slice(0, width)
        parts.append((slice(row, row + rows), columns))
        row += rows
    state_user_batches(joined["net_input"]["src_tokens"], parts)
    return joined
