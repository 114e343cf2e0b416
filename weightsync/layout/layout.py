"""Pieces, layouts and the engine-layout interface.

A *piece* says "this box of local tensor X holds that box of canonical tensor Y". A rank's
*layout* is its local tensors with their pieces. Every engine convention (TP sharding, fused qkv,
stacked experts, vocab padding, replicated KV heads, PP renumbering) is only a different set of
pieces, so nothing downstream of a layout knows about engines.

Engines describe placement per canonical tensor (:meth:`EngineLayout.shards`): each *shard* is a
piece plus the *group* of ranks that hold an identical copy of it. From that one function come both
directions a planner needs: a rank's layout, and the holders of a canonical tensor, each in time
proportional to the answer rather than to the world size.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Iterable, Iterator, Mapping, Sequence

from weightsync.dtypes import DTYPE_SIZES
from weightsync.errors import ConfigError, LayoutMismatch
from weightsync.layout.box import Box, box_numel
from weightsync.spec.model import ModelSpec

if TYPE_CHECKING:  # pragma: no cover
    from weightsync.engines.config import EngineConfig


@dataclass(frozen=True, slots=True)
class Piece:
    """``local_box`` of local tensor ``tensor`` holds ``canon_box`` of canonical tensor ``canonical``."""

    tensor: str
    local_box: Box
    canonical: str
    canon_box: Box

    @property
    def numel(self) -> int:
        return box_numel(self.canon_box)


@dataclass(frozen=True, slots=True)
class Group:
    """A set of ranks holding identical data: fixed coordinates of one of the engine's meshes."""

    mesh: str
    coords: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class Shard:
    """A piece together with where it lives: every rank of ``group`` holds it."""

    group: Group
    piece: Piece
    shape: tuple[int, ...]  # full shape of the local tensor
    dtype: str


@dataclass
class TensorLayout:
    """A local tensor of one rank: engine name, shape, dtype and the pieces it holds."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: list[Piece] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Layout:
    """Every local tensor of one rank, in the engine's own order."""

    engine: str
    rank: int
    tensors: dict[str, TensorLayout]

    def pieces(self) -> Iterator[Piece]:
        for t in self.tensors.values():
            yield from t.pieces

    def bytes_held(self, spec: ModelSpec) -> int:
        """Canonical bytes this rank holds (padding excluded, replicas counted)."""
        return sum(p.numel * DTYPE_SIZES[spec.by_name[p.canonical].dtype] for p in self.pieces())


def layout_digest(layout: Layout) -> str:
    """A short fingerprint of a rank's local tensors (names, shapes, dtypes, in order).

    Two participants holding the same digest for a rank hold tensors the same plan fits; a job
    compares the digest each participant registered with the one its plan's layout gives.
    """
    h = hashlib.blake2b(digest_size=8)
    for name, t in layout.tensors.items():
        h.update(f"{name}:{t.shape}:{t.dtype};".encode())
    return h.hexdigest()


class Mesh:
    """Named parallel dimensions laid over ranks, fastest-varying first (Megatron's RankGenerator order)."""

    def __init__(self, name: str, dims: Sequence[tuple[str, int]]):
        self.name = name
        self.dims = tuple(dims)
        self.size = math.prod(n for _, n in self.dims)
        self.sizes = dict(self.dims)

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for dim, n in self.dims:
            out[dim] = rank % n
            rank //= n
        return out

    def rank(self, coords: Mapping[str, int]) -> int:
        r, stride = 0, 1
        for dim, n in self.dims:
            r += coords.get(dim, 0) * stride
            stride *= n
        return r

    def group(self, **coords: int) -> Group:
        return Group(self.name, tuple((d, coords[d]) for d, _ in self.dims if d in coords))

    def ranks(self, group: Group) -> tuple[int, ...]:
        """All ranks whose coordinates match the group's fixed ones."""
        fixed = dict(group.coords)
        out = [0]
        stride = 1
        for dim, n in self.dims:
            if dim in fixed:
                out = [r + fixed[dim] * stride for r in out]
            else:
                out = [r + i * stride for i in range(n) for r in out]
            stride *= n
        return tuple(sorted(out))

    def contains(self, group: Group, rank: int) -> bool:
        c = self.coords(rank)
        return all(c[d] == v for d, v in group.coords)


