"""A step's fixed device copies replayed as CUDA graphs: one launch where Python issued hundreds.

Packing a bucket, unpacking it and the co-located same-GPU copies are the same copies between the
same addresses every step (the plan, the live tensors and the transport's buffers do not change), and
they are many: a Qwen3-8B step is ~400 segments a side, each a ``copy_`` costing 10-20 us of Python
and launch time, so the CPU, not the GPU, set the pace (measured: the copies of one co-located step
took ~13 ms of host time for ~8 ms of device work). Captured once and replayed, each group of copies
is one launch and runs back to back on the GPU.

A graph holds raw addresses, so :meth:`CopyGraphs.begin` drops every graph as soon as any tensor it
may touch moved (an engine that reallocated its weights gets fresh graphs, never stale ones).
Captures use ``thread_local`` error mode: NCCL's watchdog thread queries events meanwhile, which a
global-mode capture would count as an error. Only CUDA tensors are captured; on CPU the copies run
as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

import torch

T = TypeVar("T")


class CopyGraphs:
    """Graphs of copy sequences, keyed by the caller, valid while the tensors stay where they are."""

    def __init__(self) -> None:
        self._graphs: dict[tuple[int, Hashable], tuple[object, torch.cuda.CUDAGraph]] = {}
        self._memo: dict[tuple[int, Hashable], tuple[object, object]] = {}
        self._where: tuple[int, ...] | None = None
        self._stream: torch.cuda.Stream | None = None

    def begin(self, *tensor_maps: Mapping[str, torch.Tensor]) -> None:
        """Call at the start of every step with every tensor map the copies read or write."""
        where = tuple(t.data_ptr() for m in tensor_maps for t in m.values())
        if where != self._where:
            self._graphs.clear()
            self._memo.clear()
            self._where = where

    def run(self, owner: object, tag: Hashable, copies: Callable[[], None], device: torch.device) -> None:
        """Run ``copies`` -- the copies of ``owner`` (a bucket, a plan) named ``tag`` -- on the current
        stream: replayed from its graph, captured on first use. The graph keeps ``owner`` alive, so
        its identity cannot pass to another object."""
        if device.type != "cuda":
            copies()
            return
        key = (id(owner), tag)
        got = self._graphs.get(key)
        if got is None or got[0] is not owner:
            got = self._graphs[key] = (owner, self._capture(copies, device))
        got[1].replay()

    def memo(self, owner: object, tag: Hashable, build: Callable[[], T]) -> T:
        """``build()`` -- something derived from the tensors' addresses, such as views into them -- kept
        for ``owner`` under ``tag`` until the tensors move, like the graphs (on CPU too)."""
        key = (id(owner), tag)
        got = self._memo.get(key)
        if got is None or got[0] is not owner:
            got = self._memo[key] = (owner, build())
        return got[1]  # type: ignore[return-value]

    def _capture(self, copies: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                copies()
            finally:
                graph.capture_end()
        current.wait_stream(self._stream)
        return graph

    def __len__(self) -> int:
        return len(self._graphs)
