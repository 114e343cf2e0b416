"""NIXL transport: inference workers READ their planned pieces straight out of the trainers' registered
memory, one-sided (RDMA across hosts; UCX's shared-memory/CMA, TCP or CUDA transports on one host).

Why READ (docs/nixl.md has the measurements): the worker is the initiator, so a training rank does
the same work every step whatever instances exist -- it registers its tensors once, publishes one
descriptor document (:mod:`weightsync.transport.nixl_wire`) and, per step, only stamps a small
header. An instance that joins needs nobody's help: it looks the documents up, plans its own reads,
and starts at the next step; one that leaves or dies costs the trainers nothing.

Trainer (:class:`NixlSender`), per connect: a NIXL agent; the memory under its tensors (sync: the
live weights; async: a snapshot of them, allocated once) registered -- on a GPU whole allocator segments
(:func:`_regions`), so tensors that share one are read as one descriptor -- and a DRAM header; every
strided box of its plan (a column half of a row-parallel weight: one byte run a row) gets a place in a
registered *pack region* (:func:`pack_layout`); the document published. Per step: sync, wait for the
device, copy the strided boxes into the pack region, stamp ``header = (seq + 2, step)``; the writer then
announces the step and (sync) keeps the weights still until every instance holds it. Async, stage the
snapshot (and pack from it) under a sequence lock (``seq`` odd while copying). ``check`` refuses to
record a step whose tensors were reallocated since they were registered.

Worker (:class:`NixlReceiver`), per connect: load each peer trainer's document, check every planned
piece against it (tensor, dtype, shape as the planner expects, bounds inside a registered region)
before any byte moves, and compute each piece's remote byte runs. Per target set (live tensors, or a
staged reader's copy; prepared on first use): register the local memory (GPU: allocator segments);
every segment whose destination is contiguous and in the wire dtype is read in place, the others
through two registered staging slots (each as large as the most one bucket stages) and unpacked as the
codec lands them (:func:`~weightsync.payload.pack.unpacked`: the full codec's casts into another dtype than
the wire's). A packed box is one run; the in-place reads are ordered by remote address and runs
that continue each other on both sides (inside one registration) merged into one descriptor, the lists
prepared once (``prep_xfer_dlist``) and every step replayed (``make_prepped_xfer`` handles, re-posted;
a peer's in-place reads as transfers of at most ``POST_CHUNK`` descriptors, so the first copies run
while the CPU posts the rest). A step's
reads wait, per peer, for the header afterwards: sync, it must name the step; async, a header that
changed during the read means the snapshot was re-staged: the pull reports a mix (step -1) and the
reader pulls again, so only a whole step is ever reported.

Frames (a framed codec, :mod:`weightsync.codec`: delta, fp8). A trainer also registers a *region*, one
slot per distinct bucket at its worst case, and an *index* (``seq`` odd while stamped, step, slots; per
slot its key, offset and header), published as two more entries of its document; per step the encoder
writes each frame into its slot and the index is stamped, inside the async snapshot's odd window. A
worker reads the indexes after the step and, when its decoder proves every header's base (a codec
needing no base: always), READs only the payloads (:class:`FrameReads`), through the read loop a full read's
staged buckets take (:meth:`NixlReceiver._stream`: the same slots' window, prepped READs, landing after each
chunk's READ); otherwise it reads the step in
full -- except for a codec whose frames are the only form its receiver lands (``needs_frames``: fp8,
whose payload is e4m3 bytes and scales, not the plan's bf16 bytes), where that is an error naming the
trainer and nothing is read.

Errors: a NIXL error, a peer whose transfers make no progress for ``timeout_s``, or -- asked once a wait made
no progress for ``LOOK_S`` -- a training rank gone or stopped (:mod:`weightsync.transport.liveness`: a READ of a
stopped trainer's memory stays posted) raise :class:`TransportError` naming the pair and bucket. A wait that
gives up with reads still posted abandons the receiver: they may land later, so it reads no later step.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from weightsync.dtypes import dtype_name
from weightsync.errors import TransportError, WeightsMoved
from weightsync.layout.box import fmt_box, slices
from weightsync.layout.layout import layout_digest
from weightsync.layout.materialize import TORCH_DTYPES
from weightsync.plan.descriptors import POST_CHUNK  # in-place reads posted as transfers of at most this many
from weightsync.plan.messages import Segment, segments
from weightsync.plan.planner import Bucket, Pair
from weightsync.transport.base import (BASE_PROOF, Buffers, Pulled, Receiver, ReceiverContext, Sender, SenderContext,
                                       StepStats)
from weightsync.transport.graphs import CopyGraphs
from weightsync.transport.posted import posted as all_posted
from weightsync.payload.pack import Landing, join
from weightsync.transport.nixl_wire import (
    HEADER_WORDS,
    PackedBox,
    RemoteTensor,
    TrainerDoc,
    box_runs,
    load_nixl,
    lookup_doc,
    merge_pairs,
    publish_doc,
)

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("weightsync.transport.nixl")

SLOTS = 2  # staging slots: unpacking bucket k overlaps reading bucket k+1
POLL_S = 20e-6

# a framed codec's region and index: two more entries of the descriptor document (never a model tensor's name)
REGION = "__weightsync.frames.region"
INDEX = "__weightsync.frames.index"
HEAD = 3  # index words before the slots: seq (odd while stamped), step, slots
SLOT = 8  # words per slot: key, offset, then the header's 6 words (kind WHOLE: no payload this step)
WHOLE = -1  # weightsync.payload.codec.WHOLE
_ALIGN = 8


def _describe(pair: Pair) -> str:
    return f"training rank {pair[0]} -> instance {pair[1]} rank {pair[2]}"


def _mem(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda":
        return "VRAM", device.index if device.index is not None else torch.cuda.current_device()
    return "DRAM", 0


def _storages(tensors) -> list[tuple[int, int]]:
    """The distinct storages (addr, nbytes) under ``tensors``: registered once each (views share one)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sorted(seen.items())


def _allocator_segments(device: torch.device) -> list[tuple[int, int]]:
    """The CUDA caching allocator's segments on ``device`` (each one ``cudaMalloc`` allocation), sorted:
    what one registration may cover. Expandable segments are left out (their pages are separate driver
    allocations, which CUDA IPC maps one at a time), and so is everything when the snapshot is unavailable
    (another allocator backend)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        snap = torch.cuda.memory_snapshot()
    except Exception:  # noqa: BLE001 - cudaMallocAsync backend, or no allocator: per-storage registrations
        return []
    return sorted((int(s["address"]), int(s["total_size"])) for s in snap
                  if s.get("device") == index and not s.get("is_expandable", False))


def _cover(storages: list[tuple[int, int]], segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each storage replaced by the allocator segment that holds it (a storage in none stays itself),
    distinct and sorted: tensors of one segment then lie in one registration, so reads of adjacent
    tensors merge into one descriptor."""
    import bisect

    starts = [a for a, _ in segments]
    out = set()
    for a, n in storages:
        k = bisect.bisect_right(starts, a) - 1
        if k >= 0 and a + n <= segments[k][0] + segments[k][1]:
            out.add(segments[k])
        else:
            out.add((a, n))
    return sorted(out)


def _regions(tensors) -> list[tuple[int, int]]:
    """What to register for ``tensors``: on a GPU the allocator segments that hold their storages (set
    ``WEIGHTSYNC_NIXL_SEGMENTS=0`` for one registration per storage), elsewhere their storages. A segment
    may also hold other tensors of the process: registering exposes them to one-sided reads by the job's
    peers, which read only the boxes their plan names (each checked against the document first)."""
    tensors = list(tensors)
    storages = _storages(tensors)
    if not storages or tensors[0].device.type != "cuda" or os.environ.get("WEIGHTSYNC_NIXL_SEGMENTS", "1") == "0":
        return storages
    return _cover(storages, _allocator_segments(tensors[0].device))


class _Registry:
    """An agent's registered regions: each registered once (a segment can hold tensors of several uses:
    targets, slots, scratch), deregistered together at close."""

    def __init__(self, agent):
        self.agent, self.done, self.regs = agent, set(), []

    def add(self, regions: list[tuple[int, int]], mem: str, dev: int) -> None:
        new = [r for r in regions if (mem, r) not in self.done]
        if new:
            self.regs.append(_register(self.agent, new, mem, dev))
            self.done.update((mem, r) for r in new)

    def close(self) -> None:
        for reg in self.regs:
            if reg is not None:
                _quietly(lambda reg=reg: self.agent.deregister_memory(reg))
        self.regs, self.done = [], set()


