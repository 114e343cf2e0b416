"""Engine configs: one frozen dataclass per engine drives parsing and printing, and a layout survives its text.

The job rebuilds every participant's layout from the text it registered (``layout.describe()``), so a
key lost in printing silently changes the plan on one side only. These tests print and re-read every
key of every engine, at the config and at the layout level, and check the refusals.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from weightsync.engines import CONFIGS, ENGINES, engine_class, make_layout, parse_engine
from weightsync.engines.config import (
    AUTO_FLAG,
    COUNT,
    FLAG,
    QUANT,
    SIZE,
    EngineConfig,
    FSDPConfig,
    HFConfig,
    MegatronConfig,
    SGLangConfig,
    VLLMConfig,
)
from weightsync.engines.hf import FP32_KEYS
from weightsync.errors import ConfigError
from weightsync.layout import layout_digest
from weightsync.plan.planner import Planner
from weightsync.predict.stats import job_stats
from weightsync.plan.topology import Topology
from weightsync.spec import load_spec

from helpers import tiny

TINY = ["tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"]

# One config per (engine, key) with that key away from its default; each must also be a valid layout
# of the model named with it (so the layout-level round trip covers every key too).
EVERY_KEY = [
    ("tiny-qwen3", HFConfig(fp32=1)),
    ("tiny-qwen3", FSDPConfig(dp=2)),
    ("tiny-qwen3", FSDPConfig(tp=2)),
    ("tiny-qwen3", FSDPConfig(dp=2, tp=2, fp32=1)),
    ("tiny-deepseek-v3", HFConfig(fp32_router=1, fp32_router_bias=1)),  # as transformers 5.24 keeps them
    ("tiny-deepseek-v3", HFConfig(fp32_router=0, fp32_router_bias=0)),  # as from_config under 5.19 makes them
    ("tiny-qwen3-moe", HFConfig(fp32_router=1)),  # a trainer keeping Qwen3-MoE's router in fp32
    ("tiny-deepseek-v3", FSDPConfig(dp=2, fp32_router=0, fp32_router_bias=1)),  # as 5.19 loads them
    ("tiny-qwen3", MegatronConfig(tp=2)),
    ("tiny-qwen3", MegatronConfig(pp=2)),
    ("tiny-qwen3", MegatronConfig(pp=2, vpp=2)),
    ("tiny-qwen3", MegatronConfig(dp=2)),
    ("tiny-qwen3-moe", MegatronConfig(dp=2, ep=2)),
    ("tiny-qwen3-moe", MegatronConfig(tp=2, etp=2)),
    ("tiny-llama3", MegatronConfig(pp=3, pp_first=1)),
    ("tiny-llama3", MegatronConfig(pp=3, pp_last=1)),
    ("tiny-qwen3", MegatronConfig(tp=2, te=1)),
    ("tiny-qwen3-moe", MegatronConfig(ep=2, dp=2, te=1, grouped=1)),
    ("tiny-deepseek-v3", MegatronConfig(tp=4, vocab_multiple=32)),
    ("tiny-qwen3", VLLMConfig(tp=2)),
    ("tiny-qwen3", VLLMConfig(tp=2, quant=1)),  # vllm:tp=2,quant=fp8 (the FP8 tensors: weightsync/quant/config.py)
    ("tiny-qwen3", VLLMConfig(dp=2)),
    ("tiny-qwen3-moe", VLLMConfig(tp=2, ep=2)),
    ("tiny-qwen3", SGLangConfig(tp=2)),
    ("tiny-qwen3-moe", SGLangConfig(tp=2, quant=1)),
    ("tiny-qwen3", SGLangConfig(tp=2, dp=2)),
    ("tiny-qwen3-moe", SGLangConfig(tp=2, ep=2)),
    ("tiny-qwen3", SGLangConfig(tp=4, dp=2, dp_attention=1)),
    ("tiny-deepseek-v3", SGLangConfig(tp=4, dp=2, dp_attention=1, dp_lm_head=1)),
    ("tiny-deepseek-v3", SGLangConfig(tp=2, fuse_shared=0)),
    ("tiny-deepseek-v3", SGLangConfig(tp=2, fuse_shared=1)),
]


def test_every_engine_has_a_config_and_every_key_is_covered():
    assert set(CONFIGS) == set(ENGINES)
    for name, cls in CONFIGS.items():
        assert engine_class(name).keys == cls.keys() and engine_class(name).engine == cls.engine == name
        covered = {k for _, c in EVERY_KEY if type(c) is cls for k in c.items()}
        assert covered == set(cls.keys()), f"{name}: keys never printed away from their default: {set(cls.keys()) - covered}"


@pytest.mark.parametrize("model,config", EVERY_KEY, ids=lambda x: str(x))
def test_every_key_survives_describe(model, config):
    text = str(config)
    assert config.describe() == text and text.startswith(config.engine)
    assert parse_engine(text) == config == type(config).parse(text)
    # printed in canonical (field) order, defaults omitted
    keys = [kv.split("=")[0] for kv in text.partition(":")[2].split(",")]
    assert keys == [k for k in config.keys() if k in keys] and all(getattr(config, k) != f.default
                                                                  for k in keys for f in dataclasses.fields(config) if f.name == k)
    spec = load_spec(model)
    layout = make_layout(spec, text)
    assert layout.config == config and layout.describe() == text
    again = make_layout(spec, layout.describe())
    assert again.config == config
    assert [layout_digest(again.layout(r)) for r in range(again.world_size)] == [
        layout_digest(layout.layout(r)) for r in range(layout.world_size)
    ]
    # built from the config object, and from keywords, it is the same layout
    assert make_layout(spec, config).config == config
    assert engine_class(config.engine)(spec, **config.as_dict()).describe() == text


def _value(domain):
    if domain is FLAG:
        return st.sampled_from([0, 1])
    if domain is AUTO_FLAG:
        return st.sampled_from([-1, 0, 1])
    if domain is COUNT:
        return st.integers(0, 9)
    if domain is QUANT:
        return st.sampled_from([0, 1])
    assert domain is SIZE
    return st.sampled_from([1, 2, 3, 4, 8, 16, 128])


@st.composite
def configs(draw, classes=tuple(CONFIGS.values())):
    cls = draw(st.sampled_from(classes))
    values = {f.name: draw(st.one_of(st.just(f.default), _value(f.metadata["domain"]))) for f in dataclasses.fields(cls)}
    try:
        return cls(**values)
    except ConfigError:
        assume(False)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(configs())
def test_round_trip_any_config(config):
    text = str(config)
    assert parse_engine(text) == config
    assert str(parse_engine(text)) == text
    assert type(config).parse(text.partition(":")[2]) == config  # the keys alone, engine implied
    assert type(config)(**config.as_dict()) == config
    assert hash(parse_engine(text)) == hash(config)  # frozen: usable as a key


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(st.sampled_from(TINY), configs())
def test_any_valid_layout_is_rebuilt_from_its_description(model, config):
    spec = load_spec(model)
    try:
        layout = make_layout(spec, config)
    except ConfigError:
        assume(False)
    assume(layout.world_size <= 32)
    again = make_layout(spec, layout.describe())
    assert again.config == layout.config
    # the layout keeps every key given; only the fp32_* keys are resolved (auto) or made canonical
    given = {k: getattr(config, k) for k in FP32_KEYS if k in config.keys()}
    assert dataclasses.replace(layout.config, **given) == config
    assert make_layout(spec, layout.config).config == layout.config  # resolving is idempotent
    for r in range(layout.world_size):
        assert layout_digest(again.layout(r)) == layout_digest(layout.layout(r))
    for t in spec.tensors:
        assert again.shards(t.name) == layout.shards(t.name)


def _plan_hash(src, dst) -> str:
    topo = Topology.separated(src.world_size, dst.world_size, 1)
    return job_stats(Planner(src, dst, 1, topo)).plan_hash


@pytest.mark.parametrize(
    "infer,differs_from",
    [
        ("sglang:tp=2,fuse_shared=1", "sglang:tp=2"),  # SGLang fuses only 256-expert DeepSeek-V3 by default, not this tiny one
        ("sglang:tp=4,dp=2,dp_attention=1,dp_lm_head=1", "sglang:tp=4,dp=2,dp_attention=1"),
    ],
)
def test_sglang_options_survive_the_job_rebuilding_layouts(infer, differs_from):
    """The failure of issue 14: ``--infer sglang:tp=2,fuse_shared=0`` was registered as ``sglang:tp=2,...``;
    the job rebuilt the default (fused) layout from it and the two sides planned different transfers."""
    spec = load_spec("tiny-deepseek-v3")
    src, dst = make_layout(spec, "hf"), make_layout(spec, infer)
    text = dst.describe()
    assert text == infer
    rebuilt = make_layout(spec, text)  # what JobShape.planner does with the registered string
    assert rebuilt.config == dst.config
    for r in range(dst.world_size):
        assert layout_digest(rebuilt.layout(r)) == layout_digest(dst.layout(r))
    assert _plan_hash(src, rebuilt) == _plan_hash(src, dst)
    # the option matters: without it the layout (and so the plan) is another one
    other = make_layout(spec, differs_from)
    assert [layout_digest(other.layout(r)) for r in range(other.world_size)] != [
        layout_digest(dst.layout(r)) for r in range(dst.world_size)
    ]
    assert _plan_hash(src, other) != _plan_hash(src, dst)


def test_auto_fuse_shared_is_kept_as_auto():
    """``fuse_shared`` left at -1 (SGLang's default for the model) prints as nothing and rebuilds the same choice."""
    assert not make_layout(load_spec("tiny-deepseek-v3"), "sglang:tp=2").fuse_shared_expert  # 8 experts: not by default
    spec = tiny("tiny-deepseek-v3", n_routed_experts=256)  # SGLang's default fuses DeepSeek-V3's 256 (docs/sglang.md)
    auto = make_layout(spec, "sglang:tp=2")
    assert auto.config.fuse_shared == -1 and auto.fuse_shared_expert and auto.describe() == "sglang:tp=2"
    fused = make_layout(spec, "sglang:tp=2,fuse_shared=1")
    assert [layout_digest(fused.layout(r)) for r in range(2)] == [layout_digest(auto.layout(r)) for r in range(2)]
    assert not make_layout(spec, "sglang:tp=2,ep=2").fuse_shared_expert  # SGLang fuses only without EP


@pytest.mark.parametrize(
    "text,message",
    [
        ("vllm:tp=2,foo=1", "vllm: unknown key 'foo'; known keys: tp, dp, ep"),
        ("megatron:tpp=2", "known keys: tp, pp, vpp, dp, ep, etp, pp_first, pp_last, te, grouped, vocab_multiple"),
        ("hf:dp=2", "hf: unknown key 'dp'; known keys: fp32, fp32_router, fp32_router_bias"),
        ("fsdp:dp=0", "fsdp: dp must be at least 1, got 0; known keys: dp, tp, fp32, fp32_router, fp32_router_bias"),
        ("hf:fp32_router=2", "fp32_router must be -1 (auto), 0 or 1, got 2"),
        ("megatron:te=2", "megatron: te must be 0 or 1, got 2"),
        ("megatron:pp=2,pp_first=-1", "pp_first must be at least 0, got -1"),
        ("sglang:fuse_shared=2", "fuse_shared must be -1 (auto), 0 or 1, got 2"),
        ("vllm:tp=two", "vllm: tp='two' is not an integer"),
        ("vllm:tp=1.5", "is not an integer"),
        ("vllm:tp", "expected key=value, got 'tp'"),
        ("vllm:tp=2,tp=4", "key 'tp' given twice"),
        ("deepspeed:tp=2", "unknown engine 'deepspeed'; known: hf, fsdp, megatron, vllm, sglang"),
        ("vllm:ep=3,tp=2", "spans all tp*dp=2 ranks"),
        ("megatron:grouped=1", "grouped=1 needs te=1"),
        ("megatron:vpp=2", "vpp>1 needs pp>1"),
        ("megatron:tp=2,ep=2,etp=2", "tp*dp=2 is not divisible by ep*etp=4"),
        ("sglang:dp_lm_head=1", "dp_lm_head needs dp_attention"),
        ("sglang:tp=4,dp=3,dp_attention=1", "tp=4 must be divisible by dp=3"),
        ("sglang:tp=2,ep=4", "tp=2 must be divisible by ep=4"),
    ],
)
def test_refusals_are_one_line_config_errors(text, message):
    with pytest.raises(ConfigError) as e:
        parse_engine(text)
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError):  # make_layout refuses the same text before looking at the model
        make_layout(load_spec("tiny-qwen3-moe"), text)


