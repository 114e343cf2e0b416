"""How long a co-located step's CPU signals take on this host, one hop at a time.

    python benchmarks/signals.py [--rounds 200]

A co-located step is: the trainer announces `written` (HTTP POST to the MetaServer), the reader's
long poll wakes, the reader hands the step to its workers (a pipe each), the workers copy, answer back.
This times each hop between processes, with time.perf_counter (CLOCK_MONOTONIC, shared by the
processes of one host), against the alternatives a one-host job could use instead:

- ``http``: POST written -> the reader's wait_written long poll returns (what runs now)
- ``shm-spin``: the trainer stores the step in shared memory -> a process spinning on it sees it
- ``shm-sleep``: the same, the waiter sleeping 50 us between looks
- ``pipe``: one pipe message to an idle process blocked in recv (the reader -> worker hand-over)

Each line: median and 90th percentile of the one-way latency, in microseconds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import struct
import time
from multiprocessing import shared_memory


def _stats(name: str, lat: list[float]) -> None:
    lat = sorted(x * 1e6 for x in lat)
    print(f"{name:10s} median {statistics.median(lat):7.1f} us  p90 {lat[int(len(lat) * 0.9)]:7.1f} us  "
          f"(n={len(lat)})", flush=True)


def _http_waiter(url: str, rounds: int, q) -> None:
    from weightsync.meta.client import MetaClient

    c = MetaClient(url, "sig")
    c.health()
    q.put("ready")
    for step in range(1, rounds + 1):
        c.wait_written(step, n=1, timeout=30)
        q.put(time.perf_counter())


def _shm_waiter(name: str, rounds: int, q, sleep_s: float) -> None:
    shm = shared_memory.SharedMemory(name=name)
    q.put("ready")
    for step in range(1, rounds + 1):
        while struct.unpack_from("q", shm.buf, 0)[0] < step:
            if sleep_s:
                time.sleep(sleep_s)
        q.put(time.perf_counter())
    shm.close()


def _pipe_waiter(conn, rounds: int, q) -> None:
    q.put("ready")
    for _ in range(rounds):
        conn.recv_bytes()
        q.put(time.perf_counter())


def _drive(kind: str, rounds: int, start, signal) -> list[float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=start[0], args=(*start[1], rounds, q, *start[2]))
    p.start()
    assert q.get(timeout=60) == "ready"
    lat = []
    for step in range(1, rounds + 1):
        time.sleep(0.002)  # the waiter is blocked (or spinning) before the signal, as in a step
        t0 = time.perf_counter()
        signal(step)
        lat.append(q.get(timeout=30) - t0)
    p.join(30)
    return lat[rounds // 10:]  # drop warm-up


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    a = ap.parse_args()
    from weightsync.meta.client import MetaClient
    from weightsync.meta.server import MetaServer

    with MetaServer(port=0) as server:
        c = MetaClient(server.url, "sig")
        c.register("train", 0)
        _stats("http", _drive("http", a.rounds, (_http_waiter, (server.url,), ()), lambda s: c.written(s, 0)))
    shm = shared_memory.SharedMemory(create=True, size=8)
    try:
        for kind, sleep_s in (("shm-spin", 0.0), ("shm-sleep", 50e-6)):
            struct.pack_into("q", shm.buf, 0, 0)
            _stats(kind, _drive(kind, a.rounds, (_shm_waiter, (shm.name,), (sleep_s,)),
                                lambda s: struct.pack_into("q", shm.buf, 0, s)))
    finally:
        shm.close()
        shm.unlink()
    parent, child = mp.get_context("spawn").Pipe()
    _stats("pipe", _drive("pipe", a.rounds, (_pipe_waiter, (child,), ()), lambda s: parent.send_bytes(b"x" * 64)))


if __name__ == "__main__":
    main()
