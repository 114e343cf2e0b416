"""Delta updates through the NIXL transport (sync and async): workers READ what changed, when they prove its base.

NIXL is one-sided (workers READ the trainers' registered memory), so -- as with the file transport --
the trainer cannot ask each worker what it holds. Instead, per step, each training rank encodes every
bucket of its send plan against the step it served before (:func:`weightsync.delta.codec.encode`;
buckets to several instances with one source layout share one encoding, one
:class:`~weightsync.delta.state.PreviousVersion` copy) into a registered *delta region* (allocated
once at its worst case, a full bucket per distinct bucket, and counted with the previous version in
the sender's :class:`~weightsync.transport.base.Buffers`), and stamps a registered *index*: ``(seq,
step, base step, slots)`` then per slot ``(signature hash, offset, kind, count, base checksum,
this step's checksum)`` (a kind of -1: no delta this step). Both are published as two extra
entries of the rank's descriptor document (:data:`REGION`, :data:`INDEX`), so a worker needs no new
rendezvous.

A worker READs each peer's index after the step was announced, and takes the delta path only when
it proves it holds the base of every bucket it receives: its version (the step it last received
whole) is every index's base step and each bucket's checksum as its targets hold it now equals the
base checksum. Then it READs only the payloads (batched into one registered scratch buffer of its
largest bucket) and applies them in place; otherwise -- a new instance, a failed or skipped step, a
staged copy, anything that touched the tensors, a bucket the trainer's own plan does not hold (an
elastic trainer plans one instance slot: with DP replicas, an instance served by another replica
than slot 0's finds no slot and always reads in full) -- it reads everything as a full sync (the
fall-back is per worker and per step, and needs no round trip).

Async mode. The trainer stages a snapshot (under the header's sequence lock, ``seq`` odd while
copying) and encodes it, inside the same odd window, against the snapshot it staged before: the
region and the index then always describe the snapshot the header names. A pull takes the step
every peer's stable header names (none: the peers staged different steps, so the pull is a mix
anyway and reads in full) and proves the base exactly as a sync receive does: its version is each
index's base step (the step staged before the snapshot's) and every bucket's checksum is the base
checksum. A pull whose headers changed meanwhile (the trainer staged again: the payloads may have
been overwritten under the read) is reported as a mix, as every torn async pull is, and leaves no
version, so the next pull reads in full; an instance that skipped a snapshot holds an older step
than the base and reads in full too.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weightsync.delta import codec
from weightsync.delta.state import PreviousVersion, gather_pairs, previous_buffers_bytes, signature, words_of
from weightsync.errors import TransportError
from weightsync.plan.planner import Bucket, Pair
from weightsync.transport.pack import copy_pairs, pack, stage, unpack_pairs

log = logging.getLogger("weightsync.delta.nixl")

REGION = "__weightsync.delta.region"  # descriptor-document entries (never a model tensor's name)
INDEX = "__weightsync.delta.index"
HEAD = 4  # index words before the slots: seq, step, base step, slots
SLOT = 6  # words per slot: signature hash, offset, kind (-1: none), count, base checksum, this step's checksum
NONE = -1
_ALIGN = 8


def sig_hash(sig: tuple) -> int:
    """A bucket signature as one signed int64 (both ends hash the same planner records)."""
    return int.from_bytes(hashlib.blake2b(repr(sig).encode(), digest_size=8).digest(), "little", signed=True)


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def _buckets(plans: Mapping[Pair, list[Bucket]]) -> list[Bucket]:
    return [b for p in sorted(plans) for b in sorted(plans[p], key=lambda b: b.index) if b.nbytes > 0]


def region_bytes(plans: Mapping[Pair, list[Bucket]]) -> int:
    """The delta region's worst case: every distinct bucket encoded FULL (no encoding is larger)."""
    sizes = {signature(b): b.nbytes for b in _buckets(plans)}
    return sum(-(-n // _ALIGN) * _ALIGN for n in sizes.values())


def sender_buffers_bytes(plans: Mapping[Pair, list[Bucket]], host: bool) -> int:
    """What delta adds to a NIXL sender's device memory: the previous version (unless in host memory)
    and the delta region (always beside the tensors, where the workers READ it)."""
    return previous_buffers_bytes(plans, host) + region_bytes(plans)


class DeltaNixlSender:
    """A training rank's encoder: fills the registered region and index every step (module docstring)."""

    def __init__(self, plans: Mapping[Pair, list[Bucket]], tensors: Mapping[str, torch.Tensor], device: torch.device,
                 host: bool = False):
        self.tensors, self.device = tensors, device
        self.previous = PreviousVersion(plans, device, host=host)
        self.first: dict[tuple, Bucket] = {}  # signature -> the bucket it is encoded from
        for b in _buckets(plans):
            self.first.setdefault(signature(b), b)
        self.sigs = sorted(self.first, key=sig_hash)
        self.offsets: dict[tuple, int] = {}
        at = 0
        for s in self.sigs:
            self.offsets[s] = at
            at += -(-self.first[s].nbytes // _ALIGN) * _ALIGN
        self.region = torch.empty(max(at, _ALIGN), dtype=torch.uint8, device=device)
        self.index = torch.zeros(HEAD + SLOT * len(self.sigs), dtype=torch.int64)
        self.index[3] = len(self.sigs)
        for k, s in enumerate(self.sigs):
            self.index[HEAD + SLOT * k] = sig_hash(s)
            self.index[HEAD + SLOT * k + 2] = NONE
        self.words = {s: words_of(self.first[s]).word for s in self.sigs}
        largest = max((b.nbytes for b in self.first.values()), default=0)
        # the packing buffer: only the host-memory path packs outside the region (see _encode_in_place)
        self._buf = torch.empty(max(largest, 1), dtype=torch.uint8, device=device) if host else None
        self.last_kinds: dict[str, int] = {}

    def encode(self, step: int) -> None:
        """Encode this step against the previous one into the region and stamp the index (the tensors
        are still: the optimizer is done and the step not yet announced)."""
        try:
            self._encode(step)
        except BaseException:
            self.previous.invalidate()
            self.index[2] = NONE
            raise

    def _encode(self, step: int) -> None:
        if self.previous.host:
            self._encode_serial(step)
        else:
            self._encode_in_place(step)

    def _encode_in_place(self, step: int) -> None:
        """The previous version beside the tensors: per bucket, pack straight into its region slot (the
        region holds a full bucket per slot), queue its checksum, find the changed words against the
        base (:func:`codec.changed_words`), write the payload over the packed bytes
        (:func:`codec.encode_to` reads everything it needs first) and patch the base with the changed
        words (FULL: copy the bucket): the base becomes this step's bytes without a copy of the
        bucket, and all the checksums are read once, at the end.

        (A batched variant -- every bucket's count queued, one sync, then ``nonzero_static`` -- read
        each bucket twice and measured slower at 0.1-1% on an H200: BENCHMARKS.md.)"""
        base_step = self.previous.version
        idx = self.index
        idx[0] += 1  # odd while stamping
        kinds: dict[str, int] = {}
        sums: list[torch.Tensor] = []
        for k, s in enumerate(self.sigs):
            b, word, off = self.first[s], self.words[s], self.offsets[s]
            w = HEAD + SLOT * k
            cur = pack(b, self.tensors, out=self.region[off : off + b.nbytes])
            sums.append(codec.checksum_queued([cur]))  # queued before the payload overwrites the slot
            base = self.previous.base(b) if base_step is not None else None
            base_sum = self.previous.checksum_of(b) if base is not None else None
            if base_sum is None:
                idx[w + 2] = NONE
                self.previous.slot(b).copy_(cur)
                continue
            cw, bw = codec.as_words(cur, word), codec.as_words(base, word)
            changed = codec.changed_words(cw, bw)
            kind, count = codec.choose(changed.numel(), None, b.nbytes // word, word)
            patch = codec.encode_to(kind, count, cw, bw, cur, idx=changed)
            if patch is not None:
                bw.index_copy_(0, *patch)
            elif kind == codec.FULL:
                base.copy_(cur)
            idx[w + 1], idx[w + 2], idx[w + 3], idx[w + 4] = off, kind, count, _signed(base_sum)
            name = codec.KIND_NAMES[kind]
            kinds[name] = kinds.get(name, 0) + 1
        from weightsync.integrity.digest import to_ints

        for k, (s, got) in enumerate(zip(self.sigs, to_ints(sums))):  # one read for all
            self.previous.rebased(self.first[s], got)
            idx[HEAD + SLOT * k + 5] = _signed(got)  # a worker holding this step proves it
        self._stamped(step, base_step, kinds)

    def _encode_serial(self, step: int) -> None:
        """The previous version in host memory: per bucket, pack, bring its base over, encode, keep."""
        base_step = self.previous.version
        idx = self.index
        idx[0] += 1  # odd while stamping
        kinds: dict[str, int] = {}
        base_sums = [self.previous.checksum_of(self.first[s]) for s in self.sigs]  # read before any store
        for k, s in enumerate(self.sigs):
            b = self.first[s]
            w = HEAD + SLOT * k
            buf = pack(b, self.tensors, out=self._buf[: b.nbytes])
            base = self.previous.base(b)
            base_sum = base_sums[k]
            if base_step is None or base is None or base_sum is None:
                idx[w + 2] = NONE
            else:
                word = words_of(b).word
                base = base.to(buf.device) if base.device != buf.device else base
                enc = codec.encode(codec.as_words(buf, word), codec.as_words(base, word), blocks=False)
                off = self.offsets[s]
                self.region[off : off + enc.payload.numel()].copy_(enc.payload)
                idx[w + 1], idx[w + 2], idx[w + 3], idx[w + 4] = off, enc.kind, enc.count, _signed(base_sum)
                name = codec.KIND_NAMES[enc.kind]
                kinds[name] = kinds.get(name, 0) + 1
            self.previous.store(b, buf)  # its checksum queued
        for k, s in enumerate(self.sigs):  # a worker holding this step proves it (one read for all)
            idx[HEAD + SLOT * k + 5] = _signed(self.previous.checksum_of(self.first[s]))
        self._stamped(step, base_step, kinds)

    def _stamped(self, step: int, base_step: int | None, kinds: dict[str, int]) -> None:
        """Close the index's odd window once every slot is written (the region's bytes landed first)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.previous.version = step
        self.index[1], self.index[2] = step, NONE if base_step is None else base_step
        self.index[0] += 1
        self.last_kinds = kinds


class Restaged(TransportError):
    """A peer encoded a new delta (re-staged, or moved on) while this worker read the payloads of the
    one it proved: nothing of that batch was applied, the targets may mix two steps. ``moved``: the
    bytes read before."""

    def __init__(self, message: str, moved: int, peer: int, pair: Pair):
        super().__init__(message, peer=peer, pair=pair)
        self.moved = moved


@dataclass(frozen=True)
class Planned:
    """One bucket a worker applies from a peer's delta: where its payload lies and what it holds."""

    pair: Pair
    bucket: Bucket
    addr: int  # remote address of the payload
    kind: int
    count: int
    nbytes: int


@dataclass(frozen=True)
class Read:
    """One READ from one peer: local and remote ``(addr, nbytes, device)`` descriptors."""

    rank: int
    local: list
    local_mem: str
    remote: list
    remote_mem: str
    what: Planned | None = None  # the first payload it carries (for errors), None for an index


class DeltaNixlReceiver:
    """A worker's side: proves its base from each peer's index, then READs and applies the payloads."""

    def __init__(self, rx, plans: Mapping[Pair, list[Bucket]]):
        self.rx = rx  # the NixlReceiver: its agent, peers and error handling
        self.buckets = _buckets(plans)
        self.words = {(b.pair, b.index): words_of(b).word for b in self.buckets}
        self.hashes = {(b.pair, b.index): sig_hash(signature(b)) for b in self.buckets}
        self.version: int | None = None
        self.largest = max((b.nbytes for b in self.buckets), default=0)
        self._scratch: torch.Tensor | None = None
        self._slot: torch.Tensor | None = None
        self._regs: list = []
        self._index: dict[int, torch.Tensor] = {}
        self._heads: dict[int, tuple[int, int]] = {}  # each peer's index (seq, step) the plan was proven on
        self.last_kinds: dict[str, int] = {}
        self.last_full = False

    def receive(self, step: int | None, targets: Mapping[str, torch.Tensor], full) -> "StepStats":  # noqa: F821
        """Read ``step`` into ``targets``: the payloads when this worker proves their base, else in full
        (``full(targets, t0)``). ``step``: sync, the announced step; async, the step every peer's stable
        header names, or None when they name different ones (a mix: read in full, no version). The
        caller drops :attr:`version` when the transport finds the read torn afterwards."""
        from weightsync.transport.base import StepStats

        t0 = time.perf_counter()
        held, self.version = self.version, None  # from here the targets may mix two steps
        full_bytes = sum(b.nbytes for b in self.buckets)
        plan = self._plan(step, held, targets) if held is not None and step is not None else None
        if plan is None:
            stats = full(targets, t0)
            self.version, self.last_full = step, True
            self.last_kinds = {"full": len(self.buckets)}
            return StepStats(stats.buckets, stats.bytes, stats.seconds, stats.posted, stats.started,
                             full_bytes=full_bytes)
        self.last_full = False
        moved = self._apply(plan, targets)  # Restaged: no version (sync raises it; an async pull is a mix)
        self.version = step
        return StepStats(len(self.buckets), moved, time.perf_counter() - t0, full_bytes=full_bytes)

    # -- the proof ------------------------------------------------------------------------------
    def _buffers(self, device: torch.device) -> None:
        from weightsync.transport.nixl import _mem, _register, _storages

        if self._scratch is not None and self._scratch.device == device:
            return
        n = max(-(-self.largest // _ALIGN) * _ALIGN, _ALIGN)
        self._scratch = torch.empty(n, dtype=torch.uint8, device=device)
        self._slot = torch.empty(n, dtype=torch.uint8, device=device)
        mem, dev = _mem(device)
        self._regs.append(_register(self.rx.agent, _storages([self._scratch]), mem, dev))

    def _read_indexes(self) -> dict[int, torch.Tensor] | None:
        """Every peer's index, read at once (None: a peer runs without delta)."""
        from weightsync.transport.nixl import _register, _storages

        reads = []
        for r in self.rx.peer_ranks:
            rt = self.rx.peers[r].doc.tensors.get(INDEX)
            if rt is None:
                return None  # that trainer runs without delta
            buf = self._index.get(r)
            if buf is None:
                buf = self._index[r] = torch.zeros(rt.shape[0], dtype=torch.int64)
                self._regs.append(_register(self.rx.agent, _storages([buf]), "DRAM", 0))
            buf.fill_(0)
            n = buf.numel() * 8
            reads.append(Read(r, [(buf.data_ptr(), n, 0)], "DRAM", [(rt.addr, n, 0)], "DRAM"))
        self._reads(reads)
        return {r: self._index[r] for r in self.rx.peer_ranks}

    def _plan(self, step: int, held: int, targets: Mapping[str, torch.Tensor]) -> list[Planned] | None:
        """The payloads to READ when this worker proves the base of every bucket, else None (read full).

        A worker that already holds ``step`` (async: it pulls a snapshot it pulled before) proves that
        against each bucket's checksum of the step itself, and reads nothing."""
        self.rx._ensure_peers()
        device = next(iter(targets.values())).device
        self._buffers(device)
        slots: dict[int, dict[int, tuple[int, int, int, int, int, int]]] = {}
        holds: dict[int, bool] = {}
        indexes = self._read_indexes()
        if indexes is None:
            return None
        for r, idx in indexes.items():
            v = idx.tolist()
            self._heads[r] = (v[0], v[1])
            holds[r] = v[1] == held
            if v[0] % 2 or v[1] != step or not (holds[r] or v[2] == held):
                log.info("instance %d rank %d, step %d: training rank %d's delta is against step %d, this worker "
                         "holds %s; reading in full", self.rx.ctx.instance, self.rx.ctx.rank, step, r, v[2], held)
                return None
            slots[r] = {v[HEAD + SLOT * k]: tuple(v[HEAD + SLOT * k + 1: HEAD + SLOT * k + SLOT])
                        for k in range(v[3])}
        checks = []
        for b in self.buckets:
            got = slots[b.pair[0]].get(self.hashes[(b.pair, b.index)])
            holds_step = holds[b.pair[0]]
            if got is None or (got[1] == NONE and not holds_step):
                return None
            # queued, read once for all buckets: a staged bucket's gather into the one slot is
            # stream-ordered after the previous bucket's sum of it
            _, parts = self._base(b, targets)
            checks.append((b, got, holds_step, codec.checksum_queued(parts)))
        from weightsync.integrity.digest import to_ints

        plan = []
        for (b, got, holds_step, _), have in zip(checks, to_ints([c[3] for c in checks])):  # one host sync
            off, kind, count, base_sum, step_sum = got
            if _signed(have) != (step_sum if holds_step else base_sum):
                log.info("instance %d rank %d, step %d: bucket %d does not hold step %d; reading in full",
                         self.rx.ctx.instance, self.rx.ctx.rank, step, b.index, held)
                return None
            if holds_step:
                continue  # nothing to read
            w = self.words[(b.pair, b.index)]
            n = codec.payload_bytes(kind, count, b.nbytes // w, w)
            region = self.rx.peers[b.pair[0]].doc.tensors[REGION]
            plan.append(Planned(b.pair, b, region.addr + off, kind, count, n))
        return plan

    def _base(self, b: Bucket, targets: Mapping[str, torch.Tensor]):
        st = stage(b, targets, False)
        if st.staged:
            copy_pairs(gather_pairs(st.staged, targets, self._slot))
        return st, st.tensors(self._slot)

    # -- the payloads ---------------------------------------------------------------------------
    def _apply(self, plan: list[Planned], targets: Mapping[str, torch.Tensor]) -> int:
        from weightsync.transport.nixl import _mem

        mem, dev = _mem(self._scratch.device)
        kinds: dict[str, int] = {}
        moved = 0
        batch: list[tuple[Planned, int]] = []
        at = 0

        def flush() -> None:
            by_peer: dict[int, list] = {}
            for p, o in batch:
                if p.nbytes:
                    by_peer.setdefault(p.pair[0], []).append((p, o))
            reads = []
            for r, items in by_peer.items():
                doc = self.rx.peers[r].doc
                reads.append(Read(r, [(self._scratch.data_ptr() + o, p.nbytes, dev) for p, o in items], mem,
                                  [(p.addr, p.nbytes, doc.device) for p, _ in items], doc.mem, items[0][0]))
            self._reads(reads)  # every peer's payloads of the batch at once
            self._unchanged(by_peer, done[0])  # before applying: a torn payload could index out of bounds
            for p, o in batch:
                w = self.words[(p.pair, p.bucket.index)]
                st, parts = self._base(p.bucket, targets)
                codec.apply([codec.as_words(x, w) for x in parts], p.kind, p.count, w, self._scratch[o : o + p.nbytes])
                if st.staged:
                    copy_pairs(unpack_pairs(st.staged, self._slot, targets))
                name = codec.KIND_NAMES[p.kind]
                kinds[name] = kinds.get(name, 0) + 1
            if self._scratch.device.type == "cuda":  # applied before NIXL writes the next batch there
                torch.cuda.current_stream().synchronize()
            done[0] += sum(p.nbytes for p, _ in batch)
            batch.clear()

        done = [0]  # the bytes read and applied so far
        for p in plan:
            size = -(-p.nbytes // _ALIGN) * _ALIGN
            if at + size > self._scratch.numel() and batch:
                flush()
                at = 0
            batch.append((p, at))
            at += size
            moved += p.nbytes
        if batch:
            flush()
        self.last_kinds = kinds
        return moved

    def _unchanged(self, peers, moved: int) -> None:
        """Raise :class:`Restaged` unless every peer's index still is the one the plan was proven on.

        A trainer bumps its index's ``seq`` (odd) before it writes a new delta into the region, and
        this re-reads it only after the payload READs completed: unchanged, no payload byte was
        overwritten under them (the seqlock argument of the async header, applied to the region)."""
        self._reads([Read(r, [(self._index[r].data_ptr(), 16, 0)], "DRAM",
                          [(self.rx.peers[r].doc.tensors[INDEX].addr, 16, 0)], "DRAM") for r in peers])
        for r in peers:
            buf = self._index[r]
            got = (int(buf[0]), int(buf[1]))
            if got != self._heads[r]:
                ctx = self.rx.ctx
                raise Restaged(f"training rank {r} -> instance {ctx.instance} rank {ctx.rank}: the trainer encoded a "
                               f"new delta (index seq {got[0]}, step {got[1]}) while the payloads of step "
                               f"{self._heads[r][1]} were read; nothing of them applied, the step is not whole",
                               moved, r, (r, ctx.instance, ctx.rank))

    def _reads(self, reads: list[Read]) -> None:
        """Post every read (one per peer, in flight together: one round trip, not one per peer), wait
        for all, release them."""
        agent = self.rx.agent
        handles = []
        try:
            for rd in reads:
                pair = rd.what.pair if rd.what is not None else (rd.rank, self.rx.ctx.instance, self.rx.ctx.rank)
                bucket = rd.what.bucket.index if rd.what is not None else None
                try:
                    h = agent.initialize_xfer("READ", agent.get_xfer_descs(rd.local, rd.local_mem),
                                              agent.get_xfer_descs(rd.remote, rd.remote_mem), self.rx.remote[rd.rank])
                except Exception as e:  # noqa: BLE001 - NIXL's own error types
                    raise self.rx._error(pair, bucket, e) from e
                handles.append((h, pair, bucket))
                self.rx._post(h, pair, bucket)
            self.rx._wait(handles)
        finally:
            for h, _, _ in handles:
                try:
                    h.release()
                except Exception:  # noqa: BLE001 - tearing down
                    pass

    def close(self) -> None:
        agent = getattr(self.rx, "agent", None)
        for reg in self._regs:
            if reg is not None and agent is not None:
                try:
                    agent.deregister_memory(reg)
                except Exception:  # noqa: BLE001
                    pass
        self._regs = []