class EngineLayout(ABC):
    """An engine's layout rules for one model and one parallel config (pure, no live objects).

    Subclasses implement :meth:`shards` (every copy of a canonical tensor's regions) and
    :meth:`canonical_names` (which canonical tensors a rank touches); the rest is derived. Each
    holds its :class:`~weightsync.engines.config.EngineConfig` as ``config`` (set before calling
    ``__init__`` here), whose text :meth:`describe` gives and ``make_layout`` reads back.
    """

    engine: str = "?"
    keys: ClassVar[tuple[str, ...]] = ()  # the config's keys, in canonical order
    config: EngineConfig

    def __init__(self, spec: ModelSpec, meshes: Sequence[Mesh]):
        self.spec = spec
        self.meshes = {m.name: m for m in meshes}
        sizes = {m.size for m in meshes}
        if len(sizes) != 1:
            raise ConfigError(f"{self.engine}: meshes disagree on world size: {sizes}")
        self.world_size = sizes.pop()
        self._shard_cache: dict[str, tuple[Shard, ...]] = {}

    # -- to implement -------------------------------------------------------------------------
    @abstractmethod
    def _shards(self, canonical: str) -> Iterable[Shard]:
        """Every shard of one canonical tensor, over all ranks."""

    @abstractmethod
    def canonical_names(self, rank: int) -> Iterable[str]:
        """Canonical tensors of which ``rank`` holds some region (a superset is allowed)."""

    # -- derived ------------------------------------------------------------------------------
    def shards(self, canonical: str) -> tuple[Shard, ...]:
        got = self._shard_cache.get(canonical)
        if got is None:
            got = self._shard_cache[canonical] = tuple(self._shards(canonical))
        return got

    def group_ranks(self, group: Group) -> tuple[int, ...]:
        return self.meshes[group.mesh].ranks(group)

    def in_group(self, rank: int, group: Group) -> bool:
        return self.meshes[group.mesh].contains(group, rank)

    def layout(self, rank: int) -> Layout:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"{self.engine}: rank {rank} outside world of {self.world_size}")
        tensors: dict[str, TensorLayout] = {}
        for name in self.canonical_names(rank):
            for s in self.shards(name):
                if not self.in_group(rank, s.group):
                    continue
                t = tensors.get(s.piece.tensor)
                if t is None:
                    t = tensors[s.piece.tensor] = TensorLayout(s.piece.tensor, s.shape, s.dtype)
                t.pieces.append(s.piece)
        return Layout(self.engine, rank, tensors)

    def describe(self) -> str:
        """``ENGINE:k=v,...`` with every key that differs from its default: ``make_layout`` rebuilds this layout from it."""
        return self.config.describe()


def check_live(
    layout: Layout,
    live: Mapping[str, tuple[tuple[int, ...], str]],
    where: str = "",
    ignore: Sequence[str] = (),
) -> None:
    """Compare a derived layout with live tensors ``{name: (shape, dtype)}``; raise listing every difference.

    Live tensors whose names end with one of ``ignore`` (parameters an engine derives from others
    after loading, such as vLLM's MLA ``W_UK_T``) are not compared.
    """
    problems = []
    at = f" on {where}" if where else f" on {layout.engine} rank {layout.rank}"
    for name, t in layout.tensors.items():
        if name not in live:
            problems.append(f"missing tensor {name} (expected shape {list(t.shape)}, {t.dtype})")
            continue
        shape, dtype = live[name]
        if tuple(shape) != t.shape:
            problems.append(f"tensor {name}: live shape {list(shape)}, derived {list(t.shape)}")
        if dtype != t.dtype:
            problems.append(f"tensor {name}: live dtype {dtype}, derived {t.dtype}")
    for name in live:
        if name.endswith(tuple(ignore)):
            continue
        if name not in layout.tensors and math.prod(live[name][0]):  # empty shards (FSDP2) hold nothing
            problems.append(f"unexpected tensor {name} (shape {list(live[name][0])}) not in the derived layout")
    if problems:
        raise LayoutMismatch(f"layout mismatch{at}:\n  " + "\n  ".join(problems))

