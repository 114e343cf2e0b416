"""Trainer-side bindings: a plain transformers module, FSDP2 (+TP) DTensors, megatron-core GPTModels.

Each constructor reads the parallel config and this process's rank from the live objects (never
from user-supplied numbers that could disagree with them), derives the engine layout, and runs
:func:`weightsync.layout.layout.check_live` before anything else, raising ``LayoutMismatch``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from weightsync.bind import Bound, LiveEngine, as_spec, bind, hf_module_spec, live_fp32_keys, module_tensors
from weightsync.engines.fsdp import FSDPLayout
from weightsync.engines.hf import HFLayout
from weightsync.engines.megatron import MegatronLayout
from weightsync.engines.common import pad_to
from weightsync.errors import ConfigError
from weightsync.spec.model import ModelSpec


class HFTrainEngine(LiveEngine):
    """A whole (unsharded) transformers model in one process: layout ``hf``, rank 0.

    The spec comes from ``module.config`` so the binding cannot disagree with the model about which
    model it is; ``spec`` overrides it (e.g. a trainer keeping fp32 weights of a bf16 checkpoint).
    fp32 master weights and what is kept in fp32 beside bf16 ones (``fp32_router``...) are read
    from the live tensors (:func:`weightsync.bind.live_fp32_keys`), and the layout's description
    records them for the other end of the job.
    """

    def __init__(self, module: torch.nn.Module, spec: ModelSpec | None = None):
        spec = spec or hf_module_spec(module)
        self.module = module
        live = module_tensors(module)
        fp32 = fp32_master(spec, live.values())
        engine = HFLayout(spec, fp32=fp32, **live_fp32_keys(spec, live, fp32))
        self.bound: Bound = bind(engine, 0, live, where=f"{engine.describe()} rank 0 ({spec.name})")


def fp32_master(spec: ModelSpec, tensors) -> int:
    """1 when a trainer keeps fp32 weights of a lower-precision model (mixed precision's master copy)."""
    return int(spec.dtype != "float32" and all(t.dtype == torch.float32 for t in tensors if t.is_floating_point()))


# --------------------------------------------------------------------------------------------
# FSDP2


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_dim0_shard(placement: Any) -> bool:
    """FSDP2 always shards dim 0 (``Shard(0)``, or ``_StridedShard(0)`` under TP that also splits dim 0)."""
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard) and placement.dim == 0


def fsdp_mesh_dims(params: Sequence[Any]) -> tuple[Any, int, int | None]:
    """(mesh, dp mesh dim, tp mesh dim or None) of FSDP2 DTensor parameters.

    Named dims ``"dp"`` / ``"tp"`` decide when present. Otherwise the FSDP dim is the one on which
    *every* parameter is a dim-0 shard (FSDP shards everything; TP replicates norms), falling back
    to position 0 (FSDP's mesh is the outer one in ``init_device_mesh((dp, tp))``). A second dim on
    which nothing is sharded is HSDP's replicate dim, which the ``fsdp`` layout does not model.
    """
    mesh = max((p.device_mesh for p in params), key=lambda m: m.ndim)
    if mesh.ndim == 1:
        return mesh, 0, None
    if mesh.ndim > 2:
        raise ConfigError(f"fsdp: a {mesh.ndim}-D device mesh {mesh.mesh_dim_names} is not supported (dp and tp only)")
    names = tuple(mesh.mesh_dim_names or ())
    if set(names) == {"dp", "tp"}:
        dp_dim = names.index("dp")
    else:
        on_mesh = [p for p in params if p.device_mesh.ndim == 2]
        fsdp_like = [d for d in (0, 1) if all(_is_dim0_shard(p.placements[d]) for p in on_mesh)]
        dp_dim = fsdp_like[0] if len(fsdp_like) == 1 else 0
    tp_dim = 1 - dp_dim
    if not any(not p.placements[tp_dim].is_replicate() for p in params if p.device_mesh.ndim == 2):
        raise ConfigError(
            f"fsdp: mesh dim {tp_dim} ({names[tp_dim] if names else 'unnamed'}) shards no parameter: HSDP "
            "(replicate x shard) is not modelled by the fsdp layout"
        )
    return mesh, dp_dim, tp_dim


