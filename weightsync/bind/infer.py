"""Inference-side bindings.

A plain transformers module is bound here (one process, layout ``hf``, rank 0): the reference
"inference engine" of tests and of small deployments. vLLM workers are bound in their own processes
by :mod:`weightsync.vllm.live` (the loaded form of every layer, and how each is brought back to the
form the engine computes with), SGLang workers by :mod:`weightsync.instances.sglang`.
"""

from __future__ import annotations

import torch

from weightsync.bind import Bound, LiveEngine, bind, hf_module_spec, live_fp32_keys, module_tensors
from weightsync.engines.hf import HFLayout
from weightsync.spec.model import ModelSpec


class HFInferenceEngine(LiveEngine):
    """A transformers model serving generation: the receiving end of a sync, layout ``hf``, rank 0.

    Same layout as :class:`weightsync.bind.train.HFTrainEngine` (transformers keeps one in-memory
    form), kept as its own class so a sync names its two sides and each can grow its own hooks
    (e.g. an inference engine resetting its KV cache after weights change).
    """

    def __init__(self, module: torch.nn.Module, spec: ModelSpec | None = None):
        spec = spec or hf_module_spec(module)
        self.module = module
        live = module_tensors(module)
        engine = HFLayout(spec, **live_fp32_keys(spec, live))  # fp32_router...: as the live module holds them
        self.bound: Bound = bind(engine, 0, live, where=f"{engine.describe()} rank 0 ({spec.name})")


__all__ = ["HFInferenceEngine"]
