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
import multiprocessing as mp
import queue
import statistics
import sys
import time
import zlib
from dataclasses import dataclass

import torch

from weightsync.errors import ConfigError
from weightsync.runtime.job import DEFAULT_MEMORY_BUDGET

CHECKPOINT_ENGINE = "checkpoint-engine"


def _device(kind: str, index: int) -> torch.device:
    """GPU ``index`` of a CUDA run; a CPU run (``--device cpu``: the wiring, no timings worth keeping) has one."""
    return torch.device("cuda", index) if kind == "cuda" else torch.device("cpu")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _memory(dev: torch.device, reset: bool = False) -> tuple[int, int]:
    """(allocated, peak allocated) bytes on ``dev`` (0 on CPU); ``reset`` restarts the peak first."""
    if dev.type != "cuda":
        return 0, 0
    if reset:
        torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev)


@dataclass(frozen=True)
class Scenario:
    train: str
    infer: str
    instances: int
    colocate: bool
    gpus: int


SCENARIOS = {
    "colo-1gpu": Scenario("hf", "vllm:tp=1", 1, True, 1),
    "sep-1to1": Scenario("hf", "vllm:tp=1", 1, False, 2),
    "colo-pp2-tp2": Scenario("megatron:pp=2", "vllm:tp=2", 1, True, 2),
    "sep-tp2-tp2": Scenario("megatron:tp=2", "vllm:tp=2", 1, False, 4),
    "sep-fsdp2-2x1": Scenario("fsdp:dp=2", "vllm:tp=1", 2, False, 4),
    "colo-tp2pp2-tp4": Scenario("megatron:tp=2,pp=2", "vllm:tp=4", 1, True, 4),
}


def canonical_region(name: str, shape: tuple[int, ...], dtype: torch.dtype, box, device) -> torch.Tensor:
    """A region of canonical tensor ``name``'s base data: the same bits on any rank that asks."""
    g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
    full = torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)
    return full[tuple(slice(o, o + n) for o, n in box)]


def init_weights(layout, tensors: dict, spec) -> None:
    """Write the base data into a rank's local tensors, following its pieces (once: it is slow for MoE)."""
    from weightsync.layout.materialize import TORCH_DTYPES, local_view

    with torch.no_grad():
        for name, t in layout.tensors.items():
            live = tensors[name]
            for p in t.pieces:
                c = spec.by_name[p.canonical]
                local_view(live, p).copy_(canonical_region(c.name, c.shape, TORCH_DTYPES[c.dtype], p.canon_box, live.device))


def advance(tensors: dict) -> None:
    """Make the next step's weights: every value doubled (exact in bf16), so each step's bits differ."""
    with torch.no_grad():
        for t in tensors.values():
            t.mul_(2)


def check(ctx, model: str, engine: str, doublings: int) -> bool:
    """On an inference worker: every piece holds the base data doubled ``doublings`` times, bit for bit."""
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES
    from weightsync.spec import load_spec
    from weightsync.testing import holds

    spec = load_spec(model)

    def expected(p):
        c = spec.by_name[p.canonical]
        return canonical_region(c.name, c.shape, TORCH_DTYPES[c.dtype], p.canon_box, ctx.device) * (2 ** doublings)

    return holds(make_layout(spec, engine).layout(ctx.rank), ctx.tensors, expected)


