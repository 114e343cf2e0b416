"""WeightReader: the inference side, one per instance, in the instance's control process.

It registers every worker (GPU) of its instance, checks the job like the writers do, and drives one
worker reader per GPU through :meth:`InferenceInstance.call`: each worker plans its own receives,
joins the train+inference group and, every step, receives its buckets straight into the engine's
live parameters. ``update(step)`` returns the step every worker now fully holds; after a failed
update ``version`` is None (the tensors are a mix of two steps) until a later update succeeds --
unless the reader is ``staged``: then each worker receives into a copy of its tensors (twice the
memory) and commits only a complete step, so a failed update leaves the old version intact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from weightsync.engines import make_layout
from weightsync.errors import WeightsMoved
from weightsync.meta.client import MetaClient, MetaError, MetaTimeout
from weightsync.plan.planner import DEFAULT_BUCKET_BYTES
from weightsync.runtime.doorbell import Doorbell, open_bells, wait_rung
from weightsync.runtime.instance import InferenceInstance, WorkerContext
from weightsync.runtime.job import (
    DEFAULT_MEMORY_BUDGET,
    JobShape,
    enforce_memory_budget,
    hashes_of,
    job_shape,
    register,
    wait_plan_proven,
    wait_side,
)
from weightsync.spec.model import spec_from_config
from weightsync.transport.colocated import buffer_slots
from weightsync.transport.p2p import DEFAULT_WINDOW, TransportError


class WeightReader:
    """Receives every step into one inference instance's live weights."""

    def __init__(
        self,
        instance: InferenceInstance,
        *,
        meta: str,
        job: str,
        instance_id: int,
        instances: int,
        token: str | None = None,
        colocate: bool = False,
        peer_copies: bool = True,
        transport: str = "p2p",
        directory: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        memory_budget: int | None = DEFAULT_MEMORY_BUDGET,
        timeout_s: float = 60.0,
        staged: bool = False,
        mode: str = "sync",
        push: bool = True,
    ):
        if mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
        if mode == "async" and (colocate or transport != "p2p"):
            raise ValueError("async mode runs over the p2p transport, separated (not co-located)")
        self.instance, self.instance_id, self.timeout_s = instance, instance_id, timeout_s
        self.staged, self.mode = staged, mode
        self._next_pull = 0
        self.client = MetaClient(meta, job, token=token, timeout=timeout_s)
        self.spec = spec_from_config(instance.model_config)
        dst = make_layout(self.spec, instance.engine)
        extra = {"colocate": colocate, "bucket_bytes": bucket_bytes, "instances": instances, "transport": transport,
                 "mode": mode}
        # co-located: can each worker read the other GPUs (CUDA peer access)? One that cannot makes the job
        # send those pieces through the workers' group instead
        reach = instance.call(_reaches_peers) if colocate and peer_copies else [peer_copies] * dst.world_size
        self.client.join(instance_id)
        for rank in range(dst.world_size):
            register(self.client, self.spec, "infer", rank, dst, dst.layout(rank), instance=instance_id,
                     extra={**extra, "peer_copies": reach[rank]})
        readers = wait_side(self.client, "infer", timeout_s, count=instances * dst.world_size)
        trainers = wait_side(self.client, "train", timeout_s)
        self.shape = job_shape(trainers + readers, colocate, bucket_bytes)
        # co-located workers write into each other's weights (``push``: their live tensors are exported
        # to each other by CUDA IPC; off when the engine's cannot be), unless each commits its own copy
        planned = instance.call(_plan, self.shape, dict(instance.model_config), instance_id, push and not staged,
                                timeout_s=timeout_s)
        if transport == "p2p":  # each worker keeps buffers as large as the largest bucket it moves
            slots = buffer_slots(DEFAULT_WINDOW) if colocate else DEFAULT_WINDOW
            for rank, (_, largest) in enumerate(planned):
                enforce_memory_budget(self.client, memory_budget, slots, largest, f"instance {instance_id} rank {rank}")
        participants = len(trainers) + len(readers)
        # sync: the trainers on this host wait for our `held` on this bell rather than on the MetaServer
        self._held_bell = Doorbell() if mode == "sync" else None
        if self._held_bell is not None:
            self.client.publish(f"bell.held.{instance_id}", self._held_bell.address, replace=True)
        for rank, (pairs, _) in enumerate(planned):
            self.client.post_plan_hashes("infer", rank, pairs, instance=instance_id)
        wait_plan_proven(self.client, timeout_s, participants)
        # co-located: the trainers' `written` bells, when every trainer is on this host
        self._written_bells = (open_bells(self.client, [f"bell.written.{t}" for t in range(self.shape.train_world)],
                                          timeout_s) if colocate and mode == "sync" else None)
        backend = trainers[0]["engine_config"].get("backend", "gloo")
        self.colocate = colocate
        if transport == "file":
            if not directory:
                raise ValueError("the file transport needs a directory")
            instance.call(_connect_file, directory, timeout_s, timeout_s=timeout_s)
        elif colocate:
            link = (self.client.url, job, token)
            instance.call(_connect_colocated, link, backend, timeout_s, timeout_s=timeout_s * 2)
        else:
            address = self.client.lookup("group", timeout=timeout_s)
            instance.call(_connect, address, backend, timeout_s, mode == "sync", timeout_s=timeout_s * 2)
        self.version: int | None = None
        self._announcer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-held")
        self._report_error: Exception | None = None  # the first held report that failed, until raised
        self.last_stats: list[dict] = []
        #: seconds the last update spent waiting for the trainers (co-located), in the workers (of which
        #: ``transport`` in the slowest worker's transport, ``posting`` until its CPU had posted everything,
        #: co-located ``started`` until it posted its first copy) and handing the step's ``held`` report over
        self.last_timing: dict[str, float] = {}

    def update(self, step: int) -> int:
        """Receive step ``step`` into every worker; return it once every worker fully holds it."""
        if self.mode != "sync":
            raise ValueError("update(step) is for sync mode; in async mode call pull()")
        t0 = time.perf_counter()
        self._check_announced(wait=False)
        recorded = None
        if self.colocate:  # the trainers' shared weights hold `step` once every trainer announced it
            try:
                wait_rung(self._written_bells, step, self.timeout_s,
                          lambda t: self.client.wait_written(step, timeout=t))
            except MetaTimeout as e:  # nothing copied yet: say so, and what the workers still hold
                raise MetaTimeout(f"instance {self.instance_id}: not every training rank announced step {step} "
                                  f"within {self.timeout_s:g} s, so nothing of it was copied; the workers still "
                                  f"hold step {self.version} ({e})") from e
            if self._written_bells is not None:
                # a trainer rings before it checks its weights are where it shared them, and records the
                # step on the MetaServer after: copy now, report the step held only once it is recorded
                # (a staged step is committed inside the workers: copy it only from recorded weights)
                recorded = self._announcer.submit(self.client.wait_written, step, timeout=self.timeout_s)
                if self.staged:
                    recorded.result()
        if not self.staged:
            self.version = None  # from here until success the live tensors may mix two steps
        t1 = time.perf_counter()
        self.instance.pause()
        try:
            self.last_stats = self.instance.call(_receive, step, self.staged, timeout_s=self.timeout_s * 2)
            self.instance.after_update()
        except WeightsMoved as e:  # no later step can succeed either: stop the trainers waiting for us now
            with contextlib.suppress(MetaError):
                self.client.abort(str(e))
            raise
        finally:
            self.instance.resume()
        if recorded is not None:
            recorded.result()  # long done, normally: raises MetaAborted for a trainer that found its weights moved
        t2 = time.perf_counter()
        self.version = step
        self.instance.set_version(step)
        self._announce(step)
        self.last_timing = {"wait_written": t1 - t0, "workers": t2 - t1, "held": time.perf_counter() - t2,
                            "transport": max(s["seconds"] for s in self.last_stats),
                            "posting": max(s["posted"] for s in self.last_stats)}
        if self.colocate:
            self.last_timing["started"] = max(s["started"] for s in self.last_stats)
        return step

    def pull(self, attempts: int = 5) -> int:
        """Async mode: receive the latest staged step; return it (pulling again while steps were mixed)."""
        from weightsync.runtime.pull import claim_pull

        if self.mode != "async":
            raise ValueError("pull() is for async mode; in sync mode call update(step)")
        for _ in range(attempts):
            n = claim_pull(self.client, self.instance_id, self._next_pull)
            self._next_pull = n + 1
            if not self.staged:
                self.version = None
            self.instance.pause()
            try:
                results = self.instance.call(_pull, self.staged, timeout_s=self.timeout_s * 2)
                self.instance.after_update()
            finally:
                self.instance.resume()
            steps = set().union(*(r["steps"] for r in results))
            self.last_stats = results
            if len(steps) == 1:
                self.version = steps.pop()
                self.instance.set_version(self.version)
                self._announce(self.version)
                return self.version
        raise TransportError(f"instance {self.instance_id}: training ranks kept serving different steps")

    def _announce(self, step: int) -> None:
        """Report ``step`` held to the MetaServer off the critical path: the workers already hold it
        whole, so the instance may serve it now; the trainers, waiting for the report before they
        overwrite their weights, see it one round trip later (on this host at once, by the bell).
        Reports go out in order, one at a time (one thread); the first that fails is kept and raises
        at the next update (the trainers meanwhile time out waiting for it)."""
        if self._held_bell is not None:
            self._held_bell.ring(step)
        self._announcer.submit(self._report, step)

    def _report(self, step: int) -> None:
        try:
            self.client.held(self.instance_id, step)
        except Exception as e:  # noqa: BLE001 - raised in the caller's thread by _check_announced
            self._report_error = self._report_error or e

    def _check_announced(self, wait: bool) -> None:
        """Raise the first failed report's error (``wait``: once every report so far went out)."""
        if wait:
            self._announcer.submit(lambda: None).result(timeout=self.timeout_s)
        e, self._report_error = self._report_error, None
        if e is not None:
            raise e

    def close(self) -> None:
        try:
            self._check_announced(wait=True)
        finally:
            self._announcer.shutdown(wait=False)
            if self._held_bell is not None:
                self._held_bell.close()
            self.instance.call(_disconnect, timeout_s=self.timeout_s)


