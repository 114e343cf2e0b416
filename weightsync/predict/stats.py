"""Plan statistics for a whole job or for one rank: the numbers ``weightsync plan`` prints."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from weightsync.dtypes import DTYPE_SIZES
from weightsync.plan.descriptors import count_workers
from weightsync.plan.messages import wire_bytes
from weightsync.plan.planner import Bucket, Pair, Planner, combine_hashes, pair_hash
from weightsync.predict.simulate import CostModel, Deployment, StepPrediction, predict_seconds, predict_step


@dataclass
class PlanStats:
    model: str
    train: str
    infer: str
    instances: int
    scope: str  # "job", "train:R" or "infer:I:R"
    canonical_bytes: int
    bytes_needed: int
    bytes_sent: int
    redundancy: float
    max_rank_send_bytes: int
    max_rank_recv_bytes: int
    send_balance: float
    messages: int
    buckets: int
    plan_hash: str
    plan_seconds: float
    predicted_seconds: float  # the step: the busiest link plus posting, signals and receiver trips (simulate)
    link_seconds: float  # the busiest link alone (full bytes, 20 us a bucket), what the plan predicted before
    nixl_descriptors: int  # every worker's NIXL data descriptors a step, summed (plan.descriptors)
    nixl_transfers: int  # every worker's prepared NIXL transfers posted a step, summed
    deployment: Deployment
    prediction: StepPrediction  # its parts, and the busiest worker's descriptors and messages a step
    count_seconds: float  # counting descriptors and messages and predicting (not in plan_seconds)
    #: an FP8-served engine (quant=fp8): the bytes the fp8 codec sends (e4m3 weights + their blocks' fp32 scales,
    #: the rest as is; frame alignment and headers aside), exact per copy (weightsync.codec.fp8); 0 otherwise
    fp8_bytes_sent: int = 0
    send_bytes: dict[int, int] = field(default_factory=dict, repr=False)
    recv_bytes: dict[str, int] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)  # deployment and prediction become objects of their own
        d["send_bytes"] = {str(k): v for k, v in self.send_bytes.items()}
        d["nic_floor_seconds"] = self.prediction.nic.seconds if self.prediction.nic is not None else 0.0
        return d


def canonical_bytes(planner: Planner, copies) -> int:
    """Bytes of copies counted in the canonical dtype (what bytes_needed counts), whatever the wire dtype."""
    spec = planner.spec
    return sum(c.numel * DTYPE_SIZES[spec.by_name[c.canonical].dtype] for c in copies)


def default_deployment(planner: Planner) -> Deployment:
    """What a job of this topology runs by default: co-located copies, else p2p NCCL."""
    return Deployment(transport="colocated" if planner.topology.colocate else "p2p")


def _summarize(
    planner: Planner, scope: str, plans: dict[Pair, list[Bucket]], bytes_needed: int, seconds: float,
    deployment: Deployment | None, cost: CostModel,
) -> PlanStats:
    deployment = (deployment or default_deployment(planner)).on(planner.topology)  # doorbells as the runtime decides
    send: dict[int, int] = defaultdict(int)
    recv: dict[str, int] = defaultdict(int)
    all_buckets = [b for bs in plans.values() for b in bs]
    for b in all_buckets:  # counted in the canonical dtype, like bytes_needed
        n = canonical_bytes(planner, b.copies)
        send[b.src_rank] += n
        recv[f"{b.dst_instance}:{b.dst_rank}"] += n
    sent = sum(send.values())
    senders = [v for v in send.values() if v]
    fp8_sent = _fp8_bytes(planner, all_buckets)
    t0 = time.perf_counter()
    counts = count_workers(planner, plans)
    prediction = predict_step(all_buckets, planner.topology, counts, deployment, cost, planner.spec)
    link_s = predict_seconds(all_buckets, planner.topology, cost.links)
    counted = time.perf_counter() - t0
    return PlanStats(
        model=planner.spec.name,
        train=planner.src.describe(),
        infer=planner.dst.describe(),
        instances=planner.instances,
        scope=scope,
        canonical_bytes=planner.spec.nbytes,
        bytes_needed=bytes_needed,
        bytes_sent=sent,
        redundancy=sent / bytes_needed if bytes_needed else 0.0,
        max_rank_send_bytes=max(senders, default=0),
        max_rank_recv_bytes=max(recv.values(), default=0),
        send_balance=max(senders) / (sum(senders) / len(senders)) if senders else 0.0,
        messages=sum(c.messages for c in counts),
        buckets=len(all_buckets),
        plan_hash=combine_hashes({p: pair_hash(bs) for p, bs in plans.items()}),
        plan_seconds=seconds,
        predicted_seconds=prediction.seconds,
        link_seconds=link_s,
        nixl_descriptors=sum(c.nixl_descriptors for c in counts),
        nixl_transfers=sum(c.nixl_transfers for c in counts),
        deployment=deployment,
        prediction=prediction,
        count_seconds=counted,
        fp8_bytes_sent=fp8_sent,
        send_bytes=dict(send),
        recv_bytes=dict(recv),
    )


def _fp8_bytes(planner: Planner, buckets: list[Bucket]) -> int:
    """What the fp8 codec sends for ``buckets`` when the destination engine is declared quant=fp8, else 0."""
    if not getattr(planner.dst.config, "quant", 0):
        return 0
    from weightsync.quant.config import BlockFP8, fp8_tensors  # lazily: it imports torch

    fp8 = {f.weight.name: f.weight.shape for f in fp8_tensors(planner.spec, BlockFP8())}
    return sum(wire_bytes(b.copies, fp8) for b in buckets)


def job_stats(planner: Planner, deployment: Deployment | None = None, cost: CostModel = CostModel()) -> PlanStats:
    """Plan every destination rank of every instance (the receivers' view covers every copy once)."""
    t0 = time.perf_counter()
    plans: dict[Pair, list[Bucket]] = {}
    needed = 0
    spec = planner.spec
    for rank in range(planner.dst.world_size):
        needed += planner.dst_layout(rank).bytes_held(spec) * planner.instances
        for inst in range(planner.instances):
            plans.update(planner.recv_plan(inst, rank))
    return _summarize(planner, "job", plans, needed, time.perf_counter() - t0, deployment, cost)


def rank_stats(planner: Planner, scope: str, deployment: Deployment | None = None,
               cost: CostModel = CostModel()) -> PlanStats:
    """Plan one rank only: ``train:R`` (what it sends) or ``infer:I:R`` (what it receives)."""
    parts = scope.split(":")
    t0 = time.perf_counter()
    if parts[0] == "train" and len(parts) == 2:
        plans = planner.send_plan(int(parts[1]))
        needed = sum(canonical_bytes(planner, b.copies) for bs in plans.values() for b in bs)
    elif parts[0] == "infer" and len(parts) == 3:
        inst, rank = int(parts[1]), int(parts[2])
        plans = planner.recv_plan(inst, rank)
        needed = planner.dst_layout(rank).bytes_held(planner.spec)
    else:
        raise ValueError(f"--rank must be train:R or infer:I:R, got {scope!r}")
    return _summarize(planner, scope, plans, needed, time.perf_counter() - t0, deployment, cost)


def format_stats(s: PlanStats) -> str:
    """A readable summary for people."""
    gb = 1e9

    def b(n: float) -> str:
        return f"{n / gb:.3f} GB" if n >= 1e7 else f"{n / 1e6:.3f} MB"

    lines = [
        f"model {s.model}: {s.train} -> {s.instances} x {s.infer}  ({s.scope})",
        f"  canonical bytes   {b(s.canonical_bytes)}",
        f"  bytes needed      {b(s.bytes_needed)}",
        f"  bytes sent        {b(s.bytes_sent)}   redundancy {s.redundancy:.4f}",
        *([f"  fp8 bytes sent    {b(s.fp8_bytes_sent)}   ({s.fp8_bytes_sent / s.bytes_sent:.3f} of the bf16 bytes: "
           "e4m3 weights and their fp32 block scales, the rest as is)"] if s.fp8_bytes_sent and s.bytes_sent else []),
        f"  busiest sender    {b(s.max_rank_send_bytes)}   balance (max/mean) {s.send_balance:.3f}",
        f"  busiest receiver  {b(s.max_rank_recv_bytes)}",
        f"  buckets           {s.buckets}",
        f"  plan hash         {s.plan_hash}",
        f"  planned in        {s.plan_seconds:.3f} s",
        f"  busiest link      {s.link_seconds * 1e3:.2f} ms (the link model alone: full bytes, a latency a bucket)",
    ]
    p, d = s.prediction, s.deployment
    codec = f"delta at {d.changed:g} changed" if d.codec == "delta" else d.codec
    lines += [
        f"  predicted time    {s.predicted_seconds * 1e3:.2f} ms a step ({d.transport}, {d.receiver} receivers, {codec}, "
        f"{'doorbells' if d.doorbells else 'MetaServer'}, {p.gpu} costs)",
        f"    data            {p.data_s * 1e3:.2f} ms (busiest link, {b(p.wire_bytes)} on the wire)",
        f"    posting         {p.post_s * 1e3:.2f} ms (busiest worker: {p.descriptors} NIXL descriptors, "
        f"{p.messages} messages)",
        f"    signals         {p.signal_s * 1e3:.2f} ms    receiver trips {p.receiver_s * 1e3:.2f} ms"
        + (f"    {d.codec} work {p.codec_s * 1e3:.2f} ms" if d.codec != "full" else ""),
        f"  NIXL a step       {s.nixl_descriptors} descriptors in {s.nixl_transfers} transfers (all workers)",
    ]
    if p.nic is not None and (p.nic.ingress_bytes or p.nic.egress_bytes):
        lines += [
            f"  NIC floor         {p.nic.seconds * 1e3:.2f} ms: the busiest GPU takes in {b(p.nic.ingress_bytes)} and "
            f"sends out {b(p.nic.egress_bytes)} across hosts at {p.nic.nic_bytes_per_s * 8 / 1e9:g} Gb/s a GPU;",
            f"                    no transport goes below it (predicted {s.predicted_seconds / p.nic.seconds:.2f}x "
            "it); fewer bytes (fp8, delta) or faster NICs do",
        ]
    if 0 < len(s.send_bytes) <= 64:
        lines.append("  per training rank sends:")
        for r in sorted(s.send_bytes):
            lines.append(f"    train {r:4d}  {b(s.send_bytes[r])}")
    if 0 < len(s.recv_bytes) <= 64:
        lines.append("  per inference rank receives:")
        for k in sorted(s.recv_bytes, key=lambda x: tuple(map(int, x.split(":")))):
            lines.append(f"    infer {k:>6}  {b(s.recv_bytes[k])}")
    return "\n".join(lines)

