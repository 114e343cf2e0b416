"""Check a vLLM worker against weights loaded from files (run with ``VLLMInstance.call``).

Two views of one worker, compared with ``torch.equal`` by the tests (and usable by anyone who
doubts a sync):

- :func:`loaded_problems`: the loaded-form tensors weightsync writes, against canonical (checkpoint)
  tensors scattered by the worker's layout.
- :func:`computed`: what the engine computes with -- every non-empty live parameter (norms,
  embeddings, CPU-prepacked experts ...) and, for layers whose weights are packed into an opaque
  kernel handle (CPU oneDNN linears, CPU lm_head), the layer's output on a fixed input. Two engines
  whose :func:`computed` agree compute the same thing; compare one that was synced with a fresh
  engine loaded from the checkpoint.
"""

from __future__ import annotations

import zlib
from typing import Any, Mapping

import torch


def loaded_problems(ctx: Any, canonical: Mapping[str, torch.Tensor]) -> list[str]:
    """Every loaded-form tensor of this worker that is not bit-exact to ``canonical`` (padding excluded)."""
    from weightsync.layout.materialize import local_view, canonical_view

    live = ctx.state["live"]
    problems = []
    for name, t in live.layout.tensors.items():
        got = ctx.tensors[name]
        for p in t.pieces:
            want = canonical_view(canonical[p.canonical], p).to(got.dtype)
            if not torch.equal(local_view(got, p).cpu(), want):
                problems.append(f"rank {ctx.rank}: {name} <- {p.canonical} {list(p.canon_box)} differs")
    return problems


def _probe_input(name: str, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(5, k, generator=g).to(dtype=dtype, device=device)


def computed(ctx: Any) -> dict[str, torch.Tensor]:
    """What this worker computes with (module docstring), keyed ``param:NAME`` / ``gemm:LAYER``, on CPU."""
    model = ctx.state["model"]
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel():
                out[f"param:{name}"] = p.detach().cpu().clone()
        for name, mod in model.named_modules():
            qm = getattr(mod, "quant_method", None)
            w = getattr(mod, "weight", None)
            if qm is None or not hasattr(qm, "apply") or not isinstance(w, torch.Tensor) or w.dim() > 2:
                continue
            k = (getattr(mod, "input_size_per_partition", None) or getattr(mod, "input_size", None)
                 or getattr(mod, "embedding_dim", None))
            if not k:
                continue
            x = _probe_input(name, int(k), w.dtype, w.device)
            bias = getattr(mod, "bias", None)
            try:
                y = qm.apply(mod, x, bias) if isinstance(bias, torch.Tensor) else qm.apply(mod, x)
            except TypeError:
                continue  # not a GEMM-shaped apply (fused MoE)
            out[f"gemm:{name}"] = y.detach().cpu().clone()
    return out


def differences(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bit-exact (or present on one side only)."""
    diff = [f"{n}: only in the first" for n in a if n not in b] + [f"{n}: only in the second" for n in b if n not in a]
    return diff + [f"{n}: differs" for n in a if n in b and not (a[n].shape == b[n].shape and
                                                                    a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]))]


def digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """A short content hash per tensor (bytes, shape and dtype), to compare across processes as JSON."""
    import hashlib

    out = {}
    for name, t in tensors.items():
        h = hashlib.blake2b(digest_size=12)
        h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def computed_digests(ctx: Any) -> dict[str, str]:
    """:func:`digests` of :func:`computed`: JSON-safe, for a vLLM server's HTTP ``/collective_rpc``
    (:func:`weightsync.vllm.rpc.json_request`)."""
    return digests(computed(ctx))


def validation(ctx: Any, checkpoint: str) -> dict:
    """This worker against vLLM's own fresh load of the HF checkpoint in ``checkpoint``
    (:mod:`weightsync.validate.vllm`), as :meth:`~weightsync.validate.ValidationReport.to_json` (the failed checks
    listed): JSON-safe, for a vLLM server's HTTP ``/collective_rpc`` (:func:`weightsync.vllm.rpc.json_request`)."""
    import time

    from weightsync.validate.report import VIA_VLLM, ValidationReport
    from weightsync.validate.vllm import check_vllm
    from weightsync.vllm.config import describe

    t0 = time.perf_counter()
    checks = check_vllm(ctx, str(checkpoint))
    return ValidationReport(describe(ctx.state["vllm_config"]).engine, VIA_VLLM, str(checkpoint), tuple(checks),
                            time.perf_counter() - t0).to_json()