# -- functions run on every worker of the instance ------------------------------------------------


def _reaches_peers(ctx: WorkerContext) -> bool:
    """Whether this worker can read every other GPU it sees (CUDA peer access; always on CPU). A worker
    that sees only its own GPU cannot reach the others' memory at all."""
    import torch

    if ctx.device.type != "cuda":
        return True
    mine, n = _gpu_index(ctx), torch.cuda.device_count()
    return n > 1 and all(torch.cuda.can_device_access_peer(mine, d) for d in range(n) if d != mine)


def _gpu_index(ctx: WorkerContext) -> int:
    import torch

    return ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()


def _plan(ctx: WorkerContext, shape: JobShape, model_config: dict, instance_id: int,
          push: bool = False) -> tuple[dict, int]:
    """Plan this worker's receives; keep the plan; return its pair hashes and the largest bucket it will
    buffer (co-located: only those going through the workers' group, received or sent for the training
    rank it proxies; direct copies need no buffer). ``push``: co-located, this instance's workers write
    their own GPU's trainers' pieces into each other (:meth:`ColocatedRanks.pusher`)."""
    spec = spec_from_config(model_config)
    planner = shape.planner(spec)
    plans = planner.recv_plan(instance_id, ctx.rank)
    ctx.state.update(plans=plans, shape=shape, instance=instance_id, planner=planner)
    buckets = [b for bs in plans.values() for b in bs]
    if shape.colocate:
        ranks = dataclasses.replace(shape.colocated_ranks(), push=push)
        me = ranks.infer(instance_id, ctx.rank)
        # what it sends for the training rank it proxies and pushes for those on its GPU
        send_plans = {t: planner.send_plan(t) for t in ranks.send_plan_ranks(me)}
        ctx.state.update(send_plans=send_plans, colocated_ranks=ranks)
        buckets = [b for b in buckets + [b for ps in send_plans.values() for bs in ps.values() for b in bs]
                   if not ranks.direct(b.src_rank, ranks.receiver(b.pair))]
    return hashes_of(plans), max((b.nbytes for b in buckets), default=0)


