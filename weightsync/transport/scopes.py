"""Per-thread stacks of scopes: what a runner installs around the call it runs, for the transport inside to find.

A gated call's go (:mod:`weightsync.transport.gate`) and a step's posted hooks (:mod:`weightsync.transport.posted`)
are each a stack per thread -- a transport runs on the thread that runs the call, and scopes nest -- entered and
left the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class ThreadScopes(Generic[T]):
    """One stack of scopes per thread; the innermost is the last of :meth:`stack`."""

    def __init__(self) -> None:
        self._local = threading.local()

    @contextmanager
    def scope(self, item: T) -> Iterator[None]:
        """``item`` on this thread's stack for the block."""
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(item)
        try:
            yield
        finally:
            stack.remove(item)

    def stack(self) -> list[T]:
        """This thread's scopes, outermost first (empty outside any)."""
        return getattr(self._local, "stack", [])


__all__ = ["ThreadScopes"]