def _copy_ceiling(ctx, nbytes: int) -> float:
    """Device-to-device copy bandwidth on this worker's GPU, bytes copied per second (median of 5)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).random_()
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        torch.cuda.synchronize(ctx.device)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(ctx.device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:])


def _peer_buffers(ctx, nbytes: int) -> dict | None:
    """Workers 0 and 1: allocate the peer-copy ceiling's buffers; return an export of the destination
    for the other worker to open (CUDA IPC)."""
    from weightsync.transport.share import export_tensors

    if ctx.rank > 1:
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    ctx.state["peer_ceiling"] = {"src": src, "dst": dst}
    return export_tensors({"dst": dst})


def _peer_round(ctx, descs: list, message: int) -> tuple[float, float] | None:
    """One round of the peer-copy ceiling: workers 0 and 1 each copy ``src`` into the other's ``dst`` at
    once, by the copy engines in ``message``-byte copies (the fastest way measured,
    ``benchmarks/peer_push.py``), the other GPU's memory opened in this worker's own context as the
    co-located transport opens the trainers'. Returns wall-clock (start, end) of this worker's copies."""
    from weightsync.transport.share import import_tensors

    if ctx.rank > 1:
        return None
    state = ctx.state["peer_ceiling"]
    if "peer" not in state:
        state["peer"] = import_tensors(descs[1 - ctx.rank], cuda_device=ctx.device.index)["dst"]
    src, peer = state["src"], state["peer"]
    torch.cuda.synchronize(ctx.device)
    t0 = time.time()
    for k in range(0, src.numel(), message):
        peer[k : k + message].copy_(src[k : k + message], non_blocking=True)
    torch.cuda.synchronize(ctx.device)
    return t0, time.time()


def _peer_bandwidth(instance, nbytes: int, message: int) -> float:
    """Co-located GPUs copying into each other both ways at once: the bytes each receives per second,
    from the first start to the last end of a round (median of 3 after a warm-up). Co-located, every
    GPU sends and receives at the same time, so this, not one direction alone, is the cross-GPU ceiling."""
    descs = instance.call(_peer_buffers, nbytes)
    spans = []
    for _ in range(4):
        rounds = [r for r in instance.call(_peer_round, descs, message) if r]
        spans.append(max(e for _, e in rounds) - min(s for s, _ in rounds))
    instance.call(_drop_peer_buffers)
    return nbytes // message * message / statistics.median(spans[1:])


def _drop_peer_buffers(ctx) -> None:
    ctx.state.pop("peer_ceiling", None)
    torch.cuda.empty_cache()


def _peak(ctx) -> int:
    return _memory(ctx.device)[1]


def _link_recv(ctx, sizes: list[int], peer: int) -> None:
    """Worker 0 receives the link-ceiling messages (3 rounds) the trainer sends; other workers idle."""
    if ctx.rank != 0:
        return
    g = ctx.state["transport"].group
    buf = torch.empty(max(sizes), dtype=torch.uint8, device=ctx.device)
    for _ in range(3):
        for s in sizes:
            g.recv([buf[:s]], peer, 7).wait()
    torch.cuda.synchronize(ctx.device)


# -- processes --------------------------------------------------------------------------------------


def _trainer(rank: int, scen: Scenario, model: str, steps: int, meta: str, out, timeout: float,
             baselines: tuple[str, ...] = (), store_port: int = 0, device: str = "cuda", together=None) -> None:
    """One training rank. ``together`` (a barrier of the training ranks) starts every step's writes at
    once, as a training step's last collective would: the bench's stand-in for the optimizer (doubling
    every tensor, a kernel each: ~7,000 on a 30B PP stage) ends up to ~18 ms apart on two ranks, and
    that skew is the bench's, not the sync's."""
    try:
        from weightsync.bind import Bound
        from weightsync.engines import make_layout
        from weightsync.layout.materialize import TORCH_DTYPES
        from weightsync.runtime.writer import WeightWriter
        from weightsync.spec import load_spec

        dev = _device(device, rank)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        spec = load_spec(model)
        engine = make_layout(spec, scen.train)
        layout = engine.layout(rank)
        tensors = {n: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=dev) for n, t in layout.tensors.items()}
        writer = WeightWriter(Bound(engine, rank, layout, tensors), meta=meta, job="bench", timeout_s=timeout,
                              colocate=scen.colocate)
        peak = 0
        init_weights(layout, tensors, spec)
        for step in range(steps + 1):  # step 0 warms up
            advance(tensors)  # step s holds the base data doubled s + 1 times
            _sync(dev)
            base, _ = _memory(dev, reset=True)
            together.wait(timeout)
            out.put(("start", rank, step, time.time()))
            writer.write(step)
            peak = max(peak, _memory(dev)[1] - base)
            if step and rank == 0:
                out.put(("phases", "writer", writer.last_timing))
        sent = writer.bytes_per_step
        link = None
        if not scen.colocate and rank == 0 and writer.transport is not None and dev.type == "cuda":
            # the ceiling: the same messages, raw, over the same communicator
            sizes = [b.nbytes for bs in writer.plans.values() for b in bs]
            peer = writer.ranks.infer(0, 0)
            bufs = torch.empty(max(sizes), dtype=torch.uint8, device=dev)
            out.put(("link-ready", rank, sizes, writer.ranks.train(rank)))
            times = []
            for _ in range(3):
                _sync(dev)
                t0 = time.perf_counter()
                for s in sizes:
                    writer.transport.group.send([bufs[:s]], peer, 7).wait()
                _sync(dev)
                times.append(time.perf_counter() - t0)
            link = sum(sizes) / statistics.median(times)
        if baselines:
            _baselines_train(rank, scen, engine, tensors, writer, store_port, steps, out, timeout, baselines, dev,
                             together)
        out.put(("train-done", rank, sent, link, peak))
    except BaseException as e:
        import traceback

        out.put(("error", f"train {rank}", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _store(port: int, is_master: bool, timeout: float):
    """The TCPStore the co-located baselines signal through (training rank 0 serves it)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=is_master, timeout=timedelta(seconds=timeout), wait_for_workers=False)


