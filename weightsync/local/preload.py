"""What a local job's fork server imports besides torch, so each participant forks with it in memory.

A training or inference process of a local job imports transformers' modelling code (~2.8 s of CPU) or
megatron-core (~1.5 s) before it can build its engine; imported once here, in the fork server
(:data:`weightsync.local.runner.PRELOAD`), every participant forked from it skips that. Only where it is
safe to fork after them: on a CPU-only torch build, where nothing they run at import can initialise
CUDA. On a CUDA build this imports nothing more (a participant then imports what it needs itself, as
before). Quietly: the server shares the driver's terminal, and megatron warns at import (no Apex, ...).
Either package missing is fine: its participants import nothing of it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import warnings

import torch

#: imported in this order; a missing one is skipped
MODULES = [
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer.module",
]


def safe_to_preload() -> bool:
    """True on a CPU-only torch build: no import can touch CUDA there, so forking after it is safe."""
    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def preload() -> list[str]:
    """Import :data:`MODULES` quietly where :func:`safe_to_preload`; the names imported."""
    if not safe_to_preload():
        return []
    done = []
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        for name in MODULES:
            try:
                importlib.import_module(name)
            except ImportError:
                continue
            done.append(name)
    return done


IMPORTED = preload()

__all__ = ["MODULES", "IMPORTED", "preload", "safe_to_preload"]