def _connect(ctx: WorkerContext, address: str, backend: str, timeout_s: float, coalesce: bool) -> None:
    """Join the train+inference group (built once, reused every step); ``coalesce`` in sync jobs, where
    every rank runs every step (see :func:`weightsync.transport.p2p.coalescing`)."""
    from weightsync.transport.group import new_group
    from weightsync.transport.p2p import JobRanks, P2PTransport

    shape: JobShape = ctx.state["shape"]
    ranks = JobRanks(shape.train_world, shape.infer_world, shape.instances)
    host, port = address.rsplit(":", 1)
    me = ranks.infer(ctx.state["instance"], ctx.rank)
    device = ctx.device if ctx.device.type == "cuda" else None
    group = new_group(host, int(port), me, ranks.world_size, backend, timeout_s, device=device, name="weightsync")
    ctx.state["transport"] = P2PTransport(group, ranks, timeout_s=timeout_s, coalesce=coalesce)


def _connect_colocated(ctx: WorkerContext, link: tuple, backend: str, timeout_s: float) -> None:
    """Open the tensors of the training ranks this worker reads or proxies; join the inference-only group
    when some bucket goes through it (on one host with peer access every bucket is a direct copy)."""
    from weightsync.transport.colocated import ColocatedTransport
    from weightsync.transport.group import free_port, new_group
    from weightsync.transport.share import addresses, open_shared, share_tensors

    url, job, token = link
    client = MetaClient(url, job, token=token, timeout=timeout_s)
    ranks = ctx.state["colocated_ranks"]
    me = ranks.infer(ctx.state["instance"], ctx.rank)
    group = None
    if ranks.needs_group:
        if me == 0:
            host, port = "127.0.0.1", free_port()
            client.publish("colocated-group", f"{host}:{port}")
        else:
            host, port_s = client.lookup("colocated-group", timeout=timeout_s).rsplit(":", 1)
            port = int(port_s)
        device = ctx.device if ctx.device.type == "cuda" else None
        group = new_group(host, port, me, ranks.world_size, backend, timeout_s, device=device, name="weightsync-colo")
    # opened in this worker's own CUDA context, wherever on the host they lie: another GPU's memory is
    # reached by peer access (NVLink) without a context on that GPU
    mine = _gpu_index(ctx) if ctx.device.type == "cuda" else None
    sources = {t: open_shared(client.lookup(f"share.{t}.{me}", timeout=timeout_s), mine)
               for t in ranks.sources(me, ctx.state["plans"], ctx.state["send_plans"])}
    # pushing: my instance's workers open my live tensors (one export each), I open theirs
    pushers = ranks.pushers_into(me, ctx.state["plans"])
    for p in pushers:
        path = share_tensors(ctx.tensors, job, f"infer{me}-for{p}")
        client.publish(f"push.{me}.{p}", path, replace=True)
    if pushers:  # they write where my tensors were shared: each step checks they are still there
        ctx.state["shared_at"] = addresses(ctx.tensors)
    targets = {g: open_shared(client.lookup(f"push.{g}.{me}", timeout=timeout_s), mine)
               for g in ranks.pushes(me, ctx.state["send_plans"])}
    ctx.state.update(transport=ColocatedTransport(group, ranks, me=me, timeout_s=timeout_s), sources=sources,
                     push_targets=targets)


