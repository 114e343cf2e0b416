"""Async mode: writers stage a snapshot and return; instances pull the latest step when they choose.

Writer side. ``write(step)`` copies this rank's weights into a snapshot (memory: this rank's own
shard, allocated once) and returns: training goes on while instances pull. A serving thread takes
pull requests in ONE global order, ``pull.0``, ``pull.1``, ... on the MetaServer (a reader claims the
next free number; first publisher wins), so every training rank serves the same instance at the same
time, one instance after the other -- which keeps the point-to-point order deadlock-free on NCCL as
on gloo. Serving instance i sends, to each of its receivers, first a header (the snapshot's step),
then the buckets of its pairs, from the snapshot. ``write`` waits while a pull is being served.

Reader side. A pull receives the headers, then the data, into the live weights (or the staging copy).
If the training ranks served different steps (one re-staged between two pulls' claims), the
instance holds a mix: the reader says so (no version) and pulls again, so it only ever reports a
step that every byte of the instance came from.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Mapping, Protocol

import torch
from torch.distributed import ProcessGroup

from weightsync.meta.client import MetaClient, MetaError, MetaTimeout
from weightsync.errors import TransportError
from weightsync.plan.job import JobRanks
from weightsync.plan.planner import Bucket, Pair
from weightsync.transport.fence import Fence

HEADER_TAG = 1 << 24  # distinct from bucket tags (bucket indices)


class Mover(Protocol):
    """What a pull needs of the point-to-point transport (:class:`weightsync.transport.p2p.P2PTransport`)."""

    group: ProcessGroup
    ranks: JobRanks
    timeout: timedelta

    def send(self, plans: Mapping[Pair, list[Bucket]], tensors: Mapping[str, torch.Tensor]) -> Any: ...

    def recv(self, plans: Mapping[Pair, list[Bucket]], tensors: Mapping[str, torch.Tensor],
             fence: Fence | None = None) -> Any: ...


def claim_pull(client: MetaClient, instance: int, start: int) -> int:
    """Claim the next free pull number for ``instance``; return it."""
    n = start
    while True:
        try:
            if client.publish(f"pull.{n}", str(instance))["changed"]:
                return n
        except MetaError as e:
            if e.status != 409:
                raise
        n += 1


class PullServer:
    """The writer's serving thread (see the module docstring)."""

    def __init__(self, client: MetaClient, transport: Mover, plans: Mapping[Pair, list[Bucket]],
                 tensors: Mapping[str, torch.Tensor], timeout_s: float):
        self.client, self.transport, self.timeout_s = client, transport, timeout_s
        self.plans = plans
        used = {c.src_tensor for bs in plans.values() for b in bs for c in b.copies}
        self.live = {n: tensors[n] for n in used}
        self.snapshot = {n: torch.empty_like(t) for n, t in self.live.items()}
        self.step: int | None = None
        self.lock = threading.Condition()
        self.error: BaseException | None = None
        self._stop = False
        self.thread = threading.Thread(target=self._serve, name="weightsync-pull-server", daemon=True)
        self.thread.start()

    def stage(self, step: int) -> None:
        """Copy the live weights into the snapshot (waits while a pull is served)."""
        if self.error is not None:
            raise TransportError(f"the pull server failed earlier: {self.error}") from self.error
        with self.lock, torch.no_grad():
            for n, t in self.live.items():
                self.snapshot[n].copy_(t)
            self.step = step
            self.lock.notify_all()

    def close(self) -> None:
        self._stop = True

    def _serve(self) -> None:
        n = 0
        try:
            while not self._stop:
                try:
                    instance = int(self.client.lookup(f"pull.{n}", timeout=min(5.0, self.timeout_s)))
                except MetaTimeout:
                    continue
                with self.lock:
                    while self.step is None and not self._stop:  # nothing written yet: wait for the first step
                        self.lock.wait(timeout=0.5)
                    if self._stop:
                        return
                    self._send(instance)
                n += 1
        except BaseException as e:  # surfaced by the next write()
            self.error = e

    def _send(self, instance: int) -> None:
        mine = {p: b for p, b in self.plans.items() if p[1] == instance}
        device = next(iter(self.snapshot.values())).device
        header = torch.tensor([self.step], dtype=torch.int64, device=device)
        ranks: JobRanks = self.transport.ranks
        group = self.transport.group
        works = [group.send([header], ranks.receiver(p), HEADER_TAG) for p in sorted(mine)]
        for w in works:
            w.wait(timeout=self.transport.timeout)
        self.transport.send(mine, self.snapshot)


def receive_pull(transport: Mover, plans: Mapping[Pair, list[Bucket]],
                 targets: Mapping[str, torch.Tensor], fence: Fence | None = None) -> tuple[set[int], Any]:
    """Worker side of one pull: the steps the training ranks served, and the transfer stats. ``fence``: the data
    lands through it (:mod:`weightsync.transport.fence`), begun once every header arrived."""
    device = next(iter(targets.values())).device
    ranks: JobRanks = transport.ranks
    headers = {p: torch.empty(1, dtype=torch.int64, device=device) for p in sorted(plans)}
    works = [transport.group.recv([headers[p]], ranks.sender(p), HEADER_TAG) for p in sorted(plans)]
    for w in works:
        w.wait(timeout=transport.timeout)
    if fence is not None:
        fence.begin()
    stats = transport.recv(plans, targets, fence=fence)
    return {int(h.item()) for h in headers.values()}, stats
