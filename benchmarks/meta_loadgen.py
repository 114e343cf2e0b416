"""A raw-HTTP load generator for MetaServer benchmarks: asyncio sockets, no retries, no HTTP library.

Each simulated participant opens its own keep-alive connection (as every process of a job does) and
sends pre-built requests; the generator parses only the status line, Content-Length and body, so
its own CPU stays small next to the server's on a 2-core machine. Used by ``meta_stack.py`` and
``meta_load.py``; run in its own process so the server's CPU can be read from ``/proc``.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class Result:
    """Latencies of one phase (seconds) and what went wrong."""

    name: str
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    server_cpu_s: float | None = None

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    def summary(self) -> dict:
        lat = sorted(self.latencies)
        n = len(lat)
        out: dict = {"phase": self.name, "answered": n, "errors": dict(self.errors), "wall_s": round(self.wall_s, 3)}
        if n:
            out.update(p50_ms=round(1e3 * lat[n // 2], 2), p99_ms=round(1e3 * lat[min(n - 1, int(n * 0.99))], 2),
                       max_ms=round(1e3 * lat[-1], 2), mean_ms=round(1e3 * statistics.fmean(lat), 2))
        if self.server_cpu_s is not None:
            out["server_cpu_s"] = round(self.server_cpu_s, 3)
            if n:
                out["server_cpu_us_per_request"] = round(1e6 * self.server_cpu_s / n, 1)
        return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def request_bytes(method: str, path: str, body: object | None = None, token: str | None = None) -> bytes:
    data = b"" if body is None else json.dumps(body).encode()
    head = [f"{method} {path} HTTP/1.1", "Host: bench"]
    if token:
        head.append(f"Authorization: Bearer {token}")
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


class _Answers(asyncio.Protocol):
    """A connection's bytes as they come, cut into answers (status line, Content-Length, body): no stream
    reader and no per-line parse, so the generator's CPU a request stays small next to the server's."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.answer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = exc or ConnectionResetError("connection closed")
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(asyncio.IncompleteReadError(bytes(self.buf), None))

    def answer(self) -> None:
        """Hand the waiter the first whole answer in the buffer, if there is one."""
        w = self.waiter
        if w is None or w.done():
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end])
        at = head.find(b"Content-Length:")
        if at < 0:
            at = head.lower().find(b"content-length:")
        length = 0 if at < 0 else int(head[at + 15:head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None])
        if len(self.buf) < end + 4 + length:
            return
        body = bytes(self.buf[end + 4:end + 4 + length])
        del self.buf[:end + 4 + length]
        w.set_result((int(head[9:12]), body))


class Conn:
    """One keep-alive connection: send a request, read one answer."""

    def __init__(self, transport: asyncio.Transport, proto: _Answers):
        self.transport, self.proto = transport, proto

    @classmethod
    async def open(cls, host: str, port: int) -> "Conn":
        transport, proto = await asyncio.get_running_loop().create_connection(_Answers, host, port)
        return cls(transport, proto)

    async def call(self, req: bytes) -> tuple[int, bytes]:
        if self.proto.lost is not None:
            raise asyncio.IncompleteReadError(b"", None)
        fut = self.proto.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(req)
        self.proto.answer()
        return await fut

    def close(self) -> None:
        self.transport.close()


async def at_once(name: str, host: str, port: int, reqs: list[list[bytes]], pid: int | None = None,
                  expect: int = 200, connect_timeout: float = 60.0) -> Result:
    """Every participant connects at the same moment and sends its requests in order, one connection
    each; a latency is connect (for the first) plus the answer, per request. No retries."""
    res = Result(name)
    start = asyncio.Event()

    async def one(seq: list[bytes]) -> None:
        await start.wait()
        t0 = time.perf_counter()
        try:
            conn = await asyncio.wait_for(Conn.open(host, port), connect_timeout)
        except Exception as e:  # noqa: BLE001 - counted, the phase goes on
            res.error(f"connect {type(e).__name__}")
            return
        try:
            for req in seq:
                status, _ = await conn.call(req)
                t1 = time.perf_counter()
                if status != expect:
                    res.error(f"status {status}")
                else:
                    res.latencies.append(t1 - t0)
                t0 = t1
        except Exception as e:  # noqa: BLE001
            res.error(f"io {type(e).__name__}")
        finally:
            conn.close()

    tasks = [asyncio.create_task(one(seq)) for seq in reqs]
    await asyncio.sleep(0.05)
    cpu0 = cpu_seconds(pid) if pid else None
    t0 = time.perf_counter()
    start.set()
    await asyncio.gather(*tasks)
    res.wall_s = time.perf_counter() - t0
    if pid:
        res.server_cpu_s = cpu_seconds(pid) - cpu0
    return res
