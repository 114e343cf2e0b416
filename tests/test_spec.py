import json

import pytest

from weightsync.errors import SpecError
from weightsync.spec import load_spec, preset_names

# parameter counts given with the public configs (shared/model-configs/README.md)
EXPECTED = {
    "qwen3-0.6b": 596_049_920,
    "qwen3-8b": 8_190_735_360,
    "qwen3-30b-a3b": 30_532_122_624,
    "llama3-8b": 8_030_261_248,
}


@pytest.mark.parametrize("name,params", EXPECTED.items())
def test_parameter_counts_match_published(name, params):
    spec = load_spec(name)
    assert spec.num_parameters == params
    assert spec.nbytes == 2 * params


def test_deepseek_v3_and_kimi_sizes():
    ds = load_spec("deepseek-v3")
    assert 670e9 < ds.num_parameters < 672e9  # ~671B without the MTP layer
    assert 1.02e12 < load_spec("kimi-k2").num_parameters < 1.04e12
    names = ds.by_name
    assert "model.layers.2.mlp.gate_proj.weight" in names  # first_k_dense_replace = 3
    assert "model.layers.3.mlp.experts.255.down_proj.weight" in names
    assert names["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == "float32"
    assert names["model.layers.3.mlp.shared_experts.gate_proj.weight"].shape == (2048, 7168)
    assert names["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 7168)


def test_moonlight_is_deepseek_v3_at_one_gpus_size():
    """Moonshot AI's public Moonlight-16B-A3B config (shared/model-configs): MLA without q_lora_rank, 64 routed + 2
    shared experts, one dense first layer, noaux_tc; 15.96 B parameters (31.9 GB in bf16)."""
    spec = load_spec("moonlight-16b-a3b")
    assert 15.95e9 < spec.num_parameters < 15.97e9
    names = spec.by_name
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.self_attn.q_a_proj.weight" not in names
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.1.mlp.gate_proj.weight" not in names
    assert "model.layers.26.mlp.experts.63.down_proj.weight" in names
    assert names["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (2 * 1408, 2048)
    assert names["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "float32"


def test_tied_embeddings_have_no_lm_head():
    assert "lm_head.weight" not in load_spec("qwen3-0.6b").by_name
    assert "lm_head.weight" in load_spec("qwen3-8b").by_name


def test_mla_without_q_lora():
    cfg = dict(load_spec("tiny-deepseek-v3").config, q_lora_rank=None)
    spec = load_spec(cfg)
    assert "model.layers.0.self_attn.q_proj.weight" in spec.by_name
    assert "model.layers.0.self_attn.q_a_proj.weight" not in spec.by_name


def test_all_presets_load():
    for name in preset_names():
        assert load_spec(name).tensors


def test_config_path(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(dict(load_spec("tiny-qwen2").config)))
    assert load_spec(str(p)).digest == load_spec("tiny-qwen2").digest
    assert load_spec(str(tmp_path)).digest == load_spec("tiny-qwen2").digest


def test_unknown_architecture_says_how_to_add_one():
    with pytest.raises(SpecError, match="To add one"):
        load_spec({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8})


def test_unknown_model():
    with pytest.raises(SpecError, match="unknown model"):
        load_spec("no-such-model")