def _baselines_train(rank, scen, engine, tensors, writer, store_port, steps, out, timeout, baselines, dev, together):
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
            one = lambda step, kind=kind: sync_step(
                kind, writer.transport.group, writer.ranks, engine, dst, train_rank=rank, tensors=tensors,
                device=dev, timeout=wait)
        for step in range(steps + 1):
            advance(tensors)
            _sync(dev)
            together.wait(timeout)
            out.put(("bstart", kind, step, time.time()))
            one(step)
            _sync(dev)
        if scen.colocate:
            side.finish(wait)  # rank 0 serves the store: it waits until every trainer and worker is through


def _reader(inst: int, gpu: int, scen: Scenario, model: str, steps: int, meta: str, out, timeout: float,
            link_in: mp.Queue, baselines: tuple[str, ...] = (), store_port: int = 0, device: str = "cuda",
            peer_copies: bool = True) -> None:
    instance = None
    try:
        from weightsync.instances.faithful import FaithfulInstance
        from weightsync.runtime.reader import WeightReader
        from weightsync.spec import load_spec

        spec = load_spec(model)
        instance = FaithfulInstance(dict(spec.config), scen.infer, device=f"cuda:{gpu}" if device == "cuda" else "cpu",
                                    fill=float("nan"))
        reader = WeightReader(instance, meta=meta, job="bench", instance_id=inst, instances=scen.instances,
                              timeout_s=timeout, colocate=scen.colocate, peer_copies=peer_copies)
        # memory beyond the weights over all steps: the transport's buffers (allocated in the first step and
        # kept) and anything a step allocates on top
        base = instance.call(_reset_peak)
        for step in range(steps + 1):
            reader.update(step)
            out.put(("end", inst, step, time.time(), sum(s["bytes"] for s in reader.last_stats),
                     max(s["seconds"] for s in reader.last_stats)))
            if step and inst == 0:
                out.put(("phases", "reader", reader.last_timing))
        peak = max(p - b for p, b in zip(instance.call(_peak), base))
        exact = all(instance.call(check, model, scen.infer, steps + 1))
        on_gpu = device == "cuda"  # a CPU run measures no ceilings
        copy_bw = instance.call(_copy_ceiling, 1 << 30)[0] if scen.colocate and on_gpu else None
        nvlink = None
        if scen.colocate and instance.world_size > 1 and on_gpu:  # cross-GPU pieces: copies over NVLink
            nvlink = _peer_bandwidth(instance, 4 << 30, 256 << 20)
        if not scen.colocate and inst == 0 and on_gpu:
            _, _, sizes, trainer_group_rank = link_in.get(timeout=timeout)
            instance.call(_link_recv, sizes, trainer_group_rank)
        for k, kind in enumerate(baselines):
            doublings = (steps + 1) * (k + 2)  # ours, then each baseline, advanced steps + 1 times each
            ends = instance.call(_baseline_worker, kind, model, scen, inst, steps, timeout, doublings,
                                 (meta, store_port), timeout_s=timeout * (steps + 2))
            for step in range(steps + 1):
                out.put(("bend", kind, step, max(e[0][step] for e in ends)))
            out.put(("bverified", kind, all(e[1] for e in ends)))
        pushed = sum(s["pushed_bytes"] for s in reader.last_stats)  # the last step's
        out.put(("infer-done", inst, exact, copy_bw, peak, nvlink, reader.shape.peer_copies, pushed))
    except BaseException as e:
        import traceback

        out.put(("error", f"instance {inst}", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if instance is not None:
            instance.close()


def _reset_peak(ctx) -> int:
    return _memory(ctx.device, reset=True)[0]


def _baseline_worker(ctx, kind: str, model: str, scen: Scenario, inst: int, steps: int, timeout: float,
                     doublings: int, link: tuple[str, int]):
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
        meta, port = link
        store = _store(port, False, timeout)
        client = MetaClient(meta, "bench", timeout=timeout)
        side = ColocatedWorker(kind, src, dst.layout(ctx.rank), inst * dst.world_size + ctx.rank, ctx.tensors, store,
                               lambda key: client.lookup(key, timeout=timeout))
        one = lambda: side.step(step, wait)
    else:
        transport = ctx.state["transport"]
        one = lambda: sync_step(kind, transport.group, transport.ranks, src, dst, infer=(inst, ctx.rank),
                                tensors=ctx.tensors, device=ctx.device, timeout=wait)
    ends = []
    for step in range(steps + 1):
        one()
        _sync(ctx.device)
        ends.append(time.time())
    if scen.colocate:
        side.finish()
    return ends, check(ctx, model, scen.infer, doublings)


# -- driver -----------------------------------------------------------------------------------------


def run(scenario: str, model: str, steps: int = 5, timeout: float = 300.0,
        baselines: tuple[str, ...] = ("naive", "bucketed"), device: str = "cuda", peer_copies: bool = True) -> dict:
    """One scenario: our timed steps, the ceilings, then the baselines; a JSON-ready result.

    ``peer_copies=False`` makes co-located workers take other GPUs' pieces through their NCCL group, as
    on a host whose GPUs cannot reach each other's memory (the ceiling stays the hardware's).

    ``device="cpu"`` runs the same processes, groups (gloo, shared memory) and checks on CPU with no
    ceilings, floor or checkpoint-engine: a rehearsal of a scenario's wiring, not a measurement."""
    from weightsync.engines import make_layout
    from weightsync.meta.server import MetaServer
    from weightsync.spec import load_spec

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
    requested = baselines
    baselines = tuple(b for b in baselines if b != CHECKPOINT_ENGINE)  # run in our processes
    ctx = mp.get_context("spawn")
    out, link_q = ctx.Queue(), ctx.Queue()
    starts: dict[int, float] = {}
    bstarts: dict = {}
    bends: dict = {}
    bverified: dict = {}
    ends: dict[int, float] = {}
    moved = {}
    transfer: dict[int, float] = {}  # per step: the slowest worker's time inside the transport
    reported: dict[int, int] = {}  # per step: instances that reported it
    phases: dict[str, list[float]] = {}  # where a step's time goes (training rank 0, instance 0), per timed step
    result: dict = {"scenario": scenario, "model": model, "train": scen.train, "infer": scen.infer,
                    "instances": scen.instances, "colocate": scen.colocate, "device": device, "errors": [],
                    **environment()}
    with MetaServer(port=0) as meta:
        from weightsync.transport.group import free_port

        store_port = free_port()
        together = ctx.Barrier(train.world_size)
        procs = [ctx.Process(target=_trainer, args=(r, scen, model, steps, meta.url, out, timeout, baselines,
                                                    store_port, device, together))
                 for r in range(train.world_size)]
        for i in range(scen.instances):
            gpu = 0 if scen.colocate else train.world_size + i * infer.world_size
            procs.append(ctx.Process(target=_reader, args=(i, gpu, scen, model, steps, meta.url, out, timeout, link_q,
                                                           baselines, store_port, device, peer_copies)))
        for p in procs:
            p.start()
        done_t, done_i, train_info, infer_info = 0, 0, [], []
        deadline = time.monotonic() + timeout * (steps + 4)
        while (done_t < train.world_size or done_i < scen.instances) and time.monotonic() < deadline:
            try:
                msg = out.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    result["errors"].append("a bench process died")
                    break
                continue
            kind = msg[0]
            if kind == "start":
                starts[msg[2]] = min(starts.get(msg[2], msg[3]), msg[3])
            elif kind == "end":
                ends[msg[2]] = max(ends.get(msg[2], 0.0), msg[3])
                moved[msg[2]] = moved.get(msg[2], 0) + msg[4]
                transfer[msg[2]] = max(transfer.get(msg[2], 0.0), msg[5])
                reported[msg[2]] = reported.get(msg[2], 0) + 1
                if msg[2] == steps and reported[msg[2]] == scen.instances:  # ours are done; baselines may take long
                    ours = [ends[s] - starts[s] for s in range(1, steps + 1) if s in starts and s in ends]
                    if ours:
                        print(json.dumps({"scenario": scenario, "model": model, "partial": "weightsync steps done",
                                          "median_seconds": statistics.median(ours), "step_seconds": ours}),
                              file=sys.stderr, flush=True)
            elif kind == "bstart":
                key = (msg[1], msg[2])
                bstarts[key] = min(bstarts.get(key, msg[3]), msg[3])
            elif kind == "bend":
                key = (msg[1], msg[2])
                bends[key] = max(bends.get(key, 0.0), msg[3])
            elif kind == "bverified":
                bverified[msg[1]] = bverified.get(msg[1], True) and msg[2]
            elif kind == "phases":
                for name, sec in msg[2].items():
                    phases.setdefault(f"{msg[1]}.{name}", []).append(sec)
            elif kind == "link-ready":
                link_q.put(msg)
            elif kind == "train-done":
                done_t += 1
                train_info.append(msg)
            elif kind == "infer-done":
                done_i += 1
                infer_info.append(msg)
            elif kind == "error":
                result["errors"].append(f"{msg[1]}: {msg[2]}")
                break
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    times = [ends[s] - starts[s] for s in range(1, steps + 1) if s in ends and s in starts]
    if result["errors"] or len(times) < steps:
        result["errors"].append(f"only {len(times)} of {steps} timed steps completed")
        return result
    bytes_moved = moved[steps]
    per_gpu = moved_per_gpu(train, infer, scen)
    busiest = max(local + remote for local, remote in per_gpu.values())
    if device == "cpu":
        ceiling, floor, ceiling_name = None, None, "none: a CPU rehearsal measures no ceiling"
    elif scen.colocate:
        ceiling = min(m[3] for m in infer_info if m[3])
        nvlink = min((m[5] for m in infer_info if m[5]), default=None)
        # same-GPU bytes at copy speed and cross-GPU bytes over NVLink can overlap: the slower one bounds
        floor = max(max(local / ceiling, remote / nvlink if nvlink else 0.0) for local, remote in per_gpu.values())
        ceiling_name = ("device copy (bytes copied/s); for cross-GPU pieces, GPUs copying into each other "
                        "both ways at once by their copy engines")
        result["nvlink_bytes_per_s"] = nvlink
    else:
        ceiling = min(m[3] for m in train_info if m[3])
        floor = busiest / ceiling
        ceiling_name = "NCCL send/recv, same messages, same communicator"
    median = statistics.median(times)
    result.update(
        bytes_moved=bytes_moved,
        median_seconds=median,
        min_seconds=min(times),
        max_seconds=max(times),
        step_seconds=times,
        transfer_seconds=[transfer[s] for s in range(1, steps + 1)],
        transfer_median_seconds=statistics.median(transfer[s] for s in range(1, steps + 1)),
        phase_median_seconds={k: statistics.median(v) for k, v in sorted(phases.items())},
        phase_seconds=dict(sorted(phases.items())),  # per timed step: an outlier step can be told apart
        ceiling_bytes_per_s=ceiling,
        ceiling=ceiling_name,
        floor_seconds=floor,
        efficiency=floor / median if floor is not None else None,
        verified=all(m[2] for m in infer_info),
        peak_transient_bytes=max([m[4] for m in train_info] + [m[4] for m in infer_info]),
        memory_budget_bytes=DEFAULT_MEMORY_BUDGET,  # the writers' and readers' default, checked at set-up
        # co-located: whether workers copied other GPUs' pieces directly (else through their NCCL group)
        peer_copies=all(m[6] for m in infer_info) if scen.colocate else None,
        # co-located: bytes a step's workers wrote into other workers' tensors on other GPUs (the push)
        pushed_bytes=sum(m[7] for m in infer_info) if scen.colocate else None,
    )
    result["baselines"] = {}
    for kind in baselines:
        bt = [bends[kind, s] - bstarts[kind, s] for s in range(1, steps + 1) if (kind, s) in bends and (kind, s) in bstarts]
        if len(bt) < steps:
            result["baselines"][kind] = {"ran": False, "why": f"only {len(bt)} steps completed"}
            continue
        m = statistics.median(bt)
        result["baselines"][kind] = {"ran": True, "median_seconds": m, "min_seconds": min(bt), "max_seconds": max(bt),
                                     "verified": bverified.get(kind, False), "speedup": m / median}
    if CHECKPOINT_ENGINE in requested:  # its own processes on the same GPUs, once ours have exited
        from weightsync.bench.ckpt_engine import run_checkpoint_engine

        ce = run_checkpoint_engine(model, scenario, steps, timeout)
        if ce.get("ran") and "median_seconds" in ce:
            ce["speedup"] = ce["median_seconds"] / median
            if ce.get("median_seconds_without_h2d"):
                ce["speedup_without_h2d"] = ce["median_seconds_without_h2d"] / median
        result["baselines"][CHECKPOINT_ENGINE] = ce
    return result


def environment() -> dict:
    """Where and with what a result was measured (recorded with every result)."""
    import datetime
    import os
    import subprocess

    from weightsync import __version__

    commit = os.environ.get("WEIGHTSYNC_COMMIT")  # a copied tree's .git can be stale: let the caller say
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    timeout=5).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "weightsync": __version__,
        "commit": commit,
    }


