"""The worker side shared by both entry points: one vLLM worker as one weightsync worker reader.

Whether the offline :class:`~weightsync.instances.vllm.VLLMInstance` (through the
``worker_extension_cls``) or the plug-in backend (inside ``WeightTransferEngine``) drives it, a worker
runs :mod:`weightsync.runtime.worker`'s functions on a :class:`~weightsync.runtime.instance.WorkerContext`
whose tensors are its model's loaded-form tensors (:class:`~weightsync.vllm.live.LiveModel`). There is
one :class:`VLLMWorker` per model object, kept on the model, so both entry points in one process
share it (and its staging memory).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from weightsync.runtime.instance import WorkerContext
from weightsync.vllm.config import EngineInfo, describe
from weightsync.vllm.live import LiveModel, LiveReport

_ATTR = "_weightsync_worker"


class VLLMWorker:
    """One vLLM worker's weightsync state: its engine description, loaded-form tensors and context."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, device: torch.device | str):
        from vllm.distributed import get_tensor_model_parallel_rank

        from weightsync.engines import make_layout
        from weightsync.spec.model import spec_from_config

        self.info: EngineInfo = describe(vllm_config)
        self.rank = get_tensor_model_parallel_rank()
        self.device = torch.device(device)
        spec = spec_from_config(self.info.model_config)
        engine_layout = make_layout(spec, self.info.engine)
        if getattr(engine_layout.config, "quant", 0):  # served in block FP8: the live tensors are e4m3 + scales
            from weightsync.quant.layout import fp8_layout

            engine_layout = fp8_layout(engine_layout)
        layout = engine_layout.layout(self.rank)
        where = f"{self.info.engine} rank {self.rank} ({spec.name})"
        self.live = LiveModel(model, layout, self.device, where)
        self.ctx = WorkerContext(self.rank, self.device, self.live.tensors,
                                 state={"model": model, "live": self.live, "vllm_config": vllm_config})

    @property
    def report(self) -> LiveReport:
        return self.live.report

    def run(self, fn: Callable[..., Any], args: tuple) -> Any:
        with torch.no_grad():
            return fn(self.ctx, *args)

    def refresh(self) -> int:
        return self.live.refresh()

    def close(self) -> None:
        from weightsync.runtime import worker

        worker.disconnect(self.ctx)


def worker_of(model: torch.nn.Module, vllm_config: Any, device: torch.device | str) -> VLLMWorker:
    """The model's :class:`VLLMWorker`, built on first use (a refusal raises, and is raised again next time)."""
    w = model.__dict__.get(_ATTR)
    if isinstance(w, Exception):
        raise w
    if w is None:
        try:
            w = VLLMWorker(model, vllm_config, device)
        except Exception as e:
            model.__dict__[_ATTR] = e
            raise
        model.__dict__[_ATTR] = w
    return w


def existing(model: torch.nn.Module) -> VLLMWorker | None:
    """The model's :class:`VLLMWorker` if one was built."""
    w = model.__dict__.get(_ATTR)
    return w if isinstance(w, VLLMWorker) else None


def forget(model: torch.nn.Module) -> None:
    w = model.__dict__.pop(_ATTR, None)
    if isinstance(w, VLLMWorker):
        w.close()
