"""Llama 3 (``LlamaForCausalLM``, transformers models/llama/modeling_llama.py): GQA, dense gated MLPs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightsync.errors import SpecError
from weightsync.spec.architecture import Architecture
from weightsync.spec.blocks import DENSE_KEYS, GQA_KEYS, decoder_tensors, dense_layers, gqa_attention
from weightsync.spec.records import Attention


def attention(cfg: Mapping[str, Any]) -> Attention:
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise SpecError("Llama with attention_bias or mlp_bias (o_proj/MLP biases) is not supported yet")
    return gqa_attention(cfg)


ARCH = Architecture(
    name="LlamaForCausalLM",
    config_keys=GQA_KEYS + DENSE_KEYS + ("mlp_bias",),
    attention=attention,
    layers=dense_layers,
    tensors=decoder_tensors,
    sglang_dp_attention=False,  # SGLang's llama.py has no DP-attention code
)
