"""Doorbells: a step counter in host shared memory, for the signals of a step between processes of one host.

A step's `written` and `held` go to the MetaServer, and the other side learns them by long-polling it:
about 0.9 ms from one process's POST to the other's wake-up on our GPU hosts, measured by
``benchmarks/signals.py``, and a co-located step pays it on its critical path. A process that rings its
doorbell stores the step in a small file mapped in shared memory; a waiter on the same host sees it within
microseconds (spinning) or ~65 us (sleeping between looks). The MetaServer stays the record: every bell
rung is also posted, waiters ask the MetaServer every ``CHECK_S`` (so an aborted job or a bell that never
rings still ends the wait), and at the deadline its own wait raises the timeout that names who is missing.

A bell is a file only its owner's uid may open (0600); a peer opens one by the address the MetaServer
holds, which any participant of the job may publish, so both the server (``bell.*`` names) and
:func:`_open_existing` refuse anything but a weightsync bell file: no ``/etc/passwd``, no symbolic link.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import socket
import stat
import sys
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from weightsync.errors import TransportError
from weightsync.meta.client import MetaClient, MetaTimeout, MetaUnavailable, waited
from weightsync.meta.validate import BELL_FILE_RE
from weightsync.transport.share import remove_files_of_dead_processes

if TYPE_CHECKING:
    from weightsync.transport.liveness import TrainerWatch

#: waiters spin this long, then look every SLEEP_S (a sleeping look costs ~65 us of latency, a spin a core)
SPIN_S = 0.02
SLEEP_S = 50e-6
#: how often a waiter asks the MetaServer too
CHECK_S = 0.05
#: without bells, a waiter that watches the trainers' liveness long-polls in pieces this long
WATCHED_POLL_S = 1.0
_SIZE = 8
#: what a bell holds before it is first rung (steps are >= 0)
NONE = -1


_BELL = re.compile(r"^weightsync-bell-(\d+)-[0-9a-f]+$")


def _directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _create(path: str) -> int:
    """A new bell file, readable and writable by its owner only, holding NONE: step 0 is a step like any other."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, NONE.to_bytes(_SIZE, sys.byteorder, signed=True))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_existing(path: str) -> int:
    """Open a peer's bell, refusing anything but weightsync's own bell file: its name in the shared-memory
    directory, a regular file (not a link: ``O_NOFOLLOW``), of ``_SIZE`` bytes, ours. The address came from
    the MetaServer, where any participant of the job may publish: a bell pointing at ``/etc/passwd`` must
    not be mapped (and written)."""
    directory, name = os.path.split(path)
    if os.path.normpath(path) != path or directory != _directory() or not BELL_FILE_RE.fullmatch(name):
        raise TransportError(f"{path!r} is not a weightsync doorbell (a weightsync-bell-PID-HEX file in "
                             f"{_directory()}): refusing to open it; a participant of this job published it")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TransportError(f"no such doorbell {path}: its owner closed it or died") from None
    except OSError as e:
        why = {errno.ELOOP: "is a symbolic link", errno.EISDIR: "is not a regular file"}.get(e.errno, e.strerror)
        raise TransportError(f"doorbell {path} {why}: refusing to open it") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TransportError(f"doorbell {path} is not a regular file: refusing to map it")
        if st.st_size != _SIZE:
            raise TransportError(f"doorbell {path} holds {st.st_size} bytes, not a bell's {_SIZE}: refusing to map it")
        if st.st_uid != os.geteuid():
            raise TransportError(f"doorbell {path} belongs to uid {st.st_uid}, not to this process's "
                                 f"({os.geteuid()}): refusing to map it")
    except BaseException:
        os.close(fd)
        raise
    return fd


