"""Bindings of LIVE engine objects (weightsync.bind): real transformers modules in-process, real FSDP2 and
real megatron-core GPTModels in 2-process gloo worlds on CPU.

Every case checks (1) the constructor derived the parallel config and rank from the live objects,
(2) the bound tensors are exactly the layout's (names, shapes, dtypes: check_live passed), (3) writing
canonical values through the layout into the bound tensors in place changes the model as the model
itself reports it (state_dict / full_tensor), and (4) a wrong model spec raises LayoutMismatch naming
the tensor, the shapes and the rank.

Run as a script (``python tests/test_bind.py worker JSON``) it is one rank of a live world.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import pytest  # noqa: E402
import torch  # noqa: E402

from weightsync.bind import Bound, dtype_name  # noqa: E402
from weightsync.engines.hf import HFLayout  # noqa: E402
from weightsync.errors import LayoutMismatch  # noqa: E402
from weightsync.layout.materialize import fill_from, scatter  # noqa: E402
from weightsync.spec.model import load_spec, spec_from_config  # noqa: E402
from weightsync.testing import random_canonical  # noqa: E402


def wrong(spec_or_cfg, **changes):
    """The same model config with some sizes changed: a spec that does not describe the live model."""
    cfg = dict(spec_or_cfg.config if hasattr(spec_or_cfg, "config") else spec_or_cfg)
    cfg.update(changes)
    return spec_from_config(cfg, name="wrong")


def assert_bound(b: Bound) -> None:
    assert set(b.tensors) == set(b.layout.tensors)
    for name, t in b.layout.tensors.items():
        live = b.tensors[name]
        assert tuple(live.shape) == t.shape and dtype_name(live.dtype) == t.dtype, name


# --------------------------------------------------------------------------------------------
# HF, in process


def router_keys(module) -> dict[str, int]:
    """The ``fp32_*`` keys a DeepSeek-V3 module's own dtypes say, read off the module here."""
    gates = [layer.mlp.gate for layer in module.model.layers if hasattr(layer.mlp, "gate")]
    return {
        "fp32_router": int(all(g.weight.dtype == torch.float32 for g in gates)),
        "fp32_router_bias": int(all(g.e_score_correction_bias.dtype == torch.float32 for g in gates)),
    }


def loaded(module, directory: Path):
    """``module`` saved and loaded back with ``from_pretrained``: the installed transformers'
    ``_keep_in_fp32_modules_strict`` applied, which the layouts' auto ``fp32_*`` keys follow."""
    from transformers import AutoModelForCausalLM

    module.save_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)


def check_writes(b: Bound, module, seed: int = 3) -> None:
    """Canonical values written in place through the layout are what the module's state_dict holds."""
    canonical = random_canonical(b.spec, seed=seed)
    with torch.no_grad():
        fill_from(b.layout, b.tensors, canonical)
    want = scatter(b.layout, canonical)
    sd = module.state_dict()
    for name in b.layout.tensors:
        assert torch.equal(sd[name], want[name]), f"{name}: in-place write not visible in state_dict"


