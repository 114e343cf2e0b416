"""The full codec: the plan's bytes themselves, each copy in its wire dtype ``Copy.dtype`` (the source's).

It is not framed (:attr:`~weightsync.codec.base.Codec.framed`): each transport moves the plan's bytes by
its own path, zero-copy where the bytes lie in place (p2p and co-located post or copy the live tensors'
views, nixl reads them, :mod:`weightsync.transport.pack` packs only the rest), and the receiver converts
to its tensors' dtypes as a checkpoint load would. :class:`FullEncoder` and :class:`FullDecoder` are
that contract as one bucket's frame (pack, unpack): what a framed transport path does for a bucket
that travels whole, and the reference a new codec's round trip is checked against.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from weightsync.codec.base import WHOLE, Codec, CodecStats, Decoder, Encoder, Frame, Header
from weightsync.plan.planner import Bucket, Pair
from weightsync.transport.pack import pack, unpack


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
