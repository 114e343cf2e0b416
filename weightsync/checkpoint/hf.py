"""The transformers model of a spec, and canonical tensors to and from it: what the demo's trainers,
``weightsync validate``'s checkpoints and a fresh vLLM engine's checkpoint are built with.

Production code may use these (they need ``transformers``, imported when called); the tests' own
helpers stay in :mod:`weightsync.testing`, which production code never imports.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from weightsync.layout.materialize import TORCH_DTYPES, fill_from, local_view
from weightsync.spec.model import ModelSpec


def build_hf_model(spec: ModelSpec, seed: int | None = None) -> torch.nn.Module:
    """The real transformers module for a spec, in its dtype, on CPU (random init), in the form
    ``from_pretrained`` gives it, as a trainer loading a checkpoint has it: what the installed
    transformers keeps in fp32 beside a bf16 model (``_keep_in_fp32_modules_strict``, the hf
    layout's auto ``fp32_*`` keys) is made fp32. ``from_config`` applies no such list (under
    transformers 5.19-5.23 it leaves DeepSeek-V3's ``e_score_correction_bias`` bf16)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightsync.bind import module_tensors
    from weightsync.engines.hf import HFLayout

    cfg = dict(spec.config)
    model_type = cfg.pop("model_type")
    cfg.pop("architectures", None)
    config = AutoConfig.for_model(model_type, **cfg)
    config.architectures = [spec.architecture]
    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=TORCH_DTYPES[spec.dtype])
    local = HFLayout(spec).layout(0).tensors
    for name, t in module_tensors(model).items():
        if name in local and (want := TORCH_DTYPES[local[name].dtype]) != t.dtype:
            t.data = t.data.to(want)
    return model


def hf_canonical(model: torch.nn.Module, spec: ModelSpec | None = None) -> dict[str, torch.Tensor]:
    """A transformers model's weights as canonical (checkpoint) tensors, copied, through the ``hf``
    layout's pieces (which unstack transformers 5's fused experts)."""
    from weightsync.bind import hf_module_spec, module_tensors
    from weightsync.engines.hf import HFLayout

    spec = spec or hf_module_spec(model)
    live = module_tensors(model)
    with torch.no_grad():
        return {p.canonical: local_view(live[p.tensor], p).detach().clone() for p in HFLayout(spec).layout(0).pieces()}


def save_hf_checkpoint(spec: ModelSpec, canonical: Mapping[str, torch.Tensor], directory: str | os.PathLike) -> str:
    """Write canonical tensors as an HF checkpoint (config.json, safetensors): a transformers model of
    ``spec`` (the form ``from_pretrained`` gives it) filled through the ``hf`` layout, then
    ``save_pretrained``. Returns the directory."""
    from weightsync.bind import module_tensors
    from weightsync.engines.hf import HFLayout

    model = build_hf_model(spec)
    with torch.no_grad():
        fill_from(HFLayout(spec).layout(0), module_tensors(model), canonical)
    model.save_pretrained(str(directory))
    return str(directory)


__all__ = ["build_hf_model", "hf_canonical", "save_hf_checkpoint"]
