"""The worker reader: what runs on every inference worker (GPU) of an instance.

The instance's control process (:class:`~weightsync.runtime.session.InstanceSession`, then
:class:`~weightsync.runtime.reader.WeightReader`) calls these functions on every worker at once through
:meth:`InferenceInstance.call`, in this order::

    1. probe        what the worker is (peer access, GPU)
    2. plan         its receives, its transport's memory, its integrity part (integrity=N, N > 0)
    3. connect      the transport joins; the integrity part gets its MetaServer client
    4. every step:
       receive | pull     the step lands in the live tensors, or a staged copy
       verify             on the cadence, once EVERY worker returned (co-located: they write into each other)
       commit             staged, once every worker's copy is whole and checked: all commit, never one alone
    5. disconnect

Each takes the worker's :class:`WorkerContext` first and returns a typed record; a worker keeps its
state between calls in ``ctx.reader`` (a :class:`WorkerReader`: plan, receiver, staged copy), built
once and reused every step. Nothing here asks which transport it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from weightsync.errors import TransportError
from weightsync.integrity.check import Checked, LandedCheck
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

T = TypeVar("T")

#: how much longer than the transport's own timeout a call on the workers may take: a worker's transfer
#: returns within ``timeout_s`` whatever its peers do (:func:`_transfer`), so the call's deadline (vLLM's
#: RPC deadline: a call still running past it leaves vLLM's executor out of step) is never reached by
#: a transfer; a worker that itself stalls is given up on this little later -- at most half the timeout
#: more, so every error arrives within twice what the user set
CALL_MARGIN_S = 2.0


def call_timeout(timeout_s: float) -> float:
    return timeout_s + min(CALL_MARGIN_S, timeout_s / 2)


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
    #: integrity (:mod:`weightsync.integrity.check`): what landed, checked on the cadence; None for integrity=0
    check: LandedCheck | None = None
    #: why a transfer over the job's group failed or was given up on (a trainer stopped or died mid-step,
    #: the deadline passed): the group cannot be used again, and every later receive says so at once
    abandoned: str | None = None
    #: the last transfer was refused before it began (``abandoned``): it moved nothing
    refused: bool = False

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
         options: TransportOptions, integrity: int = 0) -> WorkerPlan:
    """Plan this worker's receives and keep the plan; return its pair hashes and the memory its
    transport will keep. ``push``: co-located, this instance's workers write their own GPU's trainers'
    pieces into each other (:meth:`ColocatedRanks.pusher`). ``integrity``: the agreed cadence; where it
    is not 0 the worker derives its integrity part now (0: none, no integrity work at all)."""
    from weightsync.spec.model import spec_from_config

    planner = shape.planner(spec_from_config(model_config))
    plans = planner.recv_plan(instance, ctx.rank)
    receiver = make_receiver(options)
    context = ReceiverContext(None, shape, instance, ctx.rank, planner, plans, ctx.tensors, ctx.device, push)
    buffers = receiver.memory(context)
    check = (LandedCheck(plans, f"instance {instance} rank {ctx.rank}", ctx.tensors, options.timeout_s, options.codec)
             if integrity else None)
    ctx.reader = WorkerReader(instance, shape, plans, receiver, context, check=check)
    return WorkerPlan(hashes_of(plans), buffers)


def connect(ctx: WorkerContext, link: MetaLink) -> None:
    """Join the transport (groups, opened memory): once the plan is proven. A receiver whose waits depend on the
    trainers through nothing that breaks when one dies (``watches_trainers``) gets their liveness watch."""
    r = _reader(ctx)
    r.context.link = link
    if r.receiver.watches_trainers:
        from weightsync.transport.liveness import TrainerWatch

        r.context.watch = TrainerWatch(link, f"instance {r.instance} rank {ctx.rank}")
    r.receiver.connect(r.context)
    if r.check is not None:
        r.check.connect(link)


def receive(ctx: WorkerContext, step: int, staged: bool = False) -> WorkerReport:
    """Receive one step into the live tensors, or (staged) into a copy that the reader commits
    (:func:`commit`) only once EVERY worker's receive returned whole (and, on the integrity cadence, every
    worker's :func:`verify` passed): a worker never commits alone, or a failure on another worker would
    leave the instance serving two steps across its ranks."""
    r = _reader(ctx)
    with torch.no_grad():
        targets = r.targets(ctx, staged)
        stats = _transfer(ctx, r, f"instance {r.instance} rank {ctx.rank} receiving step {step}",
                          lambda: r.receiver.receive(step, targets))
    return WorkerReport(ctx.rank, frozenset({step}), stats)


def verify(ctx: WorkerContext, step: int, staged: bool = False, pulled: bool = False) -> Checked:
    """Check what landed of step ``step`` (the live tensors, or the staged copy) against what the training
    ranks sent (raises :class:`~weightsync.errors.IntegrityError`); run once every worker's receive or pull
    returned (co-located workers write into each other), for sync steps and async pulls alike. ``pulled``:
    an async pull, whose senders may have posted a later snapshot's sums meanwhile (``current=False``)."""
    r = _reader(ctx)
    if r.check is None:
        raise RuntimeError(f"worker {ctx.rank} was planned with integrity=0, so it has no sums to check with")
    with torch.no_grad():
        return r.check.verify(step, r.stage if staged else ctx.tensors, pulled)


