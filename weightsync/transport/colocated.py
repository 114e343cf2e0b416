"""Co-located transport: inference workers copy the trainers' weights on the GPUs they share.

Training and inference share GPUs (:meth:`Topology.colocated`: inference worker (i, j) sits on GPU
``(i*W + j) % T``, training rank t on GPU t). The trainer does nothing but export its live tensors
once (:mod:`weightsync.transport.share`: CUDA IPC on GPU, shared memory on CPU); each training rank
gets a *proxy*, the inference worker that opened those tensors and acts for it:

- a bucket for me whose source rank sits on MY HOST is a DIRECT copy (:meth:`ColocatedRanks.direct`;
  without CUDA peer access between the GPUs, only one on MY GPU):
  I open that trainer's tensors too and copy every box straight from its view into mine -- no
  buffer, no group, no proxy. On my own GPU that is a device-to-device copy (LOCAL); on another GPU
  of the host (PEER) the trainer's memory is mapped into my own CUDA context (CUDA IPC with lazy
  peer access: no context on the other GPU) and my kernel reads it over NVLink. Measured on 2 x H200
  (``benchmarks/peer_push.py``): 4 GiB each way, both GPUs at once, in 12.9 ms with a same-GPU 4 GiB
  copy beside it, against 15.9 ms for NCCL send/recv through buffers. Dtypes are converted by the
  codec (its ``land``; received buckets by its ``unpacked``): bitwise the same result as pack -> unpack
  (one cast, source dtype -> destination dtype);
- with :attr:`ColocatedRanks.push` (per instance), such a cross-GPU bucket is instead PUSHED by the
  worker of my instance on the trainer's GPU, whose kernel writes it into my tensors (opened by CUDA
  IPC in its context): a kernel writes into another GPU faster than it reads from it (11.8 against
  13.0 ms for the above). Pushes stay within an instance, whose update waits for all its workers, so
  nobody needs to be told they are done;
- a bucket whose source rank I proxy for a worker that cannot read it directly (on another host) is
  SENT by me, straight from the trainer's memory where it lies contiguous there, else packed from it,
  on the trainer's behalf;
- a bucket for me that I cannot read directly is RECEIVED from its source rank's proxy.

Those remote buckets move over a group of the inference workers only (group rank ``i*W + j``): NCCL
refuses two ranks of one communicator on one GPU, so the trainer process cannot be a member. A job on
one host with peer access needs no group at all. On CPU the same code runs over gloo and shared memory, so
everything but the CUDA kernels is tested there.

The planner needs the colocated :class:`Topology` to prefer same-GPU sources (which become local
copies); correctness does not depend on it -- any plan runs, with more group traffic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property

import torch
from torch.distributed import ProcessGroup

from weightsync.errors import ConfigError, TransportError
from weightsync.plan.job import JobShape
from weightsync.plan.planner import Bucket, Pair
from weightsync.plan.topology import Placement, Topology
from weightsync.transport.base import Buffers, GroupWait, Receiver, ReceiverContext, Sender, SenderContext, StepStats
from weightsync.payload.codec import Codec
from weightsync.transport.gate import ready
from weightsync.transport.graphs import CopyGraphs
from weightsync.transport.posted import posted as all_posted
from weightsync.transport.nccl import (DEFAULT_WINDOW, coalescing, describe, ensure_buffers, first_line, on_gpu,
                                       order_key, post, retire, settle)
from weightsync.payload.pack import (DIRECT_MIN_BYTES, Landing, Staging, direct_pairs, pack_pairs, segments, stage,
                                     unpack_pairs, unpacked)

Plans = Mapping[Pair, list[Bucket]]


def proxy_of(topology: Topology, train_rank: int) -> int | None:
    """THE proxy rule: who opens training rank ``train_rank``'s tensors and acts for it.

    The proxy is the lowest-numbered inference worker -- worker (i, j) numbered ``i*W + j``, its rank
    in the inference-only group -- that sits on the training rank's own GPU
    (``topology.infer_gpu(i, j) == topology.train_gpu(train_rank)``); None when no inference worker
    is on that GPU (then the rank cannot be proxied). With :meth:`Topology.colocated` that is worker
    ``train_rank`` itself when ``train_rank < instances * W``. Every worker evaluates this same
    pure function, so senders and receivers agree on who sends what without talking.
    """
    gpu = topology.train_gpu(train_rank)
    for g in range(topology.instances * topology.infer_world):
        if topology.infer_gpu(g // topology.infer_world, g % topology.infer_world) == gpu:
            return g
    return None


@dataclass(frozen=True)
class ColocatedRanks:
    """Group ranks of the inference-only group: (instance i, rank j) -> ``i*infer_world + j``.

    Training rank t is represented in the group by its proxy (:func:`proxy_of`).
    """

    train_world: int
    infer_world: int
    instances: int = 1
    gpus_per_host: int = 8
    #: whether workers read the other GPUs of their host directly (CUDA peer access); without it only
    #: their own GPU's trainers, and the other pieces go through the group as if from another host
    peer: bool = True
    #: whether a worker writes its own GPU's trainers' pieces into the other workers of its instance
    #: rather than those workers reading them from its GPU (:meth:`pusher`); set per instance (off
    #: for a staged one, whose workers each commit their own copy as soon as their own copies end)
    push: bool = False
    #: where the ranks registered (None: the arithmetic rule of :meth:`Topology.colocated`)
    placement: Placement | None = None

    @classmethod
    def of(cls, shape: JobShape) -> ColocatedRanks:
        """Who opens, reads, sends and receives what in a co-located job (the planner's topology)."""
        return cls(shape.train_world, shape.infer_world, shape.instances, peer=shape.peer_copies,
                   placement=shape.placement)

    @property
    def world_size(self) -> int:
        return self.instances * self.infer_world

    @cached_property
    def topology(self) -> Topology:
        if self.placement is not None:
            return Topology.placed(self.placement, self.infer_world, self.instances, colocate=True)
        return Topology.colocated(self.train_world, self.infer_world, self.instances, self.gpus_per_host)

    def infer(self, instance: int, rank: int) -> int:
        return instance * self.infer_world + rank

    def where(self, group_rank: int) -> tuple[int, int]:
        """(instance, inference rank) of a group rank."""
        return divmod(group_rank, self.infer_world)

    def gpu(self, group_rank: int) -> int:
        return self.topology.infer_gpu(*self.where(group_rank))

    @cached_property
    def _proxies(self) -> tuple[int | None, ...]:
        return tuple(proxy_of(self.topology, t) for t in range(self.train_world))

    def proxy(self, train_rank: int) -> int:
        """Group rank acting for ``train_rank``; ConfigError when nobody can."""
        if not 0 <= train_rank < self.train_world:
            raise ConfigError(f"training rank {train_rank} outside world of {self.train_world}")
        p = self._proxies[train_rank]
        if p is None:
            raise ConfigError(self._unproxied_message([train_rank]))
        return p

    def proxied_by(self, group_rank: int) -> list[int]:
        """Training ranks whose tensors ``group_rank`` opens and acts for (at most one: one trainer per GPU)."""
        return [t for t, p in enumerate(self._proxies) if p == group_rank]

    def check(self) -> None:
        """Every training rank must have a proxy (an inference worker on its GPU)."""
        missing = [t for t, p in enumerate(self._proxies) if p is None]
        if missing:
            raise ConfigError(self._unproxied_message(missing))

    def _unproxied_message(self, missing: list[int]) -> str:
        return (
            f"co-located mode: training rank(s) {missing} have no inference worker on their GPU "
            f"({self.instances} instance(s) x {self.infer_world} inference ranks cover GPUs "
            f"{sorted({self.gpu(g) for g in range(self.world_size)})} of the {self.train_world} training GPUs), "
            "so nobody can open their tensors and send for them; use at least as many inference workers "
            "as training ranks, or the separated (P2P) transport"
        )

    def direct(self, train_rank: int, group_rank: int) -> bool:
        """THE direct-read rule: worker ``group_rank`` copies training rank ``train_rank``'s pieces
        straight out of its memory when both sit on one host (on one GPU, without :attr:`peer`).
        Senders, receivers and exporters all evaluate this same pure function, so they agree on who
        moves what without talking."""
        top = self.topology
        src, dst = top.train_gpu(train_rank), self.gpu(group_rank)
        return src == dst or (self.peer and top.host(src) == top.host(dst))

    def push_candidate(self, train_rank: int, group_rank: int) -> int | None:
        """The worker that would push training rank ``train_rank``'s pieces into worker ``group_rank``:
        the worker of ``group_rank``'s own instance on the training rank's GPU, when ``group_rank``
        reads that rank directly from another GPU; else None."""
        top = self.topology
        src = top.train_gpu(train_rank)
        if src == self.gpu(group_rank) or not self.direct(train_rank, group_rank):
            return None
        instance = self.where(group_rank)[0]
        return next((p for p in (self.infer(instance, j) for j in range(self.infer_world)) if self.gpu(p) == src), None)

    def pusher(self, train_rank: int, group_rank: int) -> int | None:
        """THE push rule: who copies training rank ``train_rank``'s pieces into worker ``group_rank``
        when that is not ``group_rank`` itself (None: it reads them itself, or receives them). With
        :attr:`push`, the :meth:`push_candidate`: a kernel writes into another GPU faster than it
        reads from it (``benchmarks/peer_push.py``: 4 GiB each way beside a same-GPU copy in 11.8
        against 13.0 ms). Kept within an instance, whose update waits for all its workers anyway."""
        return self.push_candidate(train_rank, group_rank) if self.push else None

    def pushes(self, group_rank: int, send_plans: Mapping[int, Plans]) -> dict[int, list[Bucket]]:
        """The buckets worker ``group_rank`` pushes, by receiving worker, out of the send plans of the
        training ranks on its GPU (the mirror of :meth:`pushers_into`)."""
        out: dict[int, list[Bucket]] = {}
        for t, plans in send_plans.items():
            for pair, buckets in plans.items():
                g = self.receiver(pair)
                if self.pusher(t, g) == group_rank:
                    out.setdefault(g, []).extend(b for b in buckets if b.nbytes)
        return {g: bs for g, bs in sorted(out.items()) if bs}

    def pushers_into(self, group_rank: int, recv_plans: Plans) -> list[int]:
        """Workers that push into worker ``group_rank`` (each opens its tensors: one export each)."""
        return sorted({p for pair, bs in recv_plans.items() if any(b.nbytes for b in bs)
                       for p in [self.pusher(pair[0], group_rank)] if p is not None})

    def trainers_on_gpu_of(self, group_rank: int) -> list[int]:
        """Training ranks on worker ``group_rank``'s GPU: those whose send plans it needs to push."""
        return [t for t in range(self.train_world) if self.topology.train_gpu(t) == self.gpu(group_rank)]

    def send_plan_ranks(self, group_rank: int) -> list[int]:
        """Training ranks whose send plans worker ``group_rank`` holds: those it proxies, when some bucket
        goes through the group (else it never sends), and, with :attr:`push`, those on its GPU."""
        mine = set(self.proxied_by(group_rank)) if self.needs_group else set()
        return sorted(mine | (set(self.trainers_on_gpu_of(group_rank)) if self.push else set()))

    @cached_property
    def needs_group(self) -> bool:
        """Whether any bucket may cross hosts (or GPUs, without :attr:`peer`), so the workers need their
        group (never on one host with peer access)."""
        return not all(self.direct(t, g) for t in range(self.train_world) for g in range(self.world_size))

    def sources(self, group_rank: int, recv_plans: Plans, send_plans: Mapping[int, Plans] | None = None) -> list[int]:
        """Training ranks whose tensors worker ``group_rank`` opens: those it reads directly, those it
        pushes for (``send_plans``: of the ranks on its GPU) and those it proxies (the mirror of
        :meth:`importers`)."""
        read = {pair[0] for pair, bs in recv_plans.items() if any(b.nbytes for b in bs)
                and self.direct(pair[0], group_rank) and self.pusher(pair[0], group_rank) is None}
        pushed = {b.src_rank for bs in self.pushes(group_rank, send_plans or {}).values() for b in bs}
        return sorted(read | pushed | set(self.proxied_by(group_rank)))

    def importers(self, train_rank: int, send_plan: Plans) -> list[int]:
        """Workers that may open training rank ``train_rank``'s tensors (each needs its own CUDA export):
        every receiver reading it directly, the workers that could push its pieces, and its proxy. The
        trainer does not know whether an instance pushes (:attr:`push` is the instance's): it exports
        for both cases, and a worker opens only what it uses."""
        read = set()
        for pair, bs in send_plan.items():
            g = self.receiver(pair)
            if any(b.nbytes for b in bs) and self.direct(train_rank, g):
                read.add(g)
                if (p := self.push_candidate(train_rank, g)) is not None:
                    read.add(p)
        return sorted(read | {self.proxy(train_rank)})

    def sender(self, pair: Pair) -> int:
        return self.proxy(pair[0])

    def receiver(self, pair: Pair) -> int:
        return self.infer(pair[1], pair[2])


@dataclass(frozen=True)
class ColocatedStats:
    local_buckets: int  # direct copies on my GPU
    local_bytes: int
    peer_buckets: int  # direct copies from another GPU of my host
    peer_bytes: int
    sent_buckets: int  # through the group
    sent_bytes: int
    recv_buckets: int  # through the group
    recv_bytes: int
    seconds: float
    posted: float = 0.0  # seconds until the CPU had posted everything (the GPU works on after that)
    pushed_buckets: int = 0  # direct copies into another worker of my instance, on another GPU
    pushed_bytes: int = 0
    started: float = 0.0  # seconds until the first copy was posted (the step's set-up on the CPU)
    full_bytes: int = 0  # the plan's bytes (what the full codec moves; a codec may land others: ``bytes``)

    @property
    def bytes(self) -> int:
        """Bytes this worker moved into inference tensors: its own, and those it pushed into others'."""
        return self.local_bytes + self.peer_bytes + self.recv_bytes + self.pushed_bytes

    @property
    def buckets(self) -> int:
        return self.local_buckets + self.peer_buckets + self.recv_buckets + self.pushed_buckets


_LOCAL, _PEER, _PUSH, _SEND, _RECV = "local", "peer", "push", "send", "recv"
_DIRECT = (_LOCAL, _PEER, _PUSH)
UNIT_OPS = 2  # remote operations posted as one NCCL group (a send and a receive between two workers)


def buffer_slots(window: int, coalescing: bool = True) -> int:
    """Buffers a worker keeps: one per remote operation in flight (``window`` units of ``UNIT_OPS`` on NCCL)."""
    return window * (UNIT_OPS if coalescing else 1)


def _sms(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


def copy_programs(dev: torch.device, peer: bool, remote: bool) -> tuple[int | None, int | None]:
    """CTAs for the same-GPU copies and for the peer copies, which run at once on two streams.

    Peer copies are bound by NVLink, not by SMs: on a quarter of them they move as fast as on all
    (measured: 4 GiB both ways in 11.7 ms on 33 CTAs, 11.7 on 132). Same-GPU copies take the rest, or
    half when NCCL traffic runs beside them: copy CTAs on every SM delay NCCL's kernels (4 GiB both
    ways with 4 GiB copied alongside: 15.9 ms with the copy on every SM, 15.0 on half, 14.2 without)."""
    sms = _sms(dev)
    peer_programs = max(1, sms // 4) if peer else 0
    if remote:
        return max(1, sms // 2 - peer_programs), peer_programs or None
    return (sms - peer_programs if peer else None), peer_programs or None


@contextlib.contextmanager
def _nothing():
    yield


class ColocatedTransport:
    """One inference worker's side of a co-located weight sync; keep one per worker, reuse every step.

    Deadlock freedom with ONE merged FIFO. Every worker makes a single list of all its remote
    operations -- the receives of its own recv plan and the sends it makes for the training rank it
    proxies -- sorted by :func:`weightsync.transport.p2p.order_key`, ``(bucket.index, src_rank,
    dst_instance, dst_rank)``. That key is a property of the *transfer* (both ends compute it from
    the same bucket) and is distinct for distinct transfers, so all transfers of the job form one
    total order, and each worker's list is that order restricted to the transfers it takes part in,
    whatever mix of sends and receives they are. A worker posts its k-th operation only after its
    (k - window)-th completed. Take the globally earliest transfer X not yet completed, between
    sender proxy P and receiver R. Every operation before X in P's list -- send or receive alike --
    is a transfer earlier than X, hence completed; so P's FIFO drains down to X and P posts X. The
    same holds for R. X is posted on both ends, so it completes (also for a backend that finishes a
    process's operations strictly in posting order, since X is then the oldest on both), and by
    induction every transfer does. What would break this is ordering sends and receives separately
    (say, all sends first): two workers each sending to the other with full windows would each wait
    for a receive the other has not posted yet. Local copies never wait on anyone and take no window
    slot, so they do not change the argument.

    On NCCL the operations go in *units*: consecutive operations of one bucket index (at most
    ``UNIT_OPS``), posted as one NCCL group, so that a worker's send to a peer and its receive from
    that peer run at once, both ways over NVLink, instead of one after the other on the pair's stream
    (measured: 1.7x the bytes per second). A unit is a contiguous stretch of the worker's list and the
    operations of a group progress independently, so the argument holds with units for operations:
    the units before X's hold only earlier transfers. The window counts units, and, as in
    :mod:`weightsync.transport.p2p`, it is kept by CUDA streams rather than the CPU. Local copies
    run on a stream of their own, overlapping the NVLink traffic, and every group of copies (the
    local ones, each bucket's pack and unpack) replays a CUDA graph (:mod:`weightsync.transport.graphs`).

    The order above concerns remote operations (through the group) only: direct copies involve
    nobody else, so they never wait on anyone. They run on two streams of their own beside the remote
    units, the same-GPU ones and the peer ones apart (:func:`copy_programs`).

    Memory: ``window`` x ``UNIT_OPS`` uint8 buffers (``window`` on CPU) as large as the most a remote
    bucket stages (messages moved in place take none; at most the largest remote bucket), reused
    across steps; direct copies use none, so a job on one host holds no buffer at all.

    Failures never hang: on CPU every wait has ``timeout_s``; on CUDA the final watch raises once no
    unit has completed for ``timeout_s``. A dead or stalled peer raises :class:`TransportError` naming
    its group rank (``.peer``), the pair and the bucket. After that the group's state is unknown:
    discard it.
    """

    def __init__(
        self,
        group: ProcessGroup | None,
        ranks: ColocatedRanks,
        *,
        me: int | None = None,
        window: int = DEFAULT_WINDOW,
        timeout_s: float = 60.0,
        buffer_bytes: int | None = None,
        direct_min: int = DIRECT_MIN_BYTES,
        codec: Codec | None = None,
    ):
        """``group``: the inference workers' group, needed only when the job spans hosts
        (:attr:`ColocatedRanks.needs_group`); without it, ``me`` is this worker's group rank. ``codec``: how
        the direct copies land (its ``land``: :mod:`weightsync.codec`, the full codec's copies and casts, FP8's
        quantization) and the buckets received through the group (its ``unpacked``); None: the plan's bytes
        as byte copies only (a pair of two dtypes is refused: the cast is the full codec's)."""
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        if group is None:
            if ranks.needs_group:
                raise ConfigError("this co-located job's workers need a group: some buckets cross hosts "
                                  "(or GPUs, without peer access)")
            if me is None or not 0 <= me < ranks.world_size:
                raise ValueError(f"without a group, pass this worker's rank me in [0, {ranks.world_size}), got {me}")
        elif group.size() != ranks.world_size:
            raise ValueError(
                f"group has {group.size()} ranks, but the co-located group holds only the "
                f"{ranks.instances} x {ranks.infer_world} = {ranks.world_size} inference workers"
            )
        ranks.check()  # set-up fails loudly when some training rank cannot be proxied
        self.group, self.ranks, self.window = group, ranks, window
        self.me = group.rank() if group is not None else me
        self.proxied = ranks.proxied_by(self.me)
        self.timeout = timedelta(seconds=timeout_s)
        self.buffer_bytes = buffer_bytes
        self.direct_min = direct_min  # segments this large travel alone (pack.messages): the same on every rank
        self.codec = codec
        self._counted: tuple | None = None  # (ops, buckets and bytes per kind, the plan's bytes): see _counts
        if codec is not None and getattr(codec, "land", None) is None:
            raise ConfigError(f"the {codec.name} codec cannot land from the trainers' memory (co-located); use the "
                              "full codec")
        self._buffers: list[torch.Tensor] = []
        self._coalescing: bool | None = None
        self._checked: tuple | None = None  # (plans, their validated operations in the global order)
        self._graphs = CopyGraphs()  # the direct copies, and each bucket's pack / unpack, replayed on CUDA
        self._streams: dict[str, torch.cuda.Stream] = {}

    # -- the step -------------------------------------------------------------------------------
    def run(
        self,
        recv_plans: Plans,
        send_plans_by_train_rank: Mapping[int, Plans],
        dst_tensors: Mapping[str, torch.Tensor],
        src_tensors_by_train_rank: Mapping[int, Mapping[str, torch.Tensor]],
        push_targets: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
        during: Callable[[], None] | None = None,
    ) -> ColocatedStats:
        """Move one step's weights: my recv plan into ``dst_tensors`` (in place), every bucket I push
        into other workers' opened ``push_targets`` (by group rank), and every bucket of the send plans
        of the training ranks I proxy out of their opened ``src`` tensors.

        ``send_plans_by_train_rank`` holds ``planner.send_plan(t)`` for each ``t`` in :attr:`proxied`
        when :attr:`ColocatedRanks.needs_group`, and for each training rank on my GPU when
        :attr:`ColocatedRanks.push`; only the buckets through the group are mine to send, and those
        :meth:`ColocatedRanks.pushes` gives me to push. ``src_tensors_by_train_rank`` holds the opened
        tensors of every rank in :meth:`ColocatedRanks.sources`. Pushed buckets are complete when
        this returns on their pusher: the instance's update waits for all its workers.

        The opened maps (sources, push targets) are this process's mappings of other processes'
        memory: they must not change while the same map objects are passed (the copies are kept by
        their identity; pass new maps when the owner shared anew). ``dst_tensors``' addresses are
        looked up every step.

        ``during``: CPU work to overlap with the copies, called once every copy is posted; what it
        raises is raised once they are done.
        """
        push_targets = push_targets or {}
        start = time.perf_counter()
        plans = (recv_plans, send_plans_by_train_rank)
        if self._checked is None or any(a is not b for a, b in zip(self._checked[0], plans)):
            # validating and ordering is pure Python over every bucket (hashing and comparing them):
            # done once for the plans a worker keeps, not every step
            self._checked = (plans, self._ops(recv_plans, send_plans_by_train_rank, src_tensors_by_train_rank,
                                              push_targets))
        ops = self._checked[1]
        dev = self._device(dst_tensors, src_tensors_by_train_rank)
        ordered = on_gpu(dev)
        self._coalesce(dev)  # first step: every worker, remote work or not, builds the NCCL communicator
        # graphs and views stay valid while the tensors and buffers stay put
        # only my own tensors can move under me: the trainers' and the other workers' are my mappings
        opened = (*src_tensors_by_train_rank.values(), *push_targets.values())
        self._graphs.begin(dst_tensors, buffers=self._buffers, opened=opened)
        units = self._units([op for op in ops if op[0] not in _DIRECT], dev)
        stagings = {}
        for kind, b, _ in (op for unit in units for op in unit):
            tensors = src_tensors_by_train_rank[b.src_rank] if kind == _SEND else dst_tensors
            stagings[kind, id(b)] = self._graphs.memo(
                b, kind, lambda b=b, t=tensors, s=kind == _SEND: stage(b, t, s, self.direct_min))
        if units and self._ensure_buffers(max(st.nbytes for st in stagings.values()), dev):
            # new buffers (first step, or grown)
            self._graphs.begin(dst_tensors, buffers=self._buffers, opened=opened)
        free = list(self._buffers)
        counts = {kind: list(c) for kind, c in self._counts(ops).items()}
        started = time.perf_counter() - start
        # a call sent before the step was written waits here, set up, for its go (weightsync.transport.gate); the
        # step's own timing leaves the wait out
        start += ready()

        # direct copies, pack-free (each run straight from the trainer's view into its target), on streams
        # of their own: the same-GPU ones and the cross-GPU ones (read or pushed) overlap each other and
        # the remote units
        def target(kind: str, peer: int | None) -> Mapping[str, torch.Tensor]:
            return push_targets[peer] if kind == _PUSH else dst_tensors

        # the cross-GPU copies are posted first: they take longest (a graph's launch costs ~0.1 ms)
        direct = {_PEER: [(b, target(k, peer)) for k, b, peer in ops if k in (_PEER, _PUSH)],
                  _LOCAL: [(b, dst_tensors) for k, b, _ in ops if k == _LOCAL]}
        local_cap, peer_cap = copy_programs(dev, bool(direct[_PEER]), bool(units)) if ordered else (None, None)
        sides = []
        for (kind, buckets), cap in zip(direct.items(), (peer_cap, local_cap)):
            if not buckets:
                continue
            side = self._side_stream(kind, dev) if ordered else None
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(dev))
                sides.append(side)

            def pairs(buckets=buckets) -> Landing:
                src = src_tensors_by_train_rank
                if self.codec is not None:  # the codec says how its bytes land (copies, casts, quantization)
                    return self.codec.land([(b, src[b.src_rank], dst) for b, dst in buckets])
                return unpacked(None, [p for b, dst in buckets
                                       for p in direct_pairs(segments(b), src[b.src_rank], dst)])

            with torch.cuda.stream(side) if side is not None else _nothing():
                self._graphs.run(recv_plans, kind, pairs, dev, cap)
        inflight: deque = deque()
        posted: list = []
        for unit in units:
            if len(inflight) == self.window:
                free += self._finish(inflight.popleft(), dst_tensors, ordered)
            inflight.append(self._post(unit, stagings, src_tensors_by_train_rank, dst_tensors, free, dev, posted))
        while inflight:
            free += self._finish(inflight.popleft(), dst_tensors, ordered)
        for side in sides:
            torch.cuda.current_stream(dev).wait_stream(side)
        done_posting = time.perf_counter() - start
        all_posted()  # the rest is the device's: the runner may start its own work beside the copies
        error = None
        if during is not None:
            try:
                during()
            except Exception as e:  # noqa: BLE001 - raised below, once the posted work is done
                error = e
        if ordered and posted:
            settle(posted, self.timeout.total_seconds(), dev, self.group)
        elif ordered:  # direct copies only: nothing can stall them
            torch.cuda.current_stream(dev).synchronize()
        if error is not None:
            raise error
        return ColocatedStats(*counts[_LOCAL], *counts[_PEER], *counts[_SEND], *counts[_RECV],
                              time.perf_counter() - start, done_posting, *counts[_PUSH], started,
                              self._counted[2])

    def _units(self, remote: list, dev: torch.device) -> list[list]:
        """Remote operations cut into units posted together: on NCCL, the consecutive ones of one bucket
        index (at most ``UNIT_OPS``) form one group, so a send and a receive between two workers run at
        once, both ways over NVLink, instead of one after the other on the pair's stream."""
        if not remote:
            return []
        if not self._coalesce(dev):
            return [[op] for op in remote]
        units: list[list] = [[remote[0]]]
        for op in remote[1:]:
            last = units[-1]
            if op[1].index == last[0][1].index and len(last) < UNIT_OPS:
                last.append(op)
            else:
                units.append([op])
        return units

    def _post(self, unit: list, stagings: Mapping[tuple[str, int], Staging],
              src: Mapping[int, Mapping[str, torch.Tensor]], dst: Mapping[str, torch.Tensor],
              free: list[torch.Tensor], dev: torch.device, posted: list) -> tuple:
        """Post one unit (as one NCCL group when coalescing); return what retiring it needs.

        Every pack of the unit is queued before its first operation is posted, so whatever point of
        the group NCCL orders its stream after, the packed bytes are ready by then."""
        held, items = [], []
        for kind, b, peer in unit:
            sending = kind == _SEND
            tensors = src[b.src_rank] if sending else dst
            slot, st = free.pop(), stagings[kind, id(b)]
            if sending and st.staged:
                self._graphs.run(b, ("pack", slot.data_ptr()),
                                 lambda st=st, t=tensors, o=slot: pack_pairs(st.staged, t, o), dev)
            held.append((kind, b, peer, slot, st))
            items.extend((t, peer, b.index, sending) for t in st.tensors(slot))
        try:
            works = post(self.group, items, dev, self._coalesce(dev))
        except RuntimeError as e:  # a peer already known dead fails at post time
            kind, b, peer = unit[0]
            raise self._error(kind, b, peer, e) from e
        kind, b, peer = unit[0]
        posted.extend((w, lambda e, kind=kind, b=b, peer=peer: self._error(kind, b, peer, e)) for w in works)
        return works, held

    def _finish(self, entry: tuple, dst: Mapping[str, torch.Tensor], ordered: bool) -> list[torch.Tensor]:
        """Retire a unit: order what follows after it, unpack its receives; return its freed buffers."""
        works, held = entry
        for w in works:
            try:
                retire(w, self.timeout, ordered)
            except (RuntimeError, TimeoutError) as e:  # gloo: connection reset / closed by peer, or timed out
                kind, b, peer, _, _ = held[0]
                raise self._error(kind, b, peer, e) from e
        for kind, b, _, slot, st in held:
            if kind == _RECV and st.staged:  # the codec's casts, if any, run after the copies in the same graph
                self._graphs.run(b, ("unpack", slot.data_ptr()),
                                 lambda st=st, i=slot: unpacked(self.codec, unpack_pairs(st.staged, i, dst)),
                                 slot.device)
        return [slot for _, _, _, slot, _ in held]

    def _coalesce(self, dev: torch.device) -> bool:
        if self._coalescing is None:  # every worker gets here in its first step (see coalescing())
            self._coalescing = self.group is not None and coalescing(self.group, dev)
        return self._coalescing

    def _side_stream(self, kind: str, dev: torch.device) -> torch.cuda.Stream:
        if kind not in self._streams:
            self._streams[kind] = torch.cuda.Stream(dev)
        return self._streams[kind]

    # -- internals ------------------------------------------------------------------------------
    def _ops(
        self,
        recv_plans: Plans,
        send_plans: Mapping[int, Plans],
        src_tensors: Mapping[int, Mapping[str, torch.Tensor]],
        push_targets: Mapping[int, Mapping[str, torch.Tensor]],
    ) -> list[tuple[str, Bucket, int | None]]:
        """Validate the plans and list (kind, bucket, peer) in the one global order."""
        me, ranks = self.me, self.ranks
        top = ranks.topology
        ops: list[tuple[str, Bucket, int | None]] = []
        for pair, buckets in recv_plans.items():
            if ranks.receiver(pair) != me:
                raise TransportError(
                    f"group rank {me} was given the recv plan of {describe(pair)}, "
                    f"which group rank {ranks.receiver(pair)} receives",
                    pair=pair,
                )
            t = pair[0]
            if ranks.pusher(t, me) is not None:
                continue  # another worker of my instance writes these into my tensors
            if ranks.direct(t, me):
                kind, peer = (_LOCAL if top.train_gpu(t) == ranks.gpu(me) else _PEER), None
            else:
                kind, peer = _RECV, ranks.proxy(t)
            ops.extend((kind, b, peer) for b in buckets if b.nbytes)
        mine = ranks.send_plan_ranks(me)
        for t, plans in send_plans.items():
            if t not in mine:
                raise TransportError(
                    f"group rank {me} was given the send plan of training rank {t}; it sends or pushes for "
                    f"training ranks {mine} only",
                )
            for pair, buckets in plans.items():
                if pair[0] != t:
                    raise TransportError(f"the send plan of training rank {t} holds {describe(pair)}", pair=pair)
                dst = ranks.receiver(pair)
                if t in self.proxied and not ranks.direct(t, dst):  # else read straight from the trainer
                    ops.extend((_SEND, b, dst) for b in buckets if b.nbytes)
        for dst, buckets in ranks.pushes(me, send_plans).items():
            if dst not in push_targets:
                raise TransportError(f"group rank {me} pushes into group rank {dst}, whose tensors it has not opened")
            ops.extend((_PUSH, b, dst) for b in buckets)
        remote = [(kind, b) for kind, b, _ in ops if kind not in _DIRECT]
        if remote and self.codec is not None and self.codec.framed:
            kind, b = remote[0]
            raise ConfigError(f"group rank {me}: the {self.codec.name} codec runs co-located only where every bucket "
                              f"is copied straight from the trainer's memory (one host, CUDA peer access), but bucket "
                              f"{b.index} of {describe(b.pair)} goes through the workers' group ({len(remote)} such); "
                              "use the p2p or file transport for this job")
        if any(kind not in _DIRECT for kind, _, _ in ops) and self.group is None:
            raise ConfigError(f"group rank {me} has buckets to move through a group, but no group")
        need = {b.src_rank for kind, b, _ in ops if kind != _RECV}
        if missing := need - set(src_tensors):
            raise TransportError(f"group rank {me}: no opened tensors of training rank(s) {sorted(missing)}")
        ops.sort(key=lambda op: order_key(op[1]))
        return ops

    def _counts(self, ops: list) -> dict[str, tuple[int, int]]:
        """Buckets and bytes per kind of ``ops`` (a pure function of the plans: computed once for the plans kept,
        since a codec's landed bytes -- FP8's, per copy -- cost ~2 ms of Python for a Qwen3-8B step)."""
        if self._counted is None or self._counted[0] is not ops:
            counts = {kind: [0, 0] for kind in (_LOCAL, _PEER, _PUSH, _SEND, _RECV)}
            for kind, b, _ in ops:
                counts[kind][0] += 1
                counts[kind][1] += self._landed_bytes(b) if kind in _DIRECT else b.nbytes
            self._counted = (ops, {k: (n, m) for k, (n, m) in counts.items()},
                             sum(b.nbytes for kind, b, _ in ops if kind != _SEND))
        return self._counted[1]

    def _landed_bytes(self, b: Bucket) -> int:
        """What a direct copy of ``b`` writes: as the codec lands it (FP8: e4m3 bytes and scales)."""
        f = getattr(self.codec, "landed_bytes", None)
        return b.nbytes if f is None else f(b)

    def _error(self, kind: str, b: Bucket, peer: int, cause: Exception) -> TransportError:
        pair = b.pair
        if kind == _SEND:
            what = (
                f"sending bucket {b.index} ({b.nbytes} bytes) of {describe(pair)}, "
                f"on behalf of training rank {b.src_rank}, to"
            )
        else:
            what = f"receiving bucket {b.index} ({b.nbytes} bytes) of {describe(pair)} from the proxy"
        return TransportError(
            f"group rank {self.me}: {what} group rank {peer} failed "
            f"(wait timeout {self.timeout.total_seconds():g}s): {first_line(cause)}",
            peer=peer,
            pair=pair,
            bucket=b.index,
        )

    @staticmethod
    def _device(dst: Mapping[str, torch.Tensor], src: Mapping[int, Mapping[str, torch.Tensor]]) -> torch.device:
        for t in dst.values():
            return t.device
        for tensors in src.values():
            for t in tensors.values():
                return t.device
        return torch.device("cpu")

    def _ensure_buffers(self, need: int, device: torch.device) -> bool:
        """Buffers for ``need`` bytes; True when they were (re)allocated."""
        have, slots = self._buffers, buffer_slots(self.window, self._coalesce(device))
        self._buffers = ensure_buffers(have, slots, need, self.buffer_bytes, device)
        return self._buffers is not have


# -- the transport interface (weightsync.transport.base) -------------------------------------------


class ColocatedSender(Sender):
    """A training rank shares its live tensors once; the inference workers copy them every step.

    Shared by address: ``check`` refuses a step whose tensors moved since (``p.data = ...``, offload and
    reload), since the workers would have copied the old memory."""

    def connect(self, ctx: SenderContext) -> None:
        from weightsync.transport.share import addresses, share_tensors

        # one export per worker that opens them (CUDA IPC counts one opening process per export)
        self.files = []
        for g in ColocatedRanks.of(ctx.shape).importers(ctx.rank, ctx.plans):
            path = share_tensors(ctx.tensors, ctx.link.job, f"train{ctx.rank}-for{g}")
            ctx.client.publish(f"share.{ctx.rank}.{g}", path)
            self.files.append(path)
        self.rank, self.tensors = ctx.rank, ctx.tensors
        self.device = next(iter(ctx.tensors.values())).device
        self.shared_at = addresses(ctx.tensors)  # after sharing: on CPU it moves them to shared memory

    def send(self, step: int) -> None:
        if self.device.type == "cuda":
            # other processes read the weights as soon as we announce them, outside any stream order of
            # ours, so the optimizer's kernels must have finished first
            torch.cuda.synchronize(self.device)
        return None

    def check(self, step: int) -> None:
        # ~0.25 us a tensor (1.6 ms for a 30B stage's 6,300), overlapped with the workers' copies
        from weightsync.transport.share import check_in_place

        check_in_place(self.tensors, self.shared_at, f"training rank {self.rank}", "the co-located inference workers")

    def close(self) -> None:
        from weightsync.transport.share import unshare

        for path in getattr(self, "files", ()):
            unshare(path)


class ColocatedReceiver(Receiver):
    """An inference worker copies its pieces out of the trainers' shared memory (and pushes, proxies)."""

    reads_after_written = True
    sets_up_before_ready = True  # ColocatedTransport.run

    def memory(self, ctx: ReceiverContext) -> Buffers:
        """Plan what else this worker moves -- the send plans of the rank it proxies and of those on its
        GPU it pushes for -- and return the buffers of the buckets that go through the workers' group
        (direct copies need none)."""
        ranks = dataclasses.replace(ColocatedRanks.of(ctx.shape), push=ctx.push)
        self.ranks, self.me = ranks, ranks.infer(ctx.instance, ctx.rank)
        self.send_plans = {t: ctx.planner.send_plan(t) for t in ranks.send_plan_ranks(self.me)}
        buckets = [b for bs in ctx.plans.values() for b in bs]
        buckets += [b for ps in self.send_plans.values() for bs in ps.values() for b in bs]
        largest = max((b.nbytes for b in buckets if not ranks.direct(b.src_rank, ranks.receiver(b.pair))), default=0)
        return Buffers(buffer_slots(DEFAULT_WINDOW), largest)

    def connect(self, ctx: ReceiverContext) -> None:
        """Open the tensors of the training ranks this worker reads or proxies; join the inference-only
        group when some bucket goes through it (on one host with peer access every bucket is a direct copy)."""
        from weightsync.transport.group import free_port, new_group
        from weightsync.transport.share import addresses, open_shared, share_tensors

        client = ctx.link.client(self.options.timeout_s)
        ranks, me, timeout_s = self.ranks, self.me, self.options.timeout_s
        group = None
        if ranks.needs_group:
            if me == 0:
                host, port = "127.0.0.1", free_port()
                client.publish("colocated-group", f"{host}:{port}")
            else:
                host, port_s = client.lookup("colocated-group", timeout=timeout_s).rsplit(":", 1)
                port = int(port_s)
            device = ctx.device if ctx.device.type == "cuda" else None
            group = new_group(host, port, me, ranks.world_size, self.options.backend, timeout_s, device=device,
                              name="weightsync-colo")
        # opened in this worker's own CUDA context, wherever on the host they lie: another GPU's memory is
        # reached by peer access (NVLink) without a context on that GPU
        mine = gpu_index(ctx.device) if ctx.device.type == "cuda" else None
        self.sources = {t: open_shared(client.lookup(f"share.{t}.{me}", timeout=timeout_s), mine)
                        for t in ranks.sources(me, ctx.plans, self.send_plans)}
        # pushing: my instance's workers open my live tensors (one export each), I open theirs
        pushers = ranks.pushers_into(me, ctx.plans)
        self.files = []
        for p in pushers:
            path = share_tensors(ctx.tensors, ctx.link.job, f"infer{me}-for{p}")
            client.publish(f"push.{me}.{p}", path, replace=True)
            self.files.append(path)
        # they write where my tensors were shared: each step checks they are still there
        self.shared_at = addresses(ctx.tensors) if pushers else None
        self.push_targets = {g: open_shared(client.lookup(f"push.{g}.{me}", timeout=timeout_s), mine)
                             for g in ranks.pushes(me, self.send_plans)}
        self.tensors, self.plans, self.who = ctx.tensors, ctx.plans, f"instance {ctx.instance} worker {ctx.rank}"
        self.transport = ColocatedTransport(group, ranks, me=me, timeout_s=timeout_s, codec=self.options.codec)

    def receive(self, step: int, targets: Mapping[str, torch.Tensor]) -> StepStats:
        s = self.transport.run(self.plans, self.send_plans, targets, self.sources, self.push_targets,
                               during=self._check_pushed_into if self.shared_at is not None else None)
        return StepStats(s.buckets, s.bytes, s.seconds, s.posted, s.started, s.pushed_bytes, s.full_bytes)

    def group_wait(self) -> GroupWait | None:
        """The workers' group (inference workers only: errors name them so), where this worker waits on the
        workers it sends to for the training rank it proxies and on every proxy: it receives from some, and in the
        one merged order (:class:`ColocatedTransport`) a proxy held up by a stopped worker holds up everyone it
        sends to -- the proxies are the hubs (one per training rank), so watching them all stays cheap."""
        transport = getattr(self, "transport", None)
        if transport is None or transport.group is None:
            return None
        ranks, me = self.ranks, self.me
        sends = {ranks.receiver(pair) for t in ranks.proxied_by(me) for pair, bs in self.send_plans.get(t, {}).items()
                 if any(b.nbytes for b in bs) and not ranks.direct(t, ranks.receiver(pair))}
        receives = {ranks.proxy(t) for t in range(ranks.train_world)}

        def describe(g: int) -> str:
            i, j = ranks.where(g)
            proxied = ranks.proxied_by(g)
            return f"instance {i} rank {j}" + (f" (the proxy of training rank {proxied[0]})" if proxied else "")

        return GroupWait(transport.group, tuple(sorted((receives | sends) - {me})), describe)

    def _check_pushed_into(self) -> None:
        """My instance's other workers write where my tensors were shared: raise if one moved since."""
        from weightsync.transport.share import check_in_place

        check_in_place(self.tensors, self.shared_at, self.who,
                       "the instance's other workers, which write their pieces into it")

    def close(self) -> None:
        from weightsync.transport.share import unshare

        for path in getattr(self, "files", ()):
            unshare(path)
        self.transport = None


def gpu_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
