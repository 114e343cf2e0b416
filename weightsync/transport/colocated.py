"""Co-located transport: inference workers pull the trainer's weights on the GPUs they share.

Training and inference share GPUs (:meth:`Topology.colocated`: inference worker (i, j) sits on GPU
``(i*W + j) % T``, training rank t on GPU t). The trainer does nothing but export its live tensors
once (:mod:`weightsync.transport.share`: CUDA IPC on GPU, shared memory on CPU); each training rank
gets a *proxy*, the inference worker that opened those tensors and acts for it:

- a bucket whose source rank I proxy and whose destination is me is a LOCAL copy: no buffer, no
  group; every box is ``copy_``-ed straight from the trainer's view into my tensor's view
  (device-to-device on GPU, converting dtype as unpacking would; bitwise the same result as
  pack -> unpack, which goes source dtype -> buffer -> destination dtype in the same single cast);
- a bucket whose source rank I proxy for another worker is SENT by me, straight from the trainer's
  memory where it lies contiguous there, else packed from it, on the trainer's behalf;
- a bucket for me whose source another worker proxies is RECEIVED from that proxy.

Remote buckets move over a group of the inference workers only (group rank ``i*W + j``): NCCL
refuses two ranks of one communicator on one GPU, so the trainer process cannot be a member. On CPU
the same code runs over gloo and shared memory, so everything but the CUDA kernels is tested there.

The planner needs the colocated :class:`Topology` to prefer same-GPU sources (which become local
copies); correctness does not depend on it -- any plan runs, with more group traffic.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import Mapping

import torch
from torch.distributed import ProcessGroup

from weightsync.errors import ConfigError
from weightsync.plan.planner import Bucket, Pair
from weightsync.plan.topology import Topology
from weightsync.transport.graphs import CopyGraphs
from weightsync.transport.p2p import (
    DEFAULT_WINDOW,
    TransportError,
    coalescing,
    describe,
    ensure_buffers,
    first_line,
    on_gpu,
    order_key,
    post,
    retire,
    settle,
)
from weightsync.transport.pack import (
    DIRECT_MIN_BYTES,
    Pairs,
    Staging,
    direct_pairs,
    pack_pairs,
    segments,
    stage,
    unpack_pairs,
)

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

    @property
    def world_size(self) -> int:
        return self.instances * self.infer_world

    @cached_property
    def topology(self) -> Topology:
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

    def sender(self, pair: Pair) -> int:
        return self.proxy(pair[0])

    def receiver(self, pair: Pair) -> int:
        return self.infer(pair[1], pair[2])


@dataclass(frozen=True)
class ColocatedStats:
    local_buckets: int
    local_bytes: int
    sent_buckets: int
    sent_bytes: int
    recv_buckets: int
    recv_bytes: int
    seconds: float
    posted: float = 0.0  # seconds until the CPU had posted everything (the GPU works on after that)


_LOCAL, _SEND, _RECV = "local", "send", "recv"
UNIT_OPS = 2  # remote operations posted as one NCCL group (a send and a receive between two workers)


def buffer_slots(window: int, coalescing: bool = True) -> int:
    """Buffers a worker keeps: one per remote operation in flight (``window`` units of ``UNIT_OPS`` on NCCL)."""
    return window * (UNIT_OPS if coalescing else 1)


def half_the_sms(dev: torch.device) -> int:
    return max(1, torch.cuda.get_device_properties(dev).multi_processor_count // 2)


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

    Memory: ``window`` x ``UNIT_OPS`` uint8 buffers (``window`` on CPU) as large as the most a remote
    bucket stages (messages moved in place take none; at most the largest remote bucket), reused
    across steps; local copies use none.

    Failures never hang: on CPU every wait has ``timeout_s``; on CUDA the final watch raises once no
    unit has completed for ``timeout_s``. A dead or stalled peer raises :class:`TransportError` naming
    its group rank (``.peer``), the pair and the bucket. After that the group's state is unknown:
    discard it.
    """

    def __init__(
        self,
        group: ProcessGroup,
        ranks: ColocatedRanks,
        *,
        window: int = DEFAULT_WINDOW,
        timeout_s: float = 60.0,
        buffer_bytes: int | None = None,
        direct_min: int = DIRECT_MIN_BYTES,
    ):
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        if group.size() != ranks.world_size:
            raise ValueError(
                f"group has {group.size()} ranks, but the co-located group holds only the "
                f"{ranks.instances} x {ranks.infer_world} = {ranks.world_size} inference workers"
            )
        ranks.check()  # set-up fails loudly when some training rank cannot be proxied
        self.group, self.ranks, self.window = group, ranks, window
        self.me = group.rank()
        self.proxied = ranks.proxied_by(self.me)
        self.timeout = timedelta(seconds=timeout_s)
        self.buffer_bytes = buffer_bytes
        self.direct_min = direct_min  # segments this large travel alone (pack.messages): the same on every rank
        self._buffers: list[torch.Tensor] = []
        self._coalescing: bool | None = None
        self._checked: tuple | None = None  # (plans, their validated operations in the global order)
        self._graphs = CopyGraphs()  # the same-GPU copies, and each bucket's pack / unpack, replayed on CUDA
        self._stream: torch.cuda.Stream | None = None

    # -- the step -------------------------------------------------------------------------------
    def run(
        self,
        recv_plans: Plans,
        send_plans_by_train_rank: Mapping[int, Plans],
        dst_tensors: Mapping[str, torch.Tensor],
        src_tensors_by_train_rank: Mapping[int, Mapping[str, torch.Tensor]],
    ) -> ColocatedStats:
        """Move one step's weights: my recv plan into ``dst_tensors`` (in place), and every bucket
        of the send plans of the training ranks I proxy out of their opened ``src`` tensors.

        ``send_plans_by_train_rank`` holds ``planner.send_plan(t)`` for each ``t`` in
        :attr:`proxied`; its buckets addressed to me are the same local copies my recv plan lists
        (checked, and done once).
        """
        start = time.perf_counter()
        plans = (recv_plans, send_plans_by_train_rank)
        if self._checked is None or any(a is not b for a, b in zip(self._checked[0], plans)):
            # validating and ordering is pure Python over every bucket (hashing and comparing them):
            # done once for the plans a worker keeps, not every step
            self._checked = (plans, self._ops(recv_plans, send_plans_by_train_rank, src_tensors_by_train_rank))
        ops = self._checked[1]
        dev = self._device(dst_tensors, src_tensors_by_train_rank)
        ordered = on_gpu(dev)
        self._coalesce(dev)  # first step: every worker, remote work or not, builds the NCCL communicator
        # graphs and views stay valid while the tensors and buffers stay put
        self._graphs.begin(dst_tensors, *src_tensors_by_train_rank.values(), buffers=self._buffers)
        units = self._units([op for op in ops if op[0] != _LOCAL], dev)
        stagings = {}
        for kind, b, _ in (op for unit in units for op in unit):
            tensors = src_tensors_by_train_rank[b.src_rank] if kind == _SEND else dst_tensors
            stagings[kind, id(b)] = self._graphs.memo(
                b, kind, lambda b=b, t=tensors, s=kind == _SEND: stage(b, t, s, self.direct_min))
        if units and self._ensure_buffers(max(st.nbytes for st in stagings.values()), dev):
            # new buffers (first step, or grown)
            self._graphs.begin(dst_tensors, *src_tensors_by_train_rank.values(), buffers=self._buffers)
        free = list(self._buffers)
        counts = {_LOCAL: [0, 0], _SEND: [0, 0], _RECV: [0, 0]}
        for kind, b, _ in ops:
            counts[kind][0] += 1
            counts[kind][1] += b.nbytes
        # same-GPU copies on their own stream, so they overlap the NVLink traffic of the remote units
        side = self._side_stream(dev) if ordered else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(dev))
        local = [b for kind, b, _ in ops if kind == _LOCAL]

        def local_pairs() -> Pairs:  # pack-free: each run straight from the trainer's view into mine
            src = src_tensors_by_train_rank
            return [p for b in local for p in direct_pairs(segments(b), src[b.src_rank], dst_tensors)]

        if local:
            # beside NVLink traffic, the copies take half the SMs: NCCL's kernels then start at once
            # instead of behind thousands of copy CTAs (measured: 4 GiB both ways with 4 GiB copied
            # alongside took 15.9 ms with the copy on every SM, 15.0 on half, 14.2 without the copy)
            programs = half_the_sms(dev) if units and ordered else None
            with torch.cuda.stream(side) if side is not None else _nothing():
                self._graphs.run(recv_plans, "local", local_pairs, dev, programs)
        inflight: deque = deque()
        posted: list = []
        for unit in units:
            if len(inflight) == self.window:
                free += self._finish(inflight.popleft(), dst_tensors, ordered)
            inflight.append(self._post(unit, stagings, src_tensors_by_train_rank, dst_tensors, free, dev, posted))
        while inflight:
            free += self._finish(inflight.popleft(), dst_tensors, ordered)
        if side is not None:
            torch.cuda.current_stream(dev).wait_stream(side)
        done_posting = time.perf_counter() - start
        if ordered:
            settle(posted, self.timeout.total_seconds(), dev, self.group)
        return ColocatedStats(*counts[_LOCAL], *counts[_SEND], *counts[_RECV], time.perf_counter() - start,
                              done_posting)

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
            if kind == _RECV and st.staged:
                self._graphs.run(b, ("unpack", slot.data_ptr()),
                                 lambda st=st, i=slot: unpack_pairs(st.staged, i, dst), slot.device)
        return [slot for _, _, _, slot, _ in held]

    def _coalesce(self, dev: torch.device) -> bool:
        if self._coalescing is None:  # every worker gets here in its first step (see coalescing())
            self._coalescing = coalescing(self.group, dev)
        return self._coalescing

    def _side_stream(self, dev: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(dev)
        return self._stream

    # -- internals ------------------------------------------------------------------------------
    def _ops(
        self,
        recv_plans: Plans,
        send_plans: Mapping[int, Plans],
        src_tensors: Mapping[int, Mapping[str, torch.Tensor]],
    ) -> list[tuple[str, Bucket, int | None]]:
        """Validate the plans and list (kind, bucket, peer) in the one global order."""
        me, ranks = self.me, self.ranks
        ops: list[tuple[str, Bucket, int | None]] = []
        local_recv: set[Bucket] = set()
        for pair, buckets in recv_plans.items():
            if ranks.receiver(pair) != me:
                raise TransportError(
                    f"group rank {me} was given the recv plan of {describe(pair)}, "
                    f"which group rank {ranks.receiver(pair)} receives",
                    pair=pair,
                )
            src = ranks.proxy(pair[0])
            for b in buckets:
                if b.nbytes == 0:
                    continue
                if src == me:
                    local_recv.add(b)
                    ops.append((_LOCAL, b, None))
                else:
                    ops.append((_RECV, b, src))
        local_send: set[Bucket] = set()
        for t, plans in send_plans.items():
            if t not in self.proxied:
                raise TransportError(
                    f"group rank {me} was given the send plan of training rank {t}, "
                    f"which group rank {ranks.proxy(t)} proxies (I proxy {self.proxied})",
                )
            for pair, buckets in plans.items():
                if pair[0] != t:
                    raise TransportError(f"the send plan of training rank {t} holds {describe(pair)}", pair=pair)
                dst = ranks.receiver(pair)
                for b in buckets:
                    if b.nbytes == 0:
                        continue
                    if dst == me:
                        local_send.add(b)  # done once, from the recv side
                    else:
                        ops.append((_SEND, b, dst))
        for t in self.proxied:  # both sides of my local copies must have been planned identically
            if t in send_plans:
                mine = {b for b in local_recv if b.src_rank == t}
                theirs = {b for b in local_send if b.src_rank == t}
                if mine != theirs:
                    raise TransportError(
                        f"group rank {me}: the local buckets of training rank {t} differ between its send plan "
                        f"({len(theirs)}) and my recv plan ({len(mine)}): the plans disagree"
                    )
        need = {b.src_rank for kind, b, _ in ops if kind != _RECV}
        if missing := need - set(src_tensors):
            raise TransportError(f"group rank {me}: no opened tensors of training rank(s) {sorted(missing)}")
        ops.sort(key=lambda op: order_key(op[1]))
        return ops

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
