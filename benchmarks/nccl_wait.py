"""Why weightsync orders NCCL transfers by CUDA streams: the same bytes, three ways, on two GPUs.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 benchmarks/nccl_wait.py [--gib 16] [--mib 256]

1. one way, CPU-blocking ``work.wait(timeout)`` per message, window 2 (weightsync before)
2. one way, stream-ordered ``work.wait()`` and one CPU wait at the end (weightsync now)
3. both ways at once between the two GPUs: individual send/recv (one pair stream: they serialize)
   vs one NCCL group per (send, recv) pair (coalesced: both directions together)
Prints GB/s per variant (median of 5 rounds after a warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp


def _member(rank: int, port: int, gib: int, mib: int, out) -> None:
    from weightsync.transport.group import new_group

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    g = new_group("127.0.0.1", port, rank, 2, "nccl", 120, device=dev)
    g.allreduce([torch.zeros(1, device=dev)]).wait()  # the whole-group communicator, for coalescing
    msg = mib << 20
    n = (gib << 30) // msg
    bufs = [torch.empty(msg, dtype=torch.uint8, device=dev).random_() for _ in range(2)]
    rbufs = [torch.empty(msg, dtype=torch.uint8, device=dev) for _ in range(2)]
    peer = 1 - rank
    timeout = timedelta(seconds=60)

    def one_way(blocking: bool) -> None:
        pending = []
        for k in range(n):
            if len(pending) == 2:
                w = pending.pop(0)
                w.wait(timeout=timeout) if blocking else w.wait()
            b = bufs[k % 2] if rank == 0 else rbufs[k % 2]
            pending.append(g.send([b], 1, 0) if rank == 0 else g.recv([b], 0, 0))
        for w in pending:
            w.wait(timeout=timeout) if blocking else w.wait()
        torch.cuda.synchronize()

    def both_ways(coalesce: bool) -> None:
        pending = []
        for k in range(n // 2):
            if len(pending) == 2:
                for w in pending.pop(0):
                    w.wait()
            if coalesce:
                g._start_coalescing(dev)
            ws = []
            for who in (0, 1):  # the same order on both ranks: 0 -> 1 first, then 1 -> 0
                if who == rank:
                    ws.append(g.send([bufs[k % 2]], peer, 0))
                else:
                    ws.append(g.recv([rbufs[k % 2]], peer, 0))
            if coalesce:
                ws = [g._end_coalescing(dev)]
            pending.append(ws)
        for ws in pending:
            for w in ws:
                w.wait()
        torch.cuda.synchronize()

    variants = {
        "one way, CPU wait(timeout) per message": lambda: one_way(True),
        "one way, stream-ordered": lambda: one_way(False),
        "both ways, individual send/recv": lambda: both_ways(False),
        "both ways, one NCCL group per send+recv": lambda: both_ways(True),
    }
    for name, fn in variants.items():
        times = []
        for _ in range(6):
            g.allreduce([torch.zeros(1, device=dev)]).wait()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if rank == 0:
            moved = n * msg  # bytes each GPU received (both ways: each sends n/2, receives n/2; link total n)
            out.put((name, moved / statistics.median(times[1:]) / 1e9, statistics.median(times[1:]) * 1e3))


def main() -> None:
    from weightsync.transport.group import free_port

    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=int, default=16)
    p.add_argument("--mib", type=int, default=256)
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_member, args=(r, port, a.gib, a.mib, out)) for r in range(2)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(300)
    print(f"{a.gib} GiB as {a.mib} MiB messages between GPU 0 and GPU 1 (both ways: half each way)")
    while not out.empty():
        name, gbs, ms = out.get()
        print(f"  {name:45s} {ms:8.1f} ms  {gbs:7.1f} GB/s (link total)")


if __name__ == "__main__":
    main()
