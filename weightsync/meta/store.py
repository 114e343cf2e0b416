"""Durable MetaServer state: SQLite (standard library) in WAL mode, one row per fact.

A mutation is a handful of row changes (:class:`Op`), so saving it costs O(its own size), not
O(state) as rewriting one JSON file did. Ops of requests that arrive together are applied in one
transaction (one fsync: group commit); ``synchronous=FULL`` makes a commit durable before it
returns, so an answer sent after it is on disk. A crash at any point leaves the last committed
transaction (SQLite's WAL is recovered at the next open); a failed commit is rolled back whole.

Tables: ``rows(job, kind, key) -> value`` (JSON text) for participants, plan hashes, instances,
held steps, rendezvous names and per-job counters; ``written(job, step, rank)`` for the steps.

This module knows rows, not what they mean: :meth:`Store.load` hands back each job's rows
(:class:`StoredJob`) and :mod:`.state` rebuilds its jobs from them, so the two do not import each other.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import sqlite3
import stat
from dataclasses import dataclass, field
from typing import Any, Iterable

from weightsync.errors import WeightSyncError

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


@dataclass
class StoredJob:
    """One job as last committed: its rows, their values parsed from JSON, and its written steps."""

    rows: list[tuple[str, str, Any]] = field(default_factory=list)  # (kind, key, value)
    written: list[tuple[int, int]] = field(default_factory=list)  # (step, training rank)

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
        _private_file(self.path)
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
            self.apply(legacy)

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

    def load(self) -> dict[str, StoredJob]:
        """Every job's rows as last committed (:func:`weightsync.meta.state.restore` makes jobs of them)."""
        jobs: dict[str, StoredJob] = {}
        try:
            for job, kind, key, value in self.db.execute("SELECT job, kind, key, value FROM rows"):
                jobs.setdefault(job, StoredJob()).rows.append((kind, key, json.loads(value)))
            for job, step, rank in self.db.execute("SELECT job, step, rank FROM written"):
                jobs.setdefault(job, StoredJob()).written.append((int(step), int(rank)))
        except (sqlite3.Error, ValueError) as e:
            raise WeightSyncError(f"MetaServer state {self.path} is not valid: {e}") from None
        return jobs

    def close(self) -> None:
        try:
            self.db.close()  # the last connection checkpoints and removes the -wal and -shm files
        except sqlite3.Error as e:
            log.warning("closing the MetaServer state %s: %s", self.path, e)


def legacy_ops(name: str, d: dict) -> list[Op]:
    """The ops that store one job of a format-1 state file (the whole state as one JSON object)."""
    version = int(d["topology_version"])
    written = {int(s): [int(r) for r in rs] for s, rs in d["written"].items()}
    floor = int(d["written_floor"])
    ops: list[Op] = [Put(name, "job", "topology_version", str(version)),
                     Put(name, "job", "written_floor", str(floor)),
                     Put(name, "job", "written_max", str(max(written, default=floor - 1))),
                     Put(name, "job", "aborted", json.dumps(d["aborted"]))]
    ops += [Put(name, "participant", k, json.dumps(p)) for k, p in dict(d["participants"]).items()]
    ops += [Put(name, "plan", k, json.dumps(p)) for k, p in dict(d["plan_hashes"]).items()]
    # format 1 kept only the joined instances: each a member since step 0, at the version it had
    ops += [Put(name, "instance", str(int(i)), json.dumps({"state": "joined", "since": 0, "version": version}))
            for i in d["instances"]]
    ops += [Put(name, "held", str(int(i)), str(int(s))) for i, s in d["held"].items()]
    ops += [Put(name, "rendezvous", k, json.dumps(str(a))) for k, a in dict(d["rendezvous"]).items()]
    ops += [AddWritten(name, s, r) for s, rs in written.items() for r in rs]
    return ops


def _private_file(path: str) -> None:
    """Create the database 0600 before SQLite opens it, whatever the umask: it holds every job's participants,
    hosts and plans (before: 0644, readable by any local user). SQLite gives its ``-wal`` and ``-shm`` files the
    database's mode. One that exists readable by others (an older server's) is narrowed to its owner."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        return
    except FileExistsError:
        pass
    except OSError as e:
        raise WeightSyncError(f"cannot create MetaServer state {path}: {e}") from None
    st = os.stat(path)
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():
        os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
        for side in (path + "-wal", path + "-shm"):
            try:
                os.chmod(side, stat.S_IMODE(os.stat(side).st_mode) & 0o700)
            except FileNotFoundError:
                pass
        log.info("MetaServer state %s was mode %04o: narrowed to its owner (it holds every job's records)",
                 path, stat.S_IMODE(st.st_mode))


def _reclaim_temp_files(path: str) -> None:
    """The format-1 server's temp files left by a kill mid-write (``.meta-state.*`` beside the state)."""
    for tmp in glob.glob(os.path.join(os.path.dirname(path), ".meta-state.*")):
        try:
            os.unlink(tmp)
            log.info("removed %s, left by a MetaServer killed mid-write", tmp)
        except OSError:
            pass


def _read_legacy(path: str) -> list[Op] | None:
    """A format-1 JSON state at ``path``: moved aside to ``path.v1.json``, its jobs returned as ops to import."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise WeightSyncError(f"cannot read MetaServer state {path}: {e}") from None
    if not head.lstrip().startswith(b"{"):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise WeightSyncError(f"cannot read MetaServer state {path}: {e}") from None
    try:
        if data.get("format") != LEGACY_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {LEGACY_FORMAT}")
        ops = [op for job, d in data["jobs"].items() for op in legacy_ops(job, d)]
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise WeightSyncError(f"MetaServer state {path} is not valid: {e}") from None
    os.replace(path, path + ".v1.json")
    os.chmod(path + ".v1.json", stat.S_IMODE(os.stat(path + ".v1.json").st_mode) & 0o700)  # job data: its owner's
    log.info("importing %d jobs from the format-1 state file (kept as %s.v1.json)", len(data["jobs"]), path)
    return ops
