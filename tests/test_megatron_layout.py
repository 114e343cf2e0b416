"""Megatron-core layout: pure rule tests, and live checks against real megatron-core 0.16 GPTModels.

Live tests (``-m megatron``) run this file as a worker in real multi-process gloo groups on CPU:
``parallel_state.initialize_model_parallel``, ``get_gpt_decoder_block_spec(use_transformer_engine=False)``
(TE is not installed, so only the local spec is checked live), ``GPTModel`` per (pp rank, vpp chunk),
wrapped in ``Float16Module`` as Megatron's trainer does. Each worker compares names/shapes/dtypes with
the derived layout (check_live), fills the model through the layout from random canonical tensors, and
checks every ShardedTensor of Megatron's own ``sharded_state_dict()`` by value against a reference
HF->Megatron conversion written independently here (the Megatron-Bridge way: QKV merged per query
group, fc1 = cat(gate, up), experts stacked by global index).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

from weightsync.engines import make_layout
from weightsync.engines.megatron import MegatronLayout
from weightsync.errors import ConfigError
from weightsync.layout.box import box_shape, contains, full_box, intersect
from weightsync.spec.model import load_spec
from helpers import free_port as _free_port
from helpers import megatron_model as model
from helpers import tiny

try:
    import megatron.core  # noqa: F401

    HAVE_MCORE = True
except Exception:  # pragma: no cover
    HAVE_MCORE = False

needs_mcore = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not importable")


# --------------------------------------------------------------------------------------------
# Pure rule tests

RULE_CONFIGS = [
    ("tiny-llama3", "tp=2"),
    ("tiny-llama3", "tp=2,pp=2,pp_first=3,dp=2"),
    ("tiny-llama3", "pp=3,pp_last=1,te=1"),
    ("llama10", "pp=3,pp_first=2,pp_last=4,vpp=2"),
    ("llama10", "pp=4,pp_last=4,vpp=2,tp=2"),
    ("tiny-qwen2", "tp=2,dp=2,te=1"),
    ("tiny-qwen3", "pp=1,tp=2"),
    ("tiny-qwen3", "tp=2,pp=2,dp=2"),
    ("tiny-qwen3", "pp=2,vpp=2,te=1"),
    ("tiny-qwen3-moe", "tp=2,dp=2,ep=2,etp=1"),
    ("tiny-qwen3-moe", "tp=2,dp=2,ep=2"),
    ("tiny-qwen3-moe", "tp=2,dp=2,ep=4,etp=1,te=1,grouped=1"),
    ("tiny-qwen3-moe", "pp=2,vpp=2,dp=2,ep=2,etp=1"),
    ("tiny-deepseek-v3", "tp=2,pp=2,ep=2,etp=1"),
    ("tiny-deepseek-v3", "tp=4,ep=4,etp=1,te=1,grouped=1,vocab_multiple=32"),
    ("dsv3-noqlora", "tp=2,ep=2,etp=2,dp=2"),
    ("dsv3-8", "tp=2,pp=2,pp_first=2,vpp=2,ep=2,etp=1"),
]


def _ids(c):
    return f"{c[0]}:{c[1]}"


@pytest.mark.parametrize("cfg", RULE_CONFIGS, ids=[_ids(c) for c in RULE_CONFIGS])
def test_rules(cfg):
    spec = model(cfg[0])
    L = make_layout(spec, "megatron:" + cfg[1])
    assert isinstance(L, MegatronLayout)
    layouts = [L.layout(r) for r in range(L.world_size)]

    # (1) local tensors consistent: pieces inside the tensor, same shape as their canonical box, no overlap
    for lay in layouts:
        for name, t in lay.tensors.items():
            assert t.pieces
            for p in t.pieces:
                c = spec.tensor(p.canonical)
                assert contains(full_box(t.shape), p.local_box), (name, p)
                assert contains(full_box(c.shape), p.canon_box), (name, p)
                squeeze = lambda b: tuple(n for n in box_shape(b) if n != 1)  # noqa: E731
                assert squeeze(p.local_box) == squeeze(p.canon_box), (name, p)
                assert t.dtype == c.dtype  # fp32 only for e_score_correction_bias, as in the checkpoint
            for a in range(len(t.pieces)):
                for b in range(a + 1, len(t.pieces)):
                    pa, pb = t.pieces[a], t.pieces[b]
                    assert intersect(pa.local_box, pb.local_box) is None, (name, pa, pb)

    # (2) layout(rank) == what shards() says, and canonical_names(rank) is exactly the touched names
    held = defaultdict(set)  # (canonical, piece) -> ranks
    for lay in layouts:
        for p in lay.pieces():
            held[p].add(lay.rank)
        assert set(L.canonical_names(lay.rank)) == {p.canonical for p in lay.pieces()}, "canonical_names not exact"
    from_shards = {}
    for t in spec.tensors:
        for s in L.shards(t.name):
            assert s.piece not in from_shards
            from_shards[s.piece] = set(L.group_ranks(s.group))
    assert from_shards == dict(held)

    # (3) each canonical element held exactly once per data-parallel replica (dp for dense tensors,
    #     edp for experts); identical copies over tp count once; the tied lm_head copy counts apart
    for t in spec.tensors:
        shards = L.shards(t.name)
        mesh = L.meshes[shards[0].group.mesh]
        rep = "dp" if mesh.name == "dense" else "edp"
        copies = defaultdict(list)
        for s in shards:
            copies[s.piece.tensor.endswith("output_layer.weight")].append(s)
        for copy in copies.values():
            for d in range(mesh.sizes[rep]):
                cover = torch.zeros(t.shape if t.shape else (1,), dtype=torch.int32)
                for s in copy:
                    ranks = [r for r in L.group_ranks(s.group) if mesh.coords(r)[rep] == d]
                    assert ranks, (t.name, s)
                    cover[tuple(slice(o, o + n) for o, n in s.piece.canon_box)] += 1
                assert bool((cover == 1).all()), (t.name, d)
        if spec.tie_word_embeddings and t.name == "model.embed_tokens.weight":
            assert len(copies) == (2 if L.pp > 1 else 1)

    # (4) vocab padding rows hold nothing; shapes are the padded vocab over tp
    padded = -(-spec.vocab_size // (L.vocab_multiple * L.tp)) * L.vocab_multiple * L.tp
    for lay in layouts:
        for name, t in lay.tensors.items():
            if name.endswith(("word_embeddings.weight", "output_layer.weight")):
                assert t.shape == (padded // L.tp, spec.hidden_size)
                covered = sum(p.local_box[0][1] for p in t.pieces)
                tp_rank = L.dense.coords(lay.rank)["tp"]
                real = max(0, min(padded // L.tp, spec.vocab_size - tp_rank * padded // L.tp))
                assert covered == real


def test_names_local_and_te():
    spec = load_spec("tiny-qwen3-moe")
    local = set(MegatronLayout(spec, tp=2, ep=2, etp=1, dp=1).layout(1).tensors)
    te = set(MegatronLayout(spec, tp=2, ep=2, etp=1, dp=1, te=1, grouped=1).layout(1).tensors)
    assert "decoder.layers.0.input_layernorm.weight" in local
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in local and "decoder.layers.0.pre_mlp_layernorm.weight" in te
    assert "decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight" in local
    assert "decoder.layers.3.mlp.experts.linear_fc2.weight3" in te
    ds = load_spec("tiny-deepseek-v3")
    te = MegatronLayout(ds, tp=2, te=1, ep=2, etp=1).layout(0)
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te.tensors  # dense layer
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in te.tensors  # MoE layer
    assert "decoder.layers.1.input_layernorm.weight" in te.tensors  # MLA keeps its input norm
    assert te.tensors["decoder.layers.1.self_attention.linear_q_down_proj.weight"].shape == (48, 64)  # duplicated
    assert "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight" in te.tensors
    assert te.tensors["decoder.layers.1.mlp.router.expert_bias"].dtype == "float32"
    loc = MegatronLayout(ds, tp=2, ep=2, etp=1).layout(0)
    assert loc.tensors["decoder.layers.1.self_attention.linear_q_down_proj.weight"].shape == (24, 64)  # split
    assert "decoder.layers.1.self_attention.kv_layernorm.weight" in loc.tensors
    vpp = MegatronLayout(load_spec("tiny-qwen3"), pp=2, vpp=2).layout(1)
    assert set(n.split(".decoder")[0] for n in vpp.tensors if ".decoder." in n) == {"0", "1"}
    assert "1.output_layer.weight" in vpp.tensors and "1.decoder.layers.0.input_layernorm.weight" in vpp.tensors
    assert not any("output_layer" in n for n in MegatronLayout(load_spec("tiny-qwen3"), tp=2).layout(0).tensors)


def test_qkv_interleave_rows():
    spec = load_spec("tiny-llama3")  # 8 heads, 2 groups, head_dim 8
    t = MegatronLayout(spec, tp=2).layout(1).tensors["decoder.layers.0.self_attention.linear_qkv.weight"]
    got = [(p.canonical.split(".")[-2], p.local_box[0], p.canon_box[0]) for p in t.pieces]
    assert got == [("q_proj", (0, 32), (32, 32)), ("k_proj", (32, 8), (8, 8)), ("v_proj", (40, 8), (8, 8))]


@pytest.mark.parametrize(
    "preset,cfg,msg",
    [
        ("tiny-llama3", "tp=4", "num_query_groups"),
        ("tiny-llama3", "tp=3", "num_attention_heads"),
        ("tiny-llama3", "pp=2", "num_layers=5 is not divisible by pp=2"),
        ("tiny-llama3", "pp=2,pp_first=3,vpp=2", "not divisible by vpp"),
        ("tiny-llama3", "pp=3,pp_first=2", "3 middle layers not divisible by 2 middle stages"),
        ("tiny-llama3", "pp=2,pp_first=2,pp_last=2", "leaves 1 layers for 0 middle"),
        ("tiny-llama3", "vpp=2", "vpp>1 needs pp>1"),
        ("tiny-qwen3-moe", "ep=3,dp=3", "num_experts=8 is not divisible by ep=3"),
        ("tiny-qwen3-moe", "tp=2,ep=2,etp=2", "tp*dp=2 is not divisible by ep*etp=4"),
        ("tiny-qwen3-moe", "grouped=1", "grouped=1 needs te=1"),
        ("tiny-deepseek-v3", "tp=4,ep=2,etp=1,dp=2", "all padding"),
        ("tiny-deepseek-v3", "tp=4,ep=2,etp=1,dp=2,vocab_multiple=32", None),
        ("tiny-deepseek-v3", "tp=3", "num_attention_heads"),
    ],
)
def test_config_errors(preset, cfg, msg):
    spec = load_spec(preset)
    if msg is None:
        make_layout(spec, "megatron:" + cfg)
        return
    with pytest.raises(ConfigError, match=re.escape(msg)):
        make_layout(spec, "megatron:" + cfg)


def test_mla_local_spec_divisibility():
    with pytest.raises(ConfigError, match="q_lora_rank"):
        MegatronLayout(tiny("tiny-deepseek-v3", q_lora_rank=50, num_attention_heads=4), tp=4, vocab_multiple=32)
    # TE duplicates q_down, so no divisibility needed
    MegatronLayout(tiny("tiny-deepseek-v3", q_lora_rank=50, num_attention_heads=4), tp=4, te=1, vocab_multiple=32)


def test_planner_scale_deepseek_v3():
    spec = load_spec("deepseek-v3")
    spec.tensors  # the spec itself is built once, outside the per-rank cost
    L = make_layout(spec, "megatron:tp=8,pp=8,pp_first=5,pp_last=8,dp=16,ep=64")  # etp defaults to 1
    for rank in (0, 517, 1023):
        lay = L.layout(rank)
        assert lay.tensors
    assert L.world_size == 1024
    assert [L.stages[p, 0][1] for p in range(8)] == [5] + [8] * 7
    # 61 layers: 5 + 6*8 + 8; 256 experts / ep 64 = 4 local experts
    lay = L.layout(1023)
    assert "decoder.layers.7.mlp.experts.local_experts.3.linear_fc2.weight" in lay.tensors
    assert "decoder.layers.7.mlp.experts.local_experts.4.linear_fc2.weight" not in lay.tensors
    assert L.edp == 2


SPLITS = [
    (4, 2, 1, 0, 0), (8, 2, 2, 0, 0), (8, 4, 2, 0, 0), (5, 2, 1, 3, 0), (5, 3, 1, 0, 1), (10, 3, 2, 2, 4),
    (10, 4, 2, 0, 4), (10, 3, 2, 4, 0), (10, 3, 2, 2, 0), (9, 3, 1, 2, 2), (6, 2, 2, 3, 0), (12, 4, 2, 2, 2),
    (61, 8, 1, 5, 8), (7, 2, 1, 3, 4), (9, 3, 1, 1, 0),
]


@needs_mcore
@pytest.mark.megatron
@pytest.mark.parametrize("L,pp,vpp,first,last", SPLITS)
def test_pipeline_split_matches_megatron(L, pp, vpp, first, last):
    """Our stage table against megatron-core's own get_num_layers_to_build / get_transformer_layer_offset."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    spec = tiny("tiny-llama3", num_hidden_layers=L)
    try:
        cfg = TransformerConfig(
            num_layers=L, hidden_size=64, num_attention_heads=8, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, pipeline_dtype=torch.bfloat16,
            num_layers_in_first_pipeline_stage=first or None, num_layers_in_last_pipeline_stage=last or None,
        )
    except ValueError:  # megatron refuses the split: so must we
        with pytest.raises(ConfigError):
            MegatronLayout(spec, pp=pp, vpp=vpp, pp_first=first, pp_last=last)
        return
    lay = MegatronLayout(spec, pp=pp, vpp=vpp, pp_first=first, pp_last=last)
    for p in range(pp):
        for c in range(vpp):
            vp = c if vpp > 1 else None
            want = (
                get_transformer_layer_offset(cfg, vp_stage=vp, pp_rank=p),
                get_num_layers_to_build(cfg, vp_stage=vp, pp_rank=p),
            )
            assert lay.stages[p, c] == want, (p, c)


