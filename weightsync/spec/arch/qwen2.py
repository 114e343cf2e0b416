"""Qwen2 (``Qwen2ForCausalLM``, transformers models/qwen2/modeling_qwen2.py): GQA with q/k/v biases, dense MLPs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightsync.spec.architecture import Architecture
from weightsync.spec.blocks import DENSE_KEYS, GQA_KEYS, decoder_tensors, dense_layers, gqa_attention
from weightsync.spec.records import Attention


def attention(cfg: Mapping[str, Any]) -> Attention:
    return gqa_attention(cfg, qkv_bias=True)  # q/k/v_proj always carry a bias in Qwen2, o_proj none


ARCH = Architecture(
    name="Qwen2ForCausalLM",
    config_keys=GQA_KEYS + DENSE_KEYS,
    attention=attention,
    layers=dense_layers,
    tensors=decoder_tensors,
    sglang_dp_attention=False,  # SGLang's qwen2.py has no DP-attention code
)
