"""The ``fsdp`` layout: pure rule checks against an independent torch.chunk model, and live checks
against real FSDP2 (+ TP) shards of real transformers models on multi-process gloo groups.

Run as a script (``python tests/test_fsdp_layout.py worker JSON``) it is one rank of a live check.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

from weightsync.engines import make_layout  # noqa: E402
from weightsync.engines.fsdp import FSDPLayout  # noqa: E402
from weightsync.errors import ConfigError  # noqa: E402
from weightsync.layout.box import contains, full_box  # noqa: E402
from weightsync.layout.layout import check_live  # noqa: E402
from weightsync.layout.materialize import DTYPE_NAMES, TORCH_DTYPES, canonical_view, local_view, scatter  # noqa: E402
from weightsync.local.trainers import apply_tp as _apply_tp  # noqa: E402
from weightsync.spec.model import ModelSpec, load_spec, spec_from_config  # noqa: E402
from helpers import EXPERT, hf_tensors, preset  # noqa: E402
from helpers import build_model as _build_model  # noqa: E402
from helpers import free_port as _free_port  # noqa: E402

# The test's own statement of the torchtitan TP plan: hf tensor suffix -> sharded dim.
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def variant(name: str, **changes) -> dict:
    cfg = preset(name)
    cfg.update(changes)
    return cfg


def ref_tp_dim(name: str, tp: int) -> int | None:
    if tp == 1:
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0
    for m in COLWISE:
        if name.endswith(f".{m}.weight") or name.endswith(f".{m}.bias"):
            return 0
    for m in ROWWISE:
        if name.endswith(f".{m}.weight"):
            return 1
    return None


def is_buffer(name: str) -> bool:
    return name.endswith("e_score_correction_bias")


def torch_chunk(x: torch.Tensor, parts: int, dim: int, index: int) -> torch.Tensor:
    """``torch.chunk(x, parts, dim)[index]``, or the empty ``narrow(dim, 0, 0)`` FSDP2/DTensor use past the end."""
    chunks = torch.chunk(x, parts, dim=dim)
    return chunks[index] if index < len(chunks) else x.narrow(dim, 0, 0)


def reference_local(hf: dict[str, torch.Tensor], dp: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` holds: TP chunk first (tp fastest in the mesh), then FSDP's dim-0 chunk."""
    d, t = divmod(rank, tp)
    out = {}
    for name, x in hf.items():
        if not is_buffer(name):
            tdim = ref_tp_dim(name, tp)
            if tdim is not None:
                x = torch_chunk(x, tp, tdim, t)
            x = torch_chunk(x, dp, 0, d)
        out[name] = x
    return out


def id_canonical(spec: ModelSpec) -> dict[str, torch.Tensor]:
    out, base = {}, 0
    for t in spec.tensors:
        out[t.name] = torch.arange(base, base + t.numel, dtype=torch.int64).view(t.shape)
        base += t.numel
    return out


# --------------------------------------------------------------------------------------------
# Pure rules

RULE_CASES = [
    ("tiny-llama3", {}, 1, 1),
    ("tiny-llama3", {}, 2, 1),
    ("tiny-llama3", {}, 3, 1),
    ("tiny-llama3", {}, 2, 2),
    ("tiny-llama3", {}, 3, 2),
    ("tiny-qwen2", {}, 3, 2),
    ("tiny-qwen2", {"vocab_size": 251}, 2, 2),
    ("tiny-qwen3", {}, 3, 2),  # tied
    ("tiny-qwen3", {"vocab_size": 7}, 5, 2),  # TP-local vocab 4 and 3 over dp=5: empty shards
    ("tiny-qwen3-moe", {}, 3, 1),  # 8 experts over 3
    ("tiny-qwen3-moe", {"num_experts": 4}, 3, 1),  # 2, 2, empty
    ("tiny-qwen3-moe", {}, 5, 1),
    ("tiny-deepseek-v3", {}, 3, 1),
    ("tiny-deepseek-v3", {}, 7, 1),
]


