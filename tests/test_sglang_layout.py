"""The ``sglang`` layout rules against what SGLang 0.5.23's own model classes hold.

``tests/data/sglang-0.5.23-params.json`` was recorded (docs/sglang.md §5, "the CPU probe") by building
SGLang 0.5.23's own model classes on CPU in gloo TP groups (no forward; IPython, torchvision and gguf
stubbed, nothing of SGLang's changed), loading a random checkpoint with SGLang's own
``model.load_weights`` and ``postprocess_weights``, and writing per rank every parameter's name, shape,
dtype and a hash of its values over the regions the weightsync layout covers. SGLang cannot be
installed in CI, so the record is the evidence here; these tests fail when a layout rule stops
matching it (names, shapes, dtypes, and where every value sits: bit-exact through the hash).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

import pytest
import torch

from weightsync.engines import make_layout
from weightsync.engines.sglang import fusable_by_default
from weightsync.layout.layout import check_live
from weightsync.layout.materialize import TORCH_DTYPES, scatter
from weightsync.spec import load_spec

from helpers import preset, tiny

RECORD = json.loads((Path(__file__).parent / "data" / "sglang-0.5.23-params.json").read_text())["configs"]


def probe_checkpoint(spec) -> dict[str, torch.Tensor]:
    """The probe's checkpoint: one generator per tensor seeded by the CRC32 of its name."""
    out = {}
    for t in spec.tensors:
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()))
        out[t.name] = torch.randn(t.shape, generator=g).to(TORCH_DTYPES[t.dtype])
    return out


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("key", sorted(RECORD))
def test_layout_matches_sglangs_loaded_parameters(key):
    model, engine = key.split()[:2]
    spec = load_spec(model)  # the probe added rope_scaling to DeepSeek's config (SGLang's CPU rope needs it): no tensor changes
    layout = make_layout(spec, engine)
    ranks = RECORD[key]
    assert sorted(map(int, ranks)) == list(range(layout.world_size))
    ck = probe_checkpoint(spec)
    for rank, params in ranks.items():
        lay = layout.layout(int(rank))
        check_live(lay, {n: (tuple(s), d) for n, (s, d, _) in params.items()}, where=f"{key} rank {rank}")
        want = scatter(lay, ck)
        for name, (_, _, h) in params.items():
            covered = ~torch.isnan(want[name].float())
            assert _hash(want[name][covered]) == h, f"{key} rank {rank}: {name} holds other values than SGLang loaded"


def test_the_record_covers_every_rule_family():
    keys = " ".join(RECORD)
    for needle in ("tiny-qwen3 sglang:tp=4", "dp_attention=1", "dp_lm_head=1", "ep=2", "fuse_shared=1", "tiny-llama3",
                   "tiny-qwen2", "tiny-qwen3-moe", "enable_dp_attention=true", "attn_dp_size=2"):
        assert needle in keys, needle
    assert "tiny-deepseek-v3 sglang:tp=2" in RECORD  # SGLang's own default: 8 routed experts, not fused


def test_shared_expert_fusion_by_default_follows_sglangs_allow_list():
    """models/deepseek_v2.py shared_experts_fusion_disable_reason: 256 routed experts (DeepSeek-V3/R1), one
    shared expert, no EP on NVIDIA; Kimi-K2's 384 only when Quark-quantized (not an unquantized layout)."""
    assert fusable_by_default(load_spec("deepseek-v3"))
    assert not fusable_by_default(load_spec("kimi-k2"))
    assert not fusable_by_default(load_spec("tiny-deepseek-v3"))
    assert fusable_by_default(tiny("tiny-deepseek-v3", n_routed_experts=256))
    assert not fusable_by_default(tiny("tiny-deepseek-v3", n_routed_experts=256, n_shared_experts=2))
    assert make_layout(load_spec("deepseek-v3"), "sglang:tp=8").fuse_shared_expert
    assert not make_layout(load_spec("deepseek-v3"), "sglang:tp=8,ep=8").fuse_shared_expert
    assert not make_layout(load_spec("kimi-k2"), "sglang:tp=8").fuse_shared_expert
    assert make_layout(load_spec("kimi-k2"), "sglang:tp=8,fuse_shared=1").fuse_shared_expert  # --enforce-shared-experts-fusion
