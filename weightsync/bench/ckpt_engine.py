"""The ``checkpoint-engine`` baseline: Moonshot's checkpoint-engine 0.4.2, broadcast mode, its own receiver.

checkpoint-engine (``pip install checkpoint-engine==0.4.2``; imported, never copied) is run the way its
README, ``examples/update.py`` and its own tests use it: one ``ParameterServer`` process per GPU, each
with an inference-side receiver process on the same GPU that runs its
``checkpoint_engine.worker.update_weights_from_ipc`` (what its vLLM worker extension runs, with
``run`` = the model's ``load_weights``). Per step, on every PS rank: ``register_checkpoint`` +
``gather_metas`` (not timed), then ``update(name, req_func)`` with ``ranks`` unset, i.e. its
broadcast mode. ``req_func`` hands the ZMQ socket paths to the local receiver (as its tests do
with a queue; in vLLM it is an HTTP call that makes every worker run ``update_weights_from_ipc``).

Its broadcast-mode data path (``ParameterServer._update_per_bucket``), per step:

1. The weights live in pinned host memory, registered per PS rank (``register_checkpoint``: named
   tensors are copied into 4 GiB pinned buffers). Each rank *owns* the tensors it registered.
2. Bucket size: ``min(max(PS_MAX_BUCKET_SIZE_GB (default 8) GiB, largest tensor), free/3)``, ``free``
   the smallest ``PS_MEM_FRACTION`` (0.9) share of free GPU memory over the ranks (free/2 and no
   separate H2D buffer when the largest tensor does not fit in free/3). Every rank allocates a
   double buffer (2 x bucket) and, normally, an H2D buffer (1 x bucket) on its GPU.
3. Buckets go in rounds: in round i every owner copies its i-th bucket host -> GPU (the H2D
   staging, ``_copy_to_buffer``, synchronized), then, owner after owner, copies it into the
   double buffer and NCCL-broadcasts it to *every* PS rank; each rank then waits for its receiver
   to finish the previous bucket (ZMQ REQ/REP), all-reduces an error flag, synchronizes, and sends
   the bucket's tensor list (names, dtypes, shapes, offsets) to its receiver.
4. The receiver opened the double buffer once per update through CUDA IPC (the handle comes over
   ZMQ), and for every bucket calls ``run`` on views of it: here, exactly what vLLM's
   ``load_weights`` does for our layout -- every piece of its vLLM-layout tensors is copied out of
   the full canonical tensor (as ``baselines._scatter_from``). So the receiver of bucket g works
   while the PS ranks stage and broadcast bucket g + 1.

Choices where its design forces one (and for each scenario of :data:`weightsync.bench.scenarios.SCENARIOS`):

- One PS rank per GPU of the scenario, PS rank r on GPU r (its ``local_rank = rank % gpu_count``).
  The *owners* are the PS ranks on the training GPUs: each canonical tensor is registered (as the
  full HF tensor, generated on that GPU like our trainer's weights) by one training rank that holds
  part of it in the training layout, the least loaded in bytes (ties: lowest rank). So
  ``colo-1gpu``/``sep-1to1``: rank 0 owns everything; ``colo-pp2-tp2``: each pipeline stage owns
  its layers; TP/FSDP/TP+PP: the full tensors are spread over the ranks holding them (checkpoint-engine
  takes full tensors only, so the gather of TP/FSDP shards is left out, in its favour).
- Broadcast mode sends every bucket to every PS rank, and each PS rank needs a receiver on its
  socket (a REQ socket with no peer blocks). Inference workers sit where ``run.py`` puts them
  (co-located: GPU 0 on; separated: after the training GPUs). A GPU that has a PS rank but no
  inference worker (the training GPUs of a separated scenario) gets a *sink* receiver: the same
  ``update_weights_from_ipc`` with a ``run`` that does nothing. Its end is not waited for in the
  timing (the PS ranks wait for it anyway). The alternative -- PS ranks only on the inference GPUs,
  staging the trainer's weights through host memory there -- would move nothing from the training
  GPU at all; the choice here keeps the data starting on the training GPUs, as ours does.
- A new step's weights: every value doubled on the GPU (as in ``run.py``), then
  ``unregister_checkpoint`` (which keeps the pool) and ``register_checkpoint(...,
  use_shared_memory_pool=True)``, its supported way to reuse one set of pinned buffers for a new
  checkpoint of the same shapes: the GPU tensors are copied into the same pinned memory (D2H).
  That, and ``gather_metas``, is reported as ``register_seconds`` and not timed.
- Its process group: ``ParameterServer(auto_pg=False)`` and its own ``init_process_group()`` once
  (NCCL over its own TCPStore on a free port: ``master_port`` given, RANK/WORLD_SIZE/MASTER_ADDR/
  MASTER_PORT set; RANK must be in the environment since rank 0 is falsy in its constructor). With
  ``auto_pg=True`` it would destroy the group at the end of every ``update()`` and re-create it in
  the next ``gather_metas`` -- outside the timed window either way; one group is simpler.
- No mooncake (RDMA) package: its P2P store is off, which only its p2p mode needs.

Timing, per step: from the moment ``update()`` is called on the PS ranks (after the step's weights
are registered and a barrier; the earliest rank's start) to the latest *inference* receiver's
return from ``update_weights_from_ipc`` plus ``torch.cuda.synchronize``. The H2D staging is
measured inside the same steps by wrapping ``ParameterServer._copy_to_buffer`` (its pinned-host ->
GPU bucket copies, ending in a device synchronize) with a timer: per step the busiest rank's total.
``median_seconds_without_h2d`` is the median of (step time - that H2D time). ``register_seconds``
(the D2H into its pinned buffers + ``gather_metas``, before the step) is reported beside it, and
``median_seconds_with_register`` adds it: from weights on the training GPUs to weights in the workers.
Its environment variables pass through (``PS_MAX_BUCKET_SIZE_GB`` must give a multiple of 256 bytes:
the second half of its double buffer starts one bucket in, and its tensor views need aligned offsets).

Run on the GPU host: ``python3 -m weightsync.bench.ckpt_engine --scenario sep-1to1 --model qwen3-8b``
(JSON on stdout; checkpoint-engine's own log on stderr at WARNING, ``WEIGHTSYNC_CKPT_LOG=INFO`` for all).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing as mp
import os
import queue
import re
import statistics
import sys
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta

import torch

from weightsync.bench.scenarios import SCENARIOS, canonical_region
from weightsync.errors import ConfigError


VERSION = "0.4.2"  # the checkpoint-engine release this baseline was written against
CHECKPOINT = "weightsync-bench"
HOW_WITHOUT_H2D = (
    "step time minus the time checkpoint-engine spent staging buckets from pinned host memory to the GPU "
    "(ParameterServer._copy_to_buffer: its host->device copies and the device synchronize ending them, timed "
    "in the same steps by wrapping that method; per step the busiest PS rank's total). Its NCCL broadcast, "
    "the device copies into its double buffer, the ZMQ/CUDA-IPC hand-off and the receiver's copies into the "
    "vLLM-layout tensors stay in. An estimate: a receiver's copies of the previous bucket run while the PS "
    "ranks stage the next one, so where those copies were the slower part, removing the H2D saves less."
)
HOW_REGISTER = (
    "not in step time: the trainer-side staging checkpoint-engine needs before update(): "
    "unregister_checkpoint + register_checkpoint(use_shared_memory_pool=True) (the GPU weights copied into "
    "its pinned host buffers) + gather_metas; per step the slowest PS rank. median_seconds_with_register: "
    "the median of step time + that, i.e. from weights on the training GPUs to weights in the inference workers"
)
_NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# -- placement --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Which process does what: PS rank r on GPU r for r < ``gpus``."""

    gpus: int
    owners: dict[str, int]  # canonical name -> the PS rank (= training rank = GPU) that registers it
    receivers: dict[int, tuple[int, int]]  # GPU -> (instance, vLLM rank) of the inference worker there
    sinks: tuple[int, ...]  # GPUs with a PS rank and no inference worker: a receiver that discards

    def owned_bytes(self, spec) -> dict[int, int]:
        out = dict.fromkeys(range(self.gpus), 0)
        for t in spec.tensors:
            out[self.owners[t.name]] += t.nbytes
        return out