def check_rules(cfg: dict, dp: int, tp: int) -> None:
    spec = spec_from_config(cfg)
    layout = FSDPLayout(spec, dp=dp, tp=tp)
    world = dp * tp
    assert layout.world_size == world
    canon = id_canonical(spec)
    hf = hf_tensors(spec, canon)
    counts = {n: torch.zeros(x.shape, dtype=torch.int64) for n, x in canon.items()}
    for rank in range(world):
        lay = layout.layout(rank)
        ref = reference_local(hf, dp, tp, rank)
        got_names = set(lay.tensors)
        want_names = {n for n, x in ref.items() if x.numel() > 0}
        assert got_names == want_names, (rank, got_names ^ want_names)
        for name, t in lay.tensors.items():
            assert t.shape == tuple(ref[name].shape), (rank, name, t.shape, ref[name].shape)
            local = torch.full(t.shape, -1, dtype=torch.int64)
            for p in t.pieces:
                assert p.tensor == name
                assert contains(full_box(t.shape), p.local_box), (rank, p)
                assert contains(full_box(spec.tensor(p.canonical).shape), p.canon_box), (rank, p)
                assert p.numel > 0
                local_view(local, p).copy_(canonical_view(canon[p.canonical], p))
                canonical_view(counts[p.canonical], p).add_(1)
            assert sum(p.numel for p in t.pieces) == t.numel, (rank, name)  # no overlap, given full coverage
            assert torch.equal(local, ref[name]), (rank, name)
    for name, c in counts.items():
        hf_name = EXPERT.sub(r"\1", name)
        if is_buffer(name):
            want = world
        elif ref_tp_dim(hf_name, tp) is None:
            want = tp  # once per TP coordinate (replica)
        else:
            want = 1
        assert bool((c == want).all()), (name, c.min().item(), c.max().item(), want)
    # shards() of each tensor and layout() agree, and groups expand to the right ranks
    for t in spec.tensors:
        for s in layout.shards(t.name):
            for r in layout.group_ranks(s.group):
                assert s.piece in layout.layout(r).tensors[s.piece.tensor].pieces


def test_rules_presets():
    for name, changes, dp, tp in RULE_CASES:
        check_rules(variant(name, **changes), dp, tp)


def test_rules_random_dims():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=40, deadline=None)
    @given(
        vocab=st.integers(1, 40),
        hidden=st.integers(1, 12),
        kv=st.sampled_from([1, 2, 4]),
        group=st.sampled_from([1, 2]),
        inter_mult=st.integers(1, 5),
        dp=st.integers(1, 7),
        tp=st.sampled_from([1, 2, 4]),
        tied=st.booleans(),
        arch=st.sampled_from(["tiny-llama3", "tiny-qwen2", "tiny-qwen3"]),
    )
    def run(vocab, hidden, kv, group, inter_mult, dp, tp, tied, arch):
        if kv % tp:
            kv = tp
        cfg = variant(
            arch,
            vocab_size=vocab,
            hidden_size=hidden,
            head_dim=3,
            num_key_value_heads=kv,
            num_attention_heads=kv * group,
            intermediate_size=tp * inter_mult,
            num_hidden_layers=1,
            tie_word_embeddings=tied,
        )
        check_rules(cfg, dp, tp)

    run()


def test_moe_rules_random_experts():
    for experts in (1, 2, 3, 5, 9):
        for dp in (2, 4, 6):
            check_rules(variant("tiny-qwen3-moe", num_experts=experts, num_experts_per_tok=1, num_hidden_layers=1), dp, 1)