class FSDPTrainEngine(LiveEngine):
    """A transformers model under FSDP2 ``fully_shard`` (optionally TP first): layout ``fsdp``.

    dp/tp and this process's coordinates come from the parameters' ``device_mesh`` and placements;
    the bound tensors are each DTensor's ``_local_tensor`` -- the very shard FSDP2 all-gathers from
    (a view of its ``_sharded_param_data``), so an in-place write is what the next forward and
    ``full_tensor()`` see. Bind while sharded (after forward with the default reshard, or
    ``module.reshard()``), and bind again after ``load_state_dict(assign=True)`` / ``to_empty``,
    which give FSDP2 new storage.
    """

    def __init__(self, module: torch.nn.Module, spec: ModelSpec | None = None):
        DTensor = _dtensor_type()
        spec = spec or hf_module_spec(module)
        self.module = module
        live = module_tensors(module)
        params = [t for t in live.values() if isinstance(t, DTensor)]
        if not params:
            raise ConfigError(
                "fsdp: no DTensor parameter: fully_shard was not applied, or the module is unsharded "
                "(call module.reshard() before binding)"
            )
        mesh, dp_dim, tp_dim = fsdp_mesh_dims(params)
        coord = mesh.get_coordinate()
        if coord is None:
            raise ConfigError(f"fsdp: this process is not in the parameters' device mesh {mesh}")
        dp = mesh.size(dp_dim)
        tp = 1 if tp_dim is None else mesh.size(tp_dim)
        fp32 = fp32_master(spec, live.values())
        engine = FSDPLayout(spec, dp=dp, tp=tp, fp32=fp32, **live_fp32_keys(spec, live, fp32))
        rank = engine.mesh.rank({"dp": coord[dp_dim], "tp": 0 if tp_dim is None else coord[tp_dim]})
        local = {n: (t._local_tensor if isinstance(t, DTensor) else t) for n, t in live.items()}
        self.mesh = mesh
        self.bound = bind(engine, rank, local, where=f"{engine.describe()} rank {rank} ({spec.name})")


# --------------------------------------------------------------------------------------------
# Megatron-core

_GROUPED = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight\d+$")
_TE_MODULES = ("megatron.core.extensions.transformer_engine", "transformer_engine")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Strip Megatron's ``DistributedDataParallel`` / ``Float16Module`` (and torch DDP): each keeps the model in ``.module``."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def _vocab_multiple(spec: ModelSpec, padded: int, tp: int) -> int:
    """A ``vocab_multiple`` that reproduces the model's padded vocab: Megatron's default 128 when it
    does, else ``padded / tp`` (any value giving the same padded size derives the same layout)."""
    if pad_to(spec.vocab_size, 128 * tp) == padded or padded % tp or padded < spec.vocab_size:
        return 128  # a padded vocab no multiple explains is left for check_live to report by shape
    return padded // tp


