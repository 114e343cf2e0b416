"""Measure delta updates: the encodings on random sparse changes, and whole steps over CPU gloo.

``python -m weightsync.bench.delta_codec codec``   each encoding's size and encode/apply time on one bucket
                                             at 0.1-30% changed words (bf16 and fp32), and the choice
``python -m weightsync.bench.delta_codec gloo``    a trainer and a receiver process (hf -> hf layouts) over
                                             a gloo group: per step, bytes moved and seconds, full
                                             against delta, at given change fractions
``python -m weightsync.bench.delta_codec predict`` the simulator's busiest-link prediction for a job, full
                                             and at given change fractions (the plan's bytes scaled
                                             by each bucket's encoded size)
``python -m weightsync.bench.delta_codec memory``  the sender's previous version: planned, budgeted, resident

Each prints a markdown table and, with ``--json PATH``, writes the rows. Numbers for docs/delta.md
and BENCHMARKS.md ("Delta updates").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from dataclasses import asdict, dataclass

import torch

from weightsync.delta import codec


@dataclass(frozen=True)
class CodecRow:
    dtype: str
    fraction: float
    kind: str
    payload_fraction: float  # payload bytes / full bytes
    encode_ms: float
    apply_ms: float
    chosen: bool


def _best(f, repeat: int) -> float:
    """The fastest of ``repeat`` calls, the GPU's queue drained on both sides of each (CUDA runs async)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    best = float("inf")
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        f()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def codec_rows(nbytes: int = 16 << 20, fractions=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3), repeat: int = 3,
               device: str = "cpu") -> list[CodecRow]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.tensor([], dtype=dtype).element_size()
        n = nbytes // w
        base = torch.randn(n, generator=g).to(dtype).to(device)
        for frac in fractions:
            cur = base.clone()
            k = max(1, int(n * frac))
            idx = torch.randperm(n, generator=g)[:k].to(device)
            cur[idx] = (cur[idx].float() + 1).to(dtype)
            cw, bw = codec.as_words(cur.view(torch.uint8), w), codec.as_words(base.view(torch.uint8), w)
            changed = cw != bw
            chosen = codec.encode(cw, bw).kind
            for kind in (codec.INDICES, codec.BITMAP, codec.BLOCKS):
                count = int(codec._block_mask(changed).sum()) if kind == codec.BLOCKS else int(changed.sum())

                def enc(kind=kind, count=count):
                    ch = cw != bw
                    return codec.encode_as(kind, cw, ch, count, bw)

                e = enc()
                target = base.clone()
                tw = codec.as_words(target.view(torch.uint8), w)
                enc_s = _best(enc, repeat)
                app_s = _best(lambda: codec.apply([tw], kind, count, w, e.payload), repeat)
                assert torch.equal(target.view(torch.uint8), cur.view(torch.uint8))
                rows.append(CodecRow(str(dtype).replace("torch.", ""), frac, codec.KIND_NAMES[kind],
                                     e.nbytes / nbytes, enc_s * 1e3, app_s * 1e3, kind == chosen))
    return rows


def codec_table(rows: list[CodecRow], nbytes: int) -> str:
    out = [f"one bucket of {nbytes >> 20} MiB; payload as a fraction of the full bytes; best of 3; * = chosen", "",
           "| dtype | changed | indices | bitmap | blocks (32) | encode ms (i / b / k) | apply ms (i / b / k) |",
           "|---|---|---|---|---|---|---|"]
    by = {}
    for r in rows:
        by.setdefault((r.dtype, r.fraction), []).append(r)
    for (dt, frac), rs in by.items():
        cells = [f"{r.payload_fraction:.4f}{'*' if r.chosen else ''}" for r in rs]
        enc = " / ".join(f"{r.encode_ms:.1f}" for r in rs)
        app = " / ".join(f"{r.apply_ms:.1f}" for r in rs)
        out.append(f"| {dt} | {frac:.1%} | {' | '.join(cells)} | {enc} | {app} |")
    return "\n".join(out)


