"""Durable MetaServer state: SQLite (standard library) in WAL mode, one row per fact.

A mutation is a handful of row changes (:class:`Op`), so saving it costs O(its own size), not
O(state) as rewriting one JSON file did. Ops of requests that arrive together are applied in one
transaction (one fsync: group commit); ``synchronous=FULL`` makes a commit durable before it
returns, so an answer sent after it is on disk. A crash at any point leaves the last committed
transaction (SQLite's WAL is recovered at the next open); a failed commit is rolled back whole.

Tables: ``rows(job, kind, key) -> value`` (JSON text) for participants, plan hashes, instances,
held steps, rendezvous names and per-job counters; ``written(job, step, rank)`` for the steps.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import sqlite3
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from weightsync.errors import WeightSyncError

if TYPE_CHECKING:
    from weightsync.meta.state import Job

log = logging.getLogger("weightsync.meta.store")

FORMAT = 2  # 1 was the whole state as one JSON file
LEGACY_FORMAT = 1


@dataclass(frozen=True)
class Put:
    """Set ``rows[job, kind, key]`` to ``value`` (JSON text)."""

    job: str
    kind: str
    key: str
    value: str


@dataclass(frozen=True)
class Delete:
    """Remove ``rows[job, kind, key]``."""

    job: str
    kind: str
    key: str


@dataclass(frozen=True)
class AddWritten:
    job: str
    step: int
    rank: int


@dataclass(frozen=True)
class PruneWritten:
    """Forget the job's written steps below ``floor``."""

    job: str
    floor: int


@dataclass(frozen=True)
class DropJob:
    job: str


Op = Put | Delete | AddWritten | PruneWritten | DropJob

_SCHEMA = """
CREATE TABLE IF NOT EXISTS format(version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS rows(job TEXT NOT NULL, kind TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL,
                                PRIMARY KEY(job, kind, key)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS written(job TEXT NOT NULL, step INTEGER NOT NULL, rank INTEGER NOT NULL,
                                   PRIMARY KEY(job, step, rank)) WITHOUT ROWID;
"""


