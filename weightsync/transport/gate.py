"""A step's call sent before its data is there waits at its first copy for the go.

Why: a co-located (or NIXL) step may be copied only once every training rank announced it written, and the reader
learns that in its control process. Sending the call only then puts the call's whole way into the workers on the
step's path: the trip (~0.17 ms through a mailbox on an H100 host), the decode (~0.14 ms), the transport's set-up
(the live addresses looked up, ~0.13 ms) -- BENCHMARKS.md, "2026-12-06: the engines' own step work moved beside
the copies". Sent as soon as ``update(step)`` is called, all of that runs while the reader waits for the trainers'
bell, and only a go (a few bytes down the same pipe) follows the bell: 0.4-0.8 ms a step off the real engines'
receive on one H100 (BENCHMARKS.md, "2026-12-07: the step's call before the trainers' `written`"). It hides what
fits between the call and the bell: a trainer rings ~0.1 ms into ``write(step)``, so a reader that calls
``update(step)`` ahead of it (as the bench does) hides it all.

The runner of a call sent early sends the call, runs the gate (:func:`run_gate`), then sends the go or why not. On
the worker (:mod:`weightsync.runtime.mailbox`'s serving thread, a faithful worker) the call runs in a gated scope
(:func:`gated`) over its :class:`Go`; the transport calls :func:`ready` once its set-up is done and its first copy is
next; a transport that does not (``Receiver.sets_up_before_ready`` False), or one whose transfer may run on another
thread, is given the go before its receive starts (``weightsync.runtime.worker._transfer``). The first :func:`ready`
in a gated scope waits; later ones, and any outside a gated scope, return at once. What the wait raises (:class:`StepCancelled`: the go never came, the step is
not there) propagates: no copy has been posted yet, so the live weights are untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from weightsync.errors import TransportError
from weightsync.transport.scopes import ThreadScopes


class StepCancelled(TransportError):
    """A call sent before its step was there was called off before its first copy: nothing of the step landed."""


def run_gate(gate: Callable[[], None]) -> tuple[str | None, BaseException | None, float]:
    """The runner's side of a call sent early, once it is sent: run ``gate``. Returns what to send its workers
    (None: the go; else why the step is called off, never empty), what the gate raised (for the runner to raise
    once every worker answered) and the gate's seconds."""
    t0 = time.perf_counter()
    try:
        gate()
    except BaseException as e:  # noqa: BLE001 -- the step is called off; the runner raises it after the answers
        return f"{type(e).__name__}: {e}"[:4096] or "called off", e, time.perf_counter() - t0
    return None, None, time.perf_counter() - t0


class Go:
    """A worker's side of a call sent early: its go, read once from the call's channel -- by the transport's first
    :func:`ready`, or after the call (:meth:`settle`: a call that ended before its first copy, so the channel
    stays in step).

    ``receive()`` blocks for the next go message: its call number and None (go on) or why the step was called off;
    ``error(message)`` is the channel's own error for a go of another call."""

    def __init__(self, seq: int, receive: Callable[[], tuple[int, str | None]], error: Callable[[str], Exception]):
        self.seq, self._receive, self._error = seq, receive, error
        self.came = False
        self.waited = 0.0  # seconds spent waiting for it: left out of the call's own time

    def read(self) -> str | None:
        t0 = time.perf_counter()
        try:
            seq, why = self._receive()
        finally:
            self.waited += time.perf_counter() - t0
        if seq != self.seq:
            raise self._error(f"the go of call {seq} came for call {self.seq}: out of step")
        self.came = True
        return why

    def wait(self) -> None:
        """Return on the go; raise :class:`StepCancelled` when the step was called off."""
        why = self.read()
        if why is not None:
            raise StepCancelled(f"the step was called off before its first copy ({why})")

    def settle(self) -> None:
        """After the call: read the go it did not wait for."""
        if not self.came:
            self.read()


@dataclass
class _Scope:
    go: Go
    asked: bool = False  # a ready() ran (the go is waited for once)


_gates: ThreadScopes[_Scope] = ThreadScopes()


@contextmanager
def gated(go: Go) -> Iterator[None]:
    """Within this scope, on this thread, the first :func:`ready` waits for ``go``."""
    with _gates.scope(_Scope(go)):
        yield


def ready() -> float:
    """The step's set-up is done and its first copy is next: wait for the go, if the call was sent early (see the
    module docstring). Returns the seconds waited (0.0 when there was nothing to wait for), which the transport
    leaves out of its own timing."""
    stack = _gates.stack()
    if not stack or stack[-1].asked:
        return 0.0
    scope = stack[-1]
    scope.asked = True
    before = scope.go.waited
    try:
        scope.go.wait()
    finally:
        waited = scope.go.waited - before
    return waited


def waited() -> float:
    """The seconds the innermost gated scope on this thread has waited for its go so far (0.0 outside one): what a
    runner leaves out of the call's own timing."""
    stack = _gates.stack()
    return stack[-1].go.waited if stack else 0.0


__all__ = ["Go", "gated", "ready", "run_gate", "waited", "StepCancelled"]
