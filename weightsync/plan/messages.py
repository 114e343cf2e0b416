"""How a bucket travels: its copies merged into segments, the segments cut into messages.

Pure functions of a bucket (no torch), so both ends of a pair cut it the same way without talking,
and ``weightsync plan`` counts the messages a plan will send. Moving them is the transports' part
(:mod:`weightsync.payload.pack`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from weightsync.layout.box import Box
from weightsync.plan.planner import BLOCK, Bucket, Copy


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


DIRECT_MIN_BYTES = 8 << 20  # a segment this large travels as a message of its own


@dataclass(frozen=True, slots=True)
class Message:
    """A stretch ``[offset, offset + nbytes)`` of a bucket's buffer layout sent as one send/recv."""

    offset: int
    nbytes: int
    segments: tuple[Segment, ...]


def messages(bucket: Bucket, direct_min: int = DIRECT_MIN_BYTES) -> list[Message]:
    """The bucket cut into messages: each segment of at least ``direct_min`` bytes alone; the runs of
    smaller segments between them cut where the destination tensor changes, each such stretch of at
    least ``direct_min`` bytes alone and the smaller ones together.

    A pure function of the bucket, so both ends cut it the same way; each end then decides for itself
    whether a message moves in place (:func:`stage`). Large segments alone let NCCL read and write
    the live tensors directly; a large stretch of one destination tensor (the column halves of 64
    experts' ``down_proj``, say) can land in place although the sender packs it; the small rest go
    together so no message is tiny.
    """
    out: list[Message] = []
    small: list[Segment] = []  # the pending small stretches
    stretch: list[Segment] = []  # small segments into one destination tensor

    def emit(segs: list[Segment]) -> None:
        if segs:
            out.append(Message(segs[0].offset, sum(s.nbytes for s in segs), tuple(segs)))
            segs.clear()

    def close_stretch() -> None:
        if sum(s.nbytes for s in stretch) >= direct_min:
            emit(small)
            emit(stretch)
        else:
            small.extend(stretch)
            stretch.clear()

    for seg in segments(bucket):
        if seg.nbytes >= direct_min:
            close_stretch()
            emit(small)
            out.append(Message(seg.offset, seg.nbytes, (seg,)))
            continue
        if stretch and stretch[-1].dst_tensor != seg.dst_tensor:
            close_stretch()
        stretch.append(seg)
    close_stretch()
    emit(small)
    return out


def signature(bucket: Bucket) -> tuple:
    """A bucket's source bytes: buckets to several instances with one signature share one stored copy (the delta
    codec's previous version, :mod:`weightsync.codec.delta_state`; the simulator counts its encodings by it)."""
    return tuple((s.src_tensor, s.src_box, s.dtype) for s in segments(bucket))


def wire_bytes(copies: Sequence[Copy], fp8: Mapping[str, tuple[int, ...]]) -> int:
    """The bytes ``copies`` put on the wire under the fp8 codec (:mod:`weightsync.codec.fp8`: one byte an element
    and an fp32 scale per 128 x 128 block of an FP8 tensor ``fp8`` names, the rest as is), alignment aside."""
    n = 0
    for c in copies:
        if c.canonical in fp8:
            (_, rows), (_, cols) = c.canon_box
            n += rows * cols + 4 * -(-rows // BLOCK) * -(-cols // BLOCK)
        else:
            n += c.nbytes
    return n
