"""weightsync: move model weights from RL trainers to inference engines, resharding in place.

The public surface, imported lazily (PEP 562) so ``import weightsync`` costs nothing: the MetaServer
needs no torch, a vLLM user never imports Megatron::

    from weightsync import WeightWriter, WeightReader, MetaServer
    from weightsync import WeightSyncError, ConfigError, TransportError, ...
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "WeightWriter": "weightsync.runtime.writer",
    "WeightReader": "weightsync.runtime.reader",
    "MetaServer": "weightsync.meta.server",
    "MetaClient": "weightsync.meta.client",
    "load_spec": "weightsync.spec",
    "make_layout": "weightsync.engines",
    # every error a user may catch (weightsync.errors needs nothing but the standard library)
    **{name: "weightsync.errors" for name in (
        "WeightSyncError", "SpecError", "ConfigError", "LayoutMismatch", "PlanError", "JobMismatch",
        "TransportError", "WeightsMoved", "MetaError", "MetaAborted", "MetaTimeout", "MetaUnavailable",
        "InstanceError", "WorkerError", "WorkerDied", "WorkerTimeout", "ValidationMismatch", "IntegrityError",
        "GroupTimeout",
    )},
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # for type checkers and IDEs; never run
    from weightsync.engines import make_layout
    from weightsync.errors import (
        ConfigError,
        InstanceError,
        JobMismatch,
        LayoutMismatch,
        MetaAborted,
        MetaError,
        MetaTimeout,
        MetaUnavailable,
        PlanError,
        SpecError,
        TransportError,
        ValidationMismatch,
        WeightsMoved,
        WeightSyncError,
        WorkerDied,
        WorkerError,
        WorkerTimeout,
    )
    from weightsync.meta.client import MetaClient
    from weightsync.meta.server import MetaServer
    from weightsync.runtime.reader import WeightReader
    from weightsync.runtime.writer import WeightWriter
    from weightsync.spec import load_spec
