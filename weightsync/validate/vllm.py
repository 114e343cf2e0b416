"""Validation inside a real vLLM worker (``via="vllm-loader"``), run through ``VLLMInstance.call``.

The reference is what this worker's engine holds after loading the checkpoint through **vLLM's own
loader**, exactly as at engine start: a second model object of the same ``vllm_config`` is built,
``DefaultModelLoader.load_weights`` reads the checkpoint's safetensors files (vLLM's name mapping,
qkv / gate_up fusing, TP sharding, vocab padding) and ``process_weights_after_loading`` runs every
post-load transform (CPU oneDNN / sgl packing of linears and lm_head, the CPU MoE experts' padding
and prepack). Then, for both models, what the forward pass computes with is compared:

- every non-empty parameter and buffer, by vLLM's name (norms, embeddings, the prepacked MoE experts
  -- those in their packed layout, so an index there is into the packed tensor);
- for every layer whose GEMM reads a packed copy (``layer.cpu_linear``: CPU linears, whose
  ``weight`` is then empty, and CPU embeddings / lm_heads, whose logits come from the copy), the
  weight as that GEMM sees it, recovered exactly by applying the layer to an identity matrix (one
  non-zero product per output, so no rounding), named ``<layer>.weight (packed)`` with the loaded
  weight's shape ``[out, in]``.

Why a second model and not vLLM's in-place ``reload_weights``: in vLLM 0.32 on CPU that reload
leaves a tied lm_head's packed copy and the MoE experts' prepack stale and fails at TP=2 on padded
experts, leaving layers on the meta device (docs/vllm.md, section 7) -- it would report the engine
wrong where it is right, or kill it. Building a fresh model leaves the live engine untouched, so
nothing needs restoring, and it is what a fresh engine on the checkpoint computes with.

Memory, per worker: one more copy of the model's weights on the worker's device while it runs (freed
before returning), plus one layer's recovered weights at a time. The live model's attention layers,
KV cache and CUDA graphs are not touched; the fresh model is never run.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from typing import Any, Iterator

import torch

from weightsync.validate.report import TensorCheck, compare

#: rows of the identity matrix applied at once when recovering a packed weight
PROBE_ROWS = 1024


@contextlib.contextmanager
def _own_registries(vllm_config: Any) -> Iterator[None]:
    """Let a second model be built: attention and MoE layers register themselves by name in the
    compilation config (a duplicate name raises); the fresh model's go into throw-away ones."""
    cc = vllm_config.compilation_config
    ctx, moe = cc.static_forward_context, cc.static_all_moe_layers
    cc.static_forward_context, cc.static_all_moe_layers = {}, []
    try:
        yield
    finally:
        cc.static_forward_context, cc.static_all_moe_layers = ctx, moe


def load_fresh(vllm_config: Any, checkpoint: str) -> torch.nn.Module:
    """This worker's model as vLLM builds it from ``checkpoint`` (same config, same device, same rank)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    from weightsync.validate.checkpoint import checkpoint_files

    checkpoint_files(checkpoint)  # a clear error first for a directory without safetensors files
    model_config = copy.copy(vllm_config.model_config)
    model_config.model = str(checkpoint)
    if hasattr(model_config, "model_weights"):
        model_config.model_weights = ""
    model_config.revision = None
    load_config = copy.copy(vllm_config.load_config)
    load_config.load_format = "safetensors"
    with _own_registries(vllm_config), set_current_vllm_config(vllm_config):
        return get_model_loader(load_config).load_model(vllm_config=vllm_config, model_config=model_config)


def _packed_weight(mod: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The ``[out, in]`` weight a layer's packed GEMM computes with: ``apply(I)`` is ``W^T`` exactly."""
    k = (getattr(mod, "input_size_per_partition", None) or getattr(mod, "embedding_dim", None)
         or getattr(mod, "input_size", None))
    if not k:
        return None
    qm = mod.quant_method
    cols = []
    for start in range(0, int(k), PROBE_ROWS):
        n = min(PROBE_ROWS, int(k) - start)
        eye = torch.zeros(n, int(k), dtype=dtype, device=device)
        eye[torch.arange(n), torch.arange(start, start + n)] = 1
        cols.append(qm.apply(mod, eye))
    return torch.cat(cols).t().contiguous()


def _packed_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules()
            if callable(getattr(m, "cpu_linear", None)) and hasattr(getattr(m, "quant_method", None), "apply")}


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p for n, p in model.named_parameters() if p.numel()}
    for n, b in model.named_buffers():
        if b is not None and b.numel():
            out.setdefault(n, b)
    return out


def check_vllm(ctx: Any, checkpoint: str) -> list[TensorCheck]:
    """On a vLLM worker (``VLLMInstance.call(check_vllm, dir)``): what it computes with against a fresh
    load of ``checkpoint`` (module docstring)."""
    model, vc = ctx.state["model"], ctx.state["vllm_config"]
    fresh = load_fresh(vc, checkpoint)
    try:
        with torch.no_grad():
            mine, theirs = _tensors(model), _tensors(fresh)
            out = [compare(n, ctx.rank, mine.get(n), theirs.get(n)) for n in dict.fromkeys([*mine, *theirs])]
            lm, lf = _packed_layers(model), _packed_layers(fresh)
            dtype = vc.model_config.dtype
            for name in dict.fromkeys([*lm, *lf]):
                a = _packed_weight(lm[name], dtype, ctx.device) if name in lm else None
                b = _packed_weight(lf[name], dtype, ctx.device) if name in lf else None
                if a is None and b is None:
                    continue
                out.append(compare(f"{name}.weight (packed)", ctx.rank, a, b))
                del a, b
        return out
    finally:
        del fresh
        gc.collect()


__all__ = ["check_vllm", "load_fresh", "PROBE_ROWS"]