def placement(spec, scen) -> Placement:
    """Where everything goes for a :class:`weightsync.bench.scenarios.Scenario`."""
    from weightsync.engines import make_layout

    train, infer = make_layout(spec, scen.train), make_layout(spec, scen.infer)
    load = dict.fromkeys(range(train.world_size), 0)
    owners = {}
    for t in spec.tensors:
        holders = sorted({r for s in train.shards(t.name) for r in train.group_ranks(s.group)})
        if not holders:
            raise ConfigError(f"{scen.train}: no training rank holds {t.name}")
        r = min(holders, key=lambda h: (load[h], h))
        owners[t.name] = r
        load[r] += t.nbytes
    receivers = {}
    for inst in range(scen.instances):
        base = 0 if scen.one_gpu else train.world_size + inst * infer.world_size
        for k in range(infer.world_size):
            if base + k in receivers:
                raise ConfigError(f"two inference workers on GPU {base + k}")
            receivers[base + k] = (inst, k)
    gpus = max([train.world_size - 1, *receivers]) + 1
    if gpus != scen.gpus:
        raise ConfigError(f"placement uses {gpus} GPUs, the scenario says {scen.gpus}")
    sinks = tuple(g for g in range(gpus) if g not in receivers)
    return Placement(gpus, owners, receivers, sinks)


