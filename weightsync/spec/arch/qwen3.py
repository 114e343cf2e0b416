"""Qwen3 (``Qwen3ForCausalLM``, transformers models/qwen3/modeling_qwen3.py): GQA with per-head q/k norms, dense MLPs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightsync.spec.architecture import Architecture
from weightsync.spec.blocks import DENSE_KEYS, GQA_KEYS, decoder_tensors, dense_layers, gqa_attention
from weightsync.spec.records import Attention


def attention(cfg: Mapping[str, Any]) -> Attention:
    return gqa_attention(cfg, qk_norm=True)


ARCH = Architecture(
    name="Qwen3ForCausalLM",
    config_keys=GQA_KEYS + DENSE_KEYS,
    attention=attention,
    layers=dense_layers,
    tensors=decoder_tensors,
)
