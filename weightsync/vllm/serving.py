"""Withholding an offline vLLM engine whose weights are torn, until the next good update.

A non-staged update writes the engine's live weights in place: once it fails part-way (a trainer died
mid-step) the engine holds a mix of two steps, which it must not serve. An offline ``vllm.LLM``
generates only when its user calls it, and every one of its entry points (``generate``, ``chat``,
``encode`` ...) adds its requests through ``llm.llm_engine.add_request``: :func:`withhold` shadows that
method on the engine object with one that raises :class:`~weightsync.errors.InstanceError` saying why,
and :func:`serve` removes the shadow once a later update succeeded. (An ``AsyncLLM`` is withheld by
staying paused: :class:`~weightsync.instances.vllm.VLLMInstance` does not resume it.)
"""

from __future__ import annotations

import logging
from typing import Any

from weightsync.errors import InstanceError

log = logging.getLogger("weightsync.vllm")

_MARK = "_weightsync_withheld"


def withhold(llm: Any, reason: str) -> None:
    """Make every new request to the offline ``llm`` raise until :func:`serve` (requests already running
    finish: ``LLM`` runs none between its calls)."""
    engine = llm.llm_engine

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise InstanceError(f"this vLLM engine serves nothing until the next good weight update: its weights are a "
                            f"mix of two steps since a non-staged update failed ({reason})")

    setattr(refuse, _MARK, reason)
    engine.add_request = refuse
    log.warning("vLLM engine withheld until the next good update: %s", reason)


def serve(llm: Any) -> None:
    """Lift :func:`withhold` (a no-op on an engine that was not withheld)."""
    engine = getattr(llm, "llm_engine", None)
    if engine is not None and withheld(llm) is not None:
        del engine.add_request


def withheld(llm: Any) -> str | None:
    """Why ``llm`` is withheld, or None."""
    engine = getattr(llm, "llm_engine", None)
    shadow = getattr(engine, "__dict__", {}).get("add_request")
    return getattr(shadow, _MARK, None)


__all__ = ["withhold", "serve", "withheld"]
