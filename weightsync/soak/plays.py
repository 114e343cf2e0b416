"""The soak's faults that are not one signal: each runs a while, watched by the driver, and checks that weightsync
took it as designed (``Fault.problems`` says where it did not; the soak then fails).

- ``storm meta`` (:class:`StormPlay`, quiet): bad requests at the MetaServer (:mod:`.storm`) for ``storm_s`` and
  until every reader held a step the trainers started since the storm began. Every request must be refused, every
  slowloris connection closed by the server, and no participant may notice anything (before issue 40, one
  request with no token stopped the job for a minute).
- ``squat files`` (:class:`SquatPlay`): the file transport's directory becomes another user's (owned by
  ``nobody`` and 0777 where the soak runs as root; else 0777), and a reader is killed so that it restarts into it.
  The restarted reader must refuse the directory by name (``ConfigError``) and no reader may join while it is
  squatted; then the directory is given back and the reader joins.
- ``plant files`` (:class:`PlantPlay`): the trainers hold before their next step (they "train"), and files another
  user owns (or that others can write, not as root) are put at every name the readers wait for: well-formed
  files of that step, planned as the trainers plan, holding the step's weights negated, which would land if read. Every reader
  must refuse them by name ("refused, not read"), nothing may land (the invariant), none may report the step
  held, and none may withhold its engine for it (it still claims the step it held: no byte moved); then the
  planted files are removed and the trainers write the step.
- ``slow trainer`` (:class:`SlowPlay`, quiet): the trainers hold before their next step for ``timeout_s`` +
  ``slow_over_s``: a training step longer than every participant's timeout. The readers wait for it
  (``written_timeout_s``), nobody notices anything, and the step lands whole.

A quiet kind's check (:data:`weightsync.soak.config.QUIET`: the storm, the slow step) is the driver's: a failure any
participant reports from the fault's start until the job recovered is a problem of the fault.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
from typing import TYPE_CHECKING

from weightsync.local.events import Event, Failed, Ready
from weightsync.soak.events import Claim, Held, Noticed, Training

if TYPE_CHECKING:
    from weightsync.soak.config import SoakConfig
    from weightsync.soak.driver import Fault, Soak

NOBODY = 65534  # the uid and gid another user's files and folders get when the soak runs as root


class Play:
    """One fault that runs a while: :meth:`start` it, :meth:`tick` it until it says it is done, then :meth:`end` it
    (also on the way out of a soak that stops early). Told of every participant's event (:meth:`event`)."""

    def __init__(self, soak: "Soak", fault: "Fault"):
        self.soak, self.fault = soak, fault
        self.cap_s = soak.cfg.recover_s / 2  # a play that is not done by then is ended, with a problem
        self.ended = False

    def start(self) -> bool:
        """Begin; False when there is nothing to hit now (the driver tries another time)."""
        return True

    def event(self, ev: Event, at: float) -> None:
        pass

    def tick(self, now: float) -> bool:
        raise NotImplementedError

    def end(self) -> None:
        """Give the job back what the play took (idempotent)."""
        self.ended = True

    def problem(self, text: str) -> None:
        self.fault.problems.append(text)
        self.soak.out(f"  fault {self.fault.index}: NOT AS DESIGNED: {text}")

    def overdue(self, now: float, what: str) -> bool:
        if now - self.fault.at <= self.cap_s:
            return False
        self.problem(f"{what} within {self.cap_s:g} s")
        return True


def _said(ev: Event) -> str:
    if isinstance(ev, (Noticed, Failed)):
        return f"{ev.kind}: {ev.message}"
    return ""


# -- storm meta ------------------------------------------------------------------------------------


class StormPlay(Play):
    def start(self) -> bool:
        from weightsync.soak.participants import JOB
        from weightsync.soak.storm import Storm
        from weightsync.spec import load_spec

        soak = self.soak
        self.storm = Storm(soak.meta.url, JOB, soak.meta.token, soak.token, dict(load_spec(soak.cfg.model).config))
        self.storm.start()
        return True

    def tick(self, now: float) -> bool:
        f, soak = self.fault, self.soak
        served = all(soak.held_at.get(i, 0.0) >= f.at for i in range(soak.cfg.readers))
        if now - f.at >= soak.cfg.storm_s and self.storm.slow_done() and served:
            return True
        return self.overdue(now, "not every reader held a new step while the storm ran" if not served else
                            "the slowloris did not end")

    def end(self) -> None:
        if self.ended:
            return
        super().end()
        self.storm.stop()
        for p in self.storm.problems:
            self.problem(f"the MetaServer: {p}")
        self.fault.notes = self.storm.summary()


# -- squat files -----------------------------------------------------------------------------------


