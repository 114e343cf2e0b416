"""MetaClient: one method per MetaServer route, over http.client keep-alive connections (no extra dependency).

Every call has a deadline (``timeout`` seconds from the call) and returns or raises within it plus
``DEADLINE_MARGIN_S``, whatever the server does (hung, stopped, slow): the socket's timeout is what
is left of the deadline plus that margin, and no attempt starts after the deadline. Connection
errors and 503 answers (server down, restarting or stopping) are retried with backoff until that
deadline, which is safe because every server mutation is idempotent. Long-polls are sent in slices
of at most ``POLL_SLICE_S`` seconds (never past the deadline) and repeated until they are ready or
the deadline passes, so a server restart in the middle of a wait costs one slice at most.
"""

from __future__ import annotations

import gzip
import http.client
import json
import random
import socket
import threading
import time
import urllib.parse
from typing import Any, Iterable, Mapping

from weightsync.errors import MetaAborted, MetaError, MetaTimeout, MetaUnavailable  # noqa: F401 - raised here, imported from here by callers
from weightsync.meta.records import Member, Registration, decode_listing, post_body  # noqa: F401 - Member: imported from here by callers
from weightsync.meta.view import Census, decode_placement
from weightsync.plan.topology import Placement

POLL_SLICE_S = 25.0  # one long-poll request; well under the server's 300 s cap and common proxy timeouts
DEADLINE_MARGIN_S = 0.5  # a call returns within its timeout plus this (the last answer's way back)
BACKOFF_START_S, BACKOFF_MAX_S = 0.05, 1.0


_RETRY = (http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError, OSError)
_TIMEOUTS = (socket.timeout, TimeoutError)


