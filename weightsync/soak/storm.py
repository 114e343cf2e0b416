"""A storm of bad requests at the soak's MetaServer while the job runs (the ``storm meta`` fault).

What issue 40's probe sent by hand, from the driver's own threads, each request on a connection of its own:

- no token, a garbage token, a wrong admin token (asking to abort the job), another job's real token (asking to
  drop instance 0, or for ``/metrics``): refused 401 / 403, nothing changed. Before, a request with no token
  stopped the job it named for a minute (every wait answered 409);
- the headers of a 1 GiB registration with no token, and no body: refused at once, 413 (too large, told by its
  ``Content-Length``) or 401, never after waiting for the body (the token and the size are checked once the
  headers are in; before, bodies were read first);
- bytes that are not HTTP: 400, or the connection closed;
- a registration with the job's own token whose model config has a count that is a string
  (``"num_hidden_layers": "3000000"``): 400 in milliseconds (before, the event loop built the spec for 24 s);
- connections whose headers never end (a slowloris): each closed by the server within its header deadline
  (``weightsync.meta.limits.HEADER_S``).

Left out on purpose: a well-formed token of the job's own format with a wrong MAC. The server tells that job's
waits of such a refusal (a participant started with a wrong admin token must fail in seconds, naming it), so it
does stop the job's waits that are not ready: docs/security.md says so (keep the MetaServer on a network only the
job's hosts reach).

:class:`Storm` counts every answer by kind; ``problems`` lists what was not refused as it should be.
"""

from __future__ import annotations

import collections
import json
import os
import secrets
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

from weightsync.meta.limits import HEADER_S

ANSWER_S = 10.0  # a refusal comes within this, or the request counts as not answered
SLOW_CONNECTIONS = 16  # the slowloris's connections
SLOW_GRACE_S = 3.0  # a slow connection is closed by the server within HEADER_S + this of connecting


@dataclass(frozen=True)
class Probe:
    """One kind of bad request: its name, the answers that refuse it, and how it is sent."""

    name: str
    refused: frozenset[str]  # status codes (as text) and "closed" (the server closed the connection unanswered)
    send: Callable[[socket.socket], None]


