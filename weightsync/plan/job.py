"""The job's shape: the plan-level facts every participant agrees on before anything is planned.

:class:`JobShape` is what both ends derive from the registrations (:mod:`weightsync.runtime.job`
cross-checks them) and plan from; :class:`JobRanks` numbers the job's ranks in one process group.
Both sit below the transports, which read them and never the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.engines import make_layout
from weightsync.layout.layout import EngineLayout
from weightsync.plan.planner import Pair, Planner
from weightsync.plan.topology import Placement, Topology
from weightsync.spec.model import ModelSpec


def block_aligned(spec: ModelSpec, dst: EngineLayout) -> frozenset[str]:
    """The canonical tensors a plan must cut on 128 x 128 blocks only: an engine declared ``quant=fp8`` holds them in
    block FP8, and the fp8 codec makes each block's scale on one training rank (weightsync.codec.fp8)."""
    if not getattr(dst.config, "quant", 0):
        return frozenset()
    from weightsync.quant.config import BlockFP8, fp8_tensors  # lazily: it imports torch

    return frozenset(f.weight.name for f in fp8_tensors(spec, BlockFP8()))


@dataclass(frozen=True)
class JobShape:
    """What both sides must agree on to compute the same plan."""

    train: str  # training engine layout, e.g. "megatron:tp=2,pp=2"
    infer: str  # inference engine layout, e.g. "vllm:tp=2"
    train_world: int
    infer_world: int
    instances: int
    colocate: bool
    bucket_bytes: int
    transport: str = "p2p"
    mode: str = "sync"
    peer_copies: bool = True  # co-located: workers read other GPUs' trainers directly (every participant can)
    #: where the ranks registered (hosts, GPUs); None when some rank has no GPU and all are on one host
    #: (CPU jobs): then the arithmetic rules of :class:`Topology` place them
    placement: Placement | None = None
    #: instances may join, leave and die while the job runs (the transport's sender does not depend on
    #: them): the trainers plan one instance slot, ``instances`` is one past the highest id registered,
    #: and the topology is the arithmetic one, so no joiner changes anybody else's plan
    elastic: bool = False

    def topology(self) -> Topology:
        if self.placement is not None:
            return Topology.placed(self.placement, self.infer_world, self.instances, self.colocate)
        make = Topology.colocated if self.colocate else Topology.separated
        return make(self.train_world, self.infer_world, self.instances)

    def planner(self, spec: ModelSpec, src: EngineLayout | None = None, dst: EngineLayout | None = None,
                instances: int | None = None) -> Planner:
        """The job's planner (``instances``: plan only that many instance slots, as elastic trainers do:
        an instance's plan does not depend on how many others there are)."""
        src = src or make_layout(spec, self.train)
        dst = dst or make_layout(spec, self.infer)
        n = self.instances if instances is None else instances
        if n == self.instances:
            topology = self.topology()
        else:  # the arithmetic rules (a placement lists exactly the registered instances)
            make = Topology.colocated if self.colocate else Topology.separated
            topology = make(self.train_world, self.infer_world, n)
        return Planner(src, dst, n, topology, bucket_bytes=self.bucket_bytes, block_aligned=block_aligned(spec, dst))


@dataclass(frozen=True)
class JobRanks:
    """Group ranks of a job: training rank r -> r; inference (instance i, rank j) -> T + i*I + j."""

    train_world: int
    infer_world: int
    instances: int = 1

    @property
    def world_size(self) -> int:
        return self.train_world + self.instances * self.infer_world

    def train(self, rank: int) -> int:
        return rank

    def infer(self, instance: int, rank: int) -> int:
        return self.train_world + instance * self.infer_world + rank

    def sender(self, pair: Pair) -> int:
        return self.train(pair[0])

    def receiver(self, pair: Pair) -> int:
        return self.infer(pair[1], pair[2])
