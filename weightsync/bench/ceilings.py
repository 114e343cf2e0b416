"""The ceilings a bench scenario is measured against, taken on the scenario's own GPUs and groups:
device-to-device copy bandwidth, GPUs copying into each other both ways at once (co-located), and
raw NCCL send/recv of the plan's own message sizes over the job's own communicator (separated).
Functions taking ``ctx`` run on an inference worker (``instance.call``)."""

from __future__ import annotations

import statistics
import time

import torch

from weightsync.bench.scenarios import memory


def copy_ceiling(ctx, nbytes: int) -> float:
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


def peer_bandwidth(instance, nbytes: int, message: int) -> float:
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


def reset_peak(ctx) -> int:
    """On a worker: restart its GPU's peak-memory count; the bytes allocated now (0 on CPU)."""
    return memory(ctx.device, reset=True)[0]


def peak_memory(ctx) -> int:
    """On a worker: peak bytes allocated on its GPU since :func:`reset_peak` (0 on CPU)."""
    return memory(ctx.device)[1]


def link_recv(ctx, sizes: list[int], peer: int) -> None:
    """Worker 0 receives the link-ceiling messages (3 rounds) the trainer sends; other workers idle."""
    if ctx.rank != 0:
        return
    g = ctx.reader.receiver.transport.group  # the job's P2PTransport
    buf = torch.empty(max(sizes), dtype=torch.uint8, device=ctx.device)
    for _ in range(3):
        for s in sizes:
            g.recv([buf[:s]], peer, 7).wait()
    torch.cuda.synchronize(ctx.device)


# -- processes --------------------------------------------------------------------------------------


__all__ = ["copy_ceiling", "peer_bandwidth", "link_recv", "reset_peak", "peak_memory"]
