"""``weightsync bench``: time real weight syncs on GPUs and the link ceilings they depend on, in one run.

Weights are random bf16 tensors in the model's exact shapes, held by engine-layout tensors on the
GPUs (no download): each canonical tensor is generated on the GPU from a seed of its name, so a
trainer rank and an inference rank can both produce any region of it; each step doubles every value
(exact in bf16), so every step moves new bits, and the last step is checked bit for bit. Every step runs the real runtime -- MetaServer, WeightWriter per training rank,
WeightReader per instance driving layout-faithful worker processes -- and is timed from the first
``write`` call to the last ``update`` return.

In the same run it measures the ceiling the scenario depends on: NCCL send/recv between the
scenario's GPU pair with the plan's own message sizes (separated), or the device-to-device copy
bandwidth (co-located), and reports the floor (the busiest GPU's bytes over that ceiling) and the
efficiency (floor / median time). Then, in the same processes, over the same group and GPUs, the
baselines of :mod:`weightsync.bench.baselines` (naive and bucketed; separated over NCCL, co-located
by CUDA IPC), each timed the same way and checked bit for bit; then checkpoint-engine in its own
processes on the same GPUs (:mod:`weightsync.bench.ckpt_engine`).

``--device cpu`` rehearses a scenario with the same processes on CPU (gloo, shared memory) and a small
model, every step and baseline checked, nothing measured: how the tests cover the 4-GPU scenarios'
wiring on machines without them.
"""

from __future__ import annotations

import json
import secrets
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

import torch

from weightsync.bench.environment import environment  # noqa: F401 - recorded with every result; re-exported
from weightsync.bench.ceilings import copy_ceiling, link_recv, peak_memory, peer_bandwidth, reset_peak
from weightsync.bench.events import (
    BaselineEnded,
    BaselineStarted,
    BaselineVerified,
    InstanceMeasured,
    LinkReady,
    Phases,
    TrainerMeasured,
)
from weightsync.bench.scenarios import (
    SCENARIOS,
    Scenario,
    advance,
    canonical_region,
    check,
    device_of,
    init_weights,
    moved_per_gpu,
    synchronize,
    timed_write,
)
from weightsync.errors import ConfigError
from weightsync.local.events import Event, Participant, StepDone, StepStarted
from weightsync.local.runner import Emit, LocalJob
from weightsync.runtime.job import DEFAULT_MEMORY_BUDGET

CHECKPOINT_ENGINE = "checkpoint-engine"


# -- processes --------------------------------------------------------------------------------------


def _integrity(n: int | None) -> dict:
    """The writer's and reader's ``integrity=`` option, when the bench was given one."""
    return {} if n is None else {"integrity": n}


def job_transport(writer):
    """The job's point-to-point transport (group and ranks) on a separated trainer, which the link
    ceiling and the baselines reuse so they run over the same communicator; None otherwise."""
    from weightsync.transport.p2p import P2PSender

    sender = writer.connect().session.sender
    return sender.transport if isinstance(sender, P2PSender) else None


def _trainer(emit: Emit, rank: int, scen: Scenario, model: str, steps: int, meta: str, timeout: float,
             baselines: tuple[str, ...] = (), store_port: int = 0, device: str = "cuda", together=None,
             integrity: int | None = None, token: str | None = None) -> None:
    """One training rank (``token``: the bench job's MetaServer token). ``together`` (a barrier of the training
    ranks) starts every step's writes at once, as a training step's last collective would: the bench's stand-in
    for the optimizer (doubling every tensor, a kernel each: ~7,000 on a 30B PP stage) ends up to ~18 ms apart
    on two ranks, and that skew is the bench's, not the sync's."""
    from weightsync.bind import Bound
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES
    from weightsync.runtime.writer import WeightWriter
    from weightsync.spec import load_spec

    me = emit.participant
    dev = device_of(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    spec = load_spec(model)
    engine = make_layout(spec, scen.train)
    layout = engine.layout(rank)
    tensors = {n: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=dev) for n, t in layout.tensors.items()}
    # set up now, as the constructor used to: neither the warm-up step's time nor its memory peak includes it
    writer = WeightWriter(Bound(engine, rank, layout, tensors), meta=meta, job="bench", token=token,
                          timeout_s=timeout, colocate=scen.colocate, transport=scen.transport,
                          memory_budget=writer_budget(scen, layout.bytes_held(spec)), **_integrity(integrity)).connect()
    peak = 0
    init_weights(layout, tensors, spec)
    for step in range(steps + 1):  # step 0 warms up
        advance(tensors)  # step s holds the base data doubled s + 1 times
        peak = max(peak, timed_write(writer, step, dev, together, timeout, emit))
        if step and rank == 0:
            emit(Phases(me, "writer", writer.last_timing))
    sent = writer.bytes_per_step
    link = None
    p2p = job_transport(writer)
    if not scen.colocate and rank == 0 and p2p is not None and dev.type == "cuda":
        # the ceiling: the same messages, raw, over the same communicator
        sizes = [b.nbytes for bs in writer.plans.values() for b in bs]
        peer = p2p.ranks.infer(0, 0)
        bufs = torch.empty(max(sizes), dtype=torch.uint8, device=dev)
        emit(LinkReady(me, tuple(sizes), p2p.ranks.train(rank)))
        times = []
        for _ in range(3):
            synchronize(dev)
            t0 = time.perf_counter()
            for s in sizes:
                p2p.group.send([bufs[:s]], peer, 7).wait()
            synchronize(dev)
            times.append(time.perf_counter() - t0)
        link = sum(sizes) / statistics.median(times)
    if baselines:
        _baselines_train(emit, rank, scen, engine, tensors, writer, store_port, steps, timeout, baselines, dev,
                         together)
    emit(TrainerMeasured(me, sent, link, peak))