def take_over(path: str) -> tuple[int, int, int]:
    """Make ``path`` a folder another user could write (theirs and 0777 as root, else 0777); returns its owner,
    group and mode to give back (:func:`give_back`)."""
    st = os.stat(path)
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
    os.chmod(path, 0o777)
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def give_back(path: str, was: tuple[int, int, int]) -> None:
    uid, gid, mode = was
    if os.geteuid() == 0:
        os.chown(path, uid, gid)
    os.chmod(path, mode)


class SquatPlay(Play):
    def start(self) -> bool:
        soak = self.soak
        readers = [r for p, r in sorted(soak.running.items()) if p.role == "infer" and r.process.is_alive()
                   and r.process.pid not in soak.conts]
        if not readers:
            return False
        r = soak.rng.choice(readers)
        self.victim = r.participant.index
        self.fault.who = f"{soak.directory}, then {r.participant} killed (it restarts into it)"
        self.was = take_over(soak.directory)
        self.refusals: list[str] = []
        with contextlib.suppress(ProcessLookupError):
            os.kill(r.process.pid, signal.SIGKILL)
        return True

    def event(self, ev: Event, at: float) -> None:
        if self.ended or ev.participant.role != "infer":
            return
        said = _said(ev)
        if "file transport's directory" in said and self.soak.directory in said:
            self.refusals.append(f"{ev.participant}: {said}")
        elif isinstance(ev, Ready):
            self.problem(f"{ev.participant} joined the job from {self.soak.directory}, which another user could "
                         "write")

    def tick(self, now: float) -> bool:
        if self.refusals or self.fault.problems:
            return True
        return self.overdue(now, f"no reader refused the directory another user could write (instance "
                                 f"{self.victim} restarted into it)")

    def end(self) -> None:
        if self.ended:
            return
        super().end()
        give_back(self.soak.directory, self.was)
        if self.refusals:
            self.fault.notes = f"{len(self.refusals)} refusal(s); first: {self.refusals[0][:240]}"


# -- plant files -----------------------------------------------------------------------------------


def planted_weights(cfg: "SoakConfig", spec, step: int) -> dict:
    """The weights in another user's files of ``step``: the step's own, negated (random normal values, never zero:
    every element differs from the step's, so any of them landing breaks the readers' bit-for-bit check)."""
    from weightsync.soak.config import step_weights

    return {name: -t for name, t in step_weights(cfg, spec, step).items()}


def plant_files(cfg: "SoakConfig", directory: str, scratch: str, step: int) -> list[tuple[str, int]]:
    """Put another user's files of ``step`` in ``directory`` at every name the readers wait for (the files instance
    slot 0's plan names, as the trainers plan and write them), holding weights that are not any step's; returns each
    file's path and inode. (Not weights of another seed: torch's CPU generator keeps a seed's low 32 bits only, so
    ``random_canonical(seed=2**40 + step)`` is step ``step``'s own weights at seed 0.)

    Written in ``scratch`` (a folder of this user's), made another user's (root: owned by ``nobody``, 0644; else
    0666: writable by others), then hard-linked in: a name a trainer already wrote is left alone, and no file is
    ever this user's own at a name a reader reads."""
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import scatter
    from weightsync.plan.job import JobShape
    from weightsync.soak.participants import transport_args
    from weightsync.spec import load_spec
    from weightsync.transport.file import FileTransport
    from weightsync.transport.private import private_directory

    spec = load_spec(cfg.model)
    src, dst = make_layout(spec, cfg.train), make_layout(spec, cfg.infer)
    shape = JobShape(cfg.train, cfg.infer, src.world_size, dst.world_size, 1, False,
                     transport_args(cfg, directory)["bucket_bytes"], transport=cfg.transport, mode=cfg.mode,
                     elastic=True)
    planner = shape.planner(spec, src=src, dst=dst, instances=1)
    theirs = planted_weights(cfg, spec, step)
    private_directory(scratch)
    for name in os.listdir(scratch):
        os.unlink(os.path.join(scratch, name))
    t = FileTransport(scratch)
    for rank in range(src.world_size):
        t.send(planner.send_plan(rank), scatter(src.layout(rank), theirs), step=step)
    planted = []
    for name in sorted(os.listdir(scratch)):
        path = os.path.join(scratch, name)
        if os.geteuid() == 0:
            os.chown(path, NOBODY, NOBODY)
            os.chmod(path, 0o644)
        else:
            os.chmod(path, 0o666)
        there = os.path.join(directory, name)
        try:
            os.link(path, there)
            planted.append((there, os.stat(path).st_ino))
        except FileExistsError:  # written already: a trainer's, left alone
            pass
        os.unlink(path)
    return planted


