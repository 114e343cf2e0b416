"""What a delta needs on each end: the sender's previous version, the receiver's proof of its base.

A delta applies only on top of exactly the version it was encoded against. The sender keeps that
version (:class:`PreviousVersion`): per bucket, the wire bytes it sent last step, their checksum,
and the step. A receiver proves what it holds (:class:`weightsync.payload.codec.Proof`): the step it last received whole
and the checksum of what its target tensors hold *now*, read back in the bucket's wire form
(:func:`base_parts`) -- so a failed or skipped update, a new instance, a staged copy left half
written or rolled back, or anything else that touched the tensors, shows as a different version or
checksum, and the sender sends that pair whole (a full sync for that instance).

Memory. The previous version is one copy of the wire bytes a rank sends, stored once per distinct
source layout of a bucket (instances with equal layouts share it): :attr:`PreviousVersion.nbytes`,
reported through :class:`~weightsync.transport.base.Buffers` ``codec`` and counted against the
memory budget. It lives on the tensors' device, or (``host=True``) in host memory, pinned where
CUDA is present, which costs a copy to the device per changed bucket instead of GPU memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from weightsync.delta.codec import checksum_queued, word_bytes
from weightsync.layout.box import slices
from weightsync.layout.materialize import TORCH_DTYPES
from weightsync.plan.messages import DIRECT_MIN_BYTES, Segment, segments, signature
from weightsync.plan.planner import Bucket, Pair

log = logging.getLogger("weightsync.delta")

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Words:
    """How a bucket is compared: ``word`` bytes per compared element (the gcd of its dtypes' sizes)."""

    word: int


def words_of(bucket: Bucket, direct_min: int = DIRECT_MIN_BYTES) -> Words:
    segs = segments(bucket)
    return Words(word_bytes([TORCH_DTYPES[s.dtype].itemsize for s in segs], bucket.nbytes))


def combine(acc: int, part: int) -> int:
    """Fold one bucket's checksum into a pair's (in the pair's bucket order, the same on both ends)."""
    return (acc * 0x100000001B3 + part) & _MASK


class PreviousVersion:
    """The sender's copy of the version it sent last (see the module docstring)."""

    def __init__(self, plans: Mapping[Pair, list[Bucket]], device: torch.device, host: bool = False):
        self.version: int | None = None
        self._device = torch.device("cpu") if host else device
        self._host = host
        self._pin = host and torch.cuda.is_available()
        self._sig: dict[tuple[Pair, int], tuple] = {}
        self._size: dict[tuple, int] = {}
        for pair, bs in plans.items():
            for b in bs:
                if b.nbytes:
                    sig = signature(b)
                    self._sig[(pair, b.index)] = sig
                    self._size[sig] = b.nbytes
        self._store: dict[tuple, torch.Tensor] = {}
        self._sums: dict[tuple, int] = {}
        self._pending: dict[tuple, torch.Tensor] = {}  # checksums queued by store, not yet read

    @property
    def nbytes(self) -> int:
        """Bytes the previous version takes once stored (one copy per distinct bucket signature)."""
        return sum(self._size.values())

    @property
    def where(self) -> str:
        return "pinned host" if self._pin else ("host" if self._host else f"the tensors' device ({self._device})")

    def invalidate(self) -> None:
        """Forget the version (a step failed mid-way: the stored copies mix two steps)."""
        self.version = None

    def signature_of(self, bucket: Bucket) -> tuple:
        return self._sig[(bucket.pair, bucket.index)]

    def base(self, bucket: Bucket) -> torch.Tensor | None:
        return self._store.get(self._sig[(bucket.pair, bucket.index)]) if self.version is not None else None

    def checksums(self) -> dict[tuple, int]:
        """Every stored bucket's checksum by signature (the queued ones read at once)."""
        if self._pending:
            self._resolve()
        return dict(self._sums)

    def checksum_of(self, bucket: Bucket) -> int | None:
        if self._pending:
            self._resolve()
        return self._sums.get(self._sig[(bucket.pair, bucket.index)])

    def _resolve(self) -> None:
        """Read every queued checksum at once (one host sync for all the buckets stored since)."""
        from weightsync.integrity.digest import to_ints

        sigs = list(self._pending)
        for sig, v in zip(sigs, to_ints([self._pending[s] for s in sigs])):
            self._sums[sig] = v
        self._pending.clear()

    def pair_checksum(self, buckets: Sequence[Bucket]) -> int | None:
        """The pair's checksum as a receiver holding the previous version computes it, or None."""
        if self.version is None:
            return None
        acc = 0
        for b in buckets:
            c = self.checksum_of(b)
            if c is None:
                return None
            acc = combine(acc, c)
        return acc

    def store(self, bucket: Bucket, cur: torch.Tensor) -> None:
        """Keep ``cur`` (the bucket's wire bytes this step) as its base for the next step."""
        sig = self._sig[(bucket.pair, bucket.index)]
        have = self._store.get(sig)
        if have is None:
            have = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self._device, pin_memory=self._pin)
            self._store[sig] = have
        have.copy_(cur, non_blocking=self._pin)
        self._sums.pop(sig, None)
        self._pending[sig] = checksum_queued([cur])  # read at the next checksum_of: no sync per bucket

    @property
    def host(self) -> bool:
        return self._host

    def slot(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's stored copy, allocated on first use (its bytes are the base only while
        :attr:`version` is set): a sender that patches it in place (:meth:`rebased`) writes here."""
        sig = self._sig[(bucket.pair, bucket.index)]
        have = self._store.get(sig)
        if have is None:
            have = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self._device, pin_memory=self._pin)
            self._store[sig] = have
        return have

    def rebased(self, bucket: Bucket, checksum: int) -> None:
        """The bucket's stored copy now holds this step's bytes (patched in place by the caller), whose
        checksum is ``checksum``: :meth:`store` without the copy and the re-read."""
        sig = self._sig[(bucket.pair, bucket.index)]
        self._pending.pop(sig, None)
        self._sums[sig] = checksum & _MASK

    def last_uses(self, ops: Sequence[Bucket]) -> set[int]:
        """The positions in ``ops`` after which each signature's copy may be replaced (its last use)."""
        last: dict[tuple, int] = {}
        for i, b in enumerate(ops):
            last[self._sig[(b.pair, b.index)]] = i
        return set(last.values())


def gather_pairs(segs: Sequence[Segment], targets: Mapping[str, torch.Tensor], buffer: torch.Tensor):
    """The copies reading the targets' regions of ``segs`` back into their wire places in ``buffer``
    (converting to the wire dtype): the reverse of :func:`weightsync.payload.pack.unpack_pairs`."""
    pairs = []
    for seg in segs:
        region = targets[seg.dst_tensor][slices(seg.dst_box)]
        wire = buffer[seg.offset : seg.offset + seg.nbytes].view(TORCH_DTYPES[seg.dtype])
        pairs.append((wire.view(region.shape), region))
    return pairs


def previous_bytes(plans: Mapping[Pair, list[Bucket]]) -> int:
    """The memory a sender's :class:`PreviousVersion` of ``plans`` takes (one copy per signature)."""
    return sum({signature(b): b.nbytes for bs in plans.values() for b in bs if b.nbytes}.values())


def previous_buffers_bytes(plans: Mapping[Pair, list[Bucket]], host: bool) -> int:
    """What the previous version adds to a sender's :class:`~weightsync.transport.base.Buffers` (the
    device memory the budget counts): all of it on the device, none when kept in host memory (logged)."""
    n = previous_bytes(plans)
    if host:
        log.info("delta: the previous version takes %d bytes of host memory (not counted in the device budget)", n)
        return 0
    return n
