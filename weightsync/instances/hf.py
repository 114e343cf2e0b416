"""A plain transformers model as an inference instance: one "worker", the control process itself.

The live tensors are bound with :class:`weightsync.bind.infer.HFInferenceEngine` (layout ``hf``,
rank 0: parameters plus DeepSeek's persistent ``e_score_correction_bias`` buffer, under the layout's
names), which checks every name, shape and dtype against the derived layout at construction and
raises :class:`~weightsync.errors.LayoutMismatch` on any difference.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from weightsync.dtypes import dtype_name
from weightsync.bind import hf_module_config
from weightsync.bind.infer import HFInferenceEngine
from weightsync.instances import InstanceError
from weightsync.runtime.instance import ClosedOnExit, NoEngineHooks, WorkerContext
from weightsync.spec.arch import config_keys
from weightsync.spec.model import spec_from_config

#: the config.json keys spec_from_config reads (for any supported architecture: each declares its own)
SPEC_KEYS = config_keys()


def spec_config(module: torch.nn.Module) -> dict[str, Any]:
    """``module.config`` as a config.json dict, keeping only what :func:`spec_from_config` needs.

    A module built with ``from_config`` records no ``architectures``; it is taken from the module's
    class (:func:`weightsync.bind.hf_module_config`).
    """
    cfg = hf_module_config(module)
    out = {k: cfg[k] for k in SPEC_KEYS if k in cfg and cfg[k] is not None}
    for k in ("torch_dtype", "dtype"):
        if k in out and not isinstance(out[k], str):
            out[k] = dtype_name(out[k])
    return out


class HFInstance(ClosedOnExit, NoEngineHooks):
    """A live transformers model (world size 1, engine ``hf``); ``call`` runs ``fn`` here, on rank 0.

    ``fn(ctx, *args)`` gets the live parameters / buffers (writes land in the model) and runs under
    ``torch.no_grad()``; its exceptions propagate unchanged. ``timeout_s`` is accepted for the
    protocol but cannot interrupt an in-process call. ``pause``/``resume``/``after_update`` do
    nothing: transformers derives nothing from its weights and keeps no cache between generate calls.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.model_config = spec_config(module)
        self.bound = HFInferenceEngine(module, spec_from_config(self.model_config)).bound  # check_live: LayoutMismatch
        #: the layout as bound to the live module (``hf`` plus what it keeps in fp32, e.g. DeepSeek's router)
        self.engine = self.bound.engine.describe()
        tensors = dict(self.bound.tensors)
        first = next(iter(tensors.values()), None)
        device = first.device if first is not None else torch.device("cpu")
        self._ctx = WorkerContext(rank=0, device=device, tensors=tensors)
        self._closed = False

    @property
    def spec(self):
        return self.bound.spec

    @property
    def world_size(self) -> int:
        return 1

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        if self._closed:
            raise InstanceError(f"{self!r} is closed")
        with torch.no_grad():
            return [fn(self._ctx, *args)]

    def close(self) -> None:
        self._closed = True
        self._ctx.state.clear()
        self._ctx.reader = None

    def __repr__(self) -> str:
        return f"HFInstance({self.spec.name}, {len(self._ctx.tensors)} tensors)"


__all__ = ["HFInstance", "spec_config", "SPEC_KEYS"]
