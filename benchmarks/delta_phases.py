"""Where a nixl delta step's time goes, in one process on one GPU (no NIXL): the sender's encode
(``DeltaNixlSender.encode``, the real code, and its parts replayed: pack, encode, keep as base,
the checksum alone) and the receiver's proof and apply (``DeltaNixlReceiver``'s per-bucket work
replayed: stage/gather, checksum with its host read, ``codec.apply``), for the nixl-1gpu plan
(hf -> vllm:tp=1) of a model, at given change fractions (``weightsync.bench.delta.toggle``).

    python benchmarks/delta_phases.py --model qwen3-8b --device cuda --out phases.json

Each phase over all the plan's buckets, the device synchronised around it, median of ``--repeat``.
Bit-exactness: after each fraction's apply, the receiver's targets equal the trainer's (checksums).
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
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    from weightsync.bench.delta import apply_step
    from weightsync.bench.scenarios import init_weights
    from weightsync.delta import codec
    from weightsync.delta.nixl import DeltaNixlSender, _buckets
    from weightsync.delta.state import gather_pairs, words_of
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES
    from weightsync.plan.planner import Planner
    from weightsync.plan.topology import Topology
    from weightsync.spec import load_spec
    from weightsync.transport.pack import copy_pairs, pack, stage, unpack_pairs

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
    sbuckets, rbuckets = _buckets(send), _buckets(recv)
    total = sum(b.nbytes for b in rbuckets)
    largest = max(b.nbytes for b in rbuckets)
    slot = torch.empty(largest, dtype=torch.uint8, device=dev)
    scratch = torch.empty(largest + 64, dtype=torch.uint8, device=dev)
    sender = DeltaNixlSender(send, tens, dev)
    sender.encode(0)
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

    step = 0
    for frac in (float(x) for x in args.fractions.split(",")):
        step += 1
        apply_step(lay_s, tens, spec, frac, step)
        sync()
        t = time.perf_counter()
        sender.encode(step)  # the real encode: region + index for this step, base kept
        sync()
        encode_real = time.perf_counter() - t
        # the sender's parts, replayed against the version just kept (encode of an unchanged step)
        buf = torch.empty(max(b.nbytes for b in sbuckets), dtype=torch.uint8, device=dev)
        t_pack = timed(lambda: [pack(b, tens, out=buf[: b.nbytes]) for b in sbuckets], args.repeat, sync)
        t_sum = timed(lambda: [int(codec.checksum([buf[: b.nbytes]])) for b in sbuckets], args.repeat, sync)
        # the receiver: read the slots the sender stamped, prove, fetch (a device copy here), apply
        slots = {}
        idx = sender.index.tolist()
        from weightsync.delta.nixl import HEAD, SLOT, sig_hash
        from weightsync.delta.state import signature

        for k in range(idx[3]):
            slots[idx[HEAD + SLOT * k]] = idx[HEAD + SLOT * k + 1: HEAD + SLOT * k + SLOT]
        plan = []
        for bk in rbuckets:
            off, kind, count, base_sum = slots[sig_hash(signature(bk))][:4]
            w = words_of(bk).word
            plan.append((bk, off, kind, count, codec.payload_bytes(kind, count, bk.nbytes // w, w), w, base_sum))
        t_proof = timed(lambda: [int(codec.checksum(base_parts(p[0])[1])) for p in plan], args.repeat, sync)
        proven = all(((int(codec.checksum(base_parts(p[0])[1])) + (1 << 63)) % (1 << 64) - (1 << 63)) == p[6]
                     for p in plan)

        def apply_all():
            for bk, off, kind, count, n, w, _ in plan:
                scratch[:n].copy_(sender.region[off: off + n])  # NIXL's READ, as a device copy
                st, parts = base_parts(bk)
                codec.apply([codec.as_words(x, w) for x in parts], kind, count, w, scratch[:n])
                if st.staged:
                    copy_pairs(unpack_pairs(st.staged, slot, targ))

        sync()
        t = time.perf_counter()
        apply_all()
        sync()
        t_apply = time.perf_counter() - t
        after = [int(codec.checksum(base_parts(p[0])[1])) for p in plan]
        want = [sender.previous.checksum_of(bk) for bk in rbuckets]
        exact = after == want
        kinds = {}
        for p in plan:
            kinds[codec.KIND_NAMES[p[2]]] = kinds.get(codec.KIND_NAMES[p[2]], 0) + 1
        row["fractions"].append({
            "fraction": frac, "kinds": kinds, "payload_bytes": sum(p[4] for p in plan),
            "sender_encode_s": encode_real, "sender_pack_s": t_pack, "sender_checksum_s": t_sum,
            "receiver_proof_s": t_proof, "receiver_fetch_apply_s": t_apply,
            "proven_before_apply": proven, "exact_after_apply": exact,
            "staged_buckets": sum(1 for p in plan if stage(p[0], targ, False).staged),
        })
        print(json.dumps(row["fractions"][-1]), flush=True)
    print(json.dumps({k: v for k, v in row.items() if k != "fractions"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    return 0 if all(r["exact_after_apply"] and r["proven_before_apply"] for r in row["fractions"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