# -- availability -----------------------------------------------------------------------------------


def unavailable(scenario: str) -> str | None:
    """Why this baseline cannot run here (None when it can). Raises only for an unknown scenario."""

    if scenario not in SCENARIOS:
        raise ConfigError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    try:
        for module in ("zmq", "checkpoint_engine.ps", "checkpoint_engine.worker"):
            importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 -- any failure to import means: not installed here
        return f"checkpoint_engine {VERSION} is not importable: {type(e).__name__}: {e}"
    if not torch.cuda.is_available():
        return "CUDA is not available (checkpoint-engine's broadcast mode needs CUDA GPUs, NCCL and CUDA IPC)"
    need, have = SCENARIOS[scenario].gpus, torch.cuda.device_count()
    if have < need:
        return f"{scenario} needs {need} GPUs, {have} visible"
    return None


def _installed_version() -> str:
    import checkpoint_engine

    return getattr(checkpoint_engine, "__version__", "unknown")


# -- child processes --------------------------------------------------------------------------------


def _child_setup() -> list[str]:
    """Environment and logging of a child; returns the list its captured log lines go to."""
    for k, v in _NCCL_SAFE.items():
        os.environ.setdefault(k, v)
    from loguru import logger

    captured: list[str] = []
    logger.remove()
    logger.add(sys.stderr, level=os.environ.get("WEIGHTSYNC_CKPT_LOG", "WARNING").upper())
    logger.add(lambda m: captured.append(str(m).strip()), level="INFO", format="{message}",
               filter=lambda r: "bucket size" in r["message"] or "h2d buffer" in r["message"])
    return captured


