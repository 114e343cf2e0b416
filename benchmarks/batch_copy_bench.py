"""Why BatchedCopy: many device copies as copy_ loops, as one graph, and as one tile-table kernel.

    PYTHONPATH=. python3 benchmarks/batch_copy_bench.py [--repeats 5] [--small]

1. the ceiling: one contiguous copy_ of 4 GiB (bytes copied per second)
2. case A: 400 contiguous copies of 40 MB each
3. case B: 18,000 copies of 1.5 MiB, every third the column half of a [2048, 768] bf16 matrix
Each case four ways: a Python loop of copy_, that loop captured in one CUDA graph, BatchedCopy.run(),
and BatchedCopy.run() captured in a graph. Medians of --repeats after warm-up, timed with CUDA
events; one line per measurement (GB/s of bytes copied, ratio to the ceiling), a JSON summary last.
At most ~35 GB of device memory at once: case B's 28 GB of destinations read from a 6 GiB source
pool in turn (far larger than L2, so no copy reads from cache). --small runs tiny sizes (also on CPU,
without graphs) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from weightsync.transport import batch_copy
from weightsync.transport.batch_copy import BatchedCopy

Pairs = list[tuple[torch.Tensor, torch.Tensor]]

#: the copy kernel's forms (batch_copy.WIDE, batch_copy.STREAM), for --variants
VARIANTS = {"default": (batch_copy.WIDE, batch_copy.STREAM), "masked": (False, False), "wide": (True, False), "stream": (True, True)}


def timed(fn: Callable[[], None], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` after ``warmup`` calls: CUDA events on cuda, the wall clock on cpu."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def captured(fn: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph (after one eager call on the capture's side stream)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def report(results: dict, name: str, way: str, seconds: float, nbytes: int, ceiling: float | None) -> None:
    gbps = nbytes / seconds / 1e9
    ratio = gbps / ceiling if ceiling else 1.0
    results.setdefault(name, {})[way] = {"ms": seconds * 1e3, "gbps": gbps, "ratio": ratio}
    print(f"{name:9s} {way:15s} {nbytes / 1e9:8.2f} GB {seconds * 1e3:9.3f} ms {gbps:9.1f} GB/s {ratio:6.3f} x ceiling",
          flush=True)


def verify(bc: BatchedCopy, pairs: Pairs, dst_buffers: list[torch.Tensor]) -> bool:
    """Poison the destinations, run ``bc`` once, compare every pair with its source."""
    for b in dst_buffers:
        b.fill_(float("nan"))
    bc.run()
    return all(torch.equal(d, s) for d, s in pairs)


def measure_ceiling(device: torch.device, nbytes: int, repeats: int, results: dict) -> float:
    """GB/s of one contiguous copy_ of ``nbytes`` (its buffers are freed on return)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    report(results, "ceiling", "copy_", timed(lambda: dst.copy_(src), device, repeats), src.numel() * 2, None)
    return results["ceiling"]["copy_"]["gbps"]


def run_case(name: str, pairs: Pairs, dst_buffers: list[torch.Tensor], device: torch.device, args,
             ceiling: float, results: dict) -> None:
    nbytes = sum(d.numel() * d.element_size() for d, _ in pairs)

    def loop() -> None:
        for d, s in pairs:
            d.copy_(s)

    graphs = device.type == "cuda"
    if not args.batched_only:
        report(results, name, "loop", timed(loop, device, args.repeats), nbytes, ceiling)
    if graphs and not args.batched_only:
        t0 = time.perf_counter()
        g = captured(loop, device)
        capture_s = time.perf_counter() - t0
        report(results, name, "loop-graph", timed(g.replay, device, args.repeats), nbytes, ceiling)
        del g
    ok = True
    for variant in args.variants.split(","):  # the kernel's forms, each built and timed in turn (read at launch)
        batch_copy.WIDE, batch_copy.STREAM = VARIANTS[variant]
        suffix = "" if variant == "default" else f"-{variant}"
        t0 = time.perf_counter()
        bc = BatchedCopy(pairs, **({"tile_bytes": args.tile_bytes} if args.tile_bytes else {}))
        build_s = time.perf_counter() - t0
        ok = verify(bc, pairs, dst_buffers) and ok
        report(results, name, "batched" + suffix, timed(bc.run, device, args.repeats), nbytes, ceiling)
        if graphs:
            g = captured(bc.run, device)
            report(results, name, "batched-graph" + suffix, timed(g.replay, device, args.repeats), nbytes, ceiling)
            del g
    batch_copy.WIDE, batch_copy.STREAM = VARIANTS["default"]
    results[name].update(copies=len(pairs), bytes=nbytes, tiles=bc.tiles, groups=bc.groups, fallback=bc.fallback,
                         build_s=build_s, verified=ok,
                         **({"loop_capture_s": capture_s} if graphs and not args.batched_only else {}))
    print(f"{name:9s} {len(pairs)} copies -> {bc.tiles} tiles {bc.groups}, built in {build_s:.2f} s, "
          f"verified {ok}", flush=True)
    if not ok:
        raise SystemExit(f"{name}: BatchedCopy did not copy the sources exactly")