@pytest.mark.parametrize("load", ["from_config", "from_pretrained"])
@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
@pytest.mark.parametrize("side", ["train", "infer"])
def test_hf_bind_and_write(model, side, load, tmp_path):
    from hf_models import build_hf_model

    from weightsync.bind import HFInferenceEngine, HFTrainEngine

    from helpers import build_model, preset

    spec = load_spec(model)
    torch.manual_seed(0)
    # from_config as a user may call it (no fp32 list applied), or a real checkpoint load
    module = build_model(preset(model)) if load == "from_config" else loaded(build_hf_model(spec), tmp_path)
    eng = (HFTrainEngine if side == "train" else HFInferenceEngine)(module)
    b = eng.bound
    assert b.rank == 0 and b.layout.engine == "hf" and b.spec.digest == spec.digest  # spec read from module.config
    assert_bound(b)
    # derived == the preset's layout, piece for piece: a model transformers loaded holds what the auto
    # rule (the installed transformers' list) says; one built with from_config, which applies no fp32
    # list, what its own dtypes say -- and the description records it for the other end of a job
    keys = router_keys(module) if model == "tiny-deepseek-v3" else {}
    ref = HFLayout(spec, **({} if load == "from_pretrained" else keys))
    assert {n: (t.shape, t.dtype, t.pieces) for n, t in b.layout.tensors.items()} == {
        n: (t.shape, t.dtype, t.pieces) for n, t in ref.layout(0).tensors.items()
    }
    assert b.engine.describe() == ref.describe() == HFLayout(spec, **keys).describe()
    if model == "tiny-deepseek-v3":
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert bias in b.tensors and b.tensors[bias] is dict(module.named_buffers())[bias]
        if load == "from_pretrained":  # every transformers 5 keeps it in fp32 when it loads a bf16 model
            assert b.tensors[bias].dtype == torch.float32 and b.engine.config.fp32_router_bias == 1
    check_writes(b, module)


def deepseek_as_524_builds_it(spec):
    """A DeepSeek-V3 module in the form transformers 5.24 builds in memory: router weight and
    ``e_score_correction_bias`` fp32 beside bf16 weights (5.24 creates them fp32 and lists both in
    ``_keep_in_fp32_modules_strict``; 5.19-5.23 list only the bias)."""
    from hf_models import build_hf_model

    torch.manual_seed(0)
    module = build_hf_model(spec)
    for layer in module.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.float()
    return module


@pytest.mark.parametrize("side", ["train", "infer"])
def test_hf_bind_follows_a_fp32_router(side):
    # the 5.24 rule, set explicitly: the binding reads it off the live router, whatever transformers is here
    from weightsync.bind import HFInferenceEngine, HFTrainEngine

    spec = load_spec("tiny-deepseek-v3")
    module = deepseek_as_524_builds_it(spec)
    b = (HFTrainEngine if side == "train" else HFInferenceEngine)(module).bound
    assert_bound(b)
    assert b.engine.describe() == "hf:fp32_router=1,fp32_router_bias=1"
    ref = HFLayout(spec, fp32_router=1, fp32_router_bias=1).layout(0)
    assert b.layout.tensors == ref.tensors
    assert b.tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    check_writes(b, module, seed=4)


@pytest.mark.parametrize("strict,fp32_router", [
    (["e_score_correction_bias"], 0),  # transformers 5.19-5.23
    (["e_score_correction_bias", "gate.weight"], 1),  # transformers 5.24
])
def test_auto_follows_the_installed_transformers_list(strict, fp32_router, tmp_path, monkeypatch):
    # the class's list set to each version's, then a real from_pretrained under it: the auto rule and
    # the loaded model agree, and a binding of it derives the auto layout
    from hf_models import build_hf_model
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3PreTrainedModel

    from weightsync.bind import HFTrainEngine

    monkeypatch.setattr(DeepseekV3PreTrainedModel, "_keep_in_fp32_modules_strict", strict)
    spec = load_spec("tiny-deepseek-v3")
    auto = HFLayout(spec)
    assert auto.config.fp32_router == fp32_router and auto.config.fp32_router_bias == 1
    module = loaded(build_hf_model(spec), tmp_path)
    assert router_keys(module) == {"fp32_router": fp32_router, "fp32_router_bias": 1}
    b = HFTrainEngine(module).bound
    assert b.engine.describe() == auto.describe() and b.layout.tensors == auto.layout(0).tensors