def moved_per_gpu(train, infer, scen: Scenario) -> dict[int, tuple[int, int]]:
    """(same-GPU bytes, bytes from other GPUs) each GPU must receive (the busiest one bounds the step)."""
    from weightsync.plan.planner import Planner
    from weightsync.plan.topology import Topology

    make = Topology.colocated if scen.colocate else Topology.separated
    topo = make(train.world_size, infer.world_size, scen.instances)
    planner = Planner(train, infer, scen.instances, topo)
    per: dict[int, tuple[int, int]] = {}
    for inst in range(scen.instances):
        for r in range(infer.world_size):
            gpu = topo.infer_gpu(inst, r)
            local, remote = per.get(gpu, (0, 0))
            for c in planner.recv_copies(inst, r):
                if topo.train_gpu(c.src_rank) == gpu:
                    local += c.nbytes
                else:
                    remote += c.nbytes
            per[gpu] = (local, remote)
    return per


def main_from_args(args) -> int:
    baselines = tuple(b for b in args.baselines.split(",") if b)
    model = args.model or ("qwen3-8b" if args.device == "cuda" else "tiny-qwen3-moe")
    results = [run(s, model, args.steps, args.timeout, baselines, args.device, not args.no_peer_copies)
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
            print(f"{r['scenario']} {r['model']}: {r['bytes_moved'] / 1e9:.2f} GB, median {r['median_seconds'] * 1e3:.1f} ms "
                  f"[{r['min_seconds'] * 1e3:.1f}-{r['max_seconds'] * 1e3:.1f}], {floor}, "
                  f"peak transient {r['peak_transient_bytes'] / 2**20:.0f} MiB, verified {r['verified']}")
            for kind, b in r.get("baselines", {}).items():
                if b["ran"]:
                    print(f"  {kind}: median {b['median_seconds'] * 1e3:.1f} ms, weightsync {b['speedup']:.2f}x faster, "
                          f"verified {b['verified']}")
                else:
                    print(f"  {kind}: not run ({b['why']})")
    return 0 if all(not r.get("errors") and r.get("verified") for r in results) else 1


def add_arguments(p) -> None:
    p.add_argument("--scenario", action="append", required=True, choices=sorted(SCENARIOS))
    p.add_argument("--model", default=None, help="preset or config.json (default qwen3-8b; with --device cpu tiny-qwen3-moe)")
    p.add_argument("--steps", type=int, default=5)
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
    p.add_argument("--json", action="store_true")
