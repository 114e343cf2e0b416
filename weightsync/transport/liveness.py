"""Whether the training ranks a wait depends on are alive, for the waits that share no group with them.

A p2p worker waits inside a group with the trainers and watches their beats in its store
(:func:`weightsync.transport.group.watched`). The other waits have no connection to the trainers that breaks
when one dies or stops: a file reader polls its directory for a file that never comes; a NIXL worker's READ of
a stopped trainer's memory stays posted (measured on one host, UCX over loopback: SIGSTOP mid-read, the read
waited out its whole ``timeout_s``; SIGKILL, UCX saw the disconnect in 0.6 s -- across hosts only its
keep-alive would); a co-located or NIXL reader waits for a ``written`` that a dead trainer never posts. Each of
them waited until ``timeout_s``.

So each training rank of such a job keeps a :class:`Beacon`: a ``TCPStore`` server (torch's own, answered by a
C++ thread that needs no GIL) listening on every interface, its address published on the MetaServer as
``alive.<rank>`` at set-up. A :class:`TrainerWatch` (one per worker, one per reader) looks the addresses of the
ranks it waits on up and connects to each once, at set-up; from then on, a wait that has waited
:data:`LOOK_S` asks those ranks every :data:`LOOK_S`, one round trip each, on a helper thread (the waiting
loop only reads the answer):

- the rank answers: it is alive (a slow step is still a step: only ``timeout_s`` ends it);
- its connection fails (closed, reset): the process is gone -- killed, crashed, or it closed its writer -- seen
  in milliseconds;
- no answer within :data:`ANSWER_S`: it is stopped or hung, or its host cannot be reached.

Either verdict ends the wait with a :class:`TrainerLost` (a ``TransportError``) naming the training rank, about
``LOOK_S`` (gone) or ``LOOK_S + ANSWER_S`` (stopped) after the fault, and never later than the wait's own
timeout.

Why this and not the alternatives:

- a MetaServer heartbeat of every trainer: a POST per trainer per beat and a question per waiter per look, all
  to the one shared server (whose restart would then read as every trainer's death); the server stays off the
  step's path;
- process ids through the doorbells: one host only, and NIXL and file readers may sit on another;
- one store at training rank 0 that every rank beats into (the p2p group's way): every rank would depend on rank
  0's store, and a beat says nothing before seconds of silence, where a closed connection says "gone" at once.

Cost: at set-up one lookup and one connection per (waiter, training rank it waits on); a healthy step pays
nothing, unless one of its waits lasts ``LOOK_S``: then one TCP round trip per rank waited on every ``LOOK_S``,
off the waiting thread. A listener that cannot be reached at set-up (an address its readers do not route to) is
left unwatched with a warning saying to set the trainers' ``host``: that rank's faults end at ``timeout_s``, as
before.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, TypeVar

from torch.distributed import TCPStore

from weightsync.errors import TransportError

if TYPE_CHECKING:
    from weightsync.meta.client import MetaClient

log = logging.getLogger("weightsync.transport.liveness")


class ClientSource(Protocol):
    """What a watch needs of the job's MetaServer link (:class:`weightsync.transport.base.MetaLink` is one): a
    client, to look the beacons' addresses up. (A protocol, so this module sits below the transport interface.)"""

    def client(self, timeout_s: float) -> MetaClient: ...

#: a wait asks the trainers it waits on once it has waited this long, and again this often
LOOK_S = 0.5
#: a trainer whose listener does not answer within this is stopped or hung (or its host unreachable): as long
#: as a p2p peer's beat may stay silent (weightsync.transport.group.SILENT_S)
ANSWER_S = 3.0
_KEY = "alive"  # what a look asks the store for (its answer does not matter: that it answers does)

T = TypeVar("T")


def beacon_name(rank: int) -> str:
    """The rendezvous name under which training rank ``rank`` publishes its :class:`Beacon`."""
    return f"alive.{rank}"


def beacon_host(host: str, meta_url: str) -> str:
    """The address a trainer's beacon is published under: its ``host`` option where that is not loopback,
    else the address of its interface that routes to the MetaServer (loopback for a MetaServer on this host),
    which every reader reaching the MetaServer is likely to reach too."""
    from weightsync.transport.group import LOOPBACK, route_address

    if host not in LOOPBACK:
        return host
    server = urllib.parse.urlsplit(meta_url).hostname or "127.0.0.1"
    return "127.0.0.1" if server in LOOPBACK else route_address(server)


class Beacon:
    """A training rank's proof of life: a TCPStore server that answers for as long as the process runs (and
    is not stopped). ``address`` is what :class:`TrainerWatch` connects to."""

    def __init__(self, host: str):
        self._store: TCPStore | None = TCPStore(host, 0, None, True, timedelta(seconds=ANSWER_S),
                                                wait_for_workers=False)
        self.address = f"{host}:{self._store.port}"

    def close(self) -> None:
        """Stop answering (the watchers then see this rank gone)."""
        self._store = None


@dataclass(frozen=True)
class Lost:
    """A training rank a wait depends on, taken for gone or stopped, and why."""

    rank: int
    why: str

    def error(self, what: str, pair: tuple[int, int, int] | None = None, bucket: int | None = None) -> TrainerLost:
        return TrainerLost(f"{what}: {self.why}", peer=self.rank, pair=pair, bucket=bucket)


