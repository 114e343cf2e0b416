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
from dataclasses import dataclass

from weightsync.meta.validate import ID_RE

__all__ = ["JOB_TOKEN_PREFIX", "Verdict", "check", "job_token"]

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
