"""Check a block-FP8 engine worker against an FP8 checkpoint (run on its workers, e.g. ``VLLMInstance.call``).

What an FP8-served vLLM worker computes with, as bytes: every parameter (the e4m3 weights, their fp32
``weight_scale_inv``, the bf16 norms and embeddings) and, for every linear layer, its output on a fixed bf16
input (the FP8 GEMM itself: activations quantized per token group, the block-scaled matmul). Two workers whose
:func:`computed` agree compute the same thing: compare an engine a sync wrote with a fresh engine loaded from
``save_checkpoint(dir, quant="fp8")`` of the same weights. :func:`loaded_problems` compares the live tensors with
that checkpoint's tensors (the reference quantizer per weight, placed by the worker's FP8 layout).

(:mod:`weightsync.vllm.verify` does the same for unquantized engines; its GEMM probe takes the weight's dtype as
the input's, which is e4m3 here, and compares with ``torch.equal``: hence these.)
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch

_BYTES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its width (NaN compares equal to itself, -0 differs from +0)."""
    return t.detach().contiguous().view(_BYTES[t.element_size()])


def computed(ctx: Any) -> dict[str, torch.Tensor]:
    """What this worker computes with: ``param:NAME`` (every non-empty parameter; an FP8 one as its bytes, under
    ``param:NAME:float8_e4m3fn``: a pickled float8 tensor does not load back, which the first GPU run showed) and
    ``gemm:LAYER`` (each quantized or unquantized linear's output on a fixed input in the model dtype), on CPU."""
    model = ctx.state["model"]
    dtype = next((p.dtype for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16, torch.float32)),
                 torch.bfloat16)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel():
                t = p.detach().cpu().clone()
                if t.dtype in _FP8:  # pickle cannot carry them back (torch 2.11-2.13: the load fails): their bytes
                    out[f"param:{name}:{str(t.dtype).removeprefix('torch.')}"] = t.view(torch.uint8)
                else:
                    out[f"param:{name}"] = t
        for name, mod in model.named_modules():
            qm = getattr(mod, "quant_method", None)
            w = getattr(mod, "weight", None)
            k = getattr(mod, "input_size_per_partition", None)
            if qm is None or not hasattr(qm, "apply") or not isinstance(w, torch.Tensor) or w.dim() != 2 or not k:
                continue
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            x = torch.randn(5, int(k), generator=g).to(dtype=dtype, device=w.device)
            bias = getattr(mod, "bias", None)
            try:
                y = qm.apply(mod, x, bias) if isinstance(bias, torch.Tensor) else qm.apply(mod, x)
            except TypeError:
                continue
            out[f"gemm:{name}"] = y.detach().cpu().clone()
    return out


def differences(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in shape, dtype or any bit, or are present on one side only."""
    diff = [f"{n}: only in the first" for n in a if n not in b] + [f"{n}: only in the second" for n in b if n not in a]
    return diff + [f"{n}: differs" for n in a if n in b and not (
        a[n].shape == b[n].shape and a[n].dtype == b[n].dtype and torch.equal(bits(a[n]), bits(b[n])))]


def loaded_problems(ctx: Any, canonical: Mapping[str, torch.Tensor]) -> list[str]:
    """Every live tensor of this worker's FP8 layout that is not, bit for bit, the FP8 checkpoint of ``canonical``
    (each FP8 weight through :func:`weightsync.quant.fp8.quantize_reference`, as ``save_checkpoint(dir,
    quant="fp8")`` writes it) placed by the layout; regions no piece covers (vocab padding) are not compared, nor
    are the layers whose kernel requantizes the checkpoint after loading (DeepGEMM: ``in-place+requant``), which
    hold the engine's form of it -- those are compared with a fresh engine's (:func:`computed`)."""
    from weightsync.layout.materialize import canonical_view, local_view
    from weightsync.quant.fp8 import quantize_reference
    from weightsync.vllm.live import IN_PLACE_REQUANT

    live = ctx.state["live"]
    layout, requantized = live.layout, live.report.tensors_on(IN_PLACE_REQUANT)
    want = dict(canonical)
    for name, t in layout.tensors.items():
        for p in t.pieces:
            if p.canonical.endswith("_scale_inv") and p.canonical not in want:
                w = p.canonical.removesuffix("_scale_inv")
                q = quantize_reference(canonical[w])
                want[w], want[p.canonical] = q.weight, q.scale_inv
    problems = []
    for name, t in layout.tensors.items():
        if name in requantized:
            continue
        got = ctx.tensors[name]
        for p in t.pieces:
            exp = canonical_view(want[p.canonical], p)
            have = local_view(got, p).cpu()
            if have.dtype != exp.dtype or not torch.equal(bits(have), bits(exp.to(have.dtype))):
                problems.append(f"rank {ctx.rank}: {name} <- {p.canonical} {list(p.canon_box)} differs")
    return problems


def layer_methods(ctx: Any) -> dict[str, str]:
    """Each module's quant method and, for FP8 linears, the GEMM kernel vLLM chose (``Fp8LinearMethod/Cutlass...``)."""
    model = ctx.state["model"]
    out = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is not None:
            kernel = getattr(qm, "fp8_linear", None)
            out[name] = type(qm).__name__ + (f"/{type(kernel).__name__}" if kernel is not None else "")
    return out


def live_paths(ctx: Any) -> dict[str, int]:
    """The worker's :class:`weightsync.vllm.live.LiveReport` path counts."""
    return ctx.state["live"].report.counts()


__all__ = ["bits", "computed", "differences", "layer_methods", "live_paths", "loaded_problems"]
