"""The MetaServer's state and its rules, without HTTP.

Runs on the server's event loop thread only, so it needs no lock. Every public method validates
first, then mutates; a mutation records the row changes that persist it (:mod:`.store` ops) and
the topics it touched, and calls ``on_change`` — the server then saves the ops (group commit) and
only afterwards wakes the long-polls of those topics, so nobody learns of a change that is not on
disk. Long-polls wait on futures grouped by what they wait for: waiters with the same question
share one check per change, so 1,024 trainers waiting for the same step cost one check, not 1,024.
"""

from __future__ import annotations

import asyncio
import contextvars
import gzip
import json
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable

from weightsync.errors import WeightSyncError
from weightsync.meta.auth import Refusals
from weightsync.meta.mismatch import check_spec_size_async, refusal
from weightsync.meta.proof import Proof
from weightsync.meta.records import Member, Registration, RecordError, digest_of, encode_listing
from weightsync.meta.store import AddWritten, Delete, DropJob, Op, Put, PruneWritten, StoredJob
from weightsync.meta.view import census, concerning, encode_placement, placement_of
from weightsync.meta.validate import (
    MAX_JOBS, MAX_JSON_DEPTH, MAX_LIVENESS_S, MAX_PAIRS, MAX_PARTICIPANTS, MAX_RANK, MAX_RENDEZVOUS, MAX_WAIT_S,
    MIN_LIVENESS_S, ROLES, STEP_STRIDE, STEPS_KEPT, BELL_NAME_PREFIX, HEX_RE, Aborted, HTTPError, Query, bad,
    bell_address, boolean, fields, identity, instance_list, integer, json_depth, model_config, participant_name,
    seconds, short, string,
)

#: how long a ``held`` post for a step no training rank has written yet waits for that ``written``
#: (the two race when a reader's receive ends as the trainers post), before it is refused
HELD_WAITS_FOR_WRITTEN_S = 10.0

#: how often the server looks for members silent past their ``liveness_s`` (at least MIN_LIVENESS_S)
SWEEP_S = 0.25

#: the ``seq`` of the last mutation made in this request's context (0: none), so the server knows
#: whether a dropped save was the request's own
last_mutation: contextvars.ContextVar[int] = contextvars.ContextVar("weightsync_meta_last_mutation", default=0)


@dataclass(frozen=True)
class Encoded:
    """An answer already encoded as JSON (a participants list shared by many waiters), and gzipped once
    when that pays (``gz``: sent to a client that accepts gzip)."""

    body: bytes
    gz: bytes | None = None

    @classmethod
    def compressed(cls, body: bytes) -> "Encoded":
        return cls(body, gzip.compress(body, compresslevel=6, mtime=0) if len(body) > GZIP_ABOVE else None)


#: answers shorter than this are sent as they are
GZIP_ABOVE = 4096


@dataclass
class Job:
    """Everything the server knows about one job."""

    participants: dict[str, Registration] = field(default_factory=dict)  # name -> record
    #: config digest -> the model's config.json: one copy per distinct config, however many registered it
    configs: dict[str, dict] = field(default_factory=dict)
    plan_hashes: dict[str, dict] = field(default_factory=dict)  # name -> {"plan_hash", "pairs": {"s,i,r": h}}
    instances: set[int] = field(default_factory=set)  # the members that are joined now (live)
    #: every instance that ever joined (:class:`~weightsync.meta.records.Member`: joined, left or gone, since
    #: which step, at which topology version, why, its incarnation and heartbeat deadline); kept after it
    #: leaves, so a rejoin is visible
    members: dict[int, Member] = field(default_factory=dict)
    topology_version: int = 0
    written: dict[int, set[int]] = field(default_factory=dict)  # step -> training ranks that wrote it
    written_floor: int = 0  # steps below were pruned
    written_max: int = -1  # latest step any training rank wrote (kept when pruned)
    held: dict[int, int] = field(default_factory=dict)  # instance -> latest fully held step
    rendezvous: dict[str, str] = field(default_factory=dict)
    aborted: str | None = None
    # derived, never stored
    train_set: set[int] = field(default_factory=set)
    role_count: dict[str, int] = field(default_factory=dict)
    #: answers derived from the participants (listings and censuses by role, placements by who asks, the
    #: whole placement they are cut from), made once per change
    answers: dict[Hashable, Any] = field(default_factory=dict)
    proof: Proof = field(default_factory=Proof)  # the plan hashes compared as they come (weightsync.meta.proof)
    held_answers: dict[tuple, Encoded] = field(default_factory=dict)  # encoded wait_held answers, until held moves
    written_answers: dict[tuple, Encoded] = field(default_factory=dict)  # encoded wait_written answers
    #: when each joined member was last heard from (join, alive, held; time.monotonic()), for those with a
    #: ``liveness_s``; not stored: after a restart each gets a whole ``liveness_s`` from the first sweep
    heard: dict[int, float] = field(default_factory=dict)

    def rebuild_counts(self) -> None:
        self.train_set = {p.rank for p in self.participants.values() if p.role == "train"}
        self.role_count = {r: sum(p.role == r for p in self.participants.values()) for r in ROLES}
        self.answers.clear()
        self.proof = Proof.of(self.plan_hashes)
        if self.written and self.written_max < max(self.written):
            self.written_max = max(self.written)

    def train_ranks(self) -> list[int]:
        return sorted(self.train_set)

    def complete_step(self) -> int | None:
        """Latest step written by every registered training rank."""
        ranks = self.train_set
        done = [s for s, got in self.written.items() if ranks and ranks <= got]
        return max(done) if done else None

    def encoded_participants(self, role: str | None, limit: int | None = None) -> Encoded:
        """The ready answer listing ``role``'s participants (all: None), encoded (and gzipped) once per change
        (:func:`weightsync.meta.records.encode_listing`: each profile once, then one row each); ``limit``:
        only the first that many (not kept)."""
        got = None if limit is not None else self.answers.get(role)
        if got is None:
            ps = self.people(role)
            head = json.dumps({"ready": True, "count": len(ps)})[:-1].encode()
            got = Encoded.compressed(head + b", " + encode_listing(ps[:limit]) + b"}")
            if limit is None:
                self.answers[role] = got
        return got

    def people(self, role: str | None) -> list[Registration]:
        """The participants of ``role`` (all: None), in name order."""
        return [p for _, p in sorted(self.participants.items()) if role is None or p.role == role]

    def encoded_census(self, role: str | None) -> Encoded:
        """The census of ``role``'s participants (:func:`weightsync.meta.view.census`), once per change."""
        key = ("census", role)
        got = self.answers.get(key)
        if got is None:
            got = self.answers[key] = Encoded.compressed(json.dumps(census(self.people(role)).to_json()).encode())
        return got

    def encoded_placement(self, instance: int | None, whole: bool) -> Encoded:
        """The placement that concerns a training rank (``instance`` None) or an instance, or the whole
        (:func:`weightsync.meta.view.concerning`), once per change; every training rank gets the same."""
        key = ("placement", None if whole else instance, whole)
        got = self.answers.get(key)
        if got is None:
            if ("whole",) not in self.answers:
                infer = self.people("infer")
                self.answers[("whole",)] = (placement_of(self.people("train"), infer),
                                            next((p.layout.world for p in infer if p.layout), 1),
                                            {p.instance for p in infer})
            placed, infer_world, ids = self.answers[("whole",)]
            if not whole and instance is not None and instance not in ids:  # (nor is a view kept for it)
                raise HTTPError(409, f"instance {instance} has no registered inference participant")
            cut = placed if whole or placed is None else concerning(placed, infer_world, instance)
            got = self.answers[key] = Encoded.compressed(json.dumps(encode_placement(cut)).encode())
        return got