def test_hf_wrong_model_raises():
    from hf_models import build_hf_model

    from weightsync.bind import HFTrainEngine

    spec = load_spec("tiny-qwen3-moe")
    module = build_hf_model(spec)
    with pytest.raises(LayoutMismatch) as e:
        HFTrainEngine(module, spec=wrong(spec, hidden_size=96))
    msg = str(e.value)
    assert "hf rank 0" in msg
    assert "tensor model.embed_tokens.weight: live shape [250, 64], derived [250, 96]" in msg
    # a config that lies about the module (spec read from module.config)
    module.config.moe_intermediate_size = 16
    with pytest.raises(LayoutMismatch, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj: live shape \[8, 64, 64\], derived \[8, 32, 64\]"):
        HFTrainEngine(module)
    # dtype: an all-fp32 copy of a bf16-config model is a trainer's fp32 master weights ...
    module.config.moe_intermediate_size = 32
    assert HFTrainEngine(module.float()).engine.describe() == "hf:fp32=1"
    # ... but one tensor in another dtype than the rest is a mismatch, named
    mixed = build_hf_model(spec)
    mixed.model.norm.weight.data = mixed.model.norm.weight.data.float()
    with pytest.raises(LayoutMismatch, match="model.norm.weight: live dtype float32, derived bfloat16"):
        HFTrainEngine(mixed)


def test_fsdp_engine_refuses_unsharded_module():
    from hf_models import build_hf_model

    from weightsync.bind import FSDPTrainEngine
    from weightsync.errors import ConfigError

    with pytest.raises(ConfigError, match="no DTensor parameter"):
        FSDPTrainEngine(build_hf_model(load_spec("tiny-qwen3")))


# --------------------------------------------------------------------------------------------
# Multi-process worlds


def run_world(world: int, job: dict, timeout: float = 120) -> list[str]:
    from helpers import run_rank_processes

    return run_rank_processes(__file__, job, world, timeout)


def test_fsdp2_dp2_live():
    run_world(2, {"kind": "fsdp"})


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed (the lora extra)")
def test_fsdp2_peft_lora_live():
    """A PEFT LoRA model under FSDP2 (``fully_shard`` per decoder layer and the root, gloo, real DTensors) binds like
    any trainer: only the adapter's ``lora_A`` / ``lora_B`` local shards are bound (nothing of the base), each rank's
    its own rows of the unsharded adapter bit for bit; written in place they are what ``full_tensor()`` gathers;
    both ranks' plans into vLLM's slot layout (TP 2), landed together into poisoned buffers, equal the unsharded
    model's landing; and after a training step (forward, backward, AdamW) the binding still holds the live shards."""
    run_world(2, {"kind": "peft-fsdp"}, timeout=240)


def _have_mcore() -> bool:
    """Without importing it here (seconds): the workers do."""
    import importlib.util

    try:
        return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


HAVE_MCORE = _have_mcore()


@pytest.mark.megatron
@pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not importable")
def test_megatron_tp2_pp2_live():
    run_world(2, {"kind": "megatron"})


# ---- worker side ---------------------------------------------------------------------------


def _fsdp_worker(rank: int, world: int) -> None:  # pragma: no cover - runs in subprocesses
    from torch.distributed.device_mesh import init_device_mesh
    from helpers import build_model, hf_tensors, preset

    from weightsync.bind import FSDPTrainEngine
    from weightsync.local.trainers import apply_tp, shard_fsdp

    cases = [  # (preset, mesh shape, mesh dim names or None for "tell by placements")
        ("tiny-qwen3-moe", (2,), ("dp",)),
        ("tiny-deepseek-v3", (2,), ("dp",)),  # router and its bias as from_config makes them here
        ("tiny-deepseek-v3:fp32-router", (2,), ("dp",)),  # as transformers 5.24 makes them: fp32
        ("tiny-llama3", (1, 2), ("outer", "inner")),  # dp=1 x tp=2, dims told apart by placements
    ]
    for case, shape, names in cases:
        name, _, variant = case.partition(":")
        cfg = preset(name)
        spec = spec_from_config(cfg)
        torch.manual_seed(0)
        model = build_model(cfg)
        if variant == "fp32-router":
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.float()
        if len(shape) == 2:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            apply_tp(model, mesh[names[1]], spec.tie_word_embeddings)
            dp_mesh = mesh[names[0]]
        else:
            dp_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        shard_fsdp(model, dp_mesh)  # an fp32 router is a group of its own (FSDP2: one dtype per group)

        eng = FSDPTrainEngine(model)
        b = eng.bound
        dp, tp = (2, 1) if len(shape) == 1 else (1, 2)
        assert (eng.engine.dp, eng.engine.tp) == (dp, tp), eng.engine.config
        assert b.rank == rank, (b.rank, rank)  # dp-major, tp fastest: the process rank here
        assert_bound(b)
        params = dict(model.named_parameters())
        for n, t in b.tensors.items():
            if n in params:  # the DTensor's local shard itself, not a copy
                assert t is params[n]._local_tensor, n
                assert t.untyped_storage().data_ptr() == params[n].to_local().untyped_storage().data_ptr(), n
        if name == "tiny-deepseek-v3":
            assert "model.layers.1.mlp.gate.e_score_correction_bias" in b.tensors
            gate = model.model.layers[1].mlp.gate  # the description records the live router's dtypes
            want_keys = dict(fp32_router=int(gate.weight.dtype == torch.float32),
                             fp32_router_bias=int(gate.e_score_correction_bias.dtype == torch.float32))
            if variant:
                assert want_keys == {"fp32_router": 1, "fp32_router_bias": 1}
            assert {k: getattr(eng.engine.config, k) for k in want_keys} == want_keys, eng.engine.describe()

        canonical = random_canonical(spec, seed=5)  # same on every rank
        with torch.no_grad():
            fill_from(b.layout, b.tensors, canonical)
        hf = hf_tensors(spec, canonical)
        sd = model.state_dict()
        for n, p in model.named_parameters():  # collective: same order on every rank
            full = p.full_tensor()
            assert torch.equal(full, hf[n]), f"rank {rank} {name}: full_tensor of {n} lacks the in-place write"
            if n in b.tensors:
                assert torch.equal(sd[n].to_local(), b.tensors[n]), n
        for n, x in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # rounded to the buffer's dtype, as a load would
                assert torch.equal(x, hf[n].to(x.dtype)), n

        try:
            FSDPTrainEngine(model, spec=wrong(cfg, vocab_size=260))
        except LayoutMismatch as e:
            msg = str(e)
            assert f"rank {rank}" in msg and "model.embed_tokens.weight: live shape" in msg, msg
        else:
            raise AssertionError("a wrong vocab size must not bind")
        print(f"rank {rank} {name}: {eng!r}", flush=True)
        torch.distributed.barrier()


MEGATRON_CASES = [  # (model, parallel config the world is initialised with)
    ("tiny-deepseek-v3", dict(tp=2, ep=2, etp=1)),  # MLA, shared experts, router expert_bias buffer
    ("tiny-qwen3", dict(pp=2, vpp=2)),  # tied embeddings: last stage's output_layer copy, "{chunk}." names
    ("tiny-llama3", dict(pp=2, pp_first=3)),  # uneven stages from the TransformerConfig
]


def _megatron_worker(rank: int, world: int) -> None:  # pragma: no cover - runs in subprocesses
    # CPU shims as in tests/test_megatron_layout.py: router buffers on torch.cuda.current_device(), .cuda() on
    # the tied embedding copy; neither creates or renames a parameter.
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module
    from helpers import megatron_model as model

    from weightsync.local.trainers import mcore_config

    import megatron.core.transformer.multi_latent_attention as mla
    from weightsync.bind import MegatronTrainEngine
    from weightsync.engines.megatron import MegatronLayout

    mla.HAVE_TE = False  # see test_megatron_layout._worker: no TE here, local MLA path only

    class NoParamAttention(torch.nn.Module):
        def __init__(self, *a, **k):
            super().__init__()

    for name, kw in MEGATRON_CASES:
        spec = model(name)
        want = MegatronLayout(spec, **kw)  # only to build the model; the binding reads parallel_state
        ps.initialize_model_parallel(
            tensor_model_parallel_size=want.tp, pipeline_model_parallel_size=want.pp,
            virtual_pipeline_model_parallel_size=want.vpp if want.vpp > 1 else None,
            expert_model_parallel_size=want.ep, expert_tensor_parallel_size=want.etp,
        )
        cfg = mcore_config(spec, want)
        p = ps.get_pipeline_model_parallel_rank()
        torch.manual_seed(1234 + rank)
        wrapped = []
        for c in range(want.vpp):
            vp = c if want.vpp > 1 else None
            block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp, pp_rank=p)
            if spec.attention.kind == "mla":
                for ls in block.layer_specs:
                    ls.submodules.self_attention.submodules.core_attention = NoParamAttention
            m = GPTModel(
                cfg, block, vocab_size=want.padded_vocab, max_sequence_length=64,
                pre_process=(p == 0 and c == 0), post_process=(p == want.pp - 1 and c == want.vpp - 1),
                share_embeddings_and_output_weights=spec.tie_word_embeddings, position_embedding_type="rope", vp_stage=vp,
            )
            wrapped.append(Float16Module(cfg, m))  # the trainer's wrapper: the binding unwraps it

        eng = MegatronTrainEngine(wrapped, dict(spec.config))  # a config dict, as from config.json
        b = eng.bound
        assert eng.engine.config == want.config, (eng.engine.config, want.config)
        assert b.rank == rank, (b.rank, rank)
        assert_bound(b)
        chunks = [w.module for w in wrapped]
        if spec.layers[-1].router_bias:
            biases = [n for n in b.tensors if n.endswith("mlp.router.expert_bias")]
            assert biases and all(b.tensors[n].dtype == torch.float32 for n in biases), sorted(b.tensors)
        if want.vpp > 1:
            assert all(n.split(".", 1)[0] in ("0", "1") for n in b.tensors)

        canonical = random_canonical(spec, seed=9)  # same on every rank
        with torch.no_grad():
            fill_from(b.layout, b.tensors, canonical)
        expect = scatter(b.layout, canonical)  # NaN where no piece lands (vocab padding rows)
        checked = 0
        for c, m in enumerate(chunks):
            sd = m.state_dict()
            pre = f"{c}." if want.vpp > 1 else ""
            for n in b.layout.tensors:
                if not n.startswith(pre):
                    continue
                got, exp = sd[n[len(pre):]], expect[n]
                real = ~torch.isnan(exp.float())
                assert bool(real.any()) and torch.equal(got[real], exp[real]), f"rank {rank} {name}: {n} not written"
                checked += 1
        assert checked == len(b.layout.tensors), (checked, len(b.layout.tensors))

        try:
            MegatronTrainEngine(wrapped, wrong(spec, num_attention_heads=spec.attention.num_heads * 2))
        except LayoutMismatch as e:
            msg = str(e)
            assert f"rank {rank}" in msg and "live shape" in msg and "self_attention." in msg, msg
        else:
            raise AssertionError("a wrong head count must not bind")
        print(f"rank {rank} {name}: {eng!r} coords={eng.coords}", flush=True)
        torch.distributed.barrier()
        ps.destroy_model_parallel()