def _store(port: int, is_master: bool, timeout: float):
    """The TCPStore the co-located baselines signal through (training rank 0 serves it)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=is_master, timeout=timedelta(seconds=timeout), wait_for_workers=False)


def _baselines_train(emit: Emit, rank, scen, engine, tensors, writer, store_port, steps, timeout, baselines, dev,
                     together):
    """Training side of the baselines: each kind in turn, ``steps + 1`` syncs each, over the same group
    (separated) or through the co-located hand-over."""
    from datetime import timedelta

    from weightsync.bench.baselines import ColocatedTrainer, needs_training_group, sync_step
    from weightsync.engines import make_layout

    wait = timedelta(seconds=timeout)
    dst = make_layout(engine.spec, scen.infer)
    store = _store(store_port, rank == 0, timeout) if scen.colocate else None
    group = None
    if scen.colocate and needs_training_group(engine):  # shards split over trainers are gathered, as slime does
        from weightsync.transport.group import free_port, new_group

        if rank == 0:
            writer.client.publish("bench-train-group", f"127.0.0.1:{free_port()}")
        host, port = writer.client.lookup("bench-train-group", timeout=timeout).rsplit(":", 1)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        group = new_group(host, int(port), rank, engine.world_size, backend, timeout,
                          device=dev if dev.type == "cuda" else None, name="bench-train")
    for kind in baselines:
        if scen.colocate:
            side = ColocatedTrainer(kind, engine, rank, tensors, store, scen.instances * dst.world_size,
                                    writer.client.publish, group)
            one = lambda step, side=side: side.step(step, wait)
        else:
            p2p = job_transport(writer)
            one = lambda step, kind=kind: sync_step(
                kind, p2p.group, p2p.ranks, engine, dst, train_rank=rank, tensors=tensors,
                device=dev, timeout=wait)
        for step in range(steps + 1):
            advance(tensors)
            synchronize(dev)
            together.wait(timeout)
            emit(BaselineStarted(emit.participant, kind, step, time.time()))
            one(step)
            synchronize(dev)
        if scen.colocate:
            side.finish(wait)  # rank 0 serves the store: it waits until every trainer and worker is through


def _reader(emit: Emit, inst: int, gpu: int, scen: Scenario, model: str, steps: int, meta: str, timeout: float,
            link_in, baselines: tuple[str, ...] = (), store_port: int = 0, device: str = "cuda",
            peer_copies: bool = True, receiver: str = "faithful", integrity: int | None = None,
            token: str | None = None, early_call: bool = True) -> None:
    from weightsync.instances.faithful import FaithfulInstance
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    me = emit.participant
    spec = load_spec(model)
    owned = None
    if receiver == "vllm":  # a real vLLM engine on dummy weights (weightsync.vllm.engine), eager
        from weightsync.vllm.engine import EngineOptions, start

        owned = start(dict(spec.config), scen.infer, EngineOptions(device=device, backend=False))
        instance = owned.instance
    elif receiver == "sglang":  # a real SGLang engine on dummy weights (weightsync.sglang.engine), decode CUDA graphs
        from weightsync.sglang.engine import EngineOptions as SGLangOptions
        from weightsync.sglang.engine import start as start_sglang

        owned = start_sglang(dict(spec.config), scen.infer, SGLangOptions(), timeout_s=timeout)
        instance = owned.instance
    else:
        instance = FaithfulInstance(dict(spec.config), scen.infer, device=f"cuda:{gpu}" if device == "cuda" else "cpu",
                                    fill=float("nan"))
    try:
        reader = WeightReader(instance, meta=meta, job="bench", token=token, instance_id=inst,
                              instances=scen.instances, timeout_s=timeout, colocate=scen.colocate,
                              peer_copies=peer_copies, transport=scen.transport, early_call=early_call,
                              **_integrity(integrity)).connect()
        # memory beyond the weights over all steps: the transport's buffers (allocated in the first step and
        # kept) and anything a step allocates on top
        base = instance.call(reset_peak)
        for step in range(steps + 1):
            reader.update(step)
            emit(StepDone(me, step, 0.0, sum(s.bytes for s in reader.last_stats), None, end=time.time(),
                          transfer_seconds=max(s.seconds for s in reader.last_stats)))
            if step and inst == 0:
                emit(Phases(me, "reader", reader.last_timing))
                if isinstance(getattr(instance, "last_timing", None), dict) and instance.last_timing:
                    # the instance's own split of the step (SGLang: pause/lock, calls or mailbox, flush, unlock)
                    emit(Phases(me, "instance", dict(instance.last_timing)))
        peak = max(p - b for p, b in zip(instance.call(peak_memory), base))
        fp8 = "quant=fp8" in scen.infer  # the engine holds FP8: checked against the reference quantizer
        if fp8:
            mismatched = tuple(n for names in instance.call(check_fp8, model, scen.infer, steps + 1) for n in names)
            exact = not mismatched
        else:
            mismatched, exact = (), all(instance.call(check, model, scen.infer, steps + 1))
        on_gpu = device == "cuda"  # a CPU run measures no ceilings
        copy_bw = instance.call(copy_ceiling, 1 << 30)[0] if scen.one_gpu and on_gpu else None
        nvlink = None
        if scen.colocate and instance.world_size > 1 and on_gpu:  # cross-GPU pieces: copies over NVLink
            nvlink = peer_bandwidth(instance, 4 << 30, 256 << 20)
        if not scen.colocate and scen.transport == "p2p" and inst == 0 and on_gpu:
            ready: LinkReady = link_in.get(timeout=timeout)
            instance.call(link_recv, list(ready.sizes), ready.group_rank)
        for k, kind in enumerate(baselines):
            doublings = (steps + 1) * (k + 2)  # ours, then each baseline, advanced steps + 1 times each
            ends = instance.call(_baseline_worker, kind, model, scen, inst, steps, timeout, doublings,
                                 (meta, store_port, token), timeout_s=timeout * (steps + 2))
            for step in range(steps + 1):
                emit(BaselineEnded(me, kind, step, max(e[0][step] for e in ends)))
            emit(BaselineVerified(me, kind, all(e[1] for e in ends)))
        pushed = sum(s.stats.pushed_bytes for s in reader.last_stats)  # the last step's
        emit(InstanceMeasured(me, exact, copy_bw, peak, nvlink, reader.shape.peer_copies, pushed, mismatched))
    finally:
        (owned or instance).close()


def _baseline_worker(ctx, kind: str, model: str, scen: Scenario, inst: int, steps: int, timeout: float,
                     doublings: int, link: tuple[str, int, str | None]):
    """On an inference worker: take part in ``steps + 1`` baseline syncs; end times and a final bit check."""
    from datetime import timedelta

    from weightsync.bench.baselines import ColocatedWorker, sync_step
    from weightsync.engines import make_layout
    from weightsync.meta.client import MetaClient
    from weightsync.spec import load_spec

    spec = load_spec(model)
    src, dst = make_layout(spec, scen.train), make_layout(spec, scen.infer)
    wait = timedelta(seconds=timeout)
    if scen.colocate:
        meta, port, token = link
        store = _store(port, False, timeout)
        client = MetaClient(meta, "bench", token=token, timeout=timeout)
        side = ColocatedWorker(kind, src, dst.layout(ctx.rank), inst * dst.world_size + ctx.rank, ctx.tensors, store,
                               lambda key: client.lookup(key, timeout=timeout))
        one = lambda: side.step(step, wait)
    else:
        transport = ctx.reader.receiver.transport  # the job's P2PTransport: its group and ranks
        one = lambda: sync_step(kind, transport.group, transport.ranks, src, dst, infer=(inst, ctx.rank),
                                tensors=ctx.tensors, device=ctx.device, timeout=wait)
    ends = []
    for step in range(steps + 1):
        one()
        synchronize(ctx.device)
        ends.append(time.time())
    if scen.colocate:
        side.finish()
    return ends, check(ctx, model, scen.infer, doublings)


# -- driver -----------------------------------------------------------------------------------------


@dataclass
class _Timings:
    """What the driver gathers from the events, keyed by step (and baseline kind)."""

    starts: dict[int, float] = field(default_factory=dict)
    ends: dict[int, float] = field(default_factory=dict)
    moved: dict[int, int] = field(default_factory=dict)
    transfer: dict[int, float] = field(default_factory=dict)  # per step: the slowest worker's time in the transport
    reported: dict[int, int] = field(default_factory=dict)  # per step: instances that reported it
    phases: dict[str, list[float]] = field(default_factory=dict)  # per timed step (training rank 0, instance 0)
    bstarts: dict[tuple[str, int], float] = field(default_factory=dict)
    bends: dict[tuple[str, int], float] = field(default_factory=dict)
    bverified: dict[str, bool] = field(default_factory=dict)
    trainers: list[TrainerMeasured] = field(default_factory=list)
    instances: list[InstanceMeasured] = field(default_factory=list)


def run(scenario: str, model: str, steps: int = 5, timeout: float = 300.0,
        baselines: tuple[str, ...] = ("naive", "bucketed"), device: str = "cuda", peer_copies: bool = True,
        receiver: str = "faithful", integrity: int | None = None, delta=None, quant: str | None = None,
        early_call: bool = True) -> dict:
    """One scenario: our timed steps, the ceilings, then the baselines; a JSON-ready result.

    ``early_call=False``: the readers wait for the trainers' `written` before sending a step's call
    (``WeightReader(early_call=False)``), as every run before 4ea3863 did.

    ``peer_copies=False`` makes co-located workers take other GPUs' pieces through their NCCL group, as
    on a host whose GPUs cannot reach each other's memory (the ceiling stays the hardware's).

    ``device="cpu"`` runs the same processes, groups (gloo, shared memory) and checks on CPU with no
    ceilings, floor or checkpoint-engine: a rehearsal of a scenario's wiring, not a measurement.

    ``receiver="vllm"``: each instance is a real vLLM engine (dummy weights, eager; the worker extension
    runs the reader's calls and the checks in vLLM's own workers) instead of layout-faithful workers;
    co-located scenarios on one instance's GPUs only (vLLM picks its GPUs from 0).

    ``delta`` (a :class:`weightsync.bench.delta.DeltaOptions`): after the full steps, delta jobs on the same
    GPUs, each step changing a given fraction of the elements; ``result["delta"]`` holds their rows against
    this run's full step and ceiling (:mod:`weightsync.bench.delta`).

    ``quant="fp8"``: the inference instance is served in block FP8 (``<infer>,quant=fp8``: the layout-faithful FP8
    workers, or a real vLLM engine on dummy FP8 weights), so every step goes through the fp8 codec (quantized on the
    way: co-located, by the worker straight from the trainer's memory; nixl-1gpu, by the trainer into its registered
    frames, which the worker READs); integrity off (its sums cover the bf16 sources), no baselines (they move bf16
    bytes), one-GPU scenarios (colo-1gpu, nixl-1gpu). ``bytes_moved`` is what lands (e4m3 + scales + the bf16 rest);
    the floor counts the quantizer's memory traffic (read bf16, write e4m3 and scales; nixl-1gpu: and the reader's
    copy of what it wrote) at the device copy's rate; ``quantize_seconds`` times the quantize kernel alone on every
    FP8 weight of the model (one launch a weight, as the codec launches them); nixl-1gpu's writers get their frames
    region on top of the memory budget (:func:`writer_budget`). :func:`run_quant` runs bf16 and FP8 side by side."""
    from weightsync.engines import make_layout
    from weightsync.spec import load_spec
    from weightsync.transport.group import free_port

    if scenario not in SCENARIOS:
        raise ConfigError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    scen = SCENARIOS[scenario]
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"device must be cuda or cpu, not {device!r}")
    if device == "cuda" and torch.cuda.device_count() < scen.gpus:
        raise ConfigError(f"{scenario} needs {scen.gpus} GPUs, {torch.cuda.device_count()} visible")
    spec = load_spec(model)
    train = make_layout(spec, scen.train)
    infer = make_layout(spec, scen.infer)
    unknown = set(baselines) - {"naive", "bucketed", CHECKPOINT_ENGINE}
    if unknown:
        raise ConfigError(f"unknown baselines {sorted(unknown)}; known: naive, bucketed, {CHECKPOINT_ENGINE}")
    if device == "cpu" and CHECKPOINT_ENGINE in baselines:
        raise ConfigError(f"{CHECKPOINT_ENGINE} runs on GPUs only")
    if receiver not in ("faithful", "vllm", "sglang"):
        raise ConfigError(f"receiver must be faithful, vllm or sglang, not {receiver!r}")
    if receiver == "sglang":  # SGLang's layout; its engine takes GPU 0, which one-GPU scenarios share (nixl-1gpu too)
        if not (scen.one_gpu and scen.instances == 1):
            raise ConfigError(f"--receiver sglang runs one-GPU one-instance scenarios (colo-1gpu, nixl-1gpu); "
                              f"{scenario} is not one")
        scen = replace(scen, infer=scen.infer.replace("vllm:", "sglang:", 1))
    if receiver == "vllm" and not (scen.colocate and scen.instances == 1):
        raise ConfigError(f"--receiver vllm runs co-located one-instance scenarios (its engine takes GPUs from 0); "
                          f"{scenario} is not one")
    if delta is not None:
        from weightsync.bench.delta import check_options

        check_options(scen, scenario, delta, baselines)
    if quant not in (None, "none", "fp8"):
        raise ConfigError(f"quant must be fp8 or none, not {quant!r}")
    quant = None if quant == "none" else quant
    if quant == "fp8":
        if delta is not None:
            raise ConfigError("--quant fp8 with --delta: delta and FP8 together are not built (a delta of the e4m3 "
                              "bytes); drop one")
        if not scen.one_gpu or scen.transport not in ("p2p", "nixl") or receiver == "sglang":
            raise ConfigError(f"--quant fp8 runs one-GPU scenarios into a vllm layout (colo-1gpu, nixl-1gpu); "
                              f"{scenario} ({scen.transport}, receiver {receiver}) is not one: the bench's SGLang "
                              "receiver is not FP8")
        if integrity:
            raise ConfigError("--quant fp8 with --integrity: the sums cover the trainer's bf16 bytes, not the FP8 "
                              "bytes that land; use --integrity 0")
        integrity, baselines = 0, ()
        scen = replace(scen, infer=f"{scen.infer},quant=fp8")
        infer = make_layout(spec, scen.infer)
    if scen.transport != "p2p":  # the baselines run over the job's NCCL group, which only p2p builds
        baselines = ()
    requested = baselines
    baselines = tuple(b for b in baselines if b != CHECKPOINT_ENGINE)  # run in our processes
    t = _Timings()
    result: dict = {"scenario": scenario, "model": model, "train": scen.train, "infer": scen.infer,
                    "instances": scen.instances, "colocate": scen.colocate, "transport": scen.transport,
                    "device": device, "receiver": receiver, "quant": quant or "none",
                    "integrity": integrity, "early_call": early_call, "verified": False, "efficiency": None,
                    "errors": [],
                    **environment()}
    # the MetaServer runs with an admin token that stays here; the participants get the bench job's token only
    with LocalJob(deadline_s=timeout * (steps + 4), exit_grace_s=30.0, meta_token=secrets.token_hex(16)) as job:
        token = job.job_token("bench")
        link_q = job.ctx.Queue()

        def on_event(ev: Event) -> None:
            if isinstance(ev, StepStarted):
                t.starts[ev.step] = min(t.starts.get(ev.step, ev.at), ev.at)
            elif isinstance(ev, StepDone):
                s = ev.step
                t.ends[s] = max(t.ends.get(s, 0.0), ev.end)
                t.moved[s] = t.moved.get(s, 0) + ev.bytes
                t.transfer[s] = max(t.transfer.get(s, 0.0), ev.transfer_seconds)
                t.reported[s] = t.reported.get(s, 0) + 1
                if s == steps and t.reported[s] == scen.instances:  # ours are done; baselines may take long
                    ours = [t.ends[k] - t.starts[k] for k in range(1, steps + 1) if k in t.starts and k in t.ends]
                    if ours:
                        print(json.dumps({"scenario": scenario, "model": model, "partial": "weightsync steps done",
                                          "median_seconds": statistics.median(ours), "step_seconds": ours}),
                              file=sys.stderr, flush=True)
            elif isinstance(ev, BaselineStarted):
                key = (ev.kind, ev.step)
                t.bstarts[key] = min(t.bstarts.get(key, ev.at), ev.at)
            elif isinstance(ev, BaselineEnded):
                key = (ev.kind, ev.step)
                t.bends[key] = max(t.bends.get(key, 0.0), ev.at)
            elif isinstance(ev, BaselineVerified):
                t.bverified[ev.kind] = t.bverified.get(ev.kind, True) and ev.exact
            elif isinstance(ev, Phases):
                for name, sec in ev.seconds.items():
                    t.phases.setdefault(f"{ev.side}.{name}", []).append(sec)
            elif isinstance(ev, LinkReady):
                link_q.put(ev)  # to instance 0, which receives the link-ceiling messages
            elif isinstance(ev, TrainerMeasured):
                t.trainers.append(ev)
            elif isinstance(ev, InstanceMeasured):
                t.instances.append(ev)

        store_port = free_port()
        together = job.ctx.Barrier(train.world_size)
        for r in range(train.world_size):
            job.add(Participant.trainer(r), _trainer, r, scen, model, steps, job.meta_url, timeout, baselines,
                    store_port, device, together, integrity, token)
        for i in range(scen.instances):
            gpu = 0 if scen.one_gpu else train.world_size + i * infer.world_size
            job.add(Participant.instance(i), _reader, i, gpu, scen, model, steps, job.meta_url, timeout, link_q,
                    baselines, store_port, device, peer_copies, receiver, integrity, token, early_call)
        outcome = job.run(on_event=on_event)
    for m in t.instances:
        if m.mismatched:
            result["errors"].append(f"{m.participant}: {len(m.mismatched)} tensor(s) do not hold the last step: "
                                    + ", ".join(m.mismatched[:8]))
    if outcome.failure is not None:
        f = outcome.failure
        result["errors"].append(f"{f.line()}\n{f.traceback}" if f.traceback else f.line())
    times = [t.ends[s] - t.starts[s] for s in range(1, steps + 1) if s in t.ends and s in t.starts]
    if result["errors"] or len(times) < steps:
        result["errors"].append(f"only {len(times)} of {steps} timed steps completed")
        return result
    bytes_moved = t.moved[steps]
    per_gpu = moved_per_gpu(train, infer, scen)
    if quant == "fp8":  # the quantizer reads bf16 and writes e4m3 + scales: its traffic in copy-equivalent bytes
        per_gpu = {g: (fp8_copy_bytes(train, infer, scen), 0) for g in per_gpu}
    busiest = max(local + remote for local, remote in per_gpu.values())
    if device == "cpu":
        ceiling, floor, ceiling_name = None, None, "none: a CPU rehearsal measures no ceiling"
    elif scen.colocate:
        ceiling = min(m.copy_bytes_per_s for m in t.instances if m.copy_bytes_per_s)
        nvlink = min((m.nvlink_bytes_per_s for m in t.instances if m.nvlink_bytes_per_s), default=None)
        # same-GPU bytes at copy speed and cross-GPU bytes over NVLink can overlap: the slower one bounds
        floor = max(max(local / ceiling, remote / nvlink if nvlink else 0.0) for local, remote in per_gpu.values())
        ceiling_name = ("device copy (bytes copied/s); for cross-GPU pieces, GPUs copying into each other "
                        "both ways at once by their copy engines")
        result["nvlink_bytes_per_s"] = nvlink
    elif scen.gpus == 1:  # separated on one GPU (nixl-1gpu): every byte crosses that GPU's memory once
        ceiling = min(m.copy_bytes_per_s for m in t.instances if m.copy_bytes_per_s)
        floor = busiest / ceiling
        ceiling_name = "device copy of the same bytes on the one GPU (bytes copied/s)"
    else:
        ceiling = min(m.link_bytes_per_s for m in t.trainers if m.link_bytes_per_s)
        floor = busiest / ceiling
        ceiling_name = "NCCL send/recv, same messages, same communicator"
    median = statistics.median(times)
    result.update(
        bytes_moved=bytes_moved,
        median_seconds=median,
        min_seconds=min(times),
        max_seconds=max(times),
        step_seconds=times,
        transfer_seconds=[t.transfer[s] for s in range(1, steps + 1)],
        transfer_median_seconds=statistics.median(t.transfer[s] for s in range(1, steps + 1)),
        phase_median_seconds={k: statistics.median(v) for k, v in sorted(t.phases.items())},
        phase_seconds=dict(sorted(t.phases.items())),  # per timed step: an outlier step can be told apart
        ceiling_bytes_per_s=ceiling,
        ceiling=ceiling_name,
        floor_seconds=floor,
        efficiency=floor / median if floor is not None else None,
        verified=all(m.exact for m in t.instances),
        peak_transient_bytes=max([m.peak_bytes for m in t.trainers] + [m.peak_bytes for m in t.instances]),
        # the writers' and readers' default, checked at set-up (FP8 over nixl: the writers' frames region on top)
        memory_budget_bytes=max(writer_budget(scen, train.layout(r).bytes_held(spec)) for r in range(train.world_size)),
        # co-located: whether workers copied other GPUs' pieces directly (else through their NCCL group)
        peer_copies=all(m.peer_copies for m in t.instances) if scen.colocate else None,
        # co-located: bytes a step's workers wrote into other workers' tensors on other GPUs (the push)
        pushed_bytes=sum(m.pushed_bytes for m in t.instances) if scen.colocate else None,
    )
    result["baselines"] = {}
    for kind in baselines:
        bt = [t.bends[kind, s] - t.bstarts[kind, s] for s in range(1, steps + 1)
              if (kind, s) in t.bends and (kind, s) in t.bstarts]
        if len(bt) < steps:
            result["baselines"][kind] = {"ran": False, "why": f"only {len(bt)} steps completed"}
            continue
        m = statistics.median(bt)
        result["baselines"][kind] = {"ran": True, "median_seconds": m, "min_seconds": min(bt), "max_seconds": max(bt),
                                     "verified": t.bverified.get(kind, False), "speedup": m / median}
    if CHECKPOINT_ENGINE in requested:  # its own processes on the same GPUs, once ours have exited
        from weightsync.bench.ckpt_engine import run_checkpoint_engine

        ce = run_checkpoint_engine(model, scenario, steps, timeout)
        if ce.get("ran") and "median_seconds" in ce:
            ce["speedup"] = ce["median_seconds"] / median
            if ce.get("median_seconds_without_h2d"):
                ce["speedup_without_h2d"] = ce["median_seconds_without_h2d"] / median
        result["baselines"][CHECKPOINT_ENGINE] = ce
    if quant == "fp8" and device == "cuda":  # the kernel alone, in this process, once the job's have exited
        result.update(quantize_time(spec, train))
    if delta is not None:  # its own jobs on the same GPUs, once the full steps' processes have exited
        from weightsync.bench.delta import run_all

        result["delta"] = run_all(scenario, scen, model, delta, timeout, device, _integrity(integrity), result)
    return result


def check_fp8(ctx, model: str, engine: str, doublings: int) -> list[str]:
    """On an inference worker of an FP8-served instance: the local tensors that do not hold the FP8 checkpoint of
    the base data doubled ``doublings`` times (each FP8 weight through the reference quantizer, as
    ``save_checkpoint(dir, quant="fp8")`` writes it; its scale piece the scales of the blocks that piece holds),
    bit for bit; empty: verified.

    A vLLM layer whose kernel re-lays FP8 after loading (DeepGEMM, vLLM's default on Hopper: UE8M0 requantization,
    ``weightsync.vllm.live``'s requantizing transforms) holds the engine's form instead: there the reference
    checkpoint form is written into the layer's live tensors and the kernel's own post-load step run on it once,
    as a fresh engine's load runs it, and what it leaves is compared with what the synced step had left."""
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES, local_view
    from weightsync.quant.fp8 import quantize_reference
    from weightsync.quant.layout import fp8_layout
    from weightsync.spec import load_spec

    spec = load_spec(model)
    layout = fp8_layout(make_layout(spec, engine))
    scales = {f.scale.name: w for w, f in layout.fp8.items()}
    cache: dict = {}

    def canonical(name: str) -> torch.Tensor:
        w = scales.get(name, name)
        if w not in cache:
            c = spec.by_name[w]
            full = canonical_region(c.name, c.shape, TORCH_DTYPES[c.dtype], tuple((0, n) for n in c.shape),
                                    ctx.device) * (2 ** doublings)
            cache.clear()  # one tensor (and its scales) at a time: qwen3-8b's largest is ~1.2 GB in bf16
            if w in layout.fp8:
                q = quantize_reference(full, w)
                cache[w], cache[layout.fp8[w].scale.name] = q.weight, q.scale_inv
            else:
                cache[w] = full
        return cache[name]

    def reference(p) -> torch.Tensor:  # piece ``p`` of the reference checkpoint form
        return canonical(p.canonical)[tuple(slice(o, o + n) for o, n in p.canon_box)]

    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and torch.equal(a.contiguous().view(bits[a.element_size()]),
                                                  b.contiguous().view(bits[b.element_size()]))

    local = layout.layout(ctx.rank).tensors
    live = ctx.state.get("live")  # a vLLM worker's weightsync.vllm.live.LiveModel
    requant = {v.data_ptr(): t for t in getattr(live, "transforms", ()) if hasattr(t, "kernel")
               for v in t.live.values()}
    relaid: dict = {}
    bad = []
    for name, t in sorted(local.items(), key=lambda kv: kv[0].removesuffix("_scale_inv")):
        tensor = ctx.tensors[name]
        if str(tensor.dtype).removeprefix("torch.") != t.dtype:
            bad.append(f"{name}: {tensor.dtype}, the layout says {t.dtype}")
            continue
        step = requant.get(tensor.data_ptr())
        if step is not None:
            relaid.setdefault(step, []).append(name)
            continue
        if not all(same(local_view(tensor, p), reference(p).to(tensor.dtype)) for p in t.pieces):
            bad.append(name)
    for step, names in relaid.items():
        synced = {n: ctx.tensors[n].clone() for n in names}  # what the synced step's post-load run left
        for n in names:
            for p in local[n].pieces:
                local_view(ctx.tensors[n], p).copy_(reference(p))
        step.run()  # the engine kernel's own post-load step, once, on the reference checkpoint form
        bad += [f"{n} (after {type(step.kernel).__name__}'s post-load step)" for n in names
                if not same(ctx.tensors[n], synced[n])]
    return bad


def writer_budget(scen: Scenario, held: int) -> int:
    """A training rank's memory budget: the default, and for FP8 over nixl its frames region on top (every distinct
    bucket's payload -- e4m3 bytes, scales, the bf16 rest: ~0.58 of the rank's bf16 bytes -- stays registered for the
    readers' one-sided READs; granted as the ``held`` bytes, as the delta bench grants its previous version)."""
    frames = "quant=fp8" in scen.infer and scen.transport == "nixl"
    return DEFAULT_MEMORY_BUDGET + (held if frames else 0)


def fp8_copy_bytes(train, infer, scen: Scenario) -> int:
    """An FP8 step's device traffic in copy-equivalent bytes (a copy of n bytes reads and writes n): each FP8 copy
    reads its bf16/fp32 box and writes e4m3 bytes and fp32 scales, so it counts (read + written) / 2; the other
    copies count their bytes. Separated on one GPU (nixl-1gpu) the trainer quantizes into its own memory and the
    reader then copies what it wrote into the engine's: each FP8 copy counts that copy of its written bytes too."""
    from weightsync.plan.planner import Planner
    from weightsync.plan.topology import Topology
    from weightsync.quant.fp8 import BLOCK, cdiv

    fp8 = set(getattr(infer, "fp8", None) or _fp8_names(infer))
    topo = Topology.colocated(train.world_size, infer.world_size, scen.instances)
    planner = Planner(train, infer, scen.instances, topo)
    total = 0
    for inst in range(scen.instances):
        for r in range(infer.world_size):
            for c in planner.recv_copies(inst, r):
                if c.canonical in fp8:
                    (_, rows), (_, cols) = c.canon_box[-2:]
                    lead = c.nbytes // (rows * cols * _itemsize(c.dtype))
                    written = lead * (rows * cols + 4 * cdiv(rows, BLOCK) * cdiv(cols, BLOCK))
                    total += (c.nbytes + written) // 2 + (0 if scen.colocate else written)
                else:
                    total += c.nbytes
    return total


def _itemsize(dtype: str) -> int:
    from weightsync.layout.materialize import TORCH_DTYPES

    return torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()


def _fp8_names(infer) -> list[str]:
    from weightsync.quant.layout import fp8_layout

    return list(fp8_layout(infer).fp8)


def quantize_time(spec, train, repeats: int = 5) -> dict:
    """The quantize kernel alone on every FP8 canonical weight of ``spec`` (bf16 on cuda:0, one launch a weight, as
    the codec launches them per copy): median seconds of ``repeats`` after a warm-up, and its memory traffic."""
    from weightsync.layout.materialize import TORCH_DTYPES
    from weightsync.quant.config import BlockFP8, fp8_tensors
    from weightsync.quant.fp8 import Quantized, quantize, scale_shape

    dev = torch.device("cuda", 0)
    xs, outs, names = [], [], []
    for f in fp8_tensors(spec, BlockFP8()):
        c = f.weight
        xs.append(canonical_region(c.name, c.shape, TORCH_DTYPES[spec.by_name[c.name].dtype],
                                   tuple((0, n) for n in c.shape), dev))
        outs.append(Quantized(torch.empty(c.shape, dtype=torch.float8_e4m3fn, device=dev),
                              torch.empty(scale_shape(c.shape), dtype=torch.float32, device=dev)))
        names.append(c.name)
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for x, o, n in zip(xs, outs, names):
            quantize(x, out=o, name=n)
        torch.cuda.synchronize(dev)
        if i:
            times.append(time.perf_counter() - t0)
    read = sum(x.numel() * x.element_size() for x in xs)
    written = sum(o.weight.numel() + 4 * o.scale_inv.numel() for o in outs)
    med = statistics.median(times)
    got = {"quantize_seconds": med, "quantize_weights": len(xs), "quantize_read_bytes": read,
           "quantize_written_bytes": written, "quantize_bytes_per_s": (read + written) / med}
    got.update(_quantize_graphs(xs, outs, names, dev, repeats))
    return got


def _quantize_graphs(xs, outs, names, dev, repeats: int) -> dict:
    """The same quantization as nixl's FP8 trainer replays it (:func:`weightsync.quant.fp8.prepare` captured in one
    CUDA graph): one launch a weight (what the transports run), and the one-launch kernel with alignment hints,
    checked bit for bit against the former; median seconds of ``repeats`` replays after a warm-up each."""
    from weightsync.quant.fp8 import Quantized, prepare

    def graph_time(run) -> float:
        run()  # compiles outside the capture
        torch.cuda.synchronize(dev)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            g.capture_begin(capture_error_mode="thread_local")
            run()
            g.capture_end()
        torch.cuda.current_stream(dev).wait_stream(s)
        times = []
        for i in range(repeats + 1):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            g.replay()
            torch.cuda.synchronize(dev)
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    out: dict = {}
    try:
        out["quantize_graph_seconds"] = graph_time(prepare(xs, outs, names, one_launch=False))
        other = [Quantized(torch.empty_like(o.weight), torch.empty_like(o.scale_inv)) for o in outs]
        out["quantize_one_launch_graph_seconds"] = graph_time(prepare(xs, other, names, one_launch=True))
        out["quantize_one_launch_bit_identical"] = all(
            torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
            and torch.equal(a.scale_inv.view(torch.int32), b.scale_inv.view(torch.int32)) for a, b in zip(outs, other))
    except Exception as e:  # noqa: BLE001 - a measurement beside the result, never its failure
        out["quantize_graph_error"] = f"{type(e).__name__}: {e}"
    return out


def run_quant(scenario: str, model: str, steps: int = 5, timeout: float = 300.0, device: str = "cuda",
              receiver: str = "faithful", peer_copies: bool = True, early_call: bool = True) -> dict:
    """``weightsync bench --quant fp8``: the scenario in bf16, then in FP8, in one call (the same GPUs, the same
    model, each with its own ceiling); the FP8 result carries the bf16 one beside it."""
    bf16 = run(scenario, model, steps, timeout, (), device, peer_copies, receiver, 0, early_call=early_call)
    fp8 = run(scenario, model, steps, timeout, (), device, peer_copies, receiver, 0, quant="fp8", early_call=early_call)
    if not bf16.get("errors") and not fp8.get("errors"):
        fp8["bf16"] = {k: bf16.get(k) for k in ("bytes_moved", "median_seconds", "efficiency", "floor_seconds",
                                                  "ceiling_bytes_per_s", "verified")}
        fp8["bytes_ratio_to_bf16"] = fp8["bytes_moved"] / bf16["bytes_moved"]
        fp8["seconds_ratio_to_bf16"] = fp8["median_seconds"] / bf16["median_seconds"]
    return {"scenario": scenario, "model": model, "receiver": receiver, "quant": "fp8", "commit": fp8.get("commit"),
            "runs": [bf16, fp8], "verified": bool(bf16.get("verified") and fp8.get("verified")),
            "efficiency": fp8.get("efficiency"), "errors": bf16.get("errors", []) + fp8.get("errors", [])}


def main_from_args(args) -> int:
    if getattr(args, "lora", None):
        return lora_main(args)
    if not args.scenario:
        raise ConfigError("give a --scenario (or --lora RANK for an adapter sync)")
    baselines = tuple(b for b in args.baselines.split(",") if b)
    model = args.model or ("qwen3-8b" if args.device == "cuda" else "tiny-qwen3-moe")
    delta = delta_options(args)
    if getattr(args, "quant", "none") == "fp8":  # bf16 then FP8, side by side, per scenario
        if delta is not None:
            raise ConfigError("--quant fp8 with --delta: delta and FP8 together are not built; drop one")
        pairs = [run_quant(s, model, args.steps, args.timeout, args.device, args.receiver, not args.no_peer_copies,
                           not args.call_after_written) for s in args.scenario]
        results = [r for p in pairs for r in p["runs"]]
    else:
        results = [run(s, model, args.steps, args.timeout, baselines, args.device, not args.no_peer_copies,
                       args.receiver, args.integrity, delta, early_call=not args.call_after_written)
                   for s in args.scenario]
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0]))
    else:
        for r in results:
            if r.get("errors"):
                print(f"{r['scenario']} {r['model']}: FAILED: {r['errors']}")
                continue
            floor = (f"floor {r['floor_seconds'] * 1e3:.1f} ms, efficiency {r['efficiency']:.2f}"
                     if r["floor_seconds"] is not None else "no floor (CPU)")
            print(f"{r['scenario']} {r['model']}{' fp8' if r.get('quant') == 'fp8' else ''}: "
                  f"{r['bytes_moved'] / 1e9:.2f} GB, median {r['median_seconds'] * 1e3:.1f} ms "
                  f"[{r['min_seconds'] * 1e3:.1f}-{r['max_seconds'] * 1e3:.1f}], {floor}, "
                  f"peak transient {r['peak_transient_bytes'] / 2**20:.0f} MiB, verified {r['verified']}")
            if r.get("quantize_seconds"):
                print(f"  quantize kernel alone: {r['quantize_weights']} weights in {r['quantize_seconds'] * 1e3:.2f} ms "
                      f"({r['quantize_bytes_per_s'] / 1e9:.0f} GB/s read + written)")
            for kind, b in r.get("baselines", {}).items():
                if b["ran"]:
                    print(f"  {kind}: median {b['median_seconds'] * 1e3:.1f} ms, weightsync {b['speedup']:.2f}x faster, "
                          f"verified {b['verified']}")
                else:
                    print(f"  {kind}: not run ({b['why']})")
            for d in r.get("delta", {}).get("runs", []):
                if d["errors"]:
                    print(f"  delta (previous on {d['previous']}): FAILED: {d['errors']}")
                    continue
                for row in d["rows"]:
                    print(f"  delta {row['fraction']:.1%} changed (previous on {d['previous']}): "
                          f"{row['bytes_moved'] / 1e6:.2f} MB ({row['bytes_ratio_to_full']:.4f} of full), median "
                          f"{row['median_seconds'] * 1e3:.1f} ms, p90 {row['p90_seconds'] * 1e3:.1f} ms "
                          f"({row['seconds_ratio_to_full']:.2f} of full), verified {d['verified']}")
    return 0 if all(not r.get("errors") and r.get("verified") and r.get("delta", {}).get("verified", True)
                    for r in results) else 1


