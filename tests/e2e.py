"""End-to-end harness: real training processes and real inference instances syncing through a MetaServer.

Each training process builds a real engine (transformers, FSDP2 on gloo, or megatron-core on gloo:
:func:`weightsync.local.trainers.build_trainer`), binds it, and every step fills its live weights
with fresh random canonical data (the same seed on every rank) before ``write``; each inference
instance (a transformers model, or layout-faithful vLLM/SGLang worker processes) starts poisoned
with NaN, and after each ``update`` checks every tensor bit for bit against the data that step
should hold. Faults are injected by name. The processes run under
:class:`weightsync.local.runner.LocalJob` until every one has finished, so a test sees how each
side learnt of a fault; :func:`run_job` returns their typed events.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from weightsync.engines import make_layout
from weightsync.layout.materialize import fill_from, scatter
from weightsync.local.events import Event, Failed, Participant, Pulled, Ready, StepDone, UpdateFailed, Wrote
from weightsync.local.runner import Emit, JobResult, LocalJob
from weightsync.spec import load_spec
from weightsync.testing import random_canonical


def seed_of(step: int) -> int:
    return 100 + step


FP32_SCALE = 1 + 3 / 512  # moves bf16 values off the bf16 grid by ~3/4 ulp: the receiver must round to nearest


def step_canonical(spec, step: int, fp32: bool = False) -> dict:
    """The canonical weights of a step as the trainer holds them (fp32 master weights when ``fp32``)."""
    canonical = random_canonical(spec, seed_of(step))
    if fp32:
        canonical = {n: t.float() * FP32_SCALE for n, t in canonical.items()}
    return canonical


def expected_canonical(spec, step: int, fp32: bool = False) -> dict:
    """What an inference engine loading that step from a checkpoint holds, in canonical dtypes."""
    from weightsync.layout.materialize import TORCH_DTYPES

    return {n: t.to(TORCH_DTYPES[spec.by_name[n].dtype]) for n, t in step_canonical(spec, step, fp32).items()}


@dataclass(frozen=True)
class NeedRestart(Event):
    """A trainer waits before ``write(step)`` until the test has restarted the MetaServer."""

    step: int


# -- trainers ---------------------------------------------------------------------------------------


def _die_after(module, name: str, count: int) -> None:
    """Fault injection: the process exits abruptly inside the ``count``-th call of ``module.name``."""
    real = getattr(module, name)  # AttributeError when the hook point is renamed: the test must fail then
    calls = [0]

    def wrapped(*a, **k):
        calls[0] += 1
        if calls[0] == count:
            os._exit(3)
        return real(*a, **k)

    setattr(module, name, wrapped)


def _move_a_tensor(tensors: dict) -> None:
    """Reallocate the first tensor, keeping the object and its values (``p.data = p.data.clone()``)."""
    t = next(iter(tensors.values()))
    t.data = t.data.clone()


def trainer(emit: Emit, rank: int, world: int, port: int, meta: str, job: dict) -> None:
    import datetime

    import torch.distributed as dist

    from weightsync.local.trainers import build_trainer
    from weightsync.runtime.writer import WeightWriter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    spec = load_spec(job["model"])
    device = "cuda" if job.get("gpu_base") is not None and torch.cuda.is_available() else "cpu"
    bound = build_trainer(spec, job["train"], rank, world, device=device, fp32=job.get("fp32", False),
                          same_start=False).bound  # every step overwrites every weight
    writer = WeightWriter(bound, meta=meta, job=job["job"], timeout_s=job["timeout"], token=job.get("token"),
                          bucket_bytes=job.get("bucket_bytes", 256 << 20), mode=job.get("mode", "sync"),
                          memory_budget=job.get("memory_budget", 2 << 30),
                          colocate=job.get("colocate", False), transport=job.get("transport", "p2p"),
                          directory=job.get("directory"), peer_copies=job.get("peer_copies", True),
                          group=dist.group.WORLD if job.get("writer_group") else None, codec=job.get("codec"),
                          **({"integrity": job["integrity"]} if "integrity" in job else {})).connect()
    emit(Ready(emit.participant))
    if job.get("mode") == "async":
        for step in range(1, job["steps"] + 1):
            with torch.no_grad():
                fill_from(bound.layout, bound.tensors, step_canonical(spec, step))
            writer.write(step)  # returns at once: staged
            emit(Wrote(emit.participant, step))
            if step == 1:  # let instance 0 pull step 1 before moving on, so instances diverge
                writer.client.wait_held(1, [0], timeout=job["timeout"])
        writer.client.wait_held(job["steps"], range(job["instances"]), timeout=job["timeout"])
        return
    for step in range(1, job["steps"] + 1):
        if job.get("fault") == "train-moves" and rank == job.get("fault_rank", 0) and step == job["steps"]:
            _move_a_tensor(bound.tensors)  # as offloading and reloading would
        with torch.no_grad():
            fill_from(bound.layout, bound.tensors, step_canonical(spec, step, job.get("fp32", False)))
        if job.get("fault") == "train-dies-before-write" and rank == 0 and step == job["steps"]:
            # a crash after the optimizer step, before announcing it; first let the queue's feeder
            # thread finish our last message: killed while holding the queue's lock, it would block
            # every other process's messages for good
            emit.flush()
            os._exit(3)
        if job.get("fault") == "train-dies" and rank == 0 and step == job["steps"]:
            import weightsync.transport.p2p as p2p

            # die while posting the last step's fifth bucket: buckets 0-2 have surely landed by then
            # (window 2); post() runs for every bucket (packing may be a graph replay, or not needed)
            _die_after(p2p, "post", 5)
        if job.get("restart_meta_before") == step:
            emit(NeedRestart(emit.participant, step))
            _wait_file(job["restart_flag"], job["timeout"])
        writer.write(step)
        emit(Wrote(emit.participant, step))


def _wait_file(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.05)


# -- readers ----------------------------------------------------------------------------------------


def check_step(ctx, model: str, engine: str, step: int, fp32: bool = False) -> str:
    """On a worker: '' when every local tensor is bit-exact (padding still NaN), else the first problem."""
    spec = load_spec(model)
    want = scatter(make_layout(spec, engine).layout(ctx.rank), expected_canonical(spec, step, fp32))
    for name, exp in want.items():
        got = ctx.tensors[name].detach().cpu()
        if not (torch.equal(got.isnan(), exp.isnan()) and torch.equal(got.nan_to_num(), exp.nan_to_num())):
            return f"rank {ctx.rank}: {name} differs"
    return ""


def _die_in_worker(ctx) -> None:
    import weightsync.transport.p2p as p2p

    if ctx.reader.receiver.reads_after_written:  # co-located: die in the step's first batch of direct copies
        from weightsync.transport.batch_copy import BatchedCopy

        _die_after(BatchedCopy, "run", 1)
    elif ctx.device.type == "cuda":  # die with the step's receives all posted, waiting for them
        _die_after(p2p, "settle", 1)
    else:  # die mid-step, the first bucket received (gloo: the CPU waits bucket by bucket)
        _die_after(p2p, "post", 2)


def _stop_in_worker(ctx) -> None:
    """Worker rank 1 stops dead (SIGSTOP) as its next receive begins, before it posts anything: the peers that wait
    on it in a group learn it from its beat only."""
    if ctx.rank != 1:
        return
    import signal

    receiver = ctx.reader.receiver
    real = receiver.receive

    def receive(step, targets):
        os.kill(os.getpid(), signal.SIGSTOP)
        return real(step, targets)

    receiver.receive = receive


def _corrupt_in_worker(ctx) -> None:
    """Worker rank 0's next receive lands one flipped bit in its first planned destination box."""
    if ctx.rank != 0:
        return
    receiver = ctx.reader.receiver
    real = receiver.receive
    copy = next(c for bs in ctx.reader.plans.values() for b in bs for c in b.copies)

    def receive(step, targets):
        stats = real(step, targets)
        from weightsync.layout.box import slices

        region = targets[copy.dst_tensor][slices(copy.dst_box)]
        first = region[(0,) * region.dim()]  # a 0-d view of the box's first element
        first.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[first.element_size()]).bitwise_xor_(1 << 3)
        receiver.receive = real
        return stats

    receiver.receive = receive


