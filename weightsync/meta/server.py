"""The MetaServer: the job-level coordinator that training and inference processes meet through.

It only holds small facts (who takes part, plan hashes, topology, which step is where); weights never
pass through it. JSON over HTTP, standard library only, never pickle. Waits are long-polls on one
``threading.Condition``: a mutation notifies, each waiter re-checks its own predicate.

Routes (ids in paths: job and rendezvous names match ``[A-Za-z0-9_.-]{1,128}``; instances and steps
are non-negative integers). ``timeout`` is in seconds (0 = answer now, at most 300); a long-poll
answers ``"ready": false`` when it runs out, and the client decides whether to poll again.

    GET  /health                                   200 {"status": "ok", ...}; never needs the token
    GET  /metrics                                  Prometheus text
    GET  /v1/jobs/{job}                            summary: participants, topology, steps, who holds what
    DELETE /v1/jobs/{job}                          forget a job (to reuse its id)
    POST /v1/jobs/{job}/abort                      {"reason"}: every waiter of the job wakes with 409
    POST /v1/jobs/{job}/participants               {"role", "rank", "instance"?, "host"?, "gpu"?,
                                                   "layout_digest"?, "address"?, "version"?,
                                                   "spec_digest"?, "engine_config"?,
                                                   "model_config"?}; re-register = replace
    GET  /v1/jobs/{job}/participants               ?role=&wait_for=N&timeout=S
    POST /v1/jobs/{job}/plan-hashes                {"role", "rank", "instance"?, "plan_hash"?,
                                                   "pairs": [[src_rank, dst_instance, dst_rank, hash], ...]}
    GET  /v1/jobs/{job}/plan-hashes/check          pairs whose two ends disagree, with both names
    POST /v1/jobs/{job}/instances/{i}/join         {}; the topology version grows on each change
    POST /v1/jobs/{job}/instances/{i}/leave        {}
    GET  /v1/jobs/{job}/instances                  ?after_version=V&timeout=S
    POST /v1/jobs/{job}/steps/{S}/written          {"rank"}: training rank R has step S ready
    GET  /v1/jobs/{job}/steps/{S}/written          ?wait_for=N&timeout=S (N defaults to every train rank)
    POST /v1/jobs/{job}/instances/{i}/held         {"step", "reset"?}: instance i fully holds step S
    GET  /v1/jobs/{job}/held                       ?min_step=S&instances=0,1&timeout=T (default: joined ones)
    POST /v1/jobs/{job}/rendezvous/{name}          {"address", "replace"?}: first publisher wins
    GET  /v1/jobs/{job}/rendezvous/{name}          ?timeout=S

Rules: plan hashes and ``written`` need the participant registered first, ``held`` needs the instance
joined; ``held`` is monotonic per instance unless ``reset``; ``written`` keeps the last 64 steps. Once a
job is aborted its waits and mutations answer 409 (with ``"aborted"``) until it is deleted.

Errors are JSON ``{"error": "..."}`` with a 4xx status and change nothing: 400 malformed, 401 token,
404 unknown route or job, 405 method, 409 conflict (aborted job, unregistered peer, step going back),
410 step older than the retained window, 411/413 body framing and size, 429 too many jobs.
503 means the server is stopping: the client retries. (A failed state write answers 500 and leaves
the change in memory only; the next successful write includes it.)

Persistence (``state_path``): after every mutation the whole state is written to a temp file,
fsynced and renamed over the old one before the answer is sent, so a crash leaves either the old or
the new state; start reloads it. Every mutation is idempotent, so a client that retries a request
whose answer was lost to a restart changes nothing twice.
"""

from __future__ import annotations

import argparse
import hmac
import json
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qsl, urlsplit

from weightsync import __version__
from weightsync.errors import WeightSyncError

MAX_BODY = 1 << 20
MAX_WAIT_S = 300.0
MAX_JOBS = 1024
MAX_PARTICIPANTS = 16384
MAX_PAIRS = 16384
MAX_RENDEZVOUS = 65536  # async pulls claim one name each
MAX_INT = (1 << 63) - 1
MAX_RANK = 1 << 20
STEPS_KEPT = 64  # written-step sets kept per job; older steps answer 410
STATE_FORMAT = 1

ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")
INT_RE = re.compile(r"[0-9]{1,19}")
HEX_RE = re.compile(r"[0-9a-fA-F]{1,128}")
ROLES = ("train", "infer")


