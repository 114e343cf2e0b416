"""Random canonical weights and layout-wide checks, shared by the tests, the demo and the benchmarks.

Test aids only: production code never imports this module (the transformers model of a spec and HF
checkpoints of canonical tensors, which production code uses, are in :mod:`weightsync.checkpoint.hf`).
"""

from __future__ import annotations

from typing import Callable

import torch

from weightsync.layout.box import slices
from weightsync.layout.layout import EngineLayout, Layout, Piece
from weightsync.layout.materialize import TORCH_DTYPES, local_view
from weightsync.spec.model import ModelSpec


def random_canonical(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every canonical tensor filled with random normal values in its dtype (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    return {
        t.name: torch.randn(t.shape, generator=g, dtype=torch.float32).to(TORCH_DTYPES[t.dtype]) for t in spec.tensors
    }


def coverage_problems(engine: EngineLayout) -> list[str]:
    """Check every rank's layout of a (small) engine config; return a list of problems (empty = fine).

    - every piece lies inside its local tensor and matches its canonical box's shape;
    - no element of a local tensor is covered twice;
    - every element of a canonical tensor is covered the same number of times (>= 1) over all ranks
      (once per replica), and ``shards()`` agrees with the per-rank layouts.
    """
    spec = engine.spec
    problems: list[str] = []
    counts = {t.name: torch.zeros(t.shape, dtype=torch.int32) for t in spec.tensors}
    for rank in range(engine.world_size):
        layout = engine.layout(rank)
        for name, t in layout.tensors.items():
            seen = torch.zeros(t.shape, dtype=torch.int32)
            for p in t.pieces:
                lead = len(p.local_box) - len(p.canon_box)
                if tuple(n for _, n in p.local_box[lead:]) != tuple(n for _, n in p.canon_box) or any(
                    n != 1 for _, n in p.local_box[:lead]
                ):
                    problems.append(f"rank {rank} {name}: piece boxes differ in shape {p}")
                    continue
                if any(o < 0 or o + n > s for (o, n), s in zip(p.local_box, t.shape)):
                    problems.append(f"rank {rank} {name}: piece outside tensor {t.shape}: {p}")
                    continue
                local_view(seen, p).add_(1)
                counts[p.canonical][slices(p.canon_box)] += 1
            if seen.numel() and int(seen.max()) > 1:
                problems.append(f"rank {rank} {name}: some elements covered twice")
    for name, c in counts.items():
        lo, hi = int(c.min()), int(c.max())
        if lo < 1 or lo != hi:
            problems.append(f"{name}: covered between {lo} and {hi} times")
        total = sum(s.piece.numel * len(engine.group_ranks(s.group)) for s in engine.shards(name))
        if total != int(c.sum()):
            problems.append(f"{name}: shards() cover {total} elements, layouts {int(c.sum())}")
    return problems


def holds(layout: Layout, tensors: dict[str, torch.Tensor], expected: Callable[[Piece], torch.Tensor]) -> bool:
    """Whether every piece of a rank's live tensors equals ``expected(piece)`` (its canonical region),
    bit for bit, after the cast to the local tensor's dtype that a checkpoint load would do."""
    return not differences(layout, tensors, expected, first_only=True)


def differences(layout: Layout, tensors: dict[str, torch.Tensor], expected: Callable[[Piece], torch.Tensor],
                first_only: bool = False) -> list[str]:
    """The pieces (``tensor <- canonical box``) whose live values differ from ``expected`` (see :func:`holds`)."""
    out = []
    for name, t in layout.tensors.items():
        live = tensors[name]
        for p in t.pieces:
            want = expected(p).to(device=live.device, dtype=TORCH_DTYPES[t.dtype])
            if not torch.equal(local_view(live, p), want):
                out.append(f"{name} <- {p.canonical}{list(p.canon_box)}")
                if first_only:
                    return out
    return out