class _Connection(http.client.HTTPConnection):
    """No Nagle: a request's header and body writes must not wait for the server's delayed ACK (40 ms)."""

    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class MetaClient:
    """Talks to one job on one MetaServer."""

    def __init__(self, url: str, job: str, token: str | None = None, timeout: float = 30.0):
        if token is not None and not token:
            raise ValueError("the MetaServer token is empty: pass None for a server without a token")
        self.url, self.job, self.token, self.timeout = url.rstrip("/"), job, token, timeout
        self._job_path = f"/v1/jobs/{urllib.parse.quote(job, safe='')}"
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"MetaServer url must be http://host:port, got {url!r}")
        self._host, self._port, self._prefix = parts.hostname, parts.port or 80, parts.path.rstrip("/")
        self._local = threading.local()  # one keep-alive connection per thread using this client

    # -- plumbing -------------------------------------------------------------------------------
    def _connection(self, socket_s: float) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection (reused: no connect per request) and whether it was reused."""
        conn = getattr(self._local, "conn", None)
        reused = conn is not None
        if conn is None:
            conn = self._local.conn = _Connection(self._host, self._port, timeout=socket_s)
        conn.timeout = socket_s
        if conn.sock is not None:
            try:
                conn.sock.settimeout(socket_s)
            except OSError:  # closed underneath: start over on a new connection
                self._drop_connection()
                return self._connection(socket_s)
        return conn, reused

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def _request(self, method: str, path: str, body: Mapping | None = None, query: Mapping | None = None,
                 deadline: float | None = None) -> Any:
        """One request, retried on connection errors and 503 until ``deadline``; 4xx raises MetaError."""
        deadline = deadline if deadline is not None else time.monotonic() + self.timeout
        target = self._prefix + path
        if query:
            target += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {"Accept-Encoding": "gzip"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        delay = BACKOFF_START_S
        while True:  # at least one attempt, even with a deadline already past
            socket_s = max(0.05, deadline + DEADLINE_MARGIN_S - time.monotonic())
            conn, reused = self._connection(socket_s)
            try:
                conn.request(method, target, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                if resp.will_close:
                    self._drop_connection()
                if resp.status < 400:
                    ctype = resp.getheader("Content-Type", "")
                    if resp.getheader("Content-Encoding") == "gzip":  # a listing, compressed once at the server
                        raw = gzip.decompress(raw)
                    return json.loads(raw) if ctype.startswith("application/json") else raw.decode()
                msg, aborted = _error_message(resp.status, resp.reason, raw)
                if resp.status != 503:
                    kind = MetaAborted if aborted else MetaError
                    raise kind(f"{method} {path}: {msg}", resp.status, reason=msg) from None
                last = f"503 {msg}"
                self._drop_connection()  # a stopping server: the retry must reach whichever server listens next
            except _RETRY as e:
                self._drop_connection()
                if isinstance(e, _TIMEOUTS):  # the socket's timeout is the deadline's: no time is left
                    raise MetaUnavailable(f"MetaServer {self.url} did not answer {method} {path} within the "
                                          f"deadline: {type(e).__name__}: {e}") from None
                if reused and time.monotonic() < deadline:
                    continue  # the server closed an idle kept-alive connection: try again at once, on a new one
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise MetaUnavailable(f"MetaServer {self.url} unreachable until the deadline: {last}")
            time.sleep(max(0.0, min(delay * (0.5 + random.random()), deadline - time.monotonic())))
            delay = min(delay * 2, BACKOFF_MAX_S)

    def _poll(self, path: str, query: dict, timeout: float | None) -> dict:
        """Repeat a long-poll in slices until the server says ready; MetaTimeout at the deadline."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            slice_s = max(0.0, min(POLL_SLICE_S, deadline - time.monotonic()))
            got = self._request("GET", path, query={**query, "timeout": f"{slice_s:.3f}"},
                                deadline=deadline)
            if got["ready"]:
                return got
            if time.monotonic() >= deadline:
                raise _not_ready(MetaTimeout, path, query, f"{timeout:g}", got)

    # -- server ---------------------------------------------------------------------------------
    def health(self) -> dict:
        return self._request("GET", "/health")

    def metrics(self) -> str:
        return self._request("GET", "/metrics")

    # -- job ------------------------------------------------------------------------------------
    def summary(self) -> dict:
        return self._request("GET", self._job_path)

    def delete_job(self) -> dict:
        return self._request("DELETE", self._job_path)

    def abort(self, reason: str) -> dict:
        return self._request("POST", f"{self._job_path}/abort", {"reason": reason})

    # -- participants ---------------------------------------------------------------------------
    def register(self, record: Registration | str, rank: int | None = None, *, instance: int | None = None,
                 host: str = "", address: str = "", spec_digest: str = "",
                 model_config: Mapping[str, Any] | None = None) -> dict:
        """Register ``record`` (a :class:`Registration`; the model's config.json beside it). A bare identity
        (``register("train", 0, host=..., address=...)``, as tools and tests of the server do) registers
        no layout and no options: a weightsync session refuses to plan with it."""
        if not isinstance(record, Registration):
            record = Registration(record, int(rank), instance, host=host, address=address, spec_digest=spec_digest)
        return self._request("POST", f"{self._job_path}/participants", post_body(record, model_config))

    def participants(self, role: str | None = None) -> list[Registration]:
        """Every registered participant (of ``role``), typed, in name order."""
        got = self._request("GET", f"{self._job_path}/participants", query={"role": role})
        return decode_listing(got).participants

    def wait_participants(self, n: int, role: str | None = None, timeout: float | None = None,
                          limit: int | None = None) -> list[Registration]:
        """Every participant (of ``role``) once ``n`` registered (``limit``: only the first that many of them)."""
        got = self._poll(f"{self._job_path}/participants", {"wait_for": n, "role": role, "limit": limit}, timeout)
        return decode_listing(got).participants

    def census(self, role: str | None = None) -> Census:
        """What agreement needs of the participants (of ``role``): each distinct profile once, counted."""
        return Census.from_json(self._request("GET", f"{self._job_path}/census", query={"role": role}))

    def wait_census(self, n: int, role: str | None = None, timeout: float | None = None) -> Census:
        """The census (of ``role``) once ``n`` registered."""
        return Census.from_json(self._poll(f"{self._job_path}/census", {"wait_for": n, "role": role}, timeout))

    def placement(self, instance: int | None = None, whole: bool = False) -> Placement | None:
        """Where the ranks run that a training rank's plan compares (``instance``: that instance's plan;
        ``whole``: every rank); None where the arithmetic rules place them (weightsync.meta.view)."""
        got = self._request("GET", f"{self._job_path}/placement",
                            query={"instance": instance, "whole": 1 if whole else None})
        return decode_placement(got)

    # -- plan hashes ----------------------------------------------------------------------------
    def post_plan_hashes(self, role: str, rank: int, pairs: Mapping[tuple[int, int, int], str], *,
                         instance: int | None = None, plan_hash: str | None = None) -> dict:
        body: dict[str, Any] = {"role": role, "rank": rank, "pairs": [[*p, h] for p, h in sorted(pairs.items())]}
        if instance is not None:
            body["instance"] = instance
        if plan_hash is not None:
            body["plan_hash"] = plan_hash
        return self._request("POST", f"{self._job_path}/plan-hashes", body)

    def check_plan_hashes(self) -> dict:
        """The pairs' comparison now (weightsync.meta.proof: counts, the first pairs that disagree or wait)."""
        return self._request("GET", f"{self._job_path}/plan-hashes/check")

    def wait_plan_hashes(self, n: int, timeout: float | None = None) -> dict:
        """The comparison once ``n`` participants posted and no pair waits, or a pair disagrees, or the job
        was aborted (``aborted`` says why); MetaTimeout at the deadline."""
        return self._poll(f"{self._job_path}/plan-hashes/check", {"wait_for": n}, timeout)

    # -- instances ------------------------------------------------------------------------------
    def join(self, instance: int, incarnation: str | None = None, liveness_s: float | None = None) -> dict:
        """Join (``incarnation``: this reader's own hex id; a new one replaces a joined member). ``liveness_s``:
        the server marks the member gone once it has heard nothing from it for that long (see :meth:`alive`)."""
        body: dict[str, Any] = _membership(None, incarnation)
        if liveness_s is not None:
            body["liveness_s"] = liveness_s
        return self._request("POST", f"{self._job_path}/instances/{instance}/join", body)

    def alive(self, instance: int, incarnation: str | None = None, timeout: float | None = None) -> dict:
        """A joined member's heartbeat (:mod:`weightsync.meta.heartbeat` sends it); 409 once it is no member."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        return self._request("POST", f"{self._job_path}/instances/{instance}/alive", _membership(None, incarnation),
                             deadline=deadline)

    def leave(self, instance: int, reason: str = "", incarnation: str | None = None) -> dict:
        """Leave (of ``incarnation`` only, when given: a stale process cannot leave for its successor)."""
        return self._request("POST", f"{self._job_path}/instances/{instance}/leave", _membership(reason, incarnation))

    def gone(self, instance: int, reason: str = "", incarnation: str | None = None) -> dict:
        """Drop an instance that stopped answering (member state ``gone``); it may join again."""
        return self._request("POST", f"{self._job_path}/instances/{instance}/gone", _membership(reason, incarnation))

    def members(self) -> dict[int, Member]:
        """Every instance that ever joined (joined, left or gone), by instance id."""
        return {int(i): Member.from_json(i, m) for i, m in self.summary()["members"].items()}

    def instances(self) -> dict:
        return self._request("GET", f"{self._job_path}/instances")

    def wait_topology(self, after_version: int, timeout: float | None = None) -> dict:
        """Wait until the topology version is above ``after_version``."""
        return self._poll(f"{self._job_path}/instances", {"after_version": after_version}, timeout)

    # -- steps ----------------------------------------------------------------------------------
    def written(self, step: int, rank: int | Iterable[int]) -> dict:
        """Training rank ``rank`` has ``step`` ready; given several ranks (a trainer group's), each has, in
        one request."""
        body = {"rank": rank} if isinstance(rank, int) else {"ranks": list(rank)}
        return self._request("POST", f"{self._job_path}/steps/{step}/written", body)

    def written_until_held(self, step: int, rank: int | Iterable[int], instances: Iterable[int] | None = None,
                           timeout: float | None = None) -> dict[int, int]:
        """:meth:`written`, then :meth:`wait_held` for ``step``: one request while its first long-poll slice
        lasts (the MetaServer records the step written and answers once it is held), so a training rank's
        sync step asks the server once, not twice."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        instances = None if instances is None else list(instances)
        ids = None if instances is None else ",".join(str(i) for i in instances)
        body: dict[str, Any] = {"rank": rank} if isinstance(rank, int) else {"ranks": list(rank)}
        body["held"] = {"instances": ids, "timeout": round(max(0.0, min(POLL_SLICE_S, timeout)), 3)}
        got = self._request("POST", f"{self._job_path}/steps/{step}/written", body, deadline=deadline)
        if not got["ready"]:  # the rest of the wait, as wait_held asks it (its MetaTimeout at the deadline)
            try:
                return self.wait_held(step, instances, timeout=max(0.0, deadline - time.monotonic()))
            except MetaTimeout as e:
                raise waited(e, timeout) from None
        return {int(i): s for i, s in got["held"].items()}

    def wait_written(self, step: int, n: int | None = None, timeout: float | None = None) -> list[int]:
        """Training ranks that wrote ``step``, once ``n`` of them (default: every registered one) did."""
        return self._poll(f"{self._job_path}/steps/{step}/written", {"wait_for": n}, timeout)["ranks"]

    def held(self, instance: int, step: int, reset: bool = False, incarnation: str | None = None) -> dict:
        body: dict[str, Any] = {"step": step}
        if reset:
            body["reset"] = True
        if incarnation is not None:
            body["incarnation"] = incarnation
        return self._request("POST", f"{self._job_path}/instances/{instance}/held", body)

    def wait_held(self, min_step: int, instances: Iterable[int] | None = None,
                  timeout: float | None = None) -> dict[int, int]:
        """Steps held once every listed instance (default: every joined one) holds ``min_step`` or later."""
        ids = None if instances is None else ",".join(str(i) for i in instances)
        got = self._poll(f"{self._job_path}/held", {"min_step": min_step, "instances": ids}, timeout)
        return {int(i): s for i, s in got["held"].items()}

    # -- rendezvous -----------------------------------------------------------------------------
    def publish(self, name: str, address: str, replace: bool = False) -> dict:
        body: dict[str, Any] = {"address": address}
        if replace:
            body["replace"] = True
        return self._request("POST", f"{self._job_path}/rendezvous/{urllib.parse.quote(name, safe='')}", body)

    def lookup(self, name: str, timeout: float | None = None) -> str:
        """The address published under ``name``, waiting for it."""
        return self._poll(f"{self._job_path}/rendezvous/{urllib.parse.quote(name, safe='')}", {}, timeout)["address"]


def _not_ready(kind: type[MetaTimeout], path: str, query: Mapping, seconds: str, got: Any) -> MetaTimeout:
    e = kind(f"GET {path} {query}: not ready after {seconds} s; last answer {json.dumps(got)[:300]}")
    e.poll = (path, query, got)  # type: ignore[attr-defined] - for waited()
    return e


def waited(e: MetaTimeout, seconds: float) -> MetaTimeout:
    """``e`` said after the whole wait, ``seconds``: a long-poll that asked only for what was left of a longer wait
    (``timeout=0`` at its deadline) otherwise reports that remainder ("not ready after 0.0 s" after 60 s).
    Any other MetaTimeout is ``e`` itself."""
    poll = getattr(e, "poll", None)
    if poll is None:
        return e
    return _not_ready(type(e), *poll[:2], f"{seconds:.1f}", poll[2])


def _membership(reason: str | None, incarnation: str | None) -> dict[str, str]:
    body = {"reason": reason} if reason else {}
    if incarnation is not None:
        body["incarnation"] = incarnation
    return body


def _error_message(status: int, reason: str, raw: bytes) -> tuple[str, bool]:
    """The server's message and whether it reports an aborted job."""
    try:
        got = json.loads(raw)
        return str(got["error"]), "aborted" in got
    except Exception:
        return f"HTTP {status} {reason}", False