def lora_main(args) -> int:
    """``weightsync bench --lora RANK [--lora RANK ...]``: :mod:`weightsync.bench.lora`."""
    from weightsync.bench.lora import print_results, run_lora

    if args.scenario or args.delta or args.quant != "none" or args.receiver != "faithful":
        raise ConfigError("--lora runs alone: one real vLLM engine with LoRA slots, no --scenario, --delta, --quant "
                          "or --receiver")
    if any(r < 1 for r in args.lora):
        raise ConfigError(f"--lora takes adapter ranks of at least 1, got {args.lora}")
    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1 (timed repetitions), got {args.steps}")
    model = args.model or ("qwen3-8b" if args.device == "cuda" else "qwen3-0.6b")
    results = run_lora(sorted(set(args.lora)), model, args.steps, args.device, args.lora_dir,
                       log=(lambda s: print(s, file=sys.stderr)) if args.json else print)
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0]))
    else:
        print_results(results)
    return 0 if all(r["verified"] for r in results) else 1


def _fractions(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--change-fraction takes numbers (0.01 = 1%), comma-separated or repeated; got {text!r}") \
            from None


def delta_options(args):
    """``--delta`` and its options as a :class:`weightsync.bench.delta.DeltaOptions`, or None without it."""
    from weightsync.bench.delta import DEFAULT_FRACTIONS, DeltaOptions

    given = [f for text in (args.change_fraction or []) for f in _fractions(text)]
    if not args.delta:
        if given or args.delta_previous != "device":
            raise ConfigError("--change-fraction and --delta-previous go with --delta")
        return None
    previous = ("device", "host") if args.delta_previous == "both" else (args.delta_previous,)
    return DeltaOptions(tuple(given) or DEFAULT_FRACTIONS, args.steps, previous)


def add_arguments(p) -> None:
    p.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="required unless --lora")
    p.add_argument("--model", default=None,
                   help="preset or config.json (default qwen3-8b; with --device cpu tiny-qwen3-moe, with --lora and "
                        "--device cpu qwen3-0.6b)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (with --lora: timed repetitions of each path)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--baselines", default="naive,bucketed",
                   help=f"comma-separated: naive,bucketed,{CHECKPOINT_ENGINE} (or empty); {CHECKPOINT_ENGINE} needs "
                        "checkpoint-engine==0.4.2 importable")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: rehearse a scenario's processes, groups and checks on CPU (gloo, shared memory) with "
                        "a small model; no ceilings, no timings worth keeping")
    p.add_argument("--no-peer-copies", action="store_true",
                   help="co-located: take other GPUs' pieces through the workers' NCCL group instead of copying them "
                        "out of the trainers' memory (as on GPUs without peer access)")
    p.add_argument("--receiver", choices=["faithful", "vllm", "sglang"], default="faithful",
                   help="vllm: the inference instance is a real vLLM engine (dummy weights, eager) instead of "
                        "layout-faithful workers (co-located one-instance scenarios); sglang: a real SGLang engine "
                        "(dummy weights, decode CUDA graphs; colo-1gpu, nixl-1gpu; the SGLang GPU kit on the path)")
    p.add_argument("--integrity", type=int, default=None,
                   help="check every Nth step's checksums (weightsync.integrity; 1: every step, 0: never); "
                        "default: the library's")
    p.add_argument("--call-after-written", action="store_true",
                   help="co-located/NIXL: send each step's call only once the trainers announced it written "
                        "(WeightReader(early_call=False)), for an A/B against the default early call")
    p.add_argument("--delta", action="store_true",
                   help="after the full steps, time delta steps (delta=True) in which each step changes exactly "
                        "--change-fraction of the elements at random positions (separated scenarios)")
    p.add_argument("--change-fraction", action="append", metavar="F",
                   help="with --delta: the fraction of elements each step changes, repeatable or comma-separated "
                        "(default 0.001,0.01,0.1: lr 1e-7..1e-5 as measured); --steps timed steps at each")
    p.add_argument("--delta-previous", choices=["device", "host", "both"], default="device",
                   help="with --delta: where the sender keeps its previous version (host: delta_host=True, pinned "
                        "host memory where CUDA is present); both: one delta job each")
    p.add_argument("--quant", choices=["none", "fp8"], default="none",
                   help="fp8: the scenario in bf16, then into an instance served in block FP8 (the fp8 codec), side by "
                        "side; one-GPU scenarios (colo-1gpu, nixl-1gpu), integrity off, no baselines")
    p.add_argument("--lora", action="append", type=int, metavar="RANK",
                   help="instead of a scenario: one LoRA adapter sync (all linear modules, this rank; repeatable) into "
                        "a real vLLM engine's slots in place, against the engine's own disk path (PEFT "
                        "save_pretrained, vLLM add_lora) on the same engine, every repetition checked bit for bit "
                        "(weightsync.bench.lora)")
    p.add_argument("--lora-dir", default=None,
                   help="with --lora: where the disk path writes its adapter folders (default: the temporary folder)")
    p.add_argument("--json", action="store_true")


__all__ = ["run", "run_quant", "check_fp8", "fp8_copy_bytes", "writer_budget", "quantize_time", "environment", "main_from_args", "add_arguments", "CHECKPOINT_ENGINE",
           "lora_main",
           # the scenarios and their data, kept importable from here
           "SCENARIOS", "Scenario", "advance", "canonical_region", "check", "init_weights", "moved_per_gpu"]
