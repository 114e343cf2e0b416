"""Model specs: every canonical tensor of a model, derived from its HF ``config.json`` alone.

A canonical tensor is a tensor as named and shaped in the model's Hugging Face checkpoint
(safetensors on disk): per-expert MoE weights, unfused q/k/v and gate/up. Engine layouts map their
local tensors onto these, so the spec is the one vocabulary both sides of a sync share.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

from weightsync.dtypes import DTYPE_SIZES, itemsize
from weightsync.errors import SpecError

PRESET_DIR = Path(__file__).parent / "presets"


@dataclass(frozen=True)
class TensorSpec:
    """One canonical tensor: checkpoint name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

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
    shared_intermediate_size: int = 0  # DeepSeek shared experts (0 when none)
    router_bias: bool = False  # DeepSeek-V3 e_score_correction_bias


@dataclass(frozen=True)
class ModelSpec:
    """The canonical tensors of a model plus the structure engines shard by."""

    name: str
    architecture: str
    config: Mapping[str, Any] = field(repr=False, compare=False)
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: str
    attention: Attention
    layers: tuple[Layer, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return tuple(_canonical_tensors(self))

    @cached_property
    def by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    def tensor(self, name: str) -> TensorSpec:
        try:
            return self.by_name[name]
        except KeyError:
            raise SpecError(f"{self.name}: no canonical tensor named {name!r}") from None

    @property
    def num_parameters(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def is_moe(self) -> bool:
        return any(layer.moe for layer in self.layers)

    @cached_property
    def digest(self) -> str:
        """A short fingerprint of every canonical name, shape and dtype."""
        import hashlib

        h = hashlib.blake2b(digest_size=8)
        for t in self.tensors:
            h.update(f"{t.name}:{t.shape}:{t.dtype};".encode())
        return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Building a spec from config.json


def _dense_or_moe_layers(cfg: Mapping[str, Any], arch: str) -> tuple[Layer, ...]:
    n = int(cfg["num_hidden_layers"])
    inter = int(cfg["intermediate_size"])
    if arch == "Qwen3MoeForCausalLM" or arch == "Qwen2MoeForCausalLM":
        # transformers 5 keeps Qwen3-MoE's num_experts as num_local_experts in memory (attribute_map)
        experts = int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])
        step = int(cfg.get("decoder_sparse_step", 1))
        dense_only = set(cfg.get("mlp_only_layers") or [])
        moe_inter = int(cfg["moe_intermediate_size"])
        if arch == "Qwen2MoeForCausalLM":
            raise SpecError("Qwen2-MoE (shared expert gate) is not supported yet")
        return tuple(
            Layer(i, True, moe_inter, experts)
            if (i not in dense_only and experts > 0 and (i + 1) % step == 0)
            else Layer(i, False, inter)
            for i in range(n)
        )
    if arch == "DeepseekV3ForCausalLM" or arch == "DeepseekV2ForCausalLM":
        experts = int(cfg.get("n_routed_experts") or 0)
        first_dense = int(cfg.get("first_k_dense_replace", 0))
        freq = int(cfg.get("moe_layer_freq", 1))
        moe_inter = int(cfg.get("moe_intermediate_size", 0))
        shared = int(cfg.get("n_shared_experts") or 0) * moe_inter
        router_bias = cfg.get("topk_method") == "noaux_tc"
        return tuple(
            Layer(i, True, moe_inter, experts, shared, router_bias)
            if (experts > 0 and i >= first_dense and i % freq == 0)
            else Layer(i, False, inter)
            for i in range(n)
        )
    return tuple(Layer(i, False, inter) for i in range(n))


SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM",
)


def spec_from_config(config: Mapping[str, Any] | str | Path, name: str | None = None) -> ModelSpec:
    """Build a ModelSpec from a config.json path or an already-parsed dict."""
    if not isinstance(config, Mapping):
        path = Path(config)
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise SpecError(f"no such config file: {path}") from None
        except json.JSONDecodeError as e:
            raise SpecError(f"{path} is not valid JSON: {e}") from None
        name = name or path.stem
    else:
        cfg = dict(config)
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SpecError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}. "
            "To add one, list its canonical tensors in weightsync/spec/model.py "
            "(_canonical_tensors) and teach each engine layout in weightsync/engines/ its names"
        )
    try:
        return _build(cfg, arch, name or cfg.get("model_type", arch))
    except KeyError as e:
        raise SpecError(f"config for {arch} lacks required key {e.args[0]!r}") from None