# --------------------------------------------------------------------------------------------
# Live tests: real GPTModels over gloo, one process per rank

LIVE = {
    "tp2-llama3": ("tiny-llama3", dict(tp=2)),
    "tp2-qwen2-bias": ("tiny-qwen2", dict(tp=2)),
    "pp2-qwen3-tied": ("tiny-qwen3", dict(pp=2)),
    "pp2-vpp2-qwen3-tied": ("tiny-qwen3", dict(pp=2, vpp=2)),
    "pp2-uneven-llama3": ("tiny-llama3", dict(pp=2, pp_first=3)),
    "tp2pp2-qwen3": ("tiny-qwen3", dict(tp=2, pp=2)),
    "tp2ep2-qwen3moe": ("tiny-qwen3-moe", dict(tp=2, ep=2, etp=1)),
    "ep2etp2-qwen3moe": ("tiny-qwen3-moe", dict(tp=2, dp=2, ep=2, etp=2)),
    "tp2ep2-dsv3-mla": ("tiny-deepseek-v3", dict(tp=2, ep=2, etp=1)),
    "tp2-dsv3-noqlora": ("dsv3-noqlora", dict(tp=2)),
}


def _world(case: str) -> int:
    name, kw = LIVE[case]
    return MegatronLayout(model(name), **kw).world_size


