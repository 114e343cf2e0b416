"""What a WeightReader needs from an inference instance, whatever the engine behind it.

An inference instance is a control process plus one worker per GPU (vLLM/SGLang workers, our
layout-faithful worker processes, or -- for a plain transformers model -- the control process
itself). The reader lives in the control process and drives a worker reader in each worker through
:meth:`InferenceInstance.call`, the same way vLLM's ``collective_rpc`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; only annotations name it (requires-python >= 3.10)

import torch


@dataclass
class WorkerContext:
    """Handed to functions run on a worker: its rank in the instance and its live tensors.

    ``tensors`` maps the engine layout's local tensor names to the live storage (writes land in the
    engine's parameters). ``reader`` persists between calls on the same worker: the worker reader's
    plan and transport (:class:`weightsync.runtime.worker.WorkerReader`), built once and reused every
    step. ``state`` is the instance adapter's own (engine handles it keeps beside the tensors).
    """

    rank: int
    device: torch.device
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any] = field(default_factory=dict)
    reader: Any = None


class InferenceInstance(Protocol):
    """One inference instance as the reader sees it."""

    #: the engine layout string, e.g. "vllm:tp=2" (parsed with weightsync.engines.make_layout)
    engine: str
    #: the HF config dict of the model the instance serves (for the model spec)
    model_config: dict

    @property
    def world_size(self) -> int: ...

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(ctx: WorkerContext, *args)`` on every worker at once; results in rank order.

        Raises if a worker raises or dies (within ``timeout_s``); never hangs.
        """
        ...

    def pause(self) -> None:
        """Stop generating before weights change (vLLM pause(mode=keep), SGLang pause_generation)."""

    def resume(self) -> None:
        """Resume generating after an update (and flush caches that depended on old weights)."""

    def after_update(self) -> None:
        """Recompute tensors the engine derives from loaded weights (e.g. SGLang's MLA w_kc/w_vc)."""

    def set_version(self, step: int) -> None:
        """Tell the engine which weight version it now serves (vLLM/SGLang ``update_weight_version``); after a
        :meth:`withhold`, serve again."""

    def withhold(self, reason: str) -> None:
        """A non-staged update failed part-way, so the live weights may mix two steps: serve nothing until the
        next :meth:`set_version` (optional: the reader calls it where the instance has it)."""

    def call_when(self, gate: Callable[[], None], fn: Callable[..., Any], *args: Any,
                  timeout_s: float | None = None) -> list[Any]:
        """:meth:`call` sent at once, each worker's first copy waiting until ``gate()`` (run on the calling thread)
        returns; what ``gate`` raises calls the step off on every worker before any copy, and is raised once all
        answered (optional: :mod:`weightsync.transport.gate`; a co-located reader sends its step's call before the
        trainers' `written` where the instance has it)."""

    def close(self) -> None: ...


class ClosedOnExit:
    """``with instance:`` closes the instance (its ``close``) when the block ends, however it ends."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()  # type: ignore[attr-defined]


class NoEngineHooks:
    """For instances with no generation to pause and nothing derived from weights (plain tensors)."""

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def after_update(self) -> None:
        pass

    def set_version(self, step: int) -> None:
        pass

    def withhold(self, reason: str) -> None:
        pass
