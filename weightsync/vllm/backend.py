"""The ``weightsync`` weight-transfer backend: a vLLM ``WeightTransferEngine`` in every worker.

vLLM creates one engine per worker process after the model is loaded and post-processed
(``Worker.load_model``), and calls each of its methods on every worker at once (``collective_rpc``).
So every call below runs on all workers of the instance together: worker rank 0 (TP rank 0) runs an
ordinary :class:`~weightsync.runtime.reader.WeightReader` over a :class:`GroupInstance`, whose
``call(fn, *args)`` broadcasts ``(fn, args)`` to the other workers over vLLM's own CPU (gloo) TP group,
runs it locally and gathers every answer; the other ranks serve those calls until rank 0 says the
RPC is over. The reader's whole set-up and per-step logic is unchanged:

==============================  ============================================================
vLLM call (driver)              here
==============================  ============================================================
``init_weight_transfer_engine`` build the loaded-form tensors (:mod:`weightsync.vllm.live`),
  ``{"init_info": {...}}``      then ``WeightReader(...).connect()``: register, agree, plan, prove, connect
``start_weight_update``         nothing
``update_weights``              ``{"step": n}``: ``reader.update(n)``; ``{"pull": true}``: ``reader.pull()``
``finish_weight_update``        nothing (the transforms were re-run inside the update)
``shutdown_weight_transfer_..`` close the transports
==============================  ============================================================

No method ever raises (at TP >= 2 that desynchronizes vLLM's executor): rank 0 publishes every
call's outcome to the MetaServer (:mod:`weightsync.vllm.status`) and the driver helper
(:class:`weightsync.vllm.VLLMWeightSync`) raises it. The weight version is the driver's to set,
once the MetaServer records the step held.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync.errors import ConfigError, InstanceError, JobMismatch, LayoutMismatch, MetaError
from weightsync.runtime.instance import NoEngineHooks
from weightsync.vllm.config import InitInfo
from weightsync.vllm.rpc import answer, result
from weightsync.vllm.status import CallStatus, abort_reason, publish

log = logging.getLogger("weightsync.vllm")


@dataclass
class WeightSyncInitInfo(InitInfo, WeightTransferInitInfo):
    """``init_weight_transfer_engine({"init_info": {...}})``: :class:`~weightsync.vllm.config.InitInfo` as
    vLLM's init-info type (the WeightReader's options, JSON-safe)."""


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights({"update_info": {...}})``: ``{"step": n}`` (sync) or ``{"pull": true}`` (async)."""

    step: int | None = None
    pull: bool = False
    call: str = ""


# -- the workers' control group ------------------------------------------------------------------


class _Group:
    """vLLM's CPU (gloo) group of this instance's workers: rank 0 leads, the others serve."""

    def __init__(self) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        g = get_tp_group()
        self.group, self.rank, self.size = g.cpu_group, g.rank_in_group, g.world_size

    def broadcast(self, msg: Any = None) -> Any:
        box = [msg]
        torch.distributed.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def gather(self, item: bytes) -> list[bytes] | None:
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        torch.distributed.gather_object(item, out, group=self.group, group_dst=0)
        return out


_END = ("end",)
_REFUSALS = tuple(c.__name__ for c in (ConfigError, LayoutMismatch, JobMismatch))


def _serve(group: _Group, run: Callable[[Callable[..., Any], tuple], Any]) -> None:
    """Ranks other than 0: answer rank 0's calls until it ends the RPC."""
    while True:
        msg = group.broadcast()
        if msg == _END:
            return
        _, fn, args = msg
        group.gather(answer(lambda: run(fn, args)))


class GroupInstance(NoEngineHooks):
    """The instance as worker rank 0 drives it: ``call`` runs ``fn`` on every worker of the TP group.

    ``pause``/``resume`` do nothing: vLLM's engine core runs no forward pass while a worker RPC runs
    (the driver resets the prefix cache after the update). ``after_update`` re-runs every worker's
    post-load transforms. ``local``: calls run on this worker only (shutdown, when the others may
    already be gone)."""

    def __init__(self, group: _Group, run: Callable[[Callable[..., Any], tuple], Any], engine: str,
                 model_config: dict):
        self._group, self._run = group, run
        self.engine, self.model_config, self.world_size = engine, model_config, group.size
        self.local = False

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        if self.local:
            return [self._run(fn, args)]
        self._group.broadcast(("call", fn, args))
        answers = self._group.gather(answer(lambda: self._run(fn, args)))
        return [result(a, rank, self.engine) for rank, a in enumerate(answers)]

    def after_update(self) -> None:
        self.call(refresh)


def refresh(ctx: Any) -> int:
    """On a worker: re-run the post-load transforms from the loaded form."""
    return ctx.state["live"].refresh()


# -- the engine ------------------------------------------------------------------------------------


