"""The checkpoint plan: which training rank writes which canonical tensor, and where every byte comes from.

Saving a checkpoint is a transfer like any other, from the training layout to a *checkpoint layout*
(:class:`CheckpointLayout`) over the same ranks in which every canonical tensor is held whole by one
*owner*. The :class:`~weightsync.plan.planner.Planner` then picks, for every element, exactly one
source copy (the owner's own when it holds one: the topology puts each writer on its training rank's
GPU), so nothing is sent twice and replicas share the sending. Each owner writes its tensors into
its own shard files; a file's data section is cut into *windows* of at most ``chunk_bytes``, each
the next contiguous run of rows of one or more tensors, assembled from at most one message per
source rank. The plan is a pure function of the training layout and the options, so every rank
computes the same one and they meet in the same order (:mod:`weightsync.checkpoint.save`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Mapping

from weightsync.checkpoint.format import FileTensor, file_name, header, lay_out
from weightsync.dtypes import itemsize
from weightsync.errors import ConfigError, PlanError
from weightsync.layout.box import Box, box_numel, full_box, intersect, split_to_fit, translate
from weightsync.layout.layout import EngineLayout, Mesh, Piece, Shard
from weightsync.plan.planner import Copy, Planner
from weightsync.plan.topology import Topology

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_SHARD_BYTES = 5 << 30


class CheckpointLayout(EngineLayout):
    """The destination of a save: canonical tensor ``t`` whole, in the canonical dtype, on rank ``owners[t]``."""

    engine = "checkpoint"

    def __init__(self, train: EngineLayout, owners: Mapping[str, int]):
        self.mesh = Mesh("checkpoint", [("rank", train.world_size)])
        super().__init__(train.spec, [self.mesh])
        self.owners = dict(owners)
        self._by_rank: dict[int, list[str]] = {}
        for name, r in self.owners.items():
            self._by_rank.setdefault(r, []).append(name)

    def _shards(self, canonical: str) -> Iterable[Shard]:
        t = self.spec.tensor(canonical)
        box = full_box(t.shape)
        group = self.mesh.group(rank=self.owners[canonical])
        yield Shard(group, Piece(canonical, box, canonical, box), t.shape, t.dtype)

    def canonical_names(self, rank: int) -> Iterable[str]:
        return self._by_rank.get(rank, ())

    def describe(self) -> str:
        return f"checkpoint:ranks={self.world_size}"


def choose_owners(train: EngineLayout) -> dict[str, int]:
    """An owner per canonical tensor: a rank holding the most of it, among those the least loaded so far.

    Largest tensors first, so the byte loads come out even; ties go to the lowest rank. Holding the
    most of it keeps the bytes that cross ranks few (a whole-tensor holder sends nothing).
    """
    spec = train.spec
    load = [0] * train.world_size
    owners: dict[str, int] = {}
    order = sorted(range(len(spec.tensors)), key=lambda i: (-spec.tensors[i].nbytes, i))
    for i in order:
        t = spec.tensors[i]
        held: dict[int, int] = {}
        for s in train.shards(t.name):
            for r in train.group_ranks(s.group):
                held[r] = held.get(r, 0) + s.piece.numel
        if not held:
            raise PlanError(f"{train.describe()} holds no part of {t.name} {list(t.shape)}")
        r = min(held, key=lambda r: (-held[r], load[r], r))
        owners[t.name] = r
        load[r] += t.nbytes
    return owners


@dataclass(frozen=True, slots=True)
class ShardFile:
    """One safetensors file: its name, the rank that writes it, its tensors and its header bytes."""

    name: str
    owner: int
    tensors: tuple[FileTensor, ...]
    header: bytes

    @property
    def data_bytes(self) -> int:
        return self.tensors[-1].end if self.tensors else 0


@dataclass(frozen=True, slots=True)
class Slab:
    """Rows ``box`` of canonical tensor ``canonical`` (contiguous in it), at ``offset`` bytes into a window."""

    canonical: str
    box: Box
    dtype: str
    offset: int


@dataclass(frozen=True, slots=True)
class Part:
    """``canon_box`` (inside slab ``slab`` of the window) read from ``src_box`` of the source's local ``src_tensor``."""

    slab: int
    canon_box: Box
    src_tensor: str
    src_box: Box
    nbytes: int  # in the canonical dtype: what travels


@dataclass(frozen=True, slots=True)
class Source:
    """What one rank contributes to a window: one message of ``nbytes`` (or local copies, at the owner)."""

    rank: int
    parts: tuple[Part, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class Window:
    """Bytes ``[start, start + nbytes)`` of file ``file``'s data section, assembled by its owner."""

    owner: int
    file: int
    start: int
    nbytes: int
    slabs: tuple[Slab, ...]
    sources: tuple[Source, ...]


@dataclass(frozen=True)
class CheckpointPlan:
    """Files and windows of one save, in the one global order every rank follows."""

    train: str  # the training layout's description
    owners: Mapping[str, int]
    files: tuple[ShardFile, ...]
    windows: tuple[Window, ...]
    chunk_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)

    @property
    def bound_bytes(self) -> int:
        """Most buffer bytes a rank holds at once: a window being assembled plus one message into it."""
        return 2 * max((w.nbytes for w in self.windows), default=0)

    def weight_map(self) -> dict[str, str]:
        return {t.name: f.name for f in self.files for t in f.tensors}

    @property
    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{self.train}|{self.chunk_bytes}|{len(self.windows)}".encode())
        for f in self.files:
            h.update(f.name.encode() + f.header)
        return h.hexdigest()


