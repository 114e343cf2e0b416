"""Boxes: rectangular regions of a tensor, as one (offset, length) pair per dimension."""

from __future__ import annotations

import math

Box = tuple[tuple[int, int], ...]


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(n for _, n in box)


def box_numel(box: Box) -> int:
    return math.prod(n for _, n in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common region of two boxes of the same tensor, or None when they do not overlap."""
    out = []
    for (ao, an), (bo, bn) in zip(a, b):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        out.append((lo, hi - lo))
    return tuple(out)


def contains(outer: Box, inner: Box) -> bool:
    return all(oo <= io and io + il <= oo + ol for (oo, ol), (io, il) in zip(outer, inner))


def translate(sub: Box, frm: Box, to: Box) -> Box:
    """Map ``sub`` (inside box ``frm``) to the same relative region of box ``to``.

    ``to`` may have extra leading dimensions of length 1 (a stacked-experts tensor holding one
    expert's matrix), which are kept as they are.
    """
    extra = len(to) - len(frm)
    head = to[:extra]
    return head + tuple((t + (s - f), n) for (s, n), (f, _), (t, _) in zip(sub, frm, to[extra:]))


def split_dim(box: Box, dim: int, parts: int) -> list[Box]:
    """Split a box into ``parts`` near-equal slabs along ``dim`` (empty slabs dropped)."""
    off, n = box[dim]
    out = []
    for i in range(parts):
        lo, hi = off + n * i // parts, off + n * (i + 1) // parts
        if hi > lo:
            out.append(box[:dim] + ((lo, hi - lo),) + box[dim + 1 :])
    return out


def split_to_fit(box: Box, itemsize: int, max_bytes: int) -> list[Box]:
    """Split a box into slabs along its first splittable dimension so each fits ``max_bytes``.

    Slabs along the outermost dimension with more than one row keep each slab a contiguous
    run of the slower dimensions, which is what pack/unpack copy best.
    """
    nbytes = box_numel(box) * itemsize
    if nbytes <= max_bytes:
        return [box]
    for dim, (_, n) in enumerate(box):
        if n > 1:
            row = nbytes // n
            per = max(1, max_bytes // row)
            parts = -(-n // per)
            slabs = split_dim(box, dim, parts)
            if row > max_bytes:  # one row is still too big: split deeper
                return [s for slab in slabs for s in split_to_fit(slab, itemsize, max_bytes)]
            return slabs
    return [box]


def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in box)


def fmt_box(box: Box) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in box) + "]"