def _ps_main(rank: int, world: int, port: int, model: str, scenario: str, steps: int, cmd_q, out,
             timeout: float) -> None:
    """A ParameterServer rank on GPU ``rank``: registers what it owns and runs ``update`` every step."""
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port - 1))  # its fallback port is MASTER_PORT + 1; we also pass it
        captured = _child_setup()
        torch.cuda.set_device(rank)
        import checkpoint_engine.ps as ce_ps
        from checkpoint_engine.device_utils import get_ip

        from weightsync.layout.materialize import TORCH_DTYPES
        from weightsync.spec import load_spec

        try:  # only a label in broadcast mode; it asks the route to 8.8.8.8, which a closed host may lack
            get_ip()
        except OSError:
            ce_ps.get_ip = lambda: "127.0.0.1"

        spec = load_spec(model)
        owners = placement(spec, SCENARIOS[scenario]).owners
        device = torch.device("cuda", rank)
        weights = {}
        for t in spec.tensors:
            if owners[t.name] == rank:
                weights[t.name] = canonical_region(t.name, t.shape, TORCH_DTYPES[t.dtype], tuple((0, n) for n in t.shape),
                                                   device)
        ps = ce_ps.ParameterServer(rank=rank, world_size=world, auto_pg=False, master_addr="127.0.0.1",
                                   master_port=port)
        ps.init_process_group(timeout=timedelta(seconds=timeout))

        h2d: list[float] = []
        copy_to_buffer = ps._copy_to_buffer

        def timed_copy_to_buffer(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return copy_to_buffer(*args, **kwargs)
            finally:
                h2d.append(time.perf_counter() - t0)

        ps._copy_to_buffer = timed_copy_to_buffer
        flag = torch.zeros(1, device=device)

        def barrier() -> None:
            torch.distributed.all_reduce(flag)
            torch.cuda.synchronize(device)

        for step in range(steps + 1):  # step 0 warms up
            with torch.no_grad():
                for w in weights.values():
                    w.mul_(2)  # step s holds the base data doubled s + 1 times
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if weights:
                if step:
                    ps.unregister_checkpoint(CHECKPOINT)  # the shared pool's buffers stay for the next register
                ps.register_checkpoint(CHECKPOINT, named_tensors=weights, use_shared_memory_pool=True)
            ps.gather_metas(CHECKPOINT)
            register = time.perf_counter() - t0
            barrier()
            h2d.clear()
            captured.clear()
            start = time.time()
            ps.update(CHECKPOINT, _Request(cmd_q, step))
            returned = time.time()
            out.put(("ps-step", rank, step, start, returned, register, sum(h2d), len(h2d), list(captured)))
        barrier()
        out.put(("ps-done", rank))
        with contextlib.suppress(Exception):  # clean-up only
            if weights:
                ps.unregister_checkpoint(CHECKPOINT, force=True)
            torch.distributed.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 -- whatever it is, the driver reports it
        out.put(("error", f"ps rank {rank}", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class _Request:
    """checkpoint-engine's ``req_func``: hand the socket paths of this update to the receiver on this GPU."""

    def __init__(self, cmd_q, step: int):
        self.cmd_q, self.step = cmd_q, step

    def __call__(self, socket_paths) -> None:
        self.cmd_q.put((self.step, [(str(u), str(p)) for u, p in socket_paths]))


def _receiver_main(gpu: int, model: str, infer: str, vllm_rank: int | None, steps: int, cmd_q, out,
                   timeout: float) -> None:
    """An inference worker on ``gpu`` (or a sink when ``vllm_rank`` is None) running checkpoint-engine's receiver."""
    try:
        _child_setup()
        torch.cuda.set_device(gpu)
        import zmq
        from checkpoint_engine.device_utils import DeviceManager
        from checkpoint_engine.ps import _get_physical_gpu_id
        from checkpoint_engine.worker import update_weights_from_ipc

        from weightsync.engines import make_layout
        from weightsync.layout.box import slices
        from weightsync.layout.materialize import TORCH_DTYPES, local_view
        from weightsync.spec import load_spec

        spec = load_spec(model)
        device = torch.device("cuda", gpu)
        uuid = _get_physical_gpu_id(DeviceManager(), gpu)  # the key its PS rank binds its socket under
        layout, live, wanted = None, {}, defaultdict(list)
        if vllm_rank is not None:
            layout = make_layout(spec, infer).layout(vllm_rank)
            live = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype], device=device)
                    for n, t in layout.tensors.items()}
            for n, t in layout.tensors.items():
                for p in t.pieces:
                    wanted[p.canonical].append((n, p))
        seen: set[str] = set()

        def load_weights(weights) -> None:  # what vLLM's model.load_weights does for this layout
            for name, full in weights:
                seen.add(name)
                for n, p in wanted.get(name, ()):
                    local_view(live[n], p).copy_(full[slices(p.canon_box)])

        ctx = zmq.Context()
        out.put(("recv-ready", gpu))
        complete = True
        for _ in range(steps + 1):
            try:
                step, paths = cmd_q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no update request within {timeout} s") from None
            handles = dict(paths)
            if uuid not in handles:
                raise RuntimeError(f"GPU {gpu} ({uuid}) not among the PS sockets {sorted(handles)}")
            seen.clear()
            update_weights_from_ipc(ctx, handles[uuid], device_id=gpu, run=load_weights)
            torch.cuda.synchronize(device)
            out.put(("recv-step", gpu, step, time.time()))
            complete = complete and len(seen) == len(spec.tensors)
        verified = None
        if layout is not None:
            from weightsync.testing import holds

            doublings = steps + 1

            def expected(p):
                c = spec.by_name[p.canonical]
                return canonical_region(c.name, c.shape, TORCH_DTYPES[c.dtype], p.canon_box, device) * (2 ** doublings)

            verified = holds(layout, live, expected)
        out.put(("recv-done", gpu, verified, complete))
        ctx.destroy(linger=0)
    except BaseException as e:  # noqa: BLE001 -- whatever it is, the driver reports it
        out.put(("error", f"receiver on GPU {gpu}", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


# -- driver -----------------------------------------------------------------------------------------


def run_checkpoint_engine(model: str, scenario: str, steps: int = 5, timeout: float = 300.0) -> dict:
    """Time checkpoint-engine's broadcast mode on ``scenario``'s GPUs and weights; see the module docstring.

    Returns ``{"ran": True, "median_seconds": ..., ...}``, or ``{"ran": False, "why": ...}`` (with
    ``"error"`` when it started and failed). ``timeout``: the longest wait for any one step or set-up
    phase (a run with no progress for that long is stopped, its processes killed).
    """
    why = unavailable(scenario)
    if why:
        return {"ran": False, "why": why}
    from weightsync.spec import load_spec
    from weightsync.transport.group import free_port

    scen = SCENARIOS[scenario]
    spec = load_spec(model)
    place = placement(spec, scen)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    cmd = {g: ctx.Queue() for g in range(place.gpus)}
    port = free_port()
    receivers = []
    for g in range(place.gpus):
        vrank = place.receivers[g][1] if g in place.receivers else None
        receivers.append(ctx.Process(target=_receiver_main, daemon=True, name=f"receiver-gpu{g}",
                                     args=(g, model, scen.infer, vrank, steps, cmd[g], out, timeout)))
    servers = [ctx.Process(target=_ps_main, daemon=True, name=f"ps-rank{r}",
                           args=(r, place.gpus, port, model, scenario, steps, cmd[r], out, timeout))
               for r in range(place.gpus)]
    starts: dict[int, float] = {}
    returns: dict[int, float] = {}
    ends: dict[int, float] = {}
    register: dict[int, float] = {}
    h2d: dict[int, float] = {}
    h2d_copies: dict[int, int] = {}
    logs: dict[int, list[str]] = {}
    verified: dict[int, bool] = {}
    complete = True
    errors: list[str] = []
    ready = ps_done = recv_done = 0
    deadline = time.monotonic() + timeout * (steps + 4)
    for p in receivers:
        p.start()
    try:
        last = time.monotonic()
        while ps_done < place.gpus or recv_done < place.gpus:
            now = time.monotonic()
            if now > deadline or now - last > timeout:
                errors.append(f"no progress for {now - last:.0f} s (timeout {timeout} s)" if now <= deadline
                              else "past the run's deadline")
                break
            try:
                msg = out.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in receivers + servers if p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"process(es) died: {dead}")
                    break
                continue
            last = time.monotonic()
            kind = msg[0]
            if kind == "recv-ready":
                ready += 1
                if ready == place.gpus:  # PS ranks size their buckets from the memory left after the receivers'
                    for p in servers:
                        p.start()
            elif kind == "ps-step":
                _, rank, step, start, ret, reg, h2d_s, n_h2d, captured = msg
                starts[step] = min(starts.get(step, start), start)
                returns[step] = max(returns.get(step, ret), ret)
                register[step] = max(register.get(step, reg), reg)
                h2d[step] = max(h2d.get(step, h2d_s), h2d_s)
                h2d_copies[step] = h2d_copies.get(step, 0) + n_h2d
                if rank == 0:
                    logs[step] = captured
            elif kind == "recv-step":
                _, gpu, step, t = msg
                if gpu in place.receivers:
                    ends[step] = max(ends.get(step, t), t)
            elif kind == "recv-done":
                recv_done += 1
                _, gpu, ok, whole = msg
                complete = complete and whole
                if ok is not None:
                    verified[gpu] = ok
            elif kind == "ps-done":
                ps_done += 1
            elif kind == "error":
                errors.append(f"{msg[1]}: {msg[2]}")
                break
    finally:  # after a failure at once, else within 30 s in all: nothing outlives the run
        started = [p for p in servers + receivers if p.pid is not None]
        grace = time.monotonic() + (0 if errors else 30)
        for p in started:
            p.join(timeout=max(0.0, grace - time.monotonic()))
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(timeout=5)
    timed = range(1, steps + 1)
    missing = [s for s in timed if s not in starts or s not in ends]
    if errors or missing:
        why = errors[0].splitlines()[0] if errors else f"only {steps - len(missing)} of {steps} timed steps completed"
        return {"ran": False, "why": f"checkpoint-engine run failed: {why}",
                "error": "\n".join(errors) or why}
    times = [ends[s] - starts[s] for s in timed]
    without = [ends[s] - starts[s] - h2d[s] for s in timed]
    bucket_gib, h2d_buffer = _bucket_info(logs.get(steps, []))
    owned = place.owned_bytes(spec)
    version = _installed_version()
    return {
        "ran": True,
        "mode": "broadcast",
        "version": version,
        **({} if version == VERSION else {"version_note": f"written against checkpoint-engine {VERSION}"}),
        "scenario": scenario,
        "model": model,
        "median_seconds": statistics.median(times),
        "min_seconds": min(times),
        "max_seconds": max(times),
        "step_seconds": times,
        "verified": bool(verified) and all(verified.values()) and complete,
        "all_tensors_every_step": complete,
        "median_seconds_without_h2d": statistics.median(without),
        "step_seconds_without_h2d": without,
        "how": HOW_WITHOUT_H2D,
        "h2d_seconds": statistics.median(h2d[s] for s in timed),
        "buckets_per_step": h2d_copies[steps],
        "median_update_return_seconds": statistics.median(returns[s] - starts[s] for s in timed),
        "register_seconds": statistics.median(register[s] for s in timed),
        "median_seconds_with_register": statistics.median(ends[s] - starts[s] + register[s] for s in timed),
        "register_how": HOW_REGISTER,
        "bytes": sum(t.nbytes for t in spec.tensors),
        "bucket_gib": bucket_gib,
        "h2d_buffer": h2d_buffer,
        "placement": {
            "ps_ranks": place.gpus,
            "owner_bytes": {str(r): b for r, b in owned.items() if b},
            "receivers": {str(g): f"instance {i} vLLM rank {k}" for g, (i, k) in sorted(place.receivers.items())},
            "sinks": list(place.sinks),
        },
    }


def _bucket_info(lines: list[str]) -> tuple[float | None, bool | None]:
    """Bucket size (GiB) and whether a separate H2D buffer was used, from checkpoint-engine's rank-0 log."""
    gib, buffer = None, None
    for line in lines:
        m = re.search(r"auto detect bucket size ([0-9.]+) GiB", line)
        if m:
            gib = float(m.group(1))
        if "use h2d buffer" in line:
            buffer = True
        elif "disable h2d buffer" in line:
            buffer = False
    return gib, buffer


def main(argv: list[str] | None = None) -> int:
    import argparse


    p = argparse.ArgumentParser(prog="python3 -m weightsync.bench.ckpt_engine",
                                description="Time checkpoint-engine's broadcast mode (JSON on stdout).")
    p.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    result = run_checkpoint_engine(args.model, args.scenario, args.steps, args.timeout)
    print(json.dumps(result))
    return 0 if result.get("ran") and result.get("verified") else 1


if __name__ == "__main__":
    from weightsync.bench.ckpt_engine import main as _main  # the module's own name, so spawn can find the targets

    sys.exit(_main())
