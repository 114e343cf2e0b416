"""The ``weightsync`` command line."""

from __future__ import annotations

import argparse
import json
import sys

from weightsync.errors import WeightSyncError


def _plan(args: argparse.Namespace) -> int:
    from weightsync.engines import make_layout
    from weightsync.plan.job import block_aligned
    from weightsync.plan.planner import Planner
    from weightsync.predict.simulate import Deployment, cost_model
    from weightsync.predict.stats import format_stats, job_stats, rank_stats
    from weightsync.plan.topology import Topology
    from weightsync.spec import load_spec

    if args.instances < 1:
        raise WeightSyncError(f"--instances must be at least 1, got {args.instances}")
    spec = load_spec(args.model)
    src, dst = make_layout(spec, args.train), make_layout(spec, args.infer)
    if getattr(dst.config, "quant", 0):  # an FP8-served engine: its weights go as block FP8 (weightsync.codec.fp8)
        from weightsync.quant.layout import fp8_layout

        fp8_layout(dst)  # the engine's own refusal first: a shard that cuts a 128 x 128 block
    make_topo = Topology.colocated if args.colocate else Topology.separated
    topo = make_topo(src.world_size, dst.world_size, args.instances, args.gpus_per_host)
    planner = Planner(src, dst, args.instances, topo, bucket_bytes=args.budget,
                      block_aligned=block_aligned(spec, dst))  # quant=fp8: cut on blocks, as a job plans
    transport = args.transport or ("colocated" if args.colocate else "p2p")
    if transport == "colocated" and not args.colocate:
        raise WeightSyncError("--transport colocated needs --colocate (the inference ranks on the training GPUs)")
    from weightsync.codec.registry import job_codec_name

    # the job's codec as a session chooses it (an engine declared quant=fp8 takes fp8; delta with it refused)
    codec = job_codec_name(args.codec, args.infer, transport, "sync")
    deployment = Deployment(transport, args.receiver, codec, args.changed,  # the simulator's (predict.simulate)
                            early_call=not args.call_after_written)
    cost = cost_model(args.gpu)  # the constants measured on that GPU
    if args.rank:
        try:
            stats = rank_stats(planner, args.rank, deployment, cost)
        except ValueError as e:
            raise WeightSyncError(str(e)) from None
    else:
        stats = job_stats(planner, deployment, cost)
    if args.json:
        print(json.dumps(stats.to_json()))
    else:
        print(format_stats(stats))
    return 0


def _meta_server(args: argparse.Namespace) -> int:
    from weightsync.meta.server import run_from_args

    return run_from_args(args)


def _job_token(args: argparse.Namespace) -> int:
    from weightsync.meta.auth import admin_token, job_token

    token = admin_token(args)
    if not token:
        raise WeightSyncError("give the MetaServer's admin token: in $WEIGHTSYNC_META_TOKEN or a --token-file PATH")
    try:
        print(job_token(token, args.job))
    except ValueError as e:
        raise WeightSyncError(f"--job: {e}") from None
    return 0


def _add_job_token_arguments(p: argparse.ArgumentParser) -> None:
    from weightsync.meta.auth import add_token_arguments

    add_token_arguments(p)  # the MetaServer's (admin) token: $WEIGHTSYNC_META_TOKEN, --token-file (--token: warned)
    p.add_argument("--job", required=True, help="the job id the token opens")
    p.set_defaults(func=_job_token)


def _demo(args: argparse.Namespace) -> int:
    from weightsync.demo import main_from_args

    return main_from_args(args)


def _bench(args: argparse.Namespace) -> int:
    from weightsync.bench.run import main_from_args

    return main_from_args(args)


def _soak(args: argparse.Namespace) -> int:
    from weightsync.soak.cli import main_from_args

    return main_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightsync", description="Move RL trainer weights to inference engines.")
    sub = p.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="plan a weight sync and print its statistics")
    plan.add_argument("--model", required=True, help="preset name or config.json path")
    plan.add_argument("--train", required=True, help="ENGINE:k=v,... e.g. megatron:tp=2,pp=2,dp=2")
    plan.add_argument("--infer", required=True, help="ENGINE:k=v,... e.g. vllm:tp=4")
    plan.add_argument("--instances", type=int, default=1, help="inference instances (default 1)")
    plan.add_argument("--colocate", action="store_true", help="inference ranks on the training GPUs")
    plan.add_argument("--rank", help="plan one rank only: train:R or infer:I:R")
    plan.add_argument("--budget", type=int, default=256 << 20, help="bucket byte budget (default 256 MiB)")
    plan.add_argument("--gpus-per-host", type=int, default=8, help="GPUs per host for locality (default 8)")
    plan.add_argument("--transport", choices=["colocated", "p2p", "nixl"],
                      help="for the predicted step: colocated (default with --colocate), p2p (NCCL, default), nixl")
    plan.add_argument("--receiver", choices=["faithful", "vllm", "sglang"], default="faithful",
                      help="for the predicted step: layout-faithful workers (default) or a real vLLM / SGLang engine")
    from weightsync.predict.simulate import CODECS as SIMULATED_CODECS  # the codecs whose sizes it models

    plan.add_argument("--codec", choices=list(SIMULATED_CODECS), default="full",
                      help="for the predicted step: bytes on the wire (fp8: an estimate; delta: at --changed)")
    plan.add_argument("--changed", type=float, default=0.01, help="delta: fraction changed a step (default 0.01)")
    plan.add_argument("--call-after-written", action="store_true",
                      help="for the predicted step: readers that send each step's call only after the trainers' "
                           "written (WeightReader(early_call=False)); default: before it")
    plan.add_argument("--gpu", choices=["h200", "h100"], default="h200",
                      help="predict with the costs measured on this GPU (default h200; predict.simulate.GPUS)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=_plan)

    from weightsync.meta.server import add_arguments as add_meta_arguments

    meta = sub.add_parser("meta-server", help="run the MetaServer, the job-level coordinator")
    add_meta_arguments(meta)  # --host 127.0.0.1, --port 0, --token-file ($WEIGHTSYNC_META_TOKEN), --state PATH
    meta.set_defaults(func=_meta_server)

    token = sub.add_parser("job-token", help="print the token that opens one job only (give it to that job's "
                                            "participants, never the MetaServer's own token)")
    _add_job_token_arguments(token)

    from weightsync.demo import add_arguments as add_demo_arguments

    demo = sub.add_parser("demo", help="train a tiny model and sync it into inference instances, verifying each step; "
                                       "--lora RANK: a PEFT adapter synced into a vLLM engine's LoRA slots")
    add_demo_arguments(demo)
    demo.set_defaults(func=_demo)

    from weightsync.bench.run import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="time weight syncs on GPUs against the link ceilings (GPU host); --lora RANK: "
                                         "a LoRA adapter sync into vLLM against its own disk path")
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)

    from weightsync.soak.cli import add_arguments as add_soak_arguments

    soak = sub.add_parser("soak", help="a chaos soak of a local job: participants killed and stopped at random, "
                                       "every version held checked bit for bit")
    add_soak_arguments(soak)
    soak.set_defaults(func=_soak)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["meta-server"]:  # the coordinator's host needs no torch: skip the other commands' parsers
        from weightsync.meta.server import main as meta_server_main

        return meta_server_main(argv[1:])
    if argv[:1] == ["job-token"]:  # likewise: a launcher calls it before any participant starts
        p = argparse.ArgumentParser(prog="weightsync job-token", description="Print one job's MetaServer token.")
        _add_job_token_arguments(p)
        args = p.parse_args(argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except WeightSyncError as e:
        print(f"weightsync: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
