"""The MetaServer: the job-level coordinator that training and inference processes meet through.

It only holds small facts (who takes part, plan hashes, topology, which step is where); weights never
pass through it. JSON over HTTP/1.1 (aiohttp, one asyncio event loop), never pickle. Long-polls are
futures on that loop, so 10,000 open waits cost no threads; the rules live in :mod:`.state`, the
input checks in :mod:`.validate`, the durable state in :mod:`.store`.

Routes (ids in paths: job and rendezvous names match ``[A-Za-z0-9_.-]{1,128}``; instances and steps
are non-negative integers). ``timeout`` is in seconds (0 = answer now, at most 300); a long-poll
answers ``"ready": false`` when it runs out, and the client decides whether to poll again.

    GET  /health                                   200 {"status": "ok", ...}; never needs a token
    GET  /metrics                                  Prometheus text (the admin token's only)
    GET  /v1/jobs/{job}                            summary: participants, topology, steps, who holds what
    DELETE /v1/jobs/{job}                          forget a job (to reuse its id)
    POST /v1/jobs/{job}/abort                      {"reason"}: every waiter of the job wakes with 409
    POST /v1/jobs/{job}/participants               a Registration (weightsync.meta.records: "role", "rank",
                                                   "instance"?, "host"?, "gpu"? (UUID), "address"?, "version"?,
                                                   "model"?, "spec_digest"?, "layout"? {"engine", "world",
                                                   "digest"}, "terms"? {"transport", "mode", "colocate",
                                                   "bucket_bytes", "integrity", "codec"}, "backend"?,
                                                   "peer_copies"?, "instances"?) and "model_config"? beside it
                                                   (kept once per distinct config); re-register = replace
    GET  /v1/jobs/{job}/participants               ?role=&wait_for=N&limit=N&timeout=S: once ready, each
                                                   distinct "profile" (model, layout, options) once and one
                                                   row per participant; not ready: the count only; gzipped
                                                   for a client that accepts it
    GET  /v1/jobs/{job}/census                     ?role=&wait_for=N&timeout=S: what set-up agreement needs,
                                                   not a row each: each distinct profile once with how many
                                                   registered it and the first few names, the instance count
                                                   (weightsync.meta.view.Census); not ready: the count only
    GET  /v1/jobs/{job}/placement                  ?instance=I&whole=1: host and GPU of the ranks a
                                                   participant's plan compares (a training rank's view without
                                                   instance; whole=1: every rank), as runs
                                                   (weightsync.meta.view.concerning)
    POST /v1/jobs/{job}/plan-hashes                {"role", "rank", "instance"?, "plan_hash"?,
                                                   "pairs": [[src_rank, dst_instance, dst_rank, hash], ...]}
    GET  /v1/jobs/{job}/plan-hashes/check          ?wait_for=N&timeout=S: counts of pairs compared, waiting and
                                                   disagreeing, the first few of the last two with both names
                                                   (weightsync.meta.proof); wait_for: a long-poll until N
                                                   posted and none waits, or one disagrees, or an abort
    POST /v1/jobs/{job}/instances/{i}/join         {"incarnation"?, "liveness_s"?}; the topology version grows
                                                   on each change
    POST /v1/jobs/{job}/instances/{i}/alive        {"incarnation"?}: a joined member's heartbeat (nothing stored)
    POST /v1/jobs/{job}/instances/{i}/leave        {"reason"?, "incarnation"?}: member state "left"
    POST /v1/jobs/{job}/instances/{i}/gone         {"reason"?, "incarnation"?}: dropped (stopped answering)
    GET  /v1/jobs/{job}/instances                  ?after_version=V&timeout=S
    POST /v1/jobs/{job}/steps/{S}/written          {"rank"}: training rank R has step S ready; or
                                                   {"ranks": [R, ...]}: each of them has (a trainer group's
                                                   representative posts once for its group); with "held":
                                                   {"instances"?: "0,1,..", "timeout"}: then waits, and
                                                   answers, as GET held?min_step=S does (one request a
                                                   rank a sync step, not two)
    GET  /v1/jobs/{job}/steps/{S}/written          ?wait_for=N&timeout=S (N defaults to every train rank)
    POST /v1/jobs/{job}/instances/{i}/held         {"step", "reset"?, "incarnation"?}: instance i holds step S
    GET  /v1/jobs/{job}/held                       ?min_step=S&instances=0,1&timeout=T (default: the joined
                                                   instances that joined before any rank wrote S)
    POST /v1/jobs/{job}/rendezvous/{name}          {"address", "replace"?}: first publisher wins
    GET  /v1/jobs/{job}/rendezvous/{name}          ?timeout=S

Rules: plan hashes and ``written`` need the participant registered first, ``held`` needs the instance
joined (a member that left or is gone is told so, and may join again) and the step written by some
training rank (a ``held`` past the latest step written, which races its ``written``, waits up to 10 s
for it; one for a step within the window that nobody wrote is refused at once); ``held`` is monotonic
per instance unless ``reset``; ``written`` keeps the last 64
steps, and a new step is at most 2^32 past the latest (no jump to 2^63 that would evict the window)
and never pushes out of the window the latest step of a rank that is not posting it (no rank runs
more than 64 steps ahead of the slowest: 409); a step that would be dropped at once answers 410, never 200. Membership: each instance that ever
joined has a record (``members`` in the summary: state joined/left/gone, ``since``, ``version``); a
joiner counts for the default ``held`` wait from the first step no training rank had written when it
joined. An ``incarnation`` (a reader's own hex id) makes a join under a joined id replace the member
(a retry with the same one changes nothing); ``held``, ``leave`` and ``gone`` carrying another
incarnation than the member's are refused (409) or change nothing, so a dropped process that comes
back cannot report steps or leave for its successor. A member that joined with ``liveness_s`` (an async
reader: no step waits for it, so nothing else would notice it died) is marked gone, with the reason, once
nothing (join, alive, held) was heard from it for longer than that; the server looks every 0.25 s, and
after a restart each such member gets a whole ``liveness_s`` again (when it was heard is not stored). A registration whose model spec differs
from a registered one's is refused (409) and aborts the job, so the participants already waiting
fail at once with the same reason, which names the first tensor that differs and its shape on each
side (:mod:`.mismatch`). Once a job is aborted its waits and mutations answer 409 (with
``"aborted"``) until it is deleted; a plain participants listing still answers.

Tokens (:mod:`.auth`): the server's ``token`` is the admin's and opens every route; a job's token
(``weightsync job-token``, :func:`weightsync.meta.auth.job_token`) opens ``/v1/jobs/{that job}/...`` only.
The token is checked once the headers are in, before any body is read: a refused request is answered
401 or 403 with ``Connection: close`` and its body never read (a registration refused for a token of its
job's own format excepted: its first ``REFUSED_PREFIX`` bytes name who was refused, to its job's waits).

Errors are JSON ``{"error": "..."}`` and change nothing: 400 malformed, 401 token missing or wrong,
403 another job's token, 404 unknown route
or job, 405 method, 408 body too slow, 409 conflict, 410 step older than the window, 411/413 body
framing and size, 429 too many jobs, 500 the state could not be saved (nothing of the request is
kept, nobody was woken; a retry is saved again or refused again), 503 the server is stopping (the
client retries). A request line or header the HTTP parser refuses gets aiohttp's plain-text 400.
Every body past the token is read in full (or the connection is closed), so its bytes are never taken
for a request;
a GET or DELETE with a body is refused. A client must send a request's headers within ``header_s`` (5 s)
of connecting or of that request's first byte, and its body within ``REQUEST_DEADLINE_S``; a kept-alive
connection idles at most ``KEEPALIVE_S`` between requests.

Connections (:mod:`.limits`): the soft open-file limit is raised to the hard one at start and the server holds
at most that many connections, less a reserve; a connection is authenticated once a request on it passed the
token check. Unauthenticated connections (still sending headers, or only asked ``/health``) are held at most
``per_peer`` per address and are the first closed when the server is full; an authenticated request in
progress is never closed to make room.

Persistence (``state_path``): an SQLite database in WAL mode (:mod:`.store`). Mutations that arrive
together are saved in one transaction; nobody is answered or woken before the transaction that holds
what they saw is on disk. A crash at any point leaves the last committed state; start reloads it.
Every mutation is idempotent, so a client that retries a request whose answer was lost changes
nothing twice.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import ipaddress
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable
from urllib.parse import urlsplit

from aiohttp import web

from weightsync import __version__
from weightsync.errors import WeightSyncError
from weightsync.meta import auth
from weightsync.meta.limits import ACCEPT_BATCH, ConnectionGate, ConnectionLimits, file_budget, raise_file_limit
from weightsync.meta.state import SWEEP_S, Coordinator, Encoded, last_mutation, restore
from weightsync.meta.store import Store
from weightsync.meta.validate import (
    MAX_BODY, HTTPError, Query, identity, parse_body, participant_name, path_params, short,
)

__all__ = ["MAX_BODY", "ConnectionLimits", "MetaServer", "add_arguments", "main", "run_from_args", "serve"]

log = logging.getLogger("weightsync.meta.server")

BACKLOG = 4096  # a 1,000-rank job connects at once; the kernel caps it at net.core.somaxconn
KEEPALIVE_S = 30.0  # an idle kept-alive connection is closed after this (headers: limits.HEADER_S)
REQUEST_DEADLINE_S = 30.0  # a request body must arrive within this
SHUTDOWN_S = 2.0  # stop() waits this long for answers in flight

# --------------------------------------------------------------------------------------------
# Persistence: group commit on one writer thread


class _Persister:
    """Saves the coordinator's row changes in batches: while one transaction commits, the next
    batch gathers. A batch that fails is dropped with everything applied after it, and memory is
    reloaded from the database, so nothing unsaved is ever answered or seen."""

    def __init__(self, coord: Coordinator, store: Store | None, loop: asyncio.AbstractEventLoop):
        self.coord, self.store, self.loop = coord, store, loop
        self.settled = coord.seq  # every mutation up to here is saved or was dropped
        self.lost: list[tuple[int, int]] = []  # (after, upto] ranges of mutations dropped by a failed save
        self.broken: str | None = None
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self._scheduled = self._running = False
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meta-store") if store else None
        coord.on_change = self._changed

    def _changed(self) -> None:
        if self.store is None:  # memory only: a change is final at once (its waiters are still woken in _kick)
            self.settled = self.coord.seq
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._kick)

    def _kick(self) -> None:
        self._scheduled = False
        if self.store is None:  # memory only: a change is final at once
            _, touched = self.coord.take()
            self.settled = self.coord.seq
            self.coord.notify(touched)
            self._release()
        elif not self._running:
            self._running = True
            self.loop.create_task(self._run())

    async def _run(self) -> None:
        try:
            while self.coord.ops or self.coord.touched:
                upto = self.coord.seq
                ops, touched = self.coord.take()
                try:
                    await self.loop.run_in_executor(self._pool, self.store.apply, ops)
                except Exception as e:  # noqa: BLE001 - a full disk, an unwritable directory, a broken file
                    upto = self.coord.seq  # what was applied meanwhile built on the dropped batch: drop it too
                    log.error("MetaServer state not saved (%s: %s); %d requests answer 500", type(e).__name__, e,
                              upto - self.settled)
                    try:
                        self.coord.reload(restore(self.store.load()))
                    except Exception as e2:  # noqa: BLE001
                        self.broken = f"the state cannot be reloaded after a failed save: {e2}"
                        log.error("MetaServer: %s", self.broken)
                    self.lost.append((self.settled, upto))
                    self.settled = upto
                else:
                    self.settled = upto
                    self.coord.notify(touched)
                self._release()
        finally:
            self._running = False

    def _release(self) -> None:
        keep = []
        for seq, fut in self._waiters:
            if seq <= self.settled:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((seq, fut))
        self._waiters = keep

    async def settle(self, seq: int) -> None:
        """Until every mutation up to ``seq`` is saved or dropped."""
        if seq <= self.settled:
            return
        fut = self.loop.create_future()
        self._waiters.append((seq, fut))
        self._changed()
        await fut

    def dropped(self, after: int, upto: int) -> bool:
        """Was any mutation in (after, upto] dropped by a failed save?"""
        return any(lo < upto and after < hi for lo, hi in self.lost)

    async def drain(self) -> None:
        while self._running or self.coord.ops:
            await self.settle(self.coord.seq)
            await asyncio.sleep(0)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


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
         lambda p, q, b: c.participants(p["job"], Query(q, {"role", "wait_for", "limit", "timeout"}))),
        ("POST", J + ("plan-hashes",), lambda p, q, b: c.post_plan_hashes(p["job"], b)),
        ("GET", J + ("plan-hashes", "check"),
         lambda p, q, b: c.check_plan_hashes(p["job"], Query(q, {"wait_for", "timeout"}))),
        ("GET", J + ("census",), lambda p, q, b: c.census(p["job"], Query(q, {"role", "wait_for", "timeout"}))),
        ("GET", J + ("placement",), lambda p, q, b: c.placement(p["job"], Query(q, {"instance", "whole"}))),
        ("POST", J + ("instances", "{i}", "join"), lambda p, q, b: c.join_leave(p["job"], p["i"], b, True)),
        ("POST", J + ("instances", "{i}", "leave"), lambda p, q, b: c.join_leave(p["job"], p["i"], b, False)),
        ("POST", J + ("instances", "{i}", "gone"), lambda p, q, b: c.join_leave(p["job"], p["i"], b, False, "gone")),
        ("POST", J + ("instances", "{i}", "alive"), lambda p, q, b: c.alive(p["job"], p["i"], b)),
        ("GET", J + ("instances",), lambda p, q, b: c.instances(p["job"], Query(q, {"after_version", "timeout"}))),
        ("POST", J + ("steps", "{S}", "written"), lambda p, q, b: c.written_held(p["job"], p["S"], b)),
        ("GET", J + ("steps", "{S}", "written"),
         lambda p, q, b: c.wait_written(p["job"], p["S"], Query(q, {"wait_for", "timeout"}))),
        ("POST", J + ("instances", "{i}", "held"), lambda p, q, b: c.held(p["job"], p["i"], b)),
        ("GET", J + ("held",), lambda p, q, b: c.wait_held(p["job"], Query(q, {"min_step", "instances", "timeout"}))),
        ("POST", J + ("rendezvous", "{name}"), lambda p, q, b: c.publish(p["job"], p["name"], b)),
        ("GET", J + ("rendezvous", "{name}"), lambda p, q, b: c.lookup(p["job"], p["name"], Query(q, {"timeout"}))),
    ]


class _Router:
    """The routes as a tree of path segments: a request finds its routes in one dict look-up a segment, not by
    trying every template (a step's 2,000+ requests each did). No segment position holds both a literal and a
    parameter, so the walk never backtracks (checked here)."""

    def __init__(self, routes: list[tuple[str, tuple[str, ...], Callable]]):
        self.root: dict = {}
        for method, template, fn in routes:
            node = self.root
            for seg in template:
                node = node.setdefault("{}" if seg.startswith("{") else seg, {})
            node.setdefault(None, []).append((method, template, fn))
        nodes = [self.root]
        while nodes:
            node = nodes.pop()
            if "{}" in node and len(node) > 1 + (None in node):
                raise AssertionError(f"routes with a literal and a parameter at one position: {sorted(map(str, node))}")
            nodes += [child for key, child in node.items() if key is not None]

    def find(self, parts: list[str]) -> list[tuple[str, tuple[str, ...], Callable, dict[str, str]]]:
        """Every route whose template matches ``parts`` (each method's), with the path's parameters."""
        node = self.root
        for seg in parts:
            node = node.get(seg) or node.get("{}")
            if node is None:
                return []
        return [(m, t, fn, {t[k][1:-1]: parts[k] for k in range(len(t)) if t[k][0] == "{"})
                for m, t, fn in node.get(None, ())]


#: of a request refused for its token, at most this much body is read, and only to name the participant a
#: refused registration says it is (a registration's identity comes first in what MetaClient posts)
REFUSED_PREFIX = 8192
REFUSED_READ_S = 1.0  # and for at most this long
_IDENTITY_RE = {k: re.compile(rf'"{k}"\s*:\s*{v}') for k, v in
                (("role", r'"(train|infer)"'), ("rank", r"([0-9]{1,7})"), ("instance", r"([0-9]{1,7})"))}


def _who(data: bytes, whole: bool) -> str | None:
    """The participant a refused registration's body (``whole``) or its first bytes name, if any."""
    if whole:
        try:
            return participant_name(*identity(parse_body(data)))
        except HTTPError:
            return None
    text = data.decode("utf-8", "replace")
    found = {k: m.group(1) for k, r in _IDENTITY_RE.items() if (m := r.search(text))}
    if found.get("role") == "train" and "rank" in found:
        return f"train:{int(found['rank'])}"
    if found.get("role") == "infer" and "rank" in found and "instance" in found:
        return f"infer:{int(found['instance'])}:{int(found['rank'])}"
    return None


async def _prefix(request: web.Request, n: int) -> bytes:
    """Up to ``n`` bytes of the body, as many as come within REFUSED_READ_S."""
    got = bytearray()

    async def read() -> None:
        while len(got) < n:
            chunk = await request.content.read(n - len(got))
            if not chunk:
                return
            got.extend(chunk)

    try:
        await asyncio.wait_for(read(), REFUSED_READ_S)
    except Exception:  # noqa: BLE001 - too slow, or a broken body (aiohttp's payload errors): only the name is lost
        pass
    return bytes(got)


def _request_factory(message, payload, protocol, writer, task) -> web.BaseRequest:  # noqa: ANN001 - aiohttp's
    """A request whose body may be at most MAX_BODY bytes (what an Application's ``client_max_size`` set)."""
    return web.BaseRequest(message, payload, protocol, writer, task, asyncio.get_running_loop(),
                           client_max_size=MAX_BODY)


class _App:
    """One request: framing, then the token (once the headers are in, before any body is read: a refused
    request is answered 401 or 403 and its connection closed), then the body (always read in full, or the
    connection closed), route, validation, the rule, and the answer once what it says is saved."""

    def __init__(self, coord: Coordinator, persist: _Persister, token: str | None,
                 gate: ConnectionGate | None = None):
        self.coord, self.persist, self.token, self.gate = coord, persist, token, gate
        self.router = _Router(_routes(coord))
        self.requests: dict[tuple[str, int], int] = {}
        self.sent: dict[str, int] = {}  # answer body bytes by route (as sent: gzipped where it was)

    async def _refused(self, request: web.Request, job: str, path: str, parts: list[str], length: int | None,
                       verdict: auth.Verdict) -> None:
        """Record a request of ``job`` refused for its token and wake the job's waits, which then fail naming it.
        Only for a token of the job's own format (:meth:`weightsync.meta.auth.Verdict.tells`); a refused
        registration's first REFUSED_PREFIX bytes are read to name who it is, never more."""
        who = None
        if request.method == "POST" and parts[3:] == ["participants"] and length:
            want = min(length, REFUSED_PREFIX)
            data = await _prefix(request, want)
            who = _who(data, whole=len(data) == length)  # a body that names nobody is still a refusal
        self.coord.refusals.record(auth.Refusal(job, who, f"{request.method} {path[:120]}", verdict.status,
                                                verdict.message, time.monotonic()))
        self.coord.notify({(job, "*")})

    def _answer(self, route: str, status: int, payload: Any, close: bool = False, gzip_ok: bool = False) -> web.Response:
        encoding = None
        if isinstance(payload, Encoded):
            data, ctype = payload.body, "application/json"
            if gzip_ok and payload.gz is not None:  # compressed once, where it was encoded
                data, encoding = payload.gz, "gzip"
        elif isinstance(payload, str):
            data, ctype = payload.encode(), "text/plain; version=0.0.4; charset=utf-8"
        else:
            data, ctype = json.dumps(payload).encode(), "application/json"
        self.requests[(route, status)] = self.requests.get((route, status), 0) + 1
        self.sent[route] = self.sent.get(route, 0) + len(data)
        headers = {"Content-Type": ctype}
        if encoding is not None:
            headers["Content-Encoding"] = encoding
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        resp = web.Response(body=data, status=status, headers=headers)
        if close or self.coord.closing:  # a kept-alive connection must not outlive this server
            resp.force_close()
        return resp

    async def handle(self, request: web.Request) -> web.Response:
        """The request's headers are in: its connection is no longer timed; once answered, the connection is
        timed again unless a request on it presented a valid token (:class:`.limits.ConnectionGate`). No
        frame is added on the way to the body's parser: a deep body must meet the depth check, not the
        interpreter's recursion limit."""
        gate = self.gate
        conn = gate.begin(request.protocol) if gate is not None else None
        route, close = "unparsed", False
        method = request.method
        url = urlsplit(request.raw_path)
        parts = url.path.strip("/").split("/") if url.path.strip("/") else []
        try:
            if request.version.major != 1:
                close = True
                raise HTTPError(400, f"HTTP/{request.version.major}.{request.version.minor} is not served; use HTTP/1.1")
            if request.headers.get("Transfer-Encoding"):
                close = True
                raise HTTPError(411, "send the body with a Content-Length, not a transfer encoding")
            length = request.content_length
            if length is not None and length > MAX_BODY:
                close = True
                raise HTTPError(413, f"body of {length} bytes is over the {MAX_BODY} byte limit")
            if method == "GET" and parts == ["health"]:  # no token; its body, if any, is never read
                route, close = "GET /health", bool(length)
                return self._answer(route, 200, {"status": "ok", "version": __version__}, close=close)
            if self.token is not None:  # the headers are in: the token now, before any body is read
                path_job = parts[2] if len(parts) >= 3 and parts[:2] == ["v1", "jobs"] else None
                verdict = auth.check(self.token, request.headers.get("Authorization", ""), path_job)
                if verdict.status != 200:
                    route, close = ("unauthorized" if verdict.status == 401 else "forbidden"), True
                    if verdict.tells(path_job):  # a participant of that job with a wrong admin token: tell it
                        await self._refused(request, path_job, url.path, parts, length, verdict)
                    raise HTTPError(verdict.status, verdict.message)
            if gate is not None:  # a valid token (or a server without one): never closed to make room
                gate.trust(conn)
            try:
                if not length:
                    data = b""
                elif request.content.is_eof():  # all in already (a small body comes with its headers): no timer
                    data = await request.read()
                else:
                    data = await asyncio.wait_for(request.read(), REQUEST_DEADLINE_S)
            except asyncio.TimeoutError:
                close = True
                raise HTTPError(408, f"request body not received within {REQUEST_DEADLINE_S:g} s") from None
            except (ConnectionError, asyncio.CancelledError):
                raise
            except Exception as e:  # noqa: BLE001 - the body ended early or broke its framing
                close = True
                raise HTTPError(400, f"body not read: {type(e).__name__}: {str(e)[:120]}") from None
            if method == "GET" and parts == ["metrics"]:
                route = "GET /metrics"
                text = self.coord.metrics(self.requests, self.sent) + (
                    self.gate.metrics() if self.gate is not None else "")
                return self._answer(route, 200, text)
            found = self.router.find(parts)
            if not found:
                route = "unmatched"
                raise HTTPError(404, f"no route {short(url.path)}")
            chosen = [f for f in found if f[0] == method]
            if not chosen:
                route = "/" + "/".join(found[0][1])
                raise HTTPError(405, f"{method} is not allowed on {route}; use {sorted({f[0] for f in found})}")
            _, template, fn, params = chosen[0]
            route = f"{method} /" + "/".join(template)
            params = path_params(params)
            if method != "POST" and data.strip():
                raise HTTPError(400, f"a {method} takes no body; got {len(data)} bytes")
            body = parse_body(data) if method == "POST" else {}
            if self.coord.closing:
                raise HTTPError(503, "server stopping; retry")
            result = await self._run(fn, params, url.query, body)
            if template[3:] == ("participants",) and method == "POST":  # a refusal of it no longer holds
                self.coord.refusals.registered(params["job"], participant_name(*identity(body)))
            return self._answer(route, 200, result,
                                gzip_ok="gzip" in request.headers.get("Accept-Encoding", ""))
        except HTTPError as e:
            return self._answer(route, e.status, {"error": str(e), **e.extra}, close=close)
        except (ConnectionError, asyncio.CancelledError):  # the client went away
            raise
        except Exception as e:  # a bug: say so, keep serving
            traceback.print_exc(file=sys.stderr)
            return self._answer(route, 500, {"error": f"internal error: {type(e).__name__}"}, close=True)
        finally:
            if gate is not None:
                gate.end(conn)

    async def _run(self, fn: Callable, params: dict, query: str, body: dict) -> Any:
        """Run a rule; answer only once the state it answered from is saved. An answer computed from
        changes a failed save dropped is computed again; a request whose own change was dropped
        answers 500 (its retry is saved again, or answers 500 again)."""
        for _ in range(8):
            if self.persist.broken:
                raise HTTPError(500, f"MetaServer state not saved: {self.persist.broken}; restart the server")
            last_mutation.set(0)
            error: HTTPError | None = None
            try:
                result = fn(params, query, body)
                if asyncio.iscoroutine(result):
                    result = await result
            except HTTPError as e:
                error = e
            # the answer was computed from memory = saved up to `base` + pending changes up to `seen`
            base, mine, seen = self.persist.settled, last_mutation.get(), self.coord.seq
            await self.persist.settle(seen)
            if mine and self.persist.dropped(mine - 1, mine):
                raise HTTPError(500, "MetaServer state not saved (see the server's log); nothing of this "
                                     "request was kept: retry")
            if not self.persist.dropped(base, seen):
                if error is not None:
                    raise error
                return result
        raise HTTPError(500, "MetaServer state not saved (see the server's log): retry")


async def _sweep(coord: Coordinator) -> None:
    """Every ``SWEEP_S``: mark gone the members not heard from within their ``liveness_s``."""
    while True:
        await asyncio.sleep(SWEEP_S)
        try:
            for job, i in coord.expire_silent():
                log.warning("MetaServer: instance %d of job %s is gone: %s", i, job,
                            coord.jobs[job].members[i].reason)
        except Exception:  # a bug: say so, keep sweeping (and serving)
            log.exception("MetaServer: looking for silent members failed")


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (a dependency on Linux and macOS: ~10 % less server CPU a step than
    asyncio's at 1,024 + 128 participants, BENCHMARKS.md 2026-12-07), else asyncio's. ``WEIGHTSYNC_META_LOOP=asyncio``
    asks for asyncio's."""
    if os.environ.get("WEIGHTSYNC_META_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class MetaServer:
    """An embeddable MetaServer: ``with MetaServer().start() as s: MetaClient(s.url, "job")...``.

    Serves on its own thread's event loop. ``token``: the admin token; every request but ``/health``
    needs ``Authorization: Bearer TOKEN`` or, for a job's routes, that job's token (:mod:`.auth`; an
    empty token is refused). Listening beyond loopback without a token is refused unless
    ``allow_no_token``: anyone who reaches the port could otherwise abort or rewrite a job. ``limits``: how
    many connections are held, per address without a token, and how soon headers must be in
    (:class:`.limits.ConnectionLimits`; the defaults suit a job of thousands of participants on few hosts)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 state_path: str | None = None, allow_no_token: bool = False,
                 limits: ConnectionLimits | None = None):
        if token is not None and not token:
            raise WeightSyncError("the MetaServer token is empty: give a real token, or none on loopback")
        if token is None and not _is_loopback(host) and not allow_no_token:
            raise WeightSyncError(f"refusing to listen on {host or 'every address'} without a token: anyone who "
                                  f"reaches it could rewrite or abort jobs. Give the admin token in "
                                  f"${auth.TOKEN_ENV} or a --token-file, or pass --allow-no-token if the "
                                  f"network is trusted")
        self.host, self.token, self.state_path = host, token, state_path
        self.limits = limits if limits is not None else ConnectionLimits()
        self._port = port
        self._bound: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None

    def start(self) -> "MetaServer":
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="meta-server", daemon=True)
        self._thread.start()
        try:
            ready.result()
        except BaseException:
            self._thread.join()
            self._thread = None
            raise
        return self

    def _serve(self, ready: concurrent.futures.Future) -> None:
        loop = self._loop = _new_loop()
        log.info("MetaServer: event loop %s.%s", type(loop).__module__, type(loop).__name__)
        try:
            loop.run_until_complete(self._main(ready))
        except BaseException as e:  # noqa: BLE001 - handed to start()
            if not ready.done():
                ready.set_exception(e)
        finally:
            loop.close()

    async def _main(self, ready: concurrent.futures.Future) -> None:
        store = Store(self.state_path) if self.state_path else None
        try:
            coord = Coordinator(restore(store.load()) if store else None)
            persist = _Persister(coord, store, asyncio.get_running_loop())
            file_limit = raise_file_limit()
            gate = ConnectionGate(self.limits, self.limits.max_connections or file_budget(file_limit))
            handler = _App(coord, persist, self.token, gate)
            # aiohttp's low-level server: every request goes to the one handler, which routes it itself (an
            # Application's router and middleware chain cost a step's 2,000+ requests ~10% of the server's CPU).
            # A request body is at most MAX_BODY (client_max_size); lingering_time=0: the body of a request
            # answered without reading it (a refused token's) is never drained; its connection is closed instead
            server = web.Server(handler.handle, request_factory=_request_factory, handler_cancellation=True,
                                access_log=None, keepalive_timeout=KEEPALIVE_S, lingering_time=0)
            runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=SHUTDOWN_S)
            await runner.setup()
            listener: asyncio.AbstractServer | None = None
            try:
                # every connection passes the gate before aiohttp makes its protocol; asyncio accepts up to its
                # `backlog` connections per wake-up before any protocol sees one, so that is kept small and the
                # kernel's queue is made BACKLOG deep again afterwards
                listener = await asyncio.get_running_loop().create_server(
                    gate.protocol_factory(runner.server), self.host, self._port, backlog=ACCEPT_BATCH,
                    reuse_address=True)
                for sock in listener.sockets:
                    with sock.dup() as listening:
                        listening.listen(BACKLOG)
                self._bound = listener.sockets[0].getsockname()[1]
                log.debug("MetaServer: open-file limit %d; at most %d connections, %d per address without a "
                          "valid token; headers within %g s", file_limit, gate.max_connections,
                          self.limits.per_peer, self.limits.header_s)
                self._stopping = asyncio.Event()
                sweeper = asyncio.get_running_loop().create_task(_sweep(coord))
                gate.start()
                ready.set_result(None)
                await self._stopping.wait()
                sweeper.cancel()
                coord.close()  # every long-poll answers 503 now; clients retry on the next server
                await persist.drain()
            finally:
                gate.stop()
                if listener is not None:
                    listener.close()
                await runner.cleanup()
                persist.close()
        finally:
            if store is not None:
                store.close()

    @property
    def port(self) -> int:
        assert self._bound is not None, "start() the server first"
        return self._bound

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        """Wake every long-poll with 503 (clients retry elsewhen), save what is pending, free the port."""
        if self._thread is None:
            return
        assert self._loop is not None and self._stopping is not None
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join()
        self._thread = None

    def __enter__(self) -> "MetaServer":
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(host: str = "127.0.0.1", port: int = 0, token: str | None = None, state_path: str | None = None,
          allow_no_token: bool = False) -> int:
    """Run until SIGINT or SIGTERM; print the URL first so a launcher can read the chosen port."""
    # aiohttp logs each request its parser refuses with a traceback; those are answered 400 and are
    # the client's mistake (a port scanner's, often). Our own handler's failures are printed by it.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    try:
        server = MetaServer(host, port, token, state_path, allow_no_token=allow_no_token).start()
    except OSError as e:
        raise WeightSyncError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    if token is None and not _is_loopback(host):
        print(f"weightsync meta-server: warning: listening on {host} without a token (--allow-no-token)",
              file=sys.stderr)
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
    # the admin token: required as 'Authorization: Bearer TOKEN', or a job's own token (weightsync job-token)
    # for that job's routes; from $WEIGHTSYNC_META_TOKEN or --token-file (--token: warned about)
    auth.add_token_arguments(p)
    p.add_argument("--allow-no-token", action="store_true",
                   help="serve beyond loopback without a token (refused otherwise)")
    p.add_argument("--state", help="persist state to this SQLite file and reload it at start")


def run_from_args(args: argparse.Namespace) -> int:
    return serve(args.host, args.port, auth.admin_token(args), args.state, getattr(args, "allow_no_token", False))


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
