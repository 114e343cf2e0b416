"""A/B of the step's call before the trainers' `written` (weightsync.transport.gate) on this host's CPUs.

    PYTHONPATH=. .venv/bin/python benchmarks/early_call_ab.py [--receiver faithful|vllm] [--rounds 3] [--steps 30]

Each round runs ``weightsync bench --device cpu`` (co-located ``colo-1gpu``, tiny Qwen3, every step verified) twice,
in a shuffled order: the readers' default (the call sent first, its copies waiting for the go) and
``--call-after-written`` (the call sent once every trainer announced the step, as before 4ea3863). A CPU run has
no floor: what it compares is the step's median (the trainer's StepStarted to the reader's return) and the reader's
phases, arm against arm on one host. ``--out`` keeps every run's JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

ARMS = {"early": [], "after-written": ["--call-after-written"]}
PHASES = ("reader.wait_written", "reader.workers", "reader.transport", "reader.started", "writer.written")


def bench(receiver: str, steps: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "weightsync", "bench", "--scenario", "colo-1gpu", "--model", "tiny-qwen3",
           "--device", "cpu", "--receiver", receiver, "--steps", str(steps), "--baselines", "", "--json", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout
    record = json.loads(out.strip().splitlines()[-1])
    if record.get("errors") or not record.get("verified"):
        raise SystemExit(f"{cmd}: {record.get('errors')} verified={record.get('verified')}")
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--receiver", choices=["faithful", "vllm"], default="faithful")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        order = list(ARMS)
        random.shuffle(order)
        for arm in order:
            rec = bench(args.receiver, args.steps, ARMS[arm])
            runs[arm].append(rec)
            ph = rec["phase_median_seconds"]
            print(f"round {r} {arm:>13}: median {rec['median_seconds'] * 1e3:.3f} ms  "
                  + "  ".join(f"{k} {ph[k] * 1e3:.3f}" for k in PHASES if k in ph), flush=True)
    summary = {arm: {"median_of_medians_ms": statistics.median(x["median_seconds"] for x in rs) * 1e3,
                     "phases_ms": {k: statistics.median(x["phase_median_seconds"][k] for x in rs) * 1e3
                                   for k in PHASES if all(k in x["phase_median_seconds"] for x in rs)}}
               for arm, rs in runs.items()}
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps({"receiver": args.receiver, "rounds": args.rounds, "steps": args.steps,
                                        "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