class HTTPError(Exception):
    """Ends a request with ``status`` and a JSON error; raised before any state changes."""

    def __init__(self, status: int, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.extra = status, extra


# --------------------------------------------------------------------------------------------
# Validation: strict types, bounded sizes, unknown fields refused


def _bad(message: str) -> HTTPError:
    return HTTPError(400, message)


def _fields(body: dict, required: set[str], optional: set[str] = frozenset()) -> None:
    unknown = sorted(set(body) - required - optional)
    if unknown:
        raise _bad(f"unknown fields {unknown}; allowed: {sorted(required | optional)}")
    missing = sorted(required - set(body))
    if missing:
        raise _bad(f"missing fields {missing}")


def _int(v: Any, what: str, lo: int = 0, hi: int = MAX_INT) -> int:
    if type(v) is not int or not lo <= v <= hi:  # bool is an int subclass: refused too
        raise _bad(f"{what} must be an integer in [{lo}, {hi}], got {_short(v)}")
    return v


def _str(v: Any, what: str, max_len: int, pattern: re.Pattern | None = None) -> str:
    if not isinstance(v, str) or len(v) > max_len or (pattern is not None and not pattern.fullmatch(v)):
        rule = f"matching {pattern.pattern}" if pattern is not None else f"of at most {max_len} characters"
        raise _bad(f"{what} must be a string {rule}, got {_short(v)}")
    return v


def _bool(v: Any, what: str) -> bool:
    if type(v) is not bool:
        raise _bad(f"{what} must be true or false, got {_short(v)}")
    return v


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _model_config(v: Any) -> dict:
    """The HF config.json of the participant's model: lets a peer name the first differing tensor."""
    if not isinstance(v, dict) or len(json.dumps(v)) > 65536:
        raise _bad(f"model_config must be an object of at most 64 KiB, got {_short(v)}")
    return v


def _engine_config(v: Any) -> dict:
    """A small flat dict of scalars: enough to describe an engine, too small to abuse as storage."""
    if not isinstance(v, dict) or len(v) > 64:
        raise _bad(f"engine_config must be an object of at most 64 entries, got {_short(v)}")
    for k, x in v.items():
        _str(k, "engine_config key", 64)
        if x is not None and type(x) not in (str, int, float, bool):
            raise _bad(f"engine_config[{k!r}] must be a string, number, boolean or null, got {_short(x)}")
        if isinstance(x, str) and len(x) > 256:
            raise _bad(f"engine_config[{k!r}] is longer than 256 characters")
    return dict(v)


def _identity(body: dict) -> tuple[str, int, int | None]:
    """(role, rank, instance) -> validated; instance is required for infer and forbidden for train."""
    role = body.get("role")
    if role not in ROLES:
        raise _bad(f"role must be one of {list(ROLES)}, got {_short(role)}")
    rank = _int(body.get("rank"), "rank", 0, MAX_RANK)
    inst = body.get("instance")
    if role == "infer":
        inst = _int(inst, "instance", 0, MAX_RANK)
    elif inst is not None:
        raise _bad("instance is only for role infer")
    return role, rank, inst


def participant_name(role: str, rank: int, instance: int | None) -> str:
    """``train:R`` or ``infer:I:R``: how messages name a participant."""
    return f"train:{rank}" if role == "train" else f"infer:{instance}:{rank}"


class _Query:
    """Query parameters: each at most once, only the names a route accepts."""

    def __init__(self, query: str, allowed: set[str]):
        try:
            pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
        except ValueError:
            raise _bad("malformed query string") from None
        self.values: dict[str, str] = {}
        for k, v in pairs:
            if k not in allowed:
                raise _bad(f"unknown query parameter {_short(k)}; allowed: {sorted(allowed)}")
            if k in self.values:
                raise _bad(f"query parameter {k} given twice")
            self.values[k] = v

    def int(self, name: str, default: int | None, lo: int = 0, hi: int = MAX_INT) -> int | None:
        s = self.values.get(name)
        if s is None:
            return default
        if not INT_RE.fullmatch(s) or not lo <= int(s) <= hi:
            raise _bad(f"{name} must be an integer in [{lo}, {hi}], got {_short(s)}")
        return int(s)

    def timeout(self) -> float:
        s = self.values.get("timeout", "0")
        try:
            t = float(s)
        except ValueError:
            t = math.nan
        if not 0 <= t <= MAX_WAIT_S:  # also refuses nan and inf
            raise _bad(f"timeout must be a number of seconds in [0, {MAX_WAIT_S:g}], got {_short(s)}")
        return t

    def int_list(self, name: str) -> list[int] | None:
        s = self.values.get(name)
        if s is None:
            return None
        parts = s.split(",") if s else []
        if len(parts) > MAX_PARTICIPANTS or not all(INT_RE.fullmatch(p) and int(p) <= MAX_RANK for p in parts):
            raise _bad(f"{name} must be a comma-separated list of instance numbers, got {_short(s)}")
        return sorted({int(p) for p in parts})


# --------------------------------------------------------------------------------------------
# State


@dataclass
class Job:
    """Everything the server knows about one job; plain data so it round-trips through JSON."""

    participants: dict[str, dict] = field(default_factory=dict)  # name -> record
    plan_hashes: dict[str, dict] = field(default_factory=dict)  # name -> {"plan_hash", "pairs": {"s,i,r": h}}
    instances: set[int] = field(default_factory=set)
    topology_version: int = 0
    written: dict[int, set[int]] = field(default_factory=dict)  # step -> training ranks that wrote it
    written_floor: int = 0  # steps below were pruned
    held: dict[int, int] = field(default_factory=dict)  # instance -> latest fully held step
    rendezvous: dict[str, str] = field(default_factory=dict)
    aborted: str | None = None

    def train_ranks(self) -> list[int]:
        return sorted(p["rank"] for p in self.participants.values() if p["role"] == "train")

    def complete_step(self) -> int | None:
        """Latest step written by every registered training rank."""
        ranks = set(self.train_ranks())
        done = [s for s, got in self.written.items() if ranks and ranks <= got]
        return max(done) if done else None

    def to_json(self) -> dict:
        return {
            "participants": self.participants,
            "plan_hashes": self.plan_hashes,
            "instances": sorted(self.instances),
            "topology_version": self.topology_version,
            "written": {str(s): sorted(r) for s, r in self.written.items()},
            "written_floor": self.written_floor,
            "held": {str(i): s for i, s in self.held.items()},
            "rendezvous": self.rendezvous,
            "aborted": self.aborted,
        }

    @classmethod
    def from_json(cls, d: dict) -> "Job":
        return cls(
            participants=dict(d["participants"]),
            plan_hashes=dict(d["plan_hashes"]),
            instances=set(d["instances"]),
            topology_version=int(d["topology_version"]),
            written={int(s): set(r) for s, r in d["written"].items()},
            written_floor=int(d["written_floor"]),
            held={int(i): int(s) for i, s in d["held"].items()},
            rendezvous=dict(d["rendezvous"]),
            aborted=d["aborted"],
        )


def load_state(path: str) -> dict[str, Job]:
    """Jobs from a state file; a missing file is an empty state, a broken one stops the start."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise WeightSyncError(f"cannot read MetaServer state {path}: {e}") from None
    try:
        if data.get("format") != STATE_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {STATE_FORMAT}")
        return {job: Job.from_json(d) for job, d in data["jobs"].items()}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise WeightSyncError(f"MetaServer state {path} is not valid: {e}") from None


def save_state(path: str, jobs: dict[str, Job]) -> None:
    """Atomic replace: a crash at any point leaves the previous or the new file, never half of one."""
    data = json.dumps({"format": STATE_FORMAT, "jobs": {j: job.to_json() for j, job in jobs.items()}})
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".meta-state.", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class Aborted(HTTPError):
    def __init__(self, job: str, reason: str):
        super().__init__(409, f"job {job} aborted: {reason}", aborted=reason)


class Coordinator:
    """The state and its rules, without HTTP: every public method validates first, then mutates."""

    def __init__(self, state_path: str | None = None):
        self.state_path = state_path
        self.jobs: dict[str, Job] = load_state(state_path) if state_path else {}
        self.cond = threading.Condition()
        self.closing = False
        self.waiting: dict[str, int] = {}  # route -> long-polls waiting now

    # -- helpers (call with self.cond held) -------------------------------------------------------
    def _job(self, job: str, create: bool = True, allow_aborted: bool = False) -> Job:
        j = self.jobs.get(job)
        if j is None:
            if not create:
                raise HTTPError(404, f"no job {job}")
            if len(self.jobs) >= MAX_JOBS:
                raise HTTPError(429, f"too many jobs ({MAX_JOBS}); delete finished ones")
            j = Job()
        if j.aborted is not None and not allow_aborted:
            raise Aborted(job, j.aborted)
        return j

    def _commit(self, job: str, j: Job) -> None:
        """Store the (mutated) job, persist, wake every waiter."""
        self.jobs[job] = j
        self._persist()

    def _persist(self) -> None:
        """Write the state before anyone is told; a stopping server writes no more (its successor owns the file)."""
        if self.closing:
            raise HTTPError(503, "server stopping; retry")
        if self.state_path:
            save_state(self.state_path, self.jobs)
        self.cond.notify_all()

    def _wait(self, route: str, job: str, timeout: float, ready: Callable[[Job], bool]) -> tuple[bool, Job]:
        """Block until ``ready(job)`` or the timeout; an abort or a stopping server ends the wait."""
        deadline = time.monotonic() + timeout
        self.waiting[route] = self.waiting.get(route, 0) + 1
        try:
            while True:
                if self.closing:
                    raise HTTPError(503, "server stopping; retry")
                j = self.jobs.get(job) or Job()
                if j.aborted is not None:
                    raise Aborted(job, j.aborted)
                if ready(j):
                    return True, j
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, j
                self.cond.wait(left)
        finally:
            self.waiting[route] -= 1

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()

    # -- jobs -----------------------------------------------------------------------------------
    def summary(self, job: str) -> dict:
        with self.cond:
            j = self._job(job, create=False, allow_aborted=True)
            return {
                "job": job,
                "aborted": j.aborted,
                "participants": {r: sum(p["role"] == r for p in j.participants.values()) for r in ROLES},
                "train_ranks": j.train_ranks(),
                "topology_version": j.topology_version,
                "instances": sorted(j.instances),
                "held": {str(i): s for i, s in sorted(j.held.items())},
                "latest_written": max(j.written, default=None),
                "complete_step": j.complete_step(),
                "written": {str(s): sorted(r) for s, r in sorted(j.written.items())},
                "rendezvous": sorted(j.rendezvous),
            }

    def delete(self, job: str) -> dict:
        with self.cond:
            self._job(job, create=False, allow_aborted=True)
            del self.jobs[job]
            self._persist()
            return {"job": job, "deleted": True}

    def abort(self, job: str, body: dict) -> dict:
        _fields(body, {"reason"})
        reason = _str(body["reason"], "reason", 1024)
        with self.cond:
            j = self._job(job, allow_aborted=True)
            if j.aborted is None:
                j.aborted = reason or "(no reason given)"
                self._commit(job, j)
            return {"job": job, "aborted": j.aborted}

    # -- participants ---------------------------------------------------------------------------
    def register(self, job: str, body: dict) -> dict:
        _fields(body, {"role", "rank"}, {"instance", "host", "gpu", "layout_digest", "address", "version",
                                         "spec_digest", "engine_config", "model_config"})
        role, rank, inst = _identity(body)
        gpu = body.get("gpu")
        rec = {
            "role": role, "rank": rank, "instance": inst,
            "host": _str(body.get("host", ""), "host", 255),
            "gpu": None if gpu is None else _int(gpu, "gpu", 0, 4096),
            "layout_digest": _str(body.get("layout_digest", ""), "layout_digest", 128),
            "address": _str(body.get("address", ""), "address", 512),
            "version": _str(body.get("version", ""), "version", 64),
            "spec_digest": _str(body.get("spec_digest", ""), "spec_digest", 128),
            "engine_config": _engine_config(body.get("engine_config", {})),
            "model_config": _model_config(body.get("model_config", {})),
        }
        name = participant_name(role, rank, inst)
        with self.cond:
            j = self._job(job)
            for other, p in j.participants.items():
                if other != name and p["spec_digest"] and rec["spec_digest"] and p["spec_digest"] != rec["spec_digest"]:
                    raise HTTPError(409, f"{name} has model spec {rec['spec_digest']} but {other} has "
                                         f"{p['spec_digest']}: both ends must load the same model")
            old = j.participants.get(name)
            if old is None and len(j.participants) >= MAX_PARTICIPANTS:
                raise HTTPError(409, f"job {job} already has {MAX_PARTICIPANTS} participants")
            if old != rec:
                j.participants[name] = rec
                j.plan_hashes.pop(name, None)  # a re-registered participant plans again
                self._commit(job, j)
            return {"name": name, "created": old is None, "count": len(j.participants)}

    def participants(self, job: str, q: _Query) -> dict:
        role = q.values.get("role")
        if role is not None and role not in ROLES:
            raise _bad(f"role must be one of {list(ROLES)}, got {_short(role)}")
        wait_for = q.int("wait_for", 0, 0, MAX_PARTICIPANTS)
        timeout = q.timeout()

        def chosen(j: Job) -> list[dict]:
            ps = [dict(p, name=n) for n, p in sorted(j.participants.items())]
            return [p for p in ps if role is None or p["role"] == role]

        with self.cond:
            ready, j = self._wait("participants", job, timeout, lambda j: len(chosen(j)) >= wait_for)
            ps = chosen(j)
            return {"ready": ready, "count": len(ps), "participants": ps}

    # -- plan hashes ----------------------------------------------------------------------------
    def post_plan_hashes(self, job: str, body: dict) -> dict:
        _fields(body, {"role", "rank", "pairs"}, {"instance", "plan_hash"})
        role, rank, inst = _identity(body)
        name = participant_name(role, rank, inst)
        plan_hash = body.get("plan_hash")
        if plan_hash is not None:
            _str(plan_hash, "plan_hash", 128, HEX_RE)
        pairs = body["pairs"]
        if not isinstance(pairs, list) or len(pairs) > MAX_PAIRS:
            raise _bad(f"pairs must be a list of at most {MAX_PAIRS} [src_rank, dst_instance, dst_rank, hash]")
        got: dict[str, str] = {}
        for p in pairs:
            if not isinstance(p, list) or len(p) != 4:
                raise _bad(f"each pair must be [src_rank, dst_instance, dst_rank, hash], got {_short(p)}")
            s, i, r = (_int(x, "pair rank", 0, MAX_RANK) for x in p[:3])
            h = _str(p[3], "pair hash", 128, HEX_RE)
            if (role == "train" and s != rank) or (role == "infer" and (i, r) != (inst, rank)):
                raise _bad(f"{name} reported pair {[s, i, r]} that it is not an end of")
            key = f"{s},{i},{r}"
            if key in got:
                raise _bad(f"pair {[s, i, r]} given twice")
            got[key] = h
        with self.cond:
            j = self._job(job)
            if name not in j.participants:
                raise HTTPError(409, f"{name} is not registered in job {job}; register first")
            new = {"plan_hash": plan_hash, "pairs": got}
            if j.plan_hashes.get(name) != new:
                j.plan_hashes[name] = new
                self._commit(job, j)
            return {"name": name, "pairs": len(got)}

    def check_plan_hashes(self, job: str) -> dict:
        """Compare each pair's hash as its sender and its receiver computed it."""
        with self.cond:
            j = self._job(job, create=False, allow_aborted=True)
            mismatches, pending, compared = [], [], 0
            seen: set[str] = set()
            for name, ph in sorted(j.plan_hashes.items()):
                for key, h in sorted(ph["pairs"].items()):
                    if key in seen:
                        continue
                    seen.add(key)
                    s, i, r = map(int, key.split(","))
                    train, infer = f"train:{s}", f"infer:{i}:{r}"
                    peer = infer if name == train else train
                    peer_ph = j.plan_hashes.get(peer)
                    pair = [s, i, r]
                    if peer_ph is None:
                        pending.append({"pair": pair, "reported_by": name, "waiting_for": peer})
                        continue
                    compared += 1
                    hashes = {name: h, peer: peer_ph["pairs"].get(key)}
                    if hashes[train] != hashes[infer]:
                        mismatches.append({"pair": pair, "train": train, "train_hash": hashes[train],
                                           "infer": infer, "infer_hash": hashes[infer]})
            plan = {n: ph["plan_hash"] for n, ph in sorted(j.plan_hashes.items()) if ph["plan_hash"]}
            agree = len(set(plan.values())) <= 1
            return {"ok": not mismatches and agree, "complete": not pending, "compared": compared,
                    "posted": len(j.plan_hashes),
                    "mismatches": mismatches, "pending": pending, "plan_hashes": plan, "plan_hashes_agree": agree}

    # -- instances ------------------------------------------------------------------------------
    def join_leave(self, job: str, instance: int, body: dict, join: bool) -> dict:
        _fields(body, set())
        with self.cond:
            j = self._job(job)
            changed = (instance not in j.instances) == join
            if changed:
                (j.instances.add if join else j.instances.discard)(instance)
                j.topology_version += 1
                self._commit(job, j)
            return {"instance": instance, "changed": changed, "version": j.topology_version,
                    "instances": sorted(j.instances)}

    def instances(self, job: str, q: _Query) -> dict:
        after = q.int("after_version", -1, -1)
        timeout = q.timeout()
        with self.cond:
            ready, j = self._wait("instances", job, timeout, lambda j: j.topology_version > after)
            return {"ready": ready, "version": j.topology_version, "instances": sorted(j.instances)}

    # -- steps ----------------------------------------------------------------------------------
    def written(self, job: str, step: int, body: dict) -> dict:
        _fields(body, {"rank"})
        rank = _int(body["rank"], "rank", 0, MAX_RANK)
        with self.cond:
            j = self._job(job)
            if f"train:{rank}" not in j.participants:
                raise HTTPError(409, f"train:{rank} is not registered in job {job}; register first")
            if step < j.written_floor:
                raise HTTPError(410, f"step {step} is older than the steps kept (from {j.written_floor})")
            ranks = j.written.setdefault(step, set())
            if rank not in ranks:
                ranks.add(rank)
                while len(j.written) > STEPS_KEPT:
                    oldest = min(j.written)
                    del j.written[oldest]
                    j.written_floor = oldest + 1
                self._commit(job, j)
            return {"step": step, "ranks": len(j.written.get(step, ()))}

    def wait_written(self, job: str, step: int, q: _Query) -> dict:
        wait_for = q.int("wait_for", None, 1, MAX_PARTICIPANTS)
        timeout = q.timeout()

        def need(j: Job) -> int:  # default: every registered training rank (at least one)
            return wait_for if wait_for is not None else max(1, len(j.train_ranks()))

        with self.cond:
            j = self.jobs.get(job)
            if j is not None and step < j.written_floor:
                raise HTTPError(410, f"step {step} is older than the steps kept (from {j.written_floor})")
            ready, j = self._wait("written", job, timeout, lambda j: len(j.written.get(step, ())) >= need(j))
            return {"ready": ready, "step": step, "wait_for": need(j), "ranks": sorted(j.written.get(step, ()))}

    def held(self, job: str, instance: int, body: dict) -> dict:
        _fields(body, {"step"}, {"reset"})
        step = _int(body["step"], "step")
        reset = _bool(body.get("reset", False), "reset")
        with self.cond:
            j = self._job(job)
            if instance not in j.instances:
                raise HTTPError(409, f"instance {instance} has not joined job {job}; join first")
            prev = j.held.get(instance)
            if prev is not None and step < prev and not reset:
                raise HTTPError(409, f"instance {instance} already holds step {prev}; "
                                     f"step {step} goes back (send reset to allow it)")
            if prev != step:
                j.held[instance] = step
                self._commit(job, j)
            return {"instance": instance, "step": step, "previous": prev}

    def wait_held(self, job: str, q: _Query) -> dict:
        min_step = q.int("min_step", 0)
        listed = q.int_list("instances")
        timeout = q.timeout()

        def which(j: Job) -> list[int]:
            return listed if listed is not None else sorted(j.instances)

        def ready(j: Job) -> bool:
            ids = which(j)
            return bool(ids) and all(j.held.get(i, -1) >= min_step for i in ids)

        with self.cond:
            ok, j = self._wait("held", job, timeout, ready)
            ids = which(j)
            return {"ready": ok, "min_step": min_step, "instances": ids,
                    "held": {str(i): j.held.get(i) for i in ids}}

    # -- rendezvous -----------------------------------------------------------------------------
    def publish(self, job: str, name: str, body: dict) -> dict:
        _fields(body, {"address"}, {"replace"})
        address = _str(body["address"], "address", 512)
        replace = _bool(body.get("replace", False), "replace")
        with self.cond:
            j = self._job(job)
            old = j.rendezvous.get(name)
            if old is not None and old != address and not replace:
                raise HTTPError(409, f"rendezvous {name} already holds {old}; send replace to change it")
            if old is None and len(j.rendezvous) >= MAX_RENDEZVOUS:
                raise HTTPError(409, f"job {job} already has {MAX_RENDEZVOUS} rendezvous names")
            if old != address:
                j.rendezvous[name] = address
                self._commit(job, j)
            return {"name": name, "address": address, "changed": old != address}

    def lookup(self, job: str, name: str, q: _Query) -> dict:
        timeout = q.timeout()
        with self.cond:
            ready, j = self._wait("rendezvous", job, timeout, lambda j: name in j.rendezvous)
            return {"ready": ready, "name": name, "address": j.rendezvous.get(name)}

    # -- metrics --------------------------------------------------------------------------------
    def metrics(self, requests: dict[tuple[str, int], int]) -> str:
        out = ["# HELP weightsync_meta_requests_total HTTP requests by route and status.",
               "# TYPE weightsync_meta_requests_total counter"]
        for (route, status), n in sorted(requests.items()):
            out.append(f'weightsync_meta_requests_total{{route="{route}",status="{status}"}} {n}')
        with self.cond:
            out += ["# HELP weightsync_meta_jobs Jobs held.", "# TYPE weightsync_meta_jobs gauge",
                    f"weightsync_meta_jobs {len(self.jobs)}"]
            out += ["# HELP weightsync_meta_waiting Long-polls waiting now, by route.",
                    "# TYPE weightsync_meta_waiting gauge"]
            out += [f'weightsync_meta_waiting{{route="{r}"}} {n}' for r, n in sorted(self.waiting.items())]
            gauges: dict[str, tuple[str, list[str]]] = {
                "participants": ("Registered participants, by job and role.", []),
                "topology_version": ("Topology version, by job.", []),
                "instances": ("Joined instances, by job.", []),
                "step_written": ("Latest step any training rank wrote, by job.", []),
                "step_complete": ("Latest step every training rank wrote, by job.", []),
                "step_held": ("Latest step an instance fully holds, by job and instance.", []),
                "aborted": ("1 if the job was aborted.", []),
            }
            for job, j in sorted(self.jobs.items()):
                for role in ROLES:
                    n = sum(p["role"] == role for p in j.participants.values())
                    gauges["participants"][1].append(f'{{job="{job}",role="{role}"}} {n}')
                gauges["topology_version"][1].append(f'{{job="{job}"}} {j.topology_version}')
                gauges["instances"][1].append(f'{{job="{job}"}} {len(j.instances)}')
                if j.written:
                    gauges["step_written"][1].append(f'{{job="{job}"}} {max(j.written)}')
                if (c := j.complete_step()) is not None:
                    gauges["step_complete"][1].append(f'{{job="{job}"}} {c}')
                for i, s in sorted(j.held.items()):
                    gauges["step_held"][1].append(f'{{job="{job}",instance="{i}"}} {s}')
                gauges["aborted"][1].append(f'{{job="{job}"}} {int(j.aborted is not None)}')
        for name, (help_, lines) in gauges.items():
            out += [f"# HELP weightsync_meta_{name} {help_}", f"# TYPE weightsync_meta_{name} gauge"]
            out += [f"weightsync_meta_{name}{line}" for line in lines]
        return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# HTTP


def _routes(c: Coordinator) -> list[tuple[str, tuple[str, ...], Callable]]:
    """(method, path template, handler(params, query_string, body)) — the template is also the metrics label."""
    J = ("v1", "jobs", "{job}")
    return [
        ("GET", J, lambda p, q, b: c.summary(p["job"])),
        ("DELETE", J, lambda p, q, b: c.delete(p["job"])),
        ("POST", J + ("abort",), lambda p, q, b: c.abort(p["job"], b)),
        ("POST", J + ("participants",), lambda p, q, b: c.register(p["job"], b)),
        ("GET", J + ("participants",),
         lambda p, q, b: c.participants(p["job"], _Query(q, {"role", "wait_for", "timeout"}))),
        ("POST", J + ("plan-hashes",), lambda p, q, b: c.post_plan_hashes(p["job"], b)),
        ("GET", J + ("plan-hashes", "check"), lambda p, q, b: c.check_plan_hashes(p["job"])),
        ("POST", J + ("instances", "{i}", "join"), lambda p, q, b: c.join_leave(p["job"], p["i"], b, True)),
        ("POST", J + ("instances", "{i}", "leave"), lambda p, q, b: c.join_leave(p["job"], p["i"], b, False)),
        ("GET", J + ("instances",), lambda p, q, b: c.instances(p["job"], _Query(q, {"after_version", "timeout"}))),
        ("POST", J + ("steps", "{S}", "written"), lambda p, q, b: c.written(p["job"], p["S"], b)),
        ("GET", J + ("steps", "{S}", "written"),
         lambda p, q, b: c.wait_written(p["job"], p["S"], _Query(q, {"wait_for", "timeout"}))),
        ("POST", J + ("instances", "{i}", "held"), lambda p, q, b: c.held(p["job"], p["i"], b)),
        ("GET", J + ("held",), lambda p, q, b: c.wait_held(p["job"], _Query(q, {"min_step", "instances", "timeout"}))),
        ("POST", J + ("rendezvous", "{name}"), lambda p, q, b: c.publish(p["job"], p["name"], b)),
        ("GET", J + ("rendezvous", "{name}"), lambda p, q, b: c.lookup(p["job"], p["name"], _Query(q, {"timeout"}))),
    ]


def _match(template: tuple[str, ...], parts: list[str]) -> dict[str, str] | None:
    if len(template) != len(parts):
        return None
    params = {}
    for t, p in zip(template, parts):
        if t.startswith("{"):
            params[t[1:-1]] = p
        elif t != p:
            return None
    return params


def _check_params(params: dict[str, str]) -> dict[str, Any]:
    """Path ids: names match ID_RE, instances and steps are non-negative integers (no percent-decoding)."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        if k in ("i", "S"):
            what = "instance" if k == "i" else "step"
            if not INT_RE.fullmatch(v) or int(v) > MAX_INT:
                raise _bad(f"{what} in the path must be a non-negative integer, got {_short(v)}")
            out[k] = int(v)
        elif not ID_RE.fullmatch(v):
            raise _bad(f"{k} in the path must match {ID_RE.pattern}, got {_short(v)}")
        else:
            out[k] = v
    return out


class _Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive (a step's few requests reuse one connection: no connect, no new thread each);
    every answer, errors included, is JSON or metrics text. A connection whose request body was not read
    (an error before it) is closed, so its bytes can never be taken for the next request."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # the header and body writes of an answer go out at once

    server: "_HTTPServer"
    server_version = f"weightsync-meta/{__version__}"
    default_request_version = "HTTP/1.0"  # answer garbage with a status line, not a bare HTTP/0.9 body
    timeout = 30  # a client that stalls mid-request cannot hold a thread forever
    route = "unparsed"

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - metrics count requests instead
        pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The base class's errors (bad request line, unknown method...) as JSON, and always 4xx for them."""
        if code >= 500:  # only parse failures come here: an unknown method or HTTP version is the client's mistake
            code = HTTPStatus.METHOD_NOT_ALLOWED if code == HTTPStatus.NOT_IMPLEMENTED else HTTPStatus.BAD_REQUEST
        self.close_connection = True
        self._send(code, {"error": message or HTTPStatus(code).phrase})

    def _send(self, status: int, payload: dict | str) -> None:
        if isinstance(payload, str):
            data, ctype = payload.encode(), "text/plain; version=0.0.4; charset=utf-8"
        else:
            data, ctype = json.dumps(payload).encode(), "application/json"
        self.server.count(self.route, status)
        if self.server.coord.closing:  # a kept-alive connection must not outlive this server
            self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _authorized(self) -> bool:
        token = self.server.token
        if token is None:
            return True
        got = self.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode("utf-8", "replace"), f"Bearer {token}".encode())

    def _body(self) -> dict:
        if self.headers.get("Transfer-Encoding"):
            raise HTTPError(411, "send the body with a Content-Length, not a transfer encoding")
        length = self.headers.get("Content-Length")
        if length is None:
            return {}
        if not INT_RE.fullmatch(length.strip()):
            raise _bad(f"bad Content-Length {_short(length)}")
        n = int(length)
        if n > MAX_BODY:
            self.close_connection = True
            if n <= 4 * MAX_BODY:  # read and drop it, so the client can read our 413 instead of a broken pipe
                left = n
                while left > 0 and (chunk := self.rfile.read(min(1 << 16, left))):
                    left -= len(chunk)
            raise HTTPError(413, f"body of {n} bytes is over the {MAX_BODY} byte limit")
        data = self.rfile.read(n)
        if len(data) != n:
            raise _bad(f"body ended after {len(data)} of {n} bytes")
        if not data.strip():
            return {}
        try:
            body = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise _bad(f"body is not valid JSON: {str(e)[:120]}") from None
        if not isinstance(body, dict):
            raise _bad("body must be a JSON object")
        return body

    def _dispatch(self, method: str) -> None:
        self._body_read = self.headers.get("Content-Length", "0").strip() in ("", "0")
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/") if url.path.strip("/") else []
        try:
            if method == "GET" and parts == ["health"]:
                self.route = "GET /health"
                return self._send(200, {"status": "ok", "version": __version__})
            if not self._authorized():
                self.route = "unauthorized"
                raise HTTPError(401, "missing or wrong bearer token")
            if method == "GET" and parts == ["metrics"]:
                self.route = "GET /metrics"
                return self._send(200, self.server.coord.metrics(self.server.requests_snapshot()))
            found = [(m, t, fn, p) for m, t, fn in self.server.routes if (p := _match(t, parts)) is not None]
            if not found:
                self.route = "unmatched"
                raise HTTPError(404, f"no route {_short(url.path)}")
            chosen = [f for f in found if f[0] == method]
            if not chosen:
                self.route = "/" + "/".join(found[0][1])
                raise HTTPError(405, f"{method} is not allowed on {self.route}; use {sorted({f[0] for f in found})}")
            _, template, fn, params = chosen[0]
            self.route = f"{method} /" + "/".join(template)
            params = _check_params(params)
            body = self._body() if method == "POST" else {}
            self._body_read = True
            if self.server.coord.closing:
                raise HTTPError(503, "server stopping; retry")
            self._send(200, fn(params, url.query, body))
        except HTTPError as e:
            if e.status == 413 or e.status == 411 or not self._body_read:
                self.close_connection = True
            self._send(e.status, {"error": str(e), **e.extra})
        except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client went away or stalled
            self.close_connection = True
        except Exception as e:  # a bug: say so, keep serving
            traceback.print_exc(file=sys.stderr)
            self.close_connection = True
            self._send(500, {"error": f"internal error: {type(e).__name__}"})


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True  # restart on the same port right after a crash

    def __init__(self, addr: tuple[str, int], coord: Coordinator, token: str | None):
        if ":" in addr[0]:
            import socket

            self.address_family = socket.AF_INET6
        super().__init__(addr, _Handler)
        self.coord, self.token = coord, token
        self.routes = _routes(coord)
        self._requests: dict[tuple[str, int], int] = {}
        self._req_lock = threading.Lock()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up while we answer is routine, not worth a traceback."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    def count(self, route: str, status: int) -> None:
        with self._req_lock:
            self._requests[(route, status)] = self._requests.get((route, status), 0) + 1

    def requests_snapshot(self) -> dict[tuple[str, int], int]:
        with self._req_lock:
            return dict(self._requests)