def make_plan(train: EngineLayout, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
              shard_bytes: int = DEFAULT_SHARD_BYTES) -> CheckpointPlan:
    """The plan of saving ``train``'s canonical tensors (pure: every rank computes the same)."""
    if chunk_bytes < 8:
        raise ConfigError(f"checkpoint: chunk_bytes={chunk_bytes} must be at least 8 (one element of any dtype)")
    if shard_bytes < 1:
        raise ConfigError(f"checkpoint: shard_bytes={shard_bytes} must be positive")
    spec = train.spec
    owners = choose_owners(train)
    dst = CheckpointLayout(train, owners)
    planner = Planner(train, dst, instances=1, topology=Topology.colocated(train.world_size, train.world_size, 1))
    files = _files(spec, owners, train.world_size, shard_bytes)
    per_owner: dict[int, list[Window]] = {}
    copies: dict[int, dict[str, list[Copy]]] = {}
    for i, f in enumerate(files):
        if f.owner not in copies:
            by_name: dict[str, list[Copy]] = {}
            for c in planner.recv_copies(0, f.owner):
                by_name.setdefault(c.canonical, []).append(c)
            copies[f.owner] = by_name
        per_owner.setdefault(f.owner, []).extend(_windows(i, f, copies[f.owner], chunk_bytes))
    # round robin over the owners, so that owners assemble their windows side by side
    windows: list[Window] = []
    queues = [per_owner[r] for r in sorted(per_owner)]
    for k in range(max((len(q) for q in queues), default=0)):
        windows.extend(q[k] for q in queues if k < len(q))
    return CheckpointPlan(train.describe(), owners, files, tuple(windows), chunk_bytes)


def _files(spec, owners: Mapping[str, int], world: int, shard_bytes: int) -> tuple[ShardFile, ...]:
    """Each owner's tensors, in the spec's order, cut into files of at most ``shard_bytes`` (a larger
    tensor alone in one); numbered owner by owner."""
    groups: list[tuple[int, list]] = []
    for r in range(world):
        mine = [t for t in spec.tensors if owners[t.name] == r]
        cur: list = []
        size = 0
        for t in mine:
            if cur and size + t.nbytes > shard_bytes:
                groups.append((r, cur))
                cur, size = [], 0
            cur.append(t)
            size += t.nbytes
        if cur:
            groups.append((r, cur))
    out = []
    for i, (r, ts) in enumerate(groups):
        laid = lay_out([(t.name, t.dtype, tuple(t.shape)) for t in ts])
        out.append(ShardFile(file_name(i, len(groups)), r, laid, header(laid)))
    return tuple(out)


def _linear_offset(box: Box, shape: tuple[int, ...]) -> int:
    off = 0
    for (o, _), n in zip(box, shape):
        off = off * n + o
    return off


def _windows(index: int, f: ShardFile, copies: Mapping[str, list[Copy]], chunk: int) -> list[Window]:
    out: list[Window] = []
    slabs: list[Slab] = []
    size = start = pos = 0

    def flush() -> None:
        out.append(_window(f.owner, index, start, size, tuple(slabs), copies))

    for ft in f.tensors:
        isz = itemsize(ft.dtype)
        if ft.end == ft.begin:
            continue
        for box in split_to_fit(full_box(ft.shape), isz, chunk):
            nb = box_numel(box) * isz
            if slabs and size + nb > chunk:
                flush()
                slabs, size, start = [], 0, pos
            if ft.begin + _linear_offset(box, ft.shape) * isz != pos:  # split_to_fit of a whole box is row-major
                raise PlanError(f"checkpoint: slab {box} of {ft.name} is not the next run of the file")
            slabs.append(Slab(ft.name, box, ft.dtype, size))
            size += nb
            pos += nb
    if slabs:
        flush()
    return out


def _window(owner: int, file: int, start: int, nbytes: int, slabs: tuple[Slab, ...],
            copies: Mapping[str, list[Copy]]) -> Window:
    by_src: dict[int, list[Part]] = {}
    for i, slab in enumerate(slabs):
        isz = itemsize(slab.dtype)
        covered = 0
        for c in copies.get(slab.canonical, ()):
            part = intersect(c.canon_box, slab.box)
            if part is None:
                continue
            n = box_numel(part)
            covered += n
            by_src.setdefault(c.src_rank, []).append(
                Part(i, part, c.src_tensor, translate(part, c.canon_box, c.src_box), n * isz))
        if covered != box_numel(slab.box):
            raise PlanError(f"checkpoint: {covered} of the {box_numel(slab.box)} elements of {slab.canonical} "
                            f"rows {slab.box} have a source")
    sources = tuple(Source(r, tuple(ps), sum(p.nbytes for p in ps)) for r, ps in sorted(by_src.items()))
    return Window(owner, file, start, nbytes, slabs, sources)


__all__ = ["CheckpointLayout", "CheckpointPlan", "ShardFile", "Window", "Source", "Part", "Slab", "choose_owners",
           "make_plan", "DEFAULT_CHUNK_BYTES", "DEFAULT_SHARD_BYTES"]
