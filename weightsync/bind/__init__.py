"""Bindings from LIVE engine objects to the pure engine layouts.

A layout (:mod:`weightsync.layout`) says, from a model config and a parallel config alone, which
regions of which canonical tensors each rank's local tensors hold. A *binding* closes the gap to a
running engine: it reads the parallel config and this process's rank from the live objects
themselves (a transformers module, FSDP2 DTensors, megatron-core ``parallel_state``), derives the
layout, checks it against the live tensors with :func:`check_live` -- so a wrong rule or a wrong
model fails loudly, naming the tensor, shape and rank, before any byte moves -- and hands back the
live storage of every local tensor under the layout's names. Writing into those tensors in place
(under ``torch.no_grad()``) is writing into the model.

Engines live in :mod:`weightsync.bind.train` (``HFTrainEngine``, ``FSDPTrainEngine``,
``MegatronTrainEngine``) and :mod:`weightsync.bind.infer` (``HFInferenceEngine``); they are imported
lazily so a user of one never imports another's framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from weightsync.dtypes import dtype_name
from weightsync.layout.layout import EngineLayout, Layout, check_live
from weightsync.lazy_exports import lazy_exports
from weightsync.spec.model import ModelSpec, spec_from_config


@dataclass
class Bound:
    """One rank's live tensors bound to its derived layout.

    ``tensors`` holds, for every local tensor of ``layout`` (same names), the live object whose
    storage the model reads: a parameter / persistent buffer itself, or for FSDP2 the DTensor's local
    shard. They are the objects, not ``.data`` snapshots, so an engine that later swaps a tensor's
    ``.data`` (Megatron's router does for ``expert_bias``) still sees writes made through them.
    Write in place and under ``torch.no_grad()``; never rebind entries.
    """

    engine: EngineLayout
    rank: int
    layout: Layout
    tensors: dict[str, torch.Tensor]

    @property
    def spec(self) -> ModelSpec:
        return self.engine.spec


def module_tensors(module: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Parameters (tied ones once, as ``named_parameters`` gives them) plus *persistent* buffers.

    That is exactly what a checkpoint round-trips, so it is what a layout must account for:
    DeepSeek-V3's ``e_score_correction_bias`` and Megatron's ``router.expert_bias`` are persistent
    buffers, rotary ``inv_freq`` tables are not. Found without calling ``state_dict()`` because
    engines hang hooks on it.
    """
    out = {prefix + n: p for n, p in module.named_parameters()}
    persistent = set()
    for mod_name, mod in module.named_modules():
        for b in mod._buffers:
            if b not in mod._non_persistent_buffers_set:
                persistent.add(f"{mod_name}.{b}" if mod_name else b)
    for n, b in module.named_buffers():
        if n in persistent and b is not None:
            out[prefix + n] = b
    return out


def hf_config_dict(config: Any) -> dict[str, Any]:
    """A transformers config as the ``config.json`` dict :func:`spec_from_config` expects.

    transformers 5 normalises some keys in memory (Qwen3-MoE's ``num_experts`` is stored as
    ``num_local_experts``; ``attribute_map`` lists such aliases), so ``to_dict()`` can lack the
    checkpoint's key; the alias is added back from the stored value.
    """
    d = config.to_dict()
    for alias, real in (getattr(config, "attribute_map", None) or {}).items():
        if alias not in d and real in d:
            d[alias] = d[real]
    return d


def as_spec(config: ModelSpec | Mapping[str, Any] | str | Any) -> ModelSpec:
    """A ModelSpec from a spec, a config dict, a ``config.json`` path or a transformers config object."""
    if isinstance(config, ModelSpec):
        return config
    if hasattr(config, "to_dict") and not isinstance(config, Mapping):
        return spec_from_config(hf_config_dict(config))
    return spec_from_config(config)


def hf_module_config(module: torch.nn.Module) -> dict[str, Any]:
    """``module.config`` as a config.json dict, with its ``architectures``.

    A model built with ``from_config`` has no ``architectures`` in its config (only checkpoints
    record it), so the architecture falls back to the module's class -- searched along the MRO
    because FSDP2's ``fully_shard`` swaps in a subclass named ``FSDP<Class>``.
    """
    from weightsync.spec.arch import known_class

    cfg = hf_config_dict(module.config)
    if not cfg.get("architectures"):
        names = [c.__name__ for c in type(module).__mro__]
        cfg["architectures"] = [known_class(names) or names[0]]
    return cfg


def hf_module_spec(module: torch.nn.Module) -> ModelSpec:
    """The spec of a transformers model, from ``module.config`` (:func:`hf_module_config`)."""
    return spec_from_config(hf_module_config(module))


def live_fp32_keys(spec: ModelSpec, live: Mapping[str, torch.Tensor], fp32: int = 0) -> dict[str, int]:
    """The hf/fsdp layouts' ``fp32_*`` keys as the live module holds its tensors.

    Which tensors transformers keeps in fp32 depends on its version and on how the model was made
    (``from_pretrained`` applies ``_keep_in_fp32_modules_strict``; ``from_config`` in 5.19 leaves
    DeepSeek-V3's router bias in bf16), so a binding reads the live dtype instead: 1 where every
    tensor of the kind is fp32, 0 where every one holds the model dtype. A kind in some other dtype
    is left to the layout's rule, for :func:`check_live` to report by name.
    """
    from weightsync.engines.hf import FP32_KEYS, HFLayout

    canonical = {t.name: t.role.kind for t in spec.tensors if t.role.kind in FP32_KEYS.values()}
    if not canonical:
        return {}
    ref = HFLayout(spec, fp32=fp32, **{k: 1 for k, kind in FP32_KEYS.items() if kind in set(canonical.values())})
    found: dict[str, set[str]] = {}
    for name, kind in canonical.items():
        for shard in ref.shards(name):
            t = live.get(shard.piece.tensor)
            if t is not None:
                found.setdefault(kind, set()).add(dtype_name(t.dtype))
    out: dict[str, int] = {}
    for key, kind in FP32_KEYS.items():
        dtypes = found.get(kind, set())
        if dtypes == {"float32"}:
            out[key] = 1
        elif dtypes == {spec.dtype}:
            out[key] = 0
    return out


def bind(engine: EngineLayout, rank: int, live: Mapping[str, torch.Tensor], where: str = "") -> Bound:
    """Derive ``rank``'s layout, check it against ``live`` (raising :class:`LayoutMismatch`), bind.

    The check runs first and compares every name, shape and dtype, so nothing is returned -- and no
    caller can write -- unless the live engine is exactly what the layout claims. Live tensors
    absent from the layout are allowed only when empty (FSDP2's empty trailing shards hold nothing).
    """
    layout = engine.layout(rank)
    where = where or f"{engine.describe()} rank {rank} ({engine.spec.name})"
    check_live(layout, {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in live.items()}, where=where)
    return Bound(engine, rank, layout, {n: live[n] for n in layout.tensors})


class LiveEngine:
    """Base of the engine bindings: the constructor binds (and checks) once; the rest reads ``bound``."""

    bound: Bound

    @property
    def engine(self) -> EngineLayout:
        return self.bound.engine

    @property
    def rank(self) -> int:
        return self.bound.rank

    @property
    def layout(self) -> Layout:
        return self.bound.layout

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.bound.tensors

    @property
    def spec(self) -> ModelSpec:
        return self.bound.spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.engine.describe()}, rank={self.rank}, {len(self.tensors)} tensors)"


_LAZY = {
    "HFTrainEngine": "weightsync.bind.train",
    "FSDPTrainEngine": "weightsync.bind.train",
    "MegatronTrainEngine": "weightsync.bind.train",
    "HFInferenceEngine": "weightsync.bind.infer",
}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = ["Bound", "LiveEngine", "bind", "live_fp32_keys", "module_tensors", "hf_config_dict", "as_spec", "hf_module_spec", "dtype_name", *_LAZY]
