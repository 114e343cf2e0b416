"""The checksum's rate on a GPU, the one-pass Triton kernel against the torch reductions, and their bits.

    python benchmarks/checksum_speed.py --model qwen3-8b --out checksum.json

Both paths in one process (``WEIGHTSYNC_FAST_CHECKSUM`` toggled between them), the device synchronised
around each timed call, median of ``--repeat``:

- one 256 MiB bucket (``codec.checksum``, with its host read, as the delta proof and sender call it),
  and the kernel's device time alone (CUDA events, 8 calls back to back, four buffers in rotation);
- 4 GiB of 4096 x 12288 bf16 weights, whole and as column halves (a row-parallel shard's source boxes),
  all regions in one ``checksums`` call;
- many small regions (2,000 of 64 KiB) in one call;
- a model's nixl-1gpu bucket lists: the receiver's proof over every bucket's in-place targets (as
  the nixl frame reads prove them) and the sender's checksum of every packed bucket;
- the colo-1gpu integrity sums of one step (``step_sums``) on the trainer's and the worker's side;
- a device copy of 1 GiB (bytes copied a second) as the ceiling.

Every fast result is compared with the torch path's on the device and with the CPU's, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _mode(fast: bool) -> None:
    os.environ["WEIGHTSYNC_FAST_CHECKSUM"] = "1" if fast else "0"


def timed(fn, repeat: int, sync) -> float:
    fn()
    out = []
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=int, default=1, help="divide every size by this (a CPU dry run)")
    args = ap.parse_args(argv)
    k = args.scale

    from weightsync.delta import codec
    from weightsync.integrity import fastsum
    from weightsync.integrity.digest import checksum, checksums, to_ints

    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(7)
    row: dict = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__, "fast_available": None}
    _mode(True)
    row["fast_available"] = fastsum.enabled()
    same: dict[str, bool] = {}

    def both(name, fn, nbytes, repeat=args.repeat):
        out = {}
        for fast in (False, True):
            _mode(fast)
            out["fast" if fast else "torch"] = t = timed(fn, repeat, sync)
            out[("fast" if fast else "torch") + "_bytes_per_s"] = nbytes / t
        _mode(True)
        row[name] = out
        print(name, {k: (f"{v / 1e9:.0f} GB/s" if k.endswith("per_s") else f"{v * 1e3:.2f} ms") for k, v in out.items()},
              flush=True)

    def agree(name, fn):
        _mode(False)
        slow = fn()
        _mode(True)
        fast = fn()
        same[name] = fast == slow
        return fast

    # the ceiling: a device copy
    a = torch.randint(0, 255, ((1 << 30) // k,), dtype=torch.uint8, device=dev, generator=g)
    b = torch.empty_like(a)
    row["copy_bytes_per_s"] = a.numel() / timed(lambda: b.copy_(a), args.repeat, sync)
    print("copy", f"{row['copy_bytes_per_s'] / 1e9:.0f} GB/s", flush=True)
    a = b = None

    # one 256 MiB bucket, four in rotation (each far over the L2)
    nbuf = (256 << 20) // k
    bufs = [torch.randint(0, 255, (nbuf,), dtype=torch.uint8, device=dev, generator=g) for _ in range(4)]
    it = iter(range(1 << 30))
    both("bucket_256MiB", lambda: codec.checksum([bufs[next(it) % 4]]), nbuf)
    for fast in (False, True) if dev.type == "cuda" else ():
        _mode(fast)
        for j in range(8):  # warm: the same calls as timed (Triton compiles a start weight of 1 apart)
            checksum(bufs[j % 4], j)
        sync()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        sums = [checksum(bufs[j % 4], j) for j in range(8)]
        e1.record()
        sync()
        row[f"bucket_256MiB_device_{'fast' if fast else 'torch'}_bytes_per_s"] = 8 * nbuf / (e0.elapsed_time(e1) / 1e3)
        row[f"_sums_{fast}"] = to_ints(sums)
    if dev.type == "cuda":
        same["bucket_256MiB"] = row.pop("_sums_True") == row.pop("_sums_False")
    cpu = codec.checksum([bufs[1].cpu()])
    if dev.type == "cuda":  # the kernel's shape: words a step, warps, words a program
        row["variants"] = {}
        keep = fastsum.BLOCK, fastsum.WARPS, fastsum.TILE
        want = to_ints([checksum(bufs[0], 3)])
        for blk, warps, tile in ((1024, 8, 1 << 16), (2048, 8, 1 << 16), (1024, 4, 1 << 16), (512, 4, 1 << 15),
                                 (2048, 8, 1 << 18), (4096, 16, 1 << 18)):
            fastsum.BLOCK, fastsum.WARPS, fastsum.TILE = blk, warps, tile
            ok = to_ints([checksum(bufs[0], 3)]) == want
            for j in range(8):  # compile every specialisation first (Triton specialises an int argument of 1)
                checksum(bufs[j % 4], j)
            sync()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for j in range(8):
                checksum(bufs[j % 4], j)
            e1.record()
            sync()
            row["variants"][f"{blk}x{warps}x{tile}"] = {"bytes_per_s": 8 * nbuf / (e0.elapsed_time(e1) / 1e3), "same": ok}
        fastsum.BLOCK, fastsum.WARPS, fastsum.TILE = keep
        print("variants", {k: f"{v['bytes_per_s'] / 1e9:.0f} GB/s {v['same']}" for k, v in row["variants"].items()})
    same["bucket_256MiB_cpu"] = agree("bucket_256MiB_codec", lambda: codec.checksum([bufs[1]])) == cpu
    print("device only", {k: f"{v / 1e9:.0f} GB/s" for k, v in row.items() if k.startswith("bucket_256MiB_device")})
    bufs = None

    # 4 GiB of weights, whole and as column halves, one call
    ts = [torch.randn((4096 // k, 12288), device=dev, generator=g).to(torch.bfloat16) for _ in range(43)]
    nb = sum(t.numel() * 2 for t in ts)
    bases = [k * (1 << 26) for k in range(len(ts))]
    both("weights_4GiB", lambda: to_ints(list(checksums(ts, bases))), nb, 5)
    halves = [t[:, 6144:] for t in ts]
    both("column_halves_2GiB", lambda: to_ints(list(checksums(halves, bases))), nb // 2, 5)
    same["weights_cpu"] = agree("weights", lambda: to_ints(list(checksums(ts[:3], bases[:3])))) == \
        to_ints(list(checksums([t.cpu() for t in ts[:3]], bases[:3])))
    same["column_halves_cpu"] = agree("column_halves", lambda: to_ints(list(checksums(halves[:3], bases[:3])))) == \
        to_ints(list(checksums([h.cpu() for h in halves[:3]], bases[:3])))
    ts = halves = None

    # many small regions in one call
    small = [torch.randint(-(2**62), 2**62, (8192 // k,), dtype=torch.int64, device=dev, generator=g) for _ in range(2000)]
    sb = [k * 8192 + 3 for k in range(len(small))]
    both("small_2000x64KiB", lambda: to_ints(list(checksums(small, sb))), 2000 * 65536 // k)
    same["small_cpu"] = agree("small", lambda: to_ints(list(checksums(small, sb)))) == \
        to_ints(list(checksums([s.cpu() for s in small], sb)))
    small = None

    # a model's bucket lists (nixl-1gpu: hf -> vllm:tp=1) and one step's integrity sums (colo-1gpu plan)
    from weightsync.bench.scenarios import init_weights
    from weightsync.codec.delta import active

    def _buckets(plans):
        return [b for bs in active(plans).values() for b in bs]

    from weightsync.codec.delta_state import gather_pairs
    from weightsync.engines import make_layout
    from weightsync.integrity.sums import destination_dtypes, step_sums, sum_plan
    from weightsync.layout.materialize import TORCH_DTYPES
    from weightsync.plan.planner import Planner
    from weightsync.plan.topology import Topology
    from weightsync.spec import load_spec
    from weightsync.payload.pack import copy_pairs, pack, stage

    spec = load_spec(args.model)
    src, dst = make_layout(spec, "hf"), make_layout(spec, "vllm:tp=1")
    planner = Planner(src, dst, 1, Topology.colocated(1, 1, 1))
    send, recv = planner.send_plan(0), planner.recv_plan(0, 0)
    lay_s, lay_r = src.layout(0), dst.layout(0)
    tens = {n: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=dev) for n, t in lay_s.tensors.items()}
    targ = {n: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=dev) for n, t in lay_r.tensors.items()}
    init_weights(lay_s, tens, spec)
    init_weights(lay_r, targ, spec)
    sbuckets, rbuckets = _buckets(send), _buckets(recv)
    total = sum(x.nbytes for x in rbuckets)
    slot = torch.empty(max(x.nbytes for x in rbuckets), dtype=torch.uint8, device=dev)
    row["model"] = {"name": args.model, "bytes": total, "buckets_sent": len(sbuckets), "buckets_received": len(rbuckets)}

    staged = {}
    for bk in rbuckets:
        staged[bk.index, bk.pair] = stage(bk, targ, False)

    def proof():
        out = []
        for bk in rbuckets:
            st = staged[bk.index, bk.pair]
            if st.staged:
                copy_pairs(gather_pairs(st.staged, targ, slot))
            out.append(codec.checksum(st.tensors(slot)))
        return out

    both("proof_all_buckets", proof, total, 3)
    agree("proof", proof)
    packed = torch.empty(max(x.nbytes for x in sbuckets), dtype=torch.uint8, device=dev)

    def sender():
        out = []
        for x in sbuckets:
            pack(x, tens, out=packed[: x.nbytes])
            out.append(codec.checksum([packed[: x.nbytes]]))
        return out

    both("sender_pack_and_checksum", sender, sum(x.nbytes for x in sbuckets), 3)
    agree("sender", sender)

    cplanner = Planner(src, dst, 1, Topology.colocated(1, 1, 1))
    splans, rplans = cplanner.send_plan(0), cplanner.recv_plan(0, 0)
    sp = sum_plan(splans, tens, sending=True, dst_dtypes=destination_dtypes(cplanner, splans))
    rp = sum_plan(rplans, targ, sending=False)
    both("integrity_trainer_step_sums", lambda: step_sums(sp, tens), total, 3)
    both("integrity_worker_step_sums", lambda: step_sums(rp, targ), total, 3)
    agree("integrity_trainer", lambda: step_sums(sp, tens))
    agree("integrity_worker", lambda: step_sums(rp, targ))
    # trainer and worker hold the same weights here (init_weights from one spec): their bucket sums must agree
    same["integrity_trainer_equals_worker"] = step_sums(sp, tens).buckets == step_sums(rp, targ).buckets
    row["bit_identical"] = same
    print("bit identical", same, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    print(json.dumps(row, default=str))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
