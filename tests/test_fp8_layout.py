"""Scale tensors are canonical tensors sharded with their weights (weightsync.quant.layout): every FP8 layout covers
its FP8 checkpoint exactly, and placing the checkpoint's FP8 pieces and scale pieces into an engine's fused local
tensors gives exactly the block-FP8 quantization of the engine's own fused bf16 tensor, on every rank."""

from __future__ import annotations

import pytest
import torch

from weightsync.dtypes import torch_dtype
from weightsync.engines import make_layout
from weightsync.errors import ConfigError
from weightsync.layout.materialize import fill_from
from weightsync.quant.config import BlockFP8
from weightsync.quant.fp8 import quantize_reference
from weightsync.quant.layout import FP8Spec, fp8_layout, fp8_spec
from weightsync.testing import coverage_problems, random_canonical

from helpers import tiny

DENSE = tiny("tiny-qwen3-h64", hidden_size=256, head_dim=128, num_key_value_heads=2, intermediate_size=512)
MOE = tiny("tiny-qwen3-moe-h64", head_dim=128, moe_intermediate_size=256)
CASES = [(DENSE, "vllm:quant=fp8"), (DENSE, "vllm:tp=2,quant=fp8"), (DENSE, "vllm:tp=2,dp=2,quant=fp8"),
         (MOE, "vllm:tp=2,quant=fp8"), (MOE, "vllm:tp=2,ep=2,quant=fp8"), (DENSE, "sglang:tp=2,quant=fp8"),
         (MOE, "sglang:tp=2,ep=2,quant=fp8")]


def test_the_fp8_spec_lists_each_scale_after_its_weight():
    spec = fp8_spec(DENSE, BlockFP8())
    assert isinstance(spec, FP8Spec) and fp8_spec(spec, BlockFP8()) is spec
    names = [t.name for t in spec.tensors]
    i = names.index("model.layers.1.mlp.down_proj.weight")
    assert names[i + 1] == "model.layers.1.mlp.down_proj.weight_scale_inv"
    assert spec.tensor(names[i]).dtype == "float8_e4m3fn" and spec.tensor(names[i + 1]).shape == (2, 4)
    assert spec.scales[names[i + 1]].name == names[i] and len(spec.by_role) == len(DENSE.tensors)
    assert spec.digest != DENSE.digest and spec.nbytes < DENSE.nbytes


@pytest.mark.parametrize("model,infer", CASES, ids=[f"{m.name.split('{')[0]}-{i}" for m, i in CASES])
def test_every_fp8_layout_covers_its_checkpoint_once_per_replica(model, infer):
    layout = fp8_layout(make_layout(model, infer))
    assert layout.describe() == infer and layout.spec.nbytes < model.nbytes
    assert coverage_problems(layout) == []


@pytest.mark.parametrize("model,infer", CASES, ids=[f"{m.name.split('{')[0]}-{i}" for m, i in CASES])
def test_placed_fp8_pieces_are_the_quantized_local_tensor(model, infer):
    """The engine quantizing its own fused shard (what it would load from a checkpoint of its own layout) equals the
    canonical FP8 checkpoint's pieces placed by the layout: blocks and scales land where the engine's are."""
    base = make_layout(model, infer)
    layout = fp8_layout(base)
    canonical = random_canonical(model, seed=2)
    quantized = dict(canonical)
    for name, f in layout.fp8.items():
        q = quantize_reference(canonical[name])
        quantized[name], quantized[f.scale.name] = q.weight, q.scale_inv
    for rank in range(layout.world_size):
        bf16 = {n: torch.full(t.shape, float("nan"), dtype=torch_dtype(t.dtype))
                for n, t in base.layout(rank).tensors.items()}
        fill_from(base.layout(rank), bf16, canonical)
        mine = layout.layout(rank)
        live = {n: torch.full(t.shape, 7.0).to(torch_dtype(t.dtype)) for n, t in mine.tensors.items()}  # poisoned
        fill_from(mine, live, quantized)
        scaled = 0
        for n, t in mine.tensors.items():
            if not n.endswith("_scale_inv"):
                continue
            weight = n.removesuffix("_scale_inv")
            q = quantize_reference(bf16[weight])  # the engine's fused local tensor, quantized whole
            assert torch.equal(live[weight].view(torch.uint8), q.weight.view(torch.uint8)), (rank, weight)
            assert torch.equal(live[n], q.scale_inv), (rank, n)
            scaled += 1
        assert scaled >= 4 * model.num_layers or "ep=2" in infer


def test_a_layout_that_cuts_blocks_is_refused():
    with pytest.raises(ConfigError, match="shards its 128 rows 64 a piece"):
        fp8_layout(make_layout(tiny("tiny-qwen3-h64", hidden_size=256, num_key_value_heads=2), "vllm:tp=2,quant=fp8"))
