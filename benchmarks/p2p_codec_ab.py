"""A/B of the p2p transport between two trees, per codec, on CPU (gloo): the same job in each, interleaved.

    python benchmarks/p2p_codec_ab.py --old /tmp/old --new . [--model qwen3-0.6b] [--steps 6] [--rounds 2]
        [--codecs full,delta,cast] [--out FILE.json]

Each run is one separated job through ``tests/e2e.py`` (one transformers trainer, one layout-faithful vLLM TP=1
instance in its own processes, p2p over gloo, every step bit-exact against the step's weights): the full codec,
delta (every step's weights are new random values, so delta moves every element: its framed path at full size)
and cast (fp32 masters on the trainer, bf16 on the wire), each into a bf16 engine. fp8 is not here: the e2e
reader checks against the canonical bf16 weights (tests/test_fp8_sync.py has its own check, untimed). Recorded per step:
the slowest worker's time inside the transport (``StepDone.transfer_seconds``), the reader's step time and the
bytes it received. Runs alternate old, new (then new, old in the next round) under the same load; the table
prints medians over rounds and steps (the first step, which sets up, left out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ENGINE = "vllm:tp=1"


def one(codec: str, model: str, steps: int) -> dict:
    """Run one job in this process's tree; what each step took (runs in the child, ``--one``)."""
    sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
    from e2e import run_job
    from weightsync.local.events import StepDone

    job = dict(model=model, train="hf", infer=ENGINE, steps=steps, timeout=300.0, job=f"ab-{codec}",
               codec=None if codec == "full" else codec, fp32=codec == "cast")
    t0 = time.perf_counter()
    result = run_job(job)
    done = sorted((e for e in result.events if isinstance(e, StepDone)), key=lambda e: e.step)
    return {"codec": codec, "wall_s": time.perf_counter() - t0,
            "failures": [f.line() for f in result.failures],
            "steps": [{"step": e.step, "transfer_s": e.transfer_seconds, "step_s": e.seconds, "bytes": e.bytes,
                       "exact": e.exact} for e in done]}


def run(tree: str, codec: str, model: str, steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", codec, "--model", model,
                          "--steps", str(steps)], cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("{")), None)
    if line is None:
        return {"codec": codec, "failures": [f"rc={out.returncode}: {out.stderr[-2000:]}"], "steps": []}
    return json.loads(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old")
    p.add_argument("--new")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--codecs", default="full,delta,cast")
    p.add_argument("--out")
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.model, a.steps)))
        return
    records = []
    for r in range(a.rounds):
        for codec in a.codecs.split(","):
            for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                rec = run(getattr(a, side), codec, a.model, a.steps)
                rec.update(side=side, round=r, load=os.getloadavg()[0])
                records.append(rec)
                print(f"round {r} {codec:5} {side}: {len(rec['steps'])} steps, failures {rec['failures'][:1]}",
                      file=sys.stderr, flush=True)
    print(f"{'codec':6} {'side':4} {'transfer median s':>18} {'step median s':>14} {'MB/step':>8} exact")
    for codec in a.codecs.split(","):
        for side in ("old", "new"):
            steps = [s for rec in records if rec["codec"] == codec and rec["side"] == side
                     for s in rec["steps"] if s["step"] > 1]
            if not steps:
                print(f"{codec:6} {side:4} no steps")
                continue
            print(f"{codec:6} {side:4} {statistics.median(s['transfer_s'] for s in steps):18.3f} "
                  f"{statistics.median(s['step_s'] for s in steps):14.3f} "
                  f"{statistics.median(s['bytes'] for s in steps) / 1e6:8.1f} {all(s['exact'] for s in steps)}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "steps": a.steps, "old": a.old, "new": a.new, "runs": records}, f, indent=1)


if __name__ == "__main__":
    main()