def test_refusals_of_objects():
    with pytest.raises(ConfigError, match="must be an integer, got 2.0"):
        VLLMConfig(tp=2.0)
    with pytest.raises(ConfigError, match="must be an integer, got '2'"):
        MegatronConfig(tp="2")
    assert HFConfig(fp32=True) == HFConfig(fp32=1) and str(HFConfig(fp32=True)) == "hf:fp32=1"
    with pytest.raises(ConfigError, match="this is a config of engine 'vllm'"):
        MegatronConfig.parse("vllm:tp=2")
    spec = load_spec("tiny-qwen3")
    layout_cls = engine_class("vllm")
    with pytest.raises(ConfigError, match="unknown key 'pp'; known keys: tp, dp, ep"):
        layout_cls(spec, pp=2)
    with pytest.raises(ConfigError, match="not both"):
        layout_cls(spec, VLLMConfig(tp=2), tp=2)
    with pytest.raises(ConfigError, match="expected a VLLMConfig"):
        layout_cls(spec, SGLangConfig(tp=2))
    with pytest.raises(ConfigError, match="ENGINE:k=v"):
        parse_engine(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        VLLMConfig().tp = 2  # type: ignore[misc]


def test_text_forms_and_old_reads():
    assert str(MegatronConfig()) == "megatron" and MegatronConfig.parse("") == MegatronConfig.parse("megatron") == MegatronConfig()
    assert parse_engine(" megatron : tp = 2 , pp=2 ,") == MegatronConfig(tp=2, pp=2)
    assert str(MegatronConfig(pp=2, tp=2)) == "megatron:tp=2,pp=2"  # canonical order, whatever the order given
    assert parse_engine("megatron:pp=2,tp=2") == parse_engine("megatron:tp=2,pp=2")
    c = parse_engine("fsdp:tp=2")
    assert c.get("tp", 1) == 2 and c.get("dp", 1) == 1 and c.get("ep", 7) == 7  # what callers of the old dict read
    assert c.items() == {"tp": 2} and c.as_dict() == {"dp": 1, "tp": 2, "fp32": 0, "fp32_router": -1, "fp32_router_bias": -1}
    for cls in CONFIGS.values():
        assert len(cls.help().splitlines()) == len(cls.keys())
    assert isinstance(c, EngineConfig)


# --------------------------------------------------------------------------------------------
# What transformers keeps in fp32 beside a bf16 model (fp32_router, fp32_router_bias): which tensors
# depends on its version, so auto is resolved once, from the installed class's list, printed, and
# rebuilt from the text by a process whose transformers may differ

LIST_519 = ["e_score_correction_bias"]  # DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict, 5.19-5.23
LIST_524 = ["e_score_correction_bias", "gate.weight"]  # from 5.24


@pytest.fixture
def strict_list(monkeypatch):
    """Set the installed DeepseekV3PreTrainedModel's ``_keep_in_fp32_modules_strict`` to a version's list."""
    module = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    return lambda patterns: monkeypatch.setattr(module.DeepseekV3PreTrainedModel, "_keep_in_fp32_modules_strict", patterns)


def _gate_dtypes(layout) -> dict[str, str]:
    """DeepSeek-V3 layer 1's router tensors -> dtype, on rank 0."""
    return {n.rsplit(".", 1)[1]: t.dtype for n, t in layout.layout(0).tensors.items() if n.startswith("model.layers.1.mlp.gate.")}


def test_auto_is_what_the_installed_transformers_keeps():
    transformers = pytest.importorskip("transformers")
    from packaging.version import Version

    spec = load_spec("tiny-deepseek-v3")
    router = int(Version(transformers.__version__) >= Version("5.24.0"))  # gate.weight joined the list in 5.24
    for text in ("hf", "fsdp:dp=2"):
        layout = make_layout(spec, text)
        assert (layout.config.fp32_router, layout.config.fp32_router_bias) == (router, 1)
        assert layout.describe() == f"{text}{',' if ':' in text else ':'}fp32_router={router},fp32_router_bias=1"
        assert _gate_dtypes(layout) == {"weight": "float32" if router else "bfloat16", "e_score_correction_bias": "float32"}


@pytest.mark.parametrize("patterns,router", [(LIST_519, 0), (LIST_524, 1), ([], 0), (["*gate.weight", "e_score_*"], 1)])
def test_auto_follows_the_class_list(strict_list, patterns, router):
    strict_list(patterns)
    spec = load_spec("tiny-deepseek-v3")
    bias = int(any(p.startswith("e_score") for p in patterns))
    for text in ("hf", "fsdp:dp=2"):
        layout = make_layout(spec, text)
        assert (layout.config.fp32_router, layout.config.fp32_router_bias) == (router, bias), layout.describe()
        assert _gate_dtypes(layout) == {"weight": ("bfloat16", "float32")[router],
                                        "e_score_correction_bias": ("bfloat16", "float32")[bias]}


def test_without_transformers_the_newest_known_version_is_assumed(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    spec = load_spec("tiny-deepseek-v3")
    assert make_layout(spec, "hf").describe() == "hf:fp32_router=1,fp32_router_bias=1"  # as 5.24
    assert make_layout(spec, "fsdp:dp=2").describe() == "fsdp:dp=2,fp32_router=1,fp32_router_bias=1"


def test_both_ends_plan_the_same_layout_whatever_their_transformers(strict_list):
    # one end under 5.19 registers its description; the job plans from it under 5.24 and gets the same
    # layouts and plan (the auto default itself differs between the two: the key is what carries it)
    spec = load_spec("tiny-deepseek-v3")
    strict_list(LIST_519)
    src, dst = make_layout(spec, "fsdp:dp=2"), make_layout(spec, "hf")
    texts, plan = (src.describe(), dst.describe()), _plan_hash(src, dst)
    assert texts == ("fsdp:dp=2,fp32_router=0,fp32_router_bias=1", "hf:fp32_router=0,fp32_router_bias=1")
    strict_list(LIST_524)
    rebuilt = [make_layout(spec, t) for t in texts]
    for old, new in zip((src, dst), rebuilt):
        assert new.config == old.config and new.describe() == old.describe()
        assert [layout_digest(new.layout(r)) for r in range(new.world_size)] == [
            layout_digest(old.layout(r)) for r in range(old.world_size)]
    assert _plan_hash(*rebuilt) == plan
    assert _plan_hash(make_layout(spec, "fsdp:dp=2"), make_layout(spec, "hf")) != plan  # 5.24's own auto differs


def test_fp32_keys_leave_other_models_alone(monkeypatch):
    # no other architecture has a tensor transformers may keep in fp32: nothing is asked of transformers,
    # nothing printed, the layouts are the same as without the keys
    import weightsync.engines.hf_fp32 as hf_fp32

    def asked(*_):
        raise AssertionError("transformers was asked about a model with no hf_fp32 kinds")

    monkeypatch.setattr(hf_fp32, "installed_strict_list", asked)
    for model in TINY[:-1]:
        spec = load_spec(model)
        for text in ("hf", "hf:fp32=1", "fsdp:dp=2", "fsdp:dp=3,fp32=1"):
            layout = make_layout(spec, text)
            assert layout.describe() == text and all(getattr(layout.config, k) == -1 for k in FP32_KEYS)
        # a 0 that changes nothing is made auto (one text per layout); 1 on Qwen3-MoE's router is a real choice
        assert make_layout(spec, "hf:fp32_router=0,fp32_router_bias=0").describe() == "hf"
    moe = load_spec("tiny-qwen3-moe")
    router = make_layout(moe, "hf:fp32_router=1")
    assert router.describe() == "hf:fp32_router=1"
    assert router.layout(0).tensors["model.layers.1.mlp.gate.weight"].dtype == "float32"
    assert make_layout(moe, "hf").layout(0).tensors["model.layers.1.mlp.gate.weight"].dtype == "bfloat16"
    # the DeepSeek-V3 model in fp32 (fp32=1, or an fp32 checkpoint) keeps everything in fp32, whatever the list
    spec = load_spec("tiny-deepseek-v3")
    assert make_layout(spec, "hf:fp32=1").describe() == "hf:fp32=1,fp32_router=1,fp32_router_bias=1"
    fp32_model = tiny("tiny-deepseek-v3", torch_dtype="float32")
    assert make_layout(fp32_model, "fsdp:dp=2").describe() == "fsdp:dp=2,fp32_router=1,fp32_router_bias=1"


@pytest.mark.parametrize("model,text,message", [
    ("tiny-qwen3", "hf:fp32_router=1", "hf: fp32_router=1, but tiny-qwen3 has no router tensor; drop fp32_router"),
    ("tiny-qwen3-moe", "fsdp:dp=2,fp32_router_bias=1", "has no router_bias tensor"),
    ("tiny-deepseek-v3", "hf:fp32=1,fp32_router=0", "fp32=1 keeps every tensor in fp32; fp32_router=0 contradicts it"),
])
def test_fp32_keys_refused_against_the_model(model, text, message):
    with pytest.raises(ConfigError) as e:
        make_layout(load_spec(model), text)
    assert message in str(e.value)


def test_the_strict_list_matches_names_as_transformers_does():
    from weightsync.engines.hf_fp32 import StrictList

    s = StrictList(("gate.weight", "e_score_*"), "test")
    assert s.keeps("model.layers.3.mlp.gate.weight") and s.keeps("model.layers.3.mlp.gate.e_score_correction_bias")
    assert not s.keeps("model.layers.3.mlp.gate_proj.weight") and not s.keeps("model.layers.3.mlp.experts.gate_up_proj")
    assert not StrictList((), "test").keeps("model.layers.3.mlp.gate.weight")
