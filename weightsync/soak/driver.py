"""The soak's driver: start a job, hit its participants with faults one at a time, restart what a user would
restart, check the invariant all along, and sum up.

The job: a real MetaServer in a process of its own (``weightsync meta-server --state``: it restarts from its
store), ``cfg.train``'s training ranks (a gloo group; real FSDP2 shards under ``fsdp``) and ``cfg.readers``
layout-faithful instances (:mod:`weightsync.soak.participants`), every participant a process of the local
runner (:func:`weightsync.local.runner.start_participant`) with a pipe of its own back to the driver (a
participant SIGKILLed mid-send then breaks only its own pipe; a shared queue's lock would stay held).

One fault at a time: after a quiet gap, a target (a training rank, a reader, one of a reader's workers, the
MetaServer) is SIGKILLed or SIGSTOPped for a while, or a *play* runs (:mod:`weightsync.soak.plays`: a storm of bad
requests at the MetaServer, the file transport's directory squatted or planted with another user's files, a training
step longer than ``timeout_s``), checking that weightsync takes it as designed; the next fault waits until the job
has recovered from it.
Restarts are a supervisor's: a dead training rank takes its group down and the group restarts from the step
after the last one every rank wrote; a dead reader restarts and joins again under its id; a dead MetaServer
restarts on its port from its store. A fault is *detected* at the first failure weightsync reports about it
(a call raised in some participant, or a trainer dropped an instance), and *recovered* once every reader
holds, bit-exact, a step the trainers started after it.

The invariant, checked by the readers after every update and every failed one (:mod:`.participants`): no
reader reports a version it does not hold bit for bit. The driver also watches the MetaServer: every
``held`` it shows must be a step the reader checked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing.connection
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from weightsync.local.events import Event, Failed, Participant, StepStarted
from weightsync.local.runner import log_name, participant_context, start_participant
from weightsync.soak.config import QUIET, SoakConfig, check
from weightsync.soak.events import Claim, Held, InstanceUp, Noticed, Rejoined, Stepped
from weightsync.soak.participants import JOB, reader_main, trainer_main
from weightsync.soak.plays import PLAYS, Play
from weightsync.transport.private import private_directory

log = logging.getLogger("weightsync.soak")

_TICK_S = 0.1


class PipeSink:
    """The sending half a participant's events go to (what the runner's ``Emit`` calls): one pipe per process."""

    def __init__(self, conn: Any):
        self.conn = conn

    def put(self, event: Event) -> None:
        self.conn.send(event)

    def close(self) -> None:
        pass

    def join_thread(self) -> None:
        pass


@dataclass
class Fault:
    """One fault: what it hit and when; when weightsync first reported it, and when the job had recovered."""

    index: int
    target: str  # trainer, reader, worker, meta, files
    action: str  # kill, stop, storm, squat, plant, slow
    who: str
    at: float
    until: float  # a stop's SIGCONT (a kill: its time; a play's: when it ended)
    last_step: int  # the latest step any trainer had started when it hit
    pid: int | None = None
    detected_at: float | None = None
    detected_by: str = ""
    recovered_at: float | None = None
    #: where weightsync did not take the fault as designed (a play's checks; a quiet kind that was noticed)
    problems: list[str] = field(default_factory=list)
    notes: str = ""  # what a play saw (a storm's answers, a refusal)

    @property
    def kind(self) -> str:
        return f"{self.action} {self.target}"

    @property
    def detect_s(self) -> float | None:
        return None if self.detected_at is None else self.detected_at - self.at

    @property
    def recover_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.at


@dataclass(frozen=True)
class SoakReport:
    """The figures of one soak; ``ok`` when the invariant held and every fault was recovered from."""

    config: SoakConfig
    seconds: float  # the whole run
    up_s: float  # until every reader first held a step (the faults start then)
    steps: int  # the highest step written
    holds: int  # updates returned and checked
    exact_holds: int
    claims: int  # versions claimed after a failed update, checked
    violations: tuple[str, ...]
    faults: tuple[Fault, ...]
    restarts: dict[str, int]
    rejoins: int
    meta_held_seen: int  # distinct (instance, step) the MetaServer showed held
    meta_held_unchecked: tuple[str, ...]  # of those, the ones no reader checked (a reader killed in between)
    workdir: str

    @property
    def recovered(self) -> int:
        return sum(f.recovered_at is not None for f in self.faults)

    @property
    def mishandled(self) -> tuple[str, ...]:
        """Faults weightsync did not take as designed (:mod:`weightsync.soak.plays`), each with its first problem."""
        return tuple(f"fault {f.index} ({f.kind}): {f.problems[0]}" + (f" (and {len(f.problems) - 1} more)"
                                                                     if len(f.problems) > 1 else "")
                     for f in self.faults if f.problems)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.mishandled and self.recovered == len(self.faults)

    def by_kind(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for kind in sorted({f.kind for f in self.faults}):
            fs = [f for f in self.faults if f.kind == kind]
            det = [f.detect_s for f in fs if f.detect_s is not None]
            rec = [f.recover_s for f in fs if f.recover_s is not None]
            out[kind] = {"faults": len(fs), "detected": len(det), "recovered": len(rec),
                         "detect_median_s": _med(det), "detect_max_s": max(det) if det else None,
                         "recover_median_s": _med(rec), "recover_max_s": max(rec) if rec else None}
        return out

    def lines(self) -> list[str]:
        c = self.config
        staged = {"odd": "odd ids staged", "all": "all staged", "none": "none staged"}[c.staged]
        out = [f"weightsync soak: {self.seconds:.0f} s (job up after {self.up_s:.0f} s; seed {c.seed}, {c.order} faults), "
               f"{c.transport} {c.mode}, {c.model}: "
               f"{c.train} -> {c.readers} x {c.infer} ({staged}), timeout {c.timeout_s:g} s, "
               f"instance timeout {c.instance_timeout_s:g} s",
               f"steps written: {self.steps}; holds checked: {self.holds} ({self.exact_holds} bit-exact); "
               f"claims after failed updates checked: {self.claims}; in-process rejoins: {self.rejoins}",
               f"MetaServer held reports seen: {self.meta_held_seen}, not checked by their reader: "
               f"{len(self.meta_held_unchecked)}",
               f"restarts: " + ", ".join(f"{k} {v}" for k, v in sorted(self.restarts.items())),
               f"faults: {len(self.faults)}, recovered {self.recovered}, detected "
               f"{sum(f.detected_at is not None for f in self.faults)}"]
        out.append(f"  {'fault':<14} {'n':>3} {'detected':>8} {'detect median/max s':>20} {'recover median/max s':>21}")
        for kind, k in self.by_kind().items():
            out.append(f"  {kind:<14} {k['faults']:>3} {k['detected']:>8} "
                       f"{_pair(k['detect_median_s'], k['detect_max_s']):>20} "
                       f"{_pair(k['recover_median_s'], k['recover_max_s']):>21}")
        det = [f.detect_s for f in self.faults if f.detect_s is not None]
        rec = [f.recover_s for f in self.faults if f.recover_s is not None]
        out.append(f"  {'all':<14} {len(self.faults):>3} {len(det):>8} {_pair(_med(det), max(det, default=None)):>20} "
                   f"{_pair(_med(rec), max(rec, default=None)):>21}")
        for f in self.faults:
            if f.notes:
                out.append(f"  fault {f.index} ({f.kind}): {f.notes}")
        if self.violations:
            out.append(f"INVARIANT BROKEN: {len(self.violations)} time(s); first: {self.violations[0]}")
        else:
            out.append("invariant held: no reader reported a version it does not hold bit for bit")
        for m in self.mishandled:
            out.append(f"NOT AS DESIGNED: {m}")
        for f in self.faults:
            if f.recovered_at is None:
                out.append(f"NOT RECOVERED: fault {f.index} ({f.kind}: {f.who}) within {c.recover_s:g} s")
        out.append(f"logs: {self.workdir}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "seconds": self.seconds, "up_s": self.up_s, "steps": self.steps, "holds": self.holds,
                "exact_holds": self.exact_holds, "claims": self.claims, "violations": list(self.violations),
                "restarts": self.restarts, "rejoins": self.rejoins, "meta_held_seen": self.meta_held_seen,
                "meta_held_unchecked": list(self.meta_held_unchecked), "mishandled": list(self.mishandled),
                "ok": self.ok, "by_kind": self.by_kind(),
                "faults": [dict(asdict(f), kind=f.kind, detect_s=f.detect_s, recover_s=f.recover_s)
                           for f in self.faults], "workdir": self.workdir}


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _pair(a: float | None, b: float | None) -> str:
    return "-" if a is None else f"{a:.1f} / {b:.1f}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MetaProcess:
    """The MetaServer as a process of its own on a fixed port, persisting to ``state``: killed, stopped and
    restarted from its store as an operator would."""

    def __init__(self, port: int, state: str, log_path: str, token: str):
        self.port, self.state, self.log_path, self.token = port, state, log_path, token
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{port}"

    def start(self, timeout_s: float = 30.0) -> None:
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "ab") as out:  # 0600, as the participants' logs
            # the admin token through the environment (never on a command line others can read)
            self.proc = subprocess.Popen([sys.executable, "-m", "weightsync", "meta-server", "--port", str(self.port),
                                          "--state", self.state], stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, "WEIGHTSYNC_META_TOKEN": self.token})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"soak: the MetaServer exited with code {self.proc.returncode} at start; "
                                   f"see {self.log_path}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as r:
                    if r.status == 200:
                        return
            time.sleep(0.1)
        raise RuntimeError(f"soak: the MetaServer did not answer /health within {timeout_s:g} s; see {self.log_path}")

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10.0)

    def stop(self) -> None:
        """End it as an operator does (SIGTERM: it answers 503 to every waiter and saves what is pending)."""
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10.0)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class _Running:
    participant: Participant
    process: Any
    conn: Any  # the driver's end of its pipe (None once closed)
    incarnation: int
    pids: tuple[int, ...] = ()  # a reader's workers


@dataclass
class _Counts:
    holds: int = 0
    exact_holds: int = 0
    claims: int = 0
    rejoins: int = 0
    violations: list[str] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=lambda: {"trainer group": 0, "reader": 0, "meta": 0})


class Soak:
    """Run one soak (:meth:`run`); ``out`` gets a line per fault and the figures at the end."""

    def __init__(self, cfg: SoakConfig, out: Callable[[str], None] | None = None):
        check(cfg)
        self.cfg = cfg
        self.out = out or (lambda line: None)
        self.rng = random.Random(cfg.seed)
        self.workdir = cfg.workdir or tempfile.mkdtemp(prefix="weightsync-soak-")
        for d in ("logs", "files"):  # 0700: the job's weights and logs are this user's (makedirs gave 0755)
            private_directory(os.path.join(self.workdir, d))
        self.directory = os.path.join(self.workdir, "files")
        self.stop_path = os.path.join(self.workdir, "stop")
        self.train_path = os.path.join(self.workdir, "train")  # while it exists the trainers train (plays.py)
        from weightsync.engines import make_layout
        from weightsync.spec import load_spec

        self.world = make_layout(load_spec(cfg.model), cfg.train).world_size
        self.ctx = participant_context()
        from weightsync.meta.auth import job_token

        admin = secrets.token_hex(16)  # the MetaServer's own token stays here; participants get the job's
        self.token = job_token(admin, JOB)
        self.meta = MetaProcess(free_port(), os.path.join(self.workdir, "meta.sqlite"),
                                os.path.join(self.workdir, "logs", "meta-server.log"), admin)
        self.running: dict[Participant, _Running] = {}
        self.incarnations: dict[Participant, int] = {}
        self.pending: dict[str, float] = {}  # restarts due: "trainers" / "reader N" / "meta" -> when
        self.conts: dict[int, float] = {}  # stopped processes: pid -> when SIGCONT is due
        self.faults: list[Fault] = []
        self.counts = _Counts()
        self.wrote: dict[int, int] = {}  # training rank -> the last step its write returned
        self.started_step = 0  # the latest step any trainer started
        self.step_started_at: dict[int, float] = {}  # step -> when its first training rank started it (wall clock)
        self.verified: dict[int, set[int]] = {i: set() for i in range(cfg.readers)}
        self.held_at: dict[int, float] = {}  # reader -> when the latest step it held (checked exact) was started
        self.meta_held: dict[tuple[int, int], float] = {}
        self._watch_stop = threading.Event()
        self._tries = 0  # faults injected (order=cycle: which kind is next)
        self.up_s = 0.0
        self.play: Play | None = None  # the fault now running, if it is a play (weightsync.soak.plays)

    # -- processes ------------------------------------------------------------------------------
    def _spawn(self, participant: Participant, target: Callable[..., None], *args: Any) -> None:
        self._end(participant)  # never two incarnations at once
        n = self.incarnations.get(participant, 0) + 1
        self.incarnations[participant] = n
        parent, child = self.ctx.Pipe(duplex=False)
        path = os.path.join(self.workdir, "logs", log_name(participant).removesuffix(".log") + f".{n}.log")
        p = start_participant(self.ctx, participant, target, args, PipeSink(child), path)
        child.close()
        self.running[participant] = _Running(participant, p, parent, n)

    def _start_trainers(self) -> None:
        first = min((self.wrote.get(r, 0) for r in range(self.world)), default=0) + 1
        port = free_port()
        for r in range(self.world):
            self._spawn(Participant.trainer(r), trainer_main, r, self.world, port, self.meta.url, self.cfg, first,
                        self.directory, self.stop_path, self.token, self.train_path)

    def train(self, on: bool) -> None:
        """Hold the trainers before their next step (they train), or let them write it."""
        if on:
            with open(self.train_path, "w"):
                pass
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.train_path)

    def _start_reader(self, i: int) -> None:
        self._spawn(Participant.instance(i), reader_main, i, self.meta.url, self.cfg, self.directory, self.token)

    def _end(self, who: Participant) -> None:
        """Kill a participant and whatever it started (its process group), and forget it."""
        r = self.running.pop(who, None)
        if r is None:
            return
        for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process is woken so the kill lands
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.process.pid, sig)
        r.process.join(10.0)
        self._drain(r)
        if r.conn is not None:
            r.conn.close()
            r.conn = None

    def _drain(self, r: _Running) -> None:
        while r.conn is not None:
            try:
                if not r.conn.poll(0):
                    return
                self._take(r, r.conn.recv())
            except (EOFError, OSError, Exception):  # noqa: BLE001 -- a pipe cut mid-message by a SIGKILL
                r.conn.close()
                r.conn = None

    def _trainers(self) -> list[Participant]:
        return [Participant.trainer(r) for r in range(self.world)]

    # -- events ---------------------------------------------------------------------------------
    def _take(self, r: _Running, ev: Event) -> None:
        who = ev.participant
        if self.play is not None:
            self.play.event(ev, time.time())
        if isinstance(ev, StepStarted):
            self.started_step = max(self.started_step, ev.step)
            self.step_started_at[ev.step] = min(self.step_started_at.get(ev.step, ev.at), ev.at)
        elif isinstance(ev, Stepped):
            self.wrote[who.index] = max(self.wrote.get(who.index, 0), ev.step)
        elif isinstance(ev, InstanceUp):
            r.pids = ev.pids
        elif isinstance(ev, Held):
            self.counts.holds += 1
            if ev.exact:
                self.counts.exact_holds += 1
                self.verified[who.index].add(ev.step)
                self.held_at[who.index] = max(self.held_at.get(who.index, 0.0), self.step_started_at.get(ev.step, 0.0))
            else:
                self._violation(f"{who} reported step {ev.step} held, but {', '.join(ev.problems)} differ")
        elif isinstance(ev, Claim):
            self.counts.claims += 1
            if ev.version is not None and ev.exact is False:
                self._violation(f"{who} still claims step {ev.version} after a failed update, but "
                                f"{', '.join(ev.problems)} differ")
        elif isinstance(ev, Rejoined):
            self.counts.rejoins += 1
        elif isinstance(ev, Noticed):
            self._noticed(f"{who}: {ev.kind}: {ev.message}"[:300], ev.at)
        elif isinstance(ev, Failed):
            self._noticed(ev.line(300), time.time())

    def _noticed(self, what: str, at: float) -> None:
        self.out(f"  [{at - self.t0:.1f} s] {what[:300]}")
        f = self._open_fault()
        if f is not None and f.target != "none" and f.detected_at is None and at >= f.at:
            f.detected_at, f.detected_by = at, what
            self.out(f"  fault {f.index}: detected after {f.detect_s:.1f} s")

    def _violation(self, what: str) -> None:
        self.counts.violations.append(what)
        self.out(f"  INVARIANT BROKEN: {what}")

    def _open_fault(self) -> Fault | None:
        return self.faults[-1] if self.faults and self.faults[-1].recovered_at is None else None

    # -- the MetaServer's view ------------------------------------------------------------------
    def _watch_meta(self) -> None:
        """Every second: each instance's ``held`` on the MetaServer (checked against the readers' own checks
        at the end)."""
        from weightsync.meta.client import MetaClient

        client = MetaClient(self.meta.url, JOB, token=self.token, timeout=2.0)
        while not self._watch_stop.wait(1.0):
            try:
                members = client.summary().get("members", {})
            except Exception:  # noqa: BLE001 -- the server is down or stopped: a fault, not ours to report
                continue
            for i, m in members.items():
                h = m.get("held")
                if h is not None and (int(i), int(h)) not in self.meta_held:
                    self.meta_held[(int(i), int(h))] = time.time()

    # -- faults ---------------------------------------------------------------------------------
    def _inject(self) -> Fault | None:
        """Pick a target that is up and hit it; None when none of the chosen kind is up now."""
        cfg, now = self.cfg, time.time()
        kinds = cfg.kinds()
        if cfg.order == "cycle":
            target, action = kinds[self._tries % len(kinds)]
        else:
            target, action = self.rng.choice(kinds)
        if (target, action) in PLAYS:
            return self._start_play(target, action, now)
        stop_s = self.rng.uniform(*cfg.stop_s)
        pid: int | None = None
        if target == "meta":
            pid, who = self.meta.pid, "the MetaServer"
            if not self.meta.alive() or pid in self.conts:
                return None
        else:
            if target == "trainer":
                choices = [r for p, r in self.running.items() if p.role == "train"]
            else:
                choices = [r for p, r in self.running.items() if p.role == "infer" and (target == "reader" or r.pids)]
            choices = [r for r in choices if r.process.is_alive() and r.process.pid not in self.conts]
            if not choices:
                return None
            r = self.rng.choice(sorted(choices, key=lambda r: r.participant))
            if target == "worker":
                k = self.rng.randrange(len(r.pids))
                if r.pids[k] in self.conts:
                    return None
                pid, who = r.pids[k], f"{r.participant} worker {k} (pid {r.pids[k]})"
            else:
                pid, who = r.process.pid, str(r.participant)
        until = now if action == "kill" else now + stop_s
        self._tries += 1
        f = Fault(sum(f.target != "none" for f in self.faults) + 1, target, action, who, now, until, self.started_step,
                  pid)
        self.faults.append(f)
        try:
            os.kill(pid, signal.SIGKILL if action == "kill" else signal.SIGSTOP)
        except ProcessLookupError:
            f.recovered_at = now  # it had just ended on its own: nothing was hit
            f.detected_by = "target gone before the fault"
            return f
        self.out(f"fault {f.index} at {now - self.t0:.1f} s: {f.kind}: {who}"
                 + (f" for {stop_s:.1f} s" if action == "stop" else "") + f" (step {f.last_step})")
        if action == "stop":
            self.conts[pid] = until
        elif target == "meta":
            self.pending["meta"] = now + cfg.restart_after_s
        return f

    def _start_play(self, target: str, action: str, now: float) -> Fault | None:
        f = Fault(sum(f.target != "none" for f in self.faults) + 1, target, action, "", now, float("inf"),
                  self.started_step)
        play = PLAYS[(target, action)](self, f)
        if not play.start():
            return None
        self._tries += 1
        self.faults.append(f)
        self.play = play
        self.out(f"fault {f.index} at {now - self.t0:.1f} s: {f.kind}" + (f": {f.who}" if f.who else "")
                 + f" (step {f.last_step})")
        return f

    def _tick_play(self, now: float) -> None:
        if self.play is not None and self.play.tick(now):
            self._end_play(now)

    def _end_play(self, now: float) -> None:
        play, self.play = self.play, None
        if play is not None:
            try:
                play.end()
            finally:
                play.fault.until = min(play.fault.until, now)
                self.out(f"  fault {play.fault.index}: {play.fault.kind} over after {now - play.fault.at:.1f} s"
                         + (f": {play.fault.notes}" if play.fault.notes else ""))

    def _resume_stopped(self, now: float) -> None:
        for pid, due in list(self.conts.items()):
            if now >= due:
                del self.conts[pid]
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def _check_recovered(self, now: float) -> None:
        f = self._open_fault()
        if f is None:
            return
        if now >= f.until and all(self.held_at.get(i, 0.0) >= f.at for i in range(self.cfg.readers)):
            # every reader holds, checked, a step the trainers started after the fault hit
            f.recovered_at = max(now, f.until)
            self.out(f"  fault {f.index}: recovered after {f.recover_s:.1f} s")
            if (f.target, f.action) in QUIET and f.detected_at is not None:  # the job should not have felt it
                f.problems.append(f"a participant noticed it: {f.detected_by}")
                self.out(f"  fault {f.index}: NOT AS DESIGNED: {f.kind} was noticed ({f.detected_by[:200]})")
        elif now - f.at > self.cfg.recover_s:  # it stays unrecovered; the next fault waits for the job to move again
            self.out(f"  fault {f.index}: NOT recovered within {self.cfg.recover_s:g} s; restarting everyone")
            self._unstick()

    def _unstick(self) -> None:
        """After a fault the job did not recover from: restart every participant (the figures say so)."""
        stuck = self.faults[-1]
        self._end_play(time.time())
        self.pending.clear()
        for who in list(self.running):
            self._end(who)
        for pid in list(self.conts):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.conts.clear()
        if not self.meta.alive():
            self.meta.start()
        self._start_trainers()
        for i in range(self.cfg.readers):
            self._start_reader(i)
        self.counts.restarts["everyone"] = self.counts.restarts.get("everyone", 0) + 1
        # the stuck fault is closed as not recovered; a marker fault keeps the next one waiting for progress
        self.faults.append(Fault(0, "none", "unstick", "everyone", time.time(), time.time(), self.started_step))
        stuck.detected_by = stuck.detected_by or "not detected"

    # -- supervision ----------------------------------------------------------------------------
    def _supervise(self, now: float) -> None:
        for who, r in list(self.running.items()):
            if r.process.exitcode is None:
                continue
            self._drain(r)
            self._end(who)
            if who.role == "train":
                if "trainers" not in self.pending:
                    self.out(f"  {who} ended (exit {r.process.exitcode}): the trainer group restarts")
                    self.pending["trainers"] = now + self.cfg.restart_after_s
            else:
                self.pending[f"reader {who.index}"] = now + self.cfg.restart_after_s
        if not self.meta.alive() and "meta" not in self.pending:
            self.pending["meta"] = now + self.cfg.restart_after_s
        for what, due in list(self.pending.items()):
            if now < due:
                continue
            del self.pending[what]
            if what == "trainers":
                for t in self._trainers():
                    self._end(t)
                self._start_trainers()
                self.counts.restarts["trainer group"] += 1
            elif what == "meta":
                if self.meta.alive():
                    continue
                self.meta.start()
                self.counts.restarts["meta"] += 1
            else:
                self._start_reader(int(what.split()[1]))
                self.counts.restarts["reader"] += 1

    def _poll(self, timeout: float) -> None:
        conns = {r.conn: r for r in self.running.values() if r.conn is not None}
        if not conns:
            time.sleep(timeout)
            return
        for c in multiprocessing.connection.wait(list(conns), timeout=timeout):
            r = conns[c]
            try:
                self._take(r, c.recv())
            except (EOFError, OSError, Exception):  # noqa: BLE001 -- closed, or cut mid-message by a SIGKILL
                c.close()
                r.conn = None

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> SoakReport:
        cfg = self.cfg
        self.t0 = time.time()
        for path in (self.stop_path, self.train_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.meta.start()
        watcher = threading.Thread(target=self._watch_meta, name="soak-meta-watch", daemon=True)
        watcher.start()
        try:
            self._start_trainers()
            for i in range(cfg.readers):
                self._start_reader(i)
            self.out(f"soak: {self.world} training ranks ({cfg.train}), {cfg.readers} x {cfg.infer}, MetaServer "
                     f"{self.meta.url}; logs in {self.workdir}")
            # the job is up once every reader held a step; faults run for cfg.seconds from then
            self.faults.append(Fault(0, "none", "start", "everyone", time.time(), time.time(), 0))
            end: float | None = None
            next_fault = None
            while True:
                now = time.time()
                self._poll(_TICK_S)
                now = time.time()
                self._resume_stopped(now)
                self._tick_play(now)
                self._supervise(now)
                self._check_recovered(now)
                if self._open_fault() is None:
                    if end is None:
                        end = now + cfg.seconds
                        self.up_s = now - self.t0
                    if now >= end or (cfg.faults and self._tries >= cfg.faults):
                        break
                    if next_fault is None:
                        next_fault = now + self.rng.uniform(0.5, 1.5) * cfg.fault_gap_s
                    elif now >= next_fault:
                        if self._inject() is not None:
                            next_fault = None
                elif self._open_fault().target == "none" and now - self.faults[-1].at > cfg.recover_s * 2:
                    raise RuntimeError(f"soak: the job did not start within {cfg.recover_s * 2:g} s; logs in "
                                       f"{self.workdir}")
        finally:
            self._end_play(time.time())
            with open(self.stop_path, "w"):
                pass
            self._watch_stop.set()
            try:
                for who in list(self.running):
                    self._end(who)
            finally:
                self.meta.stop()
            watcher.join(5.0)
        return self._report(time.time() - self.t0)

    def _report(self, seconds: float) -> SoakReport:
        faults = tuple(f for f in self.faults if f.target != "none")
        unchecked = tuple(f"instance {i} step {s}" for (i, s) in sorted(self.meta_held)
                          if s not in self.verified.get(i, ()))
        report = SoakReport(self.cfg, seconds, self.up_s, max(self.wrote.values(), default=0), self.counts.holds,
                            self.counts.exact_holds, self.counts.claims, tuple(self.counts.violations), faults,
                            dict(self.counts.restarts), self.counts.rejoins, len(self.meta_held), unchecked,
                            self.workdir)
        with open(os.path.join(self.workdir, "report.json"), "w") as f:
            json.dump(report.to_json(), f, indent=1)
        return report


def run(cfg: SoakConfig, out: Callable[[str], None] | None = None) -> SoakReport:
    """Run one soak; the figures are ``report.lines()``."""
    return Soak(cfg, out).run()


__all__ = ["Fault", "MetaProcess", "PipeSink", "Soak", "SoakReport", "run"]
