"""Where a nixl delta step's time goes, in one process on one GPU (no NIXL): the sender's encode
(the delta codec's encoder over kept slots, the real code, and its parts replayed: pack, encode, keep as base,
the checksum alone) and the receiver's proof and apply (the nixl frame reads' per-bucket work
replayed: stage/gather, checksum with its host read, ``codec.apply``), for the nixl-1gpu plan
(hf -> vllm:tp=1) of a model, at given change fractions (``weightsync.bench.delta.toggle``).

    python benchmarks/delta_phases.py --model qwen3-8b --device cuda --out phases.json

Each phase over all the plan's buckets, the device synchronised around it: the real encode and the
apply, median of ``--steps`` steps a fraction (after one untimed warm-up step); the replayed parts,
median of ``--repeat``. The sender's own phase split (``last_phases``) is recorded where it has one.
Bit-exactness: after every apply, the receiver's targets equal the trainer's (checksums).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def timed(fn, repeat: int, sync) -> float:
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
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fractions", default="0.001,0.01,0.1")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="encoded and applied steps per fraction (median)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    from weightsync.bench.delta import apply_step
    from weightsync.bench.scenarios import init_weights
    from weightsync.delta import codec
    from weightsync.codec.delta import DeltaCodec, active, sig_hash
    from weightsync.codec.delta_state import gather_pairs, words_of
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES
    from weightsync.plan.planner import Planner
    from weightsync.plan.topology import Topology
    from weightsync.spec import load_spec
    from weightsync.payload.pack import copy_pairs, pack, stage, unpack_pairs

    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    spec = load_spec(args.model)
    src, dst = make_layout(spec, "hf"), make_layout(spec, "vllm:tp=1")
    planner = Planner(src, dst, 1, Topology.colocated(1, 1, 1))
    send, recv = planner.send_plan(0), planner.recv_plan(0, 0)
    lay_s, lay_r = src.layout(0), dst.layout(0)
    tens = {n: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=dev) for n, t in lay_s.tensors.items()}
    targ = {n: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=dev) for n, t in lay_r.tensors.items()}
    init_weights(lay_s, tens, spec)
    init_weights(lay_r, targ, spec)
    def _buckets(plans):
        return [b for bs in active(plans).values() for b in bs]

    rbuckets = _buckets(recv)
    total = sum(b.nbytes for b in rbuckets)
    largest = max(b.nbytes for b in rbuckets)
    slot = torch.empty(largest, dtype=torch.uint8, device=dev)
    scratch = torch.empty(largest + 64, dtype=torch.uint8, device=dev)
    sender = DeltaCodec().encoder(send, dev)  # the real encoder, over kept slots (nixl's registered region)
    sbuckets = sender.distinct(_buckets(send))
    region = {sender.key(b): torch.empty(b.nbytes, dtype=torch.uint8, device=dev) for b in sbuckets}
    headers = {}

    def encode(step: int) -> None:
        sender.begin(step, None)
        for b in sbuckets:
            sender.encode(b, tens, region[sender.key(b)], kept=True)
        headers.update(sender.end(step))
        sync()

    encode(0)
    row = {"model": args.model, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "buckets_sent": len(sbuckets), "buckets_received": len(rbuckets), "bytes": total, "fractions": []}

    # reference rates on one largest bucket: a device copy and the checksum
    a = torch.randint(0, 255, (largest,), dtype=torch.uint8, device=dev)
    b_ = torch.empty_like(a)
    row["copy_bytes_per_s"] = 2 * largest / timed(lambda: b_.copy_(a), 5, sync)  # read + write
    row["checksum_bytes_per_s"] = largest / timed(lambda: int(codec.checksum([a])), 5, sync)

    def base_parts(bk):
        st = stage(bk, targ, False)
        if st.staged:
            copy_pairs(gather_pairs(st.staged, targ, slot))
        return st, st.tensors(slot)

    from weightsync.codec.delta_state import signature

    def stamped_plan():
        """The receiver's plan from the headers the sender stamped."""
        plan = []
        for bk in rbuckets:
            key = sig_hash(signature(bk))
            h = headers[key]
            w = words_of(bk).word
            plan.append((bk, key, h.kind, h.count, h.nbytes, w, h.base_sum))
        return plan

    def apply_all(plan):
        for bk, key, kind, count, n, w, _ in plan:
            if kind < 0:  # no encoding this step (whole)
                continue
            scratch[:n].copy_(region[key][:n])  # NIXL's READ, as a device copy
            st, parts = base_parts(bk)
            codec.apply([codec.as_words(x, w) for x in parts], kind, count, w, scratch[:n])
            if st.staged:
                copy_pairs(unpack_pairs(st.staged, slot, targ))

    def one_step(frac: float, step: int) -> dict:
        """Make a step, encode it (the real sender), prove the receiver's base and apply it."""
        apply_step(lay_s, tens, spec, frac, step)
        sync()
        t = time.perf_counter()
        encode(step)  # the real encode: region slots + headers for this step, base kept
        enc = time.perf_counter() - t
        plan = stamped_plan()
        proven = all(int(codec.checksum(base_parts(p[0])[1])) == p[6] for p in plan)
        sync()
        t = time.perf_counter()
        apply_all(plan)
        sync()
        app = time.perf_counter() - t
        after = [int(codec.checksum(base_parts(p[0])[1])) for p in plan]
        exact = after == [sender.previous.checksum_of(bk) for bk in rbuckets]
        return {"encode": enc, "apply": app, "proven": proven, "exact": exact, "plan": plan,
                "phases": dict(getattr(sender, "last_phases", {}) or {})}

    fractions = [float(x) for x in args.fractions.split(",")]
    step = 1
    warm = one_step(fractions[0], step)  # untimed: the first encode and apply allocate and compile
    row["warmup"] = {"encode_s": warm["encode"], "apply_s": warm["apply"], "exact": warm["exact"]}
    for frac in fractions:
        runs = []
        for _ in range(args.steps):
            step += 1
            runs.append(one_step(frac, step))
        plan = runs[-1]["plan"]
        # the sender's parts, replayed against the version just kept (encode of an unchanged step)
        buf = torch.empty(max(b.nbytes for b in sbuckets), dtype=torch.uint8, device=dev)
        t_pack = timed(lambda: [pack(b, tens, out=buf[: b.nbytes]) for b in sbuckets], args.repeat, sync)
        t_sum = timed(lambda: [int(codec.checksum([buf[: b.nbytes]])) for b in sbuckets], args.repeat, sync)
        t_proof = timed(lambda: [int(codec.checksum(base_parts(p[0])[1])) for p in plan], args.repeat, sync)
        kinds = {}
        for p in plan:
            name = codec.KIND_NAMES.get(p[2], "whole")
            kinds[name] = kinds.get(name, 0) + 1
        phase_names = sorted({k for r in runs for k in r["phases"]})
        row["fractions"].append({
            "fraction": frac, "kinds": kinds, "payload_bytes": sum(p[4] for p in plan), "steps": len(runs),
            "sender_encode_s": statistics.median(r["encode"] for r in runs),
            "sender_encode_all_s": [r["encode"] for r in runs],
            "sender_phases_s": {k: statistics.median(r["phases"].get(k, 0.0) for r in runs) for k in phase_names},
            "sender_pack_s": t_pack, "sender_checksum_s": t_sum,
            "receiver_proof_s": t_proof, "receiver_fetch_apply_s": statistics.median(r["apply"] for r in runs),
            "proven_before_apply": all(r["proven"] for r in runs), "exact_after_apply": all(r["exact"] for r in runs),
            "staged_buckets": sum(1 for p in plan if stage(p[0], targ, False).staged),
        })
        print(json.dumps(row["fractions"][-1]), flush=True)
    print(json.dumps({k: v for k, v in row.items() if k != "fractions"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    ok = warm["exact"] and all(r["exact_after_apply"] and r["proven_before_apply"] for r in row["fractions"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
