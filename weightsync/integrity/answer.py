"""A training rank's answers to the finer exchange: its per-copy sums of a failed step, when asked.

Every checked step the rank computes its copies' sums anyway (the bucket sums are their sums), keeps
them, and *arms* this answerer with them. While armed, one thread long-polls the step's ask name
(``integrity.ask.<rank>.<step>``, :mod:`.exchange`); a worker whose check failed publishes it, and the
thread posts the rank's per-copy sums of that step once (``integrity.copies.<rank>``). The kept sums
are of that step whatever the weights hold by then, so an answer is right even after training moved
on. Sync writers stay armed from a checked step until their next write (the workers check before
they report the step held); async writers until their next checked stage (a snapshot's sums are
posted with it and stay valid that long). Clean steps cost an idle long-poll (one request a second
for the first 30 s armed, then one every 10 s); only a failed step posts more. A long-poll wakes the
moment its ask is posted; a slice's length only delays watching a newly armed step, by at most one
slice, which the asker's wait (``check.ASK_S``) covers.
"""

from __future__ import annotations

import logging
import threading
import time

from weightsync.integrity import exchange
from weightsync.integrity.sums import PairSums

log = logging.getLogger("weightsync.integrity")

POLL_S, SLOW_POLL_S = 1.0, 10.0  # one long-poll of the ask name: the first FAST_S armed, and after
FAST_S = 30.0


class Answerer:
    """One training rank's answering thread (started at the first arm, a daemon: nothing to join)."""

    def __init__(self, client, rank: int):
        self.client, self.rank = client, rank
        self._cond = threading.Condition()
        self._armed: tuple[int, PairSums] | None = None
        self._armed_at = 0.0
        self._answered: int | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def arm(self, step: int, copies: PairSums) -> None:
        """Answer asks for ``step`` with ``copies`` (each pair's copy sums, flat in plan order)."""
        with self._cond:
            self._armed, self._armed_at = (step, copies), time.monotonic()
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"weightsync-integrity-answer-{self.rank}",
                                            daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        with self._cond:
            self._armed = None

    def close(self) -> None:
        with self._cond:
            self._closed, self._armed = True, None
            self._cond.notify_all()

    def _run(self) -> None:
        from weightsync.meta.client import MetaAborted, MetaError, MetaTimeout

        while True:
            with self._cond:
                while self._armed is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                step, copies = self._armed
                slice_s = POLL_S if time.monotonic() - self._armed_at < FAST_S else SLOW_POLL_S
            if self._answered == step:
                with self._cond:  # answered: wait for the next arm
                    if self._armed is not None and self._armed[0] == step:
                        self._armed = None
                continue
            try:
                who = self.client.lookup(exchange.ask_name(self.rank, step), timeout=slice_s)
            except MetaTimeout:
                continue
            except MetaAborted:
                return  # the job is over
            except MetaError as e:  # noqa: PERF203 - keep answering later steps
                log.warning("training rank %d: looking for integrity asks failed: %s", self.rank, e)
                continue
            with self._cond:
                still = self._armed is not None and self._armed[0] == step
            if not still:
                continue
            try:
                n = exchange.publish(self.client, self.rank, step, copies, kind=exchange.COPIES)
                self._answered = step
                log.warning("training rank %d: %s found step %d differing; posted the sums of its copies (%d values)",
                            self.rank, who, step, n)
            except MetaError as e:
                log.warning("training rank %d: could not post the per-copy sums of step %d: %s", self.rank, step, e)
                if isinstance(e, MetaAborted):
                    return
