"""The bench's scenarios and their data: where training and inference sit, weights any rank can
regenerate, and the check that a worker holds exactly the step it should.

Weights are random tensors in the model's exact shapes: each canonical tensor is generated on the
device from a seed of its name, so a trainer rank and an inference rank can both produce any region
of it; each step doubles every value (exact in bf16), so every step moves new bits.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.local.events import StepStarted


def device_of(kind: str, index: int) -> torch.device:
    """GPU ``index`` of a CUDA run; a CPU run (``--device cpu``: the wiring, no timings worth keeping) has one."""
    return torch.device("cuda", index) if kind == "cuda" else torch.device("cpu")


def synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def memory(dev: torch.device, reset: bool = False) -> tuple[int, int]:
    """(allocated, peak allocated) bytes on ``dev`` (0 on CPU); ``reset`` restarts the peak first."""
    if dev.type != "cuda":
        return 0, 0
    if reset:
        torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev)


def timed_write(writer: Any, step: int, dev: torch.device, together: Any, timeout: float, emit: Any) -> int:
    """One measured ``writer.write(step)`` on a training rank: the device settled and every training rank at the
    barrier ``together`` first, then the step's start announced (``StepStarted``), so the step's time is the write's
    alone. Returns the write's peak transient device memory (bytes above what was allocated before it)."""
    synchronize(dev)
    base, _ = memory(dev, reset=True)
    together.wait(timeout)
    emit(StepStarted(emit.participant, step, time.time()))
    writer.write(step)
    return memory(dev)[1] - base


@dataclass(frozen=True)
class Scenario:
    train: str
    infer: str
    instances: int
    colocate: bool
    gpus: int
    transport: str = "p2p"  # separated scenarios: "p2p" (NCCL) or "nixl" (one-sided READs over UCX)

    @property
    def one_gpu(self) -> bool:
        """Whether trainers and inference workers share the GPUs: co-located, or every process on one
        GPU as separate processes (nixl-1gpu)."""
        return self.colocate or self.gpus == 1


SCENARIOS = {
    "colo-1gpu": Scenario("hf", "vllm:tp=1", 1, True, 1),
    "sep-1to1": Scenario("hf", "vllm:tp=1", 1, False, 2),
    "colo-pp2-tp2": Scenario("megatron:pp=2", "vllm:tp=2", 1, True, 2),
    "sep-tp2-tp2": Scenario("megatron:tp=2", "vllm:tp=2", 1, False, 4),
    "sep-fsdp2-2x1": Scenario("fsdp:dp=2", "vllm:tp=1", 2, False, 4),
    "colo-tp2pp2-tp4": Scenario("megatron:tp=2,pp=2", "vllm:tp=4", 1, True, 4),
    # a trainer process and an inference process on ONE GPU, the inference worker READing through NIXL
    # (UCX's CUDA transports); ceiling: a device copy of the same bytes (beside it: colo-1gpu, CUDA IPC)
    "nixl-1gpu": Scenario("hf", "vllm:tp=1", 1, False, 1, transport="nixl"),
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


def moved_per_gpu(train, infer, scen: Scenario) -> dict[int, tuple[int, int]]:
    """(same-GPU bytes, bytes from other GPUs) each GPU must receive (the busiest one bounds the step)."""
    from weightsync.plan.planner import Planner
    from weightsync.plan.topology import Topology

    # one GPU holds both sides even when they are separate processes (nixl-1gpu)
    make = Topology.colocated if scen.one_gpu else Topology.separated
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


__all__ = ["device_of", "synchronize", "memory", "Scenario", "SCENARIOS", "canonical_region", "init_weights", "advance",
           "check", "moved_per_gpu"]
