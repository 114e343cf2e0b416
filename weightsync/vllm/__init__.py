"""weightsync inside stock vLLM (imported lazily: ``import weightsync`` never imports vLLM).

Two entry points share one worker side (:mod:`weightsync.vllm.side`, :mod:`weightsync.vllm.live`):

- offline: ``LLM(..., worker_extension_cls=EXTENSION)`` and ``WeightReader(VLLMInstance(llm), ...)``;
- the plug-in backend ``weightsync`` (registered through the ``vllm.general_plugins`` entry point):
  ``LLM(..., weight_transfer_config={"backend": "weightsync"})``, driven by vLLM's own
  ``init_weight_transfer_engine`` / ``update_weights`` (or :class:`VLLMWeightSync`, which raises
  failures and sets the weight version once the step is held).
"""

from __future__ import annotations

from weightsync.lazy_exports import lazy_exports

_LAZY = {
    "EXTENSION": "weightsync.vllm.extension",  # each constant defined once, where it is used
    "BACKEND": "weightsync.vllm.plugin",
    "VLLMInstance": "weightsync.instances.vllm",
    "VLLMWeightSync": "weightsync.vllm.driver",
    "InitInfo": "weightsync.vllm.config",
    "CallStatus": "weightsync.vllm.status",
    "LiveReport": "weightsync.vllm.live",
}

__all__ = [*_LAZY]


__getattr__ = lazy_exports(__name__, _LAZY)
