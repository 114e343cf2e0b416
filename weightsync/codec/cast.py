"""The cast codec: each copy on the wire in the narrower of its two dtypes, cast on the training rank.

The full codec sends each copy in its source dtype and the receiver converts (:mod:`.full`): an fp32 master into a
bf16 engine puts 4 bytes an element on the wire to land 2. This codec casts such a copy on the training rank instead
(``Tensor.copy_``, round to nearest even: the very rounding the receiver's ``copy_`` would do, so the bytes that land
are the same) and moves half the bytes; a copy whose destination is as wide as its source or wider (bf16 into an fp32
engine) goes in its source dtype and is widened by the receiver, exactly. Ask for it with ``codec="cast"`` on every
writer and reader.

A bucket's frame (:data:`KIND_CAST`) is its segments back to back, each in its wire dtype (:func:`wire_dtype`), at
offsets both ends derive from the plan and the engine's tensor dtypes (:func:`cast_layout`): the receiver's decode is
byte copies where the target's dtype is the wire's. It needs a sender step (p2p, file, nixl); co-located workers read
the trainers' memory directly and cross no link, so it gains nothing there and is refused by the registry. An engine
served in FP8 takes the fp8 codec only (:func:`weightsync.codec.registry.check_engine`).

This module, one line in :data:`weightsync.codec.registry.CODECS` and ``tests/test_codec_cast.py`` are all of it
(docs/architecture.md, "A new codec").
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weightsync.dtypes import DTYPE_SIZES, torch_dtype
from weightsync.errors import TransportError
from weightsync.layout.box import slices
from weightsync.payload.codec import (SENDER_STEP, Codec, CodecJob, CodecStats, Decoder, Encoder, Frame, Header,
                                      payload_key)
from weightsync.payload.pack import segments
from weightsync.plan.planner import Bucket, Pair

KIND_CAST = 2  # Header.kind: the bucket's segments, each in its wire dtype
ALIGN = 8  # each segment starts on this many bytes (a view of any dtype up to 8 bytes wide)


def wire_dtype(src: str, dst: str) -> str:
    """What a copy travels in: the destination's dtype where it is narrower than the source's, else the source's."""
    return dst if DTYPE_SIZES[dst] < DTYPE_SIZES[src] else src


@dataclass(frozen=True)
class Placed:
    """One segment of a cast frame: where it lies in the payload and in what dtype."""

    offset: int
    nbytes: int
    dtype: str


def cast_layout(bucket: Bucket, dtypes: Mapping[str, str]) -> tuple[tuple[Placed, ...], int]:
    """Each of ``bucket``'s segments placed in its frame (``dtypes``: each destination tensor's dtype), and the
    frame's bytes. Both ends compute it from their own plan, so a header that disagrees is refused."""
    out, at = [], 0
    for seg in segments(bucket):
        dt = wire_dtype(seg.dtype, dtypes.get(seg.dst_tensor, seg.dtype))
        n = seg.nbytes // DTYPE_SIZES[seg.dtype] * DTYPE_SIZES[dt]
        out.append(Placed(at, n, dt))
        at += -(-n // ALIGN) * ALIGN
    return tuple(out), at


@dataclass(frozen=True, eq=False)  # a record: it travels in a signed call to worker processes
class CastCodec(Codec):
    """``dtypes``: each destination tensor's dtype, from the engine's layout (:meth:`for_job`)."""

    dtypes: tuple[tuple[str, str], ...] = ()

    name = "cast"
    needs = frozenset({SENDER_STEP})
    framed = True
    sized = True  # every frame's size is the plan's (its layout): posted with its header

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CastCodec) and other.dtypes == self.dtypes

    def __hash__(self) -> int:
        return hash((self.name, self.dtypes))

    @classmethod
    def for_job(cls, job: CodecJob) -> CastCodec:
        if job.infer is None or job.spec is None:
            return cls()  # before the job is agreed: the session makes it anew
        from weightsync.engines import make_layout

        engine = make_layout(job.spec, job.infer)
        dtypes = {n: t.dtype for r in range(engine.world_size) for n, t in engine.layout(r).tensors.items()}
        return cls(tuple(sorted(dtypes.items())))

    def encoder(self, plans: Mapping[Pair, list[Bucket]], device: torch.device) -> CastEncoder:
        return CastEncoder(dict(self.dtypes))

    def decoder(self, plans: Mapping[Pair, list[Bucket]]) -> CastDecoder:
        return CastDecoder(dict(self.dtypes))


class _Frames:
    """Both sides' frame layouts, one per bucket (computed once)."""

    def __init__(self, dtypes: Mapping[str, str]):
        self.dtypes = dtypes
        self.stats = CodecStats()
        self._layouts: dict[tuple[Pair, int], tuple[tuple[Placed, ...], int]] = {}

    def _layout(self, bucket: Bucket) -> tuple[tuple[Placed, ...], int]:
        key = (bucket.pair, bucket.index)
        if key not in self._layouts:
            self._layouts[key] = cast_layout(bucket, self.dtypes)
        return self._layouts[key]

    def bound(self, bucket: Bucket) -> int:
        return self._layout(bucket)[1]

    def key(self, bucket: Bucket) -> int:
        """The source bytes' key and the dtypes they travel in (a one-sided transport finds the frame by it)."""
        sig = repr((payload_key(bucket), tuple(p.dtype for p in self._layout(bucket)[0]))).encode()
        return int.from_bytes(hashlib.blake2b(sig, digest_size=8).digest(), "little", signed=True)  # every process alike


class CastEncoder(_Frames, Encoder):
    def encode(self, bucket: Bucket, sources: Mapping[str, torch.Tensor], slot: torch.Tensor, *,
               kept: bool = False) -> Frame:
        placed, n = self._layout(bucket)
        for seg, p in zip(segments(bucket), placed):
            src = sources[seg.src_tensor][slices(seg.src_box)]
            out = slot[p.offset : p.offset + p.nbytes].view(torch_dtype(p.dtype)).view(src.shape)
            out.copy_(src)  # the receiver's own rounding, done here (module docstring)
        self.stats.count("cast")
        return Frame(Header(KIND_CAST, 0, n), slot[:n])


class CastDecoder(_Frames, Decoder):
    def size(self, bucket: Bucket, header: Header) -> int:
        return bucket.nbytes if header.whole else self.bound(bucket)

    def decode(self, bucket: Bucket, header: Header, payload: torch.Tensor | None,
               targets: Mapping[str, torch.Tensor], slot: torch.Tensor) -> None:
        if header.whole:  # landed by the transport already
            self.stats.count("full")
            return
        placed, n = self._layout(bucket)
        if header.kind != KIND_CAST or header.nbytes != n or payload is None or payload.numel() < n:
            raise TransportError(f"cast codec: bucket {bucket.index} of {bucket.pair} came as kind {header.kind}, "
                                 f"{header.nbytes} bytes; this receiver's plan makes it kind {KIND_CAST}, {n} bytes "
                                 "(the two ends planned differently: every writer and reader must pass codec='cast')")
        for seg, p in zip(segments(bucket), placed):
            dst = targets[seg.dst_tensor][slices(seg.dst_box)]
            dst.copy_(payload[p.offset : p.offset + p.nbytes].view(torch_dtype(p.dtype)).view(dst.shape))
        self.stats.count("cast")
