"""Check an SGLang worker against weights loaded from files (run with ``SGLangInstance.call``).

- :func:`computed`: every tensor the worker computes with: every parameter and floating buffer of the live
  model (on the GPU, SGLang's unquantized linear, embedding and Triton fused-MoE methods read their
  parameters as loaded: ``layers/quantization/unquant.py`` in 0.5.14 transforms them only for CPU AMX,
  AITER on ROCm and flashinfer's TRT-LLM MoE, which ``SGLangInstance`` refuses). Two engines whose
  :func:`computed` agree compute the same thing; compare a synced engine with a FRESH engine loaded from the
  checkpoint (never with transformers: bf16 kernels differ on near-ties).
- :func:`loaded_problems`: the tensors weightsync writes, against canonical (checkpoint) tensors scattered
  by the worker's layout (under ``quant=fp8`` their block-FP8 checkpoint form, scales included).
- :func:`digests`: a content hash per tensor, to compare across processes as JSON.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import torch


def _model(ctx: Any) -> torch.nn.Module:
    return ctx.state["model"]


def computed(ctx: Any) -> dict[str, torch.Tensor]:
    """``param:NAME`` for every parameter (an FP8 one included: e4m3 weights, their fp32 ``weight_scale_inv``, the
    KV-cache scales), ``buffer:NAME`` for every floating buffer, and ``derived:LAYER.ATTR`` for every tensor an MLA
    attention derives after loading and computes with (``w_kc``, ``w_vc``, and ``w_scale*`` where they are tensors:
    plain attributes, neither parameters nor buffers; :data:`weightsync.sglang.live.MLA_DERIVED`), on CPU."""
    from weightsync.sglang.live import MLA_DERIVED

    model = _model(ctx)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"param:{name}"] = p.detach().cpu().clone()
    for name, b in model.named_buffers():
        if b.is_floating_point():
            out[f"buffer:{name}"] = b.detach().cpu().clone()
    for name, mod in model.named_modules():
        if not (hasattr(mod, "kv_b_proj") and hasattr(mod, "w_kc")):
            continue
        for attr in MLA_DERIVED:
            t = getattr(mod, attr, None)
            if isinstance(t, torch.Tensor):
                out[f"derived:{name}.{attr}"] = t.detach().cpu().clone()
    return out


def digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """A short content hash per tensor (bytes, shape and dtype)."""
    out = {}
    for name, t in tensors.items():
        h = hashlib.blake2b(digest_size=12)
        h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
        t = t.detach().cpu().contiguous()
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def computed_digests(ctx: Any) -> dict[str, str]:
    """:func:`digests` of :func:`computed`, computed on the worker (small answers for large models)."""
    return digests(computed(ctx))


def held_layout(model_config: dict, engine: str) -> Any:
    """The engine layout of ``engine`` as the engine holds it: with ``quant=fp8`` its FP8 form (e4m3 weights beside
    their fp32 ``_scale_inv``, :func:`weightsync.quant.layout.fp8_layout`), else the layout itself."""
    from weightsync.engines import make_layout
    from weightsync.spec.model import spec_from_config

    layout = make_layout(spec_from_config(model_config), engine)
    if getattr(layout.config, "quant", 0):
        from weightsync.quant.layout import fp8_layout

        return fp8_layout(layout)
    return layout


def checkpoint_form(canonical: Mapping[str, torch.Tensor], layout: Any) -> dict[str, torch.Tensor]:
    """``canonical`` (the trainer's tensors) as the checkpoint of ``layout``'s engine holds them: under an FP8 layout
    each FP8 weight through :func:`weightsync.quant.fp8.quantize_reference` (what ``save_checkpoint(dir,
    quant="fp8")`` writes) beside its ``_scale_inv``; otherwise as they are."""
    out = dict(canonical)
    for name, f in (getattr(layout, "fp8", None) or {}).items():
        from weightsync.quant.fp8 import quantize_reference

        q = quantize_reference(canonical[name])
        out[name], out[f.scale.name] = q.weight, q.scale_inv
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def loaded_problems(ctx: Any, canonical: Mapping[str, torch.Tensor], model_config: dict, engine: str) -> list[str]:
    """Every written tensor of this worker that is not bit-exact to ``canonical`` in the engine's checkpoint form
    (:func:`checkpoint_form`: block FP8 under ``quant=fp8``, bit for bit, scales included; padding excluded)."""
    from weightsync.layout.materialize import canonical_view, local_view

    held = held_layout(model_config, engine)
    want = checkpoint_form(canonical, held)
    layout = held.layout(ctx.rank)
    problems = []
    for name, t in layout.tensors.items():
        got = ctx.tensors[name]
        for p in t.pieces:
            exp = canonical_view(want[p.canonical], p).to(got.dtype)
            have = local_view(got, p).cpu()
            if have.dtype != exp.dtype or not torch.equal(_bits(have), _bits(exp)):
                problems.append(f"rank {ctx.rank}: {name} <- {p.canonical} {list(p.canon_box)} differs")
    return problems


def methods(ctx: Any) -> dict[str, str]:
    """Each module's quant method, with the block-FP8 GEMM function an ``Fp8LinearMethod`` calls
    (``w8a8_block_fp8_linear``: DeepGEMM, CUTLASS, Triton, ...) and the runner an FP8 MoE method uses."""
    from weightsync.sglang.live import _backend_name

    out = {}
    for name, mod in _model(ctx).named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is None:
            continue
        kind = type(qm).__name__
        gemm = getattr(getattr(qm, "w8a8_block_fp8_linear", None), "__name__", None)
        if gemm is not None:
            kind += f"/{gemm}"
        if kind == "Fp8MoEMethod":
            kind += f"/{_backend_name(qm)}"
        out[name] = kind
    return out


def ping(ctx: Any) -> float:
    """The worker's clock (``time.time()``) when it ran: a call's latency there and back (benchmarks/sglang_gpu.py)."""
    import time

    return time.time()


def switch_interval(ctx: Any, seconds: float | None) -> float:
    """Set this worker process's GIL switch interval (None: leave it) and return the one before: the overhead bench
    asks whether a mailbox call waits for the GIL behind SGLang's spinning scheduler loop (benchmarks/sglang_gpu.py)."""
    import sys

    before = sys.getswitchinterval()
    if seconds is not None:
        sys.setswitchinterval(seconds)
    return before


def empty_cache_seconds(ctx: Any) -> float:
    """How long ``torch.cuda.empty_cache()`` takes in this worker now (what SGLang's flush and continue run)."""
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda.empty_cache()
    return time.perf_counter() - t0


def flip(ctx: Any, name: str, restore: float | None = None) -> tuple[str, float]:
    """Change the first element of parameter ``name`` on this worker (add 1), or put ``restore`` back there: a
    known wrong tensor for a validation to find (benchmarks/sglang_gpu.py), and its undoing (exact: the old value
    is returned as a Python float, which holds any bf16/fp16/fp32 value)."""
    p = dict(_model(ctx).named_parameters())[name]
    flat = p.data.view(-1)
    old = float(flat[0])
    flat[0] = old + 1 if restore is None else restore
    return f"rank {ctx.rank}: {name}[0]", old


def differences(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    """Names whose digests differ (or that one side lacks)."""
    return sorted(f"{n}: {'only in one' if n not in a or n not in b else 'differs'}"
                  for n in set(a) | set(b) if a.get(n) != b.get(n))


__all__ = ["computed", "digests", "computed_digests", "loaded_problems", "held_layout", "checkpoint_form", "methods", "differences", "ping", "switch_interval",
           "empty_cache_seconds", "flip"]
