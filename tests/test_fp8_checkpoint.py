"""``save_checkpoint(dir, quant="fp8")``: the FP8 checkpoint of a trainer's weights -- every linear weight as 128 x 128
block FP8 equal, bit for bit, to the quantizer's definition of the trainer's values, its ``weight_scale_inv`` beside
it, everything else as saved without quant, an index naming every tensor, ``quantization_config`` in config.json."""

from __future__ import annotations

import json

import pytest
import torch

from weightsync.quant.config import BlockFP8, fp8_tensors, from_hf
from weightsync.quant.fp8 import quantize_reference
from weightsync.spec import Kind, load_spec

from helpers import tiny


def trainer(spec, seed: int, fp32: bool = False):
    from weightsync.bind.train import HFTrainEngine
    from weightsync.checkpoint.hf import build_hf_model
    from weightsync.layout.materialize import fill_from
    from weightsync.testing import random_canonical

    model = build_hf_model(spec, seed=0)
    if fp32:
        model = model.float()
    bound = HFTrainEngine(model).bound
    canonical = random_canonical(spec, seed)
    with torch.no_grad():
        fill_from(bound.layout, bound.tensors, canonical)
    return bound, canonical


def read(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("spec", [tiny("tiny-qwen3", intermediate_size=384), load_spec("tiny-qwen3-moe"),
                                  load_spec("tiny-deepseek-v3")], ids=lambda s: s.name)
def test_fp8_checkpoint_holds_the_definition_of_the_trainers_weights(tmp_path, spec):
    from weightsync.checkpoint import save_checkpoint
    from weightsync.checkpoint.format import INDEX_NAME

    bound, canonical = trainer(spec, seed=3)
    r = save_checkpoint(bound, tmp_path, chunk_bytes=64 << 10, shard_bytes=256 << 10, quant="fp8")
    got = read(tmp_path)
    fp8 = {f.weight.name: f for f in fp8_tensors(spec, BlockFP8())}
    assert set(got) == {t.name for t in spec.tensors} | {f.scale.name for f in fp8.values()}
    for name, want in canonical.items():
        if name in fp8:
            q = quantize_reference(want)
            assert got[name].dtype == torch.float8_e4m3fn and torch.equal(got[name].view(torch.uint8),
                                                                          q.weight.view(torch.uint8)), name
            s = got[fp8[name].scale.name]
            assert s.dtype == torch.float32 and torch.equal(s.view(torch.int32), q.scale_inv.view(torch.int32)), name
        else:
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(got) and len(set(index["weight_map"].values())) > 1
    assert all((tmp_path / f).exists() for f in index["weight_map"].values())
    total = sum(t.numel() * t.element_size() for t in got.values())
    assert index["metadata"]["total_size"] == total == r.quant_bytes and r.quant == "fp8" and total < r.total_bytes
    cfg = json.loads((tmp_path / "config.json").read_text())
    q = from_hf(cfg["quantization_config"])  # plain block FP8, the routers listed as ignored (vLLM 0.26's Qwen3-MoE)
    assert q.plain() and fp8_tensors(spec, q) == fp8_tensors(spec, BlockFP8())
    assert q.ignored == tuple(sorted({t.name.removesuffix(".weight") for t in spec.tensors
                                      if t.role.kind is Kind.ROUTER and not t.role.bias}))
    assert cfg["architectures"] == [spec.architecture]
    assert not list(tmp_path.glob("*.tmp"))


def test_quant_refusals_write_nothing(tmp_path):
    from weightsync.checkpoint import save_checkpoint
    from weightsync.errors import WeightSyncError

    spec = load_spec("tiny-qwen3")
    bound, _ = trainer(spec, seed=1)
    with pytest.raises(WeightSyncError, match="quant='int4' is not supported; use quant='fp8'"):
        save_checkpoint(bound, tmp_path / "a", quant="int4")
    assert not list((tmp_path / "a").glob("*"))
    fp32, _ = trainer(spec, seed=1, fp32=True)
    with pytest.raises(WeightSyncError, match="quant='fp8' of model.layers.0.self_attn.q_proj.weight held in float32"):
        save_checkpoint(fp32, tmp_path / "b", quant="fp8")
    assert not list((tmp_path / "b").glob("*"))
