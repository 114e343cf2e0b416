"""Where ranks live (host, GPU), so the planner can prefer near senders and the simulator knows links."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

T = TypeVar("T")


#: the place of a rank a participant was not told (weightsync.meta.view.concerning): on no host its plan
#: compares with, so never on the same GPU or host as any rank it was told
ELSEWHERE = (-1, -1)


@dataclass(frozen=True)
class Placement:
    """Where each rank of a job said it runs: (host index, GPU index on that host), from registration.

    ``infer`` is indexed by the flat inference rank ``instance * infer_world + rank``. A participant's
    placement may leave out (:data:`ELSEWHERE`) the ranks its plan never compares; ``per_host`` then
    keeps the job's GPUs per host (0: from the places given)."""

    train: tuple[tuple[int, int], ...]
    infer: tuple[tuple[int, int], ...]
    per_host: int = 0

    @property
    def gpus_per_host(self) -> int:
        return self.per_host or 1 + max(g for _, g in self.train + self.infer)

    def describe(self) -> str:
        known = [w for w in self.train + self.infer if w != ELSEWHERE]
        return f"{len({h for h, _ in known})} host(s), {len(set(known))} GPU(s)" + (
            f" ({len(self.train) + len(self.infer) - len(known)} ranks elsewhere)"
            if len(known) < len(self.train) + len(self.infer) else "")


@dataclass(frozen=True)
class Topology:
    """Global GPU index of every training rank and every (instance, inference rank).

    GPUs are numbered host by host, ``gpus_per_host`` to a host. With a :class:`Placement` (what the
    ranks registered) the GPUs are where the ranks are; without one, the arithmetic rules below.
    """

    train_world: int
    infer_world: int
    instances: int
    gpus_per_host: int = 8
    colocate: bool = False
    placement: Placement | None = None

    @classmethod
    def placed(cls, placement: Placement, infer_world: int, instances: int, colocate: bool) -> "Topology":
        """Where the ranks registered: GPUs numbered host by host, as many to a host as the most used."""
        return cls(len(placement.train), infer_world, instances, placement.gpus_per_host, colocate, placement)

    @classmethod
    def separated(cls, train_world: int, infer_world: int, instances: int = 1, gpus_per_host: int = 8) -> "Topology":
        """Training on GPUs 0..T-1, inference instances on the GPUs after them."""
        return cls(train_world, infer_world, instances, gpus_per_host, False)

    @classmethod
    def colocated(cls, train_world: int, infer_world: int, instances: int = 1, gpus_per_host: int = 8) -> "Topology":
        """Inference ranks on the training GPUs, instance after instance, wrapping around."""
        return cls(train_world, infer_world, instances, gpus_per_host, True)

    def train_gpu(self, rank: int) -> int:
        if self.placement is not None:
            host, gpu = self.placement.train[rank]
            return host * self.gpus_per_host + gpu
        return rank

    def infer_gpu(self, instance: int, rank: int) -> int:
        flat = instance * self.infer_world + rank
        if self.placement is not None:
            host, gpu = self.placement.infer[flat]
            return host * self.gpus_per_host + gpu
        return flat % self.train_world if self.colocate else self.train_world + flat

    def host(self, gpu: int) -> int:
        return gpu // self.gpus_per_host

    def nearest(self, instance: int, rank: int, candidates: Sequence[tuple[T, int]]) -> Sequence[tuple[T, int]]:
        """The candidates (item, training rank) on the same GPU, else the same host, else all."""
        gpu = self.infer_gpu(instance, rank)
        same_gpu = [c for c in candidates if self.train_gpu(c[1]) == gpu]
        if same_gpu:
            return same_gpu
        host = self.host(gpu)
        same_host = [c for c in candidates if self.host(self.train_gpu(c[1])) == host]
        return same_host or candidates
