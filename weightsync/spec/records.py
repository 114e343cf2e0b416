"""The records a model spec is made of: canonical tensors with their roles, attention and layer shapes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from weightsync.dtypes import DTYPE_SIZES
from weightsync.spec.roles import Role


@dataclass(frozen=True)
class TensorSpec:
    """One canonical tensor: checkpoint name, shape, dtype and its role in the model."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: Role

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class Attention:
    """Attention hyper-parameters an engine needs to shard and fuse q/k/v."""

    kind: str  # "gqa" or "mla"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    qk_norm: bool = False
    # MLA only
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


@dataclass(frozen=True)
class Layer:
    """One decoder layer: its MLP kind and sizes."""

    index: int
    moe: bool
    intermediate_size: int  # dense MLP width, or per-expert width for MoE layers
    num_experts: int = 0
    shared_intermediate_size: int = 0  # DeepSeek shared experts, all of them together (0 when none)
    router_bias: bool = False  # DeepSeek-V3 e_score_correction_bias
    shared_experts: int = 0  # how many shared experts shared_intermediate_size holds


__all__ = ["Attention", "Layer", "TensorSpec"]
