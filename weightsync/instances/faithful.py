"""A layout-faithful inference instance: one worker process per rank of a vLLM / SGLang layout.

Each worker holds exactly the tensors (names, shapes, dtypes) a worker of that engine and parallel
config holds, allocated from the derived layout and filled with ``fill`` (NaN by default, so any
region a sync forgets shows up), on CPU or on ``cuda:rank``. The control process drives them the
way vLLM's ``collective_rpc`` drives its workers: :meth:`FaithfulInstance.call` sends
``(fn, args)`` to every worker over a multiprocessing pipe and gathers the results in rank order.

Failure handling (a call never hangs):

- a worker exception is re-raised in the control process as the same exception (or a
  :class:`~weightsync.instances.WorkerError` when it does not pickle), with the worker's traceback
  attached (note and ``__cause__``); the instance stays usable;
- a worker that dies, or workers that do not answer within ``timeout_s``, raise
  :class:`~weightsync.instances.WorkerDied` / :class:`~weightsync.instances.WorkerTimeout`; the
  instance is then shut down (a missing rank makes it useless, and stuck peers may be waiting on it)
  and later calls raise :class:`~weightsync.instances.InstanceError`.

Messages are pickled with plain :mod:`pickle` (tensors travel by value, never as shared-memory
handles), so ``fn`` must be a module-level function importable in the worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import threading
import time
import weakref
from typing import Any, Callable, Mapping

import torch

from weightsync.dtypes import dtype_name
from weightsync.engines import make_layout
from weightsync.instances import (
    InstanceError,
    WorkerDied,
    WorkerTimeout,
    error_record,
    rebuild_error,
)
from weightsync.layout.materialize import TORCH_DTYPES
from weightsync.runtime.instance import ClosedOnExit, NoEngineHooks, WorkerContext
from weightsync.spec.model import load_spec
from weightsync.transport.gate import Go, gated, run_gate

_STOP = -1

#: what a ``forkserver`` start imports once in the server, so each worker forks with it in memory instead of
#: importing torch again (~1.7 s of CPU a worker). The server is a fresh interpreter that never touches
#: CUDA (importing torch does not), so its forks may still take a GPU each.
PRELOAD = ["torch", "weightsync.instances.faithful"]


def snapshot(ctx: WorkerContext) -> dict[str, torch.Tensor]:
    """Every tensor of a worker, copied to CPU (for tests: ``inst.call(snapshot)``)."""
    return {name: t.detach().cpu().clone() for name, t in ctx.tensors.items()}


def live_shapes(ctx: WorkerContext) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, dtype name)}`` of a worker's tensors, as :func:`check_live` takes them."""
    return {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in ctx.tensors.items()}


def first_gpu(device: str) -> int:
    """``cuda`` -> 0, ``cuda:K`` -> K: worker rank r runs on GPU K + r."""
    return int(device.split(":", 1)[1]) if ":" in device else 0


def _worker_main(rank: int, conn, model: Any, engine: str, device: str, fill: float, threads: int) -> None:
    """One worker: build its tensors from the layout, answer ready, then serve calls until told to stop."""
    try:
        if threads:
            torch.set_num_threads(threads)
        engine_layout = make_layout(load_spec(model), engine)
        if getattr(engine_layout.config, "quant", 0):  # quant=fp8: e4m3 weights and fp32 _scale_inv, as the engine
            from weightsync.quant.layout import fp8_layout  # holds them once it loaded an FP8 checkpoint

            engine_layout = fp8_layout(engine_layout)
        layout = engine_layout.layout(rank)
        dev = torch.device("cuda", first_gpu(device) + rank) if device.startswith("cuda") else torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        tensors = {
            name: torch.full(t.shape, fill, dtype=TORCH_DTYPES[t.dtype], device=dev) for name, t in layout.tensors.items()
        }
        ctx = WorkerContext(rank=rank, device=dev, tensors=tensors)
        ready = (0, "ok", {"pid": os.getpid(), "tensors": len(tensors)})
    except BaseException as e:  # noqa: BLE001 -- reported to the control process
        conn.send_bytes(pickle.dumps((0, "err", error_record(e))))
        return
    conn.send_bytes(pickle.dumps(ready))
    while True:
        try:
            blob = conn.recv_bytes()
        except (EOFError, OSError):  # the control process went away
            return
        seq = go = None
        try:
            seq, fn, args, early = pickle.loads(blob)
            if seq == _STOP:
                return
            go = Go(seq, lambda: _go_message(conn), RuntimeError) if early else None
            with torch.no_grad(), (gated(go) if go is not None else contextlib.nullcontext()):
                result = fn(ctx, *args)
            out = pickle.dumps((seq, "ok", result))
        except _Stopped:
            return
        except BaseException as e:  # noqa: BLE001
            if seq == _STOP:
                return
            out = pickle.dumps((seq, "err", error_record(e)))
        try:
            if go is not None:
                go.settle()  # a call that ended before its first copy reads its go all the same (in step)
        except (_Stopped, EOFError, OSError):
            return
        try:
            conn.send_bytes(out)
        except (EOFError, OSError):
            return


