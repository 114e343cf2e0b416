"""The training + inference process group, built beside (never instead of) the trainer's default group.

Training processes already own ``torch.distributed``'s default group, and inference engines own
theirs; the weight-sync group spans both jobs, so it must be created without touching either. We
build it from c10d's public pieces directly:

    TCPStore (rank 0 serves) -> PrefixStore(unique prefix) -> ProcessGroupGloo / ProcessGroupNCCL

wrapped in a bare ``ProcessGroup`` whose ``send``/``recv`` return ``Work`` objects with ``wait(timeout)``.

Why not the alternatives:

- ``torch.distributed.distributed_c10d._new_process_group_helper`` is a private helper whose
  signature changes between releases; it registers the group in the module's global ``_world``
  tables (which assume ranks of the *default* group) and, for subgroups, asserts membership in the
  default group -- exactly the coupling we must avoid when the default group is the trainer's.
- vLLM's ``StatelessProcessGroup`` moves data through the TCPStore (slow, fine for metadata only),
  and its ``stateless_init_torch_distributed_process_group`` does what this module does but would
  make the training side import vLLM. Owning these ~40 lines keeps both sides dependency-free and
  puts every torch-version-specific call in one file.

The only private calls are ``ProcessGroup._set_default_backend`` / ``_register_backend`` and the
backends' ``_Options`` fields (stable since torch 2.0; vLLM relies on the same ones).

Liveness. Gloo does not notice a peer killed in the middle of a message (measured, torch 2.13: a
receiver of a 256 MiB message whose sender was SIGKILLed after 50 ms waited out its whole 60 s
timeout) nor, of course, a peer that is stopped; ``ProcessGroupGloo.abort()`` does not wake a
blocked ``wait`` either, and a ``wait`` that timed out fails its operation for good, so short waits
in a loop are no way out. So every member of a group built here beats: a daemon thread adds 1 to
its own key in the group's store every :data:`BEAT_S`, for as long as the group is alive. A rank
that waits on peers runs the wait under :func:`watched`: a :class:`PeerWatch` reads the peers'
beats through a store client of its own with a short deadline, and once a peer's beat stops for
:data:`SILENT_S` (stopped or dead), the store host does not answer within :data:`STORE_S` (rank 0,
which serves it, is stopped or dead), or the caller's deadline passes, the caller gets a
:class:`~weightsync.errors.TransportError` naming the peer within about that long -- whatever the
backend is doing. A CPU wait runs on a helper thread the caller walks away from (it ends at the
backend's own timeout); a CUDA wait runs in the caller, and the group is aborted (NCCL's kernels
exit). Either way the group is unusable afterwards.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Generic, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroup, TCPStore

from weightsync.errors import ConfigError, StepNotWritten, TransportError
from weightsync.transport.fence import Fence

log = logging.getLogger("weightsync.transport.group")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


# (deadline, socket) of the ports free_port handed out lately, held bound until their listener has had time to bind
_HELD: list[tuple[float, socket.socket]] = []
_HELD_LOCK = threading.Lock()
HOLD_S = 120.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on, held back for the rendezvous that will listen on it.

    Binding port 0 and closing the socket is not enough: until the store binds the port (rank 0
    starts, imports torch: seconds on a loaded machine) the kernel may hand the same port to any
    other ``bind(0)`` on the host -- another job's ``free_port`` or one of gloo's own listeners --
    and two groups then meet in one store, or rank 0 dies on ``EADDRINUSE`` while its peers talk
    to a stranger (gloo reports ``Connection closed by peer`` at connectFullMesh). So the port stays
    bound (all addresses, ``SO_REUSEADDR``, not listening) in this process for :data:`HOLD_S`
    seconds: no ``bind(0)`` or ``connect()`` on the host is given it, while a listener that asks for
    it by number with ``SO_REUSEADDR`` (TCPStore, vLLM's server) binds it at once. A listener
    without ``SO_REUSEADDR`` cannot take it while it is held."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    now = time.monotonic()
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        port = s.getsockname()[1]
    except BaseException:
        s.close()
        raise
    with _HELD_LOCK:
        for _, old in [h for h in _HELD if h[0] <= now]:
            old.close()
        _HELD[:] = [h for h in _HELD if h[0] > now] + [(now + HOLD_S, s)]
    return port


def route_address(peer: str) -> str:
    """The address of this machine's interface that routes to ``peer``: what gloo must listen on and
    advertise to reach it. Not the hostname's address: it may not resolve (a network namespace, a
    container) or resolve to loopback (Debian's ``127.0.1.1``), and peers on another host would then
    connect to themselves. A UDP ``connect`` only picks the route; no packet is sent."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0]
    except OSError:  # no route (or an unresolvable name): the hostname, as before
        return socket.gethostname()


def new_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    device: torch.device | str | None = None,
    name: str = "weightsync",
    bind_host: str | None = None,
) -> ProcessGroup:
    """Join the ``world_size``-rank group rendezvousing at ``host:port`` as ``rank``.

    Rank 0 serves the TCPStore (it must be able to listen on ``port``); the others connect to it,
    retrying until ``timeout_s``. Every member must pass the same ``name``: it prefixes all store
    keys, so several groups (or steps' regroupings) may share one store without colliding.
    ``bind_host`` is the address this rank's gloo sockets listen on (loopback when ``host`` is
    loopback, else :func:`route_address` of ``host``). ``device`` is the CUDA device for NCCL.

    Keep rank 0 alive while others use the group: it serves the store (NCCL's watchdog polls it
    and logs warnings once it is gone; transfers already set up are unaffected).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of {world_size}")
    timeout = timedelta(seconds=timeout_s)
    try:
        store = TCPStore(
            host,
            port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,  # the master must not block here: its peers may start later
        )
    except dist.DistNetworkError as e:
        if rank == 0 and ("EADDRINUSE" in str(e) or "already in use" in str(e)):
            raise ConfigError(
                f"group {name!r}: rank 0 cannot serve the rendezvous on port {port}: another process listens "
                "there (its peers would join that process's store); take the port from free_port(), which "
                "holds it for this rendezvous, or pick one nothing else on the host uses"
            ) from e
        raise
    prefixed = PrefixStore(f"{name}/", store)
    pg = ProcessGroup(prefixed, rank, world_size)
    if backend == "gloo":
        if bind_host is None:
            bind_host = "127.0.0.1" if host in LOOPBACK else route_address(host)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        opts._threads = 2
        impl = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
        pg._set_default_backend(ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, impl)
    elif backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("this torch build has no NCCL")
        dev = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
        opts = dist.ProcessGroupNCCL.Options()
        # NCCL's watchdog only backs the transports' own timeout up (theirs raises a TransportError and
        # aborts the group cleanly); firing first, it would kill the process instead
        opts._timeout = timedelta(seconds=3 * timeout_s + 30)
        # NCCL's kernels go first wherever SMs free up: copies queued beside them (co-located same-GPU
        # copies, thousands of CTAs) would otherwise hold every SM and delay the link's traffic
        opts.is_high_priority_stream = True
        impl = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        pg._set_default_backend(ProcessGroup.BackendType.NCCL)
        pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, impl)
        pg.bound_device_id = dev
    else:
        raise ValueError(f"unknown backend {backend!r}; use 'gloo' or 'nccl'")
    _GROUPS[pg] = GroupAddress(host, port, name, rank, world_size)
    beacon = _BEACONS[pg] = _Beacon(pg, prefixed, rank)
    beacon.start()
    return pg


# -- liveness (module docstring) ---------------------------------------------------------------------

#: every member adds 1 to its beat key this often
BEAT_S = 0.25
#: a peer whose beat has not moved for this long is stopped or dead
SILENT_S = 3.0
#: the watcher's store calls: a store (group rank 0) that does not answer within this is stopped or dead
STORE_S = 2.0
#: how often a watched wait looks at its deadline (and, every :data:`LOOK_S`, at the peers' beats)
POLL_S = 0.05
LOOK_S = 0.5


@dataclass(frozen=True)
class GroupAddress:
    """Where a group built by :func:`new_group` meets: what a watcher needs to open its own store client."""

    host: str
    port: int
    name: str
    rank: int
    world_size: int


#: the groups built here (weakly: a group dies with its last user's reference)
_GROUPS: "weakref.WeakKeyDictionary[ProcessGroup, GroupAddress]" = weakref.WeakKeyDictionary()


#: what group rank 0 adds to every other member's beat when it closes the group (:func:`close_group`): a beacon whose
#: own beat comes back at least this large stops (no store call beyond the beat itself)
CLOSED = 1 << 40
#: each group's beacon (:func:`close_group` stops it)
_BEACONS: "weakref.WeakKeyDictionary[ProcessGroup, _Beacon]" = weakref.WeakKeyDictionary()


def beat_key(rank: int) -> str:
    return f"beat/{rank}"


def address_of(group: object) -> GroupAddress | None:
    """The rendezvous of a group :func:`new_group` built, else None (another library's group)."""
    try:
        return _GROUPS.get(group)  # type: ignore[arg-type]
    except TypeError:  # not weak-referenceable: not one of ours
        return None


class _Beacon(threading.Thread):
    """Adds 1 to this member's beat key every :data:`BEAT_S` until the group is garbage, this member closes it
    (:func:`close_group`), or group rank 0 announced its close (the beat comes back past :data:`CLOSED`)."""

    def __init__(self, group: ProcessGroup, store: PrefixStore, rank: int):
        super().__init__(name=f"weightsync-beat-{rank}", daemon=True)
        self._group, self.store, self._key = weakref.ref(group), store, beat_key(rank)
        self.stopped = threading.Event()

    def run(self) -> None:
        while self._group() is not None and not self.stopped.is_set():
            try:
                if self.store.add(self._key, 1) >= CLOSED:
                    log.debug("%s: group rank 0 closed the group; beat stopped", self.name)
                    break
            except Exception as e:  # noqa: BLE001 -- the store's host (group rank 0) is gone: so is the group
                log.debug("%s: the group's store does not answer (%s); beat stopped", self.name, e)
                break
            self.stopped.wait(BEAT_S)


def close_group(group: ProcessGroup) -> None:
    """This member is done with ``group`` (a transport's close): its beacon stops. On group rank 0, which serves the
    group's store, the other members' beacons are told first (each one's beat raised by :data:`CLOSED`) and one beat
    and a half waited out, so that none still beats against the store once this process exits -- torch's store
    client prints a C++ warning with a stack for that, on every member, at the end of every job whose trainers exit
    first. A no-op for a group :func:`new_group` did not make, or one closed already."""
    beacon = _BEACONS.pop(group, None)
    if beacon is None:
        return
    beacon.stopped.set()
    a = address_of(group)
    if a is None or a.rank != 0 or a.world_size < 2:
        return
    try:
        for r in range(1, a.world_size):
            beacon.store.add(beat_key(r), CLOSED)
    except Exception as e:  # noqa: BLE001 -- closing anyway
        log.debug("group %s: announcing the close failed (%s)", a.name, e)
        return
    time.sleep(1.5 * BEAT_S)


class PeerWatch:
    """Whether the peers a rank waits on are alive, from their beats, read through a store client of its
    own (opened at the first look, deadline :data:`STORE_S`): :meth:`lost` says why one is not."""

    def __init__(self, group: ProcessGroup, peers: Iterable[int], silent_s: float = SILENT_S,
                 store_s: float = STORE_S, describe: Callable[[int], str] | None = None):
        self.address = address_of(group)
        self.peers = sorted(set(peers))
        self.silent_s, self.store_s = silent_s, store_s
        self.describe = describe or (lambda r: f"group rank {r}")
        self._store: PrefixStore | None = None
        self._seen: dict[int, tuple[int, float]] = {}
        self._since = time.monotonic()

    def lost(self) -> str | None:
        """Why a watched peer is taken for stopped or dead, or None while every one beats."""
        a = self.address
        if a is None or not self.peers:
            return None
        try:  # (a store client to a stopped host blocks past its own timeout: the calls run on a thread)
            beats = _within(self._read, self.store_s)
        except Exception as e:  # noqa: BLE001 -- the store's host does not answer
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return (f"the group's store at {a.host}:{a.port}, served by {self.describe(0)}, did not answer within "
                    f"{self.store_s:g} s ({first}): {self.describe(0)} is stopped or dead")
        now = time.monotonic()
        for p, beat in beats.items():
            last = self._seen.get(p)
            if last is None or last[0] != beat:
                self._seen[p] = (beat, now if last is not None else self._since)
            elif now - last[1] >= self.silent_s:
                return (f"{self.describe(p)} has given no sign of life for {now - last[1]:.1f} s (its beat in the "
                        f"group's store stopped at {beat}): it is stopped or dead")
        return None


    def _read(self) -> dict[int, int]:
        a = self.address
        if self._store is None:
            client = TCPStore(a.host, a.port, a.world_size, is_master=False,
                              timeout=timedelta(seconds=self.store_s), wait_for_workers=False)
            self._store = PrefixStore(f"{a.name}/", client)
        return {p: self._store.add(beat_key(p), 0) for p in self.peers}


T = TypeVar("T")


class _OnThread(Generic[T]):
    """``fn()`` started on a daemon thread named ``name``; :attr:`done` is set once it returned or raised, and
    :meth:`result` hands its answer or its exception to the caller (a caller that gives up leaves the thread to
    end when it does)."""

    def __init__(self, fn: Callable[[], T], name: str):
        self.done = threading.Event()
        self._box: dict[str, object] = {}
        threading.Thread(target=self._run, args=(fn,), name=name, daemon=True).start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller
            self._box["err"] = e
        finally:
            self.done.set()

    def result(self) -> T:
        if "err" in self._box:
            raise self._box["err"]  # type: ignore[misc]
        return self._box["out"]  # type: ignore[return-value]


def _within(fn: Callable[[], T], seconds: float) -> T:
    """``fn()`` on a daemon thread, its answer or exception; TimeoutError once ``seconds`` passed without one
    (the thread is left to end when it does)."""
    call = _OnThread(fn, "weightsync-watch-store")
    if not call.done.wait(seconds):
        raise TimeoutError(f"no answer within {seconds:g} s")
    return call.result()


class TransferAbandoned(TransportError):
    """:func:`watched` gave up on a transfer (a peer stopped or died, or the deadline passed): the group's
    operations may still be posted, so the group cannot be used again."""


def watched(fn: Callable[[], T], group: ProcessGroup, peers: Iterable[int], budget_s: float, what: str,
            device: torch.device, describe: Callable[[int], str] | None = None,
            silent_s: float | None = None, fence: Fence | None = None, first_s: float = 0.0) -> T:
    """``fn()`` -- a transfer over ``group`` that waits on ``peers`` -- returning within ``budget_s``, or
    sooner once a peer is taken for stopped or dead (:class:`PeerWatch`): then, or at the deadline, a
    :class:`TransferAbandoned` (a ``TransportError``) saying which, and the group is unusable from then on
    (its operations may still be posted). On CPU ``fn`` runs on a helper thread (under ``no_grad``) that
    is left blocked in the backend when the caller gives up; on CUDA in the caller, and the group is
    aborted so its kernels exit (``fn`` then returns or raises, and the error is raised regardless).

    ``fence`` (:mod:`weightsync.transport.fence`): closed before the error is raised, so the abandoned ``fn`` lands
    nothing afterwards; until it begins, ``fn`` may wait ``first_s`` more for its step (the peers stay watched), and
    a failure before anything landed is a :class:`~weightsync.errors.StepNotWritten`."""
    watch = PeerWatch(group, peers, SILENT_S if silent_s is None else silent_s, describe=describe)
    start = time.monotonic()
    reason: list[str] = []

    def deadline() -> float:
        began = fence.began if fence is not None else None
        return start + first_s + budget_s if began is None else min(start + first_s, began) + budget_s

    def look(next_look: float) -> float:
        """Set ``reason`` once there is one; return when to look at the beats next."""
        now = time.monotonic()
        if now >= deadline():
            reason.append(f"{what} did not finish within its {budget_s:g} s deadline" if first_s == 0.0 or (
                fence is not None and fence.began is not None) else
                f"{what}: its step did not begin within {first_s:g} s (written_timeout_s) and {budget_s:g} s more")
        elif now >= next_look:
            lost = watch.lost()
            if lost is not None:
                reason.append(lost)
            return time.monotonic() + LOOK_S
        return next_look

    def failure() -> TransferAbandoned:
        if fence is not None:
            fence.close(reason[0])  # from here the abandoned transfer lands nothing
            if fence.began is None:
                return StepNotWritten(f"{what}: {reason[0]}; the step never began, nothing of it was received, and "
                                      "this group cannot be used again")
        return TransferAbandoned(f"{what}: {reason[0]}; gave up on the transfer after "
                                 f"{time.monotonic() - start:.1f} s, and this group cannot be used again")

    if device.type == "cuda":
        stop = threading.Event()

        def monitor() -> None:
            next_look = time.monotonic() + LOOK_S
            while not stop.wait(POLL_S) and not reason:
                next_look = look(next_look)
            if reason:
                if fence is not None:
                    fence.close(reason[0])
                _abort(group)

        t = threading.Thread(target=monitor, name="weightsync-watch", daemon=True)
        t.start()
        try:
            out = fn()
        except Exception as e:
            stop.set()
            t.join()
            if reason:
                raise failure() from e
            raise
        stop.set()
        t.join()
        if reason:
            raise failure()
        return out

    def no_grad() -> T:
        with torch.no_grad():
            return fn()

    call = _OnThread(no_grad, "weightsync-transfer")
    next_look = time.monotonic() + LOOK_S
    while not call.done.wait(POLL_S):
        next_look = look(next_look)
        if reason and not call.done.is_set():
            error = failure()  # closes the fence first: what the helper thread gets later lands nowhere
            _abort(group)
            raise error
    return call.result()


def _abort(group: ProcessGroup) -> None:
    try:
        group.abort()
    except Exception:  # noqa: BLE001 -- best effort: the caller is failing
        pass
