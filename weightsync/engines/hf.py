"""``hf``: one rank holding a transformers 5.x model as it is built in memory.

transformers 5 keeps MoE experts stacked in memory (``mlp.experts.gate_up_proj`` [E, 2I, H] with
gate rows first, ``mlp.experts.down_proj`` [E, H, I]) while checkpoints keep per-expert tensors
(transformers/models/qwen3_moe/modeling_qwen3_moe.py, Qwen3MoeExperts: ``.chunk(2, dim=-1)`` gives
gate then up). Tied embeddings appear once, as ``model.embed_tokens.weight``.

What transformers keeps in fp32 beside a bf16 model (``_keep_in_fp32_modules_strict``) depends on
its version: DeepSeek-V3's ``e_score_correction_bias`` always, its router weight ``mlp.gate.weight``
from 5.24 on. The ``fp32_router``/``fp32_router_bias`` keys say it; ``-1`` (auto) is resolved from
the installed transformers when the layout is built (:func:`resolve_fp32_keys`) and the answer is
part of the layout's description, so another process rebuilds the same layout from it.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, TypeVar

from weightsync.engines.common import whole
from weightsync.engines.config import FSDPConfig, HFConfig
from weightsync.engines.hf_fp32 import kept_in_fp32
from weightsync.errors import ConfigError
from weightsync.layout.box import full_box
from weightsync.layout.layout import EngineLayout, Mesh, Piece, Shard
from weightsync.spec.model import ModelSpec
from weightsync.spec.roles import Kind


#: the config keys saying whether tensors of a kind are fp32 beside a lower-precision model
FP32_KEYS: dict[str, Kind] = {"fp32_router": Kind.ROUTER, "fp32_router_bias": Kind.ROUTER_BIAS}
#: the model dtypes transformers' ``_keep_in_fp32_modules_strict`` applies to
LOW_PRECISION = ("bfloat16", "float16")

C = TypeVar("C", HFConfig, FSDPConfig)


def resolve_fp32_keys(spec: ModelSpec, config: C) -> C:
    """``config`` with every ``fp32_*`` key resolved and made canonical, so equal layouts print equal.

    For a kind transformers may keep in fp32 (``spec.arch.hf_fp32``), present in the model: auto
    becomes what the installed transformers does (1 for every kind when everything is fp32 anyway);
    the key is then always printed. For any other kind auto stays, meaning the tensor's own dtype,
    and 1 (a trainer that keeps, say, Qwen3-MoE's router in fp32) is kept. A key for a kind the
    model lacks is refused when set to 1; 0 there, or a value that changes nothing, becomes auto.
    """
    all_fp32 = bool(config.fp32) or spec.dtype == "float32"
    present = {t.role.kind for t in spec.tensors}
    values: dict[str, int] = {}
    for name, kind in FP32_KEYS.items():
        v = getattr(config, name)
        if kind not in present:
            if v == 1:
                raise ConfigError(f"{config.engine}: {name}=1, but {spec.name} has no {kind.value} tensor; drop {name}")
            values[name] = -1
        elif all_fp32:
            if v == 0 and config.fp32:
                raise ConfigError(f"{config.engine}: fp32=1 keeps every tensor in fp32; {name}=0 contradicts it")
            values[name] = 1 if kind in spec.arch.hf_fp32 else -1
        elif kind in spec.arch.hf_fp32:
            if v == -1:
                v = int(spec.dtype in LOW_PRECISION and kept_in_fp32(spec, kind))
            values[name] = v
        else:
            values[name] = 1 if v == 1 else -1
    return dataclasses.replace(config, **values)


class HFLayout(EngineLayout):
    """``fp32=1``: the trainer keeps fp32 (master) weights of a bf16 model; they travel as fp32 and the
    receiver rounds them to its dtype, exactly as loading an fp32 checkpoint would. ``fp32_router``,
    ``fp32_router_bias``: see the module docstring."""

    engine = "hf"
    keys = HFConfig.keys()

    def __init__(self, spec: ModelSpec, config: HFConfig | None = None, **options: int):
        self.config = resolve_fp32_keys(spec, HFConfig.of(config, **options))
        self.mesh = Mesh("hf", [("rank", 1)])
        super().__init__(spec, [self.mesh])
        self._all = self.mesh.group()
        self.fp32 = bool(self.config.fp32)
        #: kind -> 1 (fp32) or 0 (the model dtype), for the kinds an ``fp32_*`` key decides
        self.fp32_kinds: dict[Kind, int] = {
            kind: v for name, kind in FP32_KEYS.items() if (v := getattr(self.config, name)) != -1
        }

    def _dtype(self, canonical: str) -> str:
        """The in-memory dtype: fp32 everywhere with ``fp32``; for a kind an ``fp32_*`` key decides,
        fp32 or the model dtype; else the tensor's own."""
        t = self.spec.tensor(canonical)
        if self.fp32:
            return "float32"
        decided = self.fp32_kinds.get(t.role.kind)
        if decided is not None:
            return "float32" if decided else self.spec.dtype
        return t.dtype

    def canonical_names(self, rank: int) -> Iterable[str]:
        return (t.name for t in self.spec.tensors)

    def _shards(self, canonical: str) -> Iterable[Shard]:
        spec = self.spec
        t = spec.tensor(canonical)
        role = t.role
        if role.routed:  # stacked: mlp.experts.gate_up_proj [E, 2I, H] (gate rows first), mlp.experts.down_proj [E, H, I]
            layer, e = role.layer, role.expert
            L = spec.layers[layer]
            prefix = f"model.layers.{layer}.mlp.experts."
            if role.kind == Kind.DOWN:
                shape = (L.num_experts,) + t.shape
                yield Shard(self._all, Piece(prefix + "down_proj", ((e, 1),) + full_box(t.shape), canonical, full_box(t.shape)), shape, self._dtype(canonical))
            else:
                I, H = t.shape
                row = 0 if role.kind == Kind.GATE else I
                shape = (L.num_experts, 2 * I, H)
                yield Shard(self._all, Piece(prefix + "gate_up_proj", ((e, 1), (row, I), (0, H)), canonical, full_box(t.shape)), shape, self._dtype(canonical))
            return
        yield whole(self._all, canonical, spec, canonical, self._dtype(canonical))
