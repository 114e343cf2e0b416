"""The delta codec: each bucket as what changed since the version its receiver proves it holds.

One implementation for every transport that serves it (p2p, file, nixl: :mod:`weightsync.codec.registry`);
the encodings themselves are :mod:`weightsync.delta.codec`, the sender's previous version
:mod:`weightsync.codec.delta_state`, the why and the numbers docs/delta.md.

Sender (:class:`DeltaEncoder`). It keeps the wire bytes it encoded last step per distinct source
layout (:class:`~weightsync.codec.delta_state.PreviousVersion`, counted against the memory budget unless
``host=True``). Per bucket it packs the bucket into the transport's slot and encodes it against that
base in the smallest kind (indices, bitmap, full, same; :func:`weightsync.delta.codec.encode`). Where the
transport carries the receivers' proofs to it (two-sided, p2p), a pair whose proof is not its previous
version goes :data:`~weightsync.payload.codec.WHOLE`, and so does a FULL encoding (the plan's messages
land in place); buckets with one source layout share one encoding. Where receivers prove themselves
(one-sided: file, nixl), every header carries its base step and the base's checksum, and the end of the
step gives each header this step's checksum. A slot the transport keeps for the bucket (``kept``: nixl's
registered region) takes the payload over the packed bytes, and the base is patched with the changed
words instead of copied (one read of the bucket less).

Receiver (:class:`DeltaDecoder`). Its version is the step it last received whole. It proves a pair
(two-sided) or each header's base (one-sided) by the checksum of what its targets hold now, read back
in wire form -- so a new instance, a failed or skipped update, a staged copy rolled back, anything that
touched the tensors, shows, and that bucket travels whole -- and applies payloads in place (through the
transport's slot where the targets do not hold a message contiguous in the wire dtype).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from weightsync.payload.codec import (
    BASE_PROOF,
    NO_VERSION,
    SENDER_STEP,
    WHOLE,
    Codec,
    CodecJob,
    CodecStats,
    Decoder,
    Encoder,
    Frame,
    Header,
    Proof,
)
from weightsync.delta import codec
from weightsync.codec.delta_state import PreviousVersion, combine, gather_pairs, previous_buffers_bytes, signature, words_of
from weightsync.plan.planner import Bucket, Pair
from weightsync.payload.pack import active, copy_pairs, pack, stage, unpack_pairs

log = logging.getLogger("weightsync.delta")

_MASK = (1 << 64) - 1
KIND_NAMES = {**codec.KIND_NAMES, WHOLE: "full"}


@dataclass(frozen=True)
class DeltaCodec(Codec):
    """``host``: the sender keeps its previous version in (pinned) host memory, not on the device."""

    host: bool = False

    name = "delta"
    needs = frozenset({SENDER_STEP, BASE_PROOF})
    framed = True

    @classmethod
    def for_job(cls, job: CodecJob) -> DeltaCodec:
        return cls(host=job.host)

    def encoder(self, plans: Mapping[Pair, list[Bucket]], device: torch.device) -> DeltaEncoder:
        return DeltaEncoder(plans, device, host=self.host)

    def decoder(self, plans: Mapping[Pair, list[Bucket]]) -> DeltaDecoder:
        return DeltaDecoder(plans)


def sig_hash(sig: tuple) -> int:
    """A bucket signature as one signed int64 (both ends hash the same planner records)."""
    return int.from_bytes(hashlib.blake2b(repr(sig).encode(), digest_size=8).digest(), "little", signed=True)


class DeltaEncoder(Encoder):
    """A training rank's delta encoder (module docstring)."""

    def __init__(self, plans: Mapping[Pair, list[Bucket]], device: torch.device, host: bool = False):
        self.pairs = active(plans)
        self.device = device
        self.previous = PreviousVersion(self.pairs, device, host=host)
        buckets = [b for bs in self.pairs.values() for b in bs]
        self._key = {(b.pair, b.index): sig_hash(self.previous.signature_of(b)) for b in buckets}
        self._word = {(b.pair, b.index): words_of(b).word for b in buckets}
        self._uses: dict[int, int] = {}
        self._by_key: dict[int, Bucket] = {}
        for b in buckets:
            k = self.key(b)
            self._uses[k] = self._uses.get(k, 0) + 1
            self._by_key.setdefault(k, b)
        self.stats = CodecStats()
        self._left: dict[int, int] = {}
        self._ok: dict[Pair, bool] | None = None
        self._cache: dict[int, codec.Encoded] = {}
        self._base_sums: dict[tuple, int] = {}
        self._queued: dict[int, tuple[Bucket, torch.Tensor]] = {}
        self._headers: dict[int, Header] = {}

    def memory(self) -> int:
        return previous_buffers_bytes(self.pairs, self.previous.host)

    def key(self, bucket: Bucket) -> int:
        return self._key[(bucket.pair, bucket.index)]

    def begin(self, step: int, proofs: Mapping[Pair, Proof] | None) -> None:
        self.step, self.base = step, self.previous.version
        self.stats = CodecStats()
        self._left, self._cache, self._queued, self._headers = dict(self._uses), {}, {}, {}
        self._base_sums = self.previous.checksums()  # one read for every bucket stored last step
        self._ok = None
        if proofs is not None:  # two-sided: a pair goes as deltas only when its receiver holds the base
            self._ok = {}
            for pair, bs in self.pairs.items():
                p = proofs.get(pair)
                want = self.previous.pair_checksum(bs)
                self._ok[pair] = (p is not None and self.base is not None and p.version == self.base
                                  and want is not None and p.checksum == want)
            self.stats.whole_pairs = [p for p, ok in self._ok.items() if not ok]
            if self.stats.whole_pairs and self.base is not None:
                log.info("step %d: sending %d pair(s) whole (their receivers do not hold step %s): %s", step,
                         len(self.stats.whole_pairs), self.base, self.stats.whole_pairs[:4])

    def encode(self, bucket: Bucket, sources: Mapping[str, torch.Tensor], slot: torch.Tensor, *,
               kept: bool = False) -> Frame:
        if kept:
            return self._encode_kept(bucket, sources, slot)
        b, k = bucket, self.key(bucket)
        self._left[k] -= 1
        last = self._left[k] == 0  # the base is replaced after this bucket
        ok = self.base is not None and (self._ok is None or self._ok[b.pair])
        word = self._word[(b.pair, b.index)]
        enc = self._cache.get(k) if ok else None
        cur = slot[: b.nbytes]
        packed = enc is None or last or self._ok is None  # one-sided transports publish the whole bytes too
        if packed:
            pack(b, sources, out=cur)
        base = self.previous.base(b) if enc is None and ok else None
        base_sum = self._base_sums.get(self.previous.signature_of(b))
        if base is not None and (self._ok is not None or base_sum is not None):
            if base.device != cur.device:
                base = base.to(cur.device, non_blocking=True)
            # blocks lose on scattered changes (docs/delta.md) and cost a pass: not tried
            enc = codec.encode(codec.as_words(cur, word), codec.as_words(base, word), blocks=False)
            if enc.kind != codec.FULL:  # a FULL payload is the slot itself
                self._cache[k] = enc
        two_sided = self._ok is not None
        if enc is None or (two_sided and enc.kind == codec.FULL):
            header, payload = Header(WHOLE, 0, b.nbytes, NO_VERSION), cur
        else:
            header = Header(enc.kind, enc.count, enc.nbytes, self.base, 0 if two_sided else base_sum)
            payload = enc.payload
        self.stats.count(KIND_NAMES[header.kind])
        if last:
            self.previous.store(b, cur)
            self._cache.pop(k, None)
        if not two_sided:
            self._headers[k] = header
        return Frame(header, payload, cur if packed else None)

    def _encode_kept(self, b: Bucket, sources: Mapping[str, torch.Tensor], slot: torch.Tensor) -> Frame:
        """The payload over the packed bytes in ``slot``, the base patched in place (device base), or
        encoded beside them (host base): the staged region's path."""
        k, word = self.key(b), self._word[(b.pair, b.index)]
        cur = pack(b, sources, out=slot[: b.nbytes])
        base = self.previous.base(b) if self.base is not None else None
        base_sum = self._base_sums.get(self.previous.signature_of(b)) if base is not None else None
        if self.previous.host:
            enc = None
            if base_sum is None:
                header = Header(WHOLE, 0, 0, NO_VERSION)
            else:
                base = base.to(cur.device) if base.device != cur.device else base
                enc = codec.encode(codec.as_words(cur, word), codec.as_words(base, word), blocks=False)
                header = Header(enc.kind, enc.count, enc.nbytes, self.base, base_sum)
            self.previous.store(b, cur)  # stream-ordered before the payload overwrites the packed bytes
            if enc is not None and enc.payload.data_ptr() != slot.data_ptr():
                slot[: enc.nbytes].copy_(enc.payload)
        else:
            self._queued[k] = (b, codec.checksum_queued([cur]))  # queued before the payload overwrites the slot
            if base_sum is None:
                header = Header(WHOLE, 0, 0, NO_VERSION)
                self.previous.slot(b).copy_(cur)
            else:
                cw, bw = codec.as_words(cur, word), codec.as_words(base, word)
                changed = codec.changed_words(cw, bw)
                kind, count = codec.choose(changed.numel(), None, b.nbytes // word, word)
                patch = codec.encode_to(kind, count, cw, bw, cur, idx=changed)
                if patch is not None:
                    bw.index_copy_(0, *patch)
                elif kind == codec.FULL:
                    base.copy_(cur)
                header = Header(kind, count, codec.payload_bytes(kind, count, b.nbytes // word, word), self.base,
                                base_sum)
        self.stats.count(KIND_NAMES[header.kind])
        self._headers[k] = header
        return Frame(header, slot[: header.nbytes])

    def end(self, step: int) -> dict[int, Header]:
        from weightsync.integrity.digest import to_ints

        if self._queued:  # the kept path's sums: one read for all
            keys = list(self._queued)
            for k, got in zip(keys, to_ints([self._queued[k][1] for k in keys])):
                self.previous.rebased(self._queued[k][0], got)
        self.previous.version = step
        out = {}
        if self._headers:  # one-sided: each header with this step's checksum (a receiver holding it proves it)
            sums = self.previous.checksums()
            for k, h in self._headers.items():
                sig = self.previous.signature_of(self._by_key[k])
                out[k] = Header(h.kind, h.count, h.nbytes, h.base, h.base_sum, sums[sig])
        return out

    def fail(self) -> None:
        self.previous.invalidate()  # the stored copies may mix two steps


class DeltaDecoder(Decoder):
    """An inference worker's delta decoder (module docstring)."""

    def __init__(self, plans: Mapping[Pair, list[Bucket]]):
        self.pairs = active(plans)
        self._word = {(b.pair, b.index): words_of(b).word for bs in self.pairs.values() for b in bs}
        self._key = {(b.pair, b.index): sig_hash(signature(b)) for bs in self.pairs.values() for b in bs}
        self.version: int | None = None
        self.stats = CodecStats()

    def begin(self) -> int | None:
        self.stats = CodecStats()
        return super().begin()

    def _base(self, b: Bucket, targets: Mapping[str, torch.Tensor], slot: torch.Tensor):
        """The bucket's wire bytes as the targets hold them: in place where they lie contiguous in the
        wire dtype, else gathered into ``slot``."""
        st = stage(b, targets, False)
        if st.staged:
            copy_pairs(gather_pairs(st.staged, targets, slot))
        return st, st.tensors(slot)

    def proof(self, buckets: Sequence[Bucket], targets: Mapping[str, torch.Tensor], slot: torch.Tensor) -> Proof:
        if self.version is None:
            return Proof(NO_VERSION, 0)
        acc = 0
        for b in buckets:
            _, parts = self._base(b, targets, slot)
            acc = combine(acc, codec.checksum(parts))
        return Proof(self.version, acc)

    def accepts(self, step: int | None, held: int | None, items: Sequence[tuple[Bucket, Header]],
                targets: Mapping[str, torch.Tensor], slot: torch.Tensor) -> list[int] | None:
        if held is None or step is None:
            return None
        holds = held == step  # async: pulling a snapshot it pulled before proves this step and reads nothing
        for _, h in items:
            if not holds and (h.whole or h.base != held):
                return None
        # queued, read once for all buckets: a staged bucket's gather into the one slot is
        # stream-ordered after the previous bucket's sum of it
        sums = [codec.checksum_queued(self._base(b, targets, slot)[1]) for b, _ in items]
        from weightsync.integrity.digest import to_ints

        for (b, h), have in zip(items, to_ints(sums)):
            if have & _MASK != (h.sum if holds else h.base_sum):
                log.info("step %s: bucket %d of %s does not hold step %s; reading it whole", step, b.index, b.pair, held)
                return None
        return [] if holds else list(range(len(items)))

    def key(self, bucket: Bucket) -> int:
        return self._key[(bucket.pair, bucket.index)]

    def size(self, bucket: Bucket, header: Header) -> int:
        """The payload bytes ``header`` implies for ``bucket`` (what a transport allocates and checks)."""
        if header.whole:
            return bucket.nbytes
        w = self._word[(bucket.pair, bucket.index)]
        return codec.payload_bytes(header.kind, header.count, bucket.nbytes // w, w)

    def decode(self, bucket: Bucket, header: Header, payload: torch.Tensor | None,
               targets: Mapping[str, torch.Tensor], slot: torch.Tensor) -> None:
        self.stats.count(KIND_NAMES[header.kind])
        if header.whole:
            return
        w = self._word[(bucket.pair, bucket.index)]
        st, parts = self._base(bucket, targets, slot)
        if parts and payload.device != parts[0].device:
            payload = payload.to(parts[0].device)
        codec.apply([codec.as_words(p, w) for p in parts], header.kind, header.count, w, payload)
        if st.staged:
            copy_pairs(unpack_pairs(st.staged, slot, targets))
