"""Predict one planned job's step under several deployments and GPU profiles, planning it once.

``weightsync plan`` plans a job for each prediction (Kimi-K2 256 -> 128: ~1.5 min of CPU each); this plans the
job once per inference layout, exactly as ``weightsync plan`` does (weightsync/cli.py ``_plan``: the same
planner, block alignment, topology and budget), counts every worker's descriptors and messages once
(plan.descriptors.count_workers) and calls predict.simulate.predict_step for each transport, codec and profile.
The bf16 layout gives the full and delta rows; ``--fp8-infer`` (the engine served in FP8) the FP8 rows.

    python benchmarks/plan_predictions.py --out benchmarks/results/<date>-plan-kimi-k2-256to128-<commit>.json

Defaults: the Kimi-K2 job of BENCHMARKS.md "2026-12-02: FP8 codec costs" (Megatron TP=8 PP=8 EP=32 DP=4, TE spec,
256 GPUs -> 8 x vLLM TP=16 EP=16, 128 GPUs, 8 GPUs a host).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

log = logging.getLogger("weightsync")

ROOT = Path(__file__).resolve().parent.parent


def plan_job(model: str, train: str, infer: str, instances: int, gpus_per_host: int, budget: int):
    """The planner and every receiving worker's plans, as ``weightsync plan`` makes them."""
    from weightsync.engines import make_layout
    from weightsync.plan.job import block_aligned
    from weightsync.plan.planner import Planner
    from weightsync.plan.topology import Topology
    from weightsync.spec import load_spec

    spec = load_spec(model)
    src, dst = make_layout(spec, train), make_layout(spec, infer)
    if getattr(dst.config, "quant", 0):
        from weightsync.quant.layout import fp8_layout

        fp8_layout(dst)  # the engine's own refusal first, as the CLI
    topo = Topology.separated(src.world_size, dst.world_size, instances, gpus_per_host)
    planner = Planner(src, dst, instances, topo, bucket_bytes=budget, block_aligned=block_aligned(spec, dst))
    plans = {}
    for rank in range(dst.world_size):
        for inst in range(instances):
            plans.update(planner.recv_plan(inst, rank))
    return planner, plans


def predictions(planner, plans, rows, gpus) -> list[dict]:
    """predict_step for each (transport, codec, changed) of ``rows`` under each profile of ``gpus``."""
    from weightsync.plan.descriptors import count_workers
    from weightsync.predict.simulate import Deployment, cost_model, predict_step

    t0 = time.process_time()
    counts = count_workers(planner, plans)
    log.info("counted in %.1f s of CPU", time.process_time() - t0)
    buckets = [b for bs in plans.values() for b in bs]
    sent: dict[int, int] = defaultdict(int)
    for b in buckets:
        sent[b.src_rank] += b.nbytes
    out = []
    for transport, codec, changed in rows:
        for gpu in gpus:
            for receiver in ("faithful", "vllm"):
                t0 = time.process_time()
                d = Deployment(transport, receiver, codec, changed)
                p = predict_step(buckets, planner.topology, counts, d, cost_model(gpu), planner.spec)
                row = {"transport": transport, "codec": codec, "changed": changed if codec == "delta" else None,
                       "receiver": receiver, "gpu": gpu, "deployment": asdict(d.on(planner.topology)),
                       "prediction": asdict(p), "predict_cpu_seconds": time.process_time() - t0}
                if codec == "delta":  # what the encode was charged before (the busiest rank's bytes / instances)
                    r = cost_model(gpu).delta_at(changed)
                    row["encode_sent_over_instances_s"] = max(sent.values()) / planner.instances / r.encode_bytes_per_s
                out.append(row)
                log.info("%s %s %s %s %s: %.4f s", transport, codec, changed, receiver, gpu, p.seconds)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT.parent / "shared" / "model-configs" / "kimi-k2.json"))
    ap.add_argument("--train", default="megatron:tp=8,pp=8,ep=32,dp=4,pp_first=5,te=1,grouped=1")
    ap.add_argument("--infer", default="vllm:tp=16,ep=16")
    ap.add_argument("--fp8-infer", default="vllm:tp=16,ep=16,quant=fp8", help="the FP8 rows' engine ('' to skip)")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--gpus-per-host", type=int, default=8)
    ap.add_argument("--budget", type=int, default=256 << 20)
    ap.add_argument("--changed", type=float, nargs="+", default=[0.01], help="delta: the fractions changed a step")
    ap.add_argument("--gpu", nargs="+", default=["h200", "h100"], help="the profiles (predict.simulate.GPUS)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"model": args.model, "train": args.train, "instances": args.instances, "gpus_per_host": args.gpus_per_host,
              "budget": args.budget, "commit": commit, "layouts": []}
    layouts = [(args.infer, [(t, "full", None) for t in ("p2p", "nixl")]
                + [(t, "delta", f) for t in ("p2p", "nixl") for f in args.changed])]
    if args.fp8_infer:
        layouts.append((args.fp8_infer, [(t, "fp8", None) for t in ("p2p", "nixl")]))
    for infer, rows in layouts:
        t0 = time.process_time()
        planner, plans = plan_job(args.model, args.train, infer, args.instances, args.gpus_per_host, args.budget)
        planned = time.process_time() - t0
        log.info("%s planned in %.1f s of CPU", infer, planned)
        result["layouts"].append({"infer": infer, "plan_cpu_seconds": planned,
                                  "buckets": sum(len(bs) for bs in plans.values()),
                                  "rows": predictions(planner, plans, rows, args.gpu)})
        del planner, plans
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
