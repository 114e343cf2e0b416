"""The transfer planner: source layout x destination layout -> deterministic, balanced copies and buckets.

For one destination piece the planner intersects it with the source shards of the same canonical
tensor, cutting it into *cells* that each lie wholly inside a set of identical source copies (the
candidates). Each cell gets one sender, chosen by a stable hash of (destination, tensor, cell) among
the nearest candidates (same GPU, then same host, then any); a large cell with several candidates is
cut into stripes spread over them, so data-parallel replicas share the sending. Because the choice
depends only on that key, a sender and a receiver compute the same copies independently, each in
time proportional to its own pieces.

Copies are grouped per (sender, receiver) pair, sorted by destination tensor and box (so adjacent
boxes merge into one copy), split to fit the bucket budget and packed into buckets; each pair's
buckets hash to a digest both ends can compare.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass, field
from itertools import product
from typing import Iterable, Iterator

from weightsync.dtypes import DTYPE_SIZES
from weightsync.errors import PlanError
from weightsync.layout.box import Box, box_numel, fmt_box, intersect, split_dim, split_to_fit, translate
from weightsync.layout.layout import EngineLayout, Piece, Shard
from weightsync.plan.topology import Topology

DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_STRIPE_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy ``canon_box`` of ``canonical`` from a source rank's tensor to a destination rank's tensor."""

    canonical: str
    canon_box: Box
    src_rank: int
    src_tensor: str
    src_box: Box
    dst_instance: int
    dst_rank: int
    dst_tensor: str
    dst_box: Box
    #: the source tensor's dtype: what the full codec puts on the wire (the receiver converts, as a checkpoint
    #: load would); another codec may encode it otherwise (weightsync.codec: its frame says what it holds)
    dtype: str

    @property
    def numel(self) -> int:
        return box_numel(self.canon_box)

    @property
    def nbytes(self) -> int:
        return box_numel(self.canon_box) * DTYPE_SIZES[self.dtype]

    def key(self) -> str:
        return (
            f"{self.canonical}{fmt_box(self.canon_box)}|{self.src_rank}:{self.src_tensor}{fmt_box(self.src_box)}"
            f"|{self.dst_instance}.{self.dst_rank}:{self.dst_tensor}{fmt_box(self.dst_box)}|{self.dtype}"
        )


@dataclass(frozen=True, slots=True)
class Bucket:
    """Copies one sender ships to one receiver in one message (packed back to back, in order)."""

    src_rank: int
    dst_instance: int
    dst_rank: int
    index: int  # position among this pair's buckets
    copies: tuple[Copy, ...]
    # derived from ``copies`` once: transports read it for every bucket every step, and summing a 30B
    # bucket's copies each time cost tens of milliseconds a step
    nbytes: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", sum(c.nbytes for c in self.copies))

    @property
    def pair(self) -> tuple[int, int, int]:
        """(src rank, dst instance, dst rank): the :data:`Pair` this bucket travels between."""
        return (self.src_rank, self.dst_instance, self.dst_rank)

    def __hash__(self) -> int:
        # the header only: equal buckets have equal headers, and hashing every copy (a 30B bucket holds
        # hundreds) cost tens of milliseconds a step wherever buckets key a dict or a set
        return hash((self.src_rank, self.dst_instance, self.dst_rank, self.index, len(self.copies)))


Pair = tuple[int, int, int]  # (src rank, dst instance, dst rank)


def pair_hash(buckets: Iterable[Bucket]) -> str:
    """Digest of one pair's buckets: equal on both ends iff they planned the same bytes in the same order."""
    h = hashlib.blake2b(digest_size=16)
    for b in buckets:
        h.update(f"#{b.index}\n".encode())
        for c in b.copies:
            h.update(c.key().encode())
            h.update(b"\n")
    return h.hexdigest()


def combine_hashes(pair_hashes: dict[Pair, str]) -> str:
    """Job-level plan hash from every pair's hash (what a coordinator compares)."""
    h = hashlib.blake2b(digest_size=16)
    for pair in sorted(pair_hashes):
        h.update(f"{pair}={pair_hashes[pair]};".encode())
    return h.hexdigest()