def test_registry_and_config_errors():
    spec = load_spec("tiny-llama3")
    lay = make_layout(spec, "fsdp:dp=2,tp=2")
    assert isinstance(lay, FSDPLayout) and lay.describe() == "fsdp:dp=2,tp=2" and lay.world_size == 4
    assert FSDPLayout.keys == ("dp", "tp", "fp32", "fp32_router", "fp32_router_bias") and FSDPLayout.engine == "fsdp"
    assert make_layout(spec, "fsdp").world_size == 1
    bad = [
        ("tiny-llama3", "fsdp:pp=2"),
        ("tiny-llama3", "fsdp:tp=3"),  # 8 heads
        ("tiny-llama3", "fsdp:tp=4"),  # 2 kv heads
        ("tiny-qwen3-moe", "fsdp:dp=2,tp=2"),  # MoE
        ("tiny-deepseek-v3", "fsdp:tp=2"),  # MoE + MLA
        ("tiny-llama3", "fsdp:dp=0"),
    ]
    for model, text in bad:
        try:
            make_layout(load_spec(model), text)
        except ConfigError:
            pass
        else:
            raise AssertionError(f"{model} {text} should be refused")
    odd = spec_from_config(variant("tiny-llama3", num_key_value_heads=8, intermediate_size=100))
    try:
        FSDPLayout(odd, tp=8)
    except ConfigError as e:
        assert "intermediate_size" in str(e)
    else:
        raise AssertionError("intermediate 100 over tp=8 should be refused")


def test_shards_are_analytic():
    spec = load_spec("qwen3-30b-a3b")
    lay = FSDPLayout(spec, dp=1000)
    # 128 experts over 1000 ranks (chunks of 1 row): only rank 77 holds expert 77
    (s,) = lay.shards("model.layers.3.mlp.experts.77.down_proj.weight")
    assert lay.group_ranks(s.group) == (77,) and s.shape[0] == 1
    # hidden 2048 over 1000 ranks: chunks of 3 rows, so 683 non-empty shards
    assert len(lay.shards("model.norm.weight")) == 683


# --------------------------------------------------------------------------------------------
# Live: real FSDP2 (+TP) on gloo


# each live case on the first dp*tp ranks of ONE 4-process world (sub-meshes; the other ranks wait): the
# process starts and the torch/transformers imports were most of the cost, 9 processes for 3 cases before
LIVE = {
    "dp2": {"dp": 2, "tp": 1, "models": [preset("tiny-qwen3"), preset("tiny-qwen3-moe"), preset("tiny-deepseek-v3")]},
    # vocab 250 -> 84/84/82, hidden 64 -> 22/22/20, head_dim 16 -> 6/6/4; 4 experts -> 2/2/EMPTY
    "dp3-uneven": {"dp": 3, "tp": 1, "models": [variant("tiny-qwen3-moe", num_experts=4), preset("tiny-deepseek-v3")]},
    # llama3: vocab 250 -> TP 125 -> FSDP 63/62 ; qwen2: q/k/v biases ; qwen3: tied + q/k norms
    "dp2-tp2": {"dp": 2, "tp": 2, "models": [preset("tiny-llama3"), preset("tiny-qwen2"), preset("tiny-qwen3")]},
}
LIVE_WORLD = max(c["dp"] * c["tp"] for c in LIVE.values())


@functools.lru_cache(maxsize=None)
def run_world(timeout: float = 300) -> tuple[str, ...]:
    """Every live case in one world of LIVE_WORLD processes; each rank's output."""
    port = _free_port()
    procs = []
    for rank in range(LIVE_WORLD):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(LIVE_WORLD),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME="lo",
            PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "worker", json.dumps({"cases": LIVE})],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    q.kill()
            out, _ = p.communicate()
            out += "\n[timed out]"
        outs.append(f"--- rank {rank} (rc={p.returncode}) ---\n{out}")
    return tuple(outs)


def check_live_case(case: str) -> None:
    outs = run_world()
    ranks = LIVE[case]["dp"] * LIVE[case]["tp"]
    for rank in range(ranks):
        assert f"OK {case} rank {rank}\n" in outs[rank], f"live check {case} failed:\n" + "\n".join(outs)[-12000:]


@pytest.mark.xdist_group("fsdp-live")
def test_live_dp2():
    check_live_case("dp2")


@pytest.mark.xdist_group("fsdp-live")
def test_live_dp3_uneven():
    check_live_case("dp3-uneven")


@pytest.mark.xdist_group("fsdp-live")
def test_live_dp2_tp2():
    check_live_case("dp2-tp2")


