"""The fp8 codec: bf16/fp32 trainer weights sent as 128 x 128 block FP8 into an FP8-served engine (issue 24).

An engine declared ``quant=fp8`` (``vllm:tp=2,quant=fp8``) holds each linear weight in e4m3 with an fp32
``<weight>_scale_inv`` beside it (:mod:`weightsync.quant.layout`). The training rank quantizes each bucket's FP8
copies per 128 x 128 block (:func:`weightsync.quant.fp8.quantize`: the DeepGEMM/vLLM ``per_block_cast_to_fp8``
definition, the Triton kernel on a GPU) and sends the e4m3 bytes and their blocks' scales; the receiver writes
both into its live FP8 weight and its ``_scale_inv``. Tensors that stay in the model dtype (embeddings, norms,
``lm_head``, routers, ignored modules) travel as the full codec sends them, in the same frame.

Why the plan covers the weights only (the planner's destination is the engine's unquantized layout, the scale
following its weight inside this codec): a scale tensor has no source on the trainer side -- it is *made* from
the weight's blocks -- so planning it as a canonical tensor would need a source nobody holds. A copy of a weight
whose source box starts on a block and ends on a block or at the tensor's edge holds whole blocks, so its
blocks' scales are a pure function of its own bytes, and its scale box in the engine's ``_scale_inv`` is the
weight box counted in blocks (:func:`scale_box`; fused tensors' parts start on blocks: :mod:`weightsync.quant.
config` refuses the layouts where they do not). A copy that cuts a block (a trainer shard of 64 rows) is refused
at set-up, naming the tensor, its box and the block. The job's planner cuts FP8 weights on blocks itself where it
stripes a tensor over replicas or slabs a copy larger than a bucket (``Planner(block_aligned=...)``, passed by
:meth:`weightsync.plan.job.JobShape.planner`); a training layout whose own shards cut blocks stays refused (Kimi-K2
and DeepSeek-V3 under Megatron TP=8: ``q_a_proj`` 192 rows and ``kv_a_proj_with_mqa`` 72 rows a rank -- a block
scale made across training ranks is not built). Quantizing a whole-block sub-box gives the bits quantizing the
whole canonical tensor gives (each block's amax and scale see the same 128 x 128 values, the edge blocks the
same zero padding), which is what ``save_checkpoint(dir, quant="fp8")`` writes.

Payload of one bucket (both ends derive every offset from the plan, :func:`frame_layout`): the bucket's non-FP8
copies packed as the full codec packs them, then per FP8 copy its e4m3 bytes and its fp32 scales, each at a
16-byte boundary.

Where it runs (:data:`SERVED`): p2p and file in sync mode (their frame paths), co-located (:meth:`FP8Codec.land`),
and nixl in sync and async mode (each trainer quantizes every distinct bucket into its registered frames region,
each worker READs the payloads alone: :class:`weightsync.transport.nixl.FrameReads`). Its frames are the only form
a receiver lands (:attr:`~weightsync.payload.codec.Codec.needs_frames`): where a transport cannot serve one, the step
fails rather than read the plan's bf16 bytes whole. p2p in async mode is refused at set-up
(:func:`weightsync.codec.registry.check_engine`), as are delta with FP8 (a delta of the e4m3 bytes is not built) and integrity checks (the
sums cover the bf16 sources, not what lands).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from weightsync.engines.config import engine_quant
from weightsync.payload.codec import SENDER_STEP, Codec, CodecJob, CodecStats, Decoder, Encoder, Frame, Header
from weightsync.errors import ConfigError
from weightsync.layout.box import Box, slices
from weightsync.plan.messages import bucket_bytes, wire_bytes
from weightsync.plan.planner import Bucket, Copy, Pair
from weightsync.quant.fp8 import BLOCK, Quantized, cdiv, prepare, quantize
from weightsync.codec.full import Direct, landing
from weightsync.payload.pack import (Landing, Pairs, copy_pairs, direct_pairs, pack, pack_pairs, segments,
                                      unpack_pairs)

if TYPE_CHECKING:
    from weightsync.spec.model import ModelSpec
    from weightsync.transport.base import TransportOptions

log = logging.getLogger("weightsync.codec.fp8")

KIND_FP8 = 0  # Header.kind: a bucket as this module's payload (module docstring)
ALIGN = 16
SOURCE_DTYPES = ("bfloat16", "float32")
#: where the fp8 codec runs (transport, mode): the ones built and tested end to end
SERVED = (("p2p", "sync"), ("file", "sync"), ("colocated", "sync"), ("nixl", "sync"), ("nixl", "async"))
#: why it does not run where a transport would serve it (said in the refusal)
WHY_NOT: dict[tuple[str, str], str] = {}


def fp8_options(opts: TransportOptions, infer: str, spec: ModelSpec) -> TransportOptions | None:
    """``opts`` with the fp8 codec where ``infer`` is declared ``quant=fp8`` (None otherwise): what the session's
    :func:`weightsync.codec.registry.make_job_codec` makes, for a transport built directly."""
    if engine_quant(infer) == "none":
        return None
    return replace(opts, codec=FP8Codec.for_job(CodecJob(infer, spec)))


def scale_box(box: Box) -> Box:
    """A weight box (leading dims, then rows and columns starting on blocks) counted in 128 blocks."""
    lead = len(box) - 2
    return (*box[:lead], *((o // BLOCK, cdiv(n, BLOCK)) for o, n in box[lead:]))


def _check_copy(c: Copy, shape: tuple[int, ...], where: str) -> None:
    """Refuse an FP8 copy that holds part of a block (its blocks' scales would need bytes it does not have)."""
    if c.dtype not in SOURCE_DTYPES:
        raise ConfigError(f"fp8: {where} holds {c.canonical} in {c.dtype}; block FP8 is quantized from bf16 or fp32 "
                          "weights only")
    if len(c.canon_box) != 2:
        raise ConfigError(f"fp8: {c.canonical} box {list(c.canon_box)} is not 2-d; block FP8 needs 2-d weights")
    for (o, n), size, what in zip(c.canon_box, shape, ("rows", "columns")):
        if o % BLOCK or (n % BLOCK and o + n != size):
            raise ConfigError(
                f"fp8: {where} sends {what} {o}..{o + n} of {c.canonical} {list(shape)} (box {list(c.canon_box)}), "
                f"which cuts a {BLOCK} x {BLOCK} FP8 block: a block's scale needs the whole block on one training "
                f"rank; choose a training layout that shards {c.canonical} in multiples of {BLOCK} {what} (a plan "
                f"not made by the job's planner: plan with block_aligned, weightsync.plan.job.block_aligned)")
    lead = len(c.dst_box) - 2
    if any(o % BLOCK for o, _ in c.dst_box[lead:]):
        raise ConfigError(f"fp8: {c.canonical} lands at {list(c.dst_box)} of {c.dst_tensor}, off the {BLOCK} x "
                          f"{BLOCK} blocks of the engine's FP8 tensor")


def _check_target(targets: Mapping[str, torch.Tensor], name: str) -> None:
    """The engine must hold ``name`` in e4m3 beside an fp32 ``_scale_inv`` (else: not served FP8)."""
    t, s = targets.get(name), targets.get(name + "_scale_inv")
    if t is None or t.dtype != torch.float8_e4m3fn or s is None or s.dtype != torch.float32:
        got = "missing" if t is None else str(t.dtype).removeprefix("torch.")
        raise ConfigError(
            f"fp8: the engine holds {name} as {got}{'' if s is not None else ' with no ' + name + '_scale_inv'}; an "
            "engine declared quant=fp8 holds it in float8_e4m3fn with an fp32 _scale_inv: start the engine on an FP8 "
            "checkpoint, or drop quant=fp8")


def _rows(region: torch.Tensor, shape: tuple[int, int], name: str, box: Box) -> torch.Tensor:
    """``region`` (a box of a live tensor) as a 2-d view of ``shape`` whose rows are contiguous, which the quantizer
    writes in place; refused otherwise (set-up: nothing written yet)."""
    try:
        v = region.view(shape)
    except RuntimeError:
        v = None
    if v is None or (shape[1] > 1 and v.stride(1) != 1):
        raise ConfigError(f"fp8: {name} box {list(box)} is not rows of contiguous elements in the engine's tensor "
                          f"(strides {list(region.stride())}), which a co-located FP8 sync writes in place; use the "
                          "p2p or file transport for this engine")
    return v


@dataclass(frozen=True)
class Part:
    """One FP8 copy's place in a bucket's payload."""

    copy: Copy
    weight: int  # offset of its e4m3 bytes
    scale: int  # offset of its fp32 scales
    rows: int
    cols: int

    @property
    def scale_shape(self) -> tuple[int, int]:
        return cdiv(self.rows, BLOCK), cdiv(self.cols, BLOCK)


@dataclass(frozen=True)
class FrameLayout:
    """A bucket's payload: its non-FP8 copies (``plain``, packed at 0) and its FP8 copies' places."""

    plain: Bucket | None
    parts: tuple[Part, ...]
    nbytes: int


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def frame_layout(bucket: Bucket, fp8: Mapping[str, tuple[int, ...]]) -> FrameLayout:
    """Where each byte of ``bucket``'s payload goes (both ends compute it from the plan)."""
    plain = tuple(c for c in bucket.copies if c.canonical not in fp8)
    sub = Bucket(bucket.src_rank, bucket.dst_instance, bucket.dst_rank, bucket.index, plain) if plain else None
    at = bucket_bytes(sub) if sub is not None else 0
    parts = []
    for c in bucket.copies:
        if c.canonical not in fp8:
            continue
        (_, rows), (_, cols) = c.canon_box
        w = _align(at)
        s = _align(w + rows * cols)
        at = s + 4 * cdiv(rows, BLOCK) * cdiv(cols, BLOCK)
        parts.append(Part(c, w, s, rows, cols))
    return FrameLayout(sub, tuple(parts), at)


def _views(payload: torch.Tensor, p: Part) -> Quantized:
    w = payload[p.weight : p.weight + p.rows * p.cols].view(torch.float8_e4m3fn).view(p.rows, p.cols)
    sr, sc = p.scale_shape
    return Quantized(w, payload[p.scale : p.scale + 4 * sr * sc].view(torch.float32).view(sr, sc))


@dataclass(frozen=True)
class FP8Codec(Codec):
    """``fp8``: each FP8 canonical weight's name and shape (from the engine's layout, :func:`fp8_options`)."""

    fp8: tuple[tuple[str, tuple[int, ...]], ...] = ()

    name = "fp8"
    needs = frozenset({SENDER_STEP})
    framed = True
    sized = True  # every frame's size is the plan's (its layout): posted with its header
    needs_frames = True  # the bf16 plan bytes read whole into an e4m3 weight would be cast without their scales
    runs_on = frozenset(SERVED)
    why_not = WHY_NOT

    @classmethod
    def for_job(cls, job: CodecJob) -> FP8Codec:
        """The FP8 weights of ``job.infer``'s layout (a layout whose pieces cut a block is refused:
        :func:`weightsync.quant.layout.fp8_layout`); none before the job is agreed (the session makes it anew)."""
        if job.infer is None or job.spec is None:
            return cls()
        from weightsync.engines import make_layout
        from weightsync.quant.layout import fp8_layout

        layout = fp8_layout(make_layout(job.spec, job.infer))
        return cls(tuple(sorted((n, tuple(f.weight.shape)) for n, f in layout.fp8.items())))

    def encoder(self, plans: Mapping[Pair, list[Bucket]], device: torch.device) -> FP8Encoder:
        return FP8Encoder(plans, dict(self.fp8))

    def decoder(self, plans: Mapping[Pair, list[Bucket]]) -> FP8Decoder:
        return FP8Decoder(plans, dict(self.fp8))

    #: it lands from sources read in place (co-located): :meth:`land`
    lands = True

    def land(self, items: Sequence[Direct]) -> Landing:
        """Co-located: each bucket's non-FP8 copies as the full codec lands them, and each FP8 copy quantized
        straight from the trainer's tensor into its box of the engine's live e4m3 weight and of its ``_scale_inv``
        (:func:`weightsync.quant.fp8.quantize` with ``out=`` those views: the Triton kernel on a GPU, one launch a
        copy, captured with the copies in the transport's CUDA graph). Refuses, at the first step and before any
        byte moves, a receiver that does not hold the FP8 form or a box the kernel cannot write in place."""
        fp8 = dict(self.fp8)
        pairs: list = []
        jobs: list[tuple[torch.Tensor, Quantized, str]] = []
        checked: set[str] = set()
        for b, src, dst in items:
            for c in b.copies:
                if c.canonical in fp8:
                    _check_copy(c, fp8[c.canonical], f"the plan (training rank {b.src_rank} -> instance "
                                                     f"{b.dst_instance} rank {b.dst_rank})")
            lay = frame_layout(b, fp8)
            if lay.plain is not None:
                pairs += direct_pairs(segments(lay.plain), src, dst)
            for p in lay.parts:
                c = p.copy
                if c.dst_tensor not in checked:
                    _check_target(dst, c.dst_tensor)
                    checked.add(c.dst_tensor)
                x = src[c.src_tensor][slices(c.src_box)]
                w = _rows(dst[c.dst_tensor][slices(c.dst_box)], (p.rows, p.cols), c.dst_tensor, c.dst_box)
                sbox = scale_box(c.dst_box)
                sc = _rows(dst[c.dst_tensor + "_scale_inv"][slices(sbox)], p.scale_shape, c.dst_tensor + "_scale_inv",
                           sbox)
                jobs.append((_matrix(x, p.rows, p.cols, pairs), Quantized(w, sc), c.canonical))
        plain = landing(pairs)

        def work() -> None:
            if plain.work is not None:
                plain.work()
            for x, out, name in jobs:
                quantize(x, out=out, name=name)

        return Landing(plain.copies, work if jobs or plain.work is not None else None)

    def landed_bytes(self, bucket: Bucket) -> int:
        """What landing ``bucket`` writes: e4m3 bytes and fp32 scales for its FP8 copies, the plan's bytes for the
        rest (alignment aside)."""
        return wire_bytes(bucket.copies, dict(self.fp8))


def _layouts(plans: Mapping[Pair, list[Bucket]], fp8: Mapping[str, tuple[int, ...]],
             side: str) -> dict[tuple, FrameLayout]:
    """Every bucket's payload layout, refusing (set-up) an FP8 copy that cuts a block."""
    out = {}
    for pair, bs in plans.items():
        for b in bs:
            for c in b.copies:
                if c.canonical in fp8:
                    _check_copy(c, fp8[c.canonical], f"{side} (training rank {b.src_rank} -> instance "
                                                     f"{b.dst_instance} rank {b.dst_rank})")
            out[(b.pair, b.index)] = frame_layout(b, fp8)
    return out


class FP8Encoder(Encoder):
    """A training rank's side: pack the plain copies, quantize the FP8 ones into the payload. :meth:`landing` is the
    same as copies and quantize kernels (a transport whose slots stay put replays a step's as one CUDA graph)."""

    batched = True

    def __init__(self, plans: Mapping[Pair, list[Bucket]], fp8: Mapping[str, tuple[int, ...]]):
        self.layouts = _layouts(plans, fp8, "the plan")
        self.stats = CodecStats()

    def begin(self, step, proofs) -> None:
        self.stats = CodecStats()

    def bound(self, bucket: Bucket) -> int:
        return self.layouts[(bucket.pair, bucket.index)].nbytes

    def encode(self, bucket: Bucket, sources: Mapping[str, torch.Tensor], slot: torch.Tensor, *,
               kept: bool = False) -> Frame:
        lay = self.layouts[(bucket.pair, bucket.index)]
        out = slot if slot.numel() >= lay.nbytes else torch.empty(lay.nbytes, dtype=torch.uint8, device=slot.device)
        if lay.plain is not None:
            pack(lay.plain, sources, out=out[: lay.plain.nbytes])
        for p in lay.parts:
            c = p.copy
            x = sources[c.src_tensor][slices(c.src_box)].reshape(p.rows, p.cols)
            quantize(x, out=_views(out, p), name=c.canonical)
        return Frame(self.header(bucket), out[: lay.nbytes])

    def header(self, bucket: Bucket) -> Header:
        lay = self.layouts[(bucket.pair, bucket.index)]
        self.stats.count("fp8", len(lay.parts))
        if lay.plain is not None:
            self.stats.count("full", len(lay.plain.copies))
        return Header(KIND_FP8, len(lay.parts), lay.nbytes)

    def landing(self, bucket: Bucket, sources: Mapping[str, torch.Tensor], slot: torch.Tensor) -> Landing:
        """:meth:`encode` into ``slot`` (at least :meth:`bound` bytes) as the plain copies' byte copies (the wire
        dtype is the source's) and the FP8 copies' quantization (:func:`weightsync.quant.fp8.prepare`: the Triton
        kernel on a GPU). A source box that is no 2-d view (it cannot be, read in place) is first copied into a
        buffer of its own, allocated here and held by the landing, so the kernel reads this step's bytes."""
        lay = self.layouts[(bucket.pair, bucket.index)]
        if slot.numel() < lay.nbytes:
            raise ValueError(f"fp8: bucket {bucket.index} of {bucket.pair} needs a slot of {lay.nbytes} bytes, got "
                             f"{slot.numel()}")
        pairs = pack_pairs(segments(lay.plain), sources, slot[: lay.plain.nbytes]) if lay.plain is not None else []
        xs, outs, names = [], [], []
        for p in lay.parts:
            c = p.copy
            x = sources[c.src_tensor][slices(c.src_box)]
            xs.append(_matrix(x, p.rows, p.cols, pairs))
            outs.append(_views(slot, p))
            names.append(c.canonical)
        return Landing(pairs, prepare(xs, outs, names) if xs else None)


def _matrix(x: torch.Tensor, rows: int, cols: int, pairs: list) -> torch.Tensor:
    """``x`` (an FP8 copy's source box) as the ``rows x cols`` matrix the quantize kernel reads: a view of it, or,
    where the box is strided across its leading dims (no 2-d view exists), a buffer of its own that a copy appended
    to ``pairs`` (run before the landing's work, every replay) fills. Never ``reshape``: its copy would be made
    once, when the landing is built, and a replayed landing would quantize that step's bytes forever."""
    try:
        return x.view(rows, cols)
    except RuntimeError:
        stage = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
        pairs.append((stage.view(x.shape), x))
        return stage


class FP8Decoder(Decoder):
    """An inference worker's side: unpack the plain copies, write each FP8 copy's bytes and scales in place (as
    copies, :meth:`landing`, which a transport with fixed scratch batches and replays)."""

    batched = True

    def __init__(self, plans: Mapping[Pair, list[Bucket]], fp8: Mapping[str, tuple[int, ...]]):
        self.layouts = _layouts(plans, fp8, "the plan")
        self.stats = CodecStats()
        self.checked = False

    def begin(self) -> int | None:
        self.stats = CodecStats()
        return super().begin()

    def size(self, bucket: Bucket, header: Header) -> int:
        return self.layouts[(bucket.pair, bucket.index)].nbytes

    def bound(self, bucket: Bucket) -> int:
        return self.layouts[(bucket.pair, bucket.index)].nbytes

    def _check_targets(self, targets: Mapping[str, torch.Tensor]) -> None:
        """The engine must hold each FP8 weight in e4m3 beside an fp32 ``_scale_inv`` (else: not served FP8)."""
        for lay in self.layouts.values():
            for p in lay.parts:
                _check_target(targets, p.copy.dst_tensor)
        self.checked = True

    def take(self, bucket: Bucket, header: Header) -> FrameLayout:
        lay = self.layouts[(bucket.pair, bucket.index)]
        if header.kind != KIND_FP8 or header.count != len(lay.parts) or header.nbytes != lay.nbytes:
            raise ConfigError(f"fp8: bucket {bucket.index} of {bucket.pair}: header {header} does not match this "
                              f"receiver's plan ({len(lay.parts)} FP8 copies, {lay.nbytes} bytes): the two ends built "
                              "different plans")
        self.stats.count("fp8", len(lay.parts))
        if lay.plain is not None:
            self.stats.count("full", len(lay.plain.copies))
        return lay

    def landing(self, bucket: Bucket, header: Header, payload: torch.Tensor,
                targets: Mapping[str, torch.Tensor]) -> Landing:
        """:meth:`decode` as a landing (:func:`_decode_pairs`; the casts are its work)."""
        if not self.checked:
            self._check_targets(targets)
        return landing(_decode_pairs(self.layouts[(bucket.pair, bucket.index)], payload, targets))

    def decode(self, bucket: Bucket, header: Header, payload: torch.Tensor | None,
               targets: Mapping[str, torch.Tensor], slot: torch.Tensor) -> None:
        if not self.checked:
            self._check_targets(targets)
        copy_pairs(_decode_pairs(self.take(bucket, header), payload, targets))


def _decode_pairs(lay: FrameLayout, payload: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> Pairs:
    """A frame's decode as copies: the plain copies as :func:`~weightsync.payload.pack.unpack` scatters them (a cast where the engine's dtype
    differs), each FP8 copy's e4m3 bytes and fp32 scales into its boxes of the weight and its ``_scale_inv``."""
    pairs = unpack_pairs(segments(lay.plain), payload[: lay.plain.nbytes], targets) if lay.plain is not None else []
    for p in lay.parts:
        c = p.copy
        q = _views(payload, p)
        region = targets[c.dst_tensor][slices(c.dst_box)]
        sregion = targets[c.dst_tensor + "_scale_inv"][slices(scale_box(c.dst_box))]
        pairs += [(region, q.weight.view(region.shape)), (sregion, q.scale_inv.view(sregion.shape))]
    return pairs


__all__ = ["FP8Codec", "FP8Decoder", "FP8Encoder", "engine_quant", "fp8_options", "frame_layout",
           "scale_box"]
