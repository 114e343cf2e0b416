"""``weightsync soak``: its options and its output (the figures, and ``--json`` for a record)."""

from __future__ import annotations

import argparse
import json
import sys

from weightsync.soak.config import ACTIONS, KINDS, TARGETS, SoakConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SoakConfig()
    p.add_argument("--seconds", type=float, default=d.seconds, help=f"how long faults are injected (default {d.seconds:g})")
    p.add_argument("--faults", type=int, default=d.faults, help="stop after this many faults, if sooner (default 0: no limit)")
    p.add_argument("--seed", type=int, default=d.seed, help="the faults' order and timing, and the weights (default 0)")
    p.add_argument("--model", default=d.model, help=f"preset (default {d.model})")
    p.add_argument("--train", default=d.train, help=f"training layout: hf or fsdp:dp=N (default {d.train})")
    p.add_argument("--infer", default=d.infer, help=f"the instances' layout (default {d.infer})")
    p.add_argument("--readers", type=int, default=d.readers, help=f"inference instances (default {d.readers})")
    p.add_argument("--transport", default=d.transport, help="an elastic transport: file (sync) or nixl (sync, async)")
    p.add_argument("--mode", default=d.mode, choices=("sync", "async"))
    p.add_argument("--timeout", type=float, default=d.timeout_s, help=f"every participant's timeout_s (default {d.timeout_s:g})")
    p.add_argument("--instance-timeout", type=float, default=d.instance_timeout_s,
                   help=f"a sync step drops an instance that did not hold it within this (default {d.instance_timeout_s:g})")
    p.add_argument("--fault-gap", type=float, default=d.fault_gap_s,
                   help=f"mean quiet seconds between a fault's recovery and the next (default {d.fault_gap_s:g})")
    p.add_argument("--targets", default=",".join(d.targets), help=f"who faults hit, of {','.join(TARGETS)}")
    kinds = ", ".join(sorted(f"{a} {t}" for t, a in KINDS))
    p.add_argument("--actions", default=",".join(d.actions),
                   help=f"what they do, of {','.join(ACTIONS)} (kinds: {kinds})")
    p.add_argument("--order", default=d.order, choices=("random", "cycle"),
                   help="random kinds of fault, or every action (in --actions order) on every target in turn")
    p.add_argument("--stop-s", default=f"{d.stop_s[0]:g},{d.stop_s[1]:g}", help="MIN,MAX seconds a SIGSTOP lasts")
    p.add_argument("--storm-s", type=float, default=d.storm_s,
                   help=f"a storm's bad requests go on at least this long (default {d.storm_s:g})")
    p.add_argument("--slow-over-s", type=float, default=d.slow_over_s,
                   help=f"a slow step trains this much longer than --timeout (default {d.slow_over_s:g})")
    p.add_argument("--recover", type=float, default=d.recover_s,
                   help=f"a fault not recovered from within this many seconds counts as not recovered (default {d.recover_s:g})")
    p.add_argument("--staged", default=d.staged, choices=("none", "all", "odd"), help="which readers are staged")
    p.add_argument("--workdir", default=None, help="logs, the MetaServer's store and the files (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the figures as JSON to this file")


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    lo, _, hi = args.stop_s.partition(",")
    return SoakConfig(seconds=args.seconds, faults=args.faults, seed=args.seed, model=args.model, train=args.train, infer=args.infer,
                      readers=args.readers, transport=args.transport, mode=args.mode, timeout_s=args.timeout,
                      instance_timeout_s=args.instance_timeout, fault_gap_s=args.fault_gap,
                      targets=tuple(t for t in args.targets.split(",") if t),
                      actions=tuple(a for a in args.actions.split(",") if a), order=args.order,
                      stop_s=(float(lo), float(hi or lo)), storm_s=args.storm_s, slow_over_s=args.slow_over_s,
                      recover_s=args.recover, staged=args.staged,
                      workdir=args.workdir)


def main_from_args(args: argparse.Namespace) -> int:
    """Run the soak, print each fault as it happens and the figures at the end; exit 1 unless it held."""
    import signal

    from weightsync.soak.driver import run

    def _terminated(*_: object) -> None:  # `timeout` / kill: end every process of the soak on the way out
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, _terminated)
    report = run(config_from_args(args), out=lambda line: print(line, flush=True))
    for line in report.lines():
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="weightsync soak", description="A chaos soak of a local weight-sync job.")
    add_arguments(p)
    return main_from_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
