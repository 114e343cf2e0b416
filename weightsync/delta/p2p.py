"""Delta updates over the point-to-point transport (sync mode).

Each step runs in two phases over the job's group (the :class:`~weightsync.transport.p2p.P2PTransport`'s):

1. Proofs. Every receiver sends, per pair, its :class:`~weightsync.delta.state.Proof` (2 int64): the
   step it last received whole and the checksum of its target tensors' bytes now, read in each
   bucket's wire form. The sender sends a pair as deltas only when the proof equals its own previous
   version (step and checksum); otherwise -- a new instance, a failed or skipped update, a staged
   copy rolled back, tensors touched by anything else -- that pair goes whole this step.
2. Buckets, in the transport's one global order (``order_key``): per bucket a header (kind, count,
   bytes: 3 int64) and its payload. The sender packs the bucket, encodes it against the previous
   version (:func:`weightsync.delta.codec.encode`: the smallest of indices, bitmap, blocks, full),
   posts header and payload, and keeps the packed bytes as the next step's base once the last
   instance's bucket of that layout was encoded. A whole bucket goes as the plan's messages, so it
   lands in place where the receiver holds it contiguous. The receiver waits for the header, then
   receives the payload and applies it in place onto its targets (through its buffer where a
   message is not contiguous in the wire dtype: gathered from the targets, patched, scattered back).

Deadlock freedom is the transport's argument unchanged: a header and its payload are one transfer
in the global order; the sender keeps at most ``window`` transfers outstanding, the receiver one,
and a receiver waits only on its earliest incomplete transfer. Proofs all move before any bucket.

Costs: host syncs per bucket on each end (the changed words' sizes size the payload; the receiver
reads the header; the kept base's checksum is read once a step), and the receiver reads its targets
once more per step for the proof.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Mapping

import torch

from weightsync.delta import codec
from weightsync.delta.state import NO_VERSION, PreviousVersion, Proof, combine, gather_pairs, words_of
from weightsync.errors import TransportError
from weightsync.plan.messages import messages
from weightsync.plan.planner import Bucket, Pair
from weightsync.transport.base import StepStats
from weightsync.transport.p2p import P2PTransport, ensure_buffers, on_gpu, order_key, post, retire
from weightsync.transport.pack import copy_pairs, pack_segments, segments, stage, unpack_pairs

log = logging.getLogger("weightsync.delta")

PROOF_TAG = (1 << 24) + 1  # beside the pull header's tag (1 << 24)
HEADER_TAG = 1 << 25  # + bucket index
HEADER_BYTES = 3 * 8
PROOF_BYTES = 2 * 8
DELTA_WINDOW = 2


def _active(plans: Mapping[Pair, list[Bucket]]) -> dict[Pair, list[Bucket]]:
    """The pairs with bytes to move and their non-empty buckets, in the pair's bucket order."""
    out = {}
    for pair in sorted(plans):
        bs = sorted((b for b in plans[pair] if b.nbytes > 0), key=lambda b: b.index)
        if bs:
            out[pair] = bs
    return out


