"""LoRA adapters as canonical tensors (weightsync.lora): the adapter spec from a PEFT config and a base spec, a real
PEFT model bound to it, vLLM's slot layout at TP 1/2/4 and the planner between them, and every refusal by name.

What a real vLLM engine makes of the same adapter (its slot tensors, bit for bit) is tests/test_lora_vllm.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from weightsync.errors import ConfigError, LayoutMismatch
from weightsync.lora.adapter import adapter_config, adapter_spec
from weightsync.lora.layouts import PeftLayout, SlotConfig, VLLMSlotLayout
from weightsync.spec import load_spec

MODEL = "tiny-qwen3-h64"
ALL = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft is not installed (make venv installs the lora extra)")


def cfg(**kw):
    base = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    base.update(kw)
    return adapter_config(base)


def test_spec_names_and_shapes_follow_peft():
    base = load_spec(MODEL)
    spec = adapter_spec(base, cfg(target_modules=["q_proj", "down_proj"]))
    names = [t.name for t in spec.tensors]
    assert names[:4] == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
                         "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight",
                         "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    by = spec.by_name
    assert by[names[0]].shape == (8, 128) and by[names[1]].shape == (256, 8)  # q: 4 heads x 64
    assert by[names[2]].shape == (8, 256) and by[names[3]].shape == (128, 8)
    assert len(spec.tensors) == 2 * 2 * base.num_layers and spec.config.scaling == 2.0
    assert adapter_config({"r": 16, "lora_alpha": 32, "target_modules": ["q_proj"], "use_rslora": True}).scaling == 8.0
    every = adapter_spec(base, cfg(target_modules="all-linear"))
    assert {t.proj for t in every.tensors} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"}
    regex = adapter_spec(base, cfg(target_modules=r".*\.1\.self_attn\.(q|v)_proj"))
    assert [t.module for t in regex.tensors][::2] == ["model.layers.1.self_attn.q_proj",
                                                      "model.layers.1.self_attn.v_proj"]
    assert spec.digest != adapter_spec(base, cfg(target_modules=["q_proj", "down_proj"], lora_alpha=17)).digest


@pytest.mark.parametrize("kw, words", [
    ({"use_dora": True}, "use_dora=True"),
    ({"bias": "lora_only"}, "bias='lora_only'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
    ({"peft_type": "IA3"}, "peft_type IA3"),
])
def test_unsupported_features_refused_by_name(kw, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
        cfg(**kw)


@pytest.mark.parametrize("model, targets, words", [
    (MODEL, ["embed_tokens"], r"\['embed_tokens'\]: weightsync does not sync LoRA on embeddings or lm_head"),
    (MODEL, ["q_proj", "lm_head"], r"\['lm_head'\]: weightsync does not sync LoRA on embeddings or lm_head"),
    (MODEL, r".*\.embed_tokens", r"model\.embed_tokens"),
    (MODEL, ["q_proj", "nope_proj"], r"\['nope_proj'\], which name no linear module"),
    ("tiny-qwen3-moe", ["gate_proj"], r"model\.layers\.0\.mlp\.experts\.0\.gate_proj"),
    ("tiny-deepseek-v3", ["q_a_proj"], r"q_a_proj"),
])
def test_targets_not_synced_refused_by_name(model, targets, words):
    with pytest.raises(ConfigError, match=words):
        adapter_spec(load_spec(model), cfg(target_modules=targets))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_slot_layout_matches_vllms_buffers_and_plans_every_element(tp):
    """Every buffer of every rank has vLLM's shape; the adapter's pieces lie in the slot, rank rows/columns 0:r; each
    rank's pieces cover exactly the canonical region vLLM's slicing gives that rank; the planner from the PEFT
    layout sends each rank exactly its pieces' elements."""
    from weightsync.plan.planner import Planner

    spec = adapter_spec(load_spec(MODEL), cfg(target_modules="all-linear"))
    layout = VLLMSlotLayout(spec, SlotConfig(tp, 3, 16, "bfloat16", 2, ALL))
    planner = Planner(PeftLayout(spec), layout)
    heads_per_rank = 4 // tp
    for rank in range(tp):
        bufs, lay = layout.buffers(rank), layout.layout(rank)
        assert len(bufs) == 2 * 2 * (3 + 1 + 2 + 1)
        assert bufs["model.layers.0.self_attn.qkv_proj.lora_b_stacked.0"][0] == (3, 1, 64 * heads_per_rank, 16)
        assert bufs["model.layers.0.self_attn.qkv_proj.lora_b_stacked.1"][0] == (3, 1, 64, 16)  # 1 KV head, replicated
        assert bufs["model.layers.0.self_attn.o_proj.lora_a_stacked.0"][0] == (3, 1, 16, 256 // tp)
        assert bufs["model.layers.1.mlp.down_proj.lora_b_stacked.0"][0] == (3, 1, 128, 16)
        for name, t in lay.tensors.items():
            assert bufs[name] == (t.shape, t.dtype)
            for p in t.pieces:
                assert p.local_box[:2] == ((2, 1), (0, 1))
        q_b = next(p for p in lay.pieces() if p.canonical.endswith("layers.0.self_attn.q_proj.lora_B.weight"))
        assert q_b.canon_box == ((rank * 64 * heads_per_rank, 64 * heads_per_rank), (0, 8))
        o_a = next(p for p in lay.pieces() if p.canonical.endswith("layers.0.self_attn.o_proj.lora_A.weight"))
        assert o_a.canon_box == ((0, 8), (rank * 256 // tp, 256 // tp))
        sent = sum(c.numel for bs in planner.send_plan(0).values() for b in bs for c in b.copies if c.dst_rank == rank)
        assert sent == sum(p.numel for p in lay.pieces())
    assert layout.scaled and all(n.endswith("lora_B.weight") for n in layout.scaled)
    assert not VLLMSlotLayout(adapter_spec(load_spec(MODEL), cfg(lora_alpha=8)), SlotConfig(tp, 3, 16, "bfloat16", 0,
                                                                                             ALL)).scaled


def test_slot_layout_refusals_name_rank_and_modules():
    spec = adapter_spec(load_spec(MODEL), cfg(r=32, target_modules=["q_proj", "down_proj"]))
    with pytest.raises(ConfigError, match=r"rank 32 is above the engine's max_lora_rank 16; the engine has no LoRA "
                                          r"wrapper for model\.layers\.0\.mlp\.down_proj"):
        VLLMSlotLayout(spec, SlotConfig(1, 2, 16, "bfloat16", 0, ALL[:3]))
    with pytest.raises(ConfigError, match="slot 2 outside 0..1"):
        VLLMSlotLayout(spec, SlotConfig(1, 2, 64, "bfloat16", 2, ALL))


@needs_peft
def test_peft_model_binds_its_adapter_only(tmp_path):
    """A real PEFT model: the bound tensors ARE its live lora_A / lora_B parameters (no base tensor), their canonical
    names and values are what ``save_pretrained`` writes, and a live adapter that differs from the derived spec is
    refused naming the tensor."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from weightsync.checkpoint.hf import build_hf_model
    from weightsync.lora.peft import PeftTrainEngine

    model = get_peft_model(build_hf_model(load_spec(MODEL), seed=0),
                           LoraConfig(r=4, lora_alpha=12, target_modules=["v_proj", "up_proj"]))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g))
    trainer = PeftTrainEngine(model)
    live = dict(model.named_parameters())
    assert set(trainer.bound.tensors) == {n for n in live if "lora_" in n}
    assert all(trainer.bound.tensors[n] is live[n] for n in trainer.bound.tensors)
    assert trainer.spec.config.dtype == "float32"  # PEFT keeps a bf16 model's adapter in fp32
    model.save_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    mine = trainer.canonical()
    assert set(mine) == set(saved) and all(torch.equal(mine[n], saved[n]) for n in saved)
    with torch.no_grad():  # a module PEFT adapted that the config does not say (a stale or edited config)
        model.peft_config["default"].target_modules = {"v_proj"}
    with pytest.raises(LayoutMismatch, match=r"unexpected tensor .*up_proj\.lora_A\.default\.weight"):
        PeftTrainEngine(model)


@pytest.mark.parametrize("dp,tp", [(2, 1), (2, 2), (3, 2)])
def test_fsdp_adapter_layout_lands_each_ranks_rows(dp, tp):
    """The ``peft-fsdp`` layout (a PEFT adapter under FSDP2: every tensor's rows chunked as ``Shard(0)`` chunks them;
    dp 3: uneven) planned into vLLM's slot layout: each rank's copies read only its own rows, every slot element is
    sent once, and all ranks' copies landed into poisoned buffers equal the unsharded PEFT model's landing bit for
    bit (the path tests/test_lora_vllm.py proves against vLLM's own load). The live FSDP2 binding: test_bind.py."""
    from helpers import (lora_canonical, lora_fsdp_shard, lora_land_copies, lora_plan_copies, lora_poisoned_slots,
                         lora_spec, lora_unsharded_landing)

    from weightsync.lora.layouts import PeftFSDPLayout
    from weightsync.plan.planner import Planner

    spec = lora_spec(r=8)
    canonical = lora_canonical(spec, seed=dp * 10 + tp)
    slot, want = lora_unsharded_landing(spec, canonical, tp)
    src = PeftFSDPLayout(spec, dp)
    planner = Planner(src, slot)
    got = lora_poisoned_slots(slot, tp)
    sent = 0
    for rank in range(dp):
        local = lora_fsdp_shard(spec, canonical, dp, rank)
        lay = src.layout(rank)
        assert {n: t.shape for n, t in lay.tensors.items()} == {n: tuple(t.shape) for n, t in local.items()
                                                                 if t.numel()}
        copies = lora_plan_copies(planner, rank, local)  # reads only this rank's own rows (its local tensors)
        sent += sum(c[4].numel() for c in copies)
        lora_land_copies(copies, got)
    assert sent == sum(p.numel for r in range(tp) for p in slot.layout(r).pieces())  # every element sent once
    for rank in range(tp):
        diff = [n for n in want[rank] if not torch.equal(got[rank][n], want[rank][n])]
        assert not diff, f"tp rank {rank}: {diff[:6]}"


def test_fsdp_adapter_layout_refusal():
    from helpers import lora_spec

    from weightsync.lora.layouts import PeftFSDPLayout

    with pytest.raises(ConfigError, match="peft-fsdp: dp must be at least 1, got 0"):
        PeftFSDPLayout(lora_spec(), 0)
