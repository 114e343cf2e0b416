"""What one peer, or one slow sender, may hold of the MetaServer's connections (and so of its open files).

Before this, a slowloris shut everyone out: no connection cap, the soft ``RLIMIT_NOFILE`` left at the common
1,024 and 30 s to send a request's headers, so ~4,000 re-opened trickling connections pinned the server (a
client with its job's token got no answer for 45 s, and none for 63 s after the attack ended). Now:

* at start the soft ``RLIMIT_NOFILE`` is raised to the hard limit (:func:`raise_file_limit`), and the server
  holds at most ``max_connections`` connections (by default that limit less the files already open and a
  reserve: :func:`file_budget`), so ``accept`` does not fail for want of a file (asyncio answers that failure
  by logging an error for each accept it tries in that wake-up and accepting nothing for a second);
* a connection must have a request's headers complete within ``header_s`` of connecting, of the first byte
  of that request (after a kept-alive pause) or, while no request on it presented a valid token, of its
  previous answer; it is closed otherwise;
* a connection is *authenticated* once a request on it passed the token check (``/health`` does not count;
  on a server without a token, any request but ``/health``). A peer address holds at most ``per_peer``
  unauthenticated connections: one more closes that address's oldest unauthenticated connection. At
  ``max_connections``, a new connection closes the oldest unauthenticated connection of any address, else the
  authenticated connection idle longest between requests (its client reconnects at once), else it is
  refused. An authenticated request in progress (a long-poll) is never closed to make room.

Why the per-address cap counts unauthenticated connections only: every participant of a local job comes from
127.0.0.1, and a real job has 1,000+ participants on a few hosts, each holding a connection per thread with
long-polls open. A cap on all of an address's connections would have to be above what a whole host holds
legitimately, and would then stop nobody. A participant is unauthenticated only from its connect until its
first request's headers are in (milliseconds), so the cap (default 4,096, the listen backlog: a host's ranks
all connecting at once) bounds what an address holds without a token, and an attacker sharing an address
with participants (loopback, a NAT) closes its own older connections, not a newcomer that sends its headers
at once. A client with a valid token is bounded by ``max_connections`` only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

try:
    import resource
except ImportError:  # not a POSIX system: no limit to raise
    resource = None  # type: ignore[assignment]

__all__ = ["ACCEPT_BATCH", "HEADER_S", "PER_PEER", "ConnectionGate", "ConnectionLimits", "file_budget",
           "raise_file_limit"]

log = logging.getLogger("weightsync.meta.limits")

HEADER_S = 5.0  # a request's headers must be complete within this
PER_PEER = 4096  # unauthenticated connections of one address
#: connections asyncio accepts per wake-up, each a file, before any protocol (so the gate) sees them; the kernel's
#: listen queue stays BACKLOG deep, only the batch is small, so the budget's reserve covers it
ACCEPT_BATCH = 64
LOG_EVERY_S = 10.0  # closes are summed into one warning at most this often
CLOSE_REASONS = ("header_deadline", "peer_cap", "budget_unauthenticated", "budget_idle", "refused_full")


@dataclass(frozen=True)
class ConnectionLimits:
    """The MetaServer's connection limits (see the module's docstring for what each protects)."""

    per_peer: int = PER_PEER  # unauthenticated connections held per peer address
    max_connections: int | None = None  # None: from the open-file limit (file_budget)
    header_s: float = HEADER_S  # a request's headers complete within this

    def __post_init__(self) -> None:
        if self.per_peer < 1:
            raise ValueError(f"per_peer must be at least 1, got {self.per_peer}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        if not self.header_s > 0:
            raise ValueError(f"header_s must be positive, got {self.header_s}")


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def raise_file_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit and return the soft limit now in force:
    every connection is a file, and the common soft 1,024 is what a slowloris used up."""
    if resource is None:
        return 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = _nr_open()
    want = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
    if soft == resource.RLIM_INFINITY:
        return ceiling
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log.warning("MetaServer: could not raise the open-file limit from %d to %d: %s", soft, want, e)
            return soft
        log.info("MetaServer: raised the open-file limit (RLIMIT_NOFILE) from %d to %d", soft, want)
        return want
    return soft


