"""Qwen3-MoE (``Qwen3MoeForCausalLM``, transformers models/qwen3_moe/modeling_qwen3_moe.py).

Qwen3 attention (q/k norms); a layer is MoE unless listed in ``mlp_only_layers`` or off the
``decoder_sparse_step`` grid, with ``num_experts`` routed experts of width ``moe_intermediate_size``
and a router ``mlp.gate``; no shared expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightsync.spec.architecture import Architecture
from weightsync.spec.blocks import DENSE_KEYS, GQA_KEYS, decoder_tensors, gqa_attention, moe_layers
from weightsync.spec.records import Attention, Layer


def attention(cfg: Mapping[str, Any]) -> Attention:
    return gqa_attention(cfg, qk_norm=True)


def layers(cfg: Mapping[str, Any]) -> tuple[Layer, ...]:
    # transformers 5 keeps Qwen3-MoE's num_experts as num_local_experts in memory (attribute_map)
    experts = int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])
    step = int(cfg.get("decoder_sparse_step", 1))
    dense_only = set(cfg.get("mlp_only_layers") or [])
    moe_inter = int(cfg["moe_intermediate_size"])
    return moe_layers(cfg, lambda i: i not in dense_only and experts > 0 and (i + 1) % step == 0,
                      lambda i: Layer(i, True, moe_inter, experts))


ARCH = Architecture(
    name="Qwen3MoeForCausalLM",
    config_keys=GQA_KEYS + DENSE_KEYS + (
        "num_experts", "num_local_experts", "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size",
    ),
    attention=attention,
    layers=layers,
    tensors=decoder_tensors,
    sglang_all_moe=True,  # SGLang's qwen3_moe.py builds every layer as MoE
)
