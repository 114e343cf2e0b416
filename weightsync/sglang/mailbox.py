"""SGLang's side of weightsync's call mailbox: a step's calls reach every scheduler (TP worker) process without
going through SGLang's request path.

Why: every ``update_weights_from_tensor`` crosses the tokenizer manager, ZeroMQ and the scheduler's loop; on one
H200 that is ~2.4 ms a call there and back even with the message in the tensor's name (docs/sglang.md §0.6), against
a 9.35 ms budget for 0.85 of the qwen3-8b floor. So, as for vLLM (:mod:`weightsync.vllm.side`), one call through
SGLang's own path at set-up (:func:`serve_mailbox`, run by ``rpc_loader`` in every scheduler process) starts a
:mod:`weightsync.runtime.mailbox` server thread there, and the instance sends each call of a quiet update straight to
it (:class:`~weightsync.instances.sglang.SGLangInstance`, ``mailbox=True``).

**Why a call on the mailbox thread cannot race a forward pass** (SGLang 0.5.14; the control side in
``weightsync/instances/sglang.py``):

1. *No request can enter.* Before the first call of the update the control process takes SGLang's own
   model-update writer lock (``tokenizer_manager.model_update_lock.acquire_writer()``, or its exact effect in place
   while the engine's loop is idle: ``instances/sglang.py:take_writer_in_place``; the lock
   ``update_weights_from_tensor`` takes when generation is not paused, ``managers/tokenizer_control_mixin.py``);
   every generate request holds the reader lock from before it is tokenized until its last output
   (``managers/tokenizer_manager.py:TokenizerManager.generate_request``), so none is sent to a scheduler until the
   instance releases the lock in ``resume()``, after the last answer.
2. *None is in flight.* The lock is taken only when no reader holds it and the tokenizer manager's ``rid_to_state``
   (every request not finished) is empty, checked again once it is held; otherwise the update takes the old path
   (``pause_generation``, calls through ``update_weights_from_tensor``). So no scheduler holds a request: its
   running batch and waiting queue are empty and ``get_next_batch_to_run`` returns nothing, so it launches no batch.
3. *No batch launched earlier is still running.* With the overlap scheduler a batch may have been launched for a
   request whose end was not yet known (its outputs are dropped); it was launched before that request's last output
   left the scheduler, hence before ``rid_to_state`` emptied. The mailbox thread synchronizes the device
   (``torch.cuda.synchronize``: every stream of the process) before it runs a call, so that batch has finished
   reading the weights before the first byte is written.
4. *The scheduler thread steps aside.* SGLang's scheduler loop polls without sleeping, in Python: a second thread
   would get the GIL only in switch-interval (5 ms) slices. :class:`SchedulerGate` wraps the scheduler's
   ``process_input_requests`` (called once per loop iteration, where SGLang itself runs an
   ``update_weights_from_tensor`` request): while a call waits in the mailbox or runs, the scheduler thread waits
   there on a condition, GIL released, and goes on when the call is answered. That is for speed, not for safety
   (1-3 hold without it): at TP > 1 a rank's scheduler may instead be blocked in the loop's request broadcast
   waiting for rank 0's, which is just as idle.

**The KV cache is flushed by the scheduler's own thread.** The radix cache, the KV pools and the scheduler's batch
fields belong to the scheduler thread, so the mailbox thread never touches them. Once a call's copies are posted
(:mod:`weightsync.transport.posted`; after the call where it posts none), if the scheduler ran a batch since
weightsync last flushed it (``Scheduler.forward_ct``, counted in ``run_batch``: KV enters the cache
only from a batch's forward, so an unchanged count means nothing was cached since), the mailbox thread hands a flush
order to the gate, and waits for it before answering: the scheduler thread runs ``Scheduler.flush_cache(empty_cache)`` at its next loop
iteration where ``is_fully_idle()`` (within one or two iterations: a batch launched for a finished request is
processed first) -- exactly where and how SGLang runs its own ``FlushCacheReqInput``
(``scheduler_components/flush_wrapper.py:SchedulerFlushWrapper.handle`` calls the same ``flush_cache`` from
``process_input_requests``), without the request's trip. With SGLang's hierarchical cache it flushes every time. A
scheduler that does not come round within the call's flush wait fails the call (one line naming the rank) and the
reader withholds the engine; a flush the scheduler refuses (``False``) is answered, and the instance then flushes
through SGLang's own ``flush_cache`` request before it releases the writer lock.

**CUDA streams.** The mailbox thread runs the call on its own current stream (the device's default stream; the
transports may use streams of their own), not on the scheduler's ``schedule_stream``/``forward_stream``, so nothing
orders the scheduler's next kernels after the copies by stream. What orders them is the device synchronization the
mailbox thread makes before answering (:mod:`weightsync.runtime.mailbox`): every kernel the call launched, on any
stream, has finished before the answer is written, the instance releases the writer lock only after every rank
answered, and the scheduler's next forward is launched only for a request that entered after that. The scheduler's
own flush runs on its own thread and stream, before the answer too.

Only a quiet update (nothing in flight, SGLang 0.5.14's API) uses the mailbox; calls outside an update, updates
with requests in flight, 0.5.23's session API and ``SGLangInstance(mailbox=False)`` go through
``update_weights_from_tensor`` as before. Security: a message is the signed :mod:`weightsync.runtime.wire` message
(HMAC checked before anything is decoded, weightsync's record types only, each call number run once per rank,
shared with ``rpc_loader``), and it must name this mailbox's directory and instance; the FIFOs are 0600 in the
instance's private 0700 directory. A refused message is answered as an error (the FIFO is private: only this
user's processes can write it).
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from weightsync.errors import InstanceError
from weightsync.runtime.mailbox import MailboxAddress, MailboxServer, serve
from weightsync.transport.gate import waited as go_waited
from weightsync.transport.posted import hooked

log = logging.getLogger("weightsync.sglang.mailbox")

#: where a scheduler keeps its gate (one per scheduler, shared by every instance's mailbox on it)
_GATE_ATTR = "_weightsync_gate"
#: what the gate needs of SGLang's scheduler (0.5.14 ``managers/scheduler.py:Scheduler``)
SCHEDULER_NEEDS = ("process_input_requests", "is_fully_idle", "flush_cache")
#: the scheduler's idle housekeeping, skipped for an iteration while a call is coming or running (0.5.14
#: ``scheduler.py:Scheduler.on_idle``, called by both event loops when no batch runs; see :class:`SchedulerGate`)
IDLE_HOUSEKEEPING = ("on_idle",)


@dataclass(frozen=True)
class MailboxStarted:
    """What a rank answers :func:`serve_mailbox`: its rank and whether its scheduler sleeps when idle (then the gate
    wakes it through the idle sleeper's poller)."""

    rank: int
    sleeper: bool


@dataclass
class _FlushOrder:
    """A flush the mailbox thread asks the scheduler thread for (:meth:`SchedulerGate.flush_after`)."""

    empty_cache: bool
    count: int | None = None  # the scheduler's forward_ct when ordered (flushed_at, once it flushed)
    done: bool = False
    ok: bool = False
    seconds: float = 0.0
    error: str = ""
    thread: int = 0  # the thread that ran it (the scheduler's)

    def run(self, scheduler: Any) -> None:
        t0 = time.perf_counter()
        try:
            try:
                self.ok = bool(scheduler.flush_cache(empty_cache=self.empty_cache))
            except TypeError:  # a flush_cache without the argument
                self.ok = bool(scheduler.flush_cache())
        except Exception as e:  # noqa: BLE001 -- answered; the scheduler loop goes on
            self.ok, self.error = False, f"{type(e).__name__}: {e}"
            log.warning("weightsync: SGLang's flush_cache raised in the scheduler thread: %s", self.error)
        self.seconds = time.perf_counter() - t0
        self.thread = threading.get_ident()
        self.done = True


class SchedulerGate:
    """The place in an SGLang scheduler's loop where its thread steps aside while a weightsync call runs, and
    flushes the cache when a call asks (module docstring, points 4 and the flush).

    Installed once per scheduler by :meth:`of` (a wrapper on the scheduler object's ``process_input_requests``,
    the call each loop iteration makes after receiving requests, in every 0.5.14 event loop). Also wrapped, where
    the scheduler has it: its idle housekeeping (:data:`IDLE_HOUSEKEEPING`), skipped for an iteration while a call
    is coming or running, so that the scheduler thread reaches the gate without finishing it first.

    Why the skip: 0.5.14's ``Scheduler.on_idle`` runs every idle iteration (pool and request-pool leak checks, a
    tree-cache sanity check, metrics, KV events, ...), all Python holding the GIL. A call that arrives during it ran,
    until the scheduler came round to the gate, against a thread that yields the GIL only at its switch interval: on
    one H100 host the handler's first steps took 0.17 ms (decode; 0.016 ms on a CPU host) and 0.75 ms (the binding
    check), the transfer after them ran at full speed (BENCHMARKS.md, "2026-12-06: real SGLang at 0.82-0.88 of the
    floor"). Skipping one iteration's housekeeping changes nothing SGLang relies on: the next idle iteration runs it.
    Measured with the skip (7db2dbb, another H100 host): the decode still took 0.14 ms, so the housekeeping was not
    what slowed it (the once-a-step wake-up onto cold caches fits); the mailbox round trip fell from 0.54 to 0.35 ms,
    not separated from the host. Kept: the scheduler reaches its gate without a housekeeping pass first."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.cond = threading.Condition()
        self.servers: dict[str, MailboxServer] = {}
        #: how long the scheduler thread waits for one call at most before it goes on (a hung call must not stop
        #: SGLang's loop for ever: the writer lock keeps requests out anyway)
        self.park_limit_s = 600.0
        #: times the scheduler thread waited for a call (tests and timing)
        self.parks = 0
        self._flush: _FlushOrder | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._original: Callable[..., Any] = scheduler.process_input_requests
        self.sleeper = self._register_sleeper()
        scheduler.process_input_requests = self._hook
        #: idle iterations whose housekeeping was skipped because a call was coming or running (tests and timing)
        self.skipped_idle = 0
        self._idle: list[str] = []  # the names of the housekeeping methods wrapped on this scheduler
        for name in IDLE_HOUSEKEEPING:
            original = getattr(scheduler, name, None)
            if callable(original) and name not in vars(scheduler):
                self._idle.append(name)
                setattr(scheduler, name, self._idle_hook(original))

    @classmethod
    def of(cls, scheduler: Any) -> "SchedulerGate":
        """The scheduler's gate, installed on first use; :class:`InstanceError` where the scheduler lacks what it
        needs (another SGLang: the instance then keeps ``update_weights_from_tensor``)."""
        gate = getattr(scheduler, "__dict__", {}).get(_GATE_ATTR)
        if isinstance(gate, cls):
            return gate
        missing = [a for a in SCHEDULER_NEEDS if not callable(getattr(scheduler, a, None))]
        if not isinstance(getattr(scheduler, "forward_ct", None), int):
            missing.append("forward_ct")
        if missing:
            raise InstanceError(f"the SGLang scheduler {type(scheduler).__name__} has no {missing} (SGLang 0.5.14's "
                                "Scheduler has them): weightsync's call mailbox needs them to keep out of its loop")
        gate = cls(scheduler)
        setattr(scheduler, _GATE_ATTR, gate)
        return gate

    def _register_sleeper(self) -> bool:
        """With ``sleep_on_idle`` the scheduler sleeps in its idle sleeper's ZeroMQ poller (``scheduler_components/
        idle_sleeper.py:IdleSleeper.maybe_sleep``, up to 1 s): our wake pipe joins that poller, so a flush order
        wakes it."""
        poller = getattr(getattr(self.scheduler, "idle_sleeper", None), "poller", None)
        if poller is None or not callable(getattr(poller, "register", None)):
            return False
        try:
            import zmq

            poller.register(self._wake_r, zmq.POLLIN)
        except Exception as e:  # noqa: BLE001 -- then a flush waits for the sleeper's own timeout (<= 1 s)
            log.warning("weightsync: could not join the SGLang idle sleeper's poller: %s", e)
            return False
        return True

    # -- the scheduler thread ------------------------------------------------------------------------
    def _hook(self, *args: Any, **kwargs: Any) -> Any:
        self.at_safe_point()
        return self._original(*args, **kwargs)

    def _idle_hook(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def idle(*args: Any, **kwargs: Any) -> Any:
            if not self._wanted():
                return original(*args, **kwargs)
            self.skipped_idle += 1  # a call is coming or running: straight on to the gate
            return None

        idle.weightsync_gate = self  # type: ignore[attr-defined]
        return idle

    def _wanted(self) -> bool:
        """The scheduler thread is wanted at its gate: a flush order waits, or a call is coming or running."""
        return self._flush is not None or self._calls()

    def _calls(self) -> bool:
        """A call waits in, or is being run by, a mailbox of this scheduler."""
        return any(s.alive and (s.active or s.pending()) for s in list(self.servers.values()))

    def at_safe_point(self) -> None:
        """Run by the scheduler thread once per loop iteration: wait (GIL released) while a call is coming or
        running; run a flush order when the scheduler is fully idle (else go on: the loop finishes a batch launched
        for a request that already ended, and comes back)."""
        if not self._wanted():
            return
        self._drain()
        started = time.monotonic()
        waited = False
        with self.cond:
            while True:
                order = self._flush
                if order is not None and not order.done:
                    if not self.scheduler.is_fully_idle():
                        break
                    order.run(self.scheduler)
                    self.cond.notify_all()
                    continue
                if not self._calls():
                    break
                if time.monotonic() - started > self.park_limit_s:
                    log.warning("weightsync: a call has held SGLang's scheduler for %.0f s; its loop goes on (the "
                                "model-update writer lock still keeps requests out)", self.park_limit_s)
                    break
                if not waited:
                    waited = True
                    self.parks += 1
                self.cond.wait(0.05)

    def _drain(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    # -- the mailbox thread -------------------------------------------------------------------------------
    def changed(self) -> None:
        """A call is over (the server's ``on_change``): a waiting scheduler thread re-checks."""
        with self.cond:
            self.cond.notify_all()

    def order_flush(self, empty_cache: bool) -> _FlushOrder | None:
        """Hand the scheduler thread a flush order if it ran a batch since weightsync last flushed it (module
        docstring); None where nothing needs flushing. It runs at the scheduler's next safe point: during a call's
        copies (:func:`then_flush`), while this thread waits on the device."""
        from weightsync.sglang.worker import flush_due

        count = flush_due(self.scheduler)
        if count is False:
            return None
        order = _FlushOrder(empty_cache, count)
        with self.cond:
            self._flush = order
            self.cond.notify_all()
        try:
            os.write(self._wake_w, b"f")  # a scheduler asleep in its idle poller wakes
        except BlockingIOError:
            pass
        return order

    def cancel(self, order: _FlushOrder) -> None:
        """Withdraw an order not yet run (the call it was for failed); one already run stays run."""
        with self.cond:
            if self._flush is order:
                self._flush = None

    def flush_after(self, value: Any, order: _FlushOrder | None, wait_s: float, rank: int) -> Any:
        """``value`` as a :class:`~weightsync.instances.sglang.Flushed` once ``order`` (:meth:`order_flush`) has run
        (None: nothing needed flushing); :class:`InstanceError` where the scheduler did not come round in time."""
        from weightsync.sglang.worker import Flushed, flushed_at

        if order is None:
            return Flushed(value, True, 0.0, skipped=True)
        t0 = time.monotonic()
        deadline = t0 + wait_s
        with self.cond:
            while not order.done and (left := deadline - time.monotonic()) > 0:
                self.cond.wait(left)
        self.cancel(order)  # not run in time: withdrawn
        waited = time.monotonic() - t0
        if not order.done:
            raise InstanceError(f"rank {rank}: SGLang's scheduler thread did not come round to flush the KV cache "
                                f"within {wait_s:g} s of the weights landing (is its loop stuck?); the cache may hold KV "
                                "computed with the previous weights, so this update failed")
        if order.ok:
            flushed_at(self.scheduler, order.count)
        return Flushed(value, order.ok, order.seconds, waited=waited)

    # -- set-up ---------------------------------------------------------------------------------------------
    def add(self, directory: str, server: MailboxServer) -> None:
        old = self.servers.pop(directory, None)
        if old is not None:
            old.stop()
        for d in [d for d, s in self.servers.items() if not s.alive]:
            del self.servers[d]
        self.servers[directory] = server

    def remove(self, directory: str | None) -> None:
        """Stop the server of ``directory`` (None: every one); with none left the scheduler gets its method back."""
        for d in list(self.servers) if directory is None else [directory]:
            server = self.servers.pop(d, None)
            if server is not None:
                server.stop()
        if not any(s.alive for s in self.servers.values()):
            self.servers.clear()
            if self.scheduler.__dict__.get("process_input_requests") == self._hook:
                del self.scheduler.process_input_requests
            for name in self._idle:
                if getattr(self.scheduler.__dict__.get(name), "weightsync_gate", None) is self:
                    delattr(self.scheduler, name)
            self.scheduler.__dict__.pop(_GATE_ATTR, None)
            poller = getattr(getattr(self.scheduler, "idle_sleeper", None), "poller", None)
            if self.sleeper and poller is not None:
                try:
                    poller.unregister(self._wake_r)
                except Exception:  # noqa: BLE001
                    pass
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass


# -- what the mailbox thread runs ------------------------------------------------------------------------------

_LOCAL = threading.local()  # on a mailbox thread: the gate and rank of the call being run


def current_gate() -> tuple[SchedulerGate, int] | None:
    """The gate and rank of the mailbox call this thread runs, or None (not on a mailbox thread)."""
    return getattr(_LOCAL, "gate", None)


def _handler(model: torch.nn.Module, instance: str, rank: int, directory: str,
             gate: SchedulerGate) -> Callable[[bytes], bytes]:
    """The mailbox server's handler: authenticate (as ``rpc_loader`` does, and only this mailbox's instance and
    directory), run ``fn(ctx, *args)`` on the live model, answer a pickled ``RpcAnswer``; never raises."""
    from weightsync.instances import error_record
    from weightsync.sglang import worker as W
    from weightsync.runtime import wire

    grad_mode = _grad_mode()
    keys: dict[str, bytes] = {}  # the instance's key, read and checked at the first call (wire.decode)

    def handle(payload: bytes) -> bytes:
        t0 = time.perf_counter()
        try:
            call = wire.decode(payload, keys)
            if call.dir != directory or call.instance != instance:
                raise wire.WireError(f"a call signed for {call.dir!r} (instance {call.instance}) arrived in the mailbox "
                                     f"of {directory!r}: refused")
            last = W.LAST_SEQ.get((instance, rank), 0)
            if call.seq <= last:  # signed, but already run (here or through rpc_loader)
                raise wire.WireError(f"call {call.seq} of instance {instance} replayed (last run: {last})")
            W.LAST_SEQ[instance, rank] = call.seq
        except BaseException as e:  # noqa: BLE001 -- answered through the private FIFO; nothing was decoded
            log.error("weightsync mailbox on rank %s refused a message: %s: %s", rank, type(e).__name__, e)
            return pickle.dumps(W.RpcAnswer(False, error=error_record(e)))
        try:
            t1 = time.perf_counter()
            ctx, check = _context(model, instance, rank)
            t2 = time.perf_counter()
            _LOCAL.gate = (gate, rank)
            try:
                with W.running(model), grad_mode(), hooked(check.run):
                    value = call.fn(ctx, *call.args)
                check()  # where the call posted nothing, or the check has not run: now, before the answer
            finally:
                _LOCAL.gate = None
            spent = (("decode", t1 - t0), ("context", t2 - t1), ("run", time.perf_counter() - t2 - go_waited()),
                     ("check", check.seconds))
            return pickle.dumps(W.RpcAnswer(True, value, spent=spent))
        except BaseException as e:  # noqa: BLE001 -- reported to the control process; the engine stays up
            return pickle.dumps(W.RpcAnswer(False, error=error_record(e)))

    return handle


def _grad_mode() -> Callable[[], Any]:
    """The grad mode SGLang's scheduler loop runs in (0.5.14 ``utils/common.py:DynamicGradMode``: ``no_grad``, or
    ``inference_mode`` with ``SGLANG_ENABLE_TORCH_INFERENCE_MODE``), so a call on the mailbox thread writes and
    allocates exactly as one through ``rpc_loader`` does (an inference tensor may be written in place only inside
    inference mode)."""
    try:
        from sglang.srt.utils.common import DynamicGradMode
    except ImportError:
        return torch.no_grad
    return DynamicGradMode


def serve_mailbox(ctx: Any, directory: str, instance: str, park_limit_s: float) -> MailboxStarted:
    """Set-up, sent once through ``update_weights_from_tensor`` (so it runs in the scheduler thread, inside the
    scheduler's own request handling): install the scheduler's gate and serve this rank's mailbox in ``directory``
    on a daemon thread (replacing one that served it before)."""
    from weightsync.sglang import worker as W

    owner = W.scheduler_owner()
    scheduler = getattr(owner, "scheduler", None)
    if scheduler is None:
        raise InstanceError(f"rank {ctx.rank}: no SGLang scheduler on the loader's call stack (SGLang 0.5.14's "
                            "SchedulerWeightUpdaterManager.update_weights_from_tensor holds it): the call mailbox needs it")
    gate = SchedulerGate.of(scheduler)
    gate.park_limit_s = float(park_limit_s)
    model = W.find_model(ctx)
    server = serve(MailboxAddress(directory), ctx.rank, _handler(model, instance, ctx.rank, directory, gate),
                   ctx.device, name="weightsync-sglang-mailbox", on_change=gate.changed)
    gate.add(directory, server)
    ctx.state["gate"] = gate
    return MailboxStarted(ctx.rank, gate.sleeper)


class _Check:
    """The per-call check that SGLang replaced no parameter since weightsync bound the model
    (:func:`~weightsync.sglang.worker.worker_context`), run once: :meth:`run` as a hook when the call's transport has
    posted its copies (:mod:`weightsync.transport.posted`), keeping what it raises; calling it after the call runs it
    if it has not run and raises what it found.

    Why beside the copies: inside an SGLang scheduler process on the GPU host the check took 0.21 ms a call (0.75
    before b17349b's cheaper check; ~0.03 ms of the same work on a CPU host: the handler's first Python after a
    once-a-step wake-up), all of it before the first copy. Checked after the posting it is as strict: the copies'
    targets are the tensors bound before (``ctx.tensors``, which this process keeps alive, so a replaced
    parameter's old storage is never freed under a copy), a replacement still fails the call before its answer
    (:class:`~weightsync.errors.WeightsMoved`, the reader withholds the engine), and the check never redirects a
    write: where something moved it raises, where nothing did it keeps the same tensors."""

    def __init__(self, model: Any, instance: str, rank: int, done: bool):
        self.model, self.instance, self.rank = model, instance, rank
        self.done = done
        self.error: BaseException | None = None
        self.seconds = 0.0

    def run(self) -> None:
        if self.done:
            return
        self.done = True
        from weightsync.sglang import worker as W

        t0 = time.perf_counter()
        try:
            W.worker_context(self.model, self.instance, self.rank)
        except BaseException as e:  # noqa: BLE001 -- raised after the call (__call__): a hook must not raise
            self.error = e
        self.seconds = time.perf_counter() - t0

    def __call__(self) -> None:
        self.run()
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def _context(model: Any, instance: str, rank: int) -> tuple[Any, "_Check"]:
    """This rank's context for a mailbox call, and its check still due. Bound before to this same model: the
    context as bound, checked beside the copies (:class:`_Check`); otherwise bound or checked now, as
    ``rpc_loader`` does."""
    from weightsync.sglang import worker as W

    ctx = W.CONTEXTS.get((instance, rank))
    if ctx is not None and ctx.state.get("model") is model:
        return ctx, _Check(model, instance, rank, done=False)
    return W.worker_context(model, instance, rank), _Check(model, instance, rank, done=True)


def stop_mailbox(ctx: Any, directory: str | None) -> None:
    """Stop this rank's server of ``directory`` (None: every one); the scheduler gets its loop back when none is
    left. Runs in the scheduler thread (``_forget`` through ``update_weights_from_tensor``)."""
    gate = ctx.state.get("gate")
    if isinstance(gate, SchedulerGate):
        gate.remove(directory)


def then_flush(ctx: Any, empty_cache: bool, wait_s: float, fn: Callable[..., Any], *args: Any) -> Any:
    """A call of a quiet update on the mailbox thread: ``fn(ctx, *args)`` and the KV-cache flush by the
    scheduler's own thread where a batch ran since the last one, answered once both are done. The flush is ordered
    the moment ``fn``'s transport has posted its copies (:mod:`weightsync.transport.posted`), so the scheduler
    thread runs it while they run; where ``fn`` posts nothing, after ``fn``. Flushing any time in the update is the
    same: no request enters and no batch runs until the instance releases SGLang's writer lock (module docstring)."""
    here = current_gate()
    if here is None:
        raise InstanceError("then_flush runs on weightsync's SGLang mailbox thread only")
    gate, rank = here
    orders: list[_FlushOrder | None] = []  # the hook's one order (None: nothing to flush), once the copies are posted
    try:
        with hooked(lambda: orders.append(gate.order_flush(empty_cache))):
            value = fn(ctx, *args)
    except BaseException:
        if orders and orders[0] is not None:
            gate.cancel(orders[0])
        raise
    return gate.flush_after(value, orders[0] if orders else gate.order_flush(empty_cache), wait_s, rank)


__all__ = ["SchedulerGate", "MailboxStarted", "serve_mailbox", "stop_mailbox", "then_flush", "current_gate",
           "SCHEDULER_NEEDS", "IDLE_HOUSEKEEPING"]
