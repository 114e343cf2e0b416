"""Engine layouts, looked up by name and imported lazily (a vLLM user never imports Megatron code)."""

from __future__ import annotations

import importlib

from weightsync.engines.config import (
    CONFIGS,
    EngineConfig,
    FSDPConfig,
    HFConfig,
    MegatronConfig,
    SGLangConfig,
    VLLMConfig,
    config_class,
    parse_engine,
)
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


def make_layout(spec: ModelSpec, engine: str | EngineConfig) -> EngineLayout:
    """Build an engine layout from ``ENGINE:k=v,...`` (e.g. ``megatron:tp=2,pp=2``) or an engine config.

    ``make_layout(spec, layout.describe())`` rebuilds ``layout`` exactly: the description is its config's text.
    """
    config = parse_engine(engine)
    return engine_class(config.engine)(spec, config)


__all__ = [
    "ENGINES", "CONFIGS", "EngineConfig", "HFConfig", "FSDPConfig", "MegatronConfig", "VLLMConfig", "SGLangConfig",
    "config_class", "engine_class", "make_layout", "parse_engine",
]