class TrainerLost(TransportError):
    """A training rank a wait depended on is gone or does not answer (:class:`TrainerWatch`); ``peer`` is its
    training rank."""


class _Look(threading.Thread):
    """One look: ask each rank's store, in turn, until one fails."""

    def __init__(self, stores: list[tuple[int, str, TCPStore]]):
        super().__init__(name="weightsync-trainer-watch", daemon=True)
        self.stores, self.started = stores, time.monotonic()
        self.asking: tuple[int, str] | None = None
        self.lost: Lost | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            for rank, address, store in self.stores:
                self.asking = (rank, address)
                try:
                    store.check([_KEY])
                except Exception as e:  # noqa: BLE001 -- torch's DistNetworkError and kin: the connection is gone
                    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                    self.lost = Lost(rank, f"training rank {rank} is gone: its liveness listener at {address} closed "
                                           f"the connection ({first[:160]}); it was killed, crashed or closed its "
                                           "writer")
                    return
        finally:
            self.done.set()


class TrainerWatch:
    """Whether the training ranks a wait depends on are alive (module docstring): :meth:`connect` once, then
    :meth:`lost` from inside a wait's loop (cheap: it only reads what a helper thread found)."""

    def __init__(self, link: ClientSource, who: str, look_s: float = LOOK_S, answer_s: float = ANSWER_S):
        self.link, self.who = link, who
        self.look_s, self.answer_s = look_s, answer_s
        #: per training rank: (its address, a store client), or None where its listener could not be reached
        self._stores: dict[int, tuple[str, TCPStore] | None] = {}
        self._look: _Look | None = None
        self._next = 0.0  # when the next look may start (time.monotonic())

    def connect(self, ranks: Iterable[int], timeout_s: float) -> None:
        """Look up and connect to each of ``ranks`` not connected yet (waiting up to ``timeout_s`` for each to
        publish its beacon: a trainer does so at set-up)."""
        ranks = [r for r in sorted(set(ranks)) if r not in self._stores]
        if not ranks:
            return
        client = self.link.client(timeout_s)
        for r in ranks:
            address = client.lookup(beacon_name(r), timeout=timeout_s)
            self._stores[r] = self._open(r, address)

    def _open(self, rank: int, address: str) -> tuple[str, TCPStore] | None:
        from weightsync.transport.group import _within

        host, _, port = address.rpartition(":")
        try:
            store = _within(lambda: TCPStore(host, int(port), None, False, timedelta(seconds=self.answer_s),
                                             wait_for_workers=False), self.answer_s + 1.0)
        except Exception as e:  # noqa: BLE001 -- unreachable: watch nothing of this rank rather than call it dead
            log.warning("%s: cannot reach training rank %d's liveness listener at %s (%s): a fault of that rank is "
                        "noticed only at timeout_s; give the trainers a host= address this host reaches", self.who,
                        rank, address, (str(e).strip().splitlines() or [type(e).__name__])[0])
            return None
        return address, store

    @property
    def ranks(self) -> list[int]:
        """The training ranks watched (connected at set-up)."""
        return sorted(r for r, s in self._stores.items() if s is not None)

    def lost(self, ranks: Iterable[int], waited_s: float) -> Lost | None:
        """Which of ``ranks`` (those the caller still waits on) is gone or stopped, by the latest look, or None.
        ``waited_s``: how long the caller has waited (without progress); nothing is asked before :data:`LOOK_S`.
        Never blocks: a look runs on a helper thread, and one that has not answered within :data:`ANSWER_S`
        names the rank it was asking."""
        if waited_s < self.look_s:
            return None
        now = time.monotonic()
        wanted = set(ranks)
        look = self._look
        if look is not None:
            if look.done.is_set():
                self._look = None
                if look.lost is not None and look.lost.rank in wanted:
                    return look.lost
            elif now - look.started >= self.answer_s and look.asking is not None and look.asking[0] in wanted:
                rank, address = look.asking
                return Lost(rank, f"training rank {rank} did not answer within {self.answer_s:g} s (its liveness "
                                  f"listener at {address}): it is stopped or hung, or its host cannot be reached")
            else:
                return None
        if now >= self._next:
            stores = [(r, *s) for r in sorted(wanted) if (s := self._stores.get(r)) is not None]
            if stores:
                self._look = _Look(stores)
                self._look.start()
            self._next = now + self.look_s
        return None

    def result(self, future: Future[T], ranks: Iterable[int], timeout_s: float, what: str) -> T:
        """``future.result()`` (a wait on a helper thread that depends on ``ranks``), raising
        :class:`TrainerLost` once one of them is gone or stopped; TimeoutError past ``timeout_s``."""
        ranks = list(ranks)
        start = time.monotonic()
        while True:
            waited = time.monotonic() - start
            if waited >= timeout_s:
                return future.result(timeout=0)
            done, _ = wait_futures([future], timeout=min(self.look_s / 5, timeout_s - waited))
            if done:
                return future.result()
            gone = self.lost(ranks, time.monotonic() - start)
            if gone is not None:
                raise gone.error(what)

    def close(self) -> None:
        self._stores.clear()
        self._look = None


__all__ = ["ANSWER_S", "LOOK_S", "Beacon", "Lost", "TrainerLost", "TrainerWatch", "beacon_host", "beacon_name"]
