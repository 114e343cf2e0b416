"""What one step of a plan posts, per receiving worker: NIXL descriptors and transfers, NCCL messages.

The simulator (:mod:`weightsync.predict.simulate`) charges CPU time per descriptor and per message, so it
needs the counts the transports really post. They are re-derived here from the plan alone (no tensors,
no addresses, no NIXL), in time linear in the plan's segments, because the transports build them inside
their set-up methods, not in a reusable function.

NIXL, as ``weightsync/transport/nixl.py`` builds a worker's program today (``pack_layout``,
``NixlReceiver._check_and_plan`` and ``NixlReceiver._program``):

1. Per peer training rank, its buckets in pair order (empty buckets skipped); each bucket's copies merged
   into :func:`weightsync.plan.messages.segments`.
2. A segment's remote byte runs are ``nixl_wire.box_runs`` of its source box in the trainer's tensor: one
   run per index of the dimensions before the last one the box does not cover whole (a column half of a
   matrix: one run per row). The trainer's tensors are contiguous, so runs never continue each other.
   **Packed**: a box of more than one run is packed by its trainer every step (``nixl.pack_layout``: every
   strided box of its plan, copied into one registered pack region before the step is announced) and read
   as ONE run; the reader keeps each packed box a region of its own, so it never joins a neighbour.
3. A segment lands *in place* (``_in_place``) when its destination box is contiguous in the worker's tensor
   and that tensor has the wire dtype; else it is *staged* through a slot.
4. All in-place segments of one peer go into ONE descriptor list, posted as transfers of at most
   :data:`POST_CHUNK` descriptors, one after another; each staged bucket (its staged segments back to back in
   a slot) is a list and a transfer of its own.
5. ``nixl_wire.merge_pairs`` joins consecutive descriptors that continue each other on both sides and lie
   in one registered region. Counted here with every tensor its own registration (``_storages``: the CPU's
   tensors, and a GPU's tensors of 10 MB and more, each its own ``cudaMalloc``): only runs of the same source
   tensor (and, in place, the same destination tensor) can join: inside a segment none do (its runs do not
   continue remotely), so a join happens only where one segment's last run meets the next one's first.
   On a GPU the transport registers whole allocator segments (``nixl._regions``), so smaller tensors that
   share a segment may join too: there the count is an upper bound. With ``contiguous=True`` the count
   takes each process's tensors back to back in one registration, in layout order (a flat parameter
   buffer): then a join happens wherever both sides continue.
6. Every step also reads each peer's small header: one more transfer of one descriptor per peer (sync
   ``receive`` reads it once; an async ``pull`` twice).

p2p (NCCL/gloo): each bucket travels as :func:`weightsync.plan.messages.messages`, one send/recv each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from weightsync.dtypes import itemsize
from weightsync.errors import PlanError
from weightsync.layout.box import Box
from weightsync.plan.messages import messages, segments
from weightsync.plan.planner import Bucket, Pair, Planner


@dataclass(frozen=True)
class Span:
    """Where a box of a contiguous tensor lies in it, in elements: its contiguous runs."""

    runs: int  # how many contiguous runs (nixl_wire.box_runs's rows)
    first: int  # element offset where the first run starts
    last_end: int  # element offset where the last run ends
    numel: int


def span(shape: tuple[int, ...], box: Box) -> Span:
    """The runs of ``box`` in a contiguous (row-major) tensor of ``shape``, as ``nixl_wire.box_runs``
    counts them for such a tensor, without listing them (O(dims))."""
    n = len(shape)
    numel = math.prod(e for _, e in box)
    strides = [1] * n
    for d in range(n - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    d = n - 1
    while d >= 0 and tuple(box[d]) == (0, shape[d]):  # trailing dims covered whole fold into one block
        d -= 1
    if d < 0:  # the whole tensor
        return Span(1 if numel else 0, 0, numel, numel)
    block = box[d][1] * strides[d]
    first = box[d][0] * strides[d] + sum(box[j][0] * strides[j] for j in range(d))
    last = box[d][0] * strides[d] + sum((box[j][0] + box[j][1] - 1) * strides[j] for j in range(d))
    runs = math.prod(box[j][1] for j in range(d)) if numel else 0
    return Span(runs, first, last + block, numel)


#: a peer's in-place reads are posted as transfers of at most this many descriptors (transport/nixl.py)
POST_CHUNK = 64


@dataclass(frozen=True)
class WorkerCounts:
    """What one receiving worker posts in one step (see the module docstring for how each is counted)."""

    instance: int
    rank: int
    peers: int  # training ranks it receives from
    buckets: int  # non-empty buckets
    segments: int
    messages: int  # p2p: send/recv operations (plan.messages)
    nixl_direct_descriptors: int  # in-place reads, after merging
    nixl_staged_descriptors: int  # reads into the staging slots, after merging
    nixl_transfers: int  # prepared transfers posted (one per peer with in-place reads + one per staged bucket)
    staged_bytes: int  # bytes that go through a slot (unpacked after the read)
    nbytes: int
    packed_segments: int = 0  # segments read from their trainers' pack regions (one descriptor each)
    #: (training rank, bytes this worker reads from its pack region): the trainer copies them every step
    packed_bytes: tuple[tuple[int, int], ...] = ()

    @property
    def nixl_descriptors(self) -> int:
        """Data descriptors posted a step (the peers' header reads not included)."""
        return self.nixl_direct_descriptors + self.nixl_staged_descriptors


class _Chain:
    """Consecutive descriptors of one list: counts those that stay separate after ``merge_pairs``."""

    __slots__ = ("count", "src", "src_end", "dst", "dst_end")

    def __init__(self) -> None:
        self.count = 0
        self.src = self.dst = None
        self.src_end = self.dst_end = -1

    def add(self, src: str, s: Span, dst: object, d_start: int, d_end: int) -> None:
        """A segment of ``s.runs`` runs; ``dst`` its local region, ``d_start``/``d_end`` its local extent
        (staged: the slot, always continuing)."""
        if not s.runs:
            return
        joins = src == self.src and s.first == self.src_end and dst == self.dst and d_start == self.dst_end
        self.count += s.runs - (1 if joins else 0)
        self.src, self.src_end, self.dst, self.dst_end = src, s.last_end, dst, d_end


class Counter:
    """Counts workers' steps from their plans; caches the training tensors' shapes and the boxes' spans.
    ``pack``: the trainers pack their strided boxes (the transport's default; ``WEIGHTSYNC_NIXL_PACK=0`` off);
    ``contiguous``: each process's tensors back to back in one registration (module docstring, rule 5)."""

    def __init__(self, planner: Planner, pack: bool = True, contiguous: bool = False):
        self.planner = planner
        self.pack = pack
        self.contiguous = contiguous
        self._offsets: dict[object, dict[str, int]] = {}  # contiguous: element offset of each tensor
        self._shapes: dict[tuple[int, str], tuple[int, ...]] = {}  # (training rank, its tensor) -> shape
        self._spans: dict[tuple, Span] = {}

    def _src_shape(self, rank: int, tensor: str, b: Bucket) -> tuple[int, ...]:
        """The shape of training rank ``rank``'s tensor ``tensor``, from the shards of a canonical tensor it
        holds (which the planner has built already): not the rank's whole layout, which for a Megatron rank
        of a 1T model takes ~0.1 s to build."""
        key = (rank, tensor)
        got = self._shapes.get(key)
        if got is None:
            src = self.planner.src
            for c in b.copies:  # every copy of the bucket shares its source rank
                k = (rank, c.src_tensor)
                if k in self._shapes:
                    continue
                for shard in src.shards(c.canonical):
                    if shard.piece.tensor == c.src_tensor and src.in_group(rank, shard.group):
                        self._shapes[k] = shard.shape
                        break
            got = self._shapes.get(key)
            if got is None:
                raise PlanError(f"bucket {b.index} of training rank {rank} reads tensor {tensor!r}, which no shard of "
                                f"{self.planner.src.describe()} on that rank holds: the plan and the layout disagree")
        return got

    def _span(self, shape: tuple[int, ...], box: Box) -> Span:
        key = (shape, box)
        got = self._spans.get(key)
        if got is None:
            if len(self._spans) > 1_000_000:
                self._spans.clear()
            got = self._spans[key] = span(shape, box)
        return got

    def _offset(self, key: object, tensors: Mapping, name: str) -> int:
        """Element offset of tensor ``name`` in its process's flat registration (``contiguous``): the
        tensors back to back in layout order, counted in bytes / 1 so dtypes may differ."""
        got = self._offsets.get(key)
        if got is None:
            got, at = {}, 0
            for n, t in tensors.items():
                got[n] = at
                at += math.prod(t.shape) * itemsize(t.dtype)
            self._offsets[key] = got
        return got[name]

    def _src_layout(self, rank: int):
        key = ("src-layout", rank)
        got = self._offsets.get(key)
        if got is None:
            got = self._offsets[key] = self.planner.src.layout(rank).tensors
        return got

    def worker(self, instance: int, rank: int, plans: Mapping[Pair, list[Bucket]]) -> WorkerCounts:
        """The counts of worker ``(instance, rank)`` whose plan is ``plans`` (its pairs only)."""
        dst = self.planner.dst_layout(rank).tensors
        pairs = sorted(p for p in plans if p[1:] == (instance, rank))  # one pair per peer training rank
        buckets = nsegs = nmsgs = direct = staged = transfers = staged_bytes = nbytes = npacked = 0
        packed_by: dict[int, int] = {}
        for pair in pairs:
            chain = _Chain()  # one descriptor list for every in-place read from this peer (nixl.py _program)
            inplace: list[tuple] = []  # (remote order, src, span, dst, start, end): sorted as nixl.py does
            for b in plans[pair]:
                if b.nbytes == 0:
                    continue
                buckets += 1
                nbytes += b.nbytes
                nmsgs += len(messages(b))
                batch = _Chain()  # a staged bucket is a list of its own
                at = 0
                for seg in segments(b):
                    nsegs += 1
                    shape = self._src_shape(pair[0], seg.src_tensor, b)
                    s = self._span(shape, seg.src_box)
                    src: object = seg.src_tensor
                    if self.pack and s.runs > 1:  # packed by the trainer: one run, a region of its own
                        src, s = ("packed", seg.src_tensor, seg.src_box), Span(1, 0, 1, 1)
                        npacked += 1
                        packed_by[pair[0]] = packed_by.get(pair[0], 0) + seg.nbytes
                    elif self.contiguous:  # one registration: byte offsets in the trainer's flat layout
                        isz = seg.nbytes // max(s.numel, 1)
                        base = self._offset(("src", pair[0]), self._src_layout(pair[0]), seg.src_tensor)
                        src, s = ("src", pair[0]), Span(s.runs, base + s.first * isz, base + s.last_end * isz, s.numel)
                    t = dst[seg.dst_tensor]
                    d = self._span(t.shape, seg.dst_box)
                    if t.dtype == seg.dtype and d.runs <= 1:  # nixl.py _in_place: contiguous, in the wire dtype
                        # nixl.py sorts these by remote address: a packed box (its own region) joins nothing
                        # wherever it goes; one registration per tensor: what joins is a tensor's consecutive
                        # boxes, which (tensor, offset) keeps together; contiguous: the flat offset
                        order = ((2, "", 0) if isinstance(src, tuple) and src[0] == "packed"
                                 else (1, "", s.first) if self.contiguous else (1, seg.src_tensor, s.first))
                        if self.contiguous:
                            isz = itemsize(t.dtype)
                            base = self._offset(("dst", rank), dst, seg.dst_tensor)
                            inplace.append((order, src, s, "dst", base + d.first * isz, base + (d.first + d.numel) * isz))
                        else:
                            inplace.append((order, src, s, seg.dst_tensor, d.first, d.first + d.numel))
                    else:
                        batch.add(src, s, "slot", at, at + seg.nbytes)
                        at += seg.nbytes
                if at:
                    staged += batch.count
                    staged_bytes += at
                    transfers += 1
            inplace.sort(key=lambda x: x[0])  # stable, as Python's sorted in nixl.py
            for _, src, s, where, start, end in inplace:
                chain.add(src, s, where, start, end)
            direct += chain.count
            transfers += -(-chain.count // POST_CHUNK)
        return WorkerCounts(instance, rank, len(pairs), buckets, nsegs, nmsgs, direct, staged, transfers,
                            staged_bytes, nbytes, npacked, tuple(sorted(packed_by.items())))


def count_workers(planner: Planner, plans: Mapping[Pair, list[Bucket]], pack: bool = True,
                  contiguous: bool = False) -> list[WorkerCounts]:
    """Every receiving worker's counts in ``plans`` (a job's or one rank's pairs); ``pack`` and
    ``contiguous`` as :class:`Counter`'s."""
    by_worker: dict[tuple[int, int], dict[Pair, list[Bucket]]] = {}
    for pair, bs in plans.items():
        by_worker.setdefault(pair[1:], {})[pair] = bs
    counter = Counter(planner, pack, contiguous)
    return [counter.worker(i, r, ps) for (i, r), ps in sorted(by_worker.items())]

