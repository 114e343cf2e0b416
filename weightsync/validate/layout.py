"""Validation through weightsync's own layout (``via="layout"``): for workers that are not a real engine
with a loader of its own here (the layout-faithful workers, the SGLang stand-in), or whose tensors are
exactly the layout's (a real SGLang worker's parameters).

Each worker reads, for every piece of its layout, that box of the checkpoint tensor (only those bytes:
:class:`~weightsync.validate.checkpoint.Checkpoint`), cast to the local dtype as a checkpoint load
casts it, and compares its live tensor with the live tensor overwritten by those regions. So only
regions a piece covers can differ (padding, which no loader writes, is left out) and indices are in the
local tensor's coordinates. This proves the bytes landed where the layout says; it cannot prove the
layout right, which is what the engine's own loader is for (``from_pretrained``, vLLM's).

Memory: one local tensor's copy at a time, plus the regions read.
"""

from __future__ import annotations

import torch

from weightsync.validate.report import TensorCheck, compare


def check_layout(ctx, checkpoint: str, engine: str, model_config: dict) -> list[TensorCheck]:
    """On a worker (``instance.call``): every local tensor of its layout against ``checkpoint``."""
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES, local_view
    from weightsync.spec.model import spec_from_config
    from weightsync.validate.checkpoint import Checkpoint

    layout = make_layout(spec_from_config(model_config), engine).layout(ctx.rank)
    ckpt = Checkpoint(checkpoint)
    out = []
    with torch.no_grad():
        for name, t in layout.tensors.items():
            live = ctx.tensors.get(name)
            if live is None:
                out.append(TensorCheck(name, ctx.rank, t.shape, t.dtype, 0, 0, 0.0, None,
                                       "in the layout, missing in the engine"))
                continue
            if not t.pieces:
                continue
            want = live.detach().clone()
            for p in t.pieces:
                local_view(want, p).copy_(ckpt.read(p.canonical, p.canon_box).to(TORCH_DTYPES[t.dtype]))
            out.append(compare(name, ctx.rank, live, want))
            del want
    return out


__all__ = ["check_layout"]