class Storm:
    """Bad requests at ``url`` from ``threads`` threads until :meth:`stop`, and a slowloris of
    ``slow`` connections; ``counts[name][answer]`` and ``problems`` say how each was answered."""

    def __init__(self, url: str, job: str, admin_token: str, job_token: str, model_config: dict, *,
                 threads: int = 3, pause_s: float = 0.02, slow: int = SLOW_CONNECTIONS, header_s: float = HEADER_S):
        from weightsync.meta.auth import job_token as make_job_token

        u = urlsplit(url)
        self.host, self.port, self.job = u.hostname or "127.0.0.1", u.port or 80, job
        self.threads, self.pause_s, self.slow = threads, pause_s, slow
        self.header_s = header_s  # the server's header deadline (weightsync.meta.limits.ConnectionLimits)
        other = make_job_token(admin_token, f"{job}-storm")  # a real token, of another job
        wrong_admin = secrets.token_hex(16)
        self._bomb = dict(model_config, num_hidden_layers="3000000")  # a count that is a string
        self._job_token = job_token
        j = f"/v1/jobs/{job}"
        self.probes = (
            Probe("no token", frozenset({"401"}), lambda s: s.sendall(self._request("GET", j))),
            Probe("garbage token", frozenset({"401"}), lambda s: s.sendall(self._request(
                "GET", f"{j}/held?timeout=0", [f"Authorization: Bearer {secrets.token_urlsafe(24)}"]))),
            Probe("wrong admin token: abort the job", frozenset({"401"}), lambda s: s.sendall(self._request(
                "POST", f"{j}/abort", [f"Authorization: Bearer {wrong_admin}"], b'{"reason": "storm"}'))),
            Probe("another job's token: drop instance 0", frozenset({"403"}), lambda s: s.sendall(self._request(
                "POST", f"{j}/instances/0/gone", [f"Authorization: Bearer {other}"], b'{"reason": "storm"}'))),
            Probe("another job's token: /metrics", frozenset({"403"}), lambda s: s.sendall(self._request(
                "GET", "/metrics", [f"Authorization: Bearer {other}"]))),
            # the headers of a 1 GiB body and none of it: answered once the headers are in, or never
            Probe("1 GiB body, no token", frozenset({"401", "413"}), lambda s: s.sendall(self._request(
                "POST", f"{j}/participants", ["Content-Type: application/json", f"Content-Length: {1 << 30}"]))),
            Probe("not HTTP", frozenset({"400", "closed"}), lambda s: s.sendall(os.urandom(256) + b"\r\n\r\n")),
            Probe("config bomb, the job's token", frozenset({"400"}), self._send_bomb),
        )
        self.counts: dict[str, collections.Counter] = {p.name: collections.Counter() for p in self.probes}
        self.problems: list[str] = []
        self.slow_closed_s: list[float] = []  # how long each slow connection was held before the server closed it
        self.slow_held: int = 0  # slow connections the server still held past their deadline
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []
        self._slow_done = threading.Event()

    # -- requests -------------------------------------------------------------------------------
    def _request(self, method: str, path: str, headers: list[str] = (), body: bytes | None = None) -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Connection: close", *headers]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")

    def _send_bomb(self, s: socket.socket) -> None:
        from weightsync.meta.records import Registration, post_body

        body = json.dumps(post_body(Registration("infer", 0, 99), self._bomb)).encode()
        s.sendall(self._request("POST", f"/v1/jobs/{self.job}/participants",
                                [f"Authorization: Bearer {self._job_token}"], body))

    def _answer(self, probe: Probe) -> str:
        """Send one ``probe`` on a new connection; its answer: a status code, "closed" or "no answer"."""
        with socket.create_connection((self.host, self.port), timeout=ANSWER_S) as s:
            try:
                probe.send(s)
            except (BrokenPipeError, ConnectionResetError):  # answered and closed while we were still sending
                pass
            got = b""
            deadline = time.monotonic() + ANSWER_S
            while b"\r\n" not in got:
                left = deadline - time.monotonic()
                if left <= 0:
                    return "no answer"
                s.settimeout(left)
                try:
                    chunk = s.recv(4096)
                except socket.timeout:
                    return "no answer"
                except ConnectionResetError:
                    return "closed"
                if not chunk:
                    return "closed" if not got else "malformed"
                got += chunk
            line = got.split(b"\r\n", 1)[0].decode("latin-1")
            parts = line.split()
            return parts[1] if len(parts) > 1 and line.startswith("HTTP/") else f"malformed ({line[:40]!r})"

    def _requests(self, first: int) -> None:
        i = first
        while not self._stop.is_set():
            probe = self.probes[i % len(self.probes)]
            i += 1
            try:
                answer = self._answer(probe)
            except OSError as e:  # could not even connect: the server is not serving
                answer = f"connect failed ({type(e).__name__})"
            with self._lock:
                self.counts[probe.name][answer] += 1
                if answer not in probe.refused and self.counts[probe.name][answer] == 1:
                    self.problems.append(f"{probe.name}: answered {answer}, not refused "
                                         f"({' or '.join(sorted(probe.refused))})")
            self._stop.wait(self.pause_s)

    # -- a slowloris ----------------------------------------------------------------------------
    def _slowloris(self) -> None:
        """``slow`` connections that send a header line every half second and never end their headers; each must
        be closed by the server within its header deadline + ``SLOW_GRACE_S`` of connecting."""
        opened: dict[socket.socket, float] = {}
        try:
            for _ in range(self.slow):
                s = socket.create_connection((self.host, self.port), timeout=ANSWER_S)
                s.sendall(f"GET /v1/jobs/{self.job} HTTP/1.1\r\nHost: {self.host}\r\n".encode())
                s.setblocking(False)
                opened[s] = time.monotonic()
            deadline = max(opened.values()) + self.header_s + SLOW_GRACE_S
            n = 0
            while opened and time.monotonic() < deadline:
                ready, _, _ = select.select(list(opened), [], [], 0.5)
                for s in ready:  # the server answered or closed it: either way it let go
                    try:
                        data = s.recv(4096)
                    except OSError:
                        data = b""
                    if not data or data.startswith(b"HTTP/"):
                        self.slow_closed_s.append(time.monotonic() - opened.pop(s))
                        s.close()
                n += 1
                for s in list(opened):
                    try:
                        s.sendall(f"X-Trickle-{n}: {'a' * 8}\r\n".encode())
                    except OSError:  # closed by the server
                        self.slow_closed_s.append(time.monotonic() - opened.pop(s))
                        s.close()
            self.slow_held = len(opened)
            if opened:
                with self._lock:
                    self.problems.append(f"slowloris: the server still held {len(opened)} of {self.slow} connections "
                                         f"whose headers never ended {self.header_s + SLOW_GRACE_S:g} s after "
                                         f"they connected (header deadline {self.header_s:g} s)")
        except OSError as e:
            with self._lock:
                self.problems.append(f"slowloris: {type(e).__name__}: {e}")
        finally:
            for s in opened:
                s.close()
            self._slow_done.set()

    # -- the storm ------------------------------------------------------------------------------
    def start(self) -> None:
        self._workers = [threading.Thread(target=self._requests, args=(k * 3,), name=f"soak-storm-{k}", daemon=True)
                         for k in range(self.threads)]
        self._workers.append(threading.Thread(target=self._slowloris, name="soak-slowloris", daemon=True))
        for t in self._workers:
            t.start()

    def slow_done(self) -> bool:
        return self._slow_done.is_set()

    def stop(self) -> None:
        self._stop.set()
        for t in self._workers:
            t.join(ANSWER_S + 5.0)

    def summary(self) -> str:
        total = sum(sum(c.values()) for c in self.counts.values())
        answers = collections.Counter()
        for c in self.counts.values():
            answers.update(c)
        said = ", ".join(f"{a} x{n}" for a, n in sorted(answers.items()))
        closed = (f"; {len(self.slow_closed_s)} of {self.slow} slowloris connections closed by the server after "
                  f"{min(self.slow_closed_s):.1f}-{max(self.slow_closed_s):.1f} s" if self.slow_closed_s else
                  f"; none of {self.slow} slowloris connections closed")
        return f"{total} bad requests ({said}){closed}"


__all__ = ["ANSWER_S", "Probe", "Storm"]
