"""Pack a bucket's source boxes into one flat byte buffer and unpack it into destination views.

The buffer layout is the bucket's copies back to back, each in its wire dtype (the source's), so
both ends derive offsets from the plan alone. Unpacking copies into the live destination tensors
in place, converting dtype where the destination differs (as loading a checkpoint would).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from weightsync.layout.box import Box, slices
from weightsync.layout.materialize import TORCH_DTYPES
from weightsync.plan.planner import Bucket


def bucket_bytes(bucket: Bucket) -> int:
    return sum(c.nbytes for c in bucket.copies)


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of a bucket's copies that are adjacent in both tensors: moved with one copy each way."""

    src_tensor: str
    src_box: Box
    dst_tensor: str
    dst_box: Box
    dtype: str
    offset: int  # in the bucket's buffer
    nbytes: int


def _extend(a: Box, b: Box) -> Box | None:
    """``a`` and ``b`` joined when ``b`` continues ``a`` in row-major order, else None.

    True when, at the first dimension where they differ, ``b`` starts where ``a`` ends, every earlier
    dimension has extent 1 at the same offset, and every later one is the same range: then the
    flattened bytes of the joined box are those of ``a`` followed by those of ``b``.
    """
    if len(a) != len(b):
        return None
    for d, ((ao, an), (bo, bn)) in enumerate(zip(a, b)):
        if (ao, an) == (bo, bn) and an == 1:
            continue
        if bo != ao + an or a[d + 1 :] != b[d + 1 :]:
            return None
        return a[:d] + ((ao, an + bn),) + a[d + 1 :]
    return None


def _join(a: Segment, b: Segment) -> Segment | None:
    if (a.src_tensor, a.dst_tensor, a.dtype) != (b.src_tensor, b.dst_tensor, b.dtype):
        return None
    src = _extend(a.src_box, b.src_box)
    dst = _extend(a.dst_box, b.dst_box) if src is not None else None
    if dst is None:
        return None
    return Segment(a.src_tensor, src, a.dst_tensor, dst, a.dtype, a.offset, a.nbytes + b.nbytes)


_SEGMENTS: dict[int, tuple[Bucket, list[Segment]]] = {}


def segments(bucket: Bucket) -> list[Segment]:
    """The bucket's copies merged into as few segments as the tensors allow (computed once per bucket).

    The buffer layout is unchanged: a segment's bytes are exactly its copies' bytes back to back, so
    a sender and a receiver may merge differently and still agree. Stacked experts, [gate; up]
    halves and consecutive rows become one copy instead of thousands of small ones.
    """
    got = _SEGMENTS.get(id(bucket))
    if got is not None and got[0] is bucket:
        return got[1]
    out: list[Segment] = []
    off = 0
    for c in bucket.copies:
        out.append(Segment(c.src_tensor, c.src_box, c.dst_tensor, c.dst_box, c.dtype, off, c.nbytes))
        off += c.nbytes
        # reduce like a stack, so halves that joined can join their neighbour in turn ([gate; up] of
        # expert e, then experts e and e+1)
        while len(out) >= 2 and (joined := _join(out[-2], out[-1])) is not None:
            out[-2:] = [joined]
    if len(_SEGMENTS) > 100_000:  # plans are reused every step; this only bounds a pathological caller
        _SEGMENTS.clear()
    _SEGMENTS[id(bucket)] = (bucket, out)
    return out


def pack(bucket: Bucket, sources: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather the bucket's source boxes into ``out`` (a uint8 buffer, allocated when None)."""
    n = bucket_bytes(bucket)
    if out is None:
        out = torch.empty(n, dtype=torch.uint8, device=next(iter(sources.values())).device)
    for seg in segments(bucket):
        src = sources[seg.src_tensor][slices(seg.src_box)]
        dst = out[seg.offset : seg.offset + seg.nbytes].view(TORCH_DTYPES[seg.dtype])
        dst.view(src.shape).copy_(src)
    return out[:n]


def unpack(bucket: Bucket, buffer: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> None:
    """Scatter a packed buffer into the destination tensors in place."""
    for seg in segments(bucket):
        region = targets[seg.dst_tensor][slices(seg.dst_box)]
        region.copy_(buffer[seg.offset : seg.offset + seg.nbytes].view(TORCH_DTYPES[seg.dtype]).view(region.shape))


def direct_view(bucket: Bucket, tensors: Mapping[str, torch.Tensor], sending: bool) -> torch.Tensor | None:
    """The bucket's bytes as they lie in place, when no pack/unpack is needed; else None.

    True when the whole bucket is one segment whose region is contiguous in this side's tensor and
    already in the wire dtype: then sending from it (or receiving into it) moves exactly the bytes
    the packed buffer would hold, with no copy at either end.
    """
    segs = segments(bucket)
    if len(segs) != 1:
        return None
    seg = segs[0]
    name, box = (seg.src_tensor, seg.src_box) if sending else (seg.dst_tensor, seg.dst_box)
    region = tensors[name][slices(box)]
    if region.dtype != TORCH_DTYPES[seg.dtype] or not region.is_contiguous():
        return None
    return region.view(-1).view(torch.uint8)