def _move_in_worker(ctx) -> None:
    _move_a_tensor(ctx.tensors)


def reader(emit: Emit, inst: int, meta: str, job: dict) -> None:
    from weightsync.local.instances import build_instance
    from weightsync.runtime.reader import WeightReader

    torch.set_num_threads(1)
    spec = load_spec(job.get("infer_model", job["model"]))
    engine = job["infer"]
    gpu = job.get("gpu_base")
    device = f"cuda:{gpu + inst * make_layout(spec, engine).world_size}" if gpu is not None and engine != "hf" else "cpu"
    local = build_instance(spec, engine, device=device, seed=1)
    instance = local.instance
    try:
        r = WeightReader(instance, meta=meta, job=job["job"], instance_id=inst, instances=job["instances"],
                         timeout_s=job["timeout"], token=job.get("token"), bucket_bytes=job.get("bucket_bytes", 256 << 20),
                         memory_budget=job.get("reader_memory_budget", job.get("memory_budget", 2 << 30)),
                         colocate=job.get("colocate", False), peer_copies=job.get("reader_peer_copies", True),
                         transport=job.get("reader_transport", job.get("transport", "p2p")), directory=job.get("directory"),
                         staged=job.get("staged", False), mode=job.get("mode", "sync"), push=job.get("reader_push", True),
                         codec=job.get("codec"),
                         **({"integrity": job.get("reader_integrity", job["integrity"])} if "integrity" in job
                            else {})).connect()
        emit(Ready(emit.participant))
        if job.get("mode") == "async":
            waits = [1, job["steps"]] if inst == 0 else [job["steps"]]
            for step in waits:
                r.client.wait_written(step, timeout=job["timeout"])
                version = r.pull()
                problems = tuple(p for p in instance.call(check_step, spec.name, engine, version) if p)
                emit(Pulled(emit.participant, version, problems, r.client.summary()))
            return
        for step in range(1, job["steps"] + 1):
            if job.get("fault") == "infer-dies" and inst == 0 and step == job["steps"]:
                instance.call(_die_in_worker)
            if job.get("fault") == "infer-stops" and inst == 0 and step == job["steps"]:
                instance.call(_stop_in_worker)  # its rank 1 stops dead as step's receive begins
            if job.get("fault") == "infer-corrupts" and inst == 0 and step == job["steps"]:
                instance.call(_corrupt_in_worker)  # flips a bit of what lands (weightsync.integrity must catch it)
            if job.get("fault") == "infer-moves" and inst == 0 and step == job["steps"]:
                instance.call(_move_in_worker)
            t0 = time.perf_counter()
            try:
                r.update(step)
            except Exception as e:
                # what the instance holds now: still exactly the previous step? (staged readers promise it)
                intact = not any(instance.call(check_step, spec.name, engine, step - 1)) if step > 1 else None
                emit(UpdateFailed(emit.participant, step, type(e).__name__, str(e), r.version, intact))
                raise
            seconds = time.perf_counter() - t0
            problems = tuple(p for p in instance.call(check_step, spec.name, engine, step, job.get("fp32", False)) if p)
            moved = sum(s.bytes for s in r.last_stats)  # what this instance's workers received
            emit(StepDone(emit.participant, step, seconds, moved, not problems, version=r.version, problems=problems))
    finally:
        local.close()


