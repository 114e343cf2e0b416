"""Architectures: each is one module under weightsync/spec/arch/, and engines place tensors by role alone.

Every architecture gets its own test below (its tensors' roles, what its record says about other
engines' model code); the shared tests check every registered architecture: roles unique and
consistent, the declared config keys all a spec needs, and -- the point of roles -- every engine
layout unchanged when every canonical tensor is renamed, so no engine reads a tensor's name.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from weightsync.engines import make_layout
from weightsync.errors import ConfigError, SpecError
from weightsync.layout.layout import Layout
from weightsync.spec import ARCHITECTURES, Architecture, Kind, Role, load_spec, preset_names, spec_from_config
from weightsync.spec.arch import architecture, config_keys, known_class
from weightsync.spec.blocks import decoder_tensors
from weightsync.spec.model import PRESET_DIR

TINY = {  # one tiny preset per architecture: adding an architecture adds one here
    "LlamaForCausalLM": "tiny-llama3",
    "Qwen2ForCausalLM": "tiny-qwen2",
    "Qwen3ForCausalLM": "tiny-qwen3",
    "Qwen3MoeForCausalLM": "tiny-qwen3-moe",
    "DeepseekV3ForCausalLM": "tiny-deepseek-v3",
}


def preset_config(name: str) -> dict:
    return json.loads((PRESET_DIR / f"{name}.json").read_text())


def test_every_architecture_has_a_module_and_a_tiny_preset():
    assert set(ARCHITECTURES) == set(TINY)
    for name, arch in ARCHITECTURES.items():
        assert arch.name == name and architecture(name) is arch
        assert load_spec(TINY[name]).arch is arch


@pytest.mark.parametrize("preset", preset_names())
def test_roles_are_unique_and_name_every_tensor(preset):
    spec = load_spec(preset)
    assert len(spec.by_role) == len(spec.tensors)
    for t in spec.tensors:
        assert spec.tensor_of(t.role) is t
        r = t.role
        assert (r.layer is None) == (r.kind in (Kind.EMBED, Kind.LM_HEAD, Kind.FINAL_NORM))
        if r.expert is not None:
            assert spec.layers[r.layer].moe and 0 <= r.expert < spec.layers[r.layer].num_experts
            assert r.kind in (Kind.GATE, Kind.UP, Kind.DOWN)
    assert sum(len(spec.layer_tensors(i)) for i in [None, *range(spec.num_layers)]) == len(spec.tensors)
    assert [t.role.layer for t in spec.layer_tensors(1)] == [1] * len(spec.layer_tensors(1))
    with pytest.raises(SpecError, match="no canonical tensor is layer 0 expert 999 gate"):
        spec.tensor_of(Role(Kind.GATE, 0, expert=999))


@pytest.mark.parametrize("preset", preset_names())
def test_declared_config_keys_are_all_a_spec_needs(preset):
    """A config cut down to what the architecture declares builds the same spec (the HF instance relies on it)."""
    cfg = preset_config(preset)
    spec = spec_from_config(cfg, name=preset)
    for keys in (spec.arch.keys, config_keys()):
        cut = spec_from_config({k: v for k, v in cfg.items() if k in keys}, name=preset)
        assert cut.digest == spec.digest and cut.layers == spec.layers and cut.attention == spec.attention
    assert set(spec.arch.keys) <= set(config_keys())


def test_reading_an_undeclared_key_is_refused():
    qwen3 = ARCHITECTURES["Qwen3ForCausalLM"]
    sloppy = dataclasses.replace(qwen3, name="SloppyForCausalLM", attention=lambda cfg: cfg["rope_theta"])
    with pytest.raises(SpecError, match="SloppyForCausalLM reads config key 'rope_theta' its Architecture does not declare"):
        sloppy.attention(sloppy.view(preset_config("tiny-qwen3")))
    view = qwen3.view({"hidden_size": 8, "rope_theta": 1.0})
    assert dict(view) == {"hidden_size": 8} and "num_attention_heads" not in view


def test_unknown_architecture_says_how_to_add_one():
    with pytest.raises(SpecError, match=r"unsupported architecture 'GPT2LMHeadModel'.*weightsync/spec/arch/"):
        load_spec({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8})
    assert known_class(["FSDPQwen3ForCausalLM", "Qwen3ForCausalLM", "Module"]) == "Qwen3ForCausalLM"
    assert known_class(["GPT2LMHeadModel", "Module"]) is None


# --------------------------------------------------------------------------------------------
# Engines read roles, never names: rename every canonical tensor and nothing else changes

ENGINE_CONFIGS = [
    "hf", "hf:fp32=1", "fsdp:dp=3", "fsdp:dp=2,tp=2", "megatron:tp=2,pp=2", "megatron:pp=2,vpp=2,te=1",
    "megatron:dp=2,ep=2,te=1,grouped=1", "megatron:tp=2,etp=2", "vllm:tp=2,dp=2", "vllm:tp=2,ep=2",
    "sglang:tp=4,ep=2", "sglang:tp=2,fuse_shared=0", "sglang:tp=4,dp=2,dp_attention=1,dp_lm_head=1",
]


def _renamed(arch: Architecture) -> Architecture:
    def tensors(spec):
        return (dataclasses.replace(t, name=f"w{i:04d}.{t.role.kind.value}") for i, t in enumerate(decoder_tensors(spec)))

    return dataclasses.replace(arch, name="Renamed" + arch.name, tensors=tensors)


def _same_modulo_names(got: Layout, want: Layout, names: dict[str, str]) -> None:
    """``got`` is ``want`` with canonical names mapped; a local name is either the engine's own (unchanged)
    or the canonical name (mapped): engines name some local tensors after the canonical tensor they hold."""
    assert len(got.tensors) == len(want.tensors)
    for (gn, g), (wn, w) in zip(got.tensors.items(), want.tensors.items()):
        assert gn in (wn, names.get(wn)), (gn, wn)
        assert (g.shape, g.dtype) == (w.shape, w.dtype), wn
        assert [(p.local_box, p.canonical, p.canon_box) for p in g.pieces] == [
            (p.local_box, names[p.canonical], p.canon_box) for p in w.pieces
        ], wn


@pytest.mark.parametrize("arch_name", sorted(TINY))
def test_engines_place_tensors_by_role_not_name(arch_name, monkeypatch):
    renamed = _renamed(ARCHITECTURES[arch_name])
    monkeypatch.setitem(ARCHITECTURES, renamed.name, renamed)
    cfg = preset_config(TINY[arch_name])
    spec = spec_from_config(cfg, name="original")
    other = spec_from_config({**cfg, "architectures": [renamed.name]}, name="renamed")
    names = {a.name: b.name for a, b in zip(spec.tensors, other.tensors)}
    assert all(a != b for a, b in names.items()) and [t.role for t in spec.tensors] == [t.role for t in other.tensors]
    built = 0
    for text in ENGINE_CONFIGS:
        try:
            want = make_layout(spec, text)
        except ConfigError:
            with pytest.raises(ConfigError):  # refused alike
                make_layout(other, text)
            continue
        got = make_layout(other, text)
        for r in range(want.world_size):
            assert list(got.canonical_names(r)) == [names[n] for n in want.canonical_names(r)]
            _same_modulo_names(got.layout(r), want.layout(r), names)
        built += 1
    assert built >= 8


# --------------------------------------------------------------------------------------------
# One test per architecture


def _roles(preset: str) -> dict[str, Role]:
    return {t.name: t.role for t in load_spec(preset).tensors}


def test_llama3():
    roles = _roles("tiny-llama3")
    assert roles["model.embed_tokens.weight"] == Role(Kind.EMBED)
    assert roles["model.layers.2.self_attn.k_proj.weight"] == Role(Kind.K, 2)
    assert roles["model.layers.4.mlp.down_proj.weight"] == Role(Kind.DOWN, 4) and Role(Kind.DOWN, 4).dense_mlp
    assert roles["model.norm.weight"] == Role(Kind.FINAL_NORM) and roles["lm_head.weight"] == Role(Kind.LM_HEAD)
    assert not any(r.bias or r.kind == Kind.Q_NORM for r in roles.values())
    assert not ARCHITECTURES["LlamaForCausalLM"].sglang_dp_attention
    with pytest.raises(SpecError, match="attention_bias or mlp_bias"):
        spec_from_config({**preset_config("tiny-llama3"), "mlp_bias": True})


def test_qwen2():
    spec = load_spec("tiny-qwen2")
    roles = {t.name: t.role for t in spec.tensors}
    assert roles["model.layers.0.self_attn.v_proj.bias"] == Role(Kind.V, 0, bias=True)
    assert spec.tensor_of(Role(Kind.Q, 3, bias=True)).shape == (spec.attention.num_heads * spec.attention.head_dim,)
    assert not any(r.kind == Kind.O and r.bias for r in roles.values())  # o_proj has no bias
    assert not ARCHITECTURES["Qwen2ForCausalLM"].sglang_dp_attention


def test_qwen3():
    roles = _roles("tiny-qwen3")
    assert roles["model.layers.1.self_attn.q_norm.weight"] == Role(Kind.Q_NORM, 1)
    assert roles["model.layers.1.self_attn.k_norm.weight"] == Role(Kind.K_NORM, 1)
    assert not any(r.bias for r in roles.values())
    assert "lm_head.weight" not in _roles("qwen3-0.6b")  # tied


def test_qwen3_moe():
    spec = load_spec("tiny-qwen3-moe")
    roles = {t.name: t.role for t in spec.tensors}
    assert roles["model.layers.0.mlp.gate.weight"] == Role(Kind.ROUTER, 0)
    assert roles["model.layers.3.mlp.experts.7.up_proj.weight"] == Role(Kind.UP, 3, expert=7)
    assert not any(r.shared or r.kind == Kind.ROUTER_BIAS for r in roles.values())
    assert ARCHITECTURES["Qwen3MoeForCausalLM"].sglang_all_moe
    # transformers 5 names the expert count num_local_experts in memory
    cfg = preset_config("tiny-qwen3-moe")
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert spec_from_config(cfg).digest == spec.digest
    step2 = spec_from_config({**preset_config("tiny-qwen3-moe"), "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [layer.moe for layer in step2.layers] == [False, True, False, False]


def test_deepseek_v3():
    spec = load_spec("tiny-deepseek-v3")
    roles = {t.name: t.role for t in spec.tensors}
    assert roles["model.layers.0.mlp.gate_proj.weight"] == Role(Kind.GATE, 0)  # first_k_dense_replace = 1
    assert roles["model.layers.1.mlp.gate.e_score_correction_bias"] == Role(Kind.ROUTER_BIAS, 1)
    assert spec.tensor_of(Role(Kind.ROUTER_BIAS, 1)).dtype == "float32"
    assert roles["model.layers.2.mlp.shared_experts.gate_proj.weight"] == Role(Kind.GATE, 2, shared=True)
    assert roles["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == Role(Kind.KV_A, 1)
    assert {r.kind for r in roles.values() if r.layer == 1} >= {Kind.Q_A, Kind.Q_A_NORM, Kind.Q_B, Kind.KV_A_NORM, Kind.KV_B}
    assert all(layer.shared_experts == 1 for layer in spec.layers if layer.moe)
    no_lora = spec_from_config({**preset_config("tiny-deepseek-v3"), "q_lora_rank": None})
    assert no_lora.tensor_of(Role(Kind.Q, 0)).name == "model.layers.0.self_attn.q_proj.weight"
    arch = ARCHITECTURES["DeepseekV3ForCausalLM"]
    assert set(arch.hf_fp32) == {Kind.ROUTER, Kind.ROUTER_BIAS} and arch.hf_buffers == {Kind.ROUTER_BIAS}
    assert arch.sglang_fuse_shared and arch.hf_class == "DeepseekV3ForCausalLM"
    hf = make_layout(spec, "hf:fp32_router=1").layout(0)  # transformers 5.24 keeps the router in fp32 (5.19 does not)
    assert hf.tensors["model.layers.1.mlp.gate.weight"].dtype == "float32"
