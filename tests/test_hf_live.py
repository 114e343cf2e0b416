"""The `hf` layout equals the transformers module that from_pretrained builds from a real checkpoint."""

import pytest
import torch
from hf_models import live_tensors, save_checkpoint

from weightsync.engines import make_layout
from weightsync.errors import LayoutMismatch
from weightsync.layout.layout import check_live
from weightsync.layout.materialize import DTYPE_NAMES, scatter
from weightsync.spec import load_spec
from weightsync.testing import random_canonical


@pytest.mark.parametrize("model", ["tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_hf_layout_matches_from_pretrained(tmp_path, model):
    from transformers import AutoModelForCausalLM

    spec = load_spec(model)
    canonical = random_canonical(spec, seed=11)
    save_checkpoint(spec, canonical, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    live = live_tensors(loaded)
    layout = make_layout(spec, "hf").layout(0)
    check_live(layout, {n: (tuple(t.shape), DTYPE_NAMES[t.dtype]) for n, t in live.items()})
    want = scatter(layout, canonical)
    for name, t in live.items():
        assert torch.equal(t.detach(), want[name]), f"{name}: transformers loaded other values than the layout places"


def test_check_live_names_every_difference():
    spec = load_spec("tiny-qwen3")
    layout = make_layout(spec, "vllm:tp=2").layout(1)
    live = {n: (t.shape, t.dtype) for n, t in layout.tensors.items()}
    live.pop("model.norm.weight")
    live["model.layers.0.self_attn.qkv_proj.weight"] = ((48, 64), "bfloat16")
    live["model.layers.0.mlp.down_proj.weight"] = ((64, 64), "float32")
    live["extra.weight"] = ((3,), "bfloat16")
    with pytest.raises(LayoutMismatch) as e:
        check_live(layout, live)
    msg = str(e.value)
    assert "vllm rank 1" in msg
    assert "missing tensor model.norm.weight" in msg
    assert "qkv_proj.weight: live shape [48, 64], derived [96, 64]" in msg
    assert "down_proj.weight: live shape [64, 64], derived [64, 64]" not in msg
    assert "live dtype float32, derived bfloat16" in msg
    assert "unexpected tensor extra.weight" in msg
