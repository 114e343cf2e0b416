"""The fence between a receive and its watcher: a receive the watcher gave up on never lands a byte afterwards.

A watched receive (:func:`weightsync.transport.group.watched`) may be left running when its peer stops: on CPU the
backend's wait blocks on a helper thread the caller walks away from, and a trainer that resumes (SIGCONT) minutes
later completes the abandoned message. Were it then to land what it got, the engine -- synced meanwhile by a new
job -- would hold some of the old trainer's bytes and report the new step. So a receive that lands through a
:class:`Fence` lands each piece inside :meth:`Fence.landing`, and the watcher :meth:`Fence.close`\\ s it when it gives
up: from then on every landing raises instead. Together with a receiver that takes every message into its own
scratch first (gloo: :func:`weightsync.payload.pack.stage` with ``in_place=False``), nothing of an abandoned
transfer reaches a live tensor. (NCCL needs no scratch: aborting the group ends its kernels, and a resumed peer's
bytes have nowhere to go.)

The fence also tells the watcher and the reader two things about the receive: when its step's data began (its
peers announced the step: :meth:`begin`), so the wait for a step the trainers are still training is not counted as
a transfer; and whether anything landed at all (:attr:`landed`), so an update that moved no byte never withholds
the engine.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from weightsync.errors import TransportError


class Fence:
    """One receive's fence (module docstring). Used in order: the receive calls :meth:`begin` once its peers'
    step announcements arrived, lands each piece inside :meth:`landing`; the watcher, giving up, :meth:`close`\\ s
    it -- after which no landing runs or starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: monotonic time the step's data began (every peer announced the step), or None while waiting for it
        self.began: float | None = None
        #: whether any byte of the step may have reached a target (set before the first landing or posting into one)
        self.landed = False
        self._closed: str | None = None

    def begin(self) -> None:
        """The step's data begins now: the watcher's transfer deadline counts from here."""
        self.began = time.monotonic()

    @contextlib.contextmanager
    def landing(self) -> Iterator[None]:
        """Around each write into a live target: raises once the fence is closed, and holds :meth:`close` off
        while the write runs (a close returns only once no landing is running)."""
        with self._lock:
            if self._closed is not None:
                raise TransportError(f"an abandoned transfer landed nothing more: {self._closed}")
            self.landed = True
            yield

    def close(self, why: str) -> None:
        """Fence the receive off: once this returns, no landing is running and none will start."""
        with self._lock:
            self._closed = why

    @property
    def closed(self) -> bool:
        return self._closed is not None