class WeightSyncTransferEngine(WeightTransferEngine):  # type: ignore[misc]
    """One vLLM worker's ``weightsync`` backend (module docstring)."""

    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._reader: Any = None  # rank 0's WeightReader
        self._instance: GroupInstance | None = None
        self._info: WeightSyncInitInfo | None = None
        self._init_error: str | None = None

    # -- helpers ---------------------------------------------------------------------------------
    def _worker(self):
        from weightsync.vllm.side import worker_of

        return worker_of(self.model, self.vllm_config, self.device)

    def _run(self, fn: Callable[..., Any], args: tuple) -> Any:
        return self._worker().run(fn, args)

    def _collective(self, what: str, call: str, lead: Callable[[], int | None]) -> None:
        """Every worker at once: rank 0 runs ``lead`` (its calls reach the others), then publishes the outcome."""
        group = _Group()
        if group.rank != 0:
            try:
                _serve(group, self._run)
            except Exception as e:  # noqa: BLE001 -- rank 0 is gone: vLLM's executor stops every worker
                log.error("weightsync %s: lost rank 0 of the instance: %s: %s", what, type(e).__name__, e)
            return
        status: CallStatus
        info = self._info
        t0 = time.perf_counter()
        try:
            step = lead()
            status = CallStatus(info.instance_id if info else -1, call, what, True, step)
        except Exception as e:  # noqa: BLE001 -- recorded and published: never raised out of the RPC
            log.error("weightsync %s failed on %s: %s: %s", what, self.model_config.model, type(e).__name__, e)
            status = CallStatus(info.instance_id if info else -1, call, what, False, None, public_type(e), str(e))
            if what == "init":
                self._init_error = f"{type(e).__name__}: {e}"
        finally:
            group.broadcast(_END)
        log.info("weightsync %s: ok=%s step=%s in %.3f s", what, status.ok, status.step, time.perf_counter() - t0)
        if info is None:
            return
        client = info_client(info)
        try:
            publish(client, status)
        except MetaError as e:
            log.error("weightsync %s: could not publish its status: %s", what, e)
        if what == "init" and status.error_type in _REFUSALS:
            # this instance refused the job: stop every participant now, not at its timeout
            with contextlib.suppress(MetaError):
                client.abort(abort_reason(info.instance_id, status))

    # -- WeightTransferEngine --------------------------------------------------------------------
    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        self._close_reader()
        self._info, self._init_error = init_info, None

        def lead() -> None:
            from weightsync.runtime.reader import WeightReader

            w = self._worker()  # this rank's refusal raises here; the others' come back from the first call
            self._instance = GroupInstance(_Group(), self._run, w.info.engine, w.info.model_config)
            reader = WeightReader(self._instance, **init_info.reader_options())
            self._instance.call(_setup)  # every worker builds its loaded-form tensors (or says why not)
            reader.connect()
            self._reader = reader

        self._collective("init", init_info.call, lead)

    def start_weight_update(self) -> None:
        pass

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        def lead() -> int:
            if self._reader is None:
                raise InstanceError("the weightsync backend is not initialized"
                                    + (f": its init failed ({self._init_error})" if self._init_error else
                                       ": call init_weight_transfer_engine first"))
            if update_info.pull:
                return self._reader.pull()
            if update_info.step is None:
                raise ConfigError('update_info needs {"step": n} (sync mode) or {"pull": true} (async mode)')
            return self._reader.update(int(update_info.step))

        self._collective("pull" if update_info.pull else "update", update_info.call, lead)

    def finish_weight_update(self) -> None:
        pass

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """Abstract in vLLM 0.26 (gone from the engine in 0.32): the trainer side is weightsync's own."""
        raise NotImplementedError("the weightsync backend's trainers send with weightsync.WeightWriter; "
                                  "see docs/vllm.md")

    def shutdown(self) -> None:
        """Close the transports, on this worker alone (the others may be shutting down already)."""
        self._close_reader()
        from weightsync.vllm.side import forget

        with contextlib.suppress(Exception):
            forget(self.model)

    def _close_reader(self) -> None:
        """Close this worker's transports (rank 0: and its reader), touching no other worker."""
        from weightsync.vllm.side import existing

        reader, self._reader = self._reader, None
        if self._instance is not None:
            self._instance.local = True
        if reader is not None:
            with contextlib.suppress(Exception):
                reader.close()
        w = existing(self.model)
        if w is not None:
            with contextlib.suppress(Exception):
                w.close()


def public_type(e: BaseException) -> str:
    """The name the driver raises ``e`` as: its class's, or its nearest base's in :mod:`weightsync.errors` (a
    subclass defined elsewhere, e.g. ``TransferAbandoned``, is raised as the ``TransportError`` it is)."""
    from weightsync import errors

    for cls in type(e).__mro__:
        if getattr(errors, cls.__name__, None) is cls:
            return cls.__name__
    return type(e).__name__


def _setup(ctx: Any) -> None:
    """On a worker: nothing; reaching it means the worker's loaded-form tensors were built."""


def info_client(info: WeightSyncInitInfo):
    from weightsync.meta.client import MetaClient

    return MetaClient(info.meta, info.job, token=info.token, timeout=info.timeout_s)