class Planner:
    """Plans transfers from ``src`` (training) to ``instances`` copies of ``dst`` (inference).

    Call order (each end alone, no I/O; both ends compute the same buckets for a pair)::

        1. Planner(src, dst, instances, topology, bucket_bytes)    the two layouts (weightsync.engines)
        2. send_plan(rank) / recv_plan(instance, rank)              a rank's buckets per pair, once
        3. pair_hash(buckets) per pair                              posted; the job starts when both ends agree
        4. the codec stage encodes each bucket, the transport moves it (weightsync.codec, weightsync.transport)
    """

    def __init__(
        self,
        src: EngineLayout,
        dst: EngineLayout,
        instances: int = 1,
        topology: Topology | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        stripe_bytes: int = DEFAULT_STRIPE_BYTES,
        block_aligned: frozenset[str] = frozenset(),
    ):
        if src.spec.digest != dst.spec.digest:
            raise PlanError(f"source model {src.spec.name} and destination model {dst.spec.name} differ")
        if instances < 1:
            raise PlanError(f"instances must be at least 1, got {instances}")
        if bucket_bytes < 1:
            raise PlanError(f"bucket budget must be positive, got {bucket_bytes}")
        self.src, self.dst, self.instances = src, dst, instances
        self.spec = src.spec
        self.topology = topology or Topology.separated(src.world_size, dst.world_size, instances)
        self.bucket_bytes = bucket_bytes
        self.stripe_bytes = max(1, stripe_bytes)
        #: canonical tensors whose stripes and bucket slabs are cut on 128 x 128 blocks only (an FP8-served
        #: engine's FP8 weights: a block's scale is made from the whole block on one training rank, codec/fp8)
        self.block_aligned = frozenset(block_aligned)
        self._cell_cache: dict[tuple[str, Box], list[tuple[Box, list[tuple[Shard, int]]]]] = {}
        self._dst_layouts: dict = {}

    # -- cells and choices ----------------------------------------------------------------------
    def _cells(self, canonical: str, box: Box) -> list[tuple[Box, list[tuple[Shard, int]]]]:
        """Cut a destination box into cells, each wholly inside every candidate source copy it lists."""
        key = (canonical, box)
        got = self._cell_cache.get(key)
        if got is not None:
            return got
        hits = []  # (intersection, shard)
        for s in self.src.shards(canonical):
            inter = intersect(box, s.piece.canon_box)
            if inter is not None:
                hits.append((inter, s))
        distinct = {inter for inter, _ in hits}
        if _disjoint(distinct):
            cells = list(distinct)
        else:  # partially overlapping source boxes: refine to the grid of all their edges
            cells = _grid(box, distinct)
        out = []
        covered = 0
        for cell in sorted(cells):
            cands = [
                (s, r)
                for inter, s in hits
                if intersect(inter, cell) == cell
                for r in self.src.group_ranks(s.group)
            ]
            if cands:
                cands.sort(key=lambda sr: (sr[1], sr[0].piece.tensor))
                out.append((cell, cands))
                covered += box_numel(cell)
        if covered != box_numel(box):
            raise PlanError(
                f"{self.src.describe()} holds only {covered} of the {box_numel(box)} elements of "
                f"{canonical}{fmt_box(box)} that {self.dst.describe()} needs"
            )
        self._cell_cache[key] = out
        return out

    def _assign(
        self, instance: int, dst_rank: int, dst: Piece, dst_shape: tuple[int, ...], cell: Box,
        cands: list[tuple[Shard, int]],
    ) -> Iterator[tuple[Box, Shard, int]]:
        """Which source sends which part of a cell to one destination rank (a pure function).

        A large cell is striped over the candidates. A small one goes whole to the candidate picked
        by where it starts in the destination tensor (a contiguous range of the tensor per candidate,
        the ranges dealt to the candidates in turn from one destination rank to the next): the 128
        experts' halves that vLLM stacks in one ``w13_weight`` then come as a few long runs, one per
        source, that land in place, not as one pick per expert."""
        near = self.topology.nearest(instance, dst_rank, cands)
        n = len(near)
        if n == 1:
            s, r = near[0]
            yield cell, s, r
            return
        canonical = dst.canonical
        itemsize = DTYPE_SIZES[self.spec.by_name[canonical].dtype]
        nbytes = box_numel(cell) * itemsize
        stripes = min(n, nbytes // self.stripe_bytes)
        dim = next((d for d, (_, k) in enumerate(cell) if k >= 2), None)
        if stripes < 2 or dim is None:
            # the destinations of one tensor take turns over the candidates (exactly even), and a tensor's
            # own offset spreads the small tensors that all start at 0
            turn = instance * self.dst.world_size + dst_rank
            s, r = near[(zlib.crc32(dst.tensor.encode()) + turn + _share(cell, dst, dst_shape, n)) % n]
            yield cell, s, r
            return
        h = zlib.crc32(f"{instance}/{dst_rank}/{canonical}/{cell}".encode())
        aligned = canonical in self.block_aligned and len(cell) == 2
        for j, part in enumerate(_split_blocks(cell, dim, stripes) if aligned else split_dim(cell, dim, stripes)):
            s, r = near[(h + j) % n]
            yield part, s, r

    @staticmethod
    def _copy(part: Box, src: Piece, src_rank: int, instance: int, dst_rank: int, dst: Piece, dtype: str) -> Copy:
        return Copy(
            src.canonical,
            part,
            src_rank,
            src.tensor,
            translate(part, src.canon_box, src.local_box),
            instance,
            dst_rank,
            dst.tensor,
            translate(part, dst.canon_box, dst.local_box),
            dtype,
        )

    # -- per-rank copies ------------------------------------------------------------------------
    def dst_layout(self, rank: int):
        lay = self._dst_layouts.get(rank)
        if lay is None:
            lay = self._dst_layouts[rank] = self.dst.layout(rank)
        return lay

    def recv_copies(self, instance: int, rank: int) -> list[Copy]:
        """Every copy destination rank ``rank`` of instance ``instance`` receives."""
        self._check_dst(instance, rank)
        out = []
        layout = self.dst_layout(rank)
        for piece in layout.pieces():
            shape = layout.tensors[piece.tensor].shape
            for cell, cands in self._cells(piece.canonical, piece.canon_box):
                for part, s, r in self._assign(instance, rank, piece, shape, cell, cands):
                    out.append(self._copy(part, s.piece, r, instance, rank, piece, s.dtype))
        return out

    def send_copies(self, rank: int) -> list[Copy]:
        """Every copy training rank ``rank`` sends, to every destination of every instance."""
        if not 0 <= rank < self.src.world_size:
            raise PlanError(f"training rank {rank} outside world of {self.src.world_size}")
        out = []
        for tensor in self.src.layout(rank).tensors.values():
            for mine in tensor.pieces:
                self._send_piece(rank, mine, tensor.dtype, out)
        return out

    def _send_piece(self, rank: int, mine: Piece, dtype: str, out: list[Copy]) -> None:
        """Copies of one of this rank's pieces: every destination cell it was chosen to send."""
        c = mine.canonical
        for d in self.dst.shards(c):
            if intersect(d.piece.canon_box, mine.canon_box) is None:
                continue
            cells = [
                (cell, cands)
                for cell, cands in self._cells(c, d.piece.canon_box)
                if any(r == rank and s.piece == mine for s, r in cands)
            ]
            if not cells:
                continue
            for dst_rank in self.dst.group_ranks(d.group):
                for instance in range(self.instances):
                    for cell, cands in cells:
                        for part, s, r in self._assign(instance, dst_rank, d.piece, d.shape, cell, cands):
                            if r == rank and s.piece == mine:
                                out.append(self._copy(part, mine, rank, instance, dst_rank, d.piece, dtype))

    def _check_dst(self, instance: int, rank: int) -> None:
        if not 0 <= instance < self.instances:
            raise PlanError(f"instance {instance} outside 0..{self.instances - 1}")
        if not 0 <= rank < self.dst.world_size:
            raise PlanError(f"inference rank {rank} outside world of {self.dst.world_size}")

    # -- buckets --------------------------------------------------------------------------------
    def buckets(self, copies: Iterable[Copy]) -> dict[Pair, list[Bucket]]:
        """Group copies per (src, dst) pair in one deterministic order and pack them into bounded buckets."""
        pairs: dict[Pair, list[Copy]] = {}
        for c in copies:
            pairs.setdefault((c.src_rank, c.dst_instance, c.dst_rank), []).append(c)
        out = {}
        for pair in sorted(pairs):
            # destination order: copies into one tensor sit back to back, so adjacent boxes (stacked
            # experts, [gate; up] halves, row slabs) merge into single copies (transport.pack.segments)
            items = sorted(pairs[pair], key=lambda c: (c.dst_tensor, c.dst_box, c.src_tensor, c.src_box))
            out[pair] = self._pack(pair, items)
        return out

    def _pack(self, pair: Pair, copies: list[Copy]) -> list[Bucket]:
        budget = self.bucket_bytes
        buckets, cur, size = [], [], 0
        for c in copies:
            for part in self._fit(c, budget):
                if cur and size + part.nbytes > budget:
                    buckets.append(Bucket(*pair, len(buckets), tuple(cur)))
                    cur, size = [], 0
                cur.append(part)
                size += part.nbytes
        if cur:
            buckets.append(Bucket(*pair, len(buckets), tuple(cur)))
        return buckets

    def _fit(self, c: Copy, budget: int) -> list[Copy]:
        if c.nbytes <= budget:
            return [c]
        itemsize = DTYPE_SIZES[c.dtype]
        out = []
        aligned = c.canonical in self.block_aligned and len(c.canon_box) == 2
        for part in (_fit_blocks if aligned else split_to_fit)(c.canon_box, itemsize, budget):
            out.append(
                Copy(
                    c.canonical,
                    part,
                    c.src_rank,
                    c.src_tensor,
                    translate(part, c.canon_box, c.src_box),
                    c.dst_instance,
                    c.dst_rank,
                    c.dst_tensor,
                    translate(part, c.canon_box, c.dst_box),
                    c.dtype,
                )
            )
        return out

    def send_plan(self, rank: int) -> dict[Pair, list[Bucket]]:
        return self.buckets(self.send_copies(rank))

    def recv_plan(self, instance: int, rank: int) -> dict[Pair, list[Bucket]]:
        return self.buckets(self.recv_copies(instance, rank))


def _share(cell: Box, dst: Piece, dst_shape: tuple[int, ...], n: int) -> int:
    """Which of ``n`` equal contiguous ranges of the destination tensor (row-major) the cell starts in."""
    local = translate(cell, dst.canon_box, dst.local_box)
    flat, total = 0, 1
    for (start, _), size in zip(reversed(local), reversed(dst_shape)):
        flat += start * total
        total *= size
    return flat * n // total if total else 0


def _disjoint(boxes: set[Box]) -> bool:
    """Whether no two boxes overlap: a sweep along dim 0, comparing only boxes whose rows overlap."""
    active: list[Box] = []
    for b in sorted(boxes):
        start = b[0][0]
        active = [a for a in active if a[0][0] + a[0][1] > start]
        if any(intersect(a, b) is not None for a in active):
            return False
        active.append(b)
    return True


def _grid(box: Box, parts: set[Box]) -> list[Box]:
    """All cells of the grid cut by every edge of ``parts`` inside ``box``."""
    axes = []
    for d, (off, n) in enumerate(box):
        edges = {off, off + n}
        for p in parts:
            edges.update((p[d][0], p[d][0] + p[d][1]))
        e = sorted(x for x in edges if off <= x <= off + n)
        axes.append([(a, b - a) for a, b in zip(e, e[1:])])
    return [tuple(c) for c in product(*axes)]


BLOCK = 128  # the FP8 block edge (weightsync.quant.fp8.BLOCK; not imported: it would import torch)


def _split_blocks(box: Box, dim: int, parts: int) -> list[Box]:
    """:func:`split_dim` with every cut on a multiple of :data:`BLOCK` in canonical coordinates (near-equal slabs
    rounded up to the next block; fewer slabs where the box has fewer blocks)."""
    off, n = box[dim]
    out, lo = [], off
    for i in range(1, parts + 1):
        hi = off + n if i == parts else min(off + n, -(-(off + n * i // parts) // BLOCK) * BLOCK)
        if hi > lo:
            out.append(box[:dim] + ((lo, hi - lo),) + box[dim + 1:])
            lo = hi
    return out


def _fit_blocks(box: Box, itemsize: int, max_bytes: int) -> list[Box]:
    """:func:`split_to_fit` for a 2-d box whose slabs must hold whole blocks: rows in multiples of :data:`BLOCK`
    (at least one block row), then columns the same where one block row is still too big."""
    nbytes = box_numel(box) * itemsize
    if nbytes <= max_bytes:
        return [box]
    for dim, (off, n) in enumerate(box):
        if n > BLOCK:
            row = nbytes // n
            per = max(BLOCK, max_bytes // row // BLOCK * BLOCK)
            slabs = [box[:dim] + ((o, min(per, off + n - o)),) + box[dim + 1:] for o in range(off, off + n, per)]
            if row * per > max_bytes:  # one block row is still too big: cut its columns on blocks too
                return [s for slab in slabs for s in _fit_blocks(slab, itemsize, max_bytes)]
            return slabs
    return [box]

