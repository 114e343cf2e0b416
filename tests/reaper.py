"""Whatever a test process starts dies with it, even when the test process itself is killed.

A crashed xdist worker (``node down: Not properly terminated``) runs no fixture finaliser, so the engines it
started outlived it: a TP=2 vLLM engine (EngineCore and two workers, 2.2 GB) was still running 1.5 h after a
``make test``. :func:`start` (``tests/conftest.py`` calls it in every process that runs tests) starts a
watchdog process that waits for the test process to end, however it ends, and then SIGKILLs every process
that test process left behind.

Why a watchdog that tracks descendants, and not a process group of its own for the test process:

- the engine launchers make sessions of their own on purpose (``start_new_session=True``, ``os.setsid``,
  LocalJob participants' ``os.setpgrp``), so one ``killpg`` of the test process's group misses exactly the
  engines that leak; the watchdog has to know them by something else anyway;
- an xdist worker shares its process group with the controller (and without xdist, pytest shares the group
  of ``make`` or of a shell pipeline: ``pytest | tee log``): making it a group leader takes it out of the
  terminal's foreground group (Ctrl-C no longer reaches it, and a background group reading the terminal, as
  ``--pdb`` does, is stopped), while killing the group it is in kills the controller, ``make`` or ``tee``;
- a parent-death signal set in each child needs every launcher (vLLM's, multiprocessing's, ours) to set it,
  and it is cleared by setuid exec and not inherited by grandchildren.

So the watchdog, a child of the test process (it learns of its parent's death at once from
``PR_SET_PDEATHSIG``, else within a poll), knows the test process's descendants three ways:

1. it scans ``/proc`` every :data:`INTERVAL_S` and keeps every process whose parent it already keeps, by pid
   and start time (a pid reused by an unrelated process is not taken for a kept one). A process is kept once
   seen, so an engine reparented to init when its parent (the test process, or a launcher) died is still
   known; and so are the process groups and sessions its kept processes are in (other than the test
   process's own), so a member of an engine's session is killed even if it was never seen;
2. :func:`start` puts :data:`TAG` (the test process's pid and start time) in the environment, so every
   process exec'd below the test process carries it in ``/proc/PID/environ``, even one orphaned between two
   scans (a daemon's double fork);
3. at the end, any child of a process found by 1 or 2.

When the test process is gone it freezes every process found (SIGSTOP, so none forks meanwhile), looks
again until nothing new turns up, then SIGKILLs them all. It never touches the test process's own process
group or session as such, nor processes that started before the test process.

Limits: a process that is forked without exec (multiprocessing's ``fork`` start method) and orphaned
within :data:`INTERVAL_S` of its start carries no tag and was never seen; one that clears its environment
or is started with ``env={...}`` without the tag is found by 1 and 3 only. Linux only (``/proc``); elsewhere
:func:`start` does nothing. ``WEIGHTSYNC_TEST_REAPER=0`` turns it off in the suite (``tests/conftest.py``),
e.g. to keep a crashed worker's engines for gdb.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

#: the environment variable that marks every process exec'd below a test process: ``<pid>:<start time>``
TAG = "WEIGHTSYNC_TEST_REAPER_TAG"
#: how often the watchdog looks for new descendants, in seconds (an incremental scan: well under 1 ms)
INTERVAL_S = 0.5
PR_SET_PDEATHSIG = 1

_watchdog: tuple[int, subprocess.Popen] | None = None  # (the test process's pid, its watchdog)


def start(state: str | None = None, log: str | None = None) -> int | None:
    """Start this process's watchdog (once per process) and return its pid; None where there is no
    ``/proc``. ``state``: a file the watchdog rewrites with the pids it keeps after each scan that changed
    them (for tests that must know it saw a process). ``log``: a file the watchdog appends a line to, naming
    what it killed."""
    global _watchdog
    me = os.getpid()
    if _watchdog is not None and _watchdog[0] == me:
        return _watchdog[1].pid
    if not sys.platform.startswith("linux") or not os.path.isdir(f"/proc/{me}"):
        return None
    os.environ[TAG] = f"{me}:{_stat(me)[3]}"
    args = [sys.executable, "-I", os.path.abspath(__file__), str(me), os.environ[TAG]]
    if state:
        args += ["--state", state]
    if log:
        args += ["--log", log]
    # no descriptor of ours: an xdist worker's channel to the controller must close when the worker dies
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True)
    _watchdog = (me, proc)
    return proc.pid


def watchdog() -> int | None:
    """This process's watchdog's pid, if :func:`start` started one here."""
    return _watchdog[1].pid if _watchdog is not None and _watchdog[0] == os.getpid() else None


def _stat(pid: int) -> tuple[int, int, int, int, str] | None:
    """(ppid, pgid, sid, start time in clock ticks, state) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(b")") + 2:].split()
    return int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19]), rest[0].decode()