def restore(stored: dict[str, StoredJob]) -> dict[str, Job]:
    """The jobs the store last committed (:meth:`weightsync.meta.store.Store.load`), rebuilt from their rows."""
    jobs: dict[str, Job] = {}
    try:
        for name, rows in stored.items():
            j = jobs[name] = Job()
            for kind, key, value in rows.rows:
                _load_row(j, kind, key, value)
            for step, rank in rows.written:
                j.written.setdefault(step, set()).add(rank)
            j.rebuild_counts()
    except (ValueError, KeyError, TypeError, WeightSyncError) as e:
        raise WeightSyncError(f"the MetaServer's stored state is not valid: {e}") from None
    return jobs


def _load_row(j: Job, kind: str, key: str, v: object) -> None:
    if kind == "participant":
        if isinstance(v, dict) and "engine_config" in v:  # stored before typed registrations
            rec, config = Registration.legacy(v)
            if config:
                j.configs.setdefault(rec.config_digest, config)
        else:
            rec = Registration.from_json(v)
        j.participants[key] = rec
    elif kind == "config":
        j.configs[key] = v
    elif kind == "plan":
        j.plan_hashes[key] = v
    elif kind == "instance":  # a membership record (format 1 stored ``true`` for a joined instance)
        rec = Member.from_json(key, v) if isinstance(v, dict) else (Member(int(key), "joined", 0, 0) if v else None)
        if rec is not None:
            j.members[int(key)] = rec
            if rec.joined:
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


def live_for(j: Job, step: int) -> list[int]:
    """The joined instances a step must reach: those that joined before any training rank wrote it."""
    return sorted(i for i in j.instances if (j.members[i].since if i in j.members else 0) <= step)


class _Group:
    """Waiters asking the same question of one job: one check per change wakes them all."""

    __slots__ = ("ready", "futures")

    def __init__(self, ready: Callable[[Job], bool]):
        self.ready, self.futures = ready, set()


