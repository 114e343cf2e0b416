"""Inference instances for a local job's inference processes, poisoned so that a missed byte shows.

``hf``: a real transformers model of the spec (every parameter NaN) behind
:class:`~weightsync.instances.hf.HFInstance`. Any other layout (``vllm:tp=2``, ``sglang:...``):
:class:`~weightsync.instances.faithful.FaithfulInstance`, one worker process per rank holding
exactly that engine's tensors, NaN-filled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from weightsync.spec.model import ModelSpec


@dataclass
class LocalInstance:
    """``instance`` is what a WeightReader drives; ``model`` the transformers module of an ``hf`` one."""

    instance: Any
    model: torch.nn.Module | None = None

    def close(self) -> None:
        self.instance.close()


def build_instance(spec: ModelSpec, engine: str, device: str = "cpu", seed: int = 1) -> LocalInstance:
    """An instance of layout ``engine``: on ``cpu``, or from ``cuda:K`` on (rank r on ``cuda:K+r``)."""
    if engine == "hf":
        from weightsync.instances.hf import HFInstance
        from weightsync.checkpoint.hf import build_hf_model

        model = build_hf_model(spec, seed=seed).to(device)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        return LocalInstance(HFInstance(model), model)
    from weightsync.instances.faithful import FaithfulInstance

    return LocalInstance(FaithfulInstance(dict(spec.config), engine, device=device, fill=float("nan"),
                                          start_method=worker_start_method()))


def worker_start_method() -> str:
    """How a local instance starts its worker processes: forked from a forkserver that imported torch once
    (where the platform has one: each worker then costs a fork, not a fresh interpreter importing torch),
    else ``spawn``. ``WEIGHTSYNC_WORKER_START_METHOD`` overrides it."""
    import multiprocessing as mp
    import os

    return os.environ.get("WEIGHTSYNC_WORKER_START_METHOD") or (
        "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")


__all__ = ["LocalInstance", "build_instance", "worker_start_method"]
