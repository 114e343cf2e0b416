"""WeightWriter: the training side, one per training process.

Set-up (once): register with the MetaServer, wait for the whole job, cross-check it, plan this
rank's sends, prove the plan (pair hashes), and build the train+inference group. Every step,
``write(step)`` sends this rank's buckets from the live parameters and returns once they left
(async) or once every instance holds the step (sync).
"""

from __future__ import annotations

import contextlib
import time
from typing import Protocol

import torch

from weightsync.errors import WeightsMoved
from weightsync.layout.layout import EngineLayout, Layout
from weightsync.meta.client import MetaClient, MetaError
from weightsync.plan.planner import DEFAULT_BUCKET_BYTES
from weightsync.runtime.doorbell import Doorbell, open_bells, wait_rung
from weightsync.runtime.job import (
    DEFAULT_MEMORY_BUDGET,
    enforce_memory_budget,
    hashes_of,
    job_shape,
    register,
    wait_plan_proven,
    wait_side,
)
from weightsync.runtime.pull import PullServer
from weightsync.spec.model import ModelSpec
from weightsync.transport.file import FileTransport
from weightsync.transport.group import free_port, new_group
from weightsync.transport.p2p import DEFAULT_WINDOW, JobRanks, P2PTransport, TransferStats
from weightsync.transport.share import addresses, check_in_place, share_tensors


class TrainSide(Protocol):
    """A training process's live weights bound to its layout (see :mod:`weightsync.bind`)."""

    engine: EngineLayout
    rank: int
    layout: Layout
    tensors: dict[str, torch.Tensor]
    spec: ModelSpec


