"""A call mailbox into an engine's worker processes: one step's call without a trip through the engine.

Why: a real engine's own way into its workers is a trip through its scheduler process (vLLM: msgpack over
ZeroMQ to the engine core, which hands the call to every worker between model steps): 1.81 ms a trip on
an H200 host, measured (BENCHMARKS.md, "Real vLLM on GPU"), against an 8 ms step. After set-up (one engine
call that starts :func:`serve` on every worker) the control process sends each call straight to the
workers' mailboxes; nothing of the engine is in the way.

**Pipes, not polled bells.** Each worker has a request pipe and an answer pipe: named pipes (FIFOs, mode
0600) in the instance's private 0700 directory (:func:`weightsync.runtime.wire.new_key_dir`). A pipe wakes
its reader from the kernel within microseconds and costs no CPU while it waits (a shared-memory
:mod:`~weightsync.runtime.doorbell` is either spun on, a core, or slept on in 50 us naps, and says nothing
when its peer dies); and a pipe reports its other end closing: a worker process that dies, or a worker
thread that ends, is seen by the control process at once (``POLLHUP``), a control process that dies by the
workers' threads (which then end). A call still running at its deadline raises :class:`MailboxTimeout`
and closes the mailbox (a late answer is never read as the next call's).

**What travels** is bytes both ways, framed ``kind | seq | length``; the engine adapter decides what the
bytes mean. weightsync's engine adapters send a signed :mod:`~weightsync.runtime.wire` message (HMAC-checked
before anything is decoded, a restricted unpickler, each call number run at most once) and answer what the
engine's own call method would (``weightsync.vllm.rpc.answer``). A worker opens only a FIFO of its own uid,
mode 0600, in a private weightsync directory, never through a link.

**Posted.** While a handler runs, :func:`weightsync.transport.posted.posted` (a transport calls it once every copy
of the step is in flight) sends the control process a ``POSTED`` frame ahead of the answer; ``call(...,
on_posted=...)`` runs its hook once every rank has posted (or answered): the engine adapter starts there the work
that would otherwise contend with the workers' posting (vLLM's prefix-cache reset).

**Sent early, gone on later.** ``call(..., gate=...)`` sends a ``GATED`` call, then runs ``gate()`` on the calling
thread (the reader's wait for the trainers' `written`), then sends each rank a ``GO`` frame: empty to go on, the
gate's error to call the step off. The worker runs the call at once; its transport waits for the frame at its
first copy (:mod:`weightsync.transport.gate`: the trip, the decode and the set-up run before the go). A
call off raises :class:`~weightsync.transport.gate.StepCancelled` there, before any copy, and ``call`` raises the
gate's own error once every rank answered. A worker always reads its ``GO`` before answering (a call that failed
before its first copy too), so the pipes stay in step; the call's deadline starts at the ``GO``.

**Devices.** The serving thread runs with the worker's device current (``torch.cuda.set_device``), and
synchronizes it before running a call and again before answering: the answer is sent only once every
kernel the call launched has finished, on whatever stream, so the control process that reads it (and
resumes generation after it) never races a copy still in flight. What keeps the engine's own forward
passes away from a call is the engine adapter's business (vLLM: ``weightsync.instances.vllm``; SGLang:
``weightsync.sglang.mailbox``).

**A host thread that steps aside.** A worker process whose own main thread spins in Python (SGLang's scheduler
loop polls ZeroMQ without sleeping) holds the GIL nearly all the time: a serving thread woken by a call would wait
up to the interpreter's switch interval (5 ms) for it, at every wake-up and every GIL hand-over. So the server says
when it has work -- :meth:`MailboxServer.pending` (a call's bytes wait in its pipe) and :attr:`MailboxServer.active`
(a call is being read, run or answered) -- and tells the host when a call is over (``on_change``), so that the host
loop can wait, GIL released, while a call runs (the engine adapter decides where its loop may wait).

Engine-independent: nothing here knows vLLM or SGLang.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.transport.gate import Go, gated, run_gate
from weightsync.transport.posted import hooked
from weightsync.transport.private import check_private_directory

log = logging.getLogger("weightsync.runtime.mailbox")

#: a request frame: kind (1 byte), call number (8), payload length (8), then the payload; an answer frame also
#: carries the seconds the worker spent in the handler and in the two device syncs (:class:`CallTiming`)
_FRAME = struct.Struct(">BQQ")
_ANSWER = struct.Struct(">BQQdd")
CALL, ANSWER, FAILED, POSTED, GATED, GO = 1, 2, 3, 4, 5, 6
_CHUNK = 1 << 20
#: the names a mailbox directory may carry (weightsync.runtime.wire.DIR_PREFIXES, repeated: no import of torch here)
DIR_PREFIXES = ("weightsync-sglang-", "weightsync-vllm-")


class MailboxError(RuntimeError):
    """The mailbox could not carry a call (set-up refused, a protocol error, or the worker's device failed)."""


class MailboxDied(MailboxError):
    """A worker's end of the mailbox closed: its process died, or its serving thread ended."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


class MailboxTimeout(MailboxError):
    """Workers did not answer a call within its deadline (the mailbox is closed: the call may still be running)."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


@dataclass(frozen=True)
class CallTiming:
    """Where one call's time went (seconds): ``seconds`` from sending the first byte to reading the last answer (the
    control process's side), ``handler`` the slowest worker's handler (decoding, running, encoding the answer),
    ``synced`` the slowest worker's two device syncs; the rest (``seconds - handler - synced``) is the mailbox's own
    round trip: pipes, wake-ups, framing."""

    seconds: float
    handler: float
    synced: float
    #: a gated call: the seconds its gate took, before ``seconds`` started (the workers' wait for the go is out of
    #: ``handler`` too)
    gated: float = 0.0


@dataclass(frozen=True)
class MailboxAddress:
    """Where the workers' mailboxes are: the instance's private directory (named ``weightsync-<engine>-*``)."""

    directory: str

    def request(self, rank: int) -> str:
        return os.path.join(self.directory, f"mailbox-call.{int(rank)}")

    def answer(self, rank: int) -> str:
        return os.path.join(self.directory, f"mailbox-answer.{int(rank)}")


def _check_directory(d: str) -> None:
    """``d`` is a private weightsync directory of this user (0700 or tighter, not a link)."""
    check_private_directory(d, DIR_PREFIXES, MailboxError, "mailbox directory")


def _open_fifo(path: str, flags: int) -> int:
    """Open a mailbox FIFO (non-blocking), refusing anything but a 0600 FIFO of this user (no link)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise MailboxError(f"{path} is not a private mailbox FIFO of uid {os.geteuid()}: refusing it")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _frame(kind: int, seq: int, payload: bytes) -> bytes:
    return _FRAME.pack(kind, seq, len(payload)) + payload


class _Reader:
    """Accumulates one frame (``head``: its header's layout) from a non-blocking fd."""

    def __init__(self, head: struct.Struct = _FRAME) -> None:
        self.head = head
        self.buf = bytearray()
        self.want = head.size

    def feed(self, fd: int) -> bool:
        """Read what is there; True once the frame is whole. Raises EOFError when the writer closed."""
        while len(self.buf) < self.want:
            try:
                chunk = os.read(fd, min(_CHUNK, self.want - len(self.buf)))
            except BlockingIOError:
                return False
            if not chunk:
                raise EOFError
            self.buf += chunk
            if len(self.buf) == self.head.size and self.want == self.head.size:
                self.want += self.head.unpack(self.buf)[2]
        return True

    def frame(self) -> tuple[int, int, bytes]:
        kind, seq = self.head.unpack_from(self.buf)[:2]
        return kind, seq, bytes(self.buf[self.head.size:])

    def times(self) -> tuple[float, float]:
        """An answer's (handler, synced) seconds."""
        return self.head.unpack_from(self.buf)[3:5]


class Mailbox:
    """The control process's end: ``call`` sends one request to each worker and returns their answers.

    Made before the workers serve (it creates the FIFOs and opens the answer ends), :meth:`connect`\\ ed after
    (the request ends open only while a worker reads). One call at a time: a second call while one runs is refused.
    :meth:`close` may come from any thread: during a call it wakes the call (which raises :class:`MailboxError`
    naming why) and the call's thread closes the pipes as it leaves -- never under a call still polling them, whose
    descriptor numbers the process could otherwise hand to a file opened meanwhile."""

    def __init__(self, directory: str, ranks: int):
        _check_directory(directory)
        self.address = MailboxAddress(directory)
        self.ranks = ranks
        self._answers: list[int] = []
        self._requests: list[int] = []
        self._seq = 0
        self.closed: str | None = None
        #: the last call's :class:`CallTiming`
        self.last: CallTiming | None = None
        self._lock = threading.Lock()  # guards closed, _calling and closing the descriptors
        self._calling = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)  # close() wakes a call in flight
        try:
            for r in range(ranks):
                for path in (self.address.request(r), self.address.answer(r)):
                    os.mkfifo(path, 0o600)
                    os.chmod(path, 0o600)  # a umask never widens it; this only undoes one that narrowed it
                # open now, before any writer: a reader opens a FIFO without waiting
                self._answers.append(_open_fifo(self.address.answer(r), os.O_RDONLY))
        except BaseException:
            self.close("set-up failed")
            raise

    def connect(self) -> None:
        """Open every worker's request end; :class:`MailboxError` where a worker does not serve its mailbox."""
        for r in range(self.ranks):
            try:
                self._requests.append(_open_fifo(self.address.request(r), os.O_WRONLY))
            except OSError as e:
                self.close("not connected")
                why = "no thread reads it" if e.errno == errno.ENXIO else e.strerror
                raise MailboxError(f"rank {r}'s mailbox cannot be opened ({why})") from e

    def call(self, requests: Sequence[bytes], timeout_s: float, what: str = "the call",
             on_posted: Callable[[], None] | None = None, gate: Callable[[], None] | None = None) -> list[bytes]:
        """Send ``requests[r]`` to rank r, every rank at once; each rank's answer, in rank order. ``on_posted``: run
        (on this thread, once) when every rank has said its transfer is posted or has answered, if one said so.
        ``gate``: the call is sent at once, its copies wait for ``gate()`` to return (run on this thread once the
        requests are sent; what it raises calls the step off, and is raised once every rank answered; the module
        docstring's "Sent early"); ``timeout_s`` counts from then.

        :class:`MailboxDied` when a worker's end closes (process dead, thread ended), :class:`MailboxTimeout` at
        the deadline, :class:`MailboxError` when a worker's serving failed outside the call (its device); after
        the first two the mailbox is closed."""
        with self._lock:
            if self.closed is not None:
                raise MailboxError(f"the mailbox is closed ({self.closed})")
            if self._calling:
                raise MailboxError(f"{what}: another call is in flight (a mailbox runs one call at a time)")
            if len(requests) != self.ranks or len(self._requests) != self.ranks:
                raise MailboxError(f"{len(requests)} requests for {self.ranks} ranks, {len(self._requests)} "
                                   "connected")
            self._calling = True
        try:
            return self._call(requests, timeout_s, what, on_posted, gate)
        finally:
            with self._lock:
                self._calling = False
                if self.closed is not None:  # closed during the call (here or by another thread): close now
                    self._close_fds()

    def _call(self, requests: Sequence[bytes], timeout_s: float, what: str,
              on_posted: Callable[[], None] | None, gate: Callable[[], None] | None) -> list[bytes]:
        self._seq += 1
        seq = self._seq
        t0 = time.perf_counter()
        gate_s, cancelled, sending = 0.0, None, what
        deadline = time.monotonic() + timeout_s
        kind = CALL if gate is None else GATED
        out = {self._requests[r]: (r, memoryview(_frame(kind, seq, requests[r]))) for r in range(self.ranks)}
        readers = {self._answers[r]: (r, _Reader(_ANSWER)) for r in range(self.ranks)}
        spent: list[tuple[float, float]] = []
        answers: dict[int, tuple[int, bytes]] = {}
        posted: set[int] = set()  # ranks whose transfer is posted (or that answered)
        said = False  # a rank sent POSTED
        poller = select.poll()
        for fd in out:
            poller.register(fd, select.POLLOUT)
        for fd in readers:
            poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while out or readers:
                for fd in list(out):  # write what the pipes take without waiting
                    r, data = out[fd]
                    try:
                        n = os.write(fd, data[:_CHUNK])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        raise MailboxDied(f"rank {r}'s mailbox closed before {sending} was sent (the worker "
                                          "process died, or its mailbox thread ended)", r) from None
                    if n == len(data):
                        del out[fd]
                        poller.unregister(fd)
                    else:
                        out[fd] = (r, data[n:])
                if gate is not None and not out:  # every rank has the call: wait for its step, then go (or not)
                    why, cancelled, gate_s = run_gate(gate)
                    gate, sending = None, f"the go of {what}"
                    go = _frame(GO, seq, b"" if why is None else why.encode(errors="replace"))
                    for r in range(self.ranks):
                        out[self._requests[r]] = (r, memoryview(go))
                        poller.register(self._requests[r], select.POLLOUT)
                    t0, deadline = time.perf_counter(), time.monotonic() + timeout_s
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted({r for r, _ in readers.values()} | {r for r, _ in out.values()})
                    raise MailboxTimeout(f"ranks {missing} did not answer {what} within its {timeout_s:g} s deadline",
                                         missing)
                for fd, ev in poller.poll(max(1, int(left * 1000) + 1) if left < 3600 else 3_600_000):
                    if fd == self._wake_r:
                        raise MailboxError(f"{what}: the mailbox was closed during the call ({self.closed})")
                    if fd not in readers:
                        continue
                    r, rd = readers[fd]
                    try:
                        whole = rd.feed(fd)
                    except EOFError:
                        raise MailboxDied(f"rank {r}'s mailbox closed during {what} (the worker process died, or "
                                          "its mailbox thread ended)", r) from None
                    if whole:
                        kind, got, body = rd.frame()
                        if got != seq:
                            raise MailboxError(f"rank {r} answered call {got}, not {seq}: out of step")
                        posted.add(r)
                        if kind == POSTED:
                            said = True
                            readers[fd] = (r, _Reader(_ANSWER))  # the answer follows
                        else:
                            answers[r] = (kind, body)
                            spent.append(rd.times())
                            del readers[fd]
                            poller.unregister(fd)
                        if on_posted is not None and said and len(posted) == self.ranks:
                            hook, on_posted = on_posted, None
                            try:
                                hook()
                            except Exception:  # noqa: BLE001 -- the caller's hook: never breaks the call
                                log.exception("%s: the call's on_posted hook raised", what)
        except (MailboxDied, MailboxTimeout, MailboxError) as e:
            self.close(str(e))
            raise
        self.last = CallTiming(time.perf_counter() - t0, max(h for h, _ in spent), max(s for _, s in spent), gate_s)
        failed = [f"rank {r}: {body.decode(errors='replace')}" for r, (kind, body) in sorted(answers.items())
                  if kind == FAILED]
        if failed:
            raise MailboxError(f"{what}: the worker's mailbox failed outside the call: " + "; ".join(failed))
        if cancelled is not None:  # every rank called its step off before its first copy (or failed before it)
            raise cancelled
        return [answers[r][1] for r in range(self.ranks)]

    def close(self, why: str = "closed") -> None:
        """Close this end; the workers' threads see it and end. From another thread during a call: the call is
        woken and raises, and closes the pipes as it leaves (see the class docstring)."""
        with self._lock:
            if self.closed is None:
                self.closed = why
            if self._calling:
                try:
                    os.write(self._wake_w, b"x")
                except BlockingIOError:  # already woken
                    pass
                return
            self._close_fds()

    def _close_fds(self) -> None:
        for fd in self._requests + self._answers + [self._wake_r, self._wake_w]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._requests, self._answers = [], []
        self._wake_r = self._wake_w = -1


class MailboxServer:
    """A worker's end: a daemon thread that answers each request with ``handle(payload)`` (see :func:`serve`)."""

    def __init__(self, address: MailboxAddress, rank: int, handle: Callable[[bytes], bytes], device: Any = None,
                 name: str = "weightsync-mailbox", on_change: Callable[[], None] | None = None):
        _check_directory(address.directory)
        self.address, self.rank, self.handle, self.device = address, rank, handle, device
        self.calls = 0
        #: True from the moment a call's first bytes are read until its answer is sent (see :meth:`pending`)
        self.active = False
        #: called on the serving thread when a call is over (answered, or its answer could not be sent) and when the
        #: thread ends: a host waiting for the call (:attr:`active`) re-checks then; must not raise
        self.on_change = on_change
        self._req = _open_fifo(address.request(rank), os.O_RDONLY)
        try:
            self._ans = _open_fifo(address.answer(rank), os.O_WRONLY)  # the control process reads it already
        except OSError as e:
            os.close(self._req)
            raise MailboxError(f"rank {rank}: the control process does not read {address.answer(rank)} "
                               f"({e.strerror})") from e
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = False
        self._closed = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name=f"{name}-{rank}", daemon=True)
        self.thread.start()

    # -- the thread ------------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            self._set_device()
            while True:
                kind, seq, payload = self._next()
                if kind is None:
                    return
                t0 = time.perf_counter()
                handler = 0.0
                go = (Go(seq, self._go, lambda m: MailboxError(f"rank {self.rank}: {m}")) if kind == GATED
                      else None)
                try:
                    self._sync()
                    t1 = time.perf_counter()
                    with hooked(lambda seq=seq: self._send(_ANSWER.pack(POSTED, seq, 0, 0.0, 0.0))), \
                            (gated(go) if go is not None else contextlib.nullcontext()):
                        reply, rkind = self.handle(payload), ANSWER
                    handler = time.perf_counter() - t1 - (go.waited if go is not None else 0.0)
                    self._sync()  # every kernel the call launched is done before the answer says so
                except BaseException as e:  # noqa: BLE001 -- answered; the handler itself never raises
                    reply, rkind = f"{type(e).__name__}: {e}".encode(), FAILED
                waited = 0.0
                if go is not None:
                    with contextlib.suppress(MailboxError):  # closed meanwhile: the answer is not sent either
                        go.settle()  # a call that ended before its first copy reads its go all the same (in step)
                    waited = go.waited
                synced = time.perf_counter() - t0 - handler - waited
                self.calls += 1
                sent = self._send(_ANSWER.pack(rkind, seq, len(reply), handler, synced) + reply)
                self._over()
                if not sent:
                    return
        except BaseException as e:  # noqa: BLE001 -- the thread ends; the control process sees its end close
            self.error = e
            log.warning("rank %d: the weightsync mailbox thread ended: %s: %s", self.rank, type(e).__name__, e)
        finally:
            self._close()
            self._over()

    def _over(self) -> None:
        """A call is over (or the thread ends): not :attr:`active`; the host is told."""
        self.active = False
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # noqa: BLE001 -- the host's hook: never ends the serving thread
                log.exception("rank %d: the mailbox's on_change hook raised", self.rank)

    def _set_device(self) -> None:
        dev = self.device
        if dev is not None and getattr(dev, "type", None) == "cuda":
            import torch

            torch.cuda.set_device(dev)

    def _sync(self) -> None:
        dev = self.device
        if dev is not None and getattr(dev, "type", None) == "cuda":
            import torch

            torch.cuda.synchronize(dev)

    def _go(self) -> tuple[int, str | None]:
        """A gated call's ``GO`` frame (:class:`~weightsync.transport.gate.Go`): its call number, and None to go on or
        why the step was called off."""
        kind, seq, payload = self._next((GO,))
        if kind is None:
            raise MailboxError(f"rank {self.rank}: the mailbox closed while a call waited for its go")
        return seq, payload.decode(errors="replace") if payload else None

    def _next(self, kinds: tuple[int, ...] = (CALL, GATED)) -> tuple[int | None, int, bytes]:
        """The next request frame (one of ``kinds``), or (None, ...) when the control process closed its end or stop()
        was called."""
        poller = select.poll()
        poller.register(self._req, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        rd = _Reader()
        while True:
            events = dict(poller.poll())
            if self._wake_r in events or self._stopping:
                return None, 0, b""
            if self._req in events:
                self.active = True  # before reading: pending() may turn False only once this is True
                try:
                    if rd.feed(self._req):
                        kind, seq, payload = rd.frame()
                        if kind not in kinds:
                            raise MailboxError(f"rank {self.rank}: a frame of kind {kind} where one of {kinds} was "
                                               "expected")
                        return kind, seq, payload
                except EOFError:  # every writer closed: the control process closed the mailbox, or died
                    return None, 0, b""

    def _send(self, data: bytes) -> bool:
        view = memoryview(data)
        poller = select.poll()
        poller.register(self._ans, select.POLLOUT)
        poller.register(self._wake_r, select.POLLIN)
        while view:
            try:
                n = os.write(self._ans, view[:_CHUNK])
                view = view[n:]
                continue
            except BlockingIOError:
                pass
            except BrokenPipeError:  # the control process closed the mailbox (a deadline passed) or died
                return False
            events = dict(poller.poll())
            if self._wake_r in events:
                return False
        return True

    def _close(self) -> None:
        self._closed = True
        for fd in (self._req, self._ans):  # the wake pipe is stop()'s: closed there, once the thread is gone
            try:
                os.close(fd)
            except OSError:
                pass

    # -- any thread of the worker ------------------------------------------------------------------
    def pending(self) -> bool:
        """Whether a call's bytes wait in the request pipe, not yet read by the serving thread (one ``poll``, no
        wait). With :attr:`active` it tells a host loop that a call is coming or running: the serving thread sets
        :attr:`active` before it reads, so between the two there is no moment where a call in flight shows neither."""
        if self._closed:
            return False
        p = select.poll()
        p.register(self._req, select.POLLIN)
        try:
            return any(ev & select.POLLIN for _, ev in p.poll(0))
        except OSError:  # closed meanwhile
            return False

    # -- the worker's main thread ------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread (after the call it runs, if any)."""
        self._stopping = True
        if self._wake_w < 0:  # stopped before
            return
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self.thread is not threading.current_thread():
            self.thread.join(timeout_s)
        if not self.thread.is_alive():
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._wake_r = self._wake_w = -1


def serve(address: MailboxAddress, rank: int, handle: Callable[[bytes], bytes], device: Any = None,
          name: str = "weightsync-mailbox", on_change: Callable[[], None] | None = None) -> MailboxServer:
    """Serve rank ``rank``'s mailbox on a daemon thread of this (worker) process: each request's bytes go to
    ``handle`` (which must not raise: answer its errors as bytes), its result back as the answer. ``device``: the
    worker's device, current in the thread and synchronized around every call. ``on_change``: called on that
    thread when a call is over and when the thread ends (:meth:`MailboxServer.pending`). Returns once the FIFOs
    are open (the control process may :meth:`Mailbox.connect` then)."""
    return MailboxServer(address, rank, handle, device, name, on_change)


__all__ = ["Mailbox", "MailboxAddress", "CallTiming", "MailboxServer", "MailboxError", "MailboxDied", "MailboxTimeout", "serve",
           "DIR_PREFIXES"]
