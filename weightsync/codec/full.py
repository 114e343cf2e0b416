"""The full codec: the plan's bytes themselves, each copy in its wire dtype ``Copy.dtype`` (the source's).

It is not framed (:attr:`~weightsync.payload.codec.Codec.framed`): each transport moves the plan's bytes by
its own path, zero-copy where the bytes lie in place (p2p and co-located post or copy the live tensors'
views, nixl reads them, :mod:`weightsync.payload.pack` packs only the rest), and the receiver converts
to its tensors' dtypes as a checkpoint load would. :class:`FullEncoder` and :class:`FullDecoder` are
that contract as one bucket's frame (pack, unpack): what a framed transport path does for a bucket
that travels whole, and the reference a new codec's round trip is checked against.

Co-located (the transport serves :data:`~weightsync.transport.base.SOURCES`: each worker reads the trainers'
tensors in place), :meth:`FullCodec.land` says how the bytes land: the copies between views of one dtype are
bytes the transport's copy kernel moves (:mod:`weightsync.transport.batch_copy`, the hot path: a bf16 trainer into
a bf16 engine is nothing else), and the rest is this codec's cast -- each element converted once to the receiver's
dtype, as loading a checkpoint converts it (an fp32 master into a bf16 engine) -- done by ``copy_`` after them.
Every other transport lands the plan's bytes it unpacked the same way (:meth:`Codec.unpacked`, whose default is
:func:`landing`): the cast is this codec's on every transport, never the transport's copy kernel's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from weightsync.payload.codec import WHOLE, Codec, CodecStats, Decoder, Encoder, Frame, Header
from weightsync.payload.codec import landing as landing  # the full codec's landing: re-exported where it was defined
from weightsync.plan.planner import Bucket, Pair
from weightsync.payload.pack import Landing, direct_pairs, pack, segments, unpack

#: one co-located item: a bucket, the opened sources of its training rank, the receiver's targets
Direct = tuple[Bucket, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]


@dataclass(frozen=True, eq=False)  # a record: it travels in a signed call (runtime/wire admits weightsync's records)
class FullCodec(Codec):
    name = "full"
    needs = frozenset()
    framed = False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FullCodec)

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return "FullCodec()"

    def encoder(self, plans: Mapping[Pair, list[Bucket]], device: torch.device) -> FullEncoder:
        return FullEncoder()

    def decoder(self, plans: Mapping[Pair, list[Bucket]]) -> FullDecoder:
        return FullDecoder()

    #: it lands from sources read in place (co-located): :meth:`land`
    lands = True

    def land(self, items: Sequence[Direct]) -> Landing:
        """The buckets' copies from their sources straight into the targets: byte copies for the transport, the
        casts (views whose dtypes differ) as this codec's work."""
        return landing([p for b, src, dst in items for p in direct_pairs(segments(b), src, dst)])

    def landed_bytes(self, bucket: Bucket) -> int:
        """What landing ``bucket`` writes (the plan's bytes, in the wire dtype)."""
        return bucket.nbytes


class FullEncoder(Encoder):
    def __init__(self) -> None:
        self.stats = CodecStats()

    def encode(self, bucket: Bucket, sources: Mapping[str, torch.Tensor], slot: torch.Tensor, *,
               kept: bool = False) -> Frame:
        cur = pack(bucket, sources, out=slot[: bucket.nbytes])
        self.stats.count("full")
        return Frame(Header(WHOLE, 0, bucket.nbytes), cur, cur)


class FullDecoder(Decoder):
    def __init__(self) -> None:
        self.stats = CodecStats()

    def decode(self, bucket: Bucket, header: Header, payload: torch.Tensor | None,
               targets: Mapping[str, torch.Tensor], slot: torch.Tensor) -> None:
        self.stats.count("full")
        if payload is not None:
            unpack(bucket, payload, targets)