class Store:
    """One SQLite database; used from one thread at a time (the server's writer thread)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        _reclaim_temp_files(self.path)
        legacy = _read_legacy(self.path)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL").fetchone()
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.executescript(_SCHEMA)
            got = self.db.execute("SELECT version FROM format").fetchall()
            if not got:
                self.db.execute("INSERT INTO format VALUES (?)", (FORMAT,))
            elif got[0][0] != FORMAT:
                raise WeightSyncError(f"MetaServer state {path} is format {got[0][0]}, expected {FORMAT}")
        except sqlite3.Error as e:
            raise WeightSyncError(f"cannot read MetaServer state {path}: {e}") from None
        if legacy is not None:
            self.apply([op for name, job in legacy.items() for op in job_ops(name, job)])
            log.info("imported %d jobs from the format-1 state file (kept as %s.v1.json)", len(legacy), path)

    def apply(self, ops: Iterable[Op]) -> None:
        """All of ``ops`` in one durable transaction, or none of them (raises)."""
        cur = self.db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            for op in ops:
                if isinstance(op, Put):
                    cur.execute("INSERT OR REPLACE INTO rows VALUES (?, ?, ?, ?)", (op.job, op.kind, op.key, op.value))
                elif isinstance(op, Delete):
                    cur.execute("DELETE FROM rows WHERE job = ? AND kind = ? AND key = ?", (op.job, op.kind, op.key))
                elif isinstance(op, AddWritten):
                    cur.execute("INSERT OR IGNORE INTO written VALUES (?, ?, ?)", (op.job, op.step, op.rank))
                elif isinstance(op, PruneWritten):
                    cur.execute("DELETE FROM written WHERE job = ? AND step < ?", (op.job, op.floor))
                else:
                    cur.execute("DELETE FROM rows WHERE job = ?", (op.job,))
                    cur.execute("DELETE FROM written WHERE job = ?", (op.job,))
            cur.execute("COMMIT")
        except BaseException:
            try:
                cur.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise

    def load(self) -> dict[str, Job]:
        """Every job as last committed."""
        from weightsync.meta.state import Job

        jobs: dict[str, Job] = {}
        try:
            for job, kind, key, value in self.db.execute("SELECT job, kind, key, value FROM rows"):
                _load_row(jobs.setdefault(job, Job()), kind, key, json.loads(value))
            for job, step, rank in self.db.execute("SELECT job, step, rank FROM written"):
                jobs.setdefault(job, Job()).written.setdefault(step, set()).add(rank)
        except (sqlite3.Error, ValueError, KeyError, TypeError) as e:
            raise WeightSyncError(f"MetaServer state {self.path} is not valid: {e}") from None
        for j in jobs.values():
            j.rebuild_counts()
        return jobs

    def close(self) -> None:
        try:
            self.db.close()  # the last connection checkpoints and removes the -wal and -shm files
        except sqlite3.Error as e:
            log.warning("closing the MetaServer state %s: %s", self.path, e)


def _load_row(j: Job, kind: str, key: str, v: object) -> None:
    if kind == "participant":
        j.participants[key] = v
    elif kind == "plan":
        j.plan_hashes[key] = v
    elif kind == "instance":  # a membership record (format 1 stored ``true`` for a joined instance)
        from weightsync.meta.state import member

        rec = v if isinstance(v, dict) else (member("joined", 0, 0) if v else None)
        if rec is not None:
            j.members[int(key)] = rec
            if rec["state"] == "joined":
                j.instances.add(int(key))
    elif kind == "held":
        if v is not None:
            j.held[int(key)] = int(v)
    elif kind == "rendezvous":
        j.rendezvous[key] = v
    elif kind == "job":
        if key == "aborted":
            j.aborted = v
        elif key in ("topology_version", "written_floor", "written_max"):
            setattr(j, key, int(v))
    else:
        raise ValueError(f"unknown row kind {kind!r}")


def job_ops(name: str, j: Job) -> list[Op]:
    """The ops that store one whole job (importing a format-1 state)."""
    ops: list[Op] = [Put(name, "job", "topology_version", str(j.topology_version)),
                     Put(name, "job", "written_floor", str(j.written_floor)),
                     Put(name, "job", "written_max", str(j.written_max)),
                     Put(name, "job", "aborted", json.dumps(j.aborted))]
    ops += [Put(name, "participant", k, json.dumps(p)) for k, p in j.participants.items()]
    ops += [Put(name, "plan", k, json.dumps(p)) for k, p in j.plan_hashes.items()]
    ops += [Put(name, "instance", str(i), json.dumps(m)) for i, m in j.members.items()]
    ops += [Put(name, "held", str(i), str(s)) for i, s in j.held.items()]
    ops += [Put(name, "rendezvous", k, json.dumps(a)) for k, a in j.rendezvous.items()]
    ops += [AddWritten(name, s, r) for s, rs in j.written.items() for r in rs]
    return ops


def _reclaim_temp_files(path: str) -> None:
    """The format-1 server's temp files left by a kill mid-write (``.meta-state.*`` beside the state)."""
    for tmp in glob.glob(os.path.join(os.path.dirname(path), ".meta-state.*")):
        try:
            os.unlink(tmp)
            log.info("removed %s, left by a MetaServer killed mid-write", tmp)
        except OSError:
            pass


def _read_legacy(path: str) -> dict[str, "Job"] | None:
    """A format-1 JSON state at ``path``: moved aside to ``path.v1.json``, its jobs returned for import."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise WeightSyncError(f"cannot read MetaServer state {path}: {e}") from None
    if not head.lstrip().startswith(b"{"):
        return None
    from weightsync.meta.state import Job

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise WeightSyncError(f"cannot read MetaServer state {path}: {e}") from None
    try:
        if data.get("format") != LEGACY_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {LEGACY_FORMAT}")
        jobs = {job: Job.from_json(d) for job, d in data["jobs"].items()}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise WeightSyncError(f"MetaServer state {path} is not valid: {e}") from None
    os.replace(path, path + ".v1.json")
    return jobs
