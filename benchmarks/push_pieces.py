"""Does the co-located push lose time on a real model's pieces, and would the copy engines do better?

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 benchmarks/push_pieces.py [--model qwen3-8b] [--streams 2]

``peer_push.py`` pushes one flat 4 GiB buffer. Here two processes, one per GPU, hold what the bench's
``colo-pp2-tp2`` holds -- the Megatron PP stage's tensors (the trainer) and the vLLM TP=2 worker's (the
live weights), random bf16 -- open each other's live tensors by CUDA IPC in their own context, and
build the copies the transport builds (``ColocatedRanks.pushes``, ``direct_pairs`` of each bucket's
segments). Timed together, median of 5 rounds after a warm-up:

- ``local``: my trainer's pieces for me, one BatchedCopy on every SM;
- ``push``: my trainer's pieces for the other worker, into its tensors, BatchedCopy on a quarter of the
  SMs (the transport's choice); ``push+local``: both at once, the rest of the SMs copying locally (what
  a step runs);
- ``ce-push``: the same pushes by the copy engines -- each pair's 2-D byte runs as cudaMemcpyAsync or
  cudaMemcpy2DAsync (CuPy's runtime calls), round-robin over ``--streams`` streams; ``ce-push+local``;
- ``mix+local``: copy engines for the runs of at least ``--ce-min`` bytes, the kernel for the rest.

After each variant every worker's tensors are compared, bit for bit, with what they must hold, built by
another path (the other trainer's pieces pulled, by the kernel): ``verified``. Prints a line per GPU and
the JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.multiprocessing as mp
from two_gpu_timing import beside, timed_together  # beside this script


def _member(rank: int, port: int, args, descs, out) -> None:
    import cupy

    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES
    from weightsync.plan.planner import DEFAULT_BUCKET_BYTES, Planner
    from weightsync.spec import load_spec
    from weightsync.transport.batch_copy import BatchedCopy, _runs
    from weightsync.transport.colocated import ColocatedRanks, copy_programs
    from weightsync.transport.group import new_group
    from weightsync.payload.pack import direct_pairs, segments
    from weightsync.transport.share import export_tensors, import_tensors

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    g = new_group("127.0.0.1", port, rank, 2, "nccl", 120, device=dev)
    spec = load_spec(args.model)
    src_e, dst_e = make_layout(spec, "megatron:pp=2"), make_layout(spec, "vllm:tp=2")
    ranks = ColocatedRanks(2, 2, 1, push=True)
    planner = Planner(src_e, dst_e, 1, topology=ranks.topology, bucket_bytes=DEFAULT_BUCKET_BYTES)

    def alloc(layout) -> dict[str, torch.Tensor]:
        return {n: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=dev) for n, t in layout.tensors.items()}

    trainer, live = alloc(src_e.layout(rank)), alloc(dst_e.layout(rank))
    gen = torch.Generator(device=dev).manual_seed(rank)
    for t in trainer.values():
        t.copy_(torch.randn(t.shape, generator=gen, device=dev, dtype=torch.float32))
    descs[rank].put({"live": export_tensors(live), "trainer": export_tensors(trainer)})
    opened = descs[2 + rank].get(timeout=120)
    other, other_trainer = (import_tensors(opened[k], cuda_device=rank) for k in ("live", "trainer"))
    me = ranks.infer(0, rank)
    send = {t: planner.send_plan(t) for t in ranks.send_plan_ranks(me)}
    pushes = ranks.pushes(me, send)
    push_pairs = [p for bs in pushes.values() for b in bs for p in direct_pairs(segments(b), trainer, other)]
    mine = [b for bs in planner.recv_plan(0, rank).values() for b in bs]
    local_pairs = [p for b in mine if b.src_rank == rank for p in direct_pairs(segments(b), trainer, live)]
    # what my tensors must hold, by another path: the other trainer's pieces pulled, mine copied
    expected = {n: torch.full_like(t, float("nan")) for n, t in live.items()}
    BatchedCopy([p for b in mine
                 for p in direct_pairs(segments(b), trainer if b.src_rank == rank else other_trainer, expected)]).run()
    local_cap, push_cap = copy_programs(dev, True, False)
    local_all, local_rest = BatchedCopy(local_pairs), BatchedCopy(local_pairs, programs=local_cap)
    push_kernel = BatchedCopy(push_pairs, programs=push_cap)

    def pair_runs(d: torch.Tensor, s: torch.Tensor) -> list:
        """The pair's 2-D byte runs (src, dst, rows, row_bytes, src_stride, dst_stride), shaped alike first
        as BatchedCopy does."""
        if d.shape != s.shape:
            try:
                s = s.view(d.shape)
            except RuntimeError:
                d = d.view(s.shape)
        got = _runs(d, s)
        assert got is not None, (d.shape, d.stride(), s.stride())
        return got

    per_pair = [(p, pair_runs(*p)) for p in push_pairs]
    runs = [r for _, rs in per_pair for r in rs]
    big = [r for _, rs in per_pair if sum(r[2] * r[3] for r in rs) >= args.ce_min for r in rs]
    small = [p for p, rs in per_pair if sum(r[2] * r[3] for r in rs) < args.ce_min]
    small_kernel = BatchedCopy(small, programs=push_cap) if small else None
    streams = [torch.cuda.Stream(dev) for _ in range(args.streams)]
    rt = cupy.cuda.runtime

    def engines(which: list) -> None:
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        for k, (src, dst, rows, row, sst, dst_st) in enumerate(which):
            handle = streams[k % len(streams)].cuda_stream
            if rows == 1:
                rt.memcpyAsync(dst, src, row, rt.memcpyDefault, handle)
            else:
                rt.memcpy2DAsync(dst, dst_st, src, sst, row, rows, rt.memcpyDefault, handle)
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)

    def mix() -> None:
        if small_kernel is not None:
            small_kernel.run()
        engines(big)

    side = torch.cuda.Stream(dev)
    variants = {
        "local": local_all.run,
        "push": push_kernel.run,
        "push+local": lambda: beside(side, local_rest.run, push_kernel.run),
        "ce-push": lambda: engines(runs),
        "ce-push+local": lambda: beside(side, local_all.run, lambda: engines(runs)),
        "mix+local": lambda: beside(side, local_rest.run, mix),
    }
    res: dict = {"push_bytes": push_kernel.nbytes, "local_bytes": local_all.nbytes, "push_pairs": len(push_pairs),
                 "runs": len(runs), "ce_runs_in_mix": len(big), "kernel_pairs_in_mix": len(small)}

    def barrier() -> None:
        torch.cuda.synchronize()
        g.allreduce([torch.zeros(1, device=dev)]).wait()
        torch.cuda.synchronize()

    def poison() -> None:  # then a barrier: the other worker pushes into my tensors only after it
        for t in live.values():
            t.fill_(float("nan"))
        barrier()

    checks = {}
    poison()
    for name, fn in variants.items():
        res[name] = timed_together(fn, g, dev)
        if name != "local":  # my tensors: the other worker's pushes (it is done: barrier) and my own pieces
            barrier()
            local_all.run()
            torch.cuda.synchronize()
            checks[name] = all(torch.equal(t.view(torch.int16), expected[n].view(torch.int16)) for n, t in live.items())
            poison()
    res["verified"] = checks
    out.put((rank, res))
    descs[4].get(timeout=300)  # stay alive (the peer holds mappings of my memory) until told


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--ce-min", type=int, default=8 << 20, help="mix: runs of at least this many bytes by copy engine")
    args = p.parse_args()
    from weightsync.transport.group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    descs = [ctx.Queue() for _ in range(5)]  # 0, 1: exported by rank r; 2, 3: for rank r; 4: done
    port = free_port()
    procs = [ctx.Process(target=_member, args=(r, port, args, descs, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    for r in range(2):
        descs[2 + r].put(descs[1 - r].get(timeout=300))
    got = dict(q.get(timeout=900) for _ in procs)
    for _ in procs:
        descs[4].put(None)
    for pr in procs:
        pr.join()
    for r, res in sorted(got.items()):
        gb = res["push_bytes"] / 1e9
        print(f"GPU {r} ({args.model}, {gb:.2f} GB pushed, {res['push_pairs']} pairs, {res['runs']} runs; verified "
              f"{res['verified']}): " + ", ".join(
                  f"{k} {v * 1e3:.2f} ms ({(res['local_bytes'] if k == 'local' else res['push_bytes']) / 1e9 / v:.0f} GB/s)"
                  for k, v in res.items() if isinstance(v, float)))
    print(json.dumps({"model": args.model, "streams": args.streams, "ce_min": args.ce_min, **{str(k): v for k, v in got.items()}}))


if __name__ == "__main__":
    main()
