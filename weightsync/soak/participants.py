"""A soak's processes: training ranks that write each step's weights, and readers that receive and check them.

Both run under the local runner (:func:`weightsync.local.runner.start_participant`), one process each, and
report through ``emit`` (:mod:`weightsync.soak.events`). Every step's weights are known to everyone
(:func:`~weightsync.soak.config.step_weights`): a trainer sets its real model's shards to them before each
write (FSDP2 DTensor shards under ``fsdp``), and a reader compares every piece its workers hold with them after
every update -- and, after a failed update, the version it still claims. That check is the soak's invariant:
no reader reports a version it does not hold bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch

from weightsync.errors import InstanceError, WeightSyncError
from weightsync.local.events import Ready, StepStarted
from weightsync.local.runner import Emit
from weightsync.soak.config import SoakConfig, step_weights
from weightsync.soak.events import Claim, Held, InstanceUp, Noticed, Rejoined, Stepped, Training

JOB = "soak"


def transport_args(cfg: SoakConfig, directory: str) -> dict[str, Any]:
    """The WeightWriter/WeightReader options every participant of the soak's job shares."""
    args: dict[str, Any] = {"transport": cfg.transport, "mode": cfg.mode, "timeout_s": cfg.timeout_s,
                            "bucket_bytes": 64 << 10}
    if cfg.transport == "file":
        args["directory"] = directory
    return args


# -- training ranks ---------------------------------------------------------------------------------


def trainer_main(emit: Emit, rank: int, world: int, port: int, meta: str, cfg: SoakConfig, first: int,
                 directory: str, stop_path: str, token: str | None = None, train_path: str | None = None) -> None:
    """Training rank ``rank``: its own gloo default group, a real trainer of ``cfg.train``, one WeightWriter; from
    step ``first`` on it sets the model to the step's weights and writes them, until ``stop_path`` exists. While
    ``train_path`` exists the ranks train (write nothing) before their next step, as long as the driver wants: a
    step that takes longer than ``timeout_s``, or a quiet moment for planting files."""
    from datetime import timedelta

    import torch.distributed as dist

    from weightsync.layout.materialize import fill_from
    from weightsync.local.trainers import build_trainer
    from weightsync.runtime.writer import WeightWriter
    from weightsync.spec import load_spec

    torch.set_num_threads(1)
    spec = load_spec(cfg.model)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.timeout_s))
    trainer = build_trainer(spec, cfg.train, rank, world)
    bound = trainer.bound
    elastic = {"instance_timeout_s": cfg.instance_timeout_s} if cfg.mode == "sync" else {}
    writer = WeightWriter(bound, meta=meta, job=JOB, token=token, **transport_args(cfg, directory), **elastic)
    try:
        _noticing(emit, writer.connect)
        emit(Ready(emit.participant))
        flags = torch.zeros(2)
        step = first
        training = False
        while True:
            flags[0] = float(os.path.exists(stop_path))
            flags[1] = float(train_path is not None and os.path.exists(train_path))
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every rank stops, or trains on, after the same step
            if flags[0].item():
                break
            if flags[1].item():  # training: the next step is not written until the driver says
                if not training:
                    emit(Training(emit.participant, step, time.time()))
                training = True
                time.sleep(0.05)
                continue
            training = False
            with torch.no_grad():
                fill_from(bound.layout, bound.tensors, step_weights(cfg, spec, step))
            dropped = dict(writer.dropped)
            emit(StepStarted(emit.participant, step, time.time()))
            t0 = time.perf_counter()
            _noticing(emit, writer.write, step)
            emit(Stepped(emit.participant, step, time.perf_counter() - t0, time.time()))
            for i, s in writer.dropped.items():
                if dropped.get(i) != s:
                    emit(Noticed(emit.participant, "Dropped", f"instance {i} did not hold step {s} in time",
                                 time.time()))
            step += 1
            time.sleep(cfg.step_pause_s)
    finally:
        with contextlib.suppress(Exception):
            writer.close()
    dist.destroy_process_group()


def _noticing(emit: Emit, fn: Any, *args: Any) -> Any:
    """``fn(*args)``; a weightsync error is reported as :class:`Noticed` before it is raised."""
    try:
        return fn(*args)
    except WeightSyncError as e:
        emit(Noticed(emit.participant, type(e).__name__, str(e).splitlines()[0] if str(e) else "", time.time()))
        raise


# -- inference instances ----------------------------------------------------------------------------