class DeltaSender:
    """A training rank's delta sends over a P2P transport's group (see the module docstring)."""

    def __init__(self, transport: P2PTransport, plans: Mapping[Pair, list[Bucket]],
                 tensors: Mapping[str, torch.Tensor], *, host: bool = False, window: int = DELTA_WINDOW):
        self.t, self.tensors, self.window = transport, tensors, window
        self.pairs = _active(plans)
        self.ops = sorted((b for bs in self.pairs.values() for b in bs), key=order_key)
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        self.device = device
        self.previous = PreviousVersion(self.pairs, device, host=host)
        self.words = {id(b): words_of(b, transport.direct_min) for b in self.ops}
        self.last_use = self.previous.last_uses(self.ops)
        self._slots: list[torch.Tensor] = []
        #: per step, the encodings chosen (kind name -> buckets) and the pairs sent whole
        self.last_kinds: dict[str, int] = {}
        self.last_full_pairs: list[Pair] = []
        #: seconds the last step spent in each phase (proofs, pack, encode, wait, store)
        self.last_phases: dict[str, float] = {}

    def send(self, step: int) -> StepStats:
        try:
            return self._send(step)
        except BaseException:
            self.previous.invalidate()  # the stored copies may mix two steps now
            raise

    def _send(self, step: int) -> StepStats:
        t, group = self.t, self.t.group
        start = time.perf_counter()
        ordered = on_gpu(self.device)
        # 1. proofs
        proofs = {pair: torch.empty(2, dtype=torch.int64, device=self.device) for pair in self.pairs}
        works = [(pair, post(group, [(proofs[pair], t.ranks.receiver(pair), PROOF_TAG, False)], self.device, False))
                 for pair in self.pairs]
        delta_ok: dict[Pair, bool] = {}
        for pair, ws in works:
            b0 = self.pairs[pair][0]
            try:
                for w in ws:
                    retire(w, t.timeout, False)
            except (RuntimeError, TimeoutError) as e:
                raise t._error(b0, t.ranks.receiver(pair), True, e) from e
            version, held = (int(x) for x in proofs[pair].tolist())
            want = self.previous.pair_checksum(self.pairs[pair])
            delta_ok[pair] = (self.previous.version is not None and version == self.previous.version
                              and want is not None and (held & ((1 << 64) - 1)) == want)
        phases = {"proofs": time.perf_counter() - start, "pack": 0.0, "encode": 0.0, "wait": 0.0, "store": 0.0}
        self.last_full_pairs = [p for p, ok in delta_ok.items() if not ok]
        if self.last_full_pairs and self.previous.version is not None:
            log.info("step %d: sending %d pair(s) whole (their receivers do not hold step %s): %s", step,
                     len(self.last_full_pairs), self.previous.version, self.last_full_pairs[:4])
        # 2. buckets
        if self.ops:
            self._slots = ensure_buffers(self._slots, self.window, max(b.nbytes for b in self.ops), None, self.device)
        kinds: dict[str, int] = {}
        moved = PROOF_BYTES * len(self.pairs)
        inflight: deque[tuple[Bucket, list, tuple]] = deque()
        # one encoding per bucket layout and step: instances with equal layouts get the same payload
        cache: dict[tuple, codec.Encoded] = {}
        for k, b in enumerate(self.ops):
            t0 = time.perf_counter()
            if len(inflight) == self.window:
                self._retire(*inflight.popleft())
            t1 = time.perf_counter()
            phases["wait"] += t1 - t0
            slot = self._slots[k % self.window]
            sig = self.previous.signature_of(b)
            last = k in self.last_use  # the old base is replaced after this bucket
            enc = cache.get(sig) if delta_ok[b.pair] else None
            cur = slot[: b.nbytes]
            if enc is None or last:
                pack_segments(segments(b), self.tensors, cur)
            t2 = time.perf_counter()
            phases["pack"] += t2 - t1
            words = self.words[id(b)]
            base = self.previous.base(b) if enc is None and delta_ok[b.pair] else None
            if base is not None:
                if base.device != cur.device:
                    base = base.to(cur.device, non_blocking=True)
                # blocks lose on scattered changes (docs/delta.md) and cost a pass: not tried
                enc = codec.encode(codec.as_words(cur, words.word), codec.as_words(base, words.word), blocks=False)
                if enc.kind != codec.FULL:  # a FULL payload is the slot itself
                    cache[sig] = enc
            elif enc is None:
                enc = codec.Encoded(codec.FULL, 0, b.nbytes // words.word, words.word, cur)
            kinds[codec.KIND_NAMES[enc.kind]] = kinds.get(codec.KIND_NAMES[enc.kind], 0) + 1
            header = torch.tensor([enc.kind, enc.count, b.nbytes], dtype=torch.int64, device=self.device)
            peer = t.ranks.receiver(b.pair)
            ops = [(header, peer, HEADER_TAG + b.index, True)]
            if enc.kind == codec.FULL:  # the plan's messages, so the receiver lands them in place
                ops += [(cur[m.offset : m.offset + m.nbytes], peer, b.index, True) for m in messages(b, t.direct_min)]
            elif enc.nbytes:
                ops.append((enc.payload, peer, b.index, True))
            try:
                ws = post(group, ops, self.device, False)
            except RuntimeError as e:
                raise t._error(b, peer, True, e) from e
            moved += HEADER_BYTES + enc.nbytes
            t3 = time.perf_counter()
            phases["encode"] += t3 - t2
            if last:
                self.previous.store(b, cur)
                cache.pop(sig, None)
            phases["store"] += time.perf_counter() - t3
            inflight.append((b, ws, (header, enc.payload)))  # keep what is posted alive until sent
        t0 = time.perf_counter()
        while inflight:
            self._retire(*inflight.popleft())
        phases["wait"] += time.perf_counter() - t0
        self.previous.version = step
        self.last_kinds, self.last_phases = kinds, phases
        return StepStats(len(self.ops), moved, time.perf_counter() - start, full_bytes=sum(b.nbytes for b in self.ops))

    def _retire(self, b: Bucket, works: list, keep: tuple) -> None:
        try:
            for w in works:
                retire(w, self.t.timeout, False)
        except (RuntimeError, TimeoutError) as e:
            raise self.t._error(b, self.t.ranks.receiver(b.pair), True, e) from e


class DeltaReceiver:
    """An inference worker's delta receives (see the module docstring). Its version is the step it
    last received whole; None from the start of a receive until it completed."""

    def __init__(self, transport: P2PTransport, plans: Mapping[Pair, list[Bucket]]):
        self.t = transport
        self.pairs = _active(plans)
        self.ops = sorted((b for bs in self.pairs.values() for b in bs), key=order_key)
        self.words = {id(b): words_of(b, transport.direct_min) for b in self.ops}
        self.version: int | None = None
        self._slot: list[torch.Tensor] = []
        self.last_kinds: dict[str, int] = {}
        #: seconds the last step spent in each phase (proof, wait, apply)
        self.last_phases: dict[str, float] = {}

    def proof(self, pair: Pair, targets: Mapping[str, torch.Tensor], slot: torch.Tensor) -> Proof:
        """What this worker holds for ``pair`` now: its version and its targets' bytes' checksum."""
        if self.version is None:
            return Proof(NO_VERSION, 0)
        acc = 0
        for b in self.pairs[pair]:
            st, parts = self._base(b, targets, slot)
            acc = combine(acc, codec.checksum(parts))
        return Proof(self.version, acc)

    def _base(self, b: Bucket, targets: Mapping[str, torch.Tensor], slot: torch.Tensor):
        """The bucket's wire bytes as the targets hold them: in place where they lie contiguous in the
        wire dtype, else gathered into ``slot``."""
        st = stage(b, targets, False, self.t.direct_min)
        if st.staged:
            copy_pairs(gather_pairs(st.staged, targets, slot))
        return st, st.tensors(slot)

    def receive(self, step: int, targets: Mapping[str, torch.Tensor]) -> StepStats:
        t, group = self.t, self.t.group
        start = time.perf_counter()
        device = next(iter(targets.values())).device if targets else torch.device("cpu")
        if self.ops:
            self._slot = ensure_buffers(self._slot, 1, max(b.nbytes for b in self.ops), None, device)
        slot = self._slot[0] if self._slot else None
        # 1. proofs
        sends = []
        for pair in self.pairs:
            p = self.proof(pair, targets, slot)
            held = p.checksum - (1 << 64) if p.checksum >= 1 << 63 else p.checksum  # as int64
            msg = torch.tensor([p.version, held], dtype=torch.int64, device=device)
            peer = t.ranks.sender(pair)
            try:
                sends.append((pair, msg, post(group, [(msg, peer, PROOF_TAG, True)], device, False)))
            except RuntimeError as e:
                raise t._error(self.pairs[pair][0], peer, False, e) from e
        self.version = None  # from here the targets may mix two steps
        for pair, _, ws in sends:
            try:
                for w in ws:
                    retire(w, t.timeout, False)
            except (RuntimeError, TimeoutError) as e:
                raise t._error(self.pairs[pair][0], t.ranks.sender(pair), False, e) from e
        # 2. buckets, one at a time
        phases = {"proof": time.perf_counter() - start, "wait": 0.0, "apply": 0.0}
        kinds: dict[str, int] = {}
        moved = PROOF_BYTES * len(self.pairs)
        header = torch.empty(3, dtype=torch.int64, device=device)
        for b in self.ops:
            peer = t.ranks.sender(b.pair)
            try:
                for w in post(group, [(header, peer, HEADER_TAG + b.index, False)], device, False):
                    retire(w, t.timeout, False)
                kind, count, nbytes = header.tolist()
                if nbytes != b.nbytes:
                    raise TransportError(f"bucket {b.index} of training rank {b.pair[0]} -> instance {b.pair[1]} "
                                         f"rank {b.pair[2]}: the sender's header says {nbytes} bytes, planned "
                                         f"{b.nbytes} (the two ends built different plans)",
                                         pair=b.pair, bucket=b.index)
                words = self.words[id(b)]
                n = b.nbytes // words.word
                if kind == codec.FULL:
                    st = stage(b, targets, False, t.direct_min)
                    posts = st.tensors(slot)
                    for w in post(group, [(x, peer, b.index, False) for x in posts], device, False):
                        retire(w, t.timeout, False)
                    moved += HEADER_BYTES + b.nbytes
                else:
                    size = codec.payload_bytes(kind, count, n, words.word)
                    payload = torch.empty(size, dtype=torch.uint8, device=device)
                    t0 = time.perf_counter()
                    if size:
                        for w in post(group, [(payload, peer, b.index, False)], device, False):
                            retire(w, t.timeout, False)
                    t1 = time.perf_counter()
                    phases["wait"] += t1 - t0
                    st, parts = self._base(b, targets, slot)
                    codec.apply([codec.as_words(p, words.word) for p in parts], kind, count, words.word, payload)
                    phases["apply"] += time.perf_counter() - t1
                    moved += HEADER_BYTES + size
            except (RuntimeError, TimeoutError) as e:
                raise t._error(b, peer, False, e) from e
            if st.staged:
                copy_pairs(unpack_pairs(st.staged, slot, targets))
            name = codec.KIND_NAMES[kind]
            kinds[name] = kinds.get(name, 0) + 1
        self.version = step
        self.last_kinds, self.last_phases = kinds, phases
        return StepStats(len(self.ops), moved, time.perf_counter() - start, full_bytes=sum(b.nbytes for b in self.ops))

    def forget(self) -> None:
        """Hold no provable version (the next step arrives whole): after anything touched the targets."""
        self.version = None