class PlantPlay(Play):
    def start(self) -> bool:
        self.soak.train(True)  # the trainers hold before their next step
        self.training: dict[int, int] = {}  # training rank -> the step it holds before
        self.planted: list[tuple[str, int]] = []
        self.step: int | None = None
        self.refused: dict[int, int] = {}  # instance -> refusals
        self.claimed: set[int] = set()  # instances whose claim after their first refusal was seen
        self.first = ""
        self.fault.who = "the file transport's directory"
        return True

    def event(self, ev: Event, at: float) -> None:
        if self.ended:
            return
        who = ev.participant
        if isinstance(ev, Training) and who.role == "train":
            self.training[who.index] = ev.step
        elif self.step is not None and who.role == "infer":
            said = _said(ev)
            # (by file name: the reader names the file under the directory's real path)
            if "refused, not read" in said and any(os.path.basename(path) in said for path, _ in self.planted):
                self.refused[who.index] = self.refused.get(who.index, 0) + 1
                self.first = self.first or f"{who}: {said}"
            elif isinstance(ev, Held) and ev.step >= self.step:
                self.problem(f"{who} reported step {ev.step} held while only the planted files of step "
                             f"{self.step} were there")
            elif isinstance(ev, Claim) and who.index in self.refused and who.index not in self.claimed:
                self.claimed.add(who.index)  # the reader that held the step before: it still serves it
                if ev.version is None:
                    self.problem(f"{who} serves no version after refusing the planted files (its engine withheld), "
                                 "though no byte of them landed")

    def tick(self, now: float) -> bool:
        soak = self.soak
        if self.step is None:
            steps = {self.training.get(r) for r in range(soak.world)}
            if len(steps) == 1 and None not in steps:  # every rank holds before the same step
                self.step = steps.pop()
                self.planted = plant_files(soak.cfg, soak.directory, os.path.join(soak.workdir, "planted"),
                                           self.step)
                soak.out(f"  fault {self.fault.index}: {len(self.planted)} files of step {self.step} planted")
                if not self.planted:
                    self.problem(f"nothing planted: every file of step {self.step} was there already")
                    return True
            return self.overdue(now, "the trainers did not hold before a step")
        readers = range(soak.cfg.readers)
        if all(self.refused.get(i) and i in self.claimed for i in readers) or self.fault.problems:
            return True  # every reader refused them, and said what it still serves
        missing = [i for i in readers if not self.refused.get(i)]
        unclaimed = [i for i in readers if self.refused.get(i) and i not in self.claimed]
        return self.overdue(now, f"instance(s) {missing} did not refuse the planted files of step {self.step}"
                            if missing else f"instance(s) {unclaimed} refused the planted files but said nothing of "
                                            "the version they still serve")

    def end(self) -> None:
        if self.ended:
            return
        super().end()
        for path, ino in self.planted:  # only what was planted (a trainer's file at the name stays)
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(path).st_ino == ino:
                    os.unlink(path)
        self.soak.train(False)
        if self.step is not None:
            self.fault.notes = (f"{len(self.planted)} files of step {self.step} planted, refused "
                                f"{sum(self.refused.values())} time(s) by instance(s) {sorted(self.refused)}"
                                + (f"; first: {self.first[:240]}" if self.first else ""))


# -- slow trainer ----------------------------------------------------------------------------------


class SlowPlay(Play):
    def start(self) -> bool:
        self.soak.train(True)
        self.training: dict[int, float] = {}  # training rank -> when it began to hold
        self.step: int | None = None
        self.fault.who = "the training ranks"
        return True

    def event(self, ev: Event, at: float) -> None:
        if not self.ended and isinstance(ev, Training) and ev.participant.role == "train":
            self.training[ev.participant.index] = ev.at
            self.step = ev.step

    def tick(self, now: float) -> bool:
        soak = self.soak
        if len(self.training) < soak.world:
            return self.overdue(now, "the trainers did not hold before a step")
        self.long_s = soak.cfg.timeout_s + soak.cfg.slow_over_s
        return now >= min(self.training.values()) + self.long_s

    def end(self) -> None:
        if self.ended:
            return
        super().end()
        self.soak.train(False)
        if self.step is not None and len(self.training) == self.soak.world:
            self.fault.notes = (f"step {self.step} trained {self.long_s:g} s before it was written (timeout_s "
                                f"{self.soak.cfg.timeout_s:g} s)")


#: the kinds of fault a play runs, by (target, action)
PLAYS: dict[tuple[str, str], type[Play]] = {("meta", "storm"): StormPlay, ("files", "squat"): SquatPlay,
                                            ("files", "plant"): PlantPlay, ("trainer", "slow"): SlowPlay}


__all__ = ["PLAYS", "PlantPlay", "Play", "SlowPlay", "SquatPlay", "StormPlay", "give_back", "plant_files",
           "take_over"]
