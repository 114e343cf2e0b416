"""Who may call which MetaServer route: the server's token is the admin's, each job has its own.

Before this, one token opened every job: a participant of job A could read job B, drop its instances,
register as its ranks, abort and delete it. Now the server's token is an admin credential,
never handed to participants, and each job's token is derived from it::

    wsjob:<job>:<hex HMAC-SHA256(admin token, "weightsync job token v1\\0" + job)>

(``weightsync job-token --job JOB`` prints it, the admin token in ``$WEIGHTSYNC_META_TOKEN`` or a
``--token-file``; :func:`job_token` computes it). The server keeps no table of tokens: it recomputes the
MAC of the job named in the token and compares in constant time. A job token opens the routes under
``/v1/jobs/<its job>/`` only (another job's routes and ``/metrics`` answer 403, naming both jobs); a
missing, malformed or wrong token answers 401; the admin token opens everything. ``/health`` needs no
token. The job name inside the token is not secret; the MAC is, and it cannot be computed without the
admin token. The server checks the token once a request's headers are in, before it reads any body.

The admin token is read from ``$WEIGHTSYNC_META_TOKEN`` or ``--token-file PATH`` (:func:`admin_token`):
a ``--token`` on a command line is readable by every local user in ``/proc/PID/cmdline`` and ``ps``, so
it still works but is warned about.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass

from weightsync.errors import WeightSyncError
from weightsync.meta.validate import ID_RE, MAX_JOBS, HTTPError

__all__ = ["JOB_TOKEN_PREFIX", "REFUSAL_KEPT_S", "TOKEN_ENV", "Refusal", "Refusals", "Verdict", "add_token_arguments",
           "admin_token", "check", "job_token"]

log = logging.getLogger("weightsync.meta.auth")

#: where the admin token is read from by default (the environment is the owner's only: /proc/PID/environ is 0400)
TOKEN_ENV = "WEIGHTSYNC_META_TOKEN"

#: how long a refused request is told to its job's waits (unless the refused participant registers since)
REFUSAL_KEPT_S = 60.0

JOB_TOKEN_PREFIX = "wsjob:"
_DOMAIN = b"weightsync job token v1\0"  # separates these MACs from any other use of the admin token
#: a job token as :func:`job_token` writes it (whichever admin token made its MAC): the job and 64 hex digits
_JOB_TOKEN_RE = re.compile(r"wsjob:([A-Za-z0-9_.-]{1,128}):[0-9a-f]{64}")


def _mac(admin_token: str, job: str) -> str:
    return hmac.new(admin_token.encode("utf-8"), _DOMAIN + job.encode("utf-8"), hashlib.sha256).hexdigest()


def job_token(admin_token: str, job: str) -> str:
    """The token that opens job ``job``'s routes only, derived from the server's (admin) token."""
    if not admin_token:
        raise ValueError("the admin token is empty: a job token is derived from the MetaServer's admin token")
    if not isinstance(job, str) or not ID_RE.fullmatch(job):
        raise ValueError(f"job ids match {ID_RE.pattern}, got {job!r}")
    return f"{JOB_TOKEN_PREFIX}{job}:{_mac(admin_token, job)}"


@dataclass(frozen=True)
class Verdict:
    """What a request's ``Authorization`` header opens: ``status`` 200 (go on), 401 or 403, and why."""

    status: int
    message: str = ""
    job: str | None = None  # the job a valid job token belongs to
    #: the job a well-formed job token names, whether or not its MAC is this server's: a 401 of such a token
    #: on its own job's route is a participant of that job started with a wrong admin token (:class:`Refusals`)
    claims: str | None = None

    def tells(self, path_job: str | None) -> bool:
        """Whether this refusal is told to ``path_job``'s waits: only a token of that job's own format with a
        MAC not made from this server's token. A request with no token, a malformed one, the wrong admin
        token or another job's token is refused (401, 403) and changes nothing in any job: before, any of
        them stopped the job named in its path for a minute."""
        return self.status == 401 and path_job is not None and self.claims == path_job


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
        well_formed = _JOB_TOKEN_RE.fullmatch(given)
        return Verdict(401, "missing or wrong bearer token (a job token not made from this server's token)",
                       claims=well_formed.group(1) if well_formed else None)
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
                f"participant of the job its token (weightsync job-token --job {self.job}, the admin token in "
                f"${TOKEN_ENV}) and start it again")


class Refusals:
    """The latest refusal per job (at most MAX_JOBS jobs, the oldest forgotten first), for REFUSAL_KEPT_S.

    Only a request bearing a well-formed token of the job's own format is recorded (:meth:`Verdict.tells`);
    one without a token, with a malformed one or with another job's is refused and changes nothing. Such a
    token is easy to write without the admin token, so anyone who reaches the port and knows a job's id can
    still make that job's waits that are not ready fail this way (no state changes): keep the MetaServer on
    a network only the job's hosts reach."""

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


# -- the admin token on the command line --------------------------------------------------------------


def add_token_arguments(p: argparse.ArgumentParser) -> None:
    """``--token-file PATH`` and ``--token`` (kept, warned about), for every command that takes the admin token."""
    p.add_argument("--token-file", metavar="PATH",
                   help=f"read the admin token from this file (its first line; keep it 0600). Default: "
                        f"${TOKEN_ENV}")
    p.add_argument("--token", help=f"the admin token itself: readable by every local user in /proc/PID/cmdline and "
                                   f"ps, so give ${TOKEN_ENV} or --token-file instead (kept working, with a warning)")


def admin_token(args: argparse.Namespace) -> str | None:
    """The admin token a command was given: ``--token-file``, else ``--token`` (warned about: any local user
    reads a command line), else ``$WEIGHTSYNC_META_TOKEN``; None when none. A token file that cannot be read
    or holds no token is an error naming it."""
    path, given = getattr(args, "token_file", None), getattr(args, "token", None)
    if path is not None and given is not None:
        raise WeightSyncError("give the admin token once: --token-file or --token, not both")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.readline().strip()
        except OSError as e:
            raise WeightSyncError(f"cannot read the admin token file {path}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise WeightSyncError(f"the admin token file {path} is not UTF-8 text") from None
        if not token:
            raise WeightSyncError(f"the admin token file {path} holds no token (its first line is empty)")
        return token
    if given is not None:
        log.warning("warning: --token puts the admin token on the command line, where every local user reads it "
                    "(/proc/PID/cmdline, ps); give it in $%s or a --token-file (0600) instead", TOKEN_ENV)
        return given
    return os.environ.get(TOKEN_ENV)
