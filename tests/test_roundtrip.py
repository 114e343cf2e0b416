"""Scatter a real safetensors checkpoint into every rank of every engine layout, gather it back: bit-exact."""

import pytest
import torch

from weightsync.engines import make_layout
from weightsync.layout.box import slices
from weightsync.layout.materialize import TORCH_DTYPES, local_view, scatter

CONFIGS = {
    "tiny-llama3": ["hf", "vllm:tp=1", "vllm:tp=4", "vllm:tp=8,dp=2", "sglang:tp=2", "sglang:tp=8",
                    "megatron:tp=2,pp=2,pp_first=3", "megatron:pp=3,pp_last=1", "megatron:tp=2,pp=3,pp_first=1,pp_last=2,dp=2",
                    "fsdp:dp=3", "fsdp:dp=2,tp=2"],
    "tiny-qwen2": ["hf", "vllm:tp=2", "sglang:tp=4,dp=2", "megatron:tp=2,dp=2", "fsdp:dp=2,tp=2"],
    "tiny-qwen3": ["hf", "vllm:tp=8", "vllm:tp=2,dp=2", "sglang:tp=4,dp=2,dp_attention=1", "megatron:pp=2",
                   "megatron:tp=2,pp=2,vpp=2", "megatron:pp=3,pp_first=2,pp_last=1", "fsdp:dp=4"],
    "tiny-qwen3-moe": ["hf", "vllm:tp=2", "vllm:tp=2,dp=2,ep=4", "vllm:tp=1,dp=3,ep=3",
                       "sglang:tp=4,ep=2", "sglang:tp=4,dp=2,ep=4,dp_attention=1", "megatron:ep=2,dp=2",
                       "megatron:tp=2,ep=2,pp=2,te=1,grouped=1", "megatron:tp=2,etp=2,ep=2,dp=2", "fsdp:dp=3"],
    "tiny-deepseek-v3": ["hf", "vllm:tp=2", "vllm:tp=4,ep=4", "sglang:tp=4", "sglang:tp=4,ep=4",
                         "sglang:tp=4,dp=2,dp_attention=1", "megatron:tp=2,pp=2,ep=2", "megatron:ep=4,dp=4",
                         "fsdp:dp=2"],
}
CASES = [(m, e) for m, engines in CONFIGS.items() for e in engines]


@pytest.mark.parametrize("model,engine", CASES, ids=[f"{m}-{e}" for m, e in CASES])
def test_checkpoint_round_trip(checkpoints, model, engine):
    spec, ckpt = checkpoints[model]
    assert set(ckpt) == set(spec.by_name), "checkpoint names differ from the model spec"
    canonical = {n: ckpt[n].to(TORCH_DTYPES[spec.by_name[n].dtype]) for n in spec.by_name}
    layout_fn = make_layout(spec, engine)
    gathered = {n: torch.full_like(t, float("nan")) for n, t in canonical.items()}
    counts = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in canonical.items()}
    for rank in range(layout_fn.world_size):
        layout = layout_fn.layout(rank)
        local = scatter(layout, canonical, fill=float("nan"))
        covered = {}
        for name, t in layout.tensors.items():
            assert local[name].dtype == TORCH_DTYPES[t.dtype]
            mask = torch.zeros(t.shape, dtype=torch.bool)
            for p in t.pieces:
                local_view(mask, p).fill_(True)
                gathered[p.canonical][slices(p.canon_box)] = local_view(local[name], p).to(gathered[p.canonical].dtype)
                counts[p.canonical][slices(p.canon_box)] += 1
            covered[name] = mask
            # padding (no piece) stays untouched
            assert torch.isnan(local[name][~mask].float()).all(), f"{name} padding was written"
    for name, want in canonical.items():
        c = counts[name]
        assert int(c.min()) >= 1, f"{name} not fully covered on {engine}"
        assert int(c.min()) == int(c.max()), f"{name} covered unevenly on {engine}"
        assert torch.equal(gathered[name], want), f"{name} differs after the round trip on {engine}"
