"""Which tensors an FP8-served engine holds in block FP8 (weightsync.quant.config), ``quant=fp8`` in the engine
configs, and the refusals at set-up: other quantizations, other blocks, trainer dtypes, shards that cut a block."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from weightsync.engines import make_layout, parse_engine
from weightsync.engines.config import SGLangConfig, VLLMConfig
from weightsync.errors import ConfigError
from weightsync.quant.config import (
    BlockFP8,
    block_problems,
    check_layout,
    check_trainer_dtypes,
    checkpoint_tensors,
    fp8_tensors,
    from_hf,
    not_fp8,
)
from weightsync.spec import Kind, load_spec

from helpers import tiny

HF_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


# -- quant=fp8 in the engine configs --------------------------------------------------------------------


def test_quant_fp8_reads_and_prints_as_a_word():
    c = parse_engine("vllm:tp=2,quant=fp8")
    assert c == VLLMConfig(tp=2, quant=1) == VLLMConfig(tp=2, quant="fp8") and str(c) == "vllm:tp=2,quant=fp8"
    assert parse_engine("sglang:tp=4,ep=2,quant=fp8") == SGLangConfig(tp=4, ep=2, quant=1)
    assert str(parse_engine("vllm:tp=2,quant=none")) == "vllm:tp=2"  # the default prints as nothing
    assert "quant=none  linear weights as the engine holds them" in VLLMConfig.help()
    layout = make_layout(load_spec("tiny-qwen3"), "vllm:tp=2,quant=fp8")
    assert layout.describe() == "vllm:tp=2,quant=fp8" and layout.config.quant == 1


@pytest.mark.parametrize("text,message", [
    ("vllm:quant=int4", "vllm: quant='int4' is not one of none, fp8; known keys: tp, dp, ep, quant"),
    ("sglang:quant=2", "sglang: quant='2' is not one of none, fp8"),
    ("megatron:quant=fp8", "megatron: unknown key 'quant'"),  # a trainer holds bf16/fp32: quantizing is the sender's
])
def test_quant_refusals(text, message):
    with pytest.raises(ConfigError) as e:
        parse_engine(text)
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="quant must be none or fp8, got 3"):
        VLLMConfig(quant=3)


# -- the engine's quantization_config ---------------------------------------------------------------------


def test_block_fp8_is_read_from_the_checkpoint_config():
    assert from_hf(None) is None and from_hf({}) is None
    assert from_hf(HF_FP8) == BlockFP8()
    q = from_hf({**HF_FP8, "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]})
    assert q.ignored == ("model.layers.0.mlp.down_proj",)
    assert from_hf(q.hf_config()) == q and BlockFP8().hf_config() == HF_FP8


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"},
     "per-tensor FP8 (quant_method fp8 without weight_block_size)"),
    ({**HF_FP8, "weight_block_size": [64, 64]}, "weight_block_size [64, 64] is not supported; only [128, 128]"),
    ({**HF_FP8, "weight_block_size": [128, 64]}, "weight_block_size [128, 64] is not supported"),
    ({**HF_FP8, "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({**HF_FP8, "activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
    ({"quant_method": "mxfp4"}, "quantized with MXFP4; weightsync syncs block FP8 only"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quantized with ModelOpt (FP8 per-tensor or NVFP4) (NVFP4)"),
    ({"quant_method": "awq", "bits": 4}, "quantized with INT4 AWQ"),
    ({"quant_method": "gptq", "bits": 4}, "quantized with INT4 GPTQ"),
    ({"quant_method": "fbgemm_fp8"}, "quantized with channel-wise FP8"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "compressed-tensors (float-quantized)"),
    ({"quant_method": "hqq"}, "quantized with quant_method 'hqq'"),
])
def test_other_quantizations_are_refused_by_name(qc, message):
    with pytest.raises(ConfigError) as e:
        from_hf(qc)
    assert message in str(e.value) and "\n" not in str(e.value)


# -- which tensors ----------------------------------------------------------------------------------------


def _kinds(spec, names):
    return {spec.tensor(n).role.kind for n in names}


def test_dense_qwen3_projections_are_fp8_the_rest_stays():
    spec = load_spec("qwen3-8b")
    fp8 = fp8_tensors(spec, BlockFP8())
    assert len(fp8) == 36 * 7 and _kinds(spec, [f.weight.name for f in fp8]) == {
        Kind.Q, Kind.K, Kind.V, Kind.O, Kind.GATE, Kind.UP, Kind.DOWN}
    assert _kinds(spec, not_fp8(spec, BlockFP8())) == {
        Kind.EMBED, Kind.LM_HEAD, Kind.FINAL_NORM, Kind.INPUT_NORM, Kind.POST_ATTN_NORM, Kind.Q_NORM, Kind.K_NORM}
    up = next(f for f in fp8 if f.weight.name == "model.layers.3.mlp.up_proj.weight")
    assert (up.weight.shape, up.weight.dtype, up.source_dtype) == ((12288, 4096), "float8_e4m3fn", "bfloat16")
    assert (up.scale.name, up.scale.shape, up.scale.dtype) == ("model.layers.3.mlp.up_proj.weight_scale_inv", (96, 32),
                                                               "float32")
    assert up.scale.role == up.weight.role


def test_moe_experts_are_fp8_routers_are_not():
    spec = load_spec("tiny-deepseek-v3")  # MLA, shared experts, router bias, a first dense layer
    names = {f.weight.name: f for f in fp8_tensors(spec, BlockFP8())}
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert {"model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.self_attn.q_b_proj.weight",
            "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.1.self_attn.kv_b_proj.weight"} <= set(names)
    kept = set(not_fp8(spec, BlockFP8()))
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias", "lm_head.weight",
            "model.embed_tokens.weight", "model.layers.1.self_attn.kv_a_layernorm.weight"} <= kept
    assert not any(spec.tensor(n).role.kind in (Kind.ROUTER, Kind.ROUTER_BIAS) for n in names)
    # a partial edge block: kv_a_proj_with_mqa [kv_lora_rank + rope = 40, 64] has one [1, 1] scale
    assert names["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].scale.shape == (1, 1)
    moe = load_spec("qwen3-30b-a3b")
    f = {x.weight.name: x for x in fp8_tensors(moe, BlockFP8())}
    assert f["model.layers.0.mlp.experts.127.gate_proj.weight"].scale.shape == (6, 16)  # [768, 2048]
    assert "model.layers.0.mlp.gate.weight" not in f


def test_ignored_layers_match_modules_exactly_and_experts_by_layer():
    spec = load_spec("tiny-qwen3-moe")
    q = BlockFP8(ignored=("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.experts.3.up_proj", "o_proj"))
    names = {f.weight.name for f in fp8_tensors(spec, q)}
    assert "model.layers.0.self_attn.o_proj.weight" not in names  # exact module name
    assert "model.layers.1.self_attn.o_proj.weight" in names  # "o_proj" alone matches nothing (exact mode)
    assert not any(n.startswith("model.layers.1.mlp.experts.") for n in names)  # a listed expert skips its MoE layer
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
    with pytest.raises(ConfigError, match="lists model.layers.0.self_attn.q_proj but not "
                                          "model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj; "
                                          "the engine fuses them"):
        fp8_tensors(spec, BlockFP8(ignored=("model.layers.0.self_attn.q_proj",)))


def test_the_checkpoint_lists_each_scale_after_its_weight():
    spec = load_spec("tiny-qwen3")
    tensors = checkpoint_tensors(spec, BlockFP8())
    names = [t.name for t in tensors]
    assert len(tensors) == len(spec.tensors) + len(fp8_tensors(spec, BlockFP8()))
    i = names.index("model.layers.2.self_attn.q_proj.weight")
    assert names[i + 1] == "model.layers.2.self_attn.q_proj.weight_scale_inv"
    assert {t.dtype for t in tensors} == {"bfloat16", "float8_e4m3fn", "float32"}


# -- refusals at set-up -----------------------------------------------------------------------------------


def test_a_tp_shard_that_cuts_a_block_is_refused_naming_tensor_size_and_block():
    spec = tiny("tiny-qwen3-h64", hidden_size=256, head_dim=128, num_key_value_heads=2, intermediate_size=1408)
    assert check_layout(make_layout(spec, "vllm:tp=1,quant=fp8"), BlockFP8())  # whole: fine
    with pytest.raises(ConfigError) as e:
        check_layout(make_layout(spec, "vllm:tp=2,quant=fp8"), BlockFP8())
    msg = str(e.value)
    assert msg.startswith("fp8: model.layers.0.mlp.gate_proj.weight: vllm:tp=2,quant=fp8 "
                          "shards its 1408 rows 704 a piece")
    assert "cuts a 128 x 128 FP8 block" in msg and "(and 5 more tensors)" in msg and "\n" not in msg
    problems = block_problems(make_layout(spec, "sglang:tp=2"), fp8_tensors(spec, BlockFP8()))
    assert [p.split(":")[1].strip() for p in problems] == [
        f"model.layers.{i}.mlp.{m}_proj.weight" for i in (0, 1) for m in ("gate", "up", "down")]
    assert "shards its 1408 columns 704 a piece" in problems[2]  # down_proj: row parallel, split along K


def test_a_fused_part_off_the_blocks_is_refused():
    spec = load_spec("tiny-qwen3-h64")  # k, v: 64 rows each, fused after q's 256 in qkv_proj [384, 128]
    problems = block_problems(make_layout(spec, "vllm"), fp8_tensors(spec, BlockFP8()))
    assert problems[0] == ("fp8: model.layers.0.self_attn.k_proj.weight: vllm places its 64 rows at rows 256..320 of "
                           "the fused model.layers.0.self_attn.qkv_proj.weight [384, 128], off the 128 x 128 FP8 "
                           "blocks; the engine refuses such a fused layer too (its parts must be multiples of 128)")


@pytest.mark.parametrize("infer", ["vllm:tp=2", "vllm:tp=8", "sglang:tp=4"])
def test_real_models_at_common_sizes_are_block_aligned(infer):
    spec = load_spec("qwen3-8b")
    assert len(check_layout(make_layout(spec, infer), BlockFP8())) == 252


def test_trainer_dtypes():
    spec = load_spec("tiny-qwen3")
    fp8 = fp8_tensors(spec, BlockFP8())
    check_trainer_dtypes({}, fp8)  # the spec's bf16
    check_trainer_dtypes({f.weight.name: "float32" for f in fp8}, fp8)  # fp32 masters
    with pytest.raises(ConfigError, match="the trainer holds model.layers.0.self_attn.q_proj.weight in float16; "
                                          "block FP8 is quantized from bf16 or fp32 weights only"):
        check_trainer_dtypes({"model.layers.0.self_attn.q_proj.weight": "float16"}, fp8)


# -- the model configs the GPU scripts take by path (benchmarks/configs) ----------------------------------------------
# Before: ``benchmarks/vllm_gpu.py colo --model tiny-deepseek-v3-h64`` failed on an H100 inside vLLM 0.26 ("No valid MLA
# prefill backend ... FLASH_ATTN: Model does not have supported MLA dimensions (got (qk_nope_head_dim=64,
# qk_rope_head_dim=64, v_head_dim=64))": on Hopper its only MLA prefill is FlashAttention, ``v1/attention/backends/mla/
# prefill/flash_attn.py``), and a config path given as ``--model`` named the output file after the path.

_ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((_ROOT / "benchmarks" / "configs").glob("*.json"))
#: (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) vLLM 0.26's FlashAttention MLA prefill takes (FA3: DeepSeek's,
#: GLM's, Mistral Small 4's); on Hopper it is the only MLA prefill backend (``prefill/selector.py``)
VLLM026_HOPPER_MLA_DIMS = {(128, 64, 128), (192, 64, 256), (64, 64, 128)}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_each_config_loads_and_an_mla_one_has_dims_vllm_0_26_prefills_on_hopper(path):
    from weightsync.spec import load_spec

    spec = load_spec(path)
    assert spec.name == path.stem
    a = spec.attention
    if a.kind == "mla":
        assert (a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) in VLLM026_HOPPER_MLA_DIMS


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_each_fp8_linear_of_a_config_is_whole_128_blocks_but_a_fused_modules_last_shard(path):
    """vLLM's ``validate_fp8_block_shape`` lets only the last shard of a merged GEMM end inside a block (MLA's
    ``kv_a_proj_with_mqa``, 576 rows, as in DeepSeek-V3 itself); every other FP8 weight's rows and columns are whole
    128 blocks here, so every GEMM takes the kernel the engine picks by default."""
    from weightsync.quant.config import BlockFP8, fp8_tensors
    from weightsync.spec import load_spec

    spec = load_spec(path)
    weights = [f.weight for f in fp8_tensors(spec, BlockFP8())]
    assert weights, "no FP8 tensors"
    ragged = [w.name for w in weights if any(d % 128 for d in w.shape)]
    assert all(n.endswith("kv_a_proj_with_mqa.weight") for n in ragged), ragged


def test_a_config_path_names_the_output_after_its_file(tmp_path, monkeypatch):
    sys.path.insert(0, str(_ROOT / "benchmarks"))
    try:
        import vllm_gpu
    finally:
        sys.path.remove(str(_ROOT / "benchmarks"))
    written = {}

    def colo(device, out, model):
        written["model"] = model
        return {"verified": True}

    monkeypatch.setattr(vllm_gpu, "colo", colo)
    monkeypatch.setattr(sys, "argv", ["vllm_gpu.py", "colo", "--device", "cpu", "--out", str(tmp_path), "--model",
                                      "benchmarks/configs/tiny-deepseek-v3-hopper.json"])
    assert vllm_gpu.main() == 0
    assert written["model"] == "benchmarks/configs/tiny-deepseek-v3-hopper.json"
    assert [p.name for p in tmp_path.iterdir()] == ["colo_tiny-deepseek-v3-hopper.json"]


def test_a_checkpoint_lists_its_routers_as_ignored_and_that_is_still_plain_fp8():
    """vLLM 0.26 builds Qwen3-MoE's router ``mlp.gate`` with the model's quant_config (an FP8 layer unless listed in
    ``ignored_layers``; 0.32 and SGLang build it unquantized): a checkpoint weightsync writes lists every router, which
    changes nothing weightsync holds in FP8, and an engine served from it is ``quant=fp8``; ignoring a projection is
    not."""
    from weightsync.quant.config import for_checkpoint

    moe = load_spec("qwen3-30b-a3b")
    q = for_checkpoint(moe)
    assert len(q.ignored) == moe.config["num_hidden_layers"] and all(m.endswith(".mlp.gate") for m in q.ignored)
    assert q.plain() and from_hf(q.hf_config()) == q and q.hf_config()["ignored_layers"][0] == "model.layers.0.mlp.gate"
    assert fp8_tensors(moe, q) == fp8_tensors(moe, BlockFP8())
    assert for_checkpoint(load_spec("qwen3-8b")) == BlockFP8()  # dense: nothing to list
    assert not BlockFP8(("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")).plain()
    ds = load_spec("tiny-deepseek-v3")  # its router bias is no module of its own
    assert all(m.endswith(".mlp.gate") for m in for_checkpoint(ds).ignored) and for_checkpoint(ds).plain()
