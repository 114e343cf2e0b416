"""Could co-located workers move their cross-GPU bytes by copying straight into (or out of) each
other's memory -- CUDA IPC plus NVLink peer access -- instead of NCCL send/recv through buffers?

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 benchmarks/peer_push.py [--gib 4]

Two processes, one per GPU; each moves ``--gib`` to the other, both at once (what a co-located
PP=2 -> TP=2 step does). Each exports its buffers (:mod:`weightsync.transport.share`) and opens the
peer's, in its OWN device's context (no CUDA context on the peer GPU) when that works, else on the
peer's device. Timed, median of 5 rounds after a warm-up (CUDA events, a barrier before each):

- ``nccl``: a send and a receive per NCCL group, 256 MiB messages, window 2 (the transport today);
- ``push`` / ``pull``: one BatchedCopy on my SMs, my memory -> the peer's / the peer's -> mine;
- ``ce`` / ``ce-pull``: copy engines, ``dst.copy_(src)`` per 256 MiB (cudaMemcpyAsync), push / pull;
- ``push-strided``: the column halves of [rows, 2 x 12 KiB] bf16 rows into contiguous rows (what the
  sender packs today: the TP halves of Megatron's row-parallel weights);
- ``X+local``: X, and a same-GPU ``--gib`` copy (all SMs) on a second stream, at once;
- ``push-P`` / ``pull-P``: on at most P CTAs;
- ``ce-pull-1.5M-graph`` / ``-8M-graph``: the copy engines pulling in 1.5 / 8 MiB copies, replayed
  from a CUDA graph (30B's expert halves are 1.5 MiB runs).

The receiver checks the bytes that arrived against the sender's generator. Prints a line per GPU and
the JSON; also the GPU memory each process holds per GPU (nvidia-smi), to see what opening costs.
"""

from __future__ import annotations

import argparse
import json
import subprocess

import torch
import torch.multiprocessing as mp
from two_gpu_timing import beside, timed_together  # beside this script

MSG = 256 << 20
RUN = 40 << 20