PACK_ALIGN = 256  # each packed box's offset in the pack region


def pack_layout(plans: Mapping[Pair, list[Bucket]], tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, tuple, int, int]]:
    """The source boxes a training rank packs every step, ``(tensor, box, offset, nbytes)``: every distinct
    segment of its plan whose box is strided in its tensor (more than one byte run: a column half of a
    row-parallel weight), back to back at ``PACK_ALIGN``. A reader then reads each as ONE descriptor
    instead of one per row (Kimi-K2's o_proj / down_proj halves: ~875k descriptors a worker)."""
    from weightsync.transport.nixl_wire import box_runs

    seen: set = set()
    out, at = [], 0
    for p in sorted(plans):
        for b in sorted(plans[p], key=lambda b: b.index):
            for seg in segments(b):
                key = (seg.src_tensor, seg.src_box)
                if key in seen or seg.nbytes == 0:
                    continue
                seen.add(key)
                t = tensors[seg.src_tensor]
                if len(box_runs(0, t.shape, t.stride(), t.element_size(), seg.src_box)) <= 1:
                    continue
                out.append((seg.src_tensor, tuple(seg.src_box), at, seg.nbytes))
                at += -(-seg.nbytes // PACK_ALIGN) * PACK_ALIGN
    return out


def _packing() -> bool:
    return os.environ.get("WEIGHTSYNC_NIXL_PACK", "1") != "0"


#: UCX settings this transport needs, applied unless the user set them (before the first agent of the
#: process starts UCX). cuda_ipc's zero-copy get -- a READ of another process's VRAM on this host -- is
#: "auto" in UCX: off wherever UCX sees no NVLink between GPUs (a one-GPU host, PCIe hosts), and a READ
#: then falls back to a staged path ~1,000x slower (docs/nixl.md has the measurement).
UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


def _agent(nixl, role: str, progress_thread: bool = True):
    """A NIXL agent on UCX. ``progress_thread``: NIXL's UCX progress thread, which polls the worker all the
    time. Trainers keep it (a READ over TCP needs its target to progress). Readers run without it: they poll
    their own transfers (``_wait``), and on one H200 the thread cost every READ descriptor ~15 us that the
    copies waited on -- 399 reads of qwen3-8b's tensors 13.4 ms with it, 8.8 ms without, against a 7.7 ms
    device copy (BENCHMARKS.md, "NIXL: fewer, larger descriptors"). ``WEIGHTSYNC_NIXL_RX_PROGRESS_THREAD=1``
    gives readers the thread back."""
    for key, value in UCX_DEFAULTS.items():
        if key not in os.environ:
            os.environ[key] = value
            log.info("NIXL: %s=%s (set it to override)", key, value)
    name = f"ws-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    config = nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    return nixl.nixl_agent(name, config), name


def _register(agent, regions: list[tuple[int, int]], mem: str, dev: int):
    return agent.register_memory([(a, n, dev, "") for a, n in regions], mem) if regions else None


class NixlSender(Sender):
    """A training rank: registers its tensors (or a snapshot) once and publishes their descriptors."""

    modes = frozenset({"sync", "async"})

    def memory(self, ctx: SenderContext) -> Buffers:
        # the pack region (strided boxes packed every step) is reported with the codec's memory: both are
        # what this rank keeps beyond its weights
        packed = sum(-(-n // PACK_ALIGN) * PACK_ALIGN for *_, n in pack_layout(ctx.plans, ctx.tensors)) if _packing() else 0
        if not self.options.framed:
            return Buffers(codec=packed)
        encoder, _, _, size = self._frames_layout(ctx)  # what the codec keeps, and the registered region
        return Buffers(codec=encoder.memory() + size + packed)

    def _frames_layout(self, ctx: SenderContext):
        """A framed codec's encoder, the distinct buckets it encodes (one per source layout, ordered by
        key), each one's offset in the region, and the region's size (each slot its worst case)."""
        encoder = self.options.codec.encoder(ctx.plans, next(iter(ctx.tensors.values())).device)
        live = [b for p in sorted(ctx.plans) for b in sorted(ctx.plans[p], key=lambda b: b.index) if b.nbytes > 0]
        distinct = sorted(encoder.distinct(live), key=encoder.key)
        offsets, at = [], 0
        for b in distinct:
            offsets.append(at)
            at += -(-encoder.bound(b) // _ALIGN) * _ALIGN
        return encoder, distinct, offsets, at

    def connect(self, ctx: SenderContext) -> None:
        nixl = load_nixl()
        self.close()
        self.rank = ctx.rank
        self.live = dict(ctx.tensors)
        self.ptrs = {n: t.data_ptr() for n, t in self.live.items()}
        self.device = next(iter(self.live.values())).device
        self.asynchronous = self.options.mode == "async"
        # async: readers read a snapshot staged under a sequence lock, so training goes on meanwhile
        self.served = {n: torch.empty_like(t) for n, t in self.live.items()} if self.asynchronous else self.live
        self.header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        self.agent, name = _agent(nixl, f"t{ctx.rank}")
        self.registry = _Registry(self.agent)
        mem, dev = _mem(self.device)
        # strided boxes of the plan, packed every step into one region: one descriptor each for the readers
        self.packed = pack_layout(ctx.plans, self.served) if _packing() else []
        size = sum(-(-n // PACK_ALIGN) * PACK_ALIGN for *_, n in self.packed)
        self.pack = torch.empty(size, dtype=torch.uint8, device=self.device) if self.packed else None
        served = dict(self.served)
        self.encoder = None
        self._graphs = CopyGraphs()  # a batched codec's encode of a step (_encode_landing), replayed
        if self.options.framed:  # encoded into a registered region: sync from the live weights, async the snapshot
            self.encoder, self.distinct, self.offsets, size = self._frames_layout(ctx)
            self.region = torch.empty(max(size, _ALIGN), dtype=torch.uint8, device=self.device)
            self.index = torch.zeros(HEAD + SLOT * len(self.distinct), dtype=torch.int64)
            self.index[2] = len(self.distinct)
            for k, b in enumerate(self.distinct):
                self.index[HEAD + SLOT * k : HEAD + SLOT * k + 3] = torch.tensor([self.encoder.key(b), self.offsets[k],
                                                                                  WHOLE])
            served[REGION], served[INDEX] = self.region, self.index
        # every region of this device at once (a segment may hold weights, the pack and the frames alike)
        local = [*self.served.values(), *([self.pack] if self.pack is not None else []),
                 *([self.region] if self.encoder is not None else [])]
        regions = _regions(local)
        self.registry.add(regions, mem, dev)
        self.registry.add([(self.header.data_ptr(), self.header.numel() * 8)], "DRAM", 0)
        if self.encoder is not None:
            self.registry.add(_storages([self.index]), "DRAM", 0)
        packed = tuple(PackedBox(n, box, self.pack.data_ptr() + off, nb) for n, box, off, nb in self.packed)
        doc = TrainerDoc(ctx.rank, name, self.agent.get_agent_metadata(), mem, dev, tuple(regions),
                         {n: RemoteTensor(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype_name(t.dtype),
                                          t.element_size()) for n, t in served.items()},
                         self.header.data_ptr(), layout_digest(ctx.planner.src.layout(ctx.rank)), self.options.mode,
                         packed)
        size = publish_doc(ctx.client, doc)
        log.info("training rank %d: NIXL agent %s registered %d regions (%s) for %d tensors, %d strided boxes "
                 "packed (%d bytes), descriptors %d chars", ctx.rank, name, len(regions), mem, len(self.served),
                 len(self.packed), 0 if self.pack is None else self.pack.numel(), size)

    def send(self, step: int) -> StepStats | None:
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the optimizer's kernels are done before anyone reads
        if self.asynchronous:
            self._stage(step)
            return None
        self._pack()
        if self.encoder is not None:  # before the step is announced: workers read the index after it
            self._encode(step)
        self.header[1] = step
        self.header[0] += 2
        # one-sided: the readers move the bytes; this rank moved none
        return StepStats(0, 0, time.perf_counter() - t0)

    def _stage(self, step: int) -> None:
        self.header[0] += 1  # odd: a reader that overlaps this copy sees the change and discards its read
        with torch.no_grad():
            for n, t in self.live.items():
                self.served[n].copy_(t)
        self._pack()  # from the snapshot, inside the odd window
        with torch.no_grad():
            if self.encoder is not None:  # against the snapshot staged before, inside the odd window
                self._encode(step)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.header[1] = step
        self.header[0] += 1

    def _pack(self) -> None:
        """Copy every strided box of the plan into the pack region (row-major), finished before the step is
        announced (sync) or the snapshot's window closes (async)."""
        if not self.packed:
            return
        with torch.no_grad():
            for name, box, off, n in self.packed:
                src = self.served[name][slices(box)]
                self.pack[off : off + n].view(src.dtype).view(src.shape).copy_(src)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _encode(self, step: int) -> None:
        """Encode this step's frames into the region and stamp the index (the tensors are still: the
        optimizer is done and the step not yet announced). The index's ``seq`` is odd while it is
        stamped, and every slot's header names the base it was encoded against; a failed encode
        leaves every slot WHOLE (workers read in full)."""
        idx = self.index
        idx[0] += 1  # odd while stamping
        self.encoder.begin(step, None)
        try:
            headers = {}
            if self.encoder.batched:  # every distinct bucket's encode as one landing (a CUDA graph on a GPU)
                self._graphs.begin(self.served, buffers=[self.region])  # moved since the last step: rebuilt
                self._graphs.run(self, "encode", self._encode_landing, self.device)
                for b in self.distinct:
                    headers[self.encoder.key(b)] = self.encoder.header(b)
            else:
                for k, b in enumerate(self.distinct):
                    off = self.offsets[k]
                    frame = self.encoder.encode(b, self.served, self.region[off : off + self.encoder.bound(b)],
                                                kept=True)
                    headers[self.encoder.key(b)] = frame.header
            headers.update(self.encoder.end(step))  # the final headers where it has them (delta: this step's sums)
        except BaseException:
            self.encoder.fail()
            for k in range(len(self.distinct)):
                idx[HEAD + SLOT * k + 2] = WHOLE
            idx[0] += 1
            raise
        if self.distinct:  # every slot's header words at once
            idx[HEAD:].view(-1, SLOT)[:, 2:] = torch.tensor([headers[self.encoder.key(b)].words()
                                                             for b in self.distinct], dtype=torch.int64)
        if self.device.type == "cuda":  # the region's bytes landed before the window closes
            torch.cuda.synchronize(self.device)
        idx[1] = step
        idx[0] += 1

    def _encode_landing(self) -> Landing:
        """Every distinct bucket's encode into its slot of the region as one landing (a batched codec: fp8's plain
        copies and quantize kernels), built on the first step and replayed by :class:`CopyGraphs` -- on a GPU as one
        CUDA graph, on CPU as the same tables run eagerly. It holds the addresses of every source box (sync: the live
        weights; async: the snapshot) and of the region. What invalidates it: any of those tensors reallocated (a
        parameter whose ``.data`` the trainer replaced, a resize); :meth:`CopyGraphs.begin` looks up every served
        tensor's and the region's address before each step's replay and drops the graph when one moved, so the
        step is encoded from where the bytes are now (sync mode's :meth:`check` still refuses such a step: the
        registered bf16 memory moved). Not detected: a tensor object swapped for another in the trainer's module
        (the transport never sees the new one; true of every transport's registration)."""
        return join([self.encoder.landing(b, self.served, self.region[off : off + self.encoder.bound(b)])
                     for b, off in zip(self.distinct, self.offsets)])

    def snapshot(self) -> Mapping[str, torch.Tensor] | None:
        return self.served if self.asynchronous else None

    def check(self, step: int) -> None:
        if self.asynchronous:
            return  # readers read the snapshot, which never moves
        for n, t in self.live.items():
            if t.data_ptr() != self.ptrs[n]:
                raise WeightsMoved(f"training rank {self.rank}: tensor {n} {tuple(t.shape)} was reallocated since it "
                                   "was registered with NIXL, so readers would read the old memory; keep the weights "
                                   "in place, or reconnect after moving them")

    def close(self) -> None:
        """Deregister this rank's memory and release its agent (see :func:`_release`)."""
        agent = getattr(self, "agent", None)
        if agent is None:
            return
        self.registry.close()
        self.registry, self.agent = None, None
        _release(agent)


@dataclass(frozen=True)
class Batch:
    """One bucket's staged segments: read into a slot, then unpacked into the targets."""

    pair: Pair
    bucket: int
    segments: tuple[Segment, ...]  # offsets within the slot
    runs: np.ndarray  # remote (addr, nbytes) per run, (N, 2) int64
    rel: np.ndarray  # each run's offset within the slot
    nbytes: int


@dataclass(frozen=True)
class Direct:
    """A segment read straight into its destination."""

    pair: Pair
    bucket: int
    segment: Segment
    runs: np.ndarray  # remote (addr, nbytes) per run


@dataclass(frozen=True)
class PeerReads:
    """What a worker reads from one training rank each step (before the local side is known)."""

    rank: int
    doc: TrainerDoc
    direct: list[Direct]  # the segments read in place
    batches: list[Batch]
    nbytes: int
    buckets: int


class Program:
    """A worker's prepared transfers for one set of targets: replayed every step."""

    def __init__(self):
        self.direct: list[tuple[Pair, object]] = []  # (first pair of the peer, handle)
        self.staged: list[_Chunk] = []  # a bucket's staged segments each, in slot k % SLOTS (_stream)
        self.dlists: list = []
        self.descriptors = 0  # READ descriptors posted a step (after merging)


class NixlReceiver(Receiver):
    """An inference worker READs its planned pieces from the training ranks' registered memory."""

    modes = frozenset({"sync", "async"})
    reads_after_written = True  # sync: the trainers' memory holds the step once every one announced it
    watches_trainers = True  # a READ of a stopped trainer's memory stays posted (module docstring, Errors)

    def memory(self, ctx: ReceiverContext) -> Buffers:
        if not self.options.framed:
            return Buffers(SLOTS, _largest_staged(ctx.plans, ctx.tensors))
        # framed: a scratch buffer for the payloads and one to stage a bucket's base (FrameReads), and the
        # staging slots of a full read, which a codec that lands its frames only never makes
        codec = self.options.codec
        extra = 2 * _largest_frame(ctx.plans, codec.decoder(ctx.plans))
        return Buffers(SLOTS, 0 if codec.needs_frames else _largest_staged(ctx.plans, ctx.tensors), codec=extra)

    def connect(self, ctx: ReceiverContext) -> None:
        """Start this worker's agent. The peers' descriptors are looked up at the first read, not here:
        an elastic trainer publishes them only once the job's first instances joined, which they do
        after connecting; a read waits for them anyway (sync: until the step was announced)."""
        nixl = load_nixl()
        self.close()
        self.ctx, self.nixl = ctx, nixl
        self.timeout_s = self.options.timeout_s
        self.client = ctx.link.client(self.timeout_s)
        progress = os.environ.get("WEIGHTSYNC_NIXL_RX_PROGRESS_THREAD", "0") == "1"  # see _agent
        self.agent, self.name = _agent(nixl, f"i{ctx.instance}r{ctx.rank}", progress)
        self.registry = _Registry(self.agent)
        self.peer_ranks = sorted({p[0] for p in ctx.plans})
        self.peers: dict[int, PeerReads] = {}
        self.remote: dict[int, str] = {}
        self.header_bufs = {r: torch.full((HEADER_WORDS,), -1, dtype=torch.int64) for r in self.peer_ranks}
        self.registry.add(_storages(self.header_bufs.values()), "DRAM", 0)
        self.slots: list[torch.Tensor] = []
        self.programs: dict[tuple, Program] = {}
        self.header_handles: list[tuple[int, object]] = []
        self.header_dlists: list = []
        # framed: the payloads when this worker proves their bases, else a full read
        self.decoder = self.options.codec.decoder(ctx.plans) if self.options.framed else None
        self.frames = FrameReads(self, ctx.plans) if self.decoder is not None else None
        # the trainers' liveness, asked by every wait that makes no progress (weightsync.transport.liveness)
        self.watch = ctx.watch
        if self.watch is not None:
            self.watch.connect(self.peer_ranks, self.timeout_s)
        #: why a wait gave up with reads still posted: they may land later, so no later step is read into the
        #: same memory (a new reader -- rejoin() -- reads again)
        self.abandoned: str | None = None
        #: when the current receive or pull must be over (perf_counter): a step's reads take timeout_s in all, so
        #: a worker's call returns before the engine's RPC deadline however steadily they progress
        self._deadline: float | None = None

    def _ensure_peers(self) -> None:
        """Each peer trainer's descriptors, checked against the plan before any byte moves (once)."""
        if len(self.peers) == len(self.peer_ranks):
            return
        docs = {r: lookup_doc(self.client, r, self.timeout_s) for r in self.peer_ranks}
        peers = {r: self._check_and_plan(r, doc) for r, doc in docs.items()}  # refuses before anything is read
        for r, reads in peers.items():
            try:
                self.remote[r] = self.agent.add_remote_agent(reads.doc.metadata)
            except Exception as e:  # noqa: BLE001 - NIXL's own error types
                raise TransportError(f"instance {self.ctx.instance} rank {self.ctx.rank}: NIXL refused training rank "
                                     f"{r}'s agent metadata: {type(e).__name__}: {e}", peer=r) from e
        self.peers = peers
        for r, reads in peers.items():  # each peer's header, read around every step's data
            hb = self.header_bufs[r]
            lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(hb.data_ptr(), HEADER_WORDS * 8, 0)], "DRAM")
            rh = self.agent.prep_xfer_dlist(self.remote[r], [(reads.doc.header, HEADER_WORDS * 8, 0)], "DRAM")
            self.header_dlists += [lh, rh]
            self.header_handles.append((r, self.agent.make_prepped_xfer("READ", lh, [0], rh, [0])))

    # -- set-up ---------------------------------------------------------------------------------
    def _check_and_plan(self, r: int, doc: TrainerDoc) -> PeerReads:
        """Every planned piece from training rank ``r`` checked against its descriptors, then its remote
        byte runs: a mismatch is refused naming tensor, shape and rank, before anything is read."""
        ctx = self.ctx
        want = ctx.planner.src.layout(r)
        if doc.layout_digest != layout_digest(want):
            raise TransportError(f"training rank {r} registered NIXL descriptors for another layout (digest "
                                 f"{doc.layout_digest[:12]}, this plan expects {layout_digest(want)[:12]}): "
                                 "the trainer and this worker planned different jobs; restart both from one job",
                                 pair=(r, ctx.instance, ctx.rank))
        import numpy as np

        direct, batches = [], []
        nbytes = buckets = 0
        packed = doc.packed_at()
        for pair, bs in sorted((p, b) for p, b in ctx.plans.items() if p[0] == r):
            for b in bs:
                if b.nbytes == 0:
                    continue
                buckets += 1
                nbytes += b.nbytes
                staged, rel, runs, at = [], [], [], 0
                for seg in segments(b):
                    rt = self._remote_tensor(pair, b, seg, doc, want)
                    pk = packed.get((seg.src_tensor, tuple(seg.src_box)))
                    if pk is not None and pk.nbytes == seg.nbytes:  # the trainer packs this box: one run
                        got = np.array([[pk.addr, pk.nbytes]], dtype=np.int64)
                    else:
                        got = box_runs(rt.addr, rt.shape, rt.stride, rt.itemsize, seg.src_box)
                    self._inside(pair, seg, got, doc)
                    region = ctx.tensors[seg.dst_tensor][slices(seg.dst_box)]
                    if _in_place(region, seg):
                        direct.append(Direct(pair, b.index, seg, got))
                    else:
                        runs.append(got)
                        rel.append(at + _cumulative(got))
                        staged.append(replace(seg, offset=at))
                        at += seg.nbytes
                if staged:
                    batches.append(Batch(pair, b.index, tuple(staged), np.concatenate(runs), np.concatenate(rel), at))
        return PeerReads(r, doc, direct, batches, nbytes, buckets)

    def _remote_tensor(self, pair: Pair, b: Bucket, seg: Segment, doc: TrainerDoc, want) -> RemoteTensor:
        r = pair[0]
        rt = doc.tensors.get(seg.src_tensor)
        where = f"bucket {b.index} of {_describe(pair)}: tensor {seg.src_tensor}{fmt_box(seg.src_box)}"
        if rt is None:
            raise TransportError(f"{where}: training rank {r} registered no such tensor with NIXL", pair=pair, bucket=b.index)
        layout = want.tensors.get(seg.src_tensor)
        shape = tuple(layout.shape) if layout is not None else None
        if rt.shape != shape or rt.dtype != seg.dtype:
            raise TransportError(f"{where}: training rank {r} registered it as {rt.dtype} {list(rt.shape)}, the plan "
                                 f"expects {seg.dtype} {list(shape) if shape else '(no such tensor)'}; refusing to read "
                                 "(restart the trainer and this worker from one job)", pair=pair, bucket=b.index)
        if any(o < 0 or o + n > s for (o, n), s in zip(seg.src_box, rt.shape)) or len(seg.src_box) != len(rt.shape):
            raise TransportError(f"{where}: the box lies outside the registered {list(rt.shape)}", pair=pair, bucket=b.index)
        return rt

    @staticmethod
    def _inside(pair: Pair, seg: Segment, runs, doc: TrainerDoc) -> None:
        if not len(runs):
            return
        lo, hi = int(runs[:, 0].min()), int((runs[:, 0] + runs[:, 1]).max())
        if not any(a <= lo and hi <= a + n for a, n in doc.regions):
            raise TransportError(f"{_describe(pair)}: tensor {seg.src_tensor}{fmt_box(seg.src_box)} lies outside every "
                                 f"region training rank {pair[0]} registered; refusing to read", pair=pair)
        if int(runs[:, 1].sum()) != seg.nbytes:
            raise TransportError(f"{_describe(pair)}: tensor {seg.src_tensor}{fmt_box(seg.src_box)} covers "
                                 f"{int(runs[:, 1].sum())} registered bytes, the plan {seg.nbytes}", pair=pair)

    def _program(self, targets: Mapping[str, torch.Tensor]) -> Program:
        """The prepared transfers into ``targets`` (built on first use, then replayed)."""
        import numpy as np

        key = tuple(sorted((n, t.data_ptr()) for n, t in targets.items()))
        prog = self.programs.get(key)
        if prog is not None:
            return prog
        self._ensure_peers()
        prog = Program()
        device = next(iter(targets.values())).device
        mem, dev = _mem(device)
        need = max((bt.nbytes for p in self.peers.values() for bt in p.batches), default=0)
        if need and (not self.slots or self.slots[0].numel() < need or self.slots[0].device != device):
            self.slots = [torch.empty(need, dtype=torch.uint8, device=device) for _ in range(SLOTS)]
        # targets and slots at once: on a GPU one allocator segment may hold both
        local_regions = _regions([*targets.values(), *self.slots])
        self.registry.add(local_regions, mem, dev)
        k = 0
        for r, reads in self.peers.items():
            peer = self.remote[r]
            # a descriptor never crosses a registration, nor the edge of a packed box
            remote_regions = sorted(set(reads.doc.regions) | {(p.addr, p.nbytes) for p in reads.doc.packed})
            local, remote, parts = [], [], []  # parts: (kind, start, count, extra)
            if reads.direct:
                loc, rem = [], []
                # by remote address (one transfer: any order will do): reads of tensors that lie back to
                # back on both sides end up next to each other, and merge
                for d in sorted(reads.direct, key=lambda d: int(d.runs[0, 0]) if len(d.runs) else 0):
                    start = targets[d.segment.dst_tensor][slices(d.segment.dst_box)].data_ptr()
                    loc.append(np.stack([start + _cumulative(d.runs), d.runs[:, 1]], axis=1))
                    rem.append(d.runs)
                loc_a, rem_a = merge_pairs(np.concatenate(loc), np.concatenate(rem), local_regions, remote_regions)
                for at in range(0, len(loc_a), POST_CHUNK):  # posted one after another (_read)
                    parts.append(("direct", len(local) + at, min(POST_CHUNK, len(loc_a) - at), reads.direct[0].pair))
                local.extend(_descs(loc_a, dev))
                remote.extend(_descs(rem_a, reads.doc.device))
            for bt in reads.batches:
                slot = k % SLOTS
                k += 1
                loc_a, rem_a = merge_pairs(np.stack([self.slots[slot].data_ptr() + bt.rel, bt.runs[:, 1]], axis=1),
                                           bt.runs, local_regions, remote_regions)
                parts.append(("staged", len(local), len(loc_a), _Chunk(slot, [], (r,), bt.nbytes, batch=bt)))
                local.extend(_descs(loc_a, dev))
                remote.extend(_descs(rem_a, reads.doc.device))
            if local:
                lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, mem)
                rh = self.agent.prep_xfer_dlist(peer, remote, reads.doc.mem)
                prog.dlists += [lh, rh]
                prog.descriptors += len(remote)
                for kind, start, count, extra in parts:
                    idx = list(range(start, start + count))
                    h = self.agent.make_prepped_xfer("READ", lh, idx, rh, idx)
                    if kind == "direct":
                        prog.direct.append((extra, h))
                    else:
                        extra.handles.append((h, extra.batch.pair, extra.batch.bucket))
                        prog.staged.append(extra)
        # staged batches run in this (build) order, batch k in slot k % SLOTS: freed by batch k - SLOTS
        self.programs[key] = prog
        log.info("instance %d rank %d: NIXL program for %d peers: %d descriptors, %d in-place transfers, %d staged "
                 "buckets, %d local regions", self.ctx.instance, self.ctx.rank, len(self.peers), prog.descriptors,
                 len(prog.direct), len(prog.staged), len(local_regions))
        return prog

    # -- steps ----------------------------------------------------------------------------------
    def receive(self, step: int, targets: Mapping[str, torch.Tensor]) -> StepStats:
        self._refuse_if_abandoned()
        t0 = time.perf_counter()
        self._deadline = t0 + self.timeout_s
        stats = self._read(targets, t0) if self.frames is None else self.frames.receive(step, targets, self._read)
        for r, h in self._headers():
            seq, got = int(h[0]), int(h[1])
            if got != step or seq % 2:
                if self.decoder is not None:
                    self.decoder.fail()  # not a whole step: no base to prove next time
                raise TransportError(f"training rank {r} -> instance {self.ctx.instance} rank {self.ctx.rank}: its "
                                     f"header says step {got} (seq {seq}) after reading step {step}: it restarted or "
                                     "moved on while read; the step is not whole", pair=(r, self.ctx.instance, self.ctx.rank))
        return stats

    def pull(self, targets: Mapping[str, torch.Tensor]) -> Pulled:
        self._refuse_if_abandoned()
        t0 = time.perf_counter()
        self._deadline = t0 + self.timeout_s
        before = self._stable_headers(t0)
        if self.frames is None:
            stats = self._read(targets, t0)
        else:  # the payloads when this worker proves the staged frames' bases
            served = {step for _, step in before.values()}
            try:
                stats = self.frames.receive(served.pop() if len(served) == 1 else None, targets, self._read)
            except Restaged as e:  # re-staged under the payload reads: a mix, like any torn pull
                log.info("%s; pulling again", e)
                stats = StepStats(0, e.moved, time.perf_counter() - t0)
                return Pulled(frozenset({step for _, step in before.values()} | {-1}), stats)
        steps = set()
        for r, h in self._headers():
            seq, step = before[r]
            steps.add(step)
            if int(h[0]) != seq:  # re-staged while we read: a mix, never reported
                steps.add(-1)
        if self.decoder is not None and len(steps) != 1:
            self.decoder.fail()  # not a whole step: no base to prove next time
        return Pulled(frozenset(steps), stats)

    def _stable_headers(self, t0: float) -> dict[int, tuple[int, int]]:
        """Each peer's (seq, step) once none is mid-stage and each staged a step (bounded by the timeout)."""
        while True:
            got = {r: (int(h[0]), int(h[1])) for r, h in self._headers()}
            if all(seq > 0 and seq % 2 == 0 for seq, _ in got.values()):
                return got
            waited = time.perf_counter() - t0
            waiting = [r for r, (seq, _) in got.items() if seq == 0 or seq % 2]
            if waited > self.timeout_s:
                raise TransportError(f"instance {self.ctx.instance} rank {self.ctx.rank}: training ranks {waiting} "
                                     f"staged no whole step within {self.timeout_s:g} s", pair=(waiting[0], self.ctx.instance, self.ctx.rank))
            if self.watch is not None and (gone := self.watch.lost(waiting, waited)) is not None:
                raise gone.error(f"instance {self.ctx.instance} rank {self.ctx.rank}: waiting for training rank "
                                 f"{gone.rank} to stage a whole step",
                                 pair=(gone.rank, self.ctx.instance, self.ctx.rank))
            time.sleep(0.002)

    def _headers(self) -> list[tuple[int, torch.Tensor]]:
        """Read every peer's header now: [(rank, (seq, step, ...))]."""
        self._ensure_peers()
        handles = []
        for r, h in self.header_handles:
            self.header_bufs[r].fill_(-1)
            pair = (r, self.ctx.instance, self.ctx.rank)
            self._post(h, pair, None)
            handles.append((h, pair, None))
        self._wait(handles)
        return [(r, self.header_bufs[r]) for r, _ in self.header_handles]

    def _read(self, targets: Mapping[str, torch.Tensor], t0: float) -> StepStats:
        """The step in full: every in-place read posted at once (in chunks, ``POST_CHUNK``), then the staged
        buckets through the slots (:meth:`_stream`), each landed as the codec lands the plan's bytes."""
        from weightsync.payload.pack import run_landing, unpack_pairs, unpacked

        prog = self._program(targets)
        pending: list = []  # the in-place reads posted: they write into the live tensors
        started = None
        codec = self.options.codec

        def land(ch: _Chunk) -> None:  # byte copies, then the codec's casts (an fp32 trainer into bf16)
            run_landing(unpacked(codec, unpack_pairs(ch.batch.segments, self.slots[ch.slot], targets)))

        try:
            for pair, h in prog.direct:  # every in-place read in flight at once, in chunks (POST_CHUNK)
                self._post(h, pair, None)
                pending.append((h, pair, None))
                if started is None:  # the first chunk's copies run from here while the rest are posted
                    started = time.perf_counter()
            first, posted = self._stream(prog.staged, self.slots, land)
            self._wait(pending)
        except BaseException:
            self._drain(pending)  # no in-place read may still be writing once the step has failed
            raise
        peers = self.peers.values()
        started = started if started is not None else first if first is not None else posted
        return StepStats(sum(p.buckets for p in peers), sum(p.nbytes for p in peers), time.perf_counter() - t0,
                         posted - t0, started - t0)

    def _stream(self, chunks: list[_Chunk], slots: Sequence[torch.Tensor], land: Callable[[_Chunk], None],
                check: Callable[[_Chunk], None] | None = None) -> tuple[float | None, float]:
        """READ every chunk into its slot and land it, every codec alike (the plan's staged bytes, a framed codec's
        payloads): as many chunks in flight as there are ``slots``; chunk k is posted once the landing that last
        read its slot is done (a CUDA event on a GPU), and landed once its READs completed and ``check`` passed.
        :func:`~weightsync.transport.posted.posted` is said once the last is posted; on a GPU every landing is done
        before it returns; what raises leaves nothing of it posted (a prepped READ is posted again next step).
        Returns when the first and the last chunk were posted (perf_counter; the first None: no chunk)."""
        on_gpu = bool(slots) and slots[0].device.type == "cuda"
        freed: list = [None] * len(slots)  # per slot: the event after the landing that last read it
        window: list[_Chunk] = []  # posted, not yet landed
        loose: list = []  # the handles of a chunk being posted
        first = None

        def finish() -> None:
            ch = window[0]
            self._wait(ch.handles)
            window.pop(0)
            if check is not None:
                check(ch)  # before landing: a torn payload is never applied
            land(ch)
            if on_gpu:
                freed[ch.slot] = torch.cuda.Event()
                freed[ch.slot].record()

        try:
            for ch in chunks:
                if len(window) == len(slots):
                    finish()  # frees the slot of the chunk posted len(slots) before
                if freed[ch.slot] is not None:
                    freed[ch.slot].synchronize()
                for h, pair, bucket in ch.handles:
                    self._post(h, pair, bucket)
                    loose.append((h, pair, bucket))
                window.append(ch)
                loose = []
                first = time.perf_counter() if first is None else first
            posted = time.perf_counter()
            all_posted()  # the rest is NIXL's and the device's (the landings excepted)
            while window:
                finish()
            if on_gpu:  # landed before the step is reported (and before NIXL writes a slot again)
                torch.cuda.current_stream().synchronize()
        except BaseException:
            self._drain([h for ch in window for h in ch.handles] + loose)
            if on_gpu:  # a landing still queued reads its slot, which the next step's READ rewrites
                _quietly(torch.cuda.current_stream().synchronize)
            raise
        return first, posted

    def _drain(self, handles: list) -> None:
        """After a step raised: wait for each READ it left posted, one at a time -- the one that failed (ERR) must
        not hide the others, still writing into a slot or a live tensor. A READ that does not finish within the
        step's bounds abandons this receiver (:meth:`_wait` says so); an abandoned one is not waited for again (a
        second ``timeout_s`` would double the error's time)."""
        for x in handles:
            if self.abandoned is not None:
                return
            _quietly(lambda x=x: self._wait([x]))

    def _post(self, h, pair: Pair, bucket: int | None) -> None:
        try:
            state = self.agent.transfer(h)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own types (a peer disconnected, ...)
            raise self._error(pair, bucket, e) from e
        if state == "ERR":
            raise self._error(pair, bucket, RuntimeError("NIXL posted the read in state ERR"))

    def _wait(self, handles: list) -> None:
        """Block until every ``(handle, pair, bucket)`` is DONE; raise on ERR, once none progressed for
        ``timeout_s``, or once a training rank read from is gone or stopped (``self.watch``, asked after
        ``LOOK_S`` without progress). Giving up with reads still posted abandons this receiver."""
        left = list(handles)
        last = time.perf_counter()
        while left:
            still = []
            for h, pair, bucket in left:
                try:
                    state = self.agent.check_xfer_state(h)
                except Exception as e:  # noqa: BLE001
                    raise self._error(pair, bucket, e) from e
                if state == "ERR":
                    raise self._error(pair, bucket, RuntimeError("NIXL reports the read failed (state ERR)"))
                if state != "DONE":
                    still.append((h, pair, bucket))
            if len(still) < len(left):
                last = time.perf_counter()
            left = still
            if left:
                now = time.perf_counter()
                idle = now - last
                cause: Exception | None = None
                if idle > self.timeout_s:
                    h, pair, bucket = left[0]
                    cause = TimeoutError(f"no read completed for {self.timeout_s:g}s")
                elif self._deadline is not None and now > self._deadline:
                    h, pair, bucket = left[0]
                    cause = TimeoutError(f"the step's reads did not finish within {self.timeout_s:g}s")
                elif self.watch is not None and idle >= self.watch.look_s:
                    gone = self.watch.lost({p[0] for _, p, _ in left}, idle)
                    if gone is not None:
                        h, pair, bucket = next(x for x in left if x[1][0] == gone.rank)
                        cause = gone.error("a read made no progress")
                if cause is not None:
                    err = self._error(pair, bucket, cause)
                    self.abandoned = str(err)
                    raise err
                time.sleep(POLL_S)

    def _refuse_if_abandoned(self) -> None:
        if getattr(self, "abandoned", None) is not None:
            raise TransportError(f"instance {self.ctx.instance} rank {self.ctx.rank}: refused: reads of an earlier "
                                 f"step may still land ({self.abandoned}); read again through a new reader "
                                 "(WeightReader.rejoin(), or init_weight_transfer_engine again)")

    def _error(self, pair: Pair, bucket: int | None, cause: Exception) -> TransportError:
        what = f"bucket {bucket} of " if bucket is not None else ""
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        return TransportError(f"instance {self.ctx.instance} rank {self.ctx.rank}: NIXL READ of {what}{_describe(pair)} "
                              f"failed (timeout {self.timeout_s:g}s): {type(cause).__name__}: {text}",
                              peer=pair[0], pair=pair, bucket=bucket)

    def close(self) -> None:
        """Release every handle and list, deregister, forget the peers, and release the agent (see
        :func:`_release`: each handle holds the agent, so all of them go first)."""
        agent = getattr(self, "agent", None)
        if agent is None:
            return
        if getattr(self, "frames", None) is not None:
            self.frames.close()
        self._release_handles(agent)
        self.programs, self.header_handles, self.header_dlists = {}, [], []
        self.slots, self.remote, self.peers = [], {}, {}
        self.registry, self.agent = None, None
        _release(agent)

    def _release_handles(self, agent) -> None:
        handles = [h for prog in getattr(self, "programs", {}).values() for _, h in prog.direct]
        handles += [h for prog in getattr(self, "programs", {}).values() for ch in prog.staged
                    for h, _, _ in ch.handles]
        handles += [h for _, h in getattr(self, "header_handles", [])]
        handles += [d for prog in getattr(self, "programs", {}).values() for d in prog.dlists]
        handles += getattr(self, "header_dlists", [])
        for h in handles:  # transfers before the lists they were made from
            _quietly(h.release)
        if getattr(self, "registry", None) is not None:
            self.registry.close()
        for name in getattr(self, "remote", {}).values():
            _quietly(lambda name=name: agent.remove_remote_agent(name))


class Restaged(TransportError):
    """A peer encoded new frames (re-staged, or moved on) while this worker read the payloads of the
    ones it proved: nothing of that batch was applied, the targets may mix two steps. ``moved``: the
    bytes read before."""

    def __init__(self, message: str, moved: int, peer: int, pair: Pair):
        super().__init__(message, peer=peer, pair=pair)
        self.moved = moved


@dataclass(frozen=True)
class Planned:
    """One bucket a worker decodes from a peer's frames: where its payload lies and its header."""

    pair: Pair
    bucket: Bucket
    addr: int  # remote address of the payload
    header: object  # the codec's header


@dataclass(frozen=True)
class Read:
    """One READ from one peer: local and remote ``(addr, nbytes, device)`` descriptors."""

    rank: int
    local: list
    local_mem: str
    remote: list
    remote_mem: str


class FrameReads:
    """A worker's framed reads (a framed codec): each peer's index read after the step was announced;
    when the codec's decoder proves every bucket's base from the headers there, only the payloads
    are READ (in chunks through a registered scratch's slots, by the transport's one read loop) and decoded in place;
    otherwise -- a new instance, a failed or skipped step, a staged copy, anything that touched the
    tensors, a bucket the trainer's own plan does not hold (an elastic trainer plans one instance
    slot: with DP replicas an instance served by another replica than slot 0's finds no slot) -- the
    step is read in full (per worker and step, no round trip).

    Async: the trainer encodes inside the snapshot's odd window, so region and index always describe
    the snapshot the header names; a pull whose index changed under its payload reads raises
    :class:`Restaged` (nothing of that batch applied), reported as a mix as every torn pull is."""

    def __init__(self, rx: NixlReceiver, plans: Mapping[Pair, list[Bucket]]):
        self.rx, self.decoder, self.codec = rx, rx.decoder, rx.options.codec
        self.buckets = [b for p in sorted(plans) for b in sorted(plans[p], key=lambda b: b.index) if b.nbytes > 0]
        self.largest = _largest_frame(plans, self.decoder)
        self._scratch: torch.Tensor | None = None
        self._slot: torch.Tensor | None = None
        self._slots: tuple[torch.Tensor, ...] = ()  # the payloads' staging slots in the scratch (_stream)
        self._index: dict[int, torch.Tensor] = {}
        self._heads: dict[int, tuple[int, int]] = {}  # each peer's index (seq, step) the plan was proven on
        self._head_reads: dict[int, tuple[object, list]] = {}  # each peer's prepped READ of its index's (seq, step)
        self._chunks: _ChunkReads | None = None  # the payloads' prepared reads, by plan and scratch
        self._graphs = CopyGraphs()  # each chunk's decode (a batched decoder), replayed

    def receive(self, step: int | None, targets: Mapping[str, torch.Tensor], full) -> StepStats:
        """Read ``step`` into ``targets``: the payloads when the decoder proves their bases, else in full
        (``full(targets, t0)``). ``step``: sync, the announced step; async, the step every peer's stable
        header names, or None when they name different ones (a mix: read in full, no version). The
        caller fails the decoder when the transport finds the read torn afterwards."""
        t0 = time.perf_counter()
        held = self.decoder.begin()  # from here the targets may mix two steps
        full_bytes = sum(b.nbytes for b in self.buckets)
        if step is None and self.codec.needs_frames:  # async: peers staged different steps, a mix whatever is
            return StepStats(0, 0, time.perf_counter() - t0, full_bytes=full_bytes)  # read: none (pull again)
        proofs = BASE_PROOF in self.codec.needs  # else every payload is read: there is no whole fall-back
        plan = self._plan(step, held, targets) if step is not None and (held is not None or not proofs) else None
        if plan is None:
            stats = full(targets, t0)
            for pair in sorted({b.pair for b in self.buckets}):
                self.decoder.whole(pair, [b for b in self.buckets if b.pair == pair])
            self.decoder.end(step) if step is not None else self.decoder.fail()
            return StepStats(stats.buckets, stats.bytes, stats.seconds, stats.posted, stats.started,
                             full_bytes=full_bytes)
        moved = self._apply(plan, targets)  # Restaged: no version (sync raises it; an async pull is a mix)
        self.decoder.end(step)
        return StepStats(len(self.buckets), moved, time.perf_counter() - t0, full_bytes=full_bytes)

    def _buffers(self, device: torch.device) -> None:
        if self._scratch is not None and self._scratch.device == device:
            return
        n = max(-(-self.largest // _ALIGN) * _ALIGN, _ALIGN)
        if self.decoder.batched:  # two slots: one chunk of payloads decodes while the next one is read
            self._scratch = torch.empty(2 * n, dtype=torch.uint8, device=device)
            self._slots = (self._scratch[:n], self._scratch[n:])
            self._slot = self._slots[1]  # for accepts() only, before any READ (a batched decoder decodes from none)
        else:  # one slot, and the decoder's own scratch (a bucket's base)
            self._scratch = torch.empty(n, dtype=torch.uint8, device=device)
            self._slots = (self._scratch,)
            self._slot = torch.empty(n, dtype=torch.uint8, device=device)
        mem, dev = _mem(device)
        self.rx.registry.add(_regions([self._scratch]), mem, dev)

    def _read_indexes(self) -> dict[int, torch.Tensor]:
        """Every peer's index, read at once."""
        reads = []
        for r in self.rx.peer_ranks:
            rt = self.rx.peers[r].doc.tensors[INDEX]
            buf = self._index.get(r)
            if buf is None:
                buf = self._index[r] = torch.zeros(rt.shape[0], dtype=torch.int64)
                self.rx.registry.add(_storages([buf]), "DRAM", 0)
            buf.fill_(0)
            n = buf.numel() * 8
            reads.append(Read(r, [(buf.data_ptr(), n, 0)], "DRAM", [(rt.addr, n, 0)], "DRAM"))
        self._reads(reads)
        return {r: self._index[r] for r in self.rx.peer_ranks}

    def _plan(self, step: int, held: int, targets: Mapping[str, torch.Tensor]) -> list[Planned] | None:
        """The payloads to READ when the decoder proves every bucket's base, else None (read in full);
        empty when this worker holds ``step`` already (async: a snapshot it pulled before)."""
        self.rx._ensure_peers()
        self._buffers(next(iter(targets.values())).device)
        for r in self.rx.peer_ranks:
            if INDEX not in self.rx.peers[r].doc.tensors:
                return self._whole(step, r, "it publishes no frames (it runs no framed codec: the two ends chose "
                                            "different codecs)")
        slots: dict[int, dict[int, tuple[int, object]]] = {}
        for r, idx in self._read_indexes().items():
            v = idx.tolist()
            self._heads[r] = (v[0], v[1])
            if v[0] % 2 or v[1] != step:
                return self._whole(step, r, f"its frames index names step {v[1]} (seq {v[0]}): it re-staged, moved "
                                            "on or restarted", restaged=True)
            slots[r] = {v[HEAD + SLOT * k]: (v[HEAD + SLOT * k + 1], self.codec.header(v[HEAD + SLOT * k + 2 : HEAD + SLOT * (k + 1)]))
                        for k in range(v[2])}
        items, where = [], []
        for b in self.buckets:
            got = slots[b.pair[0]].get(self.decoder.key(b))
            if got is None:  # not in that trainer's plan (elastic DP replicas)
                return self._whole(step, b.pair[0], f"it encodes no frame for bucket {b.index} (its plan differs from "
                                                    "this worker's: an elastic trainer plans one instance slot, so "
                                                    "with replicated training ranks another instance may be served "
                                                    "by a replica that encodes nothing for it)")
            size = self.decoder.size(b, got[1])
            if size != got[1].nbytes or size > self.largest:
                return self._whole(step, b.pair[0], f"its frame of bucket {b.index} holds {got[1].nbytes} bytes, this "
                                                    f"worker's plan {size}: the two ends built different plans")
            items.append((b, got[1]))
            where.append(got[0])
        read = self.decoder.accepts(step, held, items, targets, self._slot)
        if read is None:  # the decoder does not hold their bases (it logged which)
            return None if not self.codec.needs_frames else self._whole(
                step, self.buckets[0].pair[0], "this worker does not hold the base of its frames")
        return [Planned(items[i][0].pair, items[i][0], self.rx.peers[items[i][0].pair[0]].doc.tensors[REGION].addr
                        + where[i], items[i][1]) for i in read]

    def _whole(self, step: int, peer: int, why: str, restaged: bool = False) -> None:
        """Training rank ``peer``'s frames cannot serve ``step`` (``why``): None -- the caller reads the step in
        full -- or, for a codec whose frames are the only form its receiver lands (``needs_frames``: fp8), an
        error naming the trainer (``restaged``: :class:`Restaged`, which an async pull reports as a mix and
        pulls again); nothing was read."""
        ctx = self.rx.ctx
        where = f"training rank {peer} -> instance {ctx.instance} rank {ctx.rank}, step {step}"
        if not self.codec.needs_frames:
            log.info("%s: %s; reading in full", where, why)
            return None
        text = (f"{where}: {why}; nothing read: the {self.codec.name} codec's frames are the only form this engine "
                f"lands (a full read would land the plan's bytes, not the codec's)")
        if restaged:
            raise Restaged(text, 0, peer, (peer, ctx.instance, ctx.rank))
        raise TransportError(text, peer=peer, pair=(peer, ctx.instance, ctx.rank))

    def _apply(self, plan: list[Planned], targets: Mapping[str, torch.Tensor]) -> int:
        """Read ``plan``'s payloads and decode them through the transport's one read loop
        (:meth:`NixlReceiver._stream`): in chunks of at most a scratch slot, ordered by remote address (a chunk's
        payloads that lie back to back in a trainer's region are one descriptor), each chunk one prepped READ per
        peer into its slot (:class:`_ChunkReads`: prepared once per plan and scratch, replayed every step); the index
        re-read after each chunk's READ and before its decode (:meth:`_unchanged`). A batched decoder
        (:attr:`~weightsync.payload.codec.Decoder.batched`: fp8) takes every header first (a plan mismatch raises
        before any byte is read) and decodes a chunk as one landing, replayed by :class:`CopyGraphs` (a CUDA graph per
        chunk and slot on a GPU), two slots in flight; any other decodes each payload (one slot: the decoder keeps
        its own scratch for a bucket's base). Returns the bytes read."""
        chunks = self._chunk_reads(plan).chunks  # first: new chunks come with new graphs (begin must see those)
        if self.decoder.batched:
            for p in plan:
                self.decoder.take(p.bucket, p.header)
            self._graphs.begin(targets, buffers=[self._scratch])  # a target that moved: its chunks' graphs go
        device = self._scratch.device
        moved = [0]

        def land(ch: _Chunk) -> None:
            slot = self._slots[ch.slot]
            if self.decoder.batched:
                self._graphs.run(ch, "decode", lambda: join(
                    [self.decoder.landing(p.bucket, p.header, slot[o : o + p.header.nbytes], targets)
                     for p, o in ch.items]), device)
            else:
                for p, o in ch.items:
                    self.decoder.decode(p.bucket, p.header, slot[o : o + p.header.nbytes], targets, self._slot)
            moved[0] += ch.nbytes

        self.rx._stream(chunks, self._slots, land, check=lambda ch: self._unchanged(ch.peers, moved[0]))
        return moved[0]

    def _chunk_reads(self, plan: list[Planned]) -> _ChunkReads:
        """The chunks of ``plan`` and their prepped READs (built once per plan and scratch, then replayed)."""
        import numpy as np

        key = (self._scratch.data_ptr(), tuple((p.pair, p.bucket.index, p.addr, p.header.nbytes) for p in plan))
        if self._chunks is not None and self._chunks.key == key:
            return self._chunks
        self._release_chunks()
        self._graphs = CopyGraphs()  # the old chunks' graphs go with them
        size = self._slots[0].numel()
        groups: list[list[tuple[Planned, int]]] = []
        at = 0
        for p in sorted(plan, key=lambda p: (p.pair[0], p.addr)):
            n = -(-p.header.nbytes // _ALIGN) * _ALIGN
            if not groups or at + n > size:
                groups.append([])
                at = 0
            groups[-1].append((p, at))
            at += n
        agent, (mem, dev) = self.rx.agent, _mem(self._scratch.device)
        local_regions = _regions([self._scratch])
        dlists: list = []
        descriptors = 0
        chunks = [_Chunk(k % len(self._slots), [], tuple(sorted({p.pair[0] for p, _ in g})),
                         sum(p.header.nbytes for p, _ in g), items=tuple(g)) for k, g in enumerate(groups)]
        for r in sorted({p.pair[0] for p in plan}):
            doc = self.rx.peers[r].doc
            local, remote, spans = [], [], []
            for ch in chunks:
                items = [(p, o) for p, o in ch.items if p.pair[0] == r and p.header.nbytes]
                if not items:
                    continue
                base = self._slots[ch.slot].data_ptr()
                loc, rem = merge_pairs(np.array([[base + o, p.header.nbytes] for p, o in items], dtype=np.int64),
                                       np.array([[p.addr, p.header.nbytes] for p, _ in items], dtype=np.int64),
                                       local_regions, doc.regions)
                spans.append((ch, len(local), len(loc), items[0][0]))
                local.extend(_descs(loc, dev))
                remote.extend(_descs(rem, doc.device))
            if not local:
                continue
            descriptors += len(local)
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, mem)
            rh = agent.prep_xfer_dlist(self.rx.remote[r], remote, doc.mem)
            dlists += [lh, rh]
            for ch, start, count, first in spans:
                idx = list(range(start, start + count))
                ch.handles.append((agent.make_prepped_xfer("READ", lh, idx, rh, idx), first.pair, first.bucket.index))
        self._chunks = _ChunkReads(key, chunks, dlists)
        log.info("instance %d rank %d: %d payloads in %d chunks of at most %d bytes, %d READ descriptors",
                 self.rx.ctx.instance, self.rx.ctx.rank, len(plan), len(chunks), size, descriptors)
        return self._chunks

    def _release_chunks(self) -> None:
        if self._chunks is None:
            return
        for ch in self._chunks.chunks:  # transfers before the lists they were made from
            for h, _, _ in ch.handles:
                _quietly(h.release)
            ch.handles.clear()
        for d in self._chunks.dlists:
            _quietly(d.release)
        self._chunks = None

    def _head_read(self, r: int):
        """Training rank ``r``'s prepped READ of its index's first two words (seq, step) into ours."""
        got = self._head_reads.get(r)
        if got is None:
            agent = self.rx.agent
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(self._index[r].data_ptr(), 16, 0)], "DRAM")
            rh = agent.prep_xfer_dlist(self.rx.remote[r], [(self.rx.peers[r].doc.tensors[INDEX].addr, 16, 0)], "DRAM")
            got = self._head_reads[r] = (agent.make_prepped_xfer("READ", lh, [0], rh, [0]), [lh, rh])
        return got[0]

    def _unchanged(self, peers, moved: int) -> None:
        """Raise :class:`Restaged` unless every peer's index still is the one the plan was proven on.

        A trainer bumps its index's ``seq`` (odd) before it writes new frames into the region, and
        this re-reads it only after the payload READs completed: unchanged, no payload byte was
        overwritten under them (the seqlock argument of the async header, applied to the region)."""
        ctx = self.rx.ctx
        handles = []
        for r in peers:
            h, pair = self._head_read(r), (r, ctx.instance, ctx.rank)
            self.rx._post(h, pair, None)
            handles.append((h, pair, None))
        self.rx._wait(handles)
        for r in peers:
            buf = self._index[r]
            got = (int(buf[0]), int(buf[1]))
            if got != self._heads[r]:
                ctx = self.rx.ctx
                raise Restaged(f"training rank {r} -> instance {ctx.instance} rank {ctx.rank}: the trainer encoded "
                               f"new frames (index seq {got[0]}, step {got[1]}) while the payloads of step "
                               f"{self._heads[r][1]} were read; nothing of them applied, the step is not whole",
                               moved, r, (r, ctx.instance, ctx.rank))

    def _reads(self, reads: list[Read]) -> None:
        """Post every read (one per peer, in flight together: one round trip, not one per peer), wait
        for all, release them."""
        agent = self.rx.agent
        handles = []
        try:
            for rd in reads:
                pair, bucket = (rd.rank, self.rx.ctx.instance, self.rx.ctx.rank), None
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
                _quietly(h.release)

    def close(self) -> None:
        """Release its prepped reads (transfers before their lists); its buffers are registered in the receiver's
        registry, deregistered with the rest at its close."""
        self._release_chunks()
        for h, lists in self._head_reads.values():
            _quietly(h.release)
            for d in lists:
                _quietly(d.release)
        self._head_reads = {}
        self._graphs = CopyGraphs()


@dataclass
class _Chunk:
    """What a receive READs into one staging slot together, then lands (:meth:`NixlReceiver._stream`): a bucket's
    staged segments of the plan's bytes (``batch``), or a framed codec's payloads (``items``)."""

    slot: int
    handles: list  # (prepped READ, pair, bucket) per peer
    peers: tuple[int, ...]
    nbytes: int
    batch: Batch | None = None
    items: tuple[tuple[Planned, int], ...] = ()  # (payload, its offset in the slot), by remote address


@dataclass
class _ChunkReads:
    """A plan's chunks and the prepped lists their READs were made from, valid for one plan and scratch."""

    key: tuple
    chunks: list[_Chunk]
    dlists: list


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - tearing down
        pass


def _release(agent) -> None:
    """Say when ``agent`` outlives its close. NIXL has no destroy call: an agent (and with it the UCX
    backend's progress thread, which polls all the time: ~0.15 CPU s a second) goes when its last
    reference does -- the transport's and those of every prepared list and transfer handle made from
    it, released or not; the callers drop theirs, then ours goes as they return."""
    held = sys.getrefcount(agent.agent) - 2  # beyond the Python agent's own reference and this call's
    if held > 0:
        log.warning("NIXL agent %s is still referenced %d more times after close: it and its progress thread "
                    "stay until those references go", agent.name, held)


def _cumulative(runs):
    """Each run's offset in the bytes the runs cover back to back."""
    import numpy as np

    return np.concatenate([[0], np.cumsum(runs[:-1, 1])]).astype(np.int64) if len(runs) else np.zeros(0, dtype=np.int64)


def _descs(a, dev: int) -> list[tuple[int, int, int]]:
    return [(int(x), int(n), dev) for x, n in a]


def _in_place(region: torch.Tensor, seg: Segment) -> bool:
    """Whether a segment lands in place: its destination is contiguous and in the wire dtype."""
    return region.dtype == TORCH_DTYPES[seg.dtype] and region.is_contiguous()


def _largest_frame(plans: Mapping[Pair, list[Bucket]], decoder) -> int:
    """The most bytes one bucket's frame or plan bytes take (each frame buffer's size: a payload, or a base)."""
    return max((max(b.nbytes, decoder.bound(b)) for bs in plans.values() for b in bs if b.nbytes > 0), default=0)


def _largest_staged(plans: Mapping[Pair, list[Bucket]], tensors: Mapping[str, torch.Tensor]) -> int:
    """The most bytes one bucket stages (segments not landing in place), the size of each slot."""
    most = 0
    for bs in plans.values():
        for b in bs:
            n = sum(s.nbytes for s in segments(b) if not _in_place(tensors[s.dst_tensor][slices(s.dst_box)], s))
            most = max(most, n)
    return most