def _loaded_model(cfg: dict):
    """The model as ``from_pretrained`` loads it under the installed transformers (its
    ``_keep_in_fp32_modules_strict`` applied: DeepSeek-V3's router bias fp32, its router weight fp32
    from 5.24 on), which the layout's auto ``fp32_*`` keys follow. ``from_config`` applies no such
    list; a binding reads that model's dtypes instead (tests/test_bind.py)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as d:
        _build_model(cfg).save_pretrained(d)
        return AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)


def _worker(job: dict) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    models = {}
    for case, c in job["cases"].items():  # before the group is up: save_pretrained under torch.distributed writes on rank 0 only
        if rank < c["dp"] * c["tp"]:
            models[case] = []
            for cfg in c["models"]:
                torch.manual_seed(0)
                models[case].append(_loaded_model(cfg))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    for case, c in job["cases"].items():  # a failed case ends the process: the collectives are out of step then
        # the case's ranks are the first dp*tp (tp fastest, as init_device_mesh orders them); every rank
        # takes part in making the mesh (its groups are made over the whole world)
        dp, tp = c["dp"], c["tp"]
        if tp > 1:
            mesh = DeviceMesh("cpu", torch.arange(dp * tp).view(dp, tp), mesh_dim_names=("dp", "tp"))
            dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
        else:
            dp_mesh = DeviceMesh("cpu", torch.arange(dp), mesh_dim_names=("dp",))
        if case in models:
            _check_case(c, models[case], rank, dp, tp, dp_mesh, tp_mesh if tp > 1 else None)
        dist.barrier()
        if case in models:
            print(f"OK {case} rank {rank}", flush=True)
    dist.destroy_process_group()
    print(f"RANK {rank} OK", flush=True)
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads can abort there ("terminate called ...")


def _check_case(c: dict, models: list, rank: int, dp: int, tp: int, dp_mesh, tp_mesh) -> None:
    """One live case on one of its ranks: every model FSDP2(+TP)-sharded and checked against the layout."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    for cfg, model in zip(c["models"], models):
        spec = spec_from_config(cfg)
        layout = FSDPLayout(spec, dp=dp, tp=tp).layout(rank)

        g = torch.Generator().manual_seed(1234)  # same data on every rank
        canonical = {}
        for t in spec.tensors:
            x = torch.randn(t.shape, generator=g).to(TORCH_DTYPES[t.dtype])
            x[x == 0] = 1
            canonical[t.name] = x
        hf = hf_tensors(spec, canonical)

        state_names = set(model.state_dict())
        filled = set()
        with torch.no_grad():
            for name, p in list(model.named_parameters()) + list(model.named_buffers()):
                if name in state_names and name in hf:
                    p.copy_(hf[name])
                    filled.add(name)
        params = {n for n, _ in model.named_parameters()}
        assert params <= filled, f"parameters without canonical data: {sorted(params - filled)}"

        if tp > 1:
            _apply_tp(model, tp_mesh, spec.tie_word_embeddings)
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)

        live_t: dict[str, torch.Tensor] = {}
        empty = []
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), name
            local = p.to_local()
            if local.numel() == 0:
                assert local.shape[0] == 0, (name, local.shape)
                empty.append(name)
            else:
                live_t[name] = local
        for name, b in model.named_buffers():
            if name in state_names and name in hf:
                live_t[name] = b
        live = {n: (tuple(x.shape), DTYPE_NAMES[x.dtype]) for n, x in live_t.items()}
        check_live(layout, live, where=f"fsdp rank {rank} ({spec.name}, dp={dp}, tp={tp})")
        want = scatter(layout, canonical)
        for name, x in live_t.items():
            assert torch.equal(x, want[name]), f"rank {rank} {spec.name}: {name} differs by value"
        for name in empty:
            assert name not in layout.tensors
        # full_tensor() gathers back the hf tensor (collective: same order on every rank)
        for name, p in model.named_parameters():
            full = p.full_tensor()
            assert torch.equal(full, hf[name].to(full.dtype)), f"full_tensor of {name} differs"
        placements = {str(p.placements) for _, p in model.named_parameters()}
        print(f"rank {rank} {spec.name}: {len(live_t)} tensors ok, empty={empty}, placements={sorted(placements)}", flush=True)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    _worker(json.loads(sys.argv[2]))
