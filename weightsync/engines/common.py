"""Helpers shared by engine layouts: even splits, stacked (fused) tensors, vocab padding."""

from __future__ import annotations

from typing import Iterable, Sequence

from weightsync.errors import ConfigError
from weightsync.layout.box import Box, full_box
from weightsync.layout.layout import Group, Piece, Shard
from weightsync.spec.model import ModelSpec


def even(n: int, parts: int, index: int, what: str) -> tuple[int, int]:
    """(offset, length) of part ``index`` when ``n`` splits evenly into ``parts``."""
    if n % parts:
        raise ConfigError(f"{what}={n} is not divisible by {parts}")
    k = n // parts
    return index * k, k


def rows(box_rows: tuple[int, int], shape: Sequence[int]) -> Box:
    """A canonical box taking a row range and every column."""
    return (box_rows,) + full_box(tuple(shape[1:]))


def cols(box_cols: tuple[int, int], shape: Sequence[int]) -> Box:
    """A canonical box of a 2-D tensor taking every row and a column range."""
    return ((0, shape[0]), box_cols)


def local_box(canon_box: Box, row: int, lead: Sequence[tuple[int, int]] = ()) -> Box:
    """Where a canonical box lands in a local tensor stacked along dim 0 at ``row``.

    ``lead`` adds leading dimensions (the expert index of a stacked-experts tensor).
    """
    first = ((row, canon_box[0][1]),)
    return tuple(lead) + first + tuple((0, n) for _, n in canon_box[1:])


def stacked(
    group: Group,
    tensor: str,
    shape: tuple[int, ...],
    dtype: str,
    blocks: Iterable[tuple[str, Box]],
    canonical: str | None = None,
    lead: Sequence[tuple[int, int]] = (),
) -> list[Shard]:
    """Shards for a local tensor made of canonical boxes stacked along its dim 0 (after ``lead``).

    ``blocks`` lists every (canonical name, canonical box) in local row order; when ``canonical``
    is given, only the shards of that canonical tensor are returned (rows still advance past the
    others so offsets are right).
    """
    out, row = [], 0
    for name, box in blocks:
        if canonical is None or name == canonical:
            out.append(Shard(group, Piece(tensor, local_box(box, row, lead), name, box), shape, dtype))
        row += box[0][1]
    return out


def whole(group: Group, tensor: str, spec: ModelSpec, canonical: str, dtype: str | None = None) -> Shard:
    """A local tensor that is exactly one whole canonical tensor."""
    t = spec.tensor(canonical)
    return Shard(group, Piece(tensor, full_box(t.shape), canonical, full_box(t.shape)), t.shape, dtype or t.dtype)


def pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def vocab_shards(
    group_of, tensor: str, spec: ModelSpec, canonical: str, padded: int, parts: int, dtype: str | None = None
) -> list[Shard]:
    """Vocab-parallel rows: the padded vocab split evenly; rows past the real vocab hold nothing."""
    t = spec.tensor(canonical)
    per = padded // parts
    out = []
    for i in range(parts):
        lo, hi = i * per, min((i + 1) * per, t.shape[0])
        if hi > lo:
            box = rows((lo, hi - lo), t.shape)
            out.append(Shard(group_of(i), Piece(tensor, local_box(box, 0), canonical, box), (per,) + t.shape[1:], dtype or t.dtype))
    return out