class Doorbell:
    """One step counter shared by the processes of a host: the owner rings it, others open it by address."""

    def __init__(self, path: str | None = None):
        self.owner = path is None
        if self.owner:  # bells are named by pid: those of processes killed before closing them go now
            remove_files_of_dead_processes(_directory(), _BELL)
        self.path = path or os.path.join(_directory(), f"weightsync-bell-{os.getpid()}-{uuid.uuid4().hex}")
        fd = _create(self.path) if self.owner else _open_existing(self.path)
        if self.owner:
            self._unlink = weakref.finalize(self, _remove, self.path)
        try:
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._step = memoryview(self._map).cast("q")  # one aligned 8-byte store: never seen half-written

    @property
    def address(self) -> str:
        """Where to find it: this host's name and the file (only a process on this host can open it)."""
        return f"{socket.gethostname()}:{self.path}"

    @classmethod
    def open(cls, address: str) -> Doorbell | None:
        """The bell at ``address``, or None when it lives on another host; TransportError when the address
        names anything but a weightsync bell file."""
        host, sep, path = address.partition(":")
        if not sep:
            raise TransportError(f"a doorbell's address is host:path, got {address!r}")
        return cls(path) if host == socket.gethostname() else None

    def ring(self, step: int) -> None:
        self._step[0] = step

    @property
    def step(self) -> int:
        return self._step[0]

    def close(self) -> None:
        if self.owner:
            self._unlink()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def open_bells(client: MetaClient, names: Sequence[str], timeout_s: float) -> list[Doorbell] | None:
    """The bells published under ``names``, or None when any of them is on another host (then the waiter
    long-polls the MetaServer as before)."""
    bells = [Doorbell.open(client.lookup(n, timeout=timeout_s)) for n in names]
    return None if any(b is None for b in bells) else bells  # type: ignore[return-value]


def wait_rung(bells: Sequence[Doorbell] | None, step: int, timeout_s: float, poll: Callable[[float], Any],
              watch: TrainerWatch | None = None) -> None:
    """Return once every bell holds ``step`` or later (without bells: once ``poll`` says so).

    ``poll(timeout)`` is the MetaServer's own wait for the same thing: asked with no wait every CHECK_S
    (it returns when the MetaServer has it all, raises MetaAborted for an aborted job), and at the
    deadline, where its MetaTimeout says who is missing. Rung bells are posted too, so a bell missed
    (a waiter holding a stale one) costs at most CHECK_S, never the step.

    ``watch``: the liveness of the ranks whose bells these are (bell i is rank i's;
    :mod:`weightsync.transport.liveness`): a rank gone or stopped before it rang ends the wait with a
    ``TrainerLost`` naming it. Without bells the long-poll is then asked in pieces of :data:`WATCHED_POLL_S`
    (a wait longer than that costs one more request per piece), the watch looked at between them.
    """
    if bells is None:  # some of them live on another host: long-poll the MetaServer
        if watch is None:
            poll(timeout_s)
            return
        start = time.monotonic()
        while True:
            left = start + timeout_s - time.monotonic()
            try:
                poll(max(0.0, min(left, WATCHED_POLL_S)))
                return
            except MetaTimeout as e:  # (MetaUnavailable too: a restarting server; at the deadline, who is missing)
                if left <= WATCHED_POLL_S:
                    raise waited(e, time.monotonic() - start) from None
            gone = watch.lost(watch.ranks, time.monotonic() - start)
            if gone is not None:
                raise gone.error(f"waiting for every training rank's written of step {step}")
    start = time.monotonic()
    deadline, next_check = start + timeout_s, start + CHECK_S
    while any(b.step < step for b in bells):
        now = time.monotonic()
        if now >= deadline:
            try:
                poll(0.0)  # raises MetaTimeout, unless everything arrived this instant
            except MetaTimeout as e:  # said after the whole wait, not the poll's 0 s
                raise waited(e, now - start) from None
            return
        if now >= next_check:
            try:
                poll(0.0)
                return
            except (MetaTimeout, MetaUnavailable):  # not yet, or the server is restarting: ask again later
                next_check = now + CHECK_S
        if watch is not None and now - start >= watch.look_s:
            gone = watch.lost([r for r, b in enumerate(bells) if b.step < step], now - start)
            if gone is not None:
                raise gone.error(f"waiting for training rank {gone.rank}'s written of step {step} (its doorbell "
                                 f"holds {bells[gone.rank].step})")
        if now - start >= SPIN_S:
            time.sleep(SLEEP_S)
