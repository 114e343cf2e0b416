"""Validation of a live transformers model (``via="from_pretrained"``): the engine's own loader is
``from_pretrained``, so the reference is the same class loaded from the checkpoint, in the live
model's dtype (transformers keeps its own fp32 modules), on the live model's device; every parameter
and buffer is compared by name. Memory: a second copy of the model, freed before returning.
"""

from __future__ import annotations

import gc

import torch

from weightsync.validate.report import TensorCheck, compare


def _dtype_of(module: torch.nn.Module) -> torch.dtype:
    """The model's dtype as ``from_pretrained(dtype=...)`` takes it (its config's, else its first float parameter's)."""
    d = getattr(getattr(module, "config", None), "dtype", None)
    if isinstance(d, torch.dtype):
        return d
    for p in module.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.float32


def tensors_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (tied ones once) and every buffer, by name: what a forward pass reads."""
    out = dict(module.named_parameters())
    for n, b in module.named_buffers():
        if b is not None:
            out.setdefault(n, b)
    return out


def check_hf(module: torch.nn.Module, checkpoint: str) -> list[TensorCheck]:
    """``module`` against ``type(module).from_pretrained(checkpoint)``."""
    from weightsync.validate.checkpoint import checkpoint_files

    checkpoint_files(checkpoint)  # a clear error for a directory that is no checkpoint, before transformers'
    device = next(iter(module.parameters())).device
    fresh = type(module).from_pretrained(checkpoint, dtype=_dtype_of(module)).to(device)
    try:
        mine, theirs = tensors_of(module), tensors_of(fresh)
        return [compare(n, 0, mine.get(n), theirs.get(n)) for n in dict.fromkeys([*mine, *theirs])]
    finally:
        del fresh
        gc.collect()


__all__ = ["check_hf", "tensors_of"]
