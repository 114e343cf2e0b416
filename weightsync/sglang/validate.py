"""Validation inside a real SGLang worker through **SGLang's own loader** (``via="sglang-loader"``), run through
``SGLangInstance.call`` (opt-in: ``SGLangInstance(validate_via="sglang-loader")``; the default stays the layout,
``via="layout"``, until this has run on the GPU host).

The reference is what this worker's engine holds after loading the checkpoint as at engine start: a second model
of the same ``ModelConfig`` (``model_path`` pointed at the checkpoint) built by ``get_model_loader(LoadConfig(
load_format="auto"), model_config).load_model(model_config, DeviceConfig(device, gpu_id))`` -- what 0.5.14's
``model_executor/model_runner.py:ModelRunner.load_model`` runs (``model_loader/loader.py:DefaultModelLoader.
load_model``: SGLang's name mapping, qkv / gate_up fusing, TP sharding, vocab padding, then
``process_weights_after_loading`` of every quant method). ``LoadConfig`` is a new one: an engine started on dummy
weights (``load_format="dummy"``) would otherwise build a dummy model. Then every parameter and every floating
buffer of both models is compared by SGLang's name (:func:`weightsync.validate.report.compare`).

The live model, its KV cache and CUDA graphs are not touched; the fresh model is never run and is dropped before
returning. Memory, per worker: one more copy of the model's weights while it runs. The model runner is the ``self``
of ``ModelRunner.update_weights_from_tensor`` on the loader's call stack (``rpc_loader`` runs inside it).
"""

from __future__ import annotations

import copy
import gc
import sys
from typing import Any

import torch

from weightsync.validate.report import TensorCheck, compare

VIA_SGLANG = "sglang-loader"


def model_runner() -> Any:
    """The SGLang ``ModelRunner`` whose ``update_weights_from_tensor`` runs the call we are in."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "update_weights_from_tensor":
            owner = frame.f_locals.get("self")
            if all(hasattr(owner, a) for a in ("model_config", "load_config", "gpu_id", "device", "model")):
                return owner
        frame = frame.f_back
    raise RuntimeError("validate via SGLang's loader: no SGLang ModelRunner on the call stack (is this call running "
                       "inside SGLang's update_weights_from_tensor?)")


def load_fresh(runner: Any, checkpoint: str) -> torch.nn.Module:
    """This worker's model as SGLang builds it from ``checkpoint`` (same model config, device, rank)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader import get_model_loader

    from weightsync.validate.checkpoint import checkpoint_files

    checkpoint_files(checkpoint)  # a clear error first for a directory without safetensors files
    model_config = copy.copy(runner.model_config)
    model_config.model_path = str(checkpoint)
    if hasattr(model_config, "revision"):
        model_config.revision = None
    loader = get_model_loader(LoadConfig(load_format="auto"), model_config)
    return loader.load_model(model_config=model_config, device_config=DeviceConfig(runner.device, runner.gpu_id))


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {f"param:{n}": p for n, p in model.named_parameters()}
    for n, b in model.named_buffers():
        if b is not None and b.is_floating_point():
            out.setdefault(f"buffer:{n}", b)
    return out


def check_sglang(ctx: Any, checkpoint: str) -> list[TensorCheck]:
    """On an SGLang worker (``SGLangInstance.call(check_sglang, dir)``): what it computes with against a fresh
    load of ``checkpoint`` through SGLang's loader (module docstring)."""
    runner = model_runner()
    fresh = load_fresh(runner, checkpoint)
    try:
        with torch.no_grad():
            mine, theirs = _tensors(ctx.state["model"]), _tensors(fresh)
            return [compare(n, ctx.rank, mine.get(n), theirs.get(n)) for n in dict.fromkeys([*mine, *theirs])]
    finally:
        del fresh
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


__all__ = ["VIA_SGLANG", "check_sglang", "load_fresh", "model_runner"]