class MetaServer:
    """An embeddable MetaServer: ``with MetaServer().start() as s: MetaClient(s.url, "job")...``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 state_path: str | None = None):
        self.host, self.token, self.state_path = host, token, state_path
        self._port = port
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "MetaServer":
        coord = Coordinator(self.state_path)
        self._httpd = _HTTPServer((self.host, self._port), coord, self.token)
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.1,), name="meta-server", daemon=True)
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        assert self._httpd is not None, "start() the server first"
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        """Wake every long-poll with 503 (clients retry elsewhen), stop accepting, free the port."""
        if self._httpd is None:
            return
        self._httpd.coord.close()
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join()
        self._httpd = self._thread = None

    def __enter__(self) -> "MetaServer":
        return self if self._httpd is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(host: str = "127.0.0.1", port: int = 0, token: str | None = None, state_path: str | None = None) -> int:
    """Run until SIGINT or SIGTERM; print the URL first so a launcher can read the chosen port."""
    if host not in ("127.0.0.1", "localhost", "::1") and not token:
        print(f"weightsync meta-server: warning: listening on {host} without a token", file=sys.stderr)
    try:
        server = MetaServer(host, port, token, state_path).start()
    except OSError as e:
        raise WeightSyncError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"weightsync meta-server listening on {server.url}", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The meta-server options, shared by ``weightsync meta-server`` and ``python -m weightsync.meta.server``."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: any free port, printed at start)")
    p.add_argument("--token", default=os.environ.get("WEIGHTSYNC_META_TOKEN"),
                   help="require 'Authorization: Bearer TOKEN' (default: $WEIGHTSYNC_META_TOKEN)")
    p.add_argument("--state", help="persist state to this JSON file and reload it at start")


def run_from_args(args: argparse.Namespace) -> int:
    return serve(args.host, args.port, args.token, args.state)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="weightsync meta-server", description="Run the weightsync MetaServer.")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_from_args(args)
    except WeightSyncError as e:
        print(f"weightsync: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
