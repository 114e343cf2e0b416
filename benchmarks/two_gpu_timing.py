"""Helpers the two-GPU microbenchmarks share (``peer_push.py``, ``colo_overlap.py``): one process per GPU,
each timing the same operation at the same moment."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def timed_together(fn: Callable[[], None], group, dev: torch.device, rounds: int = 6) -> float:
    """Median seconds of ``fn`` by CUDA events over ``rounds - 1`` rounds after a warm-up, every round
    started by both processes together (an all-reduce over ``group`` on idle GPUs)."""
    times = []
    for i in range(rounds):
        torch.cuda.synchronize()
        group.allreduce([torch.zeros(1, device=dev)]).wait()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        if i:
            times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def beside(side: torch.cuda.Stream, background: Callable[[], None], foreground: Callable[[], None]) -> None:
    """``background`` on the ``side`` stream while ``foreground`` runs on the current one; the current
    stream then waits for both."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        background()
    foreground()
    torch.cuda.current_stream().wait_stream(side)
