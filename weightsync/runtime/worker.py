"""The worker reader: what runs on every inference worker (GPU) of an instance.

The instance's control process (:class:`~weightsync.runtime.session.InstanceSession`, then
:class:`~weightsync.runtime.reader.WeightReader`) calls these functions on every worker at once through
:meth:`InferenceInstance.call`, in this order::

    probe -> plan -> connect -> (receive | pull)* -> disconnect

Each takes the worker's :class:`WorkerContext` first and returns a typed record; a worker keeps its
state between calls in ``ctx.reader`` (a :class:`WorkerReader`: plan, receiver, staged copy), built
once and reused every step. Nothing here asks which transport it holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weightsync.integrity.check import Checked, IntegrityCheck, verify_worker
from weightsync.plan.planner import Bucket, Pair
from weightsync.runtime.instance import WorkerContext
from weightsync.runtime.job import JobShape, hashes_of
from weightsync.transport.base import (
    Buffers,
    MetaLink,
    Receiver,
    ReceiverContext,
    StepStats,
    TransportOptions,
    make_receiver,
)


#: how much longer than the transport's own timeout a call on the workers may take: a worker whose peer
#: died raises its own error (naming peer and bucket) at ``timeout_s``, and a worker that itself stalls
#: is given up on this little later -- never twice the timeout
CALL_MARGIN_S = 2.0


def call_timeout(timeout_s: float) -> float:
    return timeout_s + CALL_MARGIN_S


@dataclass(frozen=True)
class WorkerProbe:
    """What a worker says of itself before registering."""

    reaches_peers: bool  # CUDA peer access to every other GPU it sees (always on CPU)
    gpu: str | None  # its GPU's UUID, None on CPU


@dataclass(frozen=True)
class WorkerPlan:
    hashes: dict[Pair, str]  # the pair hashes of its recv plan
    buffers: Buffers  # the memory its transport will keep


@dataclass(frozen=True)
class WorkerReport:
    """One worker's part of one update (or async pull)."""

    rank: int
    steps: frozenset[int]  # the steps its bytes came from (one, unless an async pull straddled two)
    stats: StepStats

    @property
    def bytes(self) -> int:
        return self.stats.bytes

    @property
    def seconds(self) -> float:
        return self.stats.seconds


@dataclass
class WorkerReader:
    """The state a worker keeps between calls (``ctx.reader``)."""

    instance: int
    shape: JobShape
    plans: Mapping[Pair, list[Bucket]]
    receiver: Receiver
    context: ReceiverContext
    stage: dict[str, torch.Tensor] | None = None  # staged readers: the copy a step lands in

    def targets(self, ctx: WorkerContext, staged: bool) -> Mapping[str, torch.Tensor]:
        """Where a step lands: the live tensors, or (staged) a copy allocated once."""
        if not staged:
            return ctx.tensors
        if self.stage is None:
            self.stage = {n: torch.empty_like(t) for n, t in ctx.tensors.items()}
        return self.stage

    def commit(self, ctx: WorkerContext) -> None:
        """Copy exactly the planned regions of a complete staged step into the live tensors (padding
        stays untouched)."""
        from weightsync.layout.box import slices

        for bs in self.plans.values():
            for b in bs:
                for c in b.copies:
                    box = slices(c.dst_box)
                    ctx.tensors[c.dst_tensor][box].copy_(self.stage[c.dst_tensor][box])


def probe(ctx: WorkerContext, peers: bool) -> WorkerProbe:
    """``peers``: whether to find out if this worker reads every other GPU it sees (co-located jobs);
    a worker that sees only its own GPU cannot reach the others' memory at all."""
    from weightsync.runtime.device import device_uuid

    reach = True
    if peers and ctx.device.type == "cuda":
        mine, n = _gpu_index(ctx), torch.cuda.device_count()
        reach = n > 1 and all(torch.cuda.can_device_access_peer(mine, d) for d in range(n) if d != mine)
    return WorkerProbe(reach, device_uuid(ctx.device))


def _gpu_index(ctx: WorkerContext) -> int:
    return ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()


def plan(ctx: WorkerContext, shape: JobShape, model_config: dict, instance: int, push: bool,
         options: TransportOptions) -> WorkerPlan:
    """Plan this worker's receives and keep the plan; return its pair hashes and the memory its
    transport will keep. ``push``: co-located, this instance's workers write their own GPU's trainers'
    pieces into each other (:meth:`ColocatedRanks.pusher`)."""
    from weightsync.spec.model import spec_from_config

    planner = shape.planner(spec_from_config(model_config))
    plans = planner.recv_plan(instance, ctx.rank)
    receiver = make_receiver(options)
    context = ReceiverContext(None, shape, instance, ctx.rank, planner, plans, ctx.tensors, ctx.device, push)
    buffers = receiver.memory(context)
    ctx.reader = WorkerReader(instance, shape, plans, receiver, context)
    return WorkerPlan(hashes_of(plans), buffers)


def connect(ctx: WorkerContext, link: MetaLink) -> None:
    """Join the transport (groups, opened memory): once the plan is proven."""
    r = _reader(ctx)
    r.context.link = link
    r.receiver.connect(r.context)


def receive(ctx: WorkerContext, step: int, staged: bool = False, check: IntegrityCheck | None = None) -> WorkerReport:
    """Receive one step into the live tensors, or (staged) into a copy committed only once complete.
    ``check`` (a checked step, :mod:`weightsync.integrity`): the reader then runs :func:`verify` on every
    worker once all returned, and a staged copy is committed (:func:`commit`) only once every worker's
    copy checked whole."""
    r = _reader(ctx)
    with torch.no_grad():
        stats = r.receiver.receive(step, r.targets(ctx, staged))
        if staged and check is None:  # every byte arrived
            r.commit(ctx)
    return WorkerReport(ctx.rank, frozenset({step}), stats)


def verify(ctx: WorkerContext, step: int, check: IntegrityCheck, staged: bool = False) -> Checked:
    """Check what landed in step ``step`` (the live tensors, or the staged copy) against what the training
    ranks sent (raises :class:`~weightsync.errors.IntegrityError`); run once every worker's receive
    returned (co-located workers write into each other)."""
    r = _reader(ctx)
    with torch.no_grad():
        return verify_worker(r.context, step, r.plans, r.stage if staged else ctx.tensors, check)


def commit(ctx: WorkerContext) -> None:
    """Commit a staged step whose every worker's copy checked whole (see :func:`receive`)."""
    with torch.no_grad():
        _reader(ctx).commit(ctx)


def pull(ctx: WorkerContext, staged: bool, check: IntegrityCheck | None = None) -> WorkerReport:
    """Async pull: the steps the training ranks served, then the data; commit when staged and whole,
    unless the step is on ``check``'s cadence (the reader commits it once every worker verified it)."""
    r = _reader(ctx)
    with torch.no_grad():
        pulled = r.receiver.pull(r.targets(ctx, staged))
        checked = check is not None and len(pulled.steps) == 1 and check.due(next(iter(pulled.steps)))
        if staged and len(pulled.steps) == 1 and not checked:
            r.commit(ctx)
    return WorkerReport(ctx.rank, pulled.steps, pulled.stats)


def disconnect(ctx: WorkerContext) -> None:
    if ctx.reader is not None:
        ctx.reader.receiver.close()
        ctx.reader = None


def _reader(ctx: WorkerContext) -> WorkerReader:
    if ctx.reader is None:
        raise RuntimeError(f"worker {ctx.rank} was not planned: the reader calls plan() before connect/receive")
    return ctx.reader
