"""vLLM and SGLang layout rules, checked against the shapes their source code gives (docs/engines.md)."""

import pytest

from weightsync.engines import make_layout
from weightsync.errors import ConfigError
from weightsync.spec import load_spec
from weightsync.testing import coverage_problems
from helpers import tiny


def shapes(model, engine, rank=0, layers=None):
    """Rank ``rank``'s tensor shapes; ``layers`` keeps only the first decoder layers of the model."""
    spec = load_spec(model) if layers is None else tiny(model, num_hidden_layers=layers)
    return {n: t.shape for n, t in make_layout(spec, engine).layout(rank).tensors.items()}


# The real models below keep their first 4 decoder layers (deepseek-v3: 3 dense, then MoE), where the asserted
# tensors live: the layout rules are per tensor and depth only adds layers, so the shapes are the full model's.
# A whole real model's layout costs seconds (deepseek-v3: 45k tensors, 7 s a rank on CI); this one, 0.1 s.
# test_depth_changes_no_shape checks the premise on every config used here.
REAL = 4
REAL_CONFIGS = [
    ("llama3-8b", "vllm:tp=4"), ("llama3-8b", "vllm:tp=16"), ("qwen3-0.6b", "vllm:tp=1"),
    ("qwen3-30b-a3b", "vllm:tp=4,dp=2"), ("qwen3-30b-a3b", "vllm:tp=4,ep=4"),
    ("deepseek-v3", "vllm:tp=8"), ("deepseek-v3", "vllm:tp=8,ep=8"),
    ("deepseek-v3", "sglang:tp=8"), ("deepseek-v3", "sglang:tp=8,ep=8"), ("deepseek-v3", "sglang:tp=8,fuse_shared=0"),
]


@pytest.mark.parametrize("model,engine", REAL_CONFIGS)
def test_depth_changes_no_shape(model, engine):
    """The first layers' shapes are the same with twice the depth (and the model-wide tensors too)."""
    short, deeper = shapes(model, engine, layers=REAL), shapes(model, engine, layers=2 * REAL)
    assert short and all(deeper[n] == s for n, s in short.items())
    assert set(deeper) - set(short) == {n for n in deeper if any(f".layers.{i}." in n for i in range(REAL, 2 * REAL))}


def pieces(model, engine, rank, tensor):
    return make_layout(load_spec(model), engine).layout(rank).tensors[tensor].pieces


@pytest.mark.parametrize(
    "model,engine",
    [
        ("tiny-llama3", "vllm:tp=8,dp=2"),
        ("tiny-qwen3-moe", "vllm:dp=3,ep=3"),
        ("tiny-qwen3-moe", "vllm:tp=2,dp=2"),
        ("tiny-deepseek-v3", "vllm:tp=4,ep=4"),
        ("tiny-deepseek-v3", "sglang:tp=4"),
        ("tiny-deepseek-v3", "sglang:tp=4,dp=4,ep=2,dp_attention=1,dp_lm_head=1"),
        ("tiny-qwen3", "sglang:tp=8,dp=2,dp_attention=1"),
    ],
)
def test_every_element_once_per_replica(model, engine):
    assert coverage_problems(make_layout(load_spec(model), engine)) == []


def test_vllm_worked_shapes_for_real_models():
    # the worked examples in docs/engines.md, from vLLM 0.33.0's source
    s = shapes("llama3-8b", "vllm:tp=4", layers=REAL)
    assert s["model.embed_tokens.weight"] == (32064, 4096)
    assert s["model.layers.0.self_attn.qkv_proj.weight"] == (1536, 4096)
    assert s["model.layers.0.mlp.gate_up_proj.weight"] == (7168, 4096)
    assert s["model.layers.0.mlp.down_proj.weight"] == (4096, 3584)
    assert shapes("llama3-8b", "vllm:tp=16", layers=REAL)["model.layers.0.self_attn.qkv_proj.weight"] == (512, 4096)
    assert "lm_head.weight" not in shapes("qwen3-0.6b", "vllm:tp=1", layers=REAL)
    s = shapes("qwen3-30b-a3b", "vllm:tp=4,dp=2", layers=REAL)
    assert s["model.layers.0.mlp.experts.routed_experts.w13_weight"] == (128, 192, 2048)
    assert s["model.layers.0.mlp.experts.routed_experts.w2_weight"] == (128, 2048, 96)
    s = shapes("qwen3-30b-a3b", "vllm:tp=4,ep=4", layers=REAL)
    assert s["model.layers.0.mlp.experts.routed_experts.w13_weight"] == (32, 1536, 2048)
    s = shapes("deepseek-v3", "vllm:tp=8", layers=REAL)
    assert s["model.layers.0.self_attn.fused_qkv_a_proj.weight"] == (2112, 7168)
    assert s["model.layers.0.self_attn.q_b_proj.weight"] == (3072, 1536)
    assert s["model.layers.0.self_attn.kv_b_proj.weight"] == (4096, 512)
    assert s["model.layers.0.self_attn.o_proj.weight"] == (7168, 2048)
    assert s["model.layers.0.mlp.gate_up_proj.weight"] == (4608, 7168)
    assert s["model.layers.3.mlp.shared_experts.gate_up_proj.weight"] == (512, 7168)
    assert s["model.layers.3.mlp.experts.routed_experts.w13_weight"] == (256, 512, 7168)
    s = shapes("deepseek-v3", "vllm:tp=8,ep=8", layers=REAL)
    assert s["model.layers.3.mlp.experts.routed_experts.w13_weight"] == (32, 4096, 7168)