# -- driver -----------------------------------------------------------------------------------------


def run_job(job: dict, meta_server=None, on_restart=None, on_event=None) -> JobResult:
    """Run trainers and readers for ``job`` until every one has finished; their events, in arrival order.

    ``on_restart(server) -> server``: called when a trainer asks for a MetaServer restart
    (``restart_meta_before``). ``on_event(event)``: called as each event arrives (to time them)."""
    from weightsync.transport.group import free_port

    job = {"job": "e2e", "steps": 2, "instances": 1, "timeout": 30.0, **job}
    spec = load_spec(job["model"])
    world = make_layout(spec, job["train"]).world_size
    server = [meta_server]

    def each(ev: Event) -> None:
        if isinstance(ev, NeedRestart) and on_restart is not None:
            server[0] = on_restart(server[0])
        if on_event is not None:
            on_event(ev)

    with LocalJob(deadline_s=job["timeout"] * (job["steps"] + 4), stop_on_failure=False, meta=meta_server,
                  meta_token=job.get("server_token"), exit_grace_s=5.0) as local:
        port = free_port()
        if "token" not in job:  # participants get their job's token, never the server's (admin) one
            job["token"] = local.job_token(job["job"])
        for r in range(world):
            local.add(Participant.trainer(r), trainer, r, world, port, local.meta_url, job)
        for i in range(job["instances"]):
            local.add(Participant.instance(i), reader, i, local.meta_url, job)
        return local.run(on_event=each)


def train_errors(result: JobResult) -> list[Failed]:
    return [f for f in result.failures if f.participant.role == "train"]


def infer_errors(result: JobResult) -> list[Failed]:
    return [f for f in result.failures if f.participant.role == "infer"]


def assert_clean(result: JobResult, job: dict) -> None:
    """No participant failed; every instance reported every step, at that version, bit-exact."""
    assert not result.failures, "\n".join(f"{f.line()}\n{f.traceback}" for f in result.failures)
    updated = result.of(StepDone)
    assert len(updated) == job["steps"] * job.get("instances", 1), result.events
    for u in updated:
        assert u.version == u.step
        assert u.problems == (), f"{u.participant} step {u.step}: {u.problems}"


__all__ = ["run_job", "assert_clean", "train_errors", "infer_errors", "check_step", "step_canonical",
           "expected_canonical", "NeedRestart", "UpdateFailed", "StepDone", "Pulled", "Wrote", "Failed"]