# -- whole steps over gloo --------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRow:
    model: str
    mode: str  # "full" or "delta"
    fraction: float
    step: int
    bytes: int
    full_bytes: int
    send_s: float
    recv_s: float


def _mutate(tensors: dict, frac: float, g: torch.Generator) -> None:
    """Change ``frac`` of every tensor's elements (random positions, new values), in place."""
    for t in tensors.values():
        flat = t.view(-1)
        k = int(flat.numel() * frac)
        if k:
            idx = torch.randint(0, flat.numel(), (k,), generator=g)
            flat[idx] = (flat[idx].float() + 0.5).to(t.dtype)


def _member(role: str, port: int, model: str, fractions, steps: int, results) -> None:
    from weightsync.codec.delta import DeltaCodec
    from weightsync.engines import make_layout
    from weightsync.integrity.digest import checksum, to_ints
    from weightsync.layout.materialize import scatter
    from weightsync.plan.planner import Planner
    from weightsync.spec import load_spec
    from weightsync.testing import random_canonical
    from weightsync.transport.group import new_group
    from weightsync.plan.job import JobRanks
    from weightsync.transport.p2p import Framing, P2PTransport

    torch.set_num_threads(1)  # two processes on a shared machine: OpenMP threads would spin against each other
    try:
        spec = load_spec(model)
        lay = make_layout(spec, "hf")
        planner = Planner(lay, lay, 1)
        ranks = JobRanks(1, 1, 1)
        pg = new_group("127.0.0.1", port, 0 if role == "train" else 1, 2, timeout_s=120)
        t = P2PTransport(pg, ranks, timeout_s=300)
        g = torch.Generator().manual_seed(1)
        codec = DeltaCodec()
        if role == "train":
            plans = planner.send_plan(0)
            tensors = scatter(lay.layout(0), random_canonical(spec, 0))
            delta = codec.encoder(plans, torch.device("cpu"))
        else:
            plans = planner.recv_plan(0, 0)
            tensors = {n: torch.empty_like(x) for n, x in scatter(lay.layout(0), random_canonical(spec, 1)).items()}
            delta = codec.decoder(plans)
        rows = []
        for frac in fractions:
            for mode in ("full", "delta"):
                for step in range(steps):
                    if role == "train":
                        if step or mode == "delta":
                            _mutate(tensors, frac, g)
                        st = (t.send(plans, tensors, frames=Framing(step, delta, codec, proofs=True)) if mode == "delta"
                              else t.send(plans, tensors))
                    else:
                        st = (t.recv(plans, tensors, frames=Framing(step, delta, codec, proofs=True)) if mode == "delta"
                              else t.recv(plans, tensors))
                    rows.append((mode, frac, step, st.bytes, st.full_bytes or st.bytes, st.seconds))
                    if mode == "delta" and step:
                        print(role, frac, step, dict(delta.stats.kinds), flush=True)
                if mode == "delta":
                    delta.fail()  # the next fraction starts whole
        sums = to_ints([checksum(tensors[n]) for n in sorted(tensors)])
        results.put((role, rows, sums))
    except BaseException:  # noqa: BLE001
        import traceback

        results.put((role, traceback.format_exc(), None))


def gloo_rows(model: str, fractions, steps: int = 3) -> list[StepRow]:
    from weightsync.transport.group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_member, args=(r, port, model, list(fractions), steps, q)) for r in ("train", "infer")]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        role, rows, sums = q.get(timeout=3600)
        if sums is None:
            raise RuntimeError(f"{role} failed:\n{rows}")
        got[role] = (rows, sums)
    for p in procs:
        p.join()
    if got["train"][1] != got["infer"][1]:
        raise AssertionError("the receiver's tensors differ from the trainer's after the last step")
    out = []
    for (mode, frac, step, nb, full, send_s), (_, _, _, _, _, recv_s) in zip(got["train"][0], got["infer"][0]):
        out.append(StepRow(model, mode, frac, step, nb, full, send_s, recv_s))
    return out