class _Stopped(Exception):
    """The control process stopped the worker while a call sent early waited for its go."""


def _go_message(conn) -> tuple[int, str | None]:
    """The go of a call sent early (:meth:`FaithfulInstance.call_when`), from the pipe: its call number, and None to
    go on or why the step was called off (:class:`~weightsync.transport.gate.Go`)."""
    seq, why = pickle.loads(conn.recv_bytes())[:2]
    if seq == _STOP:
        raise _Stopped
    return seq, why


def _shutdown(procs: list, conns: list, grace_s: float = 5.0) -> None:
    """Stop workers: ask politely, then terminate, then kill; close the pipes. Idempotent."""
    stop = pickle.dumps((_STOP, None, (), False))
    for p, c in zip(procs, conns):
        if p.is_alive():
            try:
                c.send_bytes(stop)
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for c in conns:
        try:
            c.close()
        except OSError:
            pass


class FaithfulInstance(ClosedOnExit, NoEngineHooks):
    """Layout-faithful stand-in for a vLLM / SGLang instance (see the module docstring).

    ``model``: a preset name, a config.json path or an HF config dict. ``engine``: a layout string
    such as ``"vllm:tp=2"`` or ``"sglang:tp=2,dp=2,dp_attention=1"``. ``timeout_s``: the default
    call timeout (a call's own ``timeout_s`` overrides it); ``start_timeout_s``: for the workers to
    build their tensors. ``error_grace_s``: after a worker raises, how long the others get to finish
    before they are taken as stuck (the instance is then shut down). ``threads``: torch threads per
    worker. ``start_method``: ``spawn`` (a fresh interpreter per worker), or ``forkserver``: one fresh
    interpreter with torch imported (:data:`PRELOAD`), which each worker forks from -- much cheaper for
    several workers; a dead worker is seen the same way (its exit code comes through the server).
    """

    def __init__(
        self,
        model: str | Mapping[str, Any],
        engine: str,
        device: str = "cpu",
        fill: float = float("nan"),
        start_method: str = "spawn",
        *,
        timeout_s: float = 300.0,
        start_timeout_s: float = 120.0,
        error_grace_s: float = 10.0,
        threads: int = 1,
    ):
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver' (torch is not fork-safe), not {start_method!r}")
        if device != "cpu" and not device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:K' (ranks on cuda:K, K+1, ...), not {device!r}")
        spec = load_spec(model)
        self.engine_layout = make_layout(spec, engine)  # refuses a bad config here, before any process starts
        self.engine = engine
        self.model_config: dict = dict(spec.config)
        self.spec = spec
        self.device = device
        self.timeout_s = timeout_s
        self.error_grace_s = error_grace_s
        self._world = self.engine_layout.world_size
        self._seq = 0
        self._broken: str | None = None
        self._stopping: threading.Thread | None = None  # a failure's stop of the workers (:meth:`_fail`)
        if device.startswith("cuda") and torch.cuda.device_count() < first_gpu(device) + self._world:
            k = first_gpu(device)
            raise InstanceError(
                f"{engine} needs {self._world} GPUs (cuda:{k}..{k + self._world - 1}); {torch.cuda.device_count()} visible"
            )
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(PRELOAD)  # only for a server not yet running in this process
        self._procs: list = []
        self._conns: list = []
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns)
        model_arg = model if isinstance(model, str) else dict(model)
        try:
            for rank in range(self._world):
                parent, child = ctx.Pipe(duplex=True)
                p = ctx.Process(
                    target=_worker_main,
                    args=(rank, child, model_arg, engine, device, fill, threads),
                    name=f"weightsync-faithful-{rank}",
                    daemon=True,
                )
                p.start()
                child.close()
                self._procs.append(p)
                self._conns.append(parent)
            ready = self._gather(0, start_timeout_s, "start-up")
        except BaseException:
            self.close()
            raise
        self.pids = [r["pid"] for r in ready]

    # -- protocol -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._world

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every worker at once; results in rank order (see the module docstring)."""
        seq = self._send(fn, args, early=False)
        return self._gather(seq, self.timeout_s if timeout_s is None else timeout_s, getattr(fn, "__qualname__", repr(fn)))

    def call_when(self, gate: Callable[[], None], fn: Callable[..., Any], *args: Any,
                  timeout_s: float | None = None) -> list[Any]:
        """:meth:`call`, sent at once, its copies waiting for ``gate()`` (run here once it is sent): a step's call
        before its step is written (:mod:`weightsync.transport.gate`). What ``gate`` raises calls the step off on
        every worker before its first copy, and is raised once all answered; ``timeout_s`` counts from the go."""
        seq = self._send(fn, args, early=True)
        why, cancelled, _ = run_gate(gate)  # what it raised is raised once every worker answered
        go = pickle.dumps((seq, why))
        for rank, c in enumerate(self._conns):
            try:
                c.send_bytes(go)
            except (OSError, ValueError):
                self._gone(rank)
        try:
            results = self._gather(seq, self.timeout_s if timeout_s is None else timeout_s,
                                   getattr(fn, "__qualname__", repr(fn)))
        except BaseException:
            if cancelled is None:
                raise
        if cancelled is not None:  # the workers said StepCancelled (or failed before their first copy): this is why
            raise cancelled
        return results

    def _send(self, fn: Callable[..., Any], args: tuple, early: bool) -> int:
        if self._broken is not None:
            raise InstanceError(f"{self!r} is closed: {self._broken}")
        self._seq += 1
        seq = self._seq
        try:
            blob = pickle.dumps((seq, fn, args, early))
        except Exception as e:
            raise TypeError(
                f"cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments to the workers "
                f"(fn must be a module-level function, arguments picklable): {e}"
            ) from e
        for rank, c in enumerate(self._conns):
            try:
                c.send_bytes(blob)
            except (OSError, ValueError):
                self._gone(rank)
        return seq

    def _gone(self, rank: int) -> None:
        self._fail(f"rank {rank} is gone (exit code {self._procs[rank].exitcode})")
        raise WorkerDied(f"rank {rank} of {self.engine} is gone (exit code {self._procs[rank].exitcode})") from None

    def close(self) -> None:
        if self._broken is None:
            self._broken = "closed"
        if self._stopping is not None:  # a failure's stop, under way: the workers are gone once it returns
            self._stopping.join()
        self._finalizer()

    def __repr__(self) -> str:
        return f"FaithfulInstance({self.spec.name}, {self.engine!r}, world_size={self._world}, device={self.device!r})"

    # -- internals ------------------------------------------------------------------------------
    def _fail(self, reason: str, stuck: tuple[int, ...] = ()) -> None:
        """A worker died or stalled: stop the rest at once (stuck peers get no long grace), refuse later calls.
        ``stuck`` ranks (past their call's deadline) are killed first: a hung (or stopped) process would ignore
        the polite stop and SIGTERM, and the caller would wait seconds past its deadline for nothing. The others
        are stopped on a thread (:meth:`close` waits for it): the caller's error comes at the deadline, not after
        their exits, which take seconds on a loaded host (a 1.5 s deadline was answered in 3.3 s)."""
        self._broken = reason
        for r in stuck:
            if self._procs[r].is_alive():
                self._procs[r].kill()
        procs, conns, finalizer = self._procs, self._conns, self._finalizer

        def stop() -> None:
            _shutdown(procs, conns, grace_s=0.5)
            finalizer()

        if self._stopping is None:
            self._stopping = threading.Thread(target=stop, name="weightsync-faithful-stop", daemon=True)
            self._stopping.start()

    def _gather(self, seq: int, timeout_s: float, what: str) -> list[Any]:
        """Wait for every worker's answer to ``seq``; raise on error, death or timeout."""
        where = f"{self.engine} ({self.spec.name})"
        start = time.monotonic()
        deadline = start + timeout_s
        results: list[Any] = [None] * self._world
        errors: dict[int, tuple] = {}
        pending = set(range(self._world))
        by_obj: dict[Any, tuple[str, int]] = {}
        for r in range(self._world):
            by_obj[self._conns[r]] = ("conn", r)
            by_obj[self._procs[r].sentinel] = ("proc", r)
        while pending:
            now = time.monotonic()
            if now >= deadline:
                stuck = sorted(pending)
                if errors:
                    self._fail(f"ranks {stuck} stuck after rank {min(errors)} raised in {what}", tuple(stuck))
                    exc = rebuild_error(errors[min(errors)], min(errors), where)
                    exc.add_note(f"ranks {stuck} did not finish within {deadline - start:.1f}s; the instance was shut down")
                    raise exc
                self._fail(f"ranks {stuck} did not answer {what} within {timeout_s}s", tuple(stuck))
                raise WorkerTimeout(f"{where}: ranks {stuck} did not answer {what} within {timeout_s}s; instance shut down")
            watch = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            for obj in multiprocessing.connection.wait(watch, timeout=min(deadline - now, 1.0)):
                kind, r = by_obj[obj]
                if r not in pending:
                    continue
                conn = self._conns[r]
                if kind == "proc" and conn.poll():
                    continue  # it answered before exiting: read the answer on the next pass
                try:
                    if kind == "proc":
                        raise EOFError
                    msg_seq, status, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    p = self._procs[r]
                    p.join(1.0)
                    self._fail(f"rank {r} died (exit code {p.exitcode}) during {what}")
                    raise WorkerDied(
                        f"{where}: rank {r} (pid {p.pid}) died with exit code {p.exitcode} during {what}; instance shut down"
                    ) from None
                if msg_seq != seq:
                    continue  # a late answer to an earlier call
                pending.discard(r)
                if status == "ok":
                    results[r] = payload
                else:
                    errors[r] = payload
                    deadline = min(deadline, time.monotonic() + self.error_grace_s)
        if errors:
            first = min(errors)
            exc = rebuild_error(errors[first], first, where)
            if len(errors) > 1:
                exc.add_note(f"ranks {sorted(errors)} raised; this is rank {first}'s exception")
            raise exc
        return results


__all__ = ["FaithfulInstance", "snapshot", "live_shapes"]
