"""Where ranks live (host, GPU), so the planner can prefer near senders and the simulator knows links."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Topology:
    """Global GPU index of every training rank and every (instance, inference rank).

    GPUs are numbered host by host, ``gpus_per_host`` to a host.
    """

    train_world: int
    infer_world: int
    instances: int
    gpus_per_host: int = 8
    colocate: bool = False

    @classmethod
    def separated(cls, train_world: int, infer_world: int, instances: int = 1, gpus_per_host: int = 8) -> "Topology":
        """Training on GPUs 0..T-1, inference instances on the GPUs after them."""
        return cls(train_world, infer_world, instances, gpus_per_host, False)

    @classmethod
    def colocated(cls, train_world: int, infer_world: int, instances: int = 1, gpus_per_host: int = 8) -> "Topology":
        """Inference ranks on the training GPUs, instance after instance, wrapping around."""
        return cls(train_world, infer_world, instances, gpus_per_host, True)

    def train_gpu(self, rank: int) -> int:
        return rank

    def infer_gpu(self, instance: int, rank: int) -> int:
        flat = instance * self.infer_world + rank
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
