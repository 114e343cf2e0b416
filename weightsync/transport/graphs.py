"""A step's fixed copies, batched into one kernel and replayed as CUDA graphs.

Packing a bucket, unpacking it and the co-located same-GPU copies are the same copies between the
same addresses every step (the plan, the live tensors and the transport's buffers do not change), and
they are many: a Qwen3-8B step is ~400 segments a side, a Qwen3-30B-A3B step ~18,000 (each expert's
half of a fused weight is a run of its own). As one ``copy_`` each they cost 10-20 us of Python and
~3 us of launch apiece, so the CPU and the launches, not the bytes, set the pace (measured: the copies
of one co-located 8B step took ~13 ms of host time for ~8 ms of device work). So each group of copies
is turned once into a :class:`~weightsync.transport.batch_copy.BatchedCopy` -- a table of tiles
copied by one kernel launch -- and, on CUDA, that launch is captured once and replayed as a graph.
On CPU the same tables run through its reference executor, so CPU tests cover them.

Tables and graphs hold raw addresses, so :meth:`CopyGraphs.begin` drops them all as soon as any
tensor they may touch -- the live weights and the transport's buffers -- moved (an engine that
reallocated its weights gets fresh ones, never stale ones); memos, views into the weights, go when the
weights move. Captures use
``thread_local`` error mode: NCCL's watchdog thread queries events meanwhile, which a global-mode
capture would count as an error.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

import torch

from weightsync.transport.batch_copy import BatchedCopy
from weightsync.payload.pack import Landing, Pairs

T = TypeVar("T")


class CopyGraphs:
    """Batched copies and their graphs, keyed by the caller, valid while the tensors stay where they are."""

    def __init__(self) -> None:
        self._graphs: dict[tuple[int, Hashable], tuple[object, tuple[BatchedCopy, Callable[[], None] | None],
                                                        torch.cuda.CUDAGraph | None]] = {}
        self._memo: dict[tuple[int, Hashable], tuple[object, object]] = {}
        self._where: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._opened: tuple[Mapping[str, torch.Tensor], ...] = ()
        self._scratch: tuple[int, ...] = ()
        self._stream: torch.cuda.Stream | None = None

    def begin(self, *tensor_maps: Mapping[str, torch.Tensor], buffers: Sequence[torch.Tensor] = (),
              opened: Sequence[Mapping[str, torch.Tensor]] = ()) -> None:
        """Call at the start of every step with every tensor map the copies read or write, and again
        whenever the transport's ``buffers`` were reallocated: the graphs go when anything moved, the
        memos (views into the tensors, never into the buffers) only when the tensors did -- else the
        step after the first would rebuild every bucket's views (measured: +90 ms on a 30B step).

        ``opened``: maps of another process's tensors that this one mapped (CUDA IPC, shared memory).
        Their addresses are this process's mappings, fixed while the map lives, so they are compared by
        identity: the addresses of every tensor, looked up each step before the first copy is posted,
        cost ~1 ms for a 30B trainer's 6,300 tensors. The live maps' addresses are looked up."""
        where = (tuple(map(torch.Tensor.data_ptr, (t for m in tensor_maps for t in m.values()))),
                 tuple(map(id, opened)))
        scratch = tuple(map(torch.Tensor.data_ptr, buffers))
        if where != self._where:
            self._memo.clear()
        if (where, scratch) != (self._where, self._scratch):
            self._graphs.clear()
        self._where, self._scratch = where, scratch
        self._opened = tuple(opened)  # held, so their ids are not reused while compared

    def run(self, owner: object, tag: Hashable, pairs: Callable[[], Pairs | Landing], device: torch.device,
            programs: int | None = None) -> None:
        """Do the copies ``pairs()`` lists -- the copies of ``owner`` (a bucket, a plan) named ``tag`` --
        on the current stream: batched into one kernel (on at most ``programs`` CTAs when given) and,
        on CUDA, replayed from its graph, both built on first use. The entry keeps ``owner`` alive, so
        its identity cannot pass to another object. ``pairs()`` gives byte copies (a pair of two dtypes is refused:
        a cast is a codec's) or a codec's :class:`~weightsync.payload.pack.Landing` (its casts, quantization):
        its copies batched so, its work after them in the same graph (run once before the capture, so that its
        kernels are compiled and loaded outside it)."""
        key = (id(owner), tag)
        got = self._graphs.get(key)
        if got is None or got[0] is not owner:
            built = pairs()
            landing = built if isinstance(built, Landing) else Landing(built)
            batch = BatchedCopy(landing.copies, programs=programs)  # built outside the capture: it uploads its table
            if device.type == "cuda" and landing.work is not None:
                landing.work()  # compiles what it launches (no compilation mid-capture)
            graph = self._capture(lambda: _run(batch, landing.work), device) if device.type == "cuda" else None
            got = self._graphs[key] = (owner, (batch, landing.work), graph)
        if got[2] is not None:
            got[2].replay()
        else:
            _run(*got[1])

    def memo(self, owner: object, tag: Hashable, build: Callable[[], T]) -> T:
        """``build()`` -- something derived from the tensors' addresses, such as views into them -- kept
        for ``owner`` under ``tag`` until the tensors move, like the graphs (on CPU too)."""
        key = (id(owner), tag)
        got = self._memo.get(key)
        if got is None or got[0] is not owner:
            got = self._memo[key] = (owner, build())
        return got[1]  # type: ignore[return-value]

    def _capture(self, copies: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
        """``copies`` captured on a side stream ordered after the current one."""
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


def _run(batch: BatchedCopy, work: Callable[[], None] | None) -> None:
    """The copies, then the codec's work (``batch.run`` looked up at each call, as before: tests hook it)."""
    batch.run()
    if work is not None:
        work()