def reader_main(emit: Emit, inst: int, meta: str, cfg: SoakConfig, directory: str, token: str | None = None) -> None:
    """Instance ``inst``: a layout-faithful instance of ``cfg.infer`` (worker processes, NaN-poisoned) and a
    WeightReader that joins the job (again, after a restart: under the same id). Every update is checked bit
    for bit; after a failed one, the version the reader still claims is checked, then the reader leaves its
    session and joins again in this process. A failure of the instance itself (a worker died or stalled: it is
    shut down) ends the process, as an engine's crash would; the soak's driver restarts it."""
    from weightsync.local.instances import build_instance
    from weightsync.spec import load_spec

    torch.set_num_threads(1)
    spec = load_spec(cfg.model)
    local = build_instance(spec, cfg.infer, seed=99)
    emit(InstanceUp(emit.participant, tuple(getattr(local.instance, "pids", ())), time.time()))
    try:
        joined = 0
        while True:
            reader = _join(emit, local.instance, inst, meta, cfg, directory, token)
            if joined:
                emit(Rejoined(emit.participant, max(1, reader.since) if cfg.mode == "sync" else 0, time.time()))
            joined += 1
            try:
                _serve(emit, reader, local.instance, spec, cfg)
            except InstanceError as e:  # the instance is shut down: end, as a crashed engine would
                emit(Noticed(emit.participant, type(e).__name__, _first_line(e), time.time()))
                emit(Claim(emit.participant, reader.version, None, ("the instance is shut down",), time.time()))
                raise
            except WeightSyncError as e:
                emit(Noticed(emit.participant, type(e).__name__, _first_line(e), time.time()))
                _check_claim(emit, reader, local.instance, spec, cfg)
                with contextlib.suppress(Exception):
                    reader.close()
    finally:
        local.close()


def _join(emit: Emit, instance: Any, inst: int, meta: str, cfg: SoakConfig, directory: str, token: str | None):
    from weightsync.runtime.reader import WeightReader

    liveness = {"instance_timeout_s": cfg.instance_timeout_s} if cfg.mode == "async" else {}
    reader = WeightReader(instance, meta=meta, job=JOB, token=token, instance_id=inst, instances=cfg.readers,
                          staged=cfg.is_staged(inst), **transport_args(cfg, directory), **liveness)
    _noticing(emit, reader.connect)
    emit(Ready(emit.participant))
    return reader


def _serve(emit: Emit, reader: Any, instance: Any, spec: Any, cfg: SoakConfig) -> None:
    """Update (sync: every step from the first this reader holds; async: pull the latest) and check, until a
    call raises."""
    step = max(1, reader.since) if cfg.mode == "sync" else 0  # since: 0 for the instances the job started with
    while True:
        if cfg.mode == "sync":
            got = reader.update(step)
            step = got + 1
        else:
            got = reader.pull()
            time.sleep(cfg.step_pause_s)
        problems = _verify(instance, spec, cfg, got)
        emit(Held(emit.participant, got, not problems, tuple(problems[:3]), time.time()))


def _check_claim(emit: Emit, reader: Any, instance: Any, spec: Any, cfg: SoakConfig) -> None:
    """After a failed update: the version the reader still claims, checked (staged: the previous one, whole)."""
    version = reader.version
    if version is None:
        emit(Claim(emit.participant, None, None, (), time.time()))
        return
    try:
        problems = _verify(instance, spec, cfg, version)
    except InstanceError as e:
        emit(Claim(emit.participant, version, None, (f"not checked: {_first_line(e)}",), time.time()))
        raise
    emit(Claim(emit.participant, version, not problems, tuple(problems[:3]), time.time()))


def _verify(instance: Any, spec: Any, cfg: SoakConfig, step: int) -> list[str]:
    return [p for ps in instance.call(verify_worker, cfg, step, timeout_s=cfg.timeout_s) for p in ps]


def verify_worker(ctx: Any, cfg: SoakConfig, step: int) -> list[str]:
    """On a worker: the pieces whose values differ from step ``step``'s weights (none: bit-exact)."""
    from weightsync.engines import make_layout
    from weightsync.layout.box import slices
    from weightsync.spec import load_spec
    from weightsync.testing import differences

    spec = load_spec(cfg.model)
    ref = step_weights(cfg, spec, step)
    layout = make_layout(spec, cfg.infer).layout(ctx.rank)
    differ = differences(layout, ctx.tensors, lambda p: ref[p.canonical][slices(p.canon_box)])
    return [f"rank {ctx.rank}: {d}" for d in differ]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


__all__ = ["JOB", "reader_main", "trainer_main", "transport_args", "verify_worker"]
