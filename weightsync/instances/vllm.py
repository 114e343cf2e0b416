"""A vLLM engine (offline ``vllm.LLM``, or ``AsyncLLM``) as an inference instance, for ``WeightReader``.

Start the engine with weightsync's worker extension, then hand it to an unchanged ``WeightReader``::

    llm = LLM(model=..., worker_extension_cls="weightsync.vllm.extension.WeightSyncExtension")
    reader = WeightReader(VLLMInstance(llm), meta=url, job="job", instance_id=0, instances=1)
    reader.update(step)          # every step; generate() between steps

- ``call(fn, *args)`` pickles ``(fn, args)`` into bytes for the extension's ``weightsync_call``, called
  by name through ``collective_rpc``; each worker answers bytes, an exception comes back as itself
  (:mod:`weightsync.vllm.rpc`). Workers run ``fn`` on their loaded-form tensors
  (:mod:`weightsync.vllm.live`, decided per layer at construction and logged, ``self.reports``).
- ``after_update`` re-runs the post-load transforms (CPU re-packs, expert prepack) from the loaded form;
  where every layer is in place (GPU, unquantized) there is none, and no call is made.
- ``pause``: ``AsyncLLM.pause_generation(mode=pause_mode)`` (``"keep"`` freezes in-flight requests);
  the offline ``LLM`` generates only inside ``generate()``, so there is nothing to pause.
  ``resume``: ``reset_prefix_cache()`` (cached KV of the old weights), then ``resume_generation``.
- ``set_version(step)``: ``update_weight_version(str(step))``, readable with ``get_weight_version()``
  (vLLM >= 0.32; 0.26 has no weight version: there ``get_version`` answers the last step set here).
- ``withhold(reason)``: after a failed non-staged update (the weights a mix of two steps) the engine serves
  nothing until the next good update: the offline ``LLM`` refuses every new request with
  :class:`~weightsync.errors.InstanceError` (:mod:`weightsync.vllm.serving`), an ``AsyncLLM`` stays paused.
  A staged reader never needs it: a failed step leaves the previous one whole.

An ``AsyncLLM`` runs on an asyncio loop: pass it as ``loop``; the reader must then run on another
thread (the calls are made with ``asyncio.run_coroutine_threadsafe``).

If a ``collective_rpc`` itself fails the instance is marked broken and every later call raises
:class:`~weightsync.errors.InstanceError`: a worker died (``EngineDeadError``: :class:`WorkerDied`), or the
call overran its deadline (:class:`WorkerTimeout`, naming the call and the deadline; vLLM's executor then
reads the late answer as the reply to its next call, model steps included, so the engine must restart).
weightsync's own calls never overrun: a worker's transfer returns within the reader's ``timeout_s``
(:func:`weightsync.runtime.worker.call_timeout` gives the RPC a margin beyond it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import threading
import uuid
from typing import Any, Callable

from weightsync.errors import ConfigError, InstanceError, WorkerDied, WorkerTimeout
from weightsync.runtime import wire
from weightsync.vllm.config import describe
from weightsync.vllm.extension import EXTENSION
from weightsync.vllm.live import IN_PLACE, LiveReport
from weightsync.vllm.rpc import CallChannel, pack_call, result

log = logging.getLogger("weightsync.vllm")

PAUSE_MODES = ("keep", "wait", "abort")


class VLLMInstance:
    """``vllm.LLM`` / ``AsyncLLM`` behind :class:`~weightsync.runtime.instance.InferenceInstance`."""

    def __init__(self, engine: Any, *, loop: asyncio.AbstractEventLoop | None = None, pause_mode: str = "keep",
                 timeout_s: float = 600.0):
        import vllm  # noqa: F401 -- fail here, clearly, where vLLM is missing

        if pause_mode not in PAUSE_MODES:
            raise ConfigError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.llm, self.loop, self.pause_mode, self.timeout_s = engine, loop, pause_mode, timeout_s
        self.is_async = not hasattr(engine, "llm_engine")
        if self.is_async and loop is None:
            raise ConfigError("VLLMInstance(AsyncLLM): pass the asyncio loop the engine runs on as loop=")
        vc = engine.vllm_config if self.is_async else engine.llm_engine.vllm_config
        ext = vc.parallel_config.worker_extension_cls
        if ext != EXTENSION:
            raise ConfigError(f"VLLMInstance needs vLLM's workers to carry weightsync's extension: start the engine "
                              f"with worker_extension_cls={EXTENSION!r} (it has {ext!r})")
        info = describe(vc)
        self.info = info
        self.engine = info.engine
        self.model_config: dict = info.model_config
        self.world_size = info.tp
        self._broken: str | None = None
        self._paused = False
        self._withheld: str | None = None  # why a failed non-staged update left the weights torn (withhold)
        self._version = "default"  # vLLM's own initial weight version
        #: per worker: which path each layer takes (in place, re-packed, staged), decided once here
        self.reports: list[LiveReport] = self._rpc("weightsync_setup", timeout_s=timeout_s)
        for r in self.reports:
            log.info("%s: %s", self.engine, r.summary())
        #: whether any layer is re-packed after an update; on GPU every unquantized layer is in place, and the
        #: refresh would be one more engine-core round trip a step for nothing
        self.refreshes = any(p.path != IN_PLACE for r in self.reports for p in r.layers)
        # the signed call channel (weightsync.runtime.wire): the workers read the key from this private directory
        key_dir, key = wire.new_key_dir(wire.VLLM_DIR_PREFIX)
        self._channel = CallChannel(uuid.uuid4().hex, key_dir, key)
        self._seq = itertools.count(1)

    # -- the protocol ---------------------------------------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        return self._rpc("weightsync_call", pack_call(self._channel, next(self._seq), fn, args), timeout_s=timeout_s,
                         what=f"weightsync_call({getattr(fn, '__qualname__', fn)})")

    def after_update(self) -> None:
        if self.refreshes:
            self._rpc("weightsync_refresh")

    def pause(self) -> None:
        if self.is_async:
            self._run(self.llm.pause_generation(mode=self.pause_mode, clear_cache=self.pause_mode != "keep"))
            self._paused = True

    def resume(self) -> None:
        if self._broken is not None:
            return
        reset = self._run(self.llm.reset_prefix_cache()) if self.is_async else self.llm.reset_prefix_cache()
        if not reset:
            log.warning("%s: the prefix cache was not reset: requests still running hold KV blocks computed with "
                        "the previous weights", self.engine)
        if self._paused and self._withheld is None:  # withheld: an AsyncLLM stays paused until a good update
            self._run(self.llm.resume_generation())
            self._paused = False

    def withhold(self, reason: str) -> None:
        """A non-staged update failed part-way: serve nothing until the next good update (``set_version``).
        Offline ``LLM``: every new request raises (:mod:`weightsync.vllm.serving`); ``AsyncLLM``: it stays
        paused (requests wait)."""
        self._withheld = reason
        if not self.is_async:
            from weightsync.vllm.serving import withhold

            withhold(self.llm, reason)

    def set_version(self, step: int) -> None:
        if self._withheld is not None:  # a good update: serve again
            self._withheld = None
            if self.is_async:
                if self._paused:
                    self._run(self.llm.resume_generation())
                    self._paused = False
            else:
                from weightsync.vllm.serving import serve

                serve(self.llm)
        self._version = str(step)
        if not hasattr(self.llm, "update_weight_version"):  # vLLM 0.26
            return
        if self.is_async:
            self._run(self.llm.update_weight_version(str(step)))
        else:
            self.llm.update_weight_version(str(step))

    def get_version(self) -> str:
        if not hasattr(self.llm, "get_weight_version"):  # vLLM 0.26: the last step this instance set
            return self._version
        return self._run(self.llm.get_weight_version()) if self.is_async else self.llm.get_weight_version()

    def close(self) -> None:
        if self._broken is None:
            try:
                self._rpc("weightsync_close")
            except Exception as e:  # noqa: BLE001 -- closing: the engine may be gone
                log.debug("%s: close: %s", self.engine, e)
            self._broken = "closed"
        shutil.rmtree(self._channel.dir, ignore_errors=True)

    def __repr__(self) -> str:
        return f"VLLMInstance({self.engine!r}, {self.model_config.get('architectures')})"

    # -- internals ------------------------------------------------------------------------------
    def _run(self, coro: Any) -> Any:
        """Run one of AsyncLLM's coroutines on its loop, from this (other) thread."""
        if self.loop is None:
            raise ConfigError("an AsyncLLM call needs the engine's loop")
        if _on_loop(self.loop):
            coro.close()
            raise ConfigError("VLLMInstance(AsyncLLM) was called on the engine's own loop thread; run the "
                              "WeightReader in another thread (e.g. loop.run_in_executor)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _rpc(self, method: str, *args: Any, timeout_s: float | None = None, what: str | None = None) -> list[Any]:
        if self._broken is not None:
            raise InstanceError(f"{self!r} is unusable: {self._broken}")
        timeout = timeout_s or self.timeout_s
        what = what or method
        try:
            if self.is_async:
                answers = self._run(self.llm.collective_rpc(method, timeout=timeout, args=args))
            else:
                answers = self.llm.collective_rpc(method, timeout=timeout, args=args)
        except Exception as e:
            if not timed_out(e):  # a dead worker: EngineDeadError / "Executor failed" / a failed RPC
                self._broken = f"{what} failed in vLLM: {e}"
                raise WorkerDied(f"{self.engine}: {what} failed inside vLLM ({type(e).__name__}: {e}); a worker "
                                 "died or the engine shut down: restart the engine") from e
            # nothing died: the call overran its deadline (weightsync's own transfers return within theirs,
            # so a worker hung elsewhere); its late answer will be read by vLLM's next call, as model output
            self._broken = f"{what} did not answer within its {timeout:g} s deadline (vLLM's executor is out of step)"
            raise WorkerTimeout(f"{self.engine}: the vLLM workers did not answer {what} within its {timeout:g} s "
                                "deadline (no worker is known to have died: one hangs); vLLM's executor will take "
                                "the late answer for the reply to its next call, so this instance and the engine "
                                "are unusable: restart the engine") from e
        return [result(a, rank, self.engine) for rank, a in enumerate(answers)]


def timed_out(e: BaseException) -> bool:
    """Whether vLLM failed a ``collective_rpc`` for its deadline: a ``TimeoutError`` in process, or, across the
    engine core's msgpack hop (which keeps no exception type), its message ``RPC call to ... timed out``."""
    return isinstance(e, TimeoutError) or "timed out" in str(e)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return getattr(loop, "_thread_id", None) == threading.get_ident()


__all__ = ["VLLMInstance", "PAUSE_MODES"]