def _connect_file(ctx: WorkerContext, directory: str, timeout_s: float) -> None:
    from weightsync.transport.file import FileTransport

    ctx.state["transport"] = FileTransport(directory, timeout_s=timeout_s)


def _pull(ctx: WorkerContext, staged: bool) -> dict[str, Any]:
    """Async pull on a worker: headers (the steps served), then the data; commit when staged and whole."""
    import torch

    from weightsync.runtime.pull import receive_pull

    plans = ctx.state["plans"]
    targets = _targets(ctx, staged)
    with torch.no_grad():
        steps, s = receive_pull(ctx.state["transport"], plans, targets)
        if staged and len(steps) == 1:
            _commit(ctx, plans, targets)
    return {"rank": ctx.rank, "steps": steps, "bytes": s.bytes, "seconds": s.seconds, "buckets": s.buckets}


def _targets(ctx: WorkerContext, staged: bool) -> dict:
    """Where a step lands: the live tensors, or (staged) a copy allocated once."""
    import torch

    if not staged:
        return ctx.tensors
    return ctx.state.setdefault("stage", {n: torch.empty_like(t) for n, t in ctx.tensors.items()})


def _commit(ctx: WorkerContext, plans, targets) -> None:
    """Copy exactly the planned regions of a complete staged step into the live tensors."""
    from weightsync.layout.box import slices

    for bs in plans.values():
        for b in bs:
            for c in b.copies:
                box = slices(c.dst_box)
                ctx.tensors[c.dst_tensor][box].copy_(targets[c.dst_tensor][box])


def _receive(ctx: WorkerContext, step: int, staged: bool = False) -> dict[str, Any]:
    """Receive one step into the live tensors, or (staged) into a copy committed only once complete."""
    import torch

    from weightsync.transport.file import FileTransport

    plans = ctx.state["plans"]
    targets = _targets(ctx, staged)
    with torch.no_grad():
        if isinstance(ctx.state["transport"], FileTransport):
            s = ctx.state["transport"].recv(plans, targets, step=step)
            nbytes, buckets = s.bytes, s.buckets
        elif "sources" in ctx.state:  # co-located
            check = functools.partial(_check_pushed_into, ctx) if "shared_at" in ctx.state else None
            s = ctx.state["transport"].run(plans, ctx.state["send_plans"], targets, ctx.state["sources"],
                                           ctx.state["push_targets"], during=check)  # checked while copying
            nbytes, buckets = s.bytes, s.buckets
        else:
            s = ctx.state["transport"].recv(plans, targets)
            nbytes, buckets = s.bytes, s.buckets
        if staged:  # every byte arrived: commit exactly the planned regions (padding stays untouched)
            _commit(ctx, plans, targets)
    return {"rank": ctx.rank, "step": step, "bytes": nbytes, "seconds": s.seconds, "posted": s.posted,
            "buckets": buckets, "pushed_bytes": getattr(s, "pushed_bytes", 0), "started": getattr(s, "started", 0.0)}


def _check_pushed_into(ctx: WorkerContext) -> None:
    """My instance's other workers write where my tensors were shared: raise if one moved since."""
    from weightsync.transport.share import check_in_place

    check_in_place(ctx.tensors, ctx.state["shared_at"], f"instance {ctx.state['instance']} worker {ctx.rank}",
                   "the instance's other workers, which write their pieces into it")


def _disconnect(ctx: WorkerContext) -> None:
    ctx.state.pop("transport", None)
