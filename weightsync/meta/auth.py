"""Who may call which MetaServer route: the server's token is the admin's, each job has its own.

Before this, one token opened every job: a participant of job A could read job B, drop its instances,
register as its ranks, abort and delete it. Now the server's token (``--token``) is an admin credential,
never handed to participants, and each job's token is derived from it::

    wsjob:<job>:<hex HMAC-SHA256(admin token, "weightsync job token v1\\0" + job)>

(``weightsync job-token --token ADMIN --job JOB`` prints it; :func:`job_token` computes it). The server
keeps no table of tokens: it recomputes the MAC of the job named in the token and compares in constant
time. A job token opens the routes under ``/v1/jobs/<its job>/`` only (another job's routes and
``/metrics`` answer 403, naming both jobs); a missing, malformed or wrong token answers 401; the admin
token opens everything. ``/health`` needs no token. The job name inside the token is not secret; the MAC
is, and it cannot be computed without the admin token.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import OrderedDict
from dataclasses import dataclass

from weightsync.meta.validate import ID_RE, MAX_JOBS, HTTPError

__all__ = ["JOB_TOKEN_PREFIX", "REFUSAL_KEPT_S", "Refusal", "Refusals", "Verdict", "check", "job_token"]

#: how long a refused request is told to its job's waits (unless the refused participant registers since)
REFUSAL_KEPT_S = 60.0

JOB_TOKEN_PREFIX = "wsjob:"
_DOMAIN = b"weightsync job token v1\0"  # separates these MACs from any other use of the admin token


def _mac(admin_token: str, job: str) -> str:
    return hmac.new(admin_token.encode("utf-8"), _DOMAIN + job.encode("utf-8"), hashlib.sha256).hexdigest()


def job_token(admin_token: str, job: str) -> str:
    """The token that opens job ``job``'s routes only, derived from the server's (admin) token."""
    if not admin_token:
        raise ValueError("the admin token is empty: a job token is derived from the MetaServer's --token")
    if not isinstance(job, str) or not ID_RE.fullmatch(job):
        raise ValueError(f"job ids match {ID_RE.pattern}, got {job!r}")
    return f"{JOB_TOKEN_PREFIX}{job}:{_mac(admin_token, job)}"


@dataclass(frozen=True)
class Verdict:
    """What a request's ``Authorization`` header opens: ``status`` 200 (go on), 401 or 403, and why."""

    status: int
    message: str = ""
    job: str | None = None  # the job a valid job token belongs to


OK = Verdict(200)


def check(admin_token: str, header: str, path_job: str | None) -> Verdict:
    """Whether ``Authorization: header`` may call a route of ``path_job`` (None: a route of no job,
    such as ``/metrics``, or a path that matches no route). Every comparison is constant-time."""
    given = header[7:] if header[:7].lower() == "bearer " else None
    expected_admin = f"Bearer {admin_token}".encode("utf-8")
    if hmac.compare_digest(header.encode("utf-8", "replace"), expected_admin):
        return OK
    if given is None or not given.startswith(JOB_TOKEN_PREFIX):
        return Verdict(401, "missing or wrong bearer token")
    job, _, mac = given[len(JOB_TOKEN_PREFIX):].rpartition(":")
    if not ID_RE.fullmatch(job) or not hmac.compare_digest(mac.encode("utf-8", "replace"),
                                                          _mac(admin_token, job).encode()):
        return Verdict(401, "missing or wrong bearer token (a job token not made from this server's token)")
    if path_job != job:
        where = f"job {path_job}" if path_job is not None else "this route (the admin token's only)"
        return Verdict(403, f"this token is job {job}'s: it opens /v1/jobs/{job}/ only, not {where}", job)
    return Verdict(200, job=job)


@dataclass(frozen=True)
class Refusal:
    """A request for a job's route refused for its token: its job is told, so the participants waiting for
    the refused one fail within seconds naming it, instead of at their timeout with "not ready"."""

    job: str
    who: str | None  # the participant (``train:0``) when the request said (a registration), else None
    route: str  # e.g. "POST /v1/jobs/j/participants"
    status: int  # 401 or 403
    why: str
    at: float  # time.monotonic()

    def message(self, now: float) -> str:
        whom = self.who or "a participant"
        return (f"the MetaServer refused {whom} of job {self.job} {now - self.at:.1f} s ago ({self.route}: "
                f"{self.status} {self.why}): it was started with a wrong token and will not join; give every "
                f"participant of the job its token (weightsync job-token --token ADMIN --job {self.job}) and "
                f"start it again")


class Refusals:
    """The latest refusal per job (at most MAX_JOBS jobs, the oldest forgotten first), for REFUSAL_KEPT_S.

    Anyone who reaches the port and knows a job's id can make that job's waits that are not ready fail
    this way (no state changes): keep the MetaServer on a network only the job's hosts reach."""

    def __init__(self) -> None:
        self._by_job: OrderedDict[str, Refusal] = OrderedDict()

    def record(self, refusal: Refusal) -> None:
        self._by_job.pop(refusal.job, None)
        self._by_job[refusal.job] = refusal
        while len(self._by_job) > MAX_JOBS:
            self._by_job.popitem(last=False)

    def registered(self, job: str, who: str) -> None:
        """``who`` registered with a good token: a refusal of it is stale (it was restarted with the right one)."""
        r = self._by_job.get(job)
        if r is not None and r.who == who:
            del self._by_job[job]

    def check(self, job: str, now: float | None = None) -> None:
        """409 naming the refused participant, when one of ``job`` was refused within REFUSAL_KEPT_S."""
        r = self._by_job.get(job)
        if r is None:
            return
        now = time.monotonic() if now is None else now
        if now - r.at > REFUSAL_KEPT_S:
            del self._by_job[job]
            return
        raise HTTPError(409, r.message(now), refused=r.who or r.route)
