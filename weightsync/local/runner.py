"""Run a local job: a MetaServer, and training and inference processes on this machine, with typed
events back to the driver, one deadline, and everyone stopped on the first failure.

The demo, the bench and the end-to-end tests all run jobs this way::

    with LocalJob(deadline_s=120) as job:
        for r in range(world):
            job.add(Participant.trainer(r), train_fn, job.meta_url, ...)
        job.add(Participant.instance(0), read_fn, job.meta_url, ...)
        result = job.run(on_event=print)
    if result.failure:
        print(result.failure.line())

Each participant runs ``fn(emit, *args)`` in a process of its own (``spawn``: torch is not
fork-safe), and calls ``emit(event)`` to report (:mod:`weightsync.local.events`). The runner adds
:class:`Done` when ``fn`` returns and :class:`Failed` when it raises (its traceback goes into the
event and the participant's log, never onto the driver's terminal), when the process dies without
saying why (``ProcessDied``), or when the job passes its deadline (``Timeout``). With
``stop_on_failure`` (the default) the first failure ends the job at once: every process is
killed, with whatever it started (inference worker processes), since each participant leads a
process group of its own. Without it the job runs until every participant has finished, so a
test can see how each side learnt of a fault.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import re
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from weightsync.local.events import Done, Event, Failed, Participant

log = logging.getLogger("weightsync.local")

_POLL_S = 0.5  # how often the driver looks for processes that died without a word
_LAST_WORDS_S = 1.0  # how long it then reads what may still be in flight from them


#: what the fork server imports once, so each participant forks with it in memory rather than importing it
#: again (torch alone is ~1.6 s of CPU a process; :mod:`weightsync.local.preload`: transformers' and
#: megatron-core's modelling code, on a CPU-only torch build)
PRELOAD = ["torch", "weightsync.runtime.writer", "weightsync.runtime.reader", "weightsync.local.preload"]


def participant_context(start_method: str | None = None):
    """The multiprocessing context participants run in: ``forkserver`` with torch preloaded where the
    platform has it (a fork of a server that imported torch and never touched CUDA or ran an op is safe,
    as DataLoader workers are), else ``spawn``. ``WEIGHTSYNC_START_METHOD`` overrides it."""
    method = start_method or os.environ.get("WEIGHTSYNC_START_METHOD") or (
        "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


class Emit:
    """What a participant's function is given: ``emit(event)`` sends ``event`` to the driver."""

    def __init__(self, participant: Participant, q: Any):
        self.participant = participant
        self._queue = q

    def __call__(self, event: Event) -> None:
        self._queue.put(event)

    def flush(self) -> None:
        """Wait until every event sent so far is in the pipe (before a deliberate abrupt exit: a process
        killed while its queue's feeder thread holds the pipe's lock blocks every other sender)."""
        self._queue.close()
        self._queue.join_thread()


@dataclass(frozen=True)
class JobResult:
    """Every event in arrival order, and the failure that ended the job (the first one; None if none)."""

    events: tuple[Event, ...]
    failure: Failed | None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def of(self, *kinds: type) -> list:
        """The events of the given types, in arrival order."""
        return [e for e in self.events if isinstance(e, kinds)]

    @property
    def failures(self) -> list[Failed]:
        return self.of(Failed)


@dataclass(frozen=True)
class _Spawn:
    participant: Participant
    target: Callable[..., None]
    args: tuple