def test_vllm_kv_heads_replicated_in_consecutive_blocks():
    # tiny-llama3: 8 heads, 2 KV heads; tp=8 -> ranks 0-3 hold KV head 0, ranks 4-7 KV head 1
    for rank in range(8):
        ps = pieces("tiny-llama3", "vllm:tp=8", rank, "model.layers.0.self_attn.qkv_proj.weight")
        q, k, v = ps
        assert q.canonical.endswith("q_proj.weight") and q.canon_box[0] == (rank * 8, 8)
        assert k.canon_box[0] == ((rank // 4) * 8, 8) and v.canon_box[0] == k.canon_box[0]
        assert [p.local_box[0] for p in ps] == [(0, 8), (8, 8), (16, 8)]


def test_vllm_vocab_padding():
    # vocab 250 pads to 256; tp=4 -> 64 rows per rank, the last rank holds 58 real rows
    ps = pieces("tiny-llama3", "vllm:tp=4", 3, "model.embed_tokens.weight")
    assert ps[0].canon_box[0] == (192, 58) and ps[0].local_box[0] == (0, 58)
    assert shapes("tiny-llama3", "vllm:tp=4", 3)["model.embed_tokens.weight"] == (64, 64)


def test_vllm_uneven_experts_go_to_first_ranks():
    # 8 experts over ep=3: ranks hold 3, 3, 2 (determine_expert_map, linear)
    counts = [shapes("tiny-qwen3-moe", "vllm:dp=3,ep=3", r)["model.layers.0.mlp.experts.routed_experts.w13_weight"][0] for r in range(3)]
    assert counts == [3, 3, 2]
    gate = pieces("tiny-qwen3-moe", "vllm:dp=3,ep=3", 1, "model.layers.0.mlp.experts.routed_experts.w13_weight")
    assert [p.canonical.split(".")[5] for p in gate if "gate_proj" in p.canonical] == ["3", "4", "5"]


def test_sglang_fuses_the_shared_expert_by_default_without_ep():
    s = shapes("deepseek-v3", "sglang:tp=8", layers=REAL)
    assert s["model.layers.3.mlp.experts.w13_weight"] == (257, 512, 7168)
    assert "model.layers.3.mlp.shared_experts.gate_up_proj.weight" not in s
    s = shapes("deepseek-v3", "sglang:tp=8,ep=8", layers=REAL)
    assert s["model.layers.3.mlp.experts.w13_weight"] == (32, 4096, 7168)
    assert s["model.layers.3.mlp.shared_experts.gate_up_proj.weight"] == (512, 7168)
    assert s["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"] == (2112, 7168)
    s = shapes("deepseek-v3", "sglang:tp=8,fuse_shared=0", layers=REAL)
    assert s["model.layers.3.mlp.experts.w13_weight"] == (256, 512, 7168)


def test_sglang_dp_attention_shards_attention_over_attention_tp():
    # tp=8, dp=2 -> attention TP 4; dense MLP still over all 8
    s = shapes("tiny-qwen3", "sglang:tp=8,dp=2,dp_attention=1", 5)
    assert s["model.layers.0.self_attn.qkv_proj.weight"] == ((2 + 1 + 1) * 16, 64)
    assert s["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert s["model.layers.0.mlp.gate_up_proj.weight"] == (32, 64)
    assert s["model.embed_tokens.weight"] == (64, 64)
    q = pieces("tiny-qwen3", "sglang:tp=8,dp=2,dp_attention=1", 5, "model.layers.0.self_attn.qkv_proj.weight")[0]
    assert q.canon_box[0] == (1 * 32, 32)  # attention-TP rank 5 % 4 = 1


def test_sglang_vocab_padding_grows_with_tp():
    # 250 pads to 256 = 8 * 32
    assert shapes("tiny-llama3", "sglang:tp=8")["model.embed_tokens.weight"] == (32, 64)


@pytest.mark.parametrize(
    "model,engine,message",
    [
        ("tiny-llama3", "vllm:tp=3", "not divisible"),
        ("tiny-llama3", "vllm:tp=2,ep=2", "no experts"),
        ("tiny-qwen3-moe", "vllm:tp=2,ep=3", "spans all"),
        ("tiny-llama3", "sglang:tp=4,dp=2,dp_attention=1", "DP-attention"),
        ("tiny-qwen3", "sglang:tp=4,dp=3,dp_attention=1", "divisible"),
        ("tiny-qwen3", "vllm:tp=2,foo=1", "unknown key"),
        ("tiny-qwen3", "vllm:tp=0", "at least 1"),
        ("tiny-qwen3", "nope:tp=2", "unknown engine"),
    ],
)
def test_invalid_configs_refused(model, engine, message):
    with pytest.raises(ConfigError, match=message):
        make_layout(load_spec(model), engine)
