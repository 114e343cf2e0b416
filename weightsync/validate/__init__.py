"""Tensor-level validation of an inference instance against an HF checkpoint (issue 17).

:func:`validate` compares, tensor by tensor, what every worker of an instance computes with now with
what the same engine holds after loading the checkpoint through its own loader:

==========================  ===============================  =====================================
instance                    reference (``via``)              module
==========================  ===============================  =====================================
``HFInstance``              ``from_pretrained``              :mod:`weightsync.validate.hf`
``VLLMInstance`` (real)     ``vllm-loader``: a fresh model   :mod:`weightsync.validate.vllm`
                            loaded and post-processed by
                            vLLM in each worker
any other (faithful,        ``layout``: the checkpoint's     :mod:`weightsync.validate.layout`
SGLang)                     regions placed by weightsync's
                            layout (not the engine's loader)
==========================  ===============================  =====================================

The result is a :class:`ValidationReport` (per tensor: name, rank, shape, dtype, differing elements,
max absolute difference, first differing index; ``summary``: ``tensors``, ``mismatched``,
``mismatches``). ``WeightReader.validate`` is the usual entry point (and ``validate_every=N``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from weightsync.validate.report import (
    VIA_HF,
    VIA_LAYOUT,
    VIA_VLLM,
    TensorCheck,
    ValidationReport,
    ValidationSummary,
    compare,
)


def via_of(instance: Any) -> str:
    """Which reference :func:`validate` uses for ``instance``."""
    kind = type(instance).__name__
    if kind == "HFInstance":
        return VIA_HF
    if kind == "VLLMInstance":
        return VIA_VLLM
    if kind == "SGLangInstance" and getattr(instance, "validate_via", None) == "sglang-loader":
        return "sglang-loader"  # weightsync.sglang.validate (opt-in until it has run on the GPU host)
    return VIA_LAYOUT


def validate(instance: Any, checkpoint: str | os.PathLike, *, step: int | None = None,
             raise_on_mismatch: bool = False, timeout_s: float | None = None) -> ValidationReport:
    """Compare every tensor ``instance`` computes with against the engine's load of ``checkpoint``
    (module docstring). Runs on every worker at once; the engine keeps its weights. Raises
    :class:`~weightsync.errors.ValidationMismatch` naming the tensors if ``raise_on_mismatch``."""
    from weightsync.validate.checkpoint import checkpoint_files

    path = str(checkpoint)
    checkpoint_files(path)  # refuse a path that is no checkpoint here, before any worker is asked
    via = via_of(instance)
    t0 = time.perf_counter()
    if via == VIA_HF:
        from weightsync.validate.hf import check_hf

        checks = check_hf(instance.module, path)
    elif via == VIA_VLLM:
        from weightsync.validate.vllm import check_vllm

        checks = [c for cs in instance.call(check_vllm, path, timeout_s=timeout_s) for c in cs]
    elif via == "sglang-loader":
        from weightsync.sglang.validate import check_sglang

        checks = [c for cs in instance.call(check_sglang, path, timeout_s=timeout_s) for c in cs]
    else:
        from weightsync.validate.layout import check_layout

        checks = [c for cs in instance.call(check_layout, path, instance.engine, dict(instance.model_config),
                                            timeout_s=timeout_s) for c in cs]
    report = ValidationReport(instance.engine, via, path, tuple(checks), time.perf_counter() - t0, step)
    if raise_on_mismatch:
        report.raise_if_mismatched()
    return report


__all__ = ["validate", "via_of", "ValidationReport", "ValidationSummary", "TensorCheck", "compare",
           "VIA_HF", "VIA_VLLM", "VIA_LAYOUT"]
