"""Real transformers models and safetensors checkpoints for tests (tiny presets, random weights)."""

from __future__ import annotations

import glob
from pathlib import Path

import torch

from weightsync.engines.hf import HFLayout
from weightsync.layout.materialize import fill_from
from weightsync.spec import ModelSpec
from weightsync.checkpoint.hf import build_hf_model  # noqa: F401  (re-exported for tests)


def live_tensors(model) -> dict[str, torch.Tensor]:
    """Parameters plus the canonical buffers (DeepSeek's e_score_correction_bias)."""
    out = dict(model.named_parameters())
    out.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    return out


def load_canonical_into(model, spec: ModelSpec, canonical: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        fill_from(HFLayout(spec).layout(0), live_tensors(model), canonical)


def save_checkpoint(spec: ModelSpec, canonical: dict[str, torch.Tensor], directory: Path) -> Path:
    """A real HF checkpoint (``save_pretrained``, safetensors) holding ``canonical``."""
    model = build_hf_model(spec)
    load_canonical_into(model, spec, canonical)
    model.save_pretrained(directory)
    return directory


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(Path(directory) / "*.safetensors"))):
        out.update(load_file(f))
    return out