class MegatronTrainEngine(LiveEngine):
    """megatron-core GPTModel chunks of this rank: layout ``megatron``.

    A GPTModel carries no HF config, so the model is named by ``config`` (a ModelSpec, a config dict
    or a ``config.json`` path). Parallel sizes and this rank's coordinates come from
    ``megatron.core.parallel_state``; uneven first/last stages from the TransformerConfig; TE and TE
    grouped experts from the modules; the padded vocab from ``GPTModel.vocab_size``. The layout rank
    is this process's place in the layout's dense mesh (tp, dp, pp), and its expert-mesh coordinates
    are checked against parallel_state too, so a different rank order fails here, not as garbage.

    Routers' ``expert_bias`` is switched to fp32 first, as megatron-core does on every forward and
    state_dict (``_maintain_float32_expert_bias``): binding the bf16 buffer Float16Module leaves
    would fail the dtype check.
    """

    def __init__(
        self,
        model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
        config: ModelSpec | Mapping[str, Any] | str | Path,
    ):
        from megatron.core import parallel_state as ps

        chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
        chunks = [unwrap(c) for c in chunks]
        spec = as_spec(config)
        tp = ps.get_tensor_model_parallel_world_size()
        pp = ps.get_pipeline_model_parallel_world_size()
        vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
        dp = ps.get_data_parallel_world_size(with_context_parallel=False)
        ep = ps.get_expert_model_parallel_world_size()
        etp = ps.get_expert_tensor_parallel_world_size()
        if ps.get_context_parallel_world_size() != 1:
            raise ConfigError("megatron: context parallelism (cp>1) is not modelled by the megatron layout")
        if len(chunks) != vpp:
            raise ConfigError(f"megatron: {len(chunks)} model chunks given, parallel_state says vpp={vpp}")
        tcfg = getattr(chunks[0], "config", None)
        if tcfg is not None and (
            getattr(tcfg, "pipeline_model_parallel_layout", None) is not None
            or getattr(tcfg, "account_for_embedding_in_pipeline_split", False)
            or getattr(tcfg, "account_for_loss_in_pipeline_split", False)
        ):
            raise ConfigError(
                "megatron: pipeline_model_parallel_layout / account_for_*_in_pipeline_split are not modelled"
            )
        pp_first = int(getattr(tcfg, "num_layers_in_first_pipeline_stage", None) or 0)
        pp_last = int(getattr(tcfg, "num_layers_in_last_pipeline_stage", None) or 0)
        names = [n for c in chunks for n, _ in c.named_parameters()]
        te = any(type(m).__module__.startswith(_TE_MODULES) for c in chunks for m in c.modules()) or any(
            n.endswith(".layer_norm_weight") for n in names
        )
        grouped = te and any(_GROUPED.search(n) for n in names)
        padded = getattr(chunks[0], "vocab_size", None)
        vocab_multiple = 128 if padded is None else _vocab_multiple(spec, int(padded), tp)

        for c in chunks:  # megatron-core's own fp32 switch of router expert_bias (see class docstring)
            for m in c.modules():
                if hasattr(m, "_maintain_float32_expert_bias"):
                    m._maintain_float32_expert_bias()

        engine = MegatronLayout(
            spec, tp=tp, pp=pp, vpp=vpp, dp=dp, ep=ep, etp=etp, pp_first=pp_first, pp_last=pp_last,
            te=int(te), grouped=int(grouped), vocab_multiple=vocab_multiple,
        )
        coords = dict(
            tp=ps.get_tensor_model_parallel_rank(),
            dp=ps.get_data_parallel_rank(with_context_parallel=False),
            pp=ps.get_pipeline_model_parallel_rank(),
        )
        rank = engine.dense.rank(coords)
        want = engine.expert.coords(rank)
        got = dict(
            etp=ps.get_expert_tensor_parallel_rank(), ep=ps.get_expert_model_parallel_rank(),
            edp=ps.get_expert_data_parallel_rank(), pp=coords["pp"],
        )
        if got != want:
            raise ConfigError(
                f"megatron: parallel_state's expert coordinates {got} differ from the layout's {want} for dense "
                f"coordinates {coords}: a rank order other than megatron-core's default 'tp-cp-ep-dp-pp'?"
            )
        live: dict[str, torch.Tensor] = {}
        for i, c in enumerate(chunks):
            live.update(module_tensors(c, prefix=f"{i}." if vpp > 1 else ""))
        self.chunks = chunks
        self.coords = coords
        self.bound = bind(engine, rank, live, where=f"{engine.describe()} rank {rank} {coords} ({spec.name})")


__all__ = ["HFTrainEngine", "FSDPTrainEngine", "MegatronTrainEngine", "unwrap", "fsdp_mesh_dims"]
