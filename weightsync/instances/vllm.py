"""A vLLM engine (offline ``vllm.LLM``, or ``AsyncLLM``) as an inference instance, for ``WeightReader``.

Start the engine with weightsync's worker extension, then hand it to an unchanged ``WeightReader``::

    llm = LLM(model=..., worker_extension_cls="weightsync.vllm.extension.WeightSyncExtension")
    reader = WeightReader(VLLMInstance(llm), meta=url, job="job", instance_id=0, instances=1)
    reader.update(step)          # every step; generate() between steps

- ``call(fn, *args)`` signs ``(fn, args)`` into bytes (:mod:`weightsync.vllm.rpc`) and sends them to every
  worker through the instance's **call mailbox** (:mod:`weightsync.runtime.mailbox`: FIFOs in the instance's
  private directory, served by a thread of each worker that one signed call (``host_mailbox``) at construction
  started), so a step's calls make no trip through vLLM's engine core; without the mailbox
  (``mailbox=False``, or where it could not start: logged) through the extension's ``weightsync_call`` by
  ``collective_rpc``. Either way each worker checks the signature, runs ``fn`` on its loaded-form tensors
  (:mod:`weightsync.vllm.live`, decided per layer at construction and logged, ``self.reports``) and answers
  bytes; an exception comes back as itself.
- ``after_update`` re-runs the post-load transforms (CPU re-packs, expert prepack) from the loaded form, as a
  call; where every layer is in place (GPU, unquantized) there is none, and no call is made.
- ``pause``: ``AsyncLLM.pause_generation(mode=pause_mode)`` (``"keep"`` freezes in-flight requests);
  the offline ``LLM`` generates only inside ``generate()``, so there is nothing to pause. With the mailbox
  up, ``reset_prefix_cache()`` (cached KV of the old weights: an engine-core trip that touches no worker,
  ``v1/core/sched/scheduler.py`` ``reset_prefix_cache``, 0.26) runs beside the receive: started the moment
  every worker has posted its copies (:mod:`weightsync.transport.posted`; started sooner, the engine core's
  thread handling it contends for the GIL with the receive's Python, in one process at TP = 1), else by
  ``resume``, which waits for it; without the mailbox ``resume`` resets. Then ``resume_generation``.
- ``set_version(step)``: ``update_weight_version(str(step))``, readable with ``get_weight_version()``
  (vLLM >= 0.32; 0.26 has no weight version: there ``get_version`` answers the last step set here).
- ``withhold(reason)``: after a failed non-staged update (the weights a mix of two steps) the engine serves
  nothing until the next good update: the offline ``LLM`` refuses every new request with
  :class:`~weightsync.errors.InstanceError` (:mod:`weightsync.vllm.serving`), an ``AsyncLLM`` stays paused.
  A staged reader never needs it: a failed step leaves the previous one whole.

An ``AsyncLLM`` runs on an asyncio loop: pass it as ``loop``; the reader must then run on another
thread (the calls are made with ``asyncio.run_coroutine_threadsafe``).

**Why a call on a worker thread cannot race a forward pass.** The mailbox thread writes the live parameters
while vLLM's own worker thread is idle in its RPC loop: an ``AsyncLLM`` is paused first, and
``pause_generation`` returns only once the engine core has no step in flight (``EngineCoreProc.pause_scheduler``
completes on the idle callback; ``has_work`` counts ``batch_queue``, ``v1/engine/core.py`` 0.26); the
offline ``LLM`` runs steps only inside ``generate()``, which the thread that drives the reader is not in (the
reader and ``generate`` must not run at once from two threads). The one forward that may still run is a step
dispatched for a request already finished (async scheduling schedules one past an unforeseen stop): its
output is discarded, and it only reads weights. The thread synchronizes the worker's device before the call
(kernels still queued finish first) and after it (the answer says the copies are done), so generation resumed
after ``update`` returns sees every byte.

If a ``collective_rpc`` itself fails the instance is marked broken and every later call raises
:class:`~weightsync.errors.InstanceError`: a worker died (``EngineDeadError``: :class:`WorkerDied`), or the
call overran its deadline (:class:`WorkerTimeout`, naming the call and the deadline; vLLM's executor then
reads the late answer as the reply to its next call, model steps included, so the engine must restart).
weightsync's own calls never overrun: a worker's transfer returns within the reader's ``timeout_s``
(:func:`weightsync.runtime.worker.call_timeout` gives the RPC a margin beyond it). Through the mailbox the same
errors, with the same deadline: a worker process that dies (or whose mailbox thread ends) closes its pipe and
raises :class:`WorkerDied` at once; a call past its deadline raises :class:`WorkerTimeout` naming it (vLLM's
executor is not out of step then, but the worker thread still runs the call: the instance is unusable all
the same); an engine core that dies takes its workers with it (and a prefix-cache reset that fails raises
``WorkerDied``). A call through vLLM's engine client that the engine core never answers because it died (vLLM's
client would wait for it for ever) fails with ``EngineDeadError`` once the client knows the engine dead
(:mod:`weightsync.vllm.watch`, started here), so ``collective_rpc`` raises ``WorkerDied`` then too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import shutil
import threading
import time
import uuid
from typing import Any, Callable

from weightsync.errors import ConfigError, InstanceError, WorkerDied, WorkerTimeout
from weightsync.runtime import wire
from weightsync.vllm.config import describe
from weightsync.vllm.extension import EXTENSION
from weightsync.vllm.live import IN_PLACE, LiveReport
from weightsync.vllm.rpc import CallChannel, pack_call, result
from weightsync.vllm.side import host_close, host_mailbox, host_setup
from weightsync.vllm.watch import watch

log = logging.getLogger("weightsync.vllm")

PAUSE_MODES = ("keep", "wait", "abort")


class VLLMInstance:
    """``vllm.LLM`` / ``AsyncLLM`` behind :class:`~weightsync.runtime.instance.InferenceInstance`."""

    def __init__(self, engine: Any, *, loop: asyncio.AbstractEventLoop | None = None, pause_mode: str = "keep",
                 timeout_s: float = 600.0, mailbox: bool = True):
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
        watch(engine)  # a call into an engine core that died fails (vLLM's own client would wait for ever)
        self.engine = info.engine
        self.model_config: dict = info.model_config
        self.world_size = info.tp
        self._broken: str | None = None
        self._paused = False
        self._withheld: str | None = None  # why a failed non-staged update left the weights torn (withhold)
        self._version = "default"  # vLLM's own initial weight version
        self._mailbox = None  # the call mailbox, once up
        self._client = threading.Lock()  # one call at a time through the offline LLM's engine client
        self._reset_due = False  # paused with the mailbox up: the prefix cache is reset once the workers posted
        self._reset: concurrent.futures.Future | None = None  # the prefix-cache reset, once started
        self._background: _Background | None = None
        #: engine-core trips made through collective_rpc (set-up and fallback calls; none a step with the mailbox)
        self.trips = 0
        #: the last mailbox call's timing (:class:`~weightsync.runtime.mailbox.CallTiming`), and the seconds the last
        #: resume() waited for the prefix-cache reset the update started (0 when it was done by then)
        self.last_call = None
        #: where this update's mailbox calls spent their time (seconds, summed over the update's calls since
        #: ``pause``): ``call`` the control process's wall time, ``call.handler`` / ``call.synced`` the slowest
        #: worker's (:class:`weightsync.runtime.mailbox.CallTiming`); the bench records it beside the reader's phases
        self.last_timing: dict[str, float] = {}
        self.reset_wait = 0.0
        # the signed call channel (weightsync.runtime.wire): the workers read the key from this private directory;
        # every call into a worker is signed, the set-up's first
        key_dir, key = wire.new_key_dir(wire.VLLM_DIR_PREFIX)
        self._channel = CallChannel(uuid.uuid4().hex, key_dir, key)
        self._seq = itertools.count(1)
        try:
            #: per worker: which path each layer takes (in place, re-packed, staged), decided once here
            self.reports: list[LiveReport] = self._signed_rpc(host_setup, (), timeout_s)
            for r in self.reports:
                log.info("%s: %s", self.engine, r.summary())
            #: whether any layer is re-packed after an update; on GPU every unquantized layer is in place, and the
            #: refresh would be one more engine-core round trip a step for nothing
            self.refreshes = any(p.path != IN_PLACE for r in self.reports for p in r.layers)
            if mailbox:
                self._open_mailbox()
        except BaseException:
            shutil.rmtree(key_dir, ignore_errors=True)
            raise

    @property
    def mailbox(self) -> bool:
        """Whether calls go through the call mailbox (else through ``collective_rpc``)."""
        return self._mailbox is not None

    def _open_mailbox(self) -> None:
        """One ``collective_rpc`` starts every worker's mailbox thread; a refusal leaves ``collective_rpc`` in use."""
        from weightsync.runtime.mailbox import Mailbox, MailboxError

        box = None
        try:
            box = Mailbox(self._channel.dir, self.world_size)
            self._signed_rpc(host_mailbox, (box.address.directory,))
            box.connect()
        except (WorkerDied, WorkerTimeout):
            if box is not None:
                box.close("set-up failed")
            raise
        except (MailboxError, OSError, InstanceError, wire.WireError) as e:  # e.g. a worker on another host
            if box is not None:
                box.close("set-up failed")
            log.warning("%s: the call mailbox did not start (%s: %s); calls go through collective_rpc (an "
                        "engine-core trip each)", self.engine, type(e).__name__, e)
            return
        self._mailbox = box
        self._background = _Background(f"weightsync-vllm-reset-{self._channel.instance[:8]}")

    # -- the protocol ---------------------------------------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        return self._call(fn, args, timeout_s)

    def call_when(self, gate: Callable[[], None], fn: Callable[..., Any], *args: Any,
                  timeout_s: float | None = None) -> list[Any]:
        """Through the mailbox: :meth:`call` sent at once, its copies waiting for ``gate()`` (a step's call before
        the trainers' `written`: :mod:`weightsync.transport.gate`); through ``collective_rpc``: ``gate()``, then the
        call."""
        return self._call(fn, args, timeout_s, gate)

    def _call(self, fn: Callable[..., Any], args: tuple, timeout_s: float | None,
              gate: Callable[[], None] | None = None) -> list[Any]:
        if self._mailbox is None:
            if gate is not None:
                gate()
            return self._signed_rpc(fn, args, timeout_s)
        what = f"weightsync_call({getattr(fn, '__qualname__', fn)})"
        payload = pack_call(self._channel, next(self._seq), fn, args)
        return self._mail(payload, timeout_s or self.timeout_s, what, gate)

    def _signed_rpc(self, fn: Callable[..., Any], args: tuple, timeout_s: float | None = None) -> list[Any]:
        """``fn`` (a context's function, or a host call: :data:`weightsync.vllm.side.HOST_CALLS`) on every worker
        through ``collective_rpc("weightsync_call")``, signed: the set-up and close calls, and every call without
        the mailbox."""
        what = f"weightsync_call({getattr(fn, '__qualname__', fn)})"
        payload = pack_call(self._channel, next(self._seq), fn, args)
        return self._rpc("weightsync_call", payload, timeout_s=timeout_s, what=what)

    def after_update(self) -> None:
        if not self.refreshes:
            return
        from weightsync.vllm.side import refresh

        t0 = time.perf_counter()
        self.call(refresh)  # through the mailbox where it is up
        # the post-load work a step (re-packs, DeepGEMM's requantization, MLA's derivations): a phase of its own
        self.last_timing["after_update"] = time.perf_counter() - t0

    def pause(self) -> None:
        self.last_timing = {}
        if self.is_async:
            self._run(self.llm.pause_generation(mode=self.pause_mode, clear_cache=self.pause_mode != "keep"))
            self._paused = True
        if self._mailbox is not None and self._broken is None and self._reset is None:
            # nothing generates until resume() (offline: idle; AsyncLLM: paused), so the reset may run beside the
            # receive: the update's calls go through the mailbox, not the engine client (_mail starts it)
            self._reset_due = True

    def _start_reset(self) -> None:
        """Start the prefix-cache reset pause() made due (on the reader's thread; the engine client's own)."""
        self._reset_due = False
        if self.is_async:
            self._reset = asyncio.run_coroutine_threadsafe(self.llm.reset_prefix_cache(), self.loop)
        else:
            self._reset = self._background.submit(self._locked, self.llm.reset_prefix_cache)

    def resume(self) -> None:
        self._reset_due = False  # still due: no call of this update said its copies were posted (reset below)
        pending, self._reset = self._reset, None
        if self._broken is not None:
            return
        t0 = time.perf_counter()
        if pending is not None:
            reset = self._wait_reset(pending)
            self.reset_wait = time.perf_counter() - t0
        else:
            reset = self._run(self.llm.reset_prefix_cache()) if self.is_async else self._locked(self.llm.reset_prefix_cache)
        self.last_timing["reset_wait"] = time.perf_counter() - t0  # the reset's time on the update's path
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
        self._reset_due = False
        pending, self._reset = self._reset, None
        if pending is not None:
            with contextlib.suppress(Exception):  # closing: the engine may be gone
                pending.result(timeout=self.timeout_s)
        if self._mailbox is not None:
            self._mailbox.close()
        if self._background is not None:
            self._background.stop()
        if self._broken is None:
            try:
                self._signed_rpc(host_close, ())  # the mailbox is closed by now
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

    def _locked(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (a call through the offline LLM's engine client) while no other thread uses the client."""
        with self._client:
            return fn()

    def _wait_reset(self, pending: concurrent.futures.Future) -> bool:
        """The prefix-cache reset the update started (at the posting), within the instance's deadline."""
        try:
            return pending.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError as e:
            self._broken = f"reset_prefix_cache did not answer within {self.timeout_s:g} s"
            raise WorkerTimeout(f"{self.engine}: vLLM's engine core did not answer reset_prefix_cache within "
                                f"{self.timeout_s:g} s: restart the engine") from e
        except Exception as e:
            self._broken = f"reset_prefix_cache failed in vLLM: {e}"
            raise WorkerDied(f"{self.engine}: reset_prefix_cache failed inside vLLM ({type(e).__name__}: {e}); "
                             "the engine core died or shut down: restart the engine") from e

    def _mail(self, payload: bytes, timeout: float, what: str, gate: Callable[[], None] | None = None) -> list[Any]:
        """One call through the mailbox: the same answers as ``collective_rpc`` gives, the same errors (and what
        ``gate`` raises, for a gated call: :meth:`call_when`)."""
        from weightsync.runtime.mailbox import MailboxDied, MailboxError, MailboxTimeout

        if self._broken is not None:
            raise InstanceError(f"{self!r} is unusable: {self._broken}")
        try:
            answers = self._mailbox.call([payload] * self.world_size, timeout, what,
                                         self._start_reset if self._reset_due else None, gate)
            self.last_call = last = self._mailbox.last
            if last is not None:
                for name, sec in (("call", last.seconds), ("call.handler", last.handler), ("call.synced", last.synced),
                                  ("call.gated", last.gated)):
                    self.last_timing[name] = self.last_timing.get(name, 0.0) + sec
        except MailboxTimeout as e:
            self._broken = f"{what} did not answer within its {timeout:g} s deadline (a worker thread still runs it)"
            raise WorkerTimeout(f"{self.engine}: the vLLM workers did not answer {what} within its {timeout:g} s "
                                f"deadline ({e}; no worker is known to have died: one hangs, and still runs the "
                                "call): this instance is unusable: restart the engine") from e
        except MailboxDied as e:
            self._broken = f"{what} failed: rank {e.rank}'s worker died"
            raise WorkerDied(f"{self.engine}: {what} failed: {e}; a worker died or the engine shut down: restart "
                             "the engine") from e
        except MailboxError as e:
            self._broken = f"{what} failed in the worker's mailbox: {e}"
            raise WorkerDied(f"{self.engine}: {what} failed outside weightsync's call: {e}: restart the "
                             "engine") from e
        return [result(a, rank, self.engine) for rank, a in enumerate(answers)]

    def _rpc(self, method: str, *args: Any, timeout_s: float | None = None, what: str | None = None) -> list[Any]:
        if self._broken is not None:
            raise InstanceError(f"{self!r} is unusable: {self._broken}")
        timeout = timeout_s or self.timeout_s
        what = what or method
        self.trips += 1
        try:
            if self.is_async:
                answers = self._run(self.llm.collective_rpc(method, timeout=timeout, args=args))
            else:
                answers = self._locked(lambda: self.llm.collective_rpc(method, timeout=timeout, args=args))
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


class _Background:
    """One daemon thread running submitted functions in order (a hung engine call never blocks exit)."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        f: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((f, fn, args))
        return f

    def stop(self) -> None:
        self._q.put(None)

    def _loop(self) -> None:
        while (item := self._q.get()) is not None:
            f, fn, args = item
            if f.set_running_or_notify_cancel():
                try:
                    f.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 -- handed to the waiter
                    f.set_exception(e)


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