def _build(cfg: Mapping[str, Any], arch: str, name: str) -> ModelSpec:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    itemsize(dtype)  # SpecError naming the supported dtypes
    if arch == "DeepseekV3ForCausalLM":
        attn = Attention(
            kind="mla",
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]),
            q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
        )
    else:
        attn = Attention(
            kind="gqa",
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        )
        if arch == "LlamaForCausalLM" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
            raise SpecError("Llama with attention_bias or mlp_bias (o_proj/MLP biases) is not supported yet")
        if heads % kv_heads:
            raise SpecError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    return ModelSpec(
        name=name,
        architecture=arch,
        config=cfg,
        hidden_size=hidden,
        vocab_size=int(cfg["vocab_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=dtype,
        attention=attn,
        layers=_dense_or_moe_layers(cfg, arch),
    )


def _canonical_tensors(spec: ModelSpec):
    """Yield every tensor of the HF checkpoint, in checkpoint-module order."""
    H, dt, a = spec.hidden_size, spec.dtype, spec.attention

    def t(name: str, *shape: int, dtype: str = dt) -> TensorSpec:
        return TensorSpec(name, tuple(shape), dtype)

    yield t("model.embed_tokens.weight", spec.vocab_size, H)
    for layer in spec.layers:
        p = f"model.layers.{layer.index}."
        yield t(p + "input_layernorm.weight", H)
        if a.kind == "mla":
            qk = a.qk_nope_head_dim + a.qk_rope_head_dim
            if a.q_lora_rank:
                yield t(p + "self_attn.q_a_proj.weight", a.q_lora_rank, H)
                yield t(p + "self_attn.q_a_layernorm.weight", a.q_lora_rank)
                yield t(p + "self_attn.q_b_proj.weight", a.num_heads * qk, a.q_lora_rank)
            else:
                yield t(p + "self_attn.q_proj.weight", a.num_heads * qk, H)
            yield t(p + "self_attn.kv_a_proj_with_mqa.weight", a.kv_lora_rank + a.qk_rope_head_dim, H)
            yield t(p + "self_attn.kv_a_layernorm.weight", a.kv_lora_rank)
            yield t(
                p + "self_attn.kv_b_proj.weight",
                a.num_heads * (a.qk_nope_head_dim + a.v_head_dim),
                a.kv_lora_rank,
            )
            yield t(p + "self_attn.o_proj.weight", H, a.num_heads * a.v_head_dim)
        else:
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            yield t(p + "self_attn.q_proj.weight", q, H)
            yield t(p + "self_attn.k_proj.weight", kv, H)
            yield t(p + "self_attn.v_proj.weight", kv, H)
            if a.qkv_bias:
                yield t(p + "self_attn.q_proj.bias", q)
                yield t(p + "self_attn.k_proj.bias", kv)
                yield t(p + "self_attn.v_proj.bias", kv)
            yield t(p + "self_attn.o_proj.weight", H, q)
            if a.qk_norm:
                yield t(p + "self_attn.q_norm.weight", a.head_dim)
                yield t(p + "self_attn.k_norm.weight", a.head_dim)
        yield t(p + "post_attention_layernorm.weight", H)
        I = layer.intermediate_size
        if not layer.moe:
            yield t(p + "mlp.gate_proj.weight", I, H)
            yield t(p + "mlp.up_proj.weight", I, H)
            yield t(p + "mlp.down_proj.weight", H, I)
            continue
        yield t(p + "mlp.gate.weight", layer.num_experts, H)
        if layer.router_bias:
            # fp32 in the published DeepSeek-V3 checkpoint, whatever the model dtype
            yield t(p + "mlp.gate.e_score_correction_bias", layer.num_experts, dtype="float32")
        for e in range(layer.num_experts):
            yield t(p + f"mlp.experts.{e}.gate_proj.weight", I, H)
            yield t(p + f"mlp.experts.{e}.up_proj.weight", I, H)
            yield t(p + f"mlp.experts.{e}.down_proj.weight", H, I)
        if layer.shared_intermediate_size:
            S = layer.shared_intermediate_size
            yield t(p + "mlp.shared_experts.gate_proj.weight", S, H)
            yield t(p + "mlp.shared_experts.up_proj.weight", S, H)
            yield t(p + "mlp.shared_experts.down_proj.weight", H, S)
    yield t("model.norm.weight", H)
    if not spec.tie_word_embeddings:
        yield t("lm_head.weight", spec.vocab_size, H)


# --------------------------------------------------------------------------------------------
# Presets


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_spec(model: str | Path | Mapping[str, Any]) -> ModelSpec:
    """A preset name, a config.json path, or a config dict."""
    if isinstance(model, Mapping):
        return spec_from_config(model)
    preset = PRESET_DIR / f"{model}.json"
    if isinstance(model, str) and preset.exists():
        return spec_from_config(preset, name=model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.exists():
        return spec_from_config(path)
    raise SpecError(f"unknown model {str(model)!r}: not a preset ({', '.join(preset_names())}) nor a config.json path")