def _peft_fsdp_worker(rank: int, world: int) -> None:  # pragma: no cover - runs in subprocesses
    """A PEFT adapter under FSDP2 (test_fsdp2_peft_lora_live)."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from weightsync.checkpoint.hf import build_hf_model
    from weightsync.layout.box import slices
    from weightsync.lora.adapter import peft_names
    from weightsync.lora.layouts import PeftFSDPLayout
    from weightsync.lora.peft import PeftTrainEngine
    from weightsync.plan.planner import Planner
    from weightsync.spec import load_spec

    from helpers import (LORA_MODEL, LORA_PROJ, lora_canonical, lora_fsdp_shard, lora_land_copies, lora_plan_copies,
                         lora_poisoned_slots, lora_unsharded_landing, lora_vocab)

    model = get_peft_model(build_hf_model(load_spec(LORA_MODEL), seed=0),
                           LoraConfig(r=8, lora_alpha=16, target_modules=LORA_PROJ, lora_dropout=0.0))
    g = torch.Generator().manual_seed(5)  # the same adapter on every rank, lora_B too (PEFT starts it at zero)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g))
    whole = PeftTrainEngine(model)  # unsharded: the reference
    canonical = whole.canonical()
    spec = whole.spec

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in model.get_base_model().model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    trainer = PeftTrainEngine(model)
    b = trainer.bound
    assert isinstance(b.engine, PeftFSDPLayout) and b.engine.dp == world and b.rank == rank, b.engine.describe()
    assert trainer.spec.digest == spec.digest
    params = dict(model.named_parameters())
    names = peft_names(spec)
    assert set(b.tensors) == {n for n in params if "lora_" in n}  # nothing of the base
    for n, t in b.tensors.items():
        assert isinstance(params[n], DTensor) and t is params[n]._local_tensor, n
    mine = lora_fsdp_shard(spec, canonical, world, rank)
    for canon, live in names.items():
        assert torch.equal(b.tensors[live], mine[live]), f"rank {rank}: {live} is not its rows of the adapter"

    # the bound tensors are the live shards: written in place, they are what full_tensor() gathers
    fresh = lora_canonical(spec, seed=9)
    with torch.no_grad():
        for p in b.layout.pieces():
            b.tensors[p.tensor][slices(p.local_box)].copy_(fresh[p.canonical][slices(p.canon_box)])
    for canon, live in names.items():  # collective: the same order on every rank
        assert torch.equal(params[live].full_tensor(), fresh[canon]), f"rank {rank}: {live} after an in-place write"

    # both ranks' plans into vLLM's slot layout (TP 2) landed together: the unsharded landing, bit for bit
    slot, want = lora_unsharded_landing(spec, fresh, 2)
    sent = lora_plan_copies(Planner(b.engine, slot), rank, dict(b.tensors))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, sent)
    got = lora_poisoned_slots(slot, 2)
    for copies in gathered:
        lora_land_copies(copies, got)
    for tp_rank in range(2):
        diff = [n for n in want[tp_rank] if not torch.equal(got[tp_rank][n], want[tp_rank][n])]
        assert not diff, f"rank {rank}, slot tp rank {tp_rank}: {diff[:6]}"

    # a training step under FSDP2 (forward, backward, AdamW on the adapter): the binding still holds the live shards
    before = {n: t.clone() for n, t in b.tensors.items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = torch.randint(0, lora_vocab(model), (2, 16), generator=torch.Generator().manual_seed(rank))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    params = dict(model.named_parameters())
    for n, t in b.tensors.items():
        assert t.data_ptr() == params[n].to_local().data_ptr(), f"rank {rank}: {n} moved"
    assert any(not torch.equal(before[n], t) for n, t in b.tensors.items()), "the step changed nothing"

    # bound while unsharded (FSDP2 swapped the whole parameters in): refused, every rank would be rank 0 on storage
    # freed at the next reshard
    from torch.distributed.fsdp import FSDPModule

    from weightsync.errors import ConfigError

    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        m.unshard()
    assert not any(isinstance(p, DTensor) for n, p in model.named_parameters() if "lora_" in n)
    with pytest.raises(ConfigError, match="unsharded now"):
        PeftTrainEngine(model)
    for m in fsdp_modules:
        m.reshard()


def _worker(job: dict) -> None:  # pragma: no cover - runs in subprocesses
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    {"fsdp": _fsdp_worker, "megatron": _megatron_worker, "peft-fsdp": _peft_fsdp_worker}[job["kind"]](rank, world)
    dist.barrier()
    dist.destroy_process_group()
    print(f"RANK {rank} OK", flush=True)
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads can abort there


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    _worker(json.loads(sys.argv[2]))
