"""An instance's heartbeat: proof to the MetaServer that its reader's process is still there.

A sync step waits for every instance, so a dead one is noticed there (and dropped, on an elastic
transport). In async mode no step waits for anybody, so an async reader joins with a deadline
(``liveness_s``) and this thread posts ``alive`` four times within it; the MetaServer marks the member
``gone`` once it has heard nothing (join, alive, held) for longer, and the members list and /metrics
say so. A heartbeat the server refuses (409: the member was dropped, or replaced by a new incarnation)
stops the thread and is raised by :meth:`Heartbeat.check`; a server that does not answer is retried at
the next beat (after a restart every member gets a whole ``liveness_s`` again).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from weightsync.meta.client import MetaAborted, MetaClient, MetaError, MetaUnavailable

log = logging.getLogger("weightsync.meta.heartbeat")

BEATS_PER_DEADLINE = 4  # so two lost or late beats in a row still keep a member


class Heartbeat:
    """Posts ``alive`` for ``instance`` every ``liveness_s / 4`` from a daemon thread, until :meth:`stop` or
    until ``owner`` (held weakly) is garbage."""

    def __init__(self, client: MetaClient, instance: int, liveness_s: float, incarnation: str | None = None,
                 owner: Any = None):
        self.client, self.instance, self.liveness_s, self.incarnation = client, instance, liveness_s, incarnation
        # the reader's session, held weakly: a reader dropped without close() stops beating (and is marked
        # gone after liveness_s) instead of leaving a thread that claims it alive for the process's life
        self._owner = weakref.ref(owner) if owner is not None else None
        self.every_s = liveness_s / BEATS_PER_DEADLINE
        self.error: MetaError | None = None  # the refusal that stopped it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weightsync-heartbeat-{instance}", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self._owner is not None and self._owner() is None:
                log.info("instance %d: its reader is gone without close(); heartbeat stopped", self.instance)
                return
            try:
                self.client.alive(self.instance, self.incarnation, timeout=self.every_s)
            except MetaUnavailable as e:  # down or restarting: the next beat tries again
                log.warning("instance %d: heartbeat not delivered: %s", self.instance, e)
            except MetaAborted:  # the job is over; the reader learns it at its next call
                return
            except MetaError as e:
                self.error = e
                log.error("instance %d: the MetaServer refused its heartbeat: %s", self.instance, e)
                return

    def check(self) -> None:
        """Raise the refusal that stopped the heartbeat (this instance is no member any more), if any."""
        if self.error is not None:
            raise MetaError(f"instance {self.instance}: the MetaServer stopped counting it as alive: {self.error}",
                            self.error.status)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.every_s + 1.0)


__all__ = ["Heartbeat"]