class Coordinator:
    def __init__(self, jobs: dict[str, Job] | None = None):
        self.jobs: dict[str, Job] = jobs or {}
        self.closing = False
        self.refusals = Refusals()  # requests refused for their token, told to their job's waits (server.py)
        self.waiting: dict[str, int] = {}  # route -> long-polls waiting now
        self.seq = 0  # mutations applied to memory so far
        self.ops: list[Op] = []  # their row changes, until the server takes them
        self.touched: set[tuple[str, str]] = set()  # (job, topic) they changed; topic "*": all of the job
        self.on_change: Callable[[], None] = lambda: None
        self._groups: dict[str, dict[str, dict[Hashable, _Group]]] = {}

    # -- helpers --------------------------------------------------------------------------------
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

    def _save(self, job: str, j: Job, topics: tuple[str, ...], ops: list[Op]) -> None:
        """Record a mutation already applied to ``j``; a stopping server takes none (its successor owns the state)."""
        self.jobs[job] = j
        self._record(job, topics, ops)

    def _record(self, job: str, topics: tuple[str, ...], ops: list[Op]) -> None:
        self.ops.extend(ops)
        self.touched.update((job, t) for t in topics)
        self.seq += 1
        last_mutation.set(self.seq)
        self.on_change()

    def _refuse_if_closing(self) -> None:
        if self.closing:
            raise HTTPError(503, "server stopping; retry")

    def take(self) -> tuple[list[Op], set[tuple[str, str]]]:
        """Hand the pending row changes and touched topics to the server (to save, then notify)."""
        ops, touched = self.ops, self.touched
        self.ops, self.touched = [], set()
        return ops, touched

    def notify(self, touched: set[tuple[str, str]]) -> None:
        """Wake the waiters whose question may now have another answer."""
        for job, topic in touched:
            topics = self._groups.get(job)
            if not topics:
                continue
            j = self.jobs.get(job) or Job()
            for t in list(topics) if topic == "*" else [topic]:
                groups = topics.get(t)
                if not groups:
                    continue
                for key, g in list(groups.items()):
                    if topic == "*" or j.aborted is not None:
                        verdict = None  # each waiter looks again (stopping, aborted, deleted)
                    elif g.ready(j):
                        verdict = True  # ready now: its waiters need not ask again
                    else:
                        continue
                    del groups[key]
                    for f in g.futures:
                        if not f.done():
                            f.set_result(verdict)

    def reload(self, jobs: dict[str, Job]) -> None:
        """Replace memory with the last saved state (after a failed save); nobody is woken."""
        self.jobs = jobs
        self.ops, self.touched = [], set()

    def close(self) -> None:
        self.closing = True
        self.notify({(job, "*") for job in self._groups})

    async def _wait(self, route: str, job: str, topic: str, key: Hashable, timeout: float,
                    ready: Callable[[Job], bool], allow_aborted: bool = False) -> tuple[bool, Job]:
        """Until ``ready(job)`` or the timeout; an abort or a stopping server ends the wait."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.waiting[route] = self.waiting.get(route, 0) + 1
        try:
            while True:
                self._refuse_if_closing()
                j = self.jobs.get(job) or Job()
                if j.aborted is not None and not allow_aborted:
                    raise Aborted(job, j.aborted)
                if ready(j):
                    return True, j
                self.refusals.check(job)  # a participant it waits for was refused for its token: say so now
                left = deadline - loop.time()
                if left <= 0:
                    return False, j
                groups = self._groups.setdefault(job, {}).setdefault(topic, {})
                g = groups.get(key)
                if g is None:
                    g = groups[key] = _Group(ready)
                fut = loop.create_future()
                g.futures.add(fut)
                timer = loop.call_later(left, _expire, fut)
                try:
                    if await fut and not self.closing:
                        return True, self.jobs.get(job) or Job()
                finally:
                    timer.cancel()
                    g.futures.discard(fut)
                    if not g.futures and groups.get(key) is g:
                        del groups[key]
                        if not groups:
                            self._groups.get(job, {}).pop(topic, None)
                            if not self._groups.get(job, True):
                                del self._groups[job]
        finally:
            self.waiting[route] -= 1

    # -- jobs -----------------------------------------------------------------------------------
    def summary(self, job: str) -> dict:
        j = self._job(job, create=False, allow_aborted=True)
        return {
            "job": job,
            "aborted": j.aborted,
            "participants": {r: j.role_count.get(r, 0) for r in ROLES},
            "train_ranks": j.train_ranks(),
            "topology_version": j.topology_version,
            "instances": sorted(j.instances),
            "members": {str(i): {**m.to_json(), "held": j.held.get(i)} for i, m in sorted(j.members.items())},
            "held": {str(i): s for i, s in sorted(j.held.items())},
            "latest_written": max(j.written, default=None),
            "complete_step": j.complete_step(),
            "written": {str(s): sorted(r) for s, r in sorted(j.written.items())},
            "rendezvous": sorted(j.rendezvous),
        }

    def delete(self, job: str) -> dict:
        self._refuse_if_closing()
        self._job(job, create=False, allow_aborted=True)
        del self.jobs[job]
        self._record(job, ("*",), [DropJob(job)])
        return {"job": job, "deleted": True}

    def abort(self, job: str, body: dict) -> dict:
        fields(body, {"reason"})
        reason = string(body["reason"], "reason", 1024)
        self._refuse_if_closing()
        j = self._job(job, allow_aborted=True)
        if j.aborted is None:
            self._abort(job, j, reason or "(no reason given)")
        return {"job": job, "aborted": j.aborted}

    def _abort(self, job: str, j: Job, reason: str) -> None:
        j.aborted = reason
        self._save(job, j, ("*",), [Put(job, "job", "aborted", json.dumps(reason))])

    # -- participants ---------------------------------------------------------------------------
    async def register(self, job: str, body: dict) -> dict:
        """A :class:`~weightsync.meta.records.Registration` as JSON, with the model's ``model_config`` beside
        it: the config is kept once per distinct value (by digest), the record names it."""
        identity(body)  # role, rank and instance first: their errors name them
        try:
            rec = Registration.from_json({k: v for k, v in body.items() if k != "model_config"}, posted=True)
        except RecordError as e:
            raise bad(str(e)) from None
        config = body.get("model_config") or {}
        if not isinstance(config, dict):
            raise bad(f"model_config must be an object, got {short(config)}")
        if json_depth(config) > MAX_JSON_DEPTH:  # before the digest (json.dumps of ~1,000 levels raises)
            raise bad(f"model_config nests deeper than {MAX_JSON_DEPTH} levels")
        digest = digest_of(config) if config else ""
        name = rec.name
        self._refuse_if_closing()
        j = self._job(job)
        if config and digest not in j.configs:  # a config already kept was checked when it came
            model_config(config)  # its counts, on the loop (milliseconds); then its spec's size, off it
            try:
                await check_spec_size_async(config)
            except ValueError as e:  # too large, a count the builder chokes on, a MemoryError: refused
                raise bad(str(e)) from None
            self._refuse_if_closing()
            j = self._job(job)  # the job as it is now: it may have changed while the size was computed
        rec = replace(rec, config_digest=digest)
        if rec.spec_digest:
            for other, p in j.participants.items():
                if other != name and p.spec_digest and p.spec_digest != rec.spec_digest:
                    # refused at set-up: abort the job, so the participants already waiting fail now, with
                    # this reason (the first tensor that differs, both sides), instead of timing out
                    reason = await refusal(name, _refusal_view(rec, config), other,
                                           _refusal_view(p, j.configs.get(p.config_digest, {})))
                    self._refuse_if_closing()
                    j = self._job(job, allow_aborted=True)
                    if j.aborted is None:
                        self._abort(job, j, reason)
                    raise HTTPError(409, j.aborted, aborted=j.aborted)
        old = j.participants.get(name)
        if old is None and len(j.participants) >= MAX_PARTICIPANTS:
            raise HTTPError(409, f"job {job} already has {MAX_PARTICIPANTS} participants")
        if old != rec:
            encoded = json.dumps(rec.to_json())  # cannot fail: every field was checked (types, sizes)
            j.participants[name] = rec
            j.answers.clear()
            if old is None:
                j.role_count[rec.role] = j.role_count.get(rec.role, 0) + 1
                if rec.role == "train":
                    j.train_set.add(rec.rank)
            ops: list[Op] = [Put(job, "participant", name, encoded)]
            if digest and digest not in j.configs:
                j.configs[digest] = config
                ops.append(Put(job, "config", digest, json.dumps(config)))
            if old is not None and old.config_digest and old.config_digest != digest and not any(
                    p.config_digest == old.config_digest for p in j.participants.values()):
                del j.configs[old.config_digest]  # nobody registers that config any more
                ops.append(Delete(job, "config", old.config_digest))
            replanned = name in j.plan_hashes
            if replanned:  # a re-registered participant plans again
                j.proof.post(j.plan_hashes, name, None)
                ops.append(Delete(job, "plan", name))
            self._save(job, j, ("participants", "written") + (("plan",) if replanned else ()), ops)
        return {"name": name, "created": old is None, "count": len(j.participants)}

    async def participants(self, job: str, q: Query) -> Encoded:
        role = q.values.get("role")
        if role is not None and role not in ROLES:
            raise bad(f"role must be one of {list(ROLES)}, got {short(role)}")
        wait_for = q.int("wait_for", 0, 0, MAX_PARTICIPANTS)
        limit = q.int("limit", None, 0, MAX_PARTICIPANTS)
        timeout = q.timeout()

        def count(j: Job) -> int:
            return len(j.participants) if role is None else j.role_count.get(role, 0)

        # a plain listing (no wait_for) answers on an aborted job too: a refused registrant reads it
        ready, j = await self._wait("participants", job, "participants", (role, wait_for), timeout,
                                    lambda j: count(j) >= wait_for, allow_aborted=wait_for == 0)
        if not ready:  # the count only: the waiter asks again, and gets the listing once it is complete
            return Encoded(json.dumps({"ready": False, "count": count(j)}).encode())
        return j.encoded_participants(role, limit)

    async def census(self, job: str, q: Query) -> Encoded:
        """What agreement needs of ``role``'s participants once ``wait_for`` registered: each distinct profile
        once, counted (:class:`weightsync.meta.view.Census`); not ready: the count only."""
        role = q.values.get("role")
        if role is not None and role not in ROLES:
            raise bad(f"role must be one of {list(ROLES)}, got {short(role)}")
        wait_for = q.int("wait_for", 0, 0, MAX_PARTICIPANTS)
        timeout = q.timeout()

        def count(j: Job) -> int:
            return len(j.participants) if role is None else j.role_count.get(role, 0)

        # a plain census (no wait_for) answers on an aborted job too: a refused registrant reads who differs
        ready, j = await self._wait("census", job, "participants", ("census", role, wait_for), timeout,
                                    lambda j: count(j) >= wait_for, allow_aborted=wait_for == 0)
        if not ready:
            return Encoded(json.dumps({"ready": False, "count": count(j)}).encode())
        return j.encoded_census(role)

    def placement(self, job: str, q: Query) -> Encoded:
        """Where the ranks a participant's plan compares run (:func:`weightsync.meta.view.concerning`):
        ``instance=I`` an instance's, none a training rank's; ``whole=1``: every rank (a co-located job)."""
        instance = q.int("instance", None, 0, MAX_RANK)
        whole = q.int("whole", 0, 0, 1) == 1
        j = self._job(job, create=False)
        return j.encoded_placement(instance, whole)

    # -- plan hashes ----------------------------------------------------------------------------
    def post_plan_hashes(self, job: str, body: dict) -> dict:
        fields(body, {"role", "rank", "pairs"}, {"instance", "plan_hash"})
        role, rank, inst = identity(body)
        name = participant_name(role, rank, inst)
        plan_hash = body.get("plan_hash")
        if plan_hash is not None:
            string(plan_hash, "plan_hash", 128, HEX_RE)
        pairs = body["pairs"]
        if not isinstance(pairs, list) or len(pairs) > MAX_PAIRS:
            raise bad(f"pairs must be a list of at most {MAX_PAIRS} [src_rank, dst_instance, dst_rank, hash]")
        got: dict[str, str] = {}
        for p in pairs:
            if not isinstance(p, list) or len(p) != 4:
                raise bad(f"each pair must be [src_rank, dst_instance, dst_rank, hash], got {short(p)}")
            s, i, r = (integer(x, "pair rank", 0, MAX_RANK) for x in p[:3])
            h = string(p[3], "pair hash", 128, HEX_RE)
            if (role == "train" and s != rank) or (role == "infer" and (i, r) != (inst, rank)):
                raise bad(f"{name} reported pair {[s, i, r]} that it is not an end of")
            key = f"{s},{i},{r}"
            if key in got:
                raise bad(f"pair {[s, i, r]} given twice")
            got[key] = h
        self._refuse_if_closing()
        j = self._job(job)
        if name not in j.participants:
            raise HTTPError(409, f"{name} is not registered in job {job}; register first")
        new = {"plan_hash": plan_hash, "pairs": got}
        if j.plan_hashes.get(name) != new:
            j.proof.post(j.plan_hashes, name, new)
            self._save(job, j, ("plan",), [Put(job, "plan", name, json.dumps(new))])
        return {"name": name, "pairs": len(got)}

    async def check_plan_hashes(self, job: str, q: Query) -> dict:
        """Each pair's hash as its sender and its receiver computed it, compared as they were posted
        (:class:`weightsync.meta.proof.Proof`): counts, and the first pairs that disagree or wait. ``wait_for=N``:
        a long-poll, answered once N participants posted and no pair waits, or a pair disagrees, or the job
        is aborted (``ready`` says which)."""
        wait_for = q.int("wait_for", None, 0, MAX_PARTICIPANTS)
        timeout = q.timeout()
        j = self._job(job, create=False, allow_aborted=True)
        if wait_for is None:
            return {**j.proof.answer(j.plan_hashes), "aborted": j.aborted}
        ready, j = await self._wait("plan-hashes", job, "plan", ("proof", wait_for), timeout,
                                    lambda j: j.aborted is not None or j.proof.settled(wait_for, j.plan_hashes),
                                    allow_aborted=True)
        return {"ready": ready, **j.proof.answer(j.plan_hashes), "aborted": j.aborted}

    # -- instances ------------------------------------------------------------------------------
    def join_leave(self, job: str, instance: int, body: dict, join: bool, state: str | None = None) -> dict:
        """Join, leave, or (``state="gone"``) drop an instance; each change grows the topology version.

        A joiner must hold every step no training rank had written when it joined (``since``); a member
        that leaves or is dropped stops counting for the steps' default ``held`` waits at once. A joiner
        giving ``liveness_s`` must be heard from (``alive``, ``held``) at least that often, else the server
        marks it gone (:meth:`expire_silent`)."""
        fields(body, set(), {"reason", "incarnation"} | ({"liveness_s"} if join else set()))
        reason = string(body.get("reason", ""), "reason", 1024)
        inc = string(body["incarnation"], "incarnation", 64, HEX_RE) if "incarnation" in body else None
        liveness = (seconds(body["liveness_s"], "liveness_s", MIN_LIVENESS_S, MAX_LIVENESS_S)
                    if "liveness_s" in body else None)
        state = state or ("joined" if join else "left")
        self._refuse_if_closing()
        j = self._job(job)
        current = j.members[instance].incarnation if instance in j.members else None
        if join:  # a new incarnation replaces a joined one (its stale process is fenced off); a retry does not
            changed = instance not in j.instances or (inc is not None and inc != current)
        else:  # a leave or drop of another incarnation than the joined one changes nothing
            changed = instance in j.instances and (inc is None or inc == current)
        if changed:
            self._change_member(job, j, instance, state, reason or None, inc if join else current, liveness)
        if join:
            j.heard[instance] = time.monotonic()
        return {"instance": instance, "changed": changed, "version": j.topology_version,
                "instances": sorted(j.instances)}

    def _change_member(self, job: str, j: Job, instance: int, state: str, reason: str | None,
                       incarnation: str | None, liveness_s: float | None = None) -> None:
        """A member joins, leaves or is dropped: the topology version grows and waiters look again."""
        (j.instances.add if state == "joined" else j.instances.discard)(instance)
        if state != "joined":
            j.heard.pop(instance, None)
        j.topology_version += 1
        j.held_answers.clear()
        rec = j.members[instance] = Member(instance, state, j.written_max + 1, j.topology_version, reason=reason,
                                           incarnation=incarnation, liveness_s=liveness_s)
        row = Put(job, "instance", str(instance), json.dumps(rec.to_json()))
        version = Put(job, "job", "topology_version", str(j.topology_version))
        self._save(job, j, ("instances", "held"), [row, version])

    def alive(self, job: str, instance: int, body: dict) -> dict:
        """A member's heartbeat (``{"incarnation"?}``): heard from now. Nothing is stored; a member that is
        not joined, or another incarnation than the joined one, is told so (409), as ``held`` is."""
        fields(body, set(), {"incarnation"})
        inc = string(body["incarnation"], "incarnation", 64, HEX_RE) if "incarnation" in body else None
        self._refuse_if_closing()
        j = self._job(job, create=False)
        self._check_member(job, j, instance, inc)
        j.heard[instance] = time.monotonic()
        rec = j.members[instance]
        return {"instance": instance, "state": rec.state, "liveness_s": rec.liveness_s}

    def _check_member(self, job: str, j: Job, instance: int, inc: str | None) -> None:
        """409 unless ``instance`` is joined (and, given ``inc``, as that incarnation)."""
        if instance not in j.instances:
            raise HTTPError(409, _not_member(job, j, instance))
        if inc is not None and inc != j.members[instance].incarnation:
            raise HTTPError(409, f"instance {instance} of job {job} rejoined (topology version "
                                 f"{j.members[instance].version}) after this reader was dropped: its reports "
                                 "no longer count; start a new WeightReader to rejoin")

    def expire_silent(self, now: float | None = None) -> list[tuple[str, int]]:
        """Mark gone every joined member with a ``liveness_s`` not heard from for longer than that (the
        server calls this every ``SWEEP_S``); the (job, instance) pairs dropped."""
        if self.closing:
            return []
        now = time.monotonic() if now is None else now
        dropped = []
        for name, j in self.jobs.items():
            if j.aborted is not None:
                continue
            for i in sorted(j.instances):
                rec = j.members.get(i)
                limit = rec.liveness_s if rec is not None else None
                if limit is None:
                    continue
                silent = now - j.heard.setdefault(i, now)  # none heard since a restart: from now
                if silent > limit:
                    reason = (f"no heartbeat for {silent:.1f} s, over its liveness_s of {limit:g} s: its reader's "
                              "process died, hangs or lost the network")
                    self._change_member(name, j, i, "gone", reason, rec.incarnation, limit)
                    dropped.append((name, i))
        return dropped

    async def instances(self, job: str, q: Query) -> dict:
        after = q.int("after_version", -1, -1)
        timeout = q.timeout()
        ready, j = await self._wait("instances", job, "instances", after, timeout, lambda j: j.topology_version > after)
        return {"ready": ready, "version": j.topology_version, "instances": sorted(j.instances)}

    # -- steps ----------------------------------------------------------------------------------
    def written(self, job: str, step: int, body: dict) -> dict:
        """``{"rank": R}`` (one training rank) or ``{"ranks": [R, ...]}`` (a trainer group's representative
        speaking for every rank of its group: one request a step for the group, not one a rank)."""
        fields(body, set(), {"rank", "ranks"})
        if ("rank" in body) == ("ranks" in body):
            raise bad('give one of "rank" (a training rank) or "ranks" (a list of training ranks)')
        if "rank" in body:
            ranks = [integer(body["rank"], "rank", 0, MAX_RANK)]
        else:
            listed = body["ranks"]
            if not isinstance(listed, list) or not 1 <= len(listed) <= MAX_PARTICIPANTS:
                raise bad(f"ranks must be a list of 1 to {MAX_PARTICIPANTS} training ranks, got {short(listed)}")
            ranks = sorted({integer(r, "rank", 0, MAX_RANK) for r in listed})
            if len(ranks) != len(listed):
                raise bad(f"ranks lists a rank twice: {short(listed)}")
        self._refuse_if_closing()
        j = self._job(job)
        unknown = [r for r in ranks if r not in j.train_set]
        if unknown:
            raise HTTPError(409, f"train:{unknown[0]} is not registered in job {job}"
                                 f"{f' (nor {len(unknown) - 1} more of the ranks given)' if len(unknown) > 1 else ''}"
                                 "; register first")
        if step < j.written_floor:
            raise HTTPError(410, f"step {step} is older than the steps kept (from {j.written_floor})")
        if step not in j.written:
            if step > j.written_max + STEP_STRIDE:
                raise HTTPError(409, f"step {step} jumps more than {STEP_STRIDE} past the latest step written "
                                     f"({j.written_max}); number steps as they come")
            if len(j.written) >= STEPS_KEPT and step < min(j.written):
                raise HTTPError(410, f"step {step} is older than every one of the {STEPS_KEPT} steps kept "
                                     f"(from {min(j.written)}); it would be dropped at once")
            if len(j.written) >= STEPS_KEPT:
                self._refuse_pushing_out(job, j, step, ranks)
        got = j.written.get(step, set())
        new = [r for r in ranks if r not in got]
        if new:
            ops: list[Op] = [AddWritten(job, step, r) for r in new]
            j.written.setdefault(step, set()).update(new)
            if step > j.written_max:
                j.written_max = step
                ops.append(Put(job, "job", "written_max", str(step)))
            if len(j.written) > STEPS_KEPT:
                while len(j.written) > STEPS_KEPT:
                    oldest = min(j.written)
                    del j.written[oldest]
                    j.written_floor = oldest + 1
                ops += [PruneWritten(job, j.written_floor), Put(job, "job", "written_floor", str(j.written_floor))]
            self._save(job, j, ("written",), ops)
        return {"step": step, "ranks": len(j.written[step])}

    def _refuse_pushing_out(self, job: str, j: Job, step: int, ranks: list[int]) -> None:
        """409 when a new ``step`` would push out of the window the latest step of a rank that is not
        posting it: no rank runs more than STEPS_KEPT steps ahead of the slowest, so the slower one's next
        step is never 410 (before, 70 posts each STEP_STRIDE ahead did that). A rank that wrote nothing
        still kept (a late joiner) holds nobody back."""
        oldest = min(j.written)
        later: set[int] = set().union(*(got for s, got in j.written.items() if s != oldest))
        behind = sorted(j.written[oldest] - later - set(ranks))
        if behind:
            raise HTTPError(409, f"step {step} would push step {oldest} out of the {STEPS_KEPT} steps kept, but "
                                 f"train:{behind[0]}{f' (and {len(behind) - 1} more)' if len(behind) > 1 else ''} "
                                 f"has written only up to step {oldest}: a training rank may run at most "
                                 f"{STEPS_KEPT} steps ahead of the slowest, and one post at most {STEP_STRIDE} "
                                 f"past the latest step ({j.written_max}); wait for the slower ranks")

    async def wait_written(self, job: str, step: int, q: Query) -> dict:
        wait_for = q.int("wait_for", None, 1, MAX_PARTICIPANTS)
        timeout = q.timeout()

        def need(j: Job) -> int:  # default: every registered training rank (at least one)
            return wait_for if wait_for is not None else max(1, len(j.train_set))

        def check(j: Job) -> bool:
            if step < j.written_floor:
                raise HTTPError(410, f"step {step} is older than the steps kept (from {j.written_floor})")
            return len(j.written.get(step, ())) >= need(j)

        ready, j = await self._wait("written", job, "written", (step, wait_for), timeout, _safe(check))
        check(j)
        ranks = j.written.get(step, ())
        key = (ready, step, need(j), len(ranks))  # a step's set only grows: its size says which it is
        cached = j.written_answers.get(key)
        if cached is None:  # every instance gets the same answer: the 1,024 ranks sorted and encoded once
            if len(j.written_answers) >= 1024:
                j.written_answers.clear()
            cached = j.written_answers[key] = Encoded(json.dumps(
                {"ready": ready, "step": step, "wait_for": key[2], "ranks": sorted(ranks)}).encode())
        return cached

    async def held(self, job: str, instance: int, body: dict) -> dict:
        fields(body, {"step"}, {"reset", "incarnation"})
        step = integer(body["step"], "step")
        reset = boolean(body.get("reset", False), "reset")
        inc = string(body["incarnation"], "incarnation", 64, HEX_RE) if "incarnation" in body else None
        j = self._job(job)
        self._check_member(job, j, instance, inc)
        j.heard[instance] = time.monotonic()
        if step > j.written_max:  # its `written` may be on its way: the receive and the post race
            ok, _ = await self._wait("held-needs-written", job, "written", ("max", step), HELD_WAITS_FOR_WRITTEN_S,
                                     lambda j: j.written_max >= step)
            if not ok:
                raise HTTPError(409, f"instance {instance} reports step {step} held, but no training rank of job "
                                     f"{job} has written it (latest written: {j.written_max})")
            j = self._job(job)
            if instance not in j.instances:
                raise HTTPError(409, _not_member(job, j, instance))
        self._refuse_if_closing()
        prev = j.held.get(instance)
        if prev is not None and step < prev and not reset:
            raise HTTPError(409, f"instance {instance} already holds step {prev}; "
                                 f"step {step} goes back (send reset to allow it)")
        if j.written_floor <= step and step not in j.written:  # below the floor: its record is gone, accepted
            raise HTTPError(409, f"instance {instance} reports step {step} held, but no training rank of job {job} "
                                 f"wrote step {step} (steps written: {_steps(j)}); report only a step received")
        if prev != step:
            j.held[instance] = step
            j.held_answers.clear()
            self._save(job, j, ("held",), [Put(job, "held", str(instance), str(step))])
        return {"instance": instance, "step": step, "previous": prev}

    async def written_held(self, job: str, step: int, body: dict) -> dict | Encoded:
        """:meth:`written`; given ``"held": {"instances"?: "0,1,..", "timeout": S}``, then the wait until the
        step is held, answered as ``GET .../held?min_step=STEP&instances=..&timeout=S`` answers: a training
        rank's two requests of a sync step (announce it, wait for it) in one, so a step of per-rank signals
        costs the server one request a rank, not two."""
        held = body.get("held")
        if held is None:
            return self.written(job, step, body)
        if not isinstance(held, dict):
            raise bad(f'held must be an object {{"instances"?, "timeout"}}, got {short(held)}')
        fields(held, {"timeout"}, {"instances"})
        timeout = seconds(held["timeout"], "held.timeout", 0, MAX_WAIT_S)
        listed = None if held.get("instances") is None else instance_list(held["instances"], "held.instances")
        self.written(job, step, {k: v for k, v in body.items() if k != "held"})
        return await self._wait_held(job, step, listed, timeout)

    async def wait_held(self, job: str, q: Query) -> Encoded:
        return await self._wait_held(job, q.int("min_step", 0), q.int_list("instances"), q.timeout())

    async def _wait_held(self, job: str, min_step: int, listed: list[int] | None, timeout: float) -> Encoded:
        """Until every listed instance (default: the live members ``min_step`` must reach) holds ``min_step``."""

        def which(j: Job) -> list[int]:  # default: the live members this step must reach
            return listed if listed is not None else live_for(j, min_step)

        def ready(j: Job) -> bool:
            ids = which(j)
            if not ids:  # nobody to wait for once instances have come (and gone, or joined after the step)
                return listed is None and bool(j.members)
            return all(j.held.get(i, -1) >= min_step for i in ids)

        key = (min_step, None if listed is None else tuple(listed))
        ok, j = await self._wait("held", job, "held", key, timeout, ready)
        cached = j.held_answers.get((ok, key))
        if cached is None:  # 1,024 trainers get the same answer: encode it once
            if len(j.held_answers) >= 1024:
                j.held_answers.clear()
            ids = which(j)
            cached = j.held_answers[(ok, key)] = Encoded(json.dumps(
                {"ready": ok, "min_step": min_step, "instances": ids, "held": {str(i): j.held.get(i) for i in ids}}
            ).encode())
        return cached

    # -- rendezvous -----------------------------------------------------------------------------
    def publish(self, job: str, name: str, body: dict) -> dict:
        fields(body, {"address"}, {"replace"})
        address = string(body["address"], "address", 512)
        if name.startswith(BELL_NAME_PREFIX):  # its peers open and map the file it names
            bell_address(address)
        replace = boolean(body.get("replace", False), "replace")
        self._refuse_if_closing()
        j = self._job(job)
        old = j.rendezvous.get(name)
        if old is not None and old != address and not replace:
            raise HTTPError(409, f"rendezvous {name} already holds {old}; send replace to change it")
        if old is None and len(j.rendezvous) >= MAX_RENDEZVOUS:
            raise HTTPError(409, f"job {job} already has {MAX_RENDEZVOUS} rendezvous names")
        if old != address:
            j.rendezvous[name] = address
            self._save(job, j, (f"rendezvous:{name}",), [Put(job, "rendezvous", name, json.dumps(address))])
        return {"name": name, "address": address, "changed": old != address}

    async def lookup(self, job: str, name: str, q: Query) -> dict:
        timeout = q.timeout()
        ready, j = await self._wait("rendezvous", job, f"rendezvous:{name}", None, timeout,
                                    lambda j: name in j.rendezvous)
        return {"ready": ready, "name": name, "address": j.rendezvous.get(name)}

    # -- metrics --------------------------------------------------------------------------------
    def metrics(self, requests: dict[tuple[str, int], int], sent: dict[str, int] | None = None) -> str:
        out = ["# HELP weightsync_meta_requests_total HTTP requests by route and status.",
               "# TYPE weightsync_meta_requests_total counter"]
        for (route, status), n in sorted(requests.items()):
            out.append(f'weightsync_meta_requests_total{{route="{route}",status="{status}"}} {n}')
        out += ["# HELP weightsync_meta_answer_bytes_total Answer body bytes sent (gzipped where they were), by route.",
                "# TYPE weightsync_meta_answer_bytes_total counter"]
        out += [f'weightsync_meta_answer_bytes_total{{route="{route}"}} {n}'
                for route, n in sorted((sent or {}).items())]
        out += ["# HELP weightsync_meta_jobs Jobs held.", "# TYPE weightsync_meta_jobs gauge",
                f"weightsync_meta_jobs {len(self.jobs)}"]
        out += ["# HELP weightsync_meta_waiting Long-polls waiting now, by route.",
                "# TYPE weightsync_meta_waiting gauge"]
        out += [f'weightsync_meta_waiting{{route="{r}"}} {n}' for r, n in sorted(self.waiting.items())]
        gauges: dict[str, tuple[str, list[str]]] = {
            "participants": ("Registered participants, by job and role.", []),
            "topology_version": ("Topology version, by job.", []),
            "instances": ("Joined instances, by job.", []),
            "member": ("1 for each instance's membership state (joined, left, gone), by job and instance.", []),
            "step_written": ("Latest step any training rank wrote, by job.", []),
            "step_complete": ("Latest step every training rank wrote, by job.", []),
            "step_held": ("Latest step an instance fully holds, by job and instance.", []),
            "aborted": ("1 if the job was aborted.", []),
        }
        for job, j in sorted(self.jobs.items()):
            for role in ROLES:
                gauges["participants"][1].append(f'{{job="{job}",role="{role}"}} {j.role_count.get(role, 0)}')
            gauges["topology_version"][1].append(f'{{job="{job}"}} {j.topology_version}')
            gauges["instances"][1].append(f'{{job="{job}"}} {len(j.instances)}')
            for i, m in sorted(j.members.items()):
                gauges["member"][1].append(f'{{job="{job}",instance="{i}",state="{m.state}"}} 1')
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


def _steps(j: Job) -> str:
    """The steps a job keeps, in words (a range when they run without gaps)."""
    if not j.written:
        return "none"
    lo, hi = min(j.written), max(j.written)
    if hi - lo + 1 == len(j.written):
        return f"{lo}..{hi}" if hi > lo else str(lo)
    kept = sorted(j.written)
    return ", ".join(map(str, kept[:3])) + (f", ... {kept[-1]}" if len(kept) > 3 else "")


def _refusal_view(rec: Registration, config: dict) -> dict:
    """What :func:`weightsync.meta.mismatch.refusal` reads of a participant."""
    return {"spec_digest": rec.spec_digest, "model_config": config, "model": rec.model}


def _not_member(job: str, j: Job, instance: int) -> str:
    m = j.members.get(instance)
    if m is None:
        return f"instance {instance} has not joined job {job}; join first"
    why = f" ({m.reason})" if m.reason else ""
    did = "left" if m.state == "left" else "was dropped (gone)"
    return (f"instance {instance} is no member of job {job}: it {did}{why} at topology version "
            f"{m.version}; join again (a new WeightReader under its id rejoins)")


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _safe(check: Callable[[Job], bool]) -> Callable[[Job], bool]:
    """A readiness check that raises (410 for a pruned step) wakes its waiter, which then raises it."""

    def ready(j: Job) -> bool:
        try:
            return check(j)
        except HTTPError:
            return True

    return ready