def file_budget(limit: int) -> int:
    """How many connections to hold under an open-file limit of ``limit``: less the files open now, twice an
    accept batch (files taken before the gate sees them), and a reserve for the store, logs and threads."""
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 64
    return max(16, limit - open_now - 2 * ACCEPT_BATCH - max(64, limit // 16))


_HEADING, _BUSY, _IDLE, _CLOSED = "heading", "busy", "idle", "closed"


class _Conn(asyncio.Protocol):
    """One connection: admitted (or refused) by the gate before aiohttp's protocol is made for it; forwards
    everything to that protocol, and tells the gate when a kept-alive pause ends (its headers are timed)."""

    def __init__(self, gate: ConnectionGate, make: Callable[[], asyncio.Protocol]):
        self.gate, self.make = gate, make
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.trusted = False
        self.state = _HEADING

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        if isinstance(peer, (tuple, list)) and peer:
            self.peer = str(peer[0])
        if not self.gate.admit(self):
            transport.abort()
            return
        self.inner = self.make()
        self.gate.made(self)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self.state == _IDLE:  # the first byte of the next request on a kept-alive connection
            self.gate.heading(self)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.forget(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


class ConnectionGate:
    """Admits, times and closes the MetaServer's connections (the module's docstring says by which rules).

    Runs on the server's event loop only. The request handler calls :meth:`begin` when a request's headers
    are in, :meth:`trust` once its token passed, :meth:`end` when it is answered."""

    def __init__(self, limits: ConnectionLimits, max_connections: int):
        self.limits, self.max_connections = limits, max_connections
        self.open = 0
        self._unauth: dict[_Conn, None] = {}  # connect order: the first is the oldest
        self._peer: dict[str, dict[_Conn, None]] = {}  # the same, per address
        self._idle: dict[_Conn, None] = {}  # authenticated, between requests; the first idle longest
        self._heading: dict[_Conn, float] = {}  # header deadlines, earliest first (header_s is fixed)
        self._by_protocol: dict[asyncio.Protocol, _Conn] = {}
        self.closed = {reason: 0 for reason in CLOSE_REASONS}
        self._logged_at, self._logged = -LOG_EVERY_S, dict(self.closed)
        self._task: asyncio.Task | None = None

    def protocol_factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The factory to listen with: ``make`` (aiohttp's) is called only for a connection admitted."""
        return lambda: _Conn(self, make)

    @property
    def unauthenticated(self) -> int:
        return len(self._unauth)

    # -- the connection's side ------------------------------------------------------------------
    def admit(self, conn: _Conn) -> bool:
        """Make room for a new connection by the rules, or refuse it (False)."""
        mine = self._peer.get(conn.peer)
        if mine is not None and len(mine) >= self.limits.per_peer:
            self._close(next(iter(mine)), "peer_cap")
        if self.open >= self.max_connections:
            if self._unauth:
                self._close(next(iter(self._unauth)), "budget_unauthenticated")
            elif self._idle:
                self._close(next(iter(self._idle)), "budget_idle")
            else:
                self.closed["refused_full"] += 1
                conn.state = _CLOSED
                return False
        self.open += 1
        self._unauth[conn] = None
        self._peer.setdefault(conn.peer, {})[conn] = None
        self._heading[conn] = time.monotonic() + self.limits.header_s
        return True

    def made(self, conn: _Conn) -> None:
        assert conn.inner is not None
        self._by_protocol[conn.inner] = conn

    def heading(self, conn: _Conn) -> None:
        """A request begins on a kept-alive connection: its headers are timed from now."""
        self._idle.pop(conn, None)
        self._arm(conn)

    def forget(self, conn: _Conn) -> None:
        if conn.state == _CLOSED:
            return
        conn.state = _CLOSED
        self.open -= 1
        self._uncount(conn)
        self._idle.pop(conn, None)
        self._heading.pop(conn, None)
        if conn.inner is not None:
            self._by_protocol.pop(conn.inner, None)

    # -- the request handler's side -------------------------------------------------------------
    def begin(self, protocol: object) -> _Conn | None:
        """A request's headers are in (aiohttp called the handler): its connection is no longer timed."""
        conn = self._by_protocol.get(protocol)  # type: ignore[arg-type]
        if conn is None or conn.state == _CLOSED:
            return None
        self._heading.pop(conn, None)
        self._idle.pop(conn, None)
        conn.state = _BUSY
        return conn

    def trust(self, conn: _Conn | None) -> None:
        """A request on ``conn`` presented a valid token: never closed for room while a request is in progress."""
        if conn is None or conn.trusted or conn.state == _CLOSED:
            return
        conn.trusted = True
        self._uncount(conn)

    def _uncount(self, conn: _Conn) -> None:
        """``conn`` no longer counts as unauthenticated, nor against its peer's cap."""
        self._unauth.pop(conn, None)
        mine = self._peer.get(conn.peer)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self._peer[conn.peer]

    def end(self, conn: _Conn | None) -> None:
        """The request on ``conn`` is answered: an authenticated connection may idle (aiohttp's keep-alive
        bounds that), an unauthenticated one must have its next headers in within header_s."""
        if conn is None or conn.state != _BUSY:
            return
        if conn.trusted:
            conn.state = _IDLE
            self._idle[conn] = None
        else:
            self._arm(conn)

    # -- timing ---------------------------------------------------------------------------------
    def _arm(self, conn: _Conn) -> None:
        conn.state = _HEADING
        self._heading.pop(conn, None)  # to the end: the dict stays in deadline order
        self._heading[conn] = time.monotonic() + self.limits.header_s

    def _close(self, conn: _Conn, reason: str) -> None:
        self.closed[reason] += 1
        self.forget(conn)
        if conn.transport is not None:
            conn.transport.abort()

    def sweep(self, now: float | None = None) -> None:
        """Close every connection whose headers are past their deadline."""
        now = time.monotonic() if now is None else now
        while self._heading:
            conn, deadline = next(iter(self._heading.items()))
            if deadline > now:
                break
            self._close(conn, "header_deadline")
        if self.closed != self._logged and now - self._logged_at >= LOG_EVERY_S:
            new = {r: n - self._logged[r] for r, n in self.closed.items() if n != self._logged[r]}
            log.warning("MetaServer: closed or refused %d connections %s (%s); %d open, %d without a valid "
                        "token, at most %d held", sum(new.values()),
                        "since the start" if self._logged_at < 0 else f"in the last {now - self._logged_at:.0f} s",
                        ", ".join(f"{r}: {n}" for r, n in new.items()), self.open, len(self._unauth),
                        self.max_connections)
            self._logged_at, self._logged = now, dict(self.closed)

    async def _sweeper(self) -> None:
        every = min(0.5, self.limits.header_s / 4)
        while True:
            await asyncio.sleep(every)
            try:
                self.sweep()
            except Exception:  # a bug: say so, keep sweeping (and serving)
                log.exception("MetaServer: timing connections' headers failed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sweeper())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def metrics(self) -> str:
        """Prometheus lines: connections held, and those closed early by reason."""
        out = ["# HELP weightsync_meta_connections Open connections, by whether a request on them presented a "
               "valid token.", "# TYPE weightsync_meta_connections gauge",
               f'weightsync_meta_connections{{authenticated="true"}} {self.open - len(self._unauth)}',
               f'weightsync_meta_connections{{authenticated="false"}} {len(self._unauth)}',
               "# HELP weightsync_meta_connections_max Connections held at most (from the open-file limit).",
               "# TYPE weightsync_meta_connections_max gauge",
               f"weightsync_meta_connections_max {self.max_connections}",
               "# HELP weightsync_meta_connections_closed_total Connections closed or refused for the limits, "
               "by reason.", "# TYPE weightsync_meta_connections_closed_total counter"]
        out += [f'weightsync_meta_connections_closed_total{{reason="{r}"}} {n}' for r, n in self.closed.items()]
        return "\n".join(out) + "\n"