LIVE_WORLD = max(_world(c) for c in LIVE)


@functools.lru_cache(maxsize=None)
def _run_world() -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Every live case in one set of LIVE_WORLD processes: the cases of each world size run on that many
    first ranks, in a torch.distributed world of their own (megatron-core's parallel state is torn down
    and set up again between cases). Process starts and imports (4 s a process) are most of a case's cost
    on CI's two cores; one world per size cost 2 processes more. Returns each rank's (return code, output)."""
    batches = [(w, [c for c in LIVE if _world(c) == w]) for w in sorted({_world(c) for c in LIVE})]
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=path)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, json.dumps(dict(batches=batches, rank=r, world=LIVE_WORLD, port=port))],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
        )
        for r in range(LIVE_WORLD)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60 + 60 * len(LIVE))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return tuple(p.returncode for p in procs), tuple(outs)


@needs_mcore
@pytest.mark.megatron
@pytest.mark.xdist_group("megatron-live")
@pytest.mark.parametrize("case", list(LIVE))
def test_live_megatron(case):
    codes, outs = _run_world()
    for r in range(_world(case)):
        out = outs[r]
        assert f"OK {case} rank {r}\n" in out, f"rank {r} (exit {codes[r]}) did not pass {case}:\n{out[-6000:]}"


# ---- worker side ---------------------------------------------------------------------------


def _reference_globals(spec, L, canon):
    """HF canonical tensors -> Megatron global (unsharded) tensors keyed like sharded_state_dict, computed
    independently of the layout (the Megatron-Bridge / HF-converter way)."""
    a = spec.attention
    out = {}
    padded = L.padded_vocab

    def pad(w):
        full = torch.full((padded,) + tuple(w.shape[1:]), float("nan"), dtype=w.dtype)
        full[: w.shape[0]] = w
        return full

    out["embedding.word_embeddings.weight"] = pad(canon["model.embed_tokens.weight"])
    head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    out["output_layer.weight"] = pad(canon[head])
    out["decoder.final_layernorm.weight"] = canon["model.norm.weight"]
    for layer in spec.layers:
        h, m = f"model.layers.{layer.index}.", f"decoder.layers.{layer.index}."
        g = lambda n: canon[h + n]  # noqa: E731
        # local-spec keys map: input_layernorm -> linear_qkv.layer_norm_, pre_mlp_layernorm -> linear_fc1.layer_norm_
        if a.kind == "gqa":
            out[m + "self_attention.linear_qkv.layer_norm_weight"] = g("input_layernorm.weight")
            ng, hd = a.num_kv_heads, a.head_dim
            for suf in ("weight", "bias") if a.qkv_bias else ("weight",):
                q, k, v = (g(f"self_attn.{x}_proj.{suf}") for x in "qkv")
                tail = q.shape[1:]
                qkv = torch.cat([q.reshape(ng, -1, *tail), k.reshape(ng, hd, *tail), v.reshape(ng, hd, *tail)], dim=1)
                out[m + f"self_attention.linear_qkv.{suf}"] = qkv.reshape(-1, *tail)
            if a.qk_norm:
                out[m + "self_attention.q_layernorm.weight"] = g("self_attn.q_norm.weight")
                out[m + "self_attention.k_layernorm.weight"] = g("self_attn.k_norm.weight")
        else:
            out[m + "input_layernorm.weight"] = g("input_layernorm.weight")
            if a.q_lora_rank:
                out[m + "self_attention.linear_q_down_proj.weight"] = g("self_attn.q_a_proj.weight")
                out[m + "self_attention.q_layernorm.weight"] = g("self_attn.q_a_layernorm.weight")
                out[m + "self_attention.linear_q_up_proj.weight"] = g("self_attn.q_b_proj.weight")
            else:
                out[m + "self_attention.linear_q_proj.weight"] = g("self_attn.q_proj.weight")
            out[m + "self_attention.linear_kv_down_proj.weight"] = g("self_attn.kv_a_proj_with_mqa.weight")
            out[m + "self_attention.kv_layernorm.weight"] = g("self_attn.kv_a_layernorm.weight")
            out[m + "self_attention.linear_kv_up_proj.weight"] = g("self_attn.kv_b_proj.weight")
        out[m + "self_attention.linear_proj.weight"] = g("self_attn.o_proj.weight")
        # checkpoint key (sharded_state_dict_keys_map of the non-MLA local spec, MoE layers included);
        # the parameter itself is pre_mlp_layernorm.weight
        norm = "mlp.linear_fc1.layer_norm_weight" if a.kind == "gqa" else "pre_mlp_layernorm.weight"
        out[m + norm] = g("post_attention_layernorm.weight")
        if not layer.moe:
            out[m + "mlp.linear_fc1.weight"] = torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")])
            out[m + "mlp.linear_fc2.weight"] = g("mlp.down_proj.weight")
            continue
        out[m + "mlp.router.weight"] = g("mlp.gate.weight")
        if layer.router_bias:
            out[m + "mlp.router.expert_bias"] = g("mlp.gate.e_score_correction_bias")
        E = range(layer.num_experts)
        out[m + "mlp.experts.experts.linear_fc1.weight"] = torch.stack(
            [torch.cat([g(f"mlp.experts.{e}.gate_proj.weight"), g(f"mlp.experts.{e}.up_proj.weight")]) for e in E]
        )
        out[m + "mlp.experts.experts.linear_fc2.weight"] = torch.stack(
            [g(f"mlp.experts.{e}.down_proj.weight") for e in E]
        )
        if layer.shared_intermediate_size:
            out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                [g("mlp.shared_experts.gate_proj.weight"), g("mlp.shared_experts.up_proj.weight")]
            )
            out[m + "mlp.shared_experts.linear_fc2.weight"] = g("mlp.shared_experts.down_proj.weight")
    return out


def _worker(args):  # pragma: no cover - runs in subprocesses
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    # CPU shims: megatron-core allocates router buffers on torch.cuda.current_device() and moves the tied
    # embedding copy with .cuda() before its all-reduce; neither creates or renames a parameter.
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    rank, world = args["rank"], args["world"]
    wait = datetime.timedelta(seconds=300)  # the ranks of a larger world wait while the smaller ones' cases run
    base = dist.TCPStore("127.0.0.1", args["port"], world, is_master=rank == 0, timeout=wait, wait_for_workers=False)
    for w, cases in args["batches"]:
        if rank >= w:
            continue
        store = dist.PrefixStore(f"world{w}/", base)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=w, timeout=datetime.timedelta(seconds=60))
        for case in cases:  # a failed case ends the process: the ranks' collectives are out of step then
            name, kw = LIVE[case]
            _check_case(name, kw, rank)
            ps.destroy_model_parallel()
            dist.barrier()
            print(f"OK {case} rank {rank}", flush=True)
        dist.destroy_process_group()
    base.set(f"done{rank}", "1")
    if rank == 0:  # it serves the store: every rank must be done with it first
        base.wait([f"done{r}" for r in range(world)])


def _check_case(name: str, kw: dict, rank: int) -> None:  # pragma: no cover - runs in subprocesses
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module

    from weightsync.layout.layout import check_live
    from weightsync.layout.materialize import TORCH_DTYPES, DTYPE_NAMES, fill_from
    from weightsync.local.trainers import mcore_config as _mcore_config

    spec = model(name)
    L = MegatronLayout(spec, **kw)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=L.tp, pipeline_model_parallel_size=L.pp,
        virtual_pipeline_model_parallel_size=L.vpp if L.vpp > 1 else None,
        expert_model_parallel_size=L.ep, expert_tensor_parallel_size=L.etp,
    )
    # rank -> mesh coordinates, as parallel_state's RankGenerator assigns them
    d, e = L.dense.coords(rank), L.expert.coords(rank)
    got = dict(
        tp=ps.get_tensor_model_parallel_rank(), dp=ps.get_data_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_rank(), ep=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_rank(), edp=ps.get_expert_data_parallel_rank(),
    )
    assert got == dict(tp=d["tp"], dp=d["dp"], pp=d["pp"], ep=e["ep"], etp=e["etp"], edp=e["edp"]), (got, d, e)

    cfg = _mcore_config(spec, L)
    if spec.attention.kind == "mla":
        # megatron-core 0.16 on a machine without TE: HAVE_TE is True (the extension module imports) but
        # TELinear is None, and the local DotProductAttention refuses MLA's k_channels. Both only concern
        # parameter-free code paths; the stub attention has no parameters.
        import megatron.core.transformer.multi_latent_attention as mla

        mla.HAVE_TE = False

    class NoParamAttention(torch.nn.Module):
        def __init__(self, *a, **k):
            super().__init__()

    torch.manual_seed(1234 + rank)
    p = d["pp"]
    chunks = []
    for c in range(L.vpp):
        vp = c if L.vpp > 1 else None
        block = get_gpt_decoder_block_spec(
            cfg, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp, pp_rank=p
        )
        if spec.attention.kind == "mla":
            for ls in block.layer_specs:
                ls.submodules.self_attention.submodules.core_attention = NoParamAttention
        m = GPTModel(
            cfg, block, vocab_size=L.padded_vocab, max_sequence_length=64,
            pre_process=(p == 0 and c == 0), post_process=(p == L.pp - 1 and c == L.vpp - 1),
            share_embeddings_and_output_weights=spec.tie_word_embeddings, position_embedding_type="rope", vp_stage=vp,
        )
        Float16Module(cfg, m)  # what Megatron's get_model does for bf16: casts m in place
        m.state_dict()  # routers switch their expert_bias back to fp32 (router._maintain_float32_expert_bias)
        chunks.append(m)

    prefix = lambda c: f"{c}." if L.vpp > 1 else ""  # noqa: E731
    local = {}
    for c, m in enumerate(chunks):
        persistent = set(m.state_dict(keep_vars=True))
        for n, t in m.named_parameters():
            local[prefix(c) + n] = t
        for n, t in m.named_buffers():
            if n in persistent:
                local[prefix(c) + n] = t
    lay = L.layout(rank)
    live = {n: (tuple(t.shape), DTYPE_NAMES[t.dtype]) for n, t in local.items()}
    check_live(lay, live, where=f"megatron rank {rank}")

    # fill through the layout from random canonical tensors (same seed on every rank)
    gen = torch.Generator().manual_seed(7)
    canon = {}
    for t in spec.tensors:
        canon[t.name] = (torch.randn(t.shape, generator=gen) + 2.0).to(TORCH_DTYPES[t.dtype])
    with torch.no_grad():
        for t in local.values():
            t.fill_(float("nan"))
        fill_from(lay, {n: t.data for n, t in local.items()}, canon)

    ref = _reference_globals(spec, L, canon)
    checked = 0
    for c, m in enumerate(chunks):
        sd = m.sharded_state_dict()
        apply_factories(sd)
        for st in nested_values(sd):
            if not isinstance(st, ShardedTensor) or st.key.endswith("_extra_state"):
                continue
            key, offset, gshape, pre = st.key, tuple(st.global_offset), tuple(st.global_shape), st.prepend_axis_num
            if key.startswith("decoder.layers.") and not key.split(".")[2].isdigit():
                # transformer layers are stacked on a prepended axis (TransformerBlock.sharded_state_dict)
                key = f"decoder.layers.{offset[0]}." + key[len("decoder.layers."):]
                offset, gshape, pre = offset[1:], gshape[1:], pre - 1
            assert key in ref, f"no reference for sharded key {st.key} ({key})"
            g = ref[key]
            assert gshape == tuple(g.shape), (st.key, gshape, g.shape)
            # remaining prepended axis: the global expert index (one expert per local tensor)
            sl = tuple(slice(o, o + n) for o, n in zip(offset, (1,) * pre + tuple(st.local_shape)))
            want = g[sl].reshape(st.data.shape)
            data = st.data
            real = ~torch.isnan(want.float())
            assert bool(real.any()), st.key
            assert torch.equal(data[real], want[real]), f"rank {rank} {st.key} offset {st.global_offset}: values differ"
            assert not bool(torch.isnan(data.float()[real]).any())
            checked += 1
    assert checked > 0
    # every local element that holds real data was written (no NaN left outside vocab padding)
    for n, t in local.items():
        if not n.endswith(("word_embeddings.weight", "output_layer.weight")):
            assert not bool(torch.isnan(t.float()).any()), f"{n} has elements no piece wrote"
    dist.barrier()
    print(f"rank {rank}: {len(local)} tensors, {checked} sharded tensors checked", flush=True)


if __name__ == "__main__":  # pragma: no cover
    _worker(json.loads(sys.argv[1]))
