"""Building blocks the architecture modules share: config readers and the HF decoder's tensor list.

Every architecture supported so far is a Hugging Face decoder named the Llama way
(``model.layers.{i}.self_attn.q_proj.weight``...), with GQA or MLA attention and dense, MoE or
shared-expert gated MLPs; :func:`decoder_tensors` lists such a checkpoint, giving each tensor its
:class:`~weightsync.spec.roles.Role`. An architecture named otherwise writes its own list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from weightsync.errors import SpecError
from weightsync.spec.records import Attention, Layer, TensorSpec
from weightsync.spec.roles import Kind, Role

if TYPE_CHECKING:  # pragma: no cover
    from weightsync.spec.model import ModelSpec

#: config keys :func:`gqa_attention` reads
GQA_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias")
#: config keys :func:`mla_attention` reads
MLA_KEYS = ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
#: config keys :func:`dense_layers` reads
DENSE_KEYS = ("intermediate_size",)


def gqa_attention(cfg: Mapping[str, Any], *, qkv_bias: bool = False, qk_norm: bool = False) -> Attention:
    """Grouped-query attention; ``qkv_bias`` also when the config says ``attention_bias``."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise SpecError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    return Attention(
        kind="gqa",
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        qkv_bias=qkv_bias or bool(cfg.get("attention_bias", False)),
        qk_norm=qk_norm,
    )


def mla_attention(cfg: Mapping[str, Any]) -> Attention:
    """DeepSeek's multi-head latent attention (q_lora_rank may be null: q_proj instead of q_a/q_b)."""
    heads = int(cfg["num_attention_heads"])
    return Attention(
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


def dense_layers(cfg: Mapping[str, Any]) -> tuple[Layer, ...]:
    inter = int(cfg["intermediate_size"])
    return tuple(Layer(i, False, inter) for i in range(int(cfg["num_hidden_layers"])))


def moe_layers(cfg: Mapping[str, Any], is_moe: Callable[[int], bool], moe: Callable[[int], Layer]) -> tuple[Layer, ...]:
    """Every decoder layer of a model that mixes dense and MoE layers: ``moe(i)`` where ``is_moe(i)`` (each
    architecture's own rule and expert sizes), else a dense layer of ``intermediate_size``."""
    inter = int(cfg["intermediate_size"])
    return tuple(moe(i) if is_moe(i) else Layer(i, False, inter) for i in range(int(cfg["num_hidden_layers"])))


def decoder_tensors(spec: ModelSpec) -> Iterator[TensorSpec]:
    """Every tensor of an HF decoder checkpoint named the Llama way, in checkpoint-module order."""
    H, dt, a = spec.hidden_size, spec.dtype, spec.attention

    def t(name: str, role: Role, *shape: int, dtype: str = dt) -> TensorSpec:
        return TensorSpec(name, tuple(shape), dtype, role)

    yield t("model.embed_tokens.weight", Role(Kind.EMBED), spec.vocab_size, H)
    for layer in spec.layers:
        i = layer.index
        p = f"model.layers.{i}."
        yield t(p + "input_layernorm.weight", Role(Kind.INPUT_NORM, i), H)
        a_ = p + "self_attn."
        if a.kind == "mla":
            qk = a.qk_nope_head_dim + a.qk_rope_head_dim
            if a.q_lora_rank:
                yield t(a_ + "q_a_proj.weight", Role(Kind.Q_A, i), a.q_lora_rank, H)
                yield t(a_ + "q_a_layernorm.weight", Role(Kind.Q_A_NORM, i), a.q_lora_rank)
                yield t(a_ + "q_b_proj.weight", Role(Kind.Q_B, i), a.num_heads * qk, a.q_lora_rank)
            else:
                yield t(a_ + "q_proj.weight", Role(Kind.Q, i), a.num_heads * qk, H)
            yield t(a_ + "kv_a_proj_with_mqa.weight", Role(Kind.KV_A, i), a.kv_lora_rank + a.qk_rope_head_dim, H)
            yield t(a_ + "kv_a_layernorm.weight", Role(Kind.KV_A_NORM, i), a.kv_lora_rank)
            yield t(a_ + "kv_b_proj.weight", Role(Kind.KV_B, i), a.num_heads * (a.qk_nope_head_dim + a.v_head_dim),
                    a.kv_lora_rank)
            yield t(a_ + "o_proj.weight", Role(Kind.O, i), H, a.num_heads * a.v_head_dim)
        else:
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            yield t(a_ + "q_proj.weight", Role(Kind.Q, i), q, H)
            yield t(a_ + "k_proj.weight", Role(Kind.K, i), kv, H)
            yield t(a_ + "v_proj.weight", Role(Kind.V, i), kv, H)
            if a.qkv_bias:
                yield t(a_ + "q_proj.bias", Role(Kind.Q, i, bias=True), q)
                yield t(a_ + "k_proj.bias", Role(Kind.K, i, bias=True), kv)
                yield t(a_ + "v_proj.bias", Role(Kind.V, i, bias=True), kv)
            yield t(a_ + "o_proj.weight", Role(Kind.O, i), H, q)
            if a.qk_norm:
                yield t(a_ + "q_norm.weight", Role(Kind.Q_NORM, i), a.head_dim)
                yield t(a_ + "k_norm.weight", Role(Kind.K_NORM, i), a.head_dim)
        yield t(p + "post_attention_layernorm.weight", Role(Kind.POST_ATTN_NORM, i), H)
        if not layer.moe:
            yield from gated_mlp(t, p + "mlp.", Role(Kind.GATE, i), layer.intermediate_size, H)
            continue
        yield t(p + "mlp.gate.weight", Role(Kind.ROUTER, i), layer.num_experts, H)
        if layer.router_bias:
            # fp32 in the published DeepSeek-V3 checkpoint, whatever the model dtype
            yield t(p + "mlp.gate.e_score_correction_bias", Role(Kind.ROUTER_BIAS, i), layer.num_experts, dtype="float32")
        for e in range(layer.num_experts):
            yield from gated_mlp(t, f"{p}mlp.experts.{e}.", Role(Kind.GATE, i, expert=e), layer.intermediate_size, H)
        if layer.shared_intermediate_size:
            yield from gated_mlp(t, p + "mlp.shared_experts.", Role(Kind.GATE, i, shared=True),
                                 layer.shared_intermediate_size, H)
    yield t("model.norm.weight", Role(Kind.FINAL_NORM), H)
    if not spec.tie_word_embeddings:
        yield t("lm_head.weight", Role(Kind.LM_HEAD), spec.vocab_size, H)


def gated_mlp(t, prefix: str, role: Role, inter: int, hidden: int) -> Iterator[TensorSpec]:
    """gate_proj, up_proj [inter, hidden] and down_proj [hidden, inter] under ``prefix``, roles like ``role``."""
    yield t(prefix + "gate_proj.weight", role.sibling(Kind.GATE), inter, hidden)
    yield t(prefix + "up_proj.weight", role.sibling(Kind.UP), inter, hidden)
    yield t(prefix + "down_proj.weight", role.sibling(Kind.DOWN), hidden, inter)


__all__ = ["DENSE_KEYS", "GQA_KEYS", "MLA_KEYS", "decoder_tensors", "dense_layers", "gated_mlp", "gqa_attention",
           "mla_attention"]
