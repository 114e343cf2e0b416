"""Moving data between canonical tensors and a rank's local tensors, following its pieces.

Used by tests, the ``file`` transport and reference checks: the slow, obviously-correct path that
the planned transports must agree with.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch

from weightsync.dtypes import torch_dtypes
from weightsync.layout.box import slices
from weightsync.layout.layout import Layout, Piece

TORCH_DTYPES = torch_dtypes()  # the one table, weightsync/dtypes.py
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def local_view(local: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The region of a local tensor a piece covers, shaped like its canonical box."""
    return local[slices(piece.local_box)].view(tuple(n for _, n in piece.canon_box))


def canonical_view(canonical: torch.Tensor, piece: Piece) -> torch.Tensor:
    return canonical[slices(piece.canon_box)]


def scatter(
    layout: Layout,
    canonical: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor],
    fill: float = float("nan"),
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Build a rank's local tensors from canonical tensors; regions without a piece keep ``fill``."""
    get = canonical.__getitem__ if isinstance(canonical, Mapping) else canonical
    out = {}
    for name, t in layout.tensors.items():
        local = torch.full(t.shape, fill, dtype=TORCH_DTYPES[t.dtype], device=device)
        for p in t.pieces:
            local_view(local, p).copy_(canonical_view(get(p.canonical), p))
        out[name] = local
    return out


def fill_from(layout: Layout, local: Mapping[str, torch.Tensor], canonical: Mapping[str, torch.Tensor]) -> None:
    """Write canonical values into existing local tensors in place (the reference 'load')."""
    for name, t in layout.tensors.items():
        for p in t.pieces:
            local_view(local[name], p).copy_(canonical_view(canonical[p.canonical], p))


def zero_uncovered(layout: Layout, local: Mapping[str, torch.Tensor]) -> int:
    """Zero every element of ``local``'s tensors of ``layout`` that no piece covers (vocab padding rows, which
    an engine's checkpoint load leaves zero and dummy weights random); returns how many tensors had any.
    Tensors the layout does not list are left alone."""
    n = 0
    with torch.no_grad():
        for name, t in local.items():
            if name not in layout.tensors:
                continue
            pieces = layout.tensors[name].pieces
            if sum(math.prod(k for _, k in p.local_box) for p in pieces) == t.numel():
                continue  # pieces never overlap: every element is written
            covered = torch.zeros(t.shape, dtype=torch.bool, device=t.device)
            for p in pieces:
                covered[slices(p.local_box)] = True
            if not bool(covered.all()):
                t.masked_fill_(~covered, 0)
                n += 1
    return n
