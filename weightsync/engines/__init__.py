"""Engine layouts, looked up by name and imported lazily (a vLLM user never imports Megatron code)."""

from __future__ import annotations

import importlib

from weightsync.engines.common import parse_kv
from weightsync.errors import ConfigError
from weightsync.layout.layout import EngineLayout
from weightsync.spec.model import ModelSpec

ENGINES = {
    "hf": "weightsync.engines.hf:HFLayout",
    "fsdp": "weightsync.engines.fsdp:FSDPLayout",
    "megatron": "weightsync.engines.megatron:MegatronLayout",
    "vllm": "weightsync.engines.vllm:VLLMLayout",
    "sglang": "weightsync.engines.sglang:SGLangLayout",
}


def engine_class(name: str) -> type[EngineLayout]:
    try:
        module, cls = ENGINES[name].split(":")
    except KeyError:
        raise ConfigError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}") from None
    return getattr(importlib.import_module(module), cls)


def make_layout(spec: ModelSpec, text: str) -> EngineLayout:
    """Build an engine layout from ``ENGINE:k=v,...`` (e.g. ``megatron:tp=2,pp=2``)."""
    name, _, rest = text.partition(":")
    cls = engine_class(name.strip())
    return cls(spec, **parse_kv(rest, cls.keys, name))


__all__ = ["ENGINES", "engine_class", "make_layout"]