def gloo_table(rows: list[StepRow]) -> str:
    out = ["| model | changed | mode | bytes / step | of full | send s | receive s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.step == 0:
            continue  # step 0: the first (whole) step of each mode
        out.append(f"| {r.model} | {r.fraction:.1%} | {r.mode} | {r.bytes / 1e6:.1f} MB | {r.bytes / r.full_bytes:.3f} "
                   f"| {r.send_s:.3f} | {r.recv_s:.3f} |")
    return "\n".join(out)


# -- the simulator ----------------------------------------------------------------------------------


def encoded_bytes(nbytes: int, fraction: float, word: int = 2) -> int:
    """What a bucket of ``nbytes`` costs on the wire when ``fraction`` of its words changed at random
    (the codec's choice, plus the 24-byte header)."""
    n = nbytes // word
    k = int(round(n * fraction))
    kind, count = codec.choose(k, None, n, word)
    return codec.payload_bytes(kind, count, n, word) + 24


def predict(model: str, train: str, infer: str, instances: int, fractions, gpus_per_host: int = 8,
            budget: int = 256 << 20) -> list[dict]:
    """The busiest-link prediction, full and with each bucket scaled to its encoded size."""
    from weightsync.engines import make_layout
    from weightsync.plan.planner import Planner
    from weightsync.predict.simulate import LinkModel, predict_seconds
    from weightsync.plan.topology import Topology
    from weightsync.spec import load_spec

    spec = load_spec(model)
    src, dst = make_layout(spec, train), make_layout(spec, infer)
    topo = Topology.separated(src.world_size, dst.world_size, instances, gpus_per_host)
    planner = Planner(src, dst, instances, topo, bucket_bytes=budget)
    t0 = time.perf_counter()
    buckets = [b for r in range(dst.world_size) for i in range(instances) for bs in planner.recv_plan(i, r).values()
               for b in bs]
    planned = time.perf_counter() - t0
    rows = [{"fraction": None, "seconds": predict_seconds(buckets, topo), "bytes": sum(b.nbytes for b in buckets),
             "buckets": len(buckets), "plan_seconds": planned}]

    class Scaled:  # a bucket whose bytes are its encoding's (predict_seconds reads the pair and nbytes)
        __slots__ = ("src_rank", "dst_instance", "dst_rank", "nbytes")

        def __init__(self, b, n):
            self.src_rank, self.dst_instance, self.dst_rank, self.nbytes = b.src_rank, b.dst_instance, b.dst_rank, n

    links = LinkModel()
    recv_bytes: dict[tuple[int, int], int] = {}
    recv_buckets: dict[tuple[int, int], int] = {}
    send_bytes: dict[int, int] = {}
    for b in buckets:
        key = (b.dst_instance, b.dst_rank)
        recv_bytes[key] = recv_bytes.get(key, 0) + b.nbytes
        recv_buckets[key] = recv_buckets.get(key, 0) + 1
        send_bytes[b.src_rank] = send_bytes.get(b.src_rank, 0) + b.nbytes
    # what the link model leaves out, modelled from HBM bandwidth and the per-message latency:
    # the receiver's proof reads everything it holds once (a checksum: about a copy's time); the
    # sender packs, compares with and replaces its previous version once per distinct bucket
    # (instances alike: its bytes / instances; ~3 copies' worth); the receiver takes its buckets one at
    # a time (header, then payload: two latencies each, serial)
    proof_s = max(recv_bytes.values()) / links.hbm_copy_bytes_per_s
    encode_s = 3 * max(send_bytes.values()) / instances / links.hbm_copy_bytes_per_s
    serial_s = 2 * links.latency_s * max(recv_buckets.values())
    for frac in fractions:
        scaled = [Scaled(b, encoded_bytes(b.nbytes, frac)) for b in buckets]
        link_s = predict_seconds(scaled, topo)
        rows.append({"fraction": frac, "seconds": link_s, "bytes": sum(s.nbytes for s in scaled),
                     "buckets": len(buckets), "proof_s": proof_s, "encode_s": encode_s, "serial_s": serial_s,
                     "estimate_s": proof_s + max(link_s, encode_s) + serial_s})
    return rows


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def memory_rows(model: str = "qwen3-0.6b") -> list[dict]:
    """The sender's previous version: bytes the plan says (``Buffers.codec``) against the resident
    memory it took once stored, kept on the tensors' device and (``host=True``) in host memory (pinned
    where CUDA is present; on a CPU-only machine both are host memory)."""
    from weightsync.codec.delta_state import PreviousVersion, previous_buffers_bytes, previous_bytes
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import scatter
    from weightsync.plan.planner import Planner
    from weightsync.spec import load_spec
    from weightsync.testing import random_canonical
    from weightsync.payload.pack import pack

    spec = load_spec(model)
    lay = make_layout(spec, "hf")
    plans = Planner(lay, lay, 1).send_plan(0)
    tensors = scatter(lay.layout(0), random_canonical(spec, 0))
    largest = max(b.nbytes for bs in plans.values() for b in bs)
    buf = torch.empty(largest, dtype=torch.uint8)
    rows = []
    for host in (False, True):
        before = _rss()
        prev = PreviousVersion(plans, torch.device("cpu"), host=host)
        for bs in plans.values():
            for b in bs:
                if b.nbytes:
                    prev.store(b, pack(b, tensors, out=buf[: b.nbytes]))
        rows.append({"model": model, "where": prev.where, "planned": previous_bytes(plans),
                     "budgeted": previous_buffers_bytes(plans, host), "resident_growth": _rss() - before})
        del prev
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m weightsync.bench.delta_codec")
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("codec")
    c.add_argument("--mib", type=int, default=16)
    c.add_argument("--device", default="cpu", help="where the bucket lives: cpu or cuda")
    g = sub.add_parser("gloo")
    g.add_argument("--model", default="qwen3-0.6b")
    g.add_argument("--fractions", default="0.001,0.01,0.03,0.1")
    g.add_argument("--steps", type=int, default=3)
    p = sub.add_parser("predict")
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--infer", required=True)
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--fractions", default="0.001,0.01,0.03,0.1")
    m = sub.add_parser("memory")
    m.add_argument("--model", default="qwen3-0.6b")
    for s in (c, g, p, m):
        s.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.what == "codec":
        rows = codec_rows(args.mib << 20, device=args.device)
        print(codec_table(rows, args.mib << 20))
        data = [asdict(r) for r in rows]
    elif args.what == "gloo":
        rows = gloo_rows(args.model, [float(x) for x in args.fractions.split(",")], args.steps)
        print(gloo_table(rows))
        data = [asdict(r) for r in rows]
    elif args.what == "memory":
        data = memory_rows(args.model)
        for r in data:
            print(f"{r['model']}: previous version in {r['where']}: {r['planned'] / 1e6:.1f} MB planned, "
                  f"{r['budgeted'] / 1e6:.1f} MB counted in the device budget, resident memory grew "
                  f"{r['resident_growth'] / 1e6:.1f} MB")
    else:
        data = predict(args.model, args.train, args.infer, args.instances,
                       [float(x) for x in args.fractions.split(",")])
        for r in data:
            frac = "full" if r["fraction"] is None else f"{r['fraction']:.1%} changed"
            extra = (f"; with proof {r['proof_s']:.3f} s, encode {r['encode_s']:.3f} s, bucket-serial "
                     f"{r['serial_s']:.3f} s: about {r['estimate_s']:.3f} s") if "estimate_s" in r else ""
            print(f"{frac:>14}: {r['seconds']:.3f} s busiest link, {r['bytes'] / 1e9:.2f} GB over all links{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
