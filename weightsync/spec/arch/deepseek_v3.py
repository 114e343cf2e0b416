"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, transformers models/deepseek_v3/modeling_deepseek_v3.py).

MLA attention; the first ``first_k_dense_replace`` layers dense, then (every ``moe_layer_freq``)
MoE layers with ``n_routed_experts`` experts, ``n_shared_experts`` shared ones fused into one MLP
(``mlp.shared_experts``) and, with ``topk_method="noaux_tc"``, the fp32 ``e_score_correction_bias``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightsync.spec.architecture import Architecture
from weightsync.spec.blocks import DENSE_KEYS, MLA_KEYS, decoder_tensors, mla_attention, moe_layers
from weightsync.spec.records import Layer
from weightsync.spec.roles import Kind


def layers(cfg: Mapping[str, Any]) -> tuple[Layer, ...]:
    experts = int(cfg.get("n_routed_experts") or 0)
    first_dense = int(cfg.get("first_k_dense_replace", 0))
    freq = int(cfg.get("moe_layer_freq", 1))
    moe_inter = int(cfg.get("moe_intermediate_size", 0))
    n_shared = int(cfg.get("n_shared_experts") or 0)
    router_bias = cfg.get("topk_method") == "noaux_tc"
    return moe_layers(cfg, lambda i: experts > 0 and i >= first_dense and i % freq == 0,
                      lambda i: Layer(i, True, moe_inter, experts, n_shared * moe_inter, router_bias, n_shared))


ARCH = Architecture(
    name="DeepseekV3ForCausalLM",
    config_keys=MLA_KEYS + DENSE_KEYS + (
        "n_routed_experts", "first_k_dense_replace", "moe_layer_freq", "moe_intermediate_size", "n_shared_experts",
        "topk_method",
    ),
    attention=mla_attention,
    layers=layers,
    tensors=decoder_tensors,
    # transformers 5.24 keeps both in fp32 (_keep_in_fp32_modules_strict); 5.19-5.23 only the bias
    hf_fp32={
        Kind.ROUTER: "model.layers.{layer}.mlp.gate.weight",
        Kind.ROUTER_BIAS: "model.layers.{layer}.mlp.gate.e_score_correction_bias",
    },
    hf_buffers=frozenset({Kind.ROUTER_BIAS}),  # e_score_correction_bias is an nn.Buffer in transformers 5
    sglang_fuse_shared=True,  # the default on NVIDIA GPUs (--disable-shared-experts-fusion turns it off)
)
