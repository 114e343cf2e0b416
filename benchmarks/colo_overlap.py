"""What bounds a co-located PP=2 -> TP=2 step: NVLink both ways, same-GPU copies, or the two together.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 benchmarks/colo_overlap.py [--gib 4] [--mib 256]

Each of two GPUs sends ``--gib`` to the other and receives as much (a send and a receive per NCCL
group, ``--mib`` messages, window 2: how the co-located transport moves cross-GPU buckets) and copies
``--gib`` within itself (one BatchedCopy of 40 MB runs: the same-GPU half). Timed three ways: the
NVLink traffic alone, the copy alone, and both at once with the copy on a side stream. Median of 5
rounds after a warm-up, CUDA events; then the copy alone and both again with the copy on at most
33, 66 or 132 CTAs (the rest of the SMs left to NCCL).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.multiprocessing as mp
from two_gpu_timing import beside, timed_together  # beside this script


def _member(rank: int, port: int, gib: float, mib: int, out) -> None:
    from weightsync.transport.batch_copy import BatchedCopy
    from weightsync.transport.group import new_group

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    g = new_group("127.0.0.1", port, rank, 2, "nccl", 120, device=dev)
    g.allreduce([torch.zeros(1, device=dev)]).wait()  # the whole-group communicator, for coalescing
    msg = mib << 20
    n = int(gib * 2**30) // msg
    src = torch.empty(n * msg, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty(n * msg, dtype=torch.uint8, device=dev)
    local_src = torch.empty(n * msg, dtype=torch.uint8, device=dev).random_()
    local_dst = torch.empty(n * msg, dtype=torch.uint8, device=dev)
    run = 40 << 20
    pairs = [(local_dst[i : i + run], local_src[i : i + run]) for i in range(0, n * msg - run + 1, run)]
    batch = BatchedCopy(pairs)
    capped = {p: BatchedCopy(pairs, programs=p) for p in (33, 66, 132)}  # at most p CTAs copying
    side = torch.cuda.Stream(dev)
    peer = 1 - rank

    def link() -> None:
        pending = []
        for k in range(n):
            if len(pending) == 2:
                pending.pop(0).wait()
            g._start_coalescing(dev)
            g.send([src[k * msg : (k + 1) * msg]], peer, 0)
            g.recv([dst[k * msg : (k + 1) * msg]], peer, 0)
            pending.append(g._end_coalescing(dev))
        for w in pending:
            w.wait()

    def copy() -> None:
        batch.run()

    def both(b=batch) -> None:
        beside(side, b.run, link)

    def timed(fn) -> float:
        return timed_together(fn, g, dev)

    res = {"bytes_each_way": n * msg, "local_bytes": len(pairs) * run}
    for name, fn in (("link", link), ("copy", copy), ("both", both)):
        res[name] = timed(fn)
    for p, b in capped.items():
        res[f"copy-{p}"] = timed(b.run)
        res[f"both-{p}"] = timed(lambda b=b: both(b))
    out.put((rank, res))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--mib", type=int, default=256)
    args = p.parse_args()
    from weightsync.transport.group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_member, args=(r, port, args.gib, args.mib, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    got = dict(q.get(timeout=300) for _ in procs)
    for pr in procs:
        pr.join()
    for r, res in sorted(got.items()):
        gb = res["bytes_each_way"] / 1e9
        print(f"GPU {r}: link {res['link']*1e3:.2f} ms ({gb / res['link']:.0f} GB/s each way), "
              f"copy {res['copy']*1e3:.2f} ms ({res['local_bytes'] / 1e9 / res['copy']:.0f} GB/s), "
              f"both {res['both']*1e3:.2f} ms (sum {1e3*(res['link'] + res['copy']):.2f}, "
              f"max {1e3*max(res['link'], res['copy']):.2f}); with the copy on at most P CTAs: "
              + ", ".join(f"P={p} copy {res[f'copy-{p}'] * 1e3:.2f} both {res[f'both-{p}'] * 1e3:.2f}"
                          for p in (33, 66, 132)))
    print(json.dumps(got))


if __name__ == "__main__":
    main()