def commit(ctx: WorkerContext) -> None:
    """Commit a staged step once every worker's copy is whole (and checked, on the cadence): see :func:`receive`."""
    with torch.no_grad():
        _reader(ctx).commit(ctx)


def pull(ctx: WorkerContext, staged: bool) -> WorkerReport:
    """Async pull: the steps the training ranks served, then the data. Staged, the reader commits every
    worker's copy (:func:`commit`) only once all pulled the SAME one step (and, on the integrity cadence,
    verified it): a worker committing alone served a later step than its peers (found by the soak)."""
    r = _reader(ctx)
    with torch.no_grad():
        targets = r.targets(ctx, staged)
        pulled = _transfer(ctx, r, f"instance {r.instance} rank {ctx.rank} pulling", lambda: r.receiver.pull(targets))
    return WorkerReport(ctx.rank, pulled.steps, pulled.stats)


def landed(ctx: WorkerContext) -> bool:
    """Whether this worker's last receive may have written into its targets (a failed update asks: one that moved
    no byte on any worker leaves the instance serving what it held; :meth:`Receiver.landed`)."""
    r = ctx.reader
    return r is None or (not r.refused and r.receiver.landed())


def disconnect(ctx: WorkerContext) -> None:
    if ctx.reader is not None:
        ctx.reader.receiver.close()
        if ctx.reader.context.watch is not None:
            ctx.reader.context.watch.close()
        ctx.reader = None


def _transfer(ctx: WorkerContext, r: WorkerReader, what: str, fn: Callable[[], T]) -> T:
    """``fn`` (a receive or pull), returning within the transport's ``timeout_s`` whatever the trainers do.

    Where the transport waits in a group of :func:`weightsync.transport.group.new_group` (its
    :meth:`~weightsync.transport.base.Receiver.group_wait`: p2p, the train+inference group; co-located
    across hosts, the workers' group), the wait runs :func:`~weightsync.transport.group.watched`: a peer
    this worker waits on -- a trainer (p2p), another worker (co-located) -- that stops or dies mid-transfer
    (its beat stops) is noticed in seconds, the deadline holds even where the backend would wait on, and the
    error names the peer. The group cannot be used again then, and every later transfer of this worker
    reader says so at once. (The other transports'
    waits are polls with the same timeout that ask the trainers' liveness beacons once they make no progress --
    ``ctx.watch``, :mod:`weightsync.transport.liveness` -- so they run as they are.)

    A call sent before its step was written (:mod:`weightsync.transport.gate`) gets its go here, before ``fn``,
    unless the transport waits for it after its own set-up (``sets_up_before_ready``) on this thread."""
    from weightsync.transport.gate import ready
    from weightsync.transport.group import address_of, watched

    r.refused = r.abandoned is not None
    if r.refused:
        raise TransportError(f"{what}: refused: {r.abandoned}; this job's transfers cannot resume: join a new "
                             "job (a new WeightReader, or init_weight_transfer_engine again)")
    wait = r.receiver.group_wait()  # p2p: the trainers; co-located: the workers it exchanges with
    if wait is None or address_of(wait.group) is None:
        if not r.receiver.sets_up_before_ready:
            ready()  # a call sent before its step was written: the go first (weightsync.transport.gate)
        return fn()
    ready()  # the go first: watched() may run fn on a thread of its own, and its deadline is the transfer's
    try:
        return watched(fn, wait.group, wait.peers, r.receiver.options.timeout_s, what, ctx.device,
                       describe=wait.describe, fence=wait.fence, first_s=wait.first_s)
    except TransportError as e:  # given up on, or failed in the backend: either way the group's state is unknown
        r.abandoned = f"an earlier transfer failed ({e})"
        raise


def _reader(ctx: WorkerContext) -> WorkerReader:
    if ctx.reader is None:
        raise RuntimeError(f"worker {ctx.rank} was not planned: the reader calls plan() before connect/receive")
    return ctx.reader