def _member(rank: int, port: int, gib: float, enable_peer: bool, descs, out) -> None:
    from weightsync.transport.batch_copy import BatchedCopy
    from weightsync.transport.group import new_group
    from weightsync.transport.share import export_tensors, import_tensors

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    peer = 1 - rank
    g = new_group("127.0.0.1", port, rank, 2, "nccl", 120, device=dev)
    g.allreduce([torch.zeros(1, device=dev)]).wait()
    n = int(gib * 2**30) // MSG * MSG
    gen = torch.Generator(device=dev).manual_seed(1000 + rank)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev, generator=gen)
    dst = torch.zeros(n, dtype=torch.uint8, device=dev)
    local_src = torch.empty(n, dtype=torch.uint8, device=dev).random_()
    local_dst = torch.empty(n, dtype=torch.uint8, device=dev)
    descs[rank].put(export_tensors({"dst": dst, "src": src}))
    desc = descs[2 + rank].get(timeout=120)
    res: dict = {"bytes_each_way": n}
    try:  # open the peer's memory in my own context: lazy peer access, no context on its GPU
        opened = import_tensors(desc, cuda_device=rank)
        res["opened_in"] = "own context"
    except RuntimeError as e:
        res["own_context_error"] = str(e).splitlines()[0]
        opened = import_tensors(desc)
        res["opened_in"] = "peer context"
    peer_dst, peer_src = opened["dst"], opened["src"]
    if enable_peer:  # explicitly (torch enables it on a cross-device copy; this makes a context on the peer)
        torch.empty(1, device=dev).copy_(torch.empty(1, device=torch.device("cuda", peer)))
    # else: the IPC mapping was opened with cudaIpcMemLazyEnablePeerAccess (torch's flag), nothing else
    torch.cuda.synchronize()

    def runs(d: torch.Tensor, s: torch.Tensor) -> list:
        return [(d[i : i + RUN], s[i : i + RUN]) for i in range(0, n, RUN)]

    push = BatchedCopy(runs(peer_dst, src))
    pull = BatchedCopy(runs(dst, peer_src))
    local = BatchedCopy(runs(local_dst, local_src))
    capped = {p: BatchedCopy(runs(peer_dst, src), programs=p) for p in (16, 33, 66)}
    pull_capped = {p: BatchedCopy(runs(dst, peer_src), programs=p) for p in (33, 66)}
    row = 6144  # bf16 elements: a 12 KiB half of a 24 KiB row
    rows = n // (4 * row)  # bytes: rows x 2 halves x row x 2 bytes = n
    half = src.view(torch.bfloat16)[: rows * 2 * row].view(rows, 2 * row)[:, :row]
    strided = BatchedCopy([(peer_dst.view(torch.bfloat16)[: rows * row].view(rows, row), half)])
    side = torch.cuda.Stream(dev)

    def nccl() -> None:
        pending = []
        for k in range(0, n, MSG):
            if len(pending) == 2:
                pending.pop(0).wait()
            g._start_coalescing(dev)
            g.send([src[k : k + MSG]], peer, 0)
            g.recv([dst[k : k + MSG]], peer, 0)
            pending.append(g._end_coalescing(dev))
        for w in pending:
            w.wait()

    def ce() -> None:
        for k in range(0, n, MSG):
            peer_dst[k : k + MSG].copy_(src[k : k + MSG], non_blocking=True)

    def ce_pull() -> None:
        for k in range(0, n, MSG):
            dst[k : k + MSG].copy_(peer_src[k : k + MSG], non_blocking=True)

    local_99 = BatchedCopy(runs(local_dst, local_src), programs=99)

    def graphed(fn) -> torch.cuda.CUDAGraph:
        fn()  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
        return graph

    def ce_pull_runs(run: int):
        def copies() -> None:
            for k in range(0, n - run + 1, run):
                dst[k : k + run].copy_(peer_src[k : k + run], non_blocking=True)
        return copies

    ce_small = graphed(ce_pull_runs(3 << 19))  # 1.5 MiB: a 30B expert's gate or up half for TP=2
    ce_8m = graphed(ce_pull_runs(8 << 20))

    def with_local(fn, loc=local) -> None:
        beside(side, loc.run, fn)

    def timed(fn) -> float:
        return timed_together(fn, g, dev)

    expect = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev,
                           generator=torch.Generator(device=dev).manual_seed(1000 + peer))
    checks = {}
    for name, fn in (("nccl", nccl), ("push", push.run), ("pull", pull.run), ("ce", ce),
                     ("local", local.run), ("push+local", lambda: with_local(push.run)),
                     ("nccl+local", lambda: with_local(nccl)), ("push-strided", strided.run),
                     ("ce-pull", ce_pull), ("pull+local", lambda: with_local(pull.run)),
                     ("ce-pull+local", lambda: with_local(ce_pull)),
                     ("pull-33+local", lambda: with_local(pull_capped[33].run)),
                     ("pull-33+local-99", lambda: with_local(pull_capped[33].run, local_99)),
                     ("push-33+local-99", lambda: with_local(capped[33].run, local_99)),
                     ("ce-pull-1.5M-graph", ce_small.replay), ("ce-pull-8M-graph", ce_8m.replay),
                     ("ce-pull-8M-graph+local-99", lambda: with_local(ce_8m.replay, local_99)),
                     *((f"push-{p}", b.run) for p, b in capped.items()),
                     *((f"pull-{p}", b.run) for p, b in pull_capped.items())):
        dst.zero_()
        torch.cuda.synchronize()
        g.allreduce([torch.zeros(1, device=dev)]).wait()
        res[name] = timed(fn)
        g.allreduce([torch.zeros(1, device=dev)]).wait()
        torch.cuda.synchronize()
        if name in ("nccl", "push", "ce", "pull", "ce-pull"):  # the peer's bytes, all of them, in my dst
            checks[name] = bool(torch.equal(dst, expect))
    res["verified"] = checks
    res["strided_bytes"] = rows * row * 2  # push-strided moves half as much
    out.put((rank, res))
    descs[4].get(timeout=300)  # stay alive (the peer holds mappings of my memory) until told


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--enable-peer", action="store_true", help="enable peer access by a cross-device copy")
    args = p.parse_args()
    from weightsync.transport.group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    descs = [ctx.Queue() for _ in range(5)]  # 0, 1: exported by rank r; 2, 3: for rank r; 4: done
    port = free_port()
    procs = [ctx.Process(target=_member, args=(r, port, args.gib, args.enable_peer, descs, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    for r in range(2):
        descs[2 + r].put(descs[1 - r].get(timeout=120))
    got = dict(q.get(timeout=600) for _ in procs)
    mem = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory", "--format=csv"],
                         capture_output=True, text=True).stdout
    for _ in procs:
        descs[4].put(None)
    for pr in procs:
        pr.join()
    for r, res in sorted(got.items()):
        def gb(k: str) -> float:
            return (res["strided_bytes"] if k == "push-strided" else res["bytes_each_way"]) / 1e9

        print(f"GPU {r} ({res['opened_in']}; verified {res['verified']}): " + ", ".join(
            f"{k} {v * 1e3:.2f} ms ({gb(k) / v:.0f} GB/s)" for k, v in res.items() if isinstance(v, float)))
    print("memory per process and GPU:\n" + mem)
    print(json.dumps(got))


if __name__ == "__main__":
    main()
