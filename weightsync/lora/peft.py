"""A live PEFT LoRA model bound as a trainer whose canonical tensors are its adapter's alone.

    model = peft.get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=[...]))
    trainer = PeftTrainEngine(model)            # checks, then binds: trainer.bound.tensors are the live
    trainer.spec                                 # lora_A / lora_B parameters, nothing of the base

Under FSDP2 (``fully_shard`` over a 1-D device mesh, the adapter's parameters DTensors) the same constructor binds
each rank's shards: the layout is :class:`~weightsync.lora.layouts.PeftFSDPLayout` (``dp`` and this rank from the
parameters' mesh) and the bound tensors are the DTensors' local tensors, the very shards FSDP2 all-gathers from, so
each rank sends its own rows and nothing is gathered. Bind while sharded (FSDP2's default after a forward).

The adapter's :class:`~weightsync.lora.adapter.AdapterSpec` is derived from the adapter's config and the base
model's config alone (rank, alpha, rsLoRA and target modules from the ``LoraConfig``; each module's shape from the
base model's spec), then checked against the live parameters by :func:`weightsync.bind.bind`: every live
``lora_*`` parameter of the adapter must be one the spec names, with the shape and dtype it says, and every one the
spec names must be live -- else :class:`~weightsync.errors.LayoutMismatch` naming each difference, before any byte
moves. The frozen base is no part of the binding: nothing of it is ever planned or sent.
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.bind import Bound, LiveEngine, bind, hf_module_spec
from weightsync.errors import ConfigError
from weightsync.lora.adapter import AdapterSpec, adapter_config, adapter_spec
from weightsync.lora.layouts import PeftFSDPLayout, PeftLayout
from weightsync.spec.model import ModelSpec


def adapter_tensors(model: torch.nn.Module, adapter_name: str) -> dict[str, torch.Tensor]:
    """Every parameter of adapter ``adapter_name`` in a PEFT model (``...lora_A.<name>.weight``, and anything else
    PEFT made for it: a DoRA magnitude, a LoRA bias, an embedding's ``lora_embedding_A``)."""
    tag = f".{adapter_name}."
    return {n: p for n, p in model.named_parameters() if "lora_" in n and (tag in n or n.endswith(f".{adapter_name}"))}


class PeftTrainEngine(LiveEngine):
    """A PEFT ``PeftModel`` bound to its adapter: in one process (:class:`PeftLayout`, rank 0), or one rank of it
    under FSDP2 (:class:`PeftFSDPLayout`, the rank its mesh coordinate says).

    ``adapter_name``: which of the model's adapters (default: the active one). ``base``: the base model's spec
    (default: from the base model's own ``config``)."""

    def __init__(self, model: torch.nn.Module, adapter_name: str | None = None, base: ModelSpec | None = None):
        configs = getattr(model, "peft_config", None)
        if not configs:
            raise ConfigError(f"{type(model).__name__} is no PEFT model (no peft_config): wrap it with "
                              "peft.get_peft_model")
        if adapter_name is None:
            active = getattr(model, "active_adapter", None)
            adapter_name = active if isinstance(active, str) else next(iter(configs))
        if adapter_name not in configs:
            raise ConfigError(f"the PEFT model has no adapter {adapter_name!r} (it has {sorted(configs)})")
        self.module = model
        self.adapter_name = adapter_name
        live = adapter_tensors(model, adapter_name)
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in live.values()})
        if len(dtypes) != 1:
            raise ConfigError(f"adapter {adapter_name!r} holds its tensors in {dtypes or 'no dtype'}: one dtype "
                              "expected")
        base = base or hf_module_spec(model.get_base_model())
        spec = adapter_spec(base, adapter_config(configs[adapter_name], dtype=dtypes[0]))
        engine, rank, live = _sharding(spec, adapter_name, live, fsdp=_under_fsdp2(model))
        self.bound: Bound = bind(engine, rank, live, where=f"{engine.describe()} rank {rank} adapter "
                                                           f"{adapter_name!r} ({spec.name})")

    @property
    def spec(self) -> AdapterSpec:  # type: ignore[override]
        """The adapter's canonical tensors (the layout's spec)."""
        return self.bound.engine.spec  # type: ignore[return-value]

    def canonical(self) -> dict[str, torch.Tensor]:
        """The adapter's canonical tensors as copies (what ``save_pretrained`` writes, names included); one process
        only (under FSDP2 each rank holds shards: gather them with the DTensors' ``full_tensor``)."""
        if not isinstance(self.bound.engine, PeftLayout):
            raise ConfigError(f"canonical(): {self.bound.engine.describe()} holds shards of the adapter, not its "
                              "whole tensors; read each parameter's full_tensor() instead")
        with torch.no_grad():
            return {p.canonical: self.bound.tensors[p.tensor].detach().clone() for p in self.bound.layout.pieces()}


def _under_fsdp2(model: Any) -> bool:
    """Whether any module of ``model`` is fully_shard's (its parameters may be unsharded at this moment)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _sharding(spec: AdapterSpec, adapter_name: str, live: dict[str, torch.Tensor],
              fsdp: bool = False) -> tuple[Any, int, dict]:
    """The adapter's layout, this process's rank in it, and the tensors to bind: whole parameters, or under FSDP2
    each DTensor's local shard (a 1-D mesh only: FSDP2 with TP or HSDP over a PEFT model is refused by name)."""
    from torch.distributed.tensor import DTensor

    sharded = [n for n, t in live.items() if isinstance(t, DTensor)]
    if not sharded:
        if fsdp:  # unsharded parameters FSDP2 swapped in: freed at its next reshard, and every rank would be rank 0
            raise ConfigError(f"peft adapter {adapter_name!r}: the model is under FSDP2 but its adapter parameters "
                              "are unsharded now (after unshard(), or a forward with reshard_after_forward=False): "
                              "reshard() before binding, so that each rank binds its own shards")
        return PeftLayout(spec, adapter_name), 0, live
    if len(sharded) != len(live):
        whole = sorted(set(live) - set(sharded))
        raise ConfigError(f"peft adapter {adapter_name!r}: {len(sharded)} adapter parameters are DTensors, "
                          f"{len(whole)} are not ({whole[0]} ...): fully_shard every module holding the adapter")
    params = [live[n] for n in sharded]
    mesh = params[0].device_mesh
    if any(t.device_mesh != mesh for t in params) or mesh.ndim != 1:
        raise ConfigError(f"peft adapter {adapter_name!r}: FSDP2 over a {mesh.ndim}-D mesh (or several meshes): only "
                          "fully_shard over one 1-D mesh is supported for a PEFT adapter (no TP, no HSDP)")
    from torch.distributed.tensor import Shard

    odd = [n for n in sharded if not (isinstance(live[n].placements[0], Shard) and live[n].placements[0].dim == 0)]
    if odd:
        raise ConfigError(f"peft adapter {adapter_name!r}: {odd[0]} is placed {live[odd[0]].placements}, not FSDP2's "
                          "Shard(0)")
    coord = mesh.get_coordinate()
    if coord is None:
        raise ConfigError(f"peft adapter {adapter_name!r}: this process is not in the parameters' device mesh {mesh}")
    local = {n: t._local_tensor for n, t in live.items()}
    return PeftFSDPLayout(spec, mesh.size(0), adapter_name), coord[0], local


def bind_peft(model: Any, adapter_name: str | None = None) -> Bound:
    """:class:`PeftTrainEngine` ``(model).bound``."""
    return PeftTrainEngine(model, adapter_name).bound


__all__ = ["PeftTrainEngine", "adapter_tensors", "bind_peft"]