def case_a(device: torch.device, copies: int, nbytes: int) -> tuple[Pairs, list[torch.Tensor]]:
    """``copies`` contiguous bf16 copies of ``nbytes`` each, distinct sources and destinations."""
    e = nbytes // 2
    src = torch.empty(copies * e, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return [(dst[i * e : (i + 1) * e], src[i * e : (i + 1) * e]) for i in range(copies)], [dst]


def case_b(device: torch.device, copies: int, rows: int, pool_bytes: int) -> tuple[Pairs, list[torch.Tensor]]:
    """``copies`` copies of rows x 384 bf16: two of every three contiguous, the third a column half of a
    [rows, 768] matrix (left and right halves in turn). Destinations distinct and contiguous; sources
    cycle through a pool: contiguous slices in its first half, matrices in its second."""
    e = rows * 384
    pool = torch.empty(max(pool_bytes // 2, 8 * e), dtype=torch.bfloat16, device=device).normal_()
    half = pool.numel() // 2
    slots, mats = half // e, half // (2 * e)
    dst = torch.empty(copies * e, dtype=torch.bfloat16, device=device)
    pairs: Pairs = []
    n_flat = n_half = 0
    for i in range(copies):
        d = dst[i * e : (i + 1) * e]
        if i % 3 == 2:
            m = (n_half // 2) % mats
            h = n_half % 2
            n_half += 1
            matrix = pool[half + m * 2 * e : half + (m + 1) * 2 * e].view(rows, 768)
            pairs.append((d.view(rows, 384), matrix[:, h * 384 : (h + 1) * 384]))
        else:
            k = n_flat % slots
            n_flat += 1
            pairs.append((d, pool[k * e : (k + 1) * e]))
    return pairs, [dst]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ceiling-gib", type=float, default=4.0)
    p.add_argument("--a-copies", type=int, default=400)
    p.add_argument("--a-mb", type=float, default=40.0)
    p.add_argument("--b-copies", type=int, default=18_000)
    p.add_argument("--b-rows", type=int, default=2048, help="rows of case B's [rows, 768] bf16 matrices")
    p.add_argument("--pool-gib", type=float, default=6.0, help="case B's source pool")
    p.add_argument("--tile-bytes", type=int, default=0, help="BatchedCopy tile size (0: its default)")
    p.add_argument("--block", type=int, default=0, help="the kernel's BLOCK (0: its default)")
    p.add_argument("--warps", type=int, default=0, help="the kernel's num_warps (0: its default)")
    p.add_argument("--variants", default="default",
                   help=f"comma-separated kernel forms to time, each built anew: {', '.join(VARIANTS)}")
    p.add_argument("--batched-only", action="store_true", help="skip the copy_ loops (tuning runs)")
    p.add_argument("--small", action="store_true", help="tiny sizes: check the script (on CPU too)")
    p.add_argument("--json", default="", help="also write the summary here")
    args = p.parse_args()

    batch_copy.BLOCK = args.block or batch_copy.BLOCK  # read at every launch
    batch_copy.NUM_WARPS = args.warps or batch_copy.NUM_WARPS
    results_config = {"block": batch_copy.BLOCK, "warps": batch_copy.NUM_WARPS}
    if args.small:
        args.ceiling_gib, args.a_copies, args.a_mb = 1 / 16, 8, 1.0
        args.b_copies, args.b_rows, args.pool_gib = 60, 128, 1 / 32
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "repeats": args.repeats, **results_config}
    t_start = time.perf_counter()

    ceiling = measure_ceiling(device, int(args.ceiling_gib * 2**30), args.repeats, results)

    for name, build in (("A", lambda: case_a(device, args.a_copies, int(args.a_mb * 1e6))),
                        ("B", lambda: case_b(device, args.b_copies, args.b_rows, int(args.pool_gib * 2**30)))):
        pairs, buffers = build()
        run_case(name, pairs, buffers, device, args, ceiling, results)
        del pairs, buffers
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()

    if device.type == "cuda":
        results["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    results["total_s"] = time.perf_counter() - t_start
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
