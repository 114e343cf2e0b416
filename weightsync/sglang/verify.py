"""Check an SGLang worker against weights loaded from files (run with ``SGLangInstance.call``).

- :func:`computed`: every tensor the worker computes with: every parameter and floating buffer of the live
  model (on the GPU, SGLang's unquantized linear, embedding and Triton fused-MoE methods read their
  parameters as loaded: ``layers/quantization/unquant.py`` in 0.5.14 transforms them only for CPU AMX,
  AITER on ROCm and flashinfer's TRT-LLM MoE, which ``SGLangInstance`` refuses). Two engines whose
  :func:`computed` agree compute the same thing; compare a synced engine with a FRESH engine loaded from the
  checkpoint (never with transformers: bf16 kernels differ on near-ties).
- :func:`loaded_problems`: the tensors weightsync writes, against canonical (checkpoint) tensors scattered
  by the worker's layout.
- :func:`digests`: a content hash per tensor, to compare across processes as JSON.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import torch


def _model(ctx: Any) -> torch.nn.Module:
    return ctx.state["model"]


def computed(ctx: Any) -> dict[str, torch.Tensor]:
    """``param:NAME`` for every parameter, ``buffer:NAME`` for every floating buffer, on CPU."""
    model = _model(ctx)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"param:{name}"] = p.detach().cpu().clone()
    for name, b in model.named_buffers():
        if b.is_floating_point():
            out[f"buffer:{name}"] = b.detach().cpu().clone()
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


def loaded_problems(ctx: Any, canonical: Mapping[str, torch.Tensor], model_config: dict, engine: str) -> list[str]:
    """Every written tensor of this worker that is not bit-exact to ``canonical`` (padding excluded)."""
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import canonical_view, local_view
    from weightsync.spec.model import spec_from_config

    layout = make_layout(spec_from_config(model_config), engine).layout(ctx.rank)
    problems = []
    for name, t in layout.tensors.items():
        got = ctx.tensors[name]
        for p in t.pieces:
            want = canonical_view(canonical[p.canonical], p).to(got.dtype)
            if not torch.equal(local_view(got, p).cpu(), want):
                problems.append(f"rank {ctx.rank}: {name} <- {p.canonical} {list(p.canon_box)} differs")
    return problems


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


__all__ = ["computed", "digests", "computed_digests", "loaded_problems", "differences", "ping", "switch_interval",
           "empty_cache_seconds", "flip"]