class WeightWriter:
    """Sends this training rank's part of every step to every inference instance."""

    def __init__(
        self,
        train: TrainSide,
        *,
        meta: str,
        job: str,
        token: str | None = None,
        mode: str = "sync",
        colocate: bool = False,
        peer_copies: bool = True,
        transport: str = "p2p",
        directory: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        memory_budget: int | None = DEFAULT_MEMORY_BUDGET,
        backend: str | None = None,
        timeout_s: float = 60.0,
        host: str = "127.0.0.1",
    ):
        if mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
        if transport not in ("p2p", "file") or (transport == "file" and (not directory or colocate)):
            raise ValueError("transport is 'p2p' or 'file' (with a directory, not co-located)")
        if mode == "async" and (colocate or transport != "p2p"):
            raise ValueError("async mode runs over the p2p transport, separated (not co-located)")
        self.train, self.mode, self.timeout_s = train, mode, timeout_s
        self.client = MetaClient(meta, job, token=token, timeout=timeout_s)
        device = self._device = next(iter(train.tensors.values())).device
        self.backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        register(self.client, train.spec, "train", train.rank, train.engine, train.layout,
                 extra={"colocate": colocate, "bucket_bytes": bucket_bytes, "backend": self.backend,
                        "transport": transport, "mode": mode, "peer_copies": peer_copies})
        trainers = wait_side(self.client, "train", timeout_s, count=train.engine.world_size)
        readers = wait_side(self.client, "infer", timeout_s)
        self.shape = job_shape(trainers + readers, colocate, bucket_bytes)
        planner = self.shape.planner(train.spec, src=train.engine)
        self.plans = planner.send_plan(train.rank)
        if transport == "p2p" and not colocate:  # co-located, the inference workers hold the buffers
            largest = max((b.nbytes for bs in self.plans.values() for b in bs), default=0)
            enforce_memory_budget(self.client, memory_budget, DEFAULT_WINDOW, largest, f"training rank {train.rank}")
        participants = len(trainers) + len(readers)
        # co-located readers wait for our `written` on this bell rather than on the MetaServer (published
        # before the plan is proven, so every bell is out once it is)
        self._written_bell = Doorbell() if colocate and mode == "sync" else None
        if self._written_bell is not None:
            self.client.publish(f"bell.written.{train.rank}", self._written_bell.address, replace=True)
        self.client.post_plan_hashes("train", train.rank, hashes_of(self.plans))
        wait_plan_proven(self.client, timeout_s, participants)
        # sync: the instances' `held` bells, when every reader is on this host
        self._held_bells = (open_bells(self.client, [f"bell.held.{i}" for i in range(self.shape.instances)], timeout_s)
                            if mode == "sync" else None)
        self.last: TransferStats | None = None
        #: seconds the last write spent sending, announcing the step and (sync) waiting until it is held
        self.last_timing: dict[str, float] = {}
        self.transport: P2PTransport | FileTransport | None = None
        self.server: PullServer | None = None
        self._step: int | None = None
        if transport == "file":
            self.transport = FileTransport(directory, step_fn=lambda: self._step, timeout_s=timeout_s)
            return
        if colocate:
            # the inference workers copy our weights straight out of our memory (and our proxy forwards
            # them to other hosts): share them once, one export per worker that opens them (CUDA IPC
            # counts one opening process per export)
            for g in self.shape.colocated_ranks().importers(train.rank, self.plans):
                path = share_tensors(train.tensors, job, f"train{train.rank}-for{g}")
                self.client.publish(f"share.{train.rank}.{g}", path)
            self._shared_at = addresses(train.tensors)  # after sharing: on CPU it moves them to shared memory
            return
        self.ranks = JobRanks(self.shape.train_world, self.shape.infer_world, self.shape.instances)
        if train.rank == 0:
            port = free_port(host)
            self.client.publish("group", f"{host}:{port}")
        else:
            host, port_s = self.client.lookup("group", timeout=timeout_s).rsplit(":", 1)
            port = int(port_s)
        group = new_group(host, port, self.ranks.train(train.rank), self.ranks.world_size, self.backend,
                          timeout_s, device=device if device.type == "cuda" else None, name="weightsync")
        # sync jobs run every rank every step, so each bucket's messages can go as one NCCL group
        self.transport = P2PTransport(group, self.ranks, timeout_s=timeout_s, coalesce=mode == "sync")
        self.server = PullServer(self.client, self.transport, self.plans, train.tensors, timeout_s) if mode == "async" else None

    @property
    def bytes_per_step(self) -> int:
        return sum(b.nbytes for bs in self.plans.values() for b in bs)

    def write(self, step: int) -> TransferStats | None:
        """Send step ``step``; in sync mode also wait until every instance holds it.

        Co-located, the weights are already shared: announcing the step lets the inference workers
        copy it, and (sync) waiting for them keeps the optimizer from changing it meanwhile.
        Async, the step is staged in a snapshot and this returns at once; instances pull it when they
        choose (:mod:`weightsync.runtime.pull`).
        """
        self._step = step
        if self.server is not None:
            self.server.stage(step)
            self.client.written(step, self.train.rank)
            return None
        t0 = time.perf_counter()
        if self.transport is not None:
            with torch.no_grad():
                self.last = self.transport.send(self.plans, self.train.tensors)
        elif self._device.type == "cuda":
            # co-located: other processes read the weights as soon as we announce them, outside any stream
            # order of ours, so the optimizer's kernels must have finished first (p2p sends are ordered
            # after them by the stream; the file transport's copies to host wait for them)
            torch.cuda.synchronize(self._device)
        t1 = time.perf_counter()
        if self._written_bell is not None:
            self._written_bell.ring(step)  # the workers on this host start copying now...
        if self.transport is None:
            # ...while we check they copy from where our weights are (~0.25 us a tensor: 1.6 ms for a
            # 30B stage's 6,300); their readers report the step held only once the MetaServer has it
            self._check_in_place(step)
        self.client.written(step, self.train.rank)
        t2 = time.perf_counter()
        if self.mode == "sync":
            instances = range(self.shape.instances)
            wait_rung(self._held_bells, step, self.timeout_s,
                      lambda t: self.client.wait_held(step, instances, timeout=t))
        self.last_timing = {"send": t1 - t0, "written": t2 - t1, "wait_held": time.perf_counter() - t2}
        return self.last

    def _check_in_place(self, step: int) -> None:
        """Co-located: refuse to record ``step`` as written when our weights moved since we shared them
        (the workers copied the old memory), and abort the job so the readers fail at once."""
        try:
            check_in_place(self.train.tensors, self._shared_at, f"training rank {self.train.rank}",
                           "the co-located inference workers")
        except WeightsMoved as e:
            error = WeightsMoved(f"{e} Step {step} is not recorded as written, so no instance reports it held.")
            with contextlib.suppress(MetaError):  # the error itself is what matters; the readers then time out
                self.client.abort(str(error))
            raise error from None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._written_bell is not None:
            self._written_bell.close()
        self.transport = None  # the group dies with its last reference