def log_name(participant: Participant) -> str:
    """``training rank 0`` -> ``training-rank-0.log``."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", str(participant)).strip("-") + ".log"


def _participant_main(participant: Participant, target: Callable[..., None], args: tuple, q: Any,
                      log_path: str | None) -> None:
    """A participant's process: lead a process group (so the driver can stop whatever it starts), send
    its output to its log, run ``target(emit, *args)`` and report how it ended."""
    os.setpgrp()
    if log_path:
        # 0600: a participant's log names its job, hosts, ports and errors (0644 let any local user read them)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    emit = Emit(participant, q)
    code = 0
    try:
        target(emit, *args)
        end: Event = Done(participant)
    except BaseException as e:  # noqa: BLE001 -- reported, not printed
        end = Failed.of(participant, e)
        if log_path:
            print(end.traceback, file=sys.stderr, flush=True)
        code = 1
    q.put(end)
    emit.flush()
    if code:
        sys.exit(code)  # SystemExit: multiprocessing sets the exit code and prints nothing


def start_participant(ctx: Any, participant: Participant, target: Callable[..., None], args: tuple, q: Any,
                      log_path: str | None = None) -> Any:
    """Start one participant's process in ``ctx`` as :meth:`LocalJob.run` does (``target(emit, *args)``, its events
    put on ``q``: anything with ``put``, ``close`` and ``join_thread``); for drivers that start, kill and restart
    participants one by one (``weightsync soak``)."""
    p = ctx.Process(target=_participant_main, args=(participant, target, args, q, log_path),
                    name=f"weightsync {participant}")
    p.start()
    return p


def _kill(p: Any) -> None:
    """SIGKILL a participant, then its process group: every process it started that is still there
    (a participant killed before it made its group has started nothing)."""
    if p.pid is None:
        return
    if p.exitcode is None:
        p.kill()
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class LocalJob:
    """A MetaServer (started here unless ``meta`` is given) and the participants added before :meth:`run`.

    ``deadline_s``: the whole job's time limit. ``stop_on_failure``: end the job on the first
    :class:`Failed` (else wait for every participant). ``log_dir``: each participant's stdout and
    stderr go to a file there (:func:`log_name`); by default they share the driver's.
    ``exit_grace_s``: how long participants that are done get to exit before they are killed.
    ``ctx`` is the multiprocessing context they run in: queues and barriers made from it may be
    passed to :meth:`add` as arguments.
    """

    def __init__(self, *, deadline_s: float, stop_on_failure: bool = True, meta: Any = None,
                 meta_token: str | None = None, log_dir: str | None = None, exit_grace_s: float = 10.0,
                 start_method: str | None = None):
        self.deadline_s = deadline_s
        self.stop_on_failure = stop_on_failure
        self.log_dir = log_dir
        self.exit_grace_s = exit_grace_s
        self.ctx = participant_context(start_method)
        self._meta = meta
        self._own_meta = meta is None
        self._meta_token = meta_token
        self._spawns: list[_Spawn] = []
        self._procs: dict[Participant, Any] = {}
        self._stopped: list = []

    # -- set-up ---------------------------------------------------------------------------------
    def __enter__(self) -> "LocalJob":
        if self._meta is None:
            from weightsync.meta.server import MetaServer

            self._meta = MetaServer(port=0, token=self._meta_token).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop(kill_now=True)
        if self._own_meta and self._meta is not None:
            self._meta.stop()

    @property
    def meta(self) -> Any:
        return self._meta

    def job_token(self, job: str) -> str | None:
        """The token to hand job ``job``'s participants: derived from ``meta_token`` (the MetaServer's admin
        token, which never leaves the driver) and opening that job only; None without a token."""
        if self._meta_token is None:
            return None
        from weightsync.meta.auth import job_token

        return job_token(self._meta_token, job)

    @property
    def meta_url(self) -> str:
        if self._meta is None:
            raise RuntimeError("LocalJob: enter the job (with LocalJob(...) as job) before asking for its MetaServer")
        return self._meta.url

    def add(self, participant: Participant, target: Callable[..., None], *args: Any) -> None:
        """Run ``target(emit, *args)`` as ``participant`` (a module-level function: it is pickled)."""
        if any(s.participant == participant for s in self._spawns):
            raise ValueError(f"LocalJob: {participant} added twice")
        self._spawns.append(_Spawn(participant, target, args))

    # -- running --------------------------------------------------------------------------------
    def run(self, on_event: Callable[[Event], None] | None = None) -> JobResult:
        """Start every participant, pass each event to ``on_event`` as it arrives, and return them all."""
        q = self.ctx.Queue()
        for s in self._spawns:
            path = os.path.join(self.log_dir, log_name(s.participant)) if self.log_dir else None
            p = start_participant(self.ctx, s.participant, s.target, s.args, q, path)
            self._procs[s.participant] = p
        events: list[Event] = []
        finished: dict[Participant, Event] = {}
        failure: list[Failed] = []

        def take(ev: Event) -> None:
            events.append(ev)
            if isinstance(ev, (Done, Failed)):
                finished.setdefault(ev.participant, ev)
            if isinstance(ev, Failed) and not failure:
                failure.append(ev)
                log.info("local job: %s", ev.line())
            if on_event is not None:
                on_event(ev)

        deadline = time.monotonic() + self.deadline_s
        next_poll = time.monotonic() + _POLL_S
        try:
            while len(finished) < len(self._procs) and not (failure and self.stop_on_failure):
                now = time.monotonic()
                if now >= deadline:
                    waiting = [p for p in self._procs if p not in finished]
                    take(Failed(waiting[0], "Timeout", f"the job did not finish within {self.deadline_s:g} s; "
                                                       f"still running: {', '.join(map(str, waiting))}"))
                    break
                try:
                    take(q.get(timeout=min(_POLL_S, deadline - now)))
                except queue.Empty:
                    pass
                if time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + _POLL_S
                    self._reap(q, finished, take)
        finally:
            self._stop(kill_now=bool(failure) or len(finished) < len(self._procs))
            q.cancel_join_thread()
            q.close()
        return JobResult(tuple(events), failure[0] if failure else None)

    def _reap(self, q: Any, finished: dict, take: Callable[[Event], None]) -> None:
        """Participants whose process ended without a last word: read what is still in flight, then
        report each that stays silent as died."""
        dead = [who for who, p in self._procs.items() if who not in finished and p.exitcode is not None]
        if not dead:
            return
        until = time.monotonic() + _LAST_WORDS_S
        try:
            while time.monotonic() < until:
                take(q.get(timeout=max(0.0, until - time.monotonic())))
        except queue.Empty:
            pass
        for who in dead:
            if who not in finished:
                code = self._procs[who].exitcode
                take(Failed(who, "ProcessDied", f"its process exited with code {code} before reporting"))

    def _stop(self, kill_now: bool) -> None:
        """Let finished participants exit (unless ``kill_now``), kill the rest, then every group's leftovers."""
        procs = [p for p in self._procs.values() if p not in self._stopped]
        self._stopped.extend(procs)
        if not kill_now:
            end = time.monotonic() + self.exit_grace_s
            for p in procs:
                p.join(max(0.0, end - time.monotonic()))
        for p in procs:
            if p.is_alive():
                _kill(p)
        for p in procs:
            p.join(5.0)
            _kill(p)  # and anything a participant started and left behind


__all__ = ["LocalJob", "JobResult", "Emit", "log_name", "start_participant"]
