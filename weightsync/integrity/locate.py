"""Naming the exact copies (tensor, box, and for one flipped bit the element) behind a differing bucket.

A bucket's sum is the sum of its copies' sums (modulo 2**64), so with the sender's per-copy sums of a
failed step (the finer exchange, :mod:`.exchange`, on a mismatch only) a worker names each copy whose
landed bytes differ. A single flipped bit is even located to the element: it changes one word ``g``
(its position in the pair's word stream) by ``+-2**b``, so the difference of the sums is
``+-2**b * (2 * g + 1)`` modulo 2**64 -- ``b`` is the difference's count of trailing zeros and ``g``
follows modulo ``2**(63 - b)``; where exactly one word of the copy fits, the difference is exactly one
flipped bit of that word, and the worker says which element and bit (else it names the box only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weightsync.integrity.digest import WORD
from weightsync.integrity.sums import Region, SumPlan
from weightsync.layout.box import fmt_box
from weightsync.plan.planner import Copy, Pair

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Flip:
    """Where one flipped bit lies: the element's index in the destination tensor, the bit within it."""

    index: tuple[int, ...]
    bit: int
    bits: int  # the element's width


@dataclass(frozen=True)
class BadCopy:
    """One copy of a failed step whose landed bytes differ from what its training rank sent."""

    pair: Pair
    bucket: int
    copy: Copy
    flip: Flip | None  # the difference is exactly one flipped bit there; None: more than one, or ambiguous

    def describe(self) -> str:
        c = self.copy
        where = (f"one flipped bit: element {list(self.flip.index)}, bit {self.flip.bit} of {self.flip.bits}"
                 if self.flip is not None else "more than one bit differs")
        return (f"{c.dst_tensor} {fmt_box(c.dst_box)} ({where}; sent as training rank {self.pair[0]}'s "
                f"{c.src_tensor} {fmt_box(c.src_box)}, bucket {self.bucket})")


def single_flip(diff: int, region: Region, shape: tuple[int, ...], itemsize: int) -> Flip | None:
    """The element and bit whose flip makes ``landed - sent == diff`` (mod 2**64) in ``region`` (a
    destination box of ``shape`` holding ``itemsize``-byte elements), if exactly one word of it fits."""
    diff &= _MASK
    if diff == 0:
        return None
    b = (diff & -diff).bit_length() - 1
    m = 1 << (63 - b)  # the word position is known modulo m
    numel = 1
    for n in shape:
        numel *= n
    words = -(-numel * itemsize // WORD)
    found = set()
    for w in (diff >> b, -(diff >> b)):  # +-(2 * g + 1), modulo 2**(64 - b)
        g0 = ((w % (2 * m)) - 1) // 2 % m
        first = region.base + (g0 - region.base) % m
        hits = range(first, region.base + words, m)
        if len(hits) > 1:
            return None
        found.update(hits)
    if len(found) != 1:
        return None
    bit_at = (found.pop() - region.base) * WORD * 8 + b
    element, bit = divmod(bit_at, itemsize * 8)
    if element >= numel:  # the word's zero padding: no element there
        return None
    index, rest = [], element
    for n in reversed(shape):
        rest, i = divmod(rest, n)
        index.append(i)
    offsets = [o for o, _ in region.box]
    return Flip(tuple(o + i for o, i in zip(offsets, reversed(index))), bit, itemsize * 8)


def bad_copies(plan: SumPlan, buckets: list[tuple[Pair, int]], sent: Mapping[Pair, tuple[int, ...]],
               landed: Mapping[Pair, tuple[tuple[int, ...], ...]],
               targets: Mapping[str, torch.Tensor]) -> list[BadCopy]:
    """Every copy of the listed ``(pair, bucket number)`` whose landed sum differs from the sent one
    (``sent``: the sender's copy sums of each pair, flat in plan order; ``landed``: per bucket)."""
    out = []
    for pair, k in buckets:
        flat = sent[pair]
        at = sum(len(rs) for _, rs in plan.buckets[pair][:k])
        b, regions = plan.buckets[pair][k]
        for c, r, got, want in zip(b.copies, regions, landed[pair][k], flat[at : at + len(regions)]):
            if got != want:
                t = targets[r.tensor]
                shape = tuple(n for _, n in r.box)
                out.append(BadCopy(pair, b.index, c, single_flip(got - want, r, shape, t.element_size())))
    return out
