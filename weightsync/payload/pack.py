"""A bucket's bytes on the wire: its layout, the messages it is cut into, and packing where needed.

The bucket's *buffer layout* is its copies back to back, each in its wire dtype (the source's), so
both ends derive every offset from the plan alone; copies adjacent in both tensors merge into
*segments*. The layout is cut into *messages* (:func:`messages`): each large segment alone, the small
ones between them by destination tensor. Each end then moves each message in place when it holds
that message's bytes back to back in the wire dtype -- NCCL reads the trainer's tensor or writes the
engine's directly -- and otherwise through a buffer it packs (sender) or unpacks (receiver). So a
bucket costs no copy at all where both layouts agree (hf -> vLLM TP=1: every large segment), one where
only one does (a column half of a row-parallel weight; Megatron's per-expert halves, stacked in vLLM's
``w13``), and the buffer holds only the staged messages.

Where the destination's dtype differs from the wire's (an fp32 trainer into a bf16 engine), the receiver
converts once, as loading a checkpoint would -- and that cast is the codec's, not the transport's: a
transport asks :func:`unpacked` how the pairs it unpacked land (:class:`Landing`: byte copies for its copy
kernel, :mod:`weightsync.transport.batch_copy`, which refuses a cast; the codec's casts as the work after
them) and runs that (:func:`run_landing`, or :class:`~weightsync.transport.graphs.CopyGraphs`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch

from weightsync.layout.box import slices
from weightsync.layout.materialize import TORCH_DTYPES
from weightsync.plan.messages import DIRECT_MIN_BYTES, Message, Segment, bucket_bytes, messages, segments  # noqa: F401 - re-exported
from weightsync.plan.planner import Bucket, Pair

if TYPE_CHECKING:
    from weightsync.payload.codec import Codec


def pack(bucket: Bucket, sources: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather the bucket's source boxes into ``out`` (a uint8 buffer, allocated when None)."""
    n = bucket_bytes(bucket)
    if out is None:
        out = torch.empty(n, dtype=torch.uint8, device=next(iter(sources.values())).device)
    pack_segments(segments(bucket), sources, out)
    return out[:n]


