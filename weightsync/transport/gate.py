"""A step's call sent before its data is there waits at its first copy for the go.

Why: a co-located (or NIXL) step may be copied only once every training rank announced it written, and the reader
learns that in its control process. Sending the call only then puts the call's whole way into the workers on the
step's path: the trip (~0.17 ms through a mailbox on an H100 host), the decode (~0.14 ms), the transport's set-up
(the live addresses looked up, ~0.13 ms) -- BENCHMARKS.md, session 17. Sent as soon as ``update(step)`` is called,
all of that runs while the reader waits for the trainers' bell, and only a go (a few bytes down the same pipe)
follows the bell: 0.4-0.8 ms a step off the real engines' receive on one H100 (BENCHMARKS.md, session 18). It hides
what fits between the call and the bell: a trainer rings ~0.1 ms into ``write(step)``, so a reader that calls
``update(step)`` ahead of it (as the bench does) hides it all.

The runner of a call sent early (:mod:`weightsync.runtime.mailbox`'s serving thread, a faithful worker) installs
the wait for its go (:func:`gated`); the transport calls :func:`ready` once its set-up is done and its first copy is
next; a transport that does not (``Receiver.sets_up_before_ready`` False), or one whose transfer may run on another
thread, is given the go before its receive starts (``weightsync.runtime.worker._transfer``). The first :func:`ready` in a gated scope waits; later ones, and any
outside a gated scope, return at once. What the wait raises (:class:`StepCancelled`: the go never came, the step is
not there) propagates: no copy has been posted yet, so the live weights are untouched.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from weightsync.errors import TransportError

_local = threading.local()


class StepCancelled(TransportError):
    """A call sent before its step was there was called off before its first copy: nothing of the step landed."""


@dataclass
class _Scope:
    wait: Callable[[], None] | None  # None once run
    waited: float = 0.0


@contextmanager
def gated(wait: Callable[[], None]) -> Iterator[None]:
    """Within this scope, on this thread, the first :func:`ready` runs ``wait`` (which returns on the go and raises
    :class:`StepCancelled` when called off)."""
    scope = _Scope(wait)
    stack = _local.__dict__.setdefault("gates", [])
    stack.append(scope)
    try:
        yield
    finally:
        stack.remove(scope)


def ready() -> float:
    """The step's set-up is done and its first copy is next: wait for the go, if the call was sent early (see the
    module docstring). Returns the seconds waited (0.0 when there was nothing to wait for), which the transport
    leaves out of its own timing."""
    stack = getattr(_local, "gates", None)
    if not stack or stack[-1].wait is None:
        return 0.0
    scope = stack[-1]
    wait, scope.wait = scope.wait, None
    t0 = time.perf_counter()
    try:
        wait()
    finally:
        scope.waited = time.perf_counter() - t0
    return scope.waited


def called_off(error: BaseException) -> str:
    """What a runner sends its workers instead of the go when the gate raised ``error``: never empty."""
    return f"{type(error).__name__}: {error}"[:4096] or "called off"


def go_on(why: str | None) -> None:
    """What a runner's wait does with the go it read: return (None: go on), or raise :class:`StepCancelled` saying
    why the step was called off (:func:`called_off`)."""
    if why is not None:
        raise StepCancelled(f"the step was called off before its first copy ({why})")


def waited() -> float:
    """The seconds the innermost gated scope on this thread has waited for its go so far (0.0 outside one): what a
    runner leaves out of the call's own timing."""
    stack = getattr(_local, "gates", None)
    return stack[-1].waited if stack else 0.0


__all__ = ["gated", "ready", "waited", "called_off", "go_on", "StepCancelled"]