def _pids() -> set[int]:
    return {int(n) for n in os.listdir("/proc") if n.isdigit()}


def _tagged(pid: int, tag: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return tag in f.read().split(b"\0")
    except OSError:
        return False


class _ParentDied(Exception):
    pass


class _Tracker:
    """The test process's descendants, kept by the watchdog (see the module's docstring)."""

    def __init__(self, root: int, tag: str, state: str | None):
        self.root, self.me, self.state = root, os.getpid(), state
        self.tag = f"{TAG}={tag}".encode()
        st = _stat(root)
        self.root_start = st[3] if st else 0
        self.root_groups = {st[1], st[2]} if st else set()
        self.seen: dict[int, tuple] = {}  # pid -> its stat when first seen
        self.kept: dict[int, int] = {root: self.root_start}  # live descendants: pid -> start time
        self.groups: set[int] = set()  # process groups and sessions of kept processes, not the root's

    def scan(self) -> None:
        pids = _pids()
        for pid in self.seen.keys() - pids:
            del self.seen[pid]
        before = set(self.kept)
        groups = set()
        for pid in list(self.kept):
            st = _stat(pid)
            if st is None or st[3] != self.kept[pid]:
                del self.kept[pid]
            elif pid != self.root:
                groups.update((st[1], st[2]))
        self.groups = groups - self.root_groups
        new = {}
        for pid in pids - self.seen.keys():
            st = _stat(pid)
            if st is not None:
                self.seen[pid] = new[pid] = st
        grew = True
        while grew:  # a parent and its child may both be new
            grew = False
            for pid, st in list(new.items()):
                if st[0] in self.kept and pid != self.me:
                    self.kept[pid] = st[3]
                    self.groups.update({st[1], st[2]} - self.root_groups)
                    del new[pid]
                    grew = True
        if self.state and set(self.kept) != before:
            tmp = f"{self.state}.tmp"
            with open(tmp, "w") as f:
                f.write(" ".join(str(p) for p in sorted(self.kept) if p != self.root))
            os.replace(tmp, self.state)

    def left(self, procs: dict[int, tuple], checked: dict[int, bool]) -> set[int]:
        """The processes the root left, among ``procs`` (pid -> stat); ``checked`` caches tag reads."""
        for pid, st in procs.items():  # the groups kept processes are in now
            if pid != self.root and self.kept.get(pid) == st[3]:
                self.groups.update({st[1], st[2]} - self.root_groups)
        found = set()
        for pid, st in procs.items():
            if pid in (self.me, self.root) or st[3] < self.root_start:
                continue
            if self.kept.get(pid) == st[3] or st[1] in self.groups or st[2] in self.groups:
                found.add(pid)
            elif pid not in checked:
                checked[pid] = _tagged(pid, self.tag)
            if checked.get(pid):
                found.add(pid)
        grew = True
        while grew:
            grew = False
            for pid, st in procs.items():
                if pid not in found and st[0] in found and pid != self.me:
                    found.add(pid)
                    grew = True
        return found

    def reap(self) -> list[str]:
        """Freeze what the root left until nothing new turns up, then kill it all; the killed, described."""
        frozen: set[int] = set()
        checked: dict[int, bool] = {}
        names = []
        for _ in range(20):
            procs = {pid: st for pid in _pids() if (st := _stat(pid)) is not None}
            new = self.left(procs, checked) - frozen
            if not new:
                break
            for pid in new:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except OSError:
                    continue
                frozen.add(pid)
                try:
                    with open(f"/proc/{pid}/comm") as f:
                        names.append(f"{pid} ({f.read().strip()})")
                except OSError:
                    names.append(str(pid))
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return names


def _main(argv: list[str]) -> None:
    root, tag = int(argv[1]), argv[2]
    opts = dict(zip(argv[3::2], argv[4::2]))
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)  # Ctrl-C or a group's SIGTERM ends the test process; this one stays

    waiting = [True]

    def parent_died(*_):
        if waiting[0] and os.getppid() != root:  # also sent when the thread that started us ends: check
            waiting[0] = False
            raise _ParentDied

    signal.signal(signal.SIGUSR1, parent_died)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGUSR1), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the poll below still sees it
    tracker = _Tracker(root, tag, opts.get("--state"))
    try:
        while os.getppid() == root:
            tracker.scan()
            time.sleep(INTERVAL_S)
        waiting[0] = False  # inside the try: the signal may land between the loop's last check and here
    except _ParentDied:
        pass
    killed = tracker.reap()
    if killed and opts.get("--log"):
        with open(opts["--log"], "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} test process {root} ended; killed what it left: "
                    f"{', '.join(killed)}\n")


if __name__ == "__main__":
    _main(sys.argv)