def unpack(bucket: Bucket, buffer: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> None:
    """Scatter a packed buffer into the destination tensors in place, converting dtype where a target's
    differs (``copy_``): the full codec's frame (:class:`~weightsync.codec.full.FullDecoder`) and the
    reference in tests; a transport lands what it unpacked through :func:`unpacked` instead."""
    unpack_segments(segments(bucket), buffer, targets)


def active(plans: Mapping[Pair, list[Bucket]]) -> dict[Pair, list[Bucket]]:
    """The pairs with bytes to move and their non-empty buckets, in the pair's bucket order."""
    out = {}
    for pair in sorted(plans):
        bs = sorted((b for b in plans[pair] if b.nbytes > 0), key=lambda b: b.index)
        if bs:
            out[pair] = bs
    return out


Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (destination view, source view): the copies of a step


@dataclass(frozen=True)
class Landing:
    """How a codec lands bytes a receiver holds -- sources read in place (co-located), or a bucket unpacked
    from a transport's buffer in the wire dtype (:func:`unpacked`): ``copies``, byte copies between views of
    one dtype, which the transport moves with its copy kernel, and ``work``, the codec's own kernels after
    them (the full codec's casts to the receiver's dtype, FP8's quantization into the live e4m3 weight and
    its scales). ``work`` allocates nothing and never synchronizes on CUDA, so the transport captures it in
    the same CUDA graph as the copies; it may run more than once (it writes the same bytes)."""

    copies: Pairs
    work: Callable[[], None] | None = None


def join(landings: Sequence[Landing]) -> Landing:
    """Several landings as one: every copy (one batched kernel), then each one's work in order."""
    works = [ld.work for ld in landings if ld.work is not None]

    def work() -> None:
        for w in works:
            w()

    return Landing([p for ld in landings for p in ld.copies], work if works else None)


def pack_pairs(segs: Sequence[Segment], sources: Mapping[str, torch.Tensor], out: torch.Tensor) -> Pairs:
    """The copies gathering ``segs`` into their places in ``out`` (the bucket's buffer)."""
    pairs = []
    for seg in segs:
        src = sources[seg.src_tensor][slices(seg.src_box)]
        pairs.append((out[seg.offset : seg.offset + seg.nbytes].view(TORCH_DTYPES[seg.dtype]).view(src.shape), src))
    return pairs


def unpack_pairs(segs: Sequence[Segment], buffer: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> Pairs:
    """The copies scattering ``segs`` from their places in ``buffer`` into the targets: each from the wire
    dtype to the target's, so some may be casts (a transport lands them through :func:`unpacked`)."""
    pairs = []
    for seg in segs:
        region = targets[seg.dst_tensor][slices(seg.dst_box)]
        wire = buffer[seg.offset : seg.offset + seg.nbytes].view(TORCH_DTYPES[seg.dtype])
        pairs.append((region, wire.view(region.shape)))
    return pairs


def direct_pairs(segs: Sequence[Segment], sources: Mapping[str, torch.Tensor],
                 targets: Mapping[str, torch.Tensor]) -> Pairs:
    """The copies moving ``segs`` straight from the sources into the targets (same process, no buffer):
    the same elements in the same row-major order, shaped as each side's box."""
    return [(targets[seg.dst_tensor][slices(seg.dst_box)], sources[seg.src_tensor][slices(seg.src_box)])
            for seg in segs]


def copy_pairs(pairs: Pairs) -> None:
    """Do ``pairs`` one ``copy_`` at a time (views shaped apart go through a reshape; a pair of two dtypes
    converts, which only a codec asks for)."""
    for dst, src in pairs:
        dst.copy_(src if src.shape == dst.shape else src.reshape(dst.shape))


def unpacked(codec: Codec | None, pairs: Pairs) -> Landing:
    """How ``pairs`` -- the plan's bytes, arrived whole in the wire dtype (:func:`unpack_pairs`,
    :func:`direct_pairs`) -- land: ``codec``'s :meth:`~weightsync.payload.codec.Codec.unpacked` (byte copies
    for the transport, the codec's casts as the work after them). With no codec (a transport built directly,
    ``TransportOptions.codec`` None) they are byte copies only, and a pair whose dtypes differ is refused:
    the cast is a codec's work."""
    if codec is not None:
        return codec.unpacked(pairs)
    for dst, src in pairs:
        if dst.dtype != src.dtype:
            raise ValueError(f"a {src.dtype} {tuple(src.shape)} piece lands in a {dst.dtype} {tuple(dst.shape)} "
                             "target, and no codec was given to cast it: pass the full codec "
                             "(weightsync.codec.full.FullCodec(), as TransportOptions.codec or the transport's codec=)")
    return Landing(pairs)


def run_landing(landing: Landing) -> None:
    """Do ``landing`` now, on the current stream: its byte copies one ``copy_`` each, then its work (a
    transport path that replays no graph; :class:`~weightsync.transport.graphs.CopyGraphs` batches them)."""
    copy_pairs(landing.copies)
    if landing.work is not None:
        landing.work()


def pack_segments(segs: Sequence[Segment], sources: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """Gather ``segs`` into their places in ``out`` (the bucket's whole buffer)."""
    copy_pairs(pack_pairs(segs, sources, out))


def unpack_segments(segs: Sequence[Segment], buffer: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> None:
    """Scatter ``segs`` from their places in ``buffer`` (the bucket's whole buffer) into the targets."""
    copy_pairs(unpack_pairs(segs, buffer, targets))


def in_place(segs: Sequence[Segment], tensors: Mapping[str, torch.Tensor], sending: bool) -> torch.Tensor | None:
    """A message's bytes as they lie in this side's tensor (a uint8 view), or None when they must go
    through the buffer: a region is strided or in another dtype than the wire's, or the regions of the
    message's segments do not follow each other in one tensor's memory.

    The segments need not be adjacent on the other side: an expert's column half of ``down_proj``
    that the trainer holds strided, say, lands straight in vLLM's ``w2_weight``, where the halves of
    consecutive experts lie back to back; only the sender packs."""
    name = None
    start = end = 0
    first: torch.Tensor | None = None
    for seg in segs:
        seg_name, box = (seg.src_tensor, seg.src_box) if sending else (seg.dst_tensor, seg.dst_box)
        region = tensors[seg_name][slices(box)]
        if region.dtype != TORCH_DTYPES[seg.dtype] or not region.is_contiguous():
            return None
        if first is None:
            name, first, start = seg_name, region, region.storage_offset()
        elif seg_name != name or region.storage_offset() != end:
            return None
        end = region.storage_offset() + region.numel()
    if first is None:
        return None
    # the regions tile [start, end) of one storage, each contiguous: one flat view covers exactly them
    return first.as_strided((end - start,), (1,), start).view(torch.uint8)


@dataclass(frozen=True)
class Staging:
    """How one side moves one bucket: per message, a view of its bytes in place or ``(offset, nbytes)``
    in the buffer; the segments to pack there before sending / unpack from there after receiving,
    at their buffer offsets; and the buffer bytes the bucket needs (the staged messages back to back)."""

    posts: tuple[torch.Tensor | tuple[int, int], ...]
    staged: tuple[Segment, ...]
    nbytes: int

    def tensors(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The tensor to send from / receive into for each message, staged ones in ``buffer``."""
        return [p if isinstance(p, torch.Tensor) else buffer[p[0] : p[0] + p[1]] for p in self.posts]


def stage(bucket: Bucket, tensors: Mapping[str, torch.Tensor], sending: bool,
          direct_min: int = DIRECT_MIN_BYTES, direct: bool = True) -> Staging:
    """Each message of ``bucket`` (:func:`messages`; both ends must pass the same ``direct_min``) in
    place when this side holds its bytes as one contiguous stretch in the wire dtype (:func:`in_place`),
    else through the buffer, where only such messages take room. ``direct=False``: every message through
    the buffer (a receiver that must be able to fence an abandoned receive off its targets:
    :mod:`weightsync.transport.fence`)."""
    posts: list[torch.Tensor | tuple[int, int]] = []
    staged: list[Segment] = []
    at = 0
    for m in messages(bucket, direct_min):
        view = in_place(m.segments, tensors, sending) if direct else None
        if view is None:
            posts.append((at, m.nbytes))
            staged.extend(replace(s, offset=at + s.offset - m.offset) for s in m.segments)
            at += m.nbytes
        else:
            posts.append(view)
    return Staging(tuple(posts), tuple(staged), at)
