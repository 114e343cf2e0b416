"""Validation (issue 17): what an engine computes with, tensor by tensor, against what the same engine holds
after loading an HF checkpoint through its own loader (``weightsync.validate``, ``WeightReader.validate``).

- records and the comparison (a flipped element found with its index, NaN-for-NaN padding is no difference);
- a transformers instance against ``from_pretrained``: clean, a flipped element, a skipped tensor;
- layout-faithful workers (vLLM TP=2 layout) through the layout, labelled ``via="layout"``;
- the e2e rows' engine pairs, synced with ``validate_every=1`` (every rank in this process, file transport):
  every step validates clean before it is reported held;
- ``weightsync demo --corrupt``: the flipped element named, the run failed.

Against a real vLLM engine: ``tests/test_vllm.py::TestQwen3TP1::test_validate_against_vllms_own_load`` (on
that class's engines, so no engine starts here).
"""

from __future__ import annotations

import math

import pytest
import torch

from weightsync.spec import load_spec
from weightsync.testing import random_canonical


# -- records --------------------------------------------------------------------------------------------


def test_compare_names_the_first_differing_element():
    from weightsync.validate import compare

    a = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).bfloat16()
    b = a.clone()
    b[2, 3] += 5
    b[3, 1] -= 1
    c = compare("w", 1, a, b)
    assert (c.differing, c.first_index, c.rank, c.shape, c.dtype) == (2, (2, 3), 1, (4, 6), "bfloat16")
    assert math.isclose(c.max_abs_diff, float((a[2, 3].double() - b[2, 3].double()).abs()))
    assert not c.ok and "2 of 24 elements differ" in c.line()
    assert compare("w", 0, a, a.clone()).ok
    pad = torch.full((3,), float("nan"))
    assert compare("p", 0, pad, pad.clone()).ok  # unwritten on both sides is not a difference
    assert compare("s", 0, a, a[:2]).problem.startswith("the engine holds [4, 6]")
    assert "missing in the engine" in compare("m", 0, None, a).problem


def test_bad_input_is_refused_before_anything_runs(tmp_path):
    from weightsync.errors import ConfigError
    from weightsync.runtime.reader import WeightReader
    from weightsync.validate import validate

    with pytest.raises(ConfigError, match="no \\*.safetensors files"):
        validate(object(), tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        validate(object(), tmp_path / "nope")
    with pytest.raises(ValueError, match="validate_checkpoint"):
        WeightReader(object(), meta="http://127.0.0.1:1", job="j", instance_id=0, instances=1, validate_every=1)


# -- transformers ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_qwen3(tmp_path_factory):
    """A tiny-qwen3 transformers instance holding seed 1, and checkpoints of seeds 1 and 2."""
    from hf_models import load_canonical_into

    from weightsync.instances.hf import HFInstance
    from weightsync.checkpoint.hf import build_hf_model, save_hf_checkpoint

    spec = load_spec("tiny-qwen3")
    seeds = {s: random_canonical(spec, seed=s) for s in (1, 2)}
    paths = {s: save_hf_checkpoint(spec, c, tmp_path_factory.mktemp(f"hf{s}")) for s, c in seeds.items()}
    model = build_hf_model(spec)
    load_canonical_into(model, spec, seeds[1])
    return spec, model, HFInstance(model), seeds, paths


def test_hf_clean_then_flipped_then_skipped(hf_qwen3):
    from hf_models import load_canonical_into

    from weightsync.errors import ValidationMismatch
    from weightsync.validate import validate

    spec, model, inst, seeds, paths = hf_qwen3
    r = validate(inst, paths[1])
    assert r.ok and r.via == "from_pretrained" and r.summary.mismatched == 0
    assert r.summary.tensors >= len(list(model.parameters()))
    assert validate(inst, paths[2]).summary.mismatched == len(list(model.parameters()))  # every weight changed

    w = model.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        old = w[3, 5].clone()
        w[3, 5] = -w[3, 5] + 1
        try:
            r = validate(inst, paths[1])
            assert r.summary.mismatches == ("model.layers.1.mlp.down_proj.weight",)
            (c,) = r.mismatched()
            assert (c.differing, c.first_index) == (1, (3, 5))
            with pytest.raises(ValidationMismatch, match="model.layers.1.mlp.down_proj.weight.*first at \\[3, 5\\]"):
                validate(inst, paths[1], raise_on_mismatch=True)
        finally:
            w[3, 5] = old

    # a sync that skipped one tensor: seed 2 everywhere but q_proj of layer 0, which still holds seed 1
    skipped = "model.layers.0.self_attn.q_proj.weight"
    load_canonical_into(model, spec, {**seeds[2], skipped: seeds[1][skipped]})
    try:
        assert validate(inst, paths[2]).summary.mismatches == (skipped,)
    finally:
        load_canonical_into(model, spec, seeds[1])
    assert validate(inst, paths[1]).ok


# -- layout-faithful workers ---------------------------------------------------------------------------


def _fill(ctx, canonical, engine, model_config):
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import fill_from
    from weightsync.spec.model import spec_from_config

    fill_from(make_layout(spec_from_config(model_config), engine).layout(ctx.rank), ctx.tensors, canonical)


def _flip(ctx, rank, name, index):
    if ctx.rank == rank:
        ctx.tensors[name][index] += 1


def test_faithful_workers_validate_through_the_layout(hf_qwen3):
    from weightsync.instances.faithful import FaithfulInstance
    from weightsync.validate import validate

    spec, _, _, seeds, paths = hf_qwen3
    with FaithfulInstance(dict(spec.config), "vllm:tp=2") as inst:  # NaN everywhere first
        r = validate(inst, paths[1])
        assert not r.ok and r.via == "layout" and r.summary.mismatched == r.summary.tensors
        inst.call(_fill, seeds[1], "vllm:tp=2", dict(spec.config))
        r = validate(inst, paths[1])
        assert r.ok, r.message()  # the vocab padding (250 -> 256 rows), NaN, is no piece: not compared
        assert {c.rank for c in r.checks} == {0, 1}
        inst.call(_flip, 1, "model.layers.1.self_attn.qkv_proj.weight", (7, 2))
        r = validate(inst, paths[1])
        (c,) = r.mismatched()
        assert (c.name, c.rank, c.first_index, c.differing) == ("model.layers.1.self_attn.qkv_proj.weight", 1,
                                                               (7, 2), 1)


# -- e2e rows' engine pairs: writers -> readers with validate_every=1 ------------------------------------


class _TrainRank:
    """A training rank as WeightWriter takes it (``TrainSide``): its layout's tensors, no engine (tests/test_elastic.py
    does the same); the rows' real trainers run in tests/test_runtime.py."""

    def __init__(self, engine, rank: int, spec):
        from weightsync.layout.materialize import scatter

        self.engine, self.rank, self.spec = engine, rank, spec
        self.layout = engine.layout(rank)
        self.tensors = scatter(self.layout, random_canonical(spec, seed=0))


class _ThreadInstance:
    """A layout-faithful instance whose workers' contexts live in this process (NaN-poisoned), called in turn."""

    def __init__(self, spec, engine: str):
        from weightsync.engines import make_layout
        from weightsync.layout.materialize import TORCH_DTYPES
        from weightsync.runtime.instance import WorkerContext

        self.engine, self.model_config = engine, dict(spec.config)
        layout = make_layout(spec, engine)
        self.contexts = [WorkerContext(r, torch.device("cpu"), {
            n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype]) for n, t in layout.layout(r).tensors.items()})
            for r in range(layout.world_size)]
        self.world_size = layout.world_size

    def call(self, fn, *args, timeout_s=None):
        return [fn(ctx, *args) for ctx in self.contexts]

    def pause(self):
        pass

    resume = after_update = close = pause

    def set_version(self, step):
        pass


def _instance(spec, engine: str):
    if engine == "hf":
        from weightsync.local.instances import build_instance

        return build_instance(spec, "hf").instance  # a real transformers model, NaN-poisoned
    return _ThreadInstance(spec, engine)


#: engine pairs of tests/test_runtime.py's rows: TP/PP and EP trainers, experts stacked by transformers and by
#: vLLM's layout, KV-head replication, DP attention, MLA with DeepSeek's fp32 router bias, tied embeddings
ROWS = [
    ("tiny-qwen3", "megatron:tp=2,pp=2", "hf"),
    ("tiny-qwen3-moe", "fsdp:dp=2", "hf"),
    ("tiny-qwen3-moe", "megatron:ep=2,dp=2", "vllm:tp=2,dp=2,ep=4"),
    ("tiny-llama3", "fsdp:dp=2", "vllm:tp=8"),
    ("tiny-qwen3", "megatron:tp=2", "sglang:tp=4,dp=2,dp_attention=1"),
    ("tiny-deepseek-v3", "hf", "sglang:tp=2"),
    ("tiny-deepseek-v3", "hf", "hf"),
]


@pytest.fixture(scope="module")
def meta():
    from weightsync.meta.server import MetaServer

    with MetaServer(port=0) as server:
        yield server


@pytest.mark.parametrize("model, train, infer", ROWS, ids=[f"{m}-{t}-{i}" for m, t, i in ROWS])
def test_synced_steps_validate_clean(meta, tmp_path, model, train, infer):
    """Two steps written by every training rank (threads, file transport) into one instance whose reader validates
    each update, before reporting it held, against that step's checkpoint (save_pretrained of the step)."""
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.engines import make_layout
    from weightsync.layout.materialize import fill_from
    from weightsync.runtime.reader import WeightReader
    from weightsync.runtime.writer import WeightWriter
    from weightsync.checkpoint.hf import save_hf_checkpoint

    spec = load_spec(model)
    engine = make_layout(spec, train)
    ranks = [_TrainRank(engine, r, spec) for r in range(engine.world_size)]
    steps = {s: random_canonical(spec, seed=40 + s) for s in (1, 2)}
    ckpt = {s: save_hf_checkpoint(spec, c, tmp_path / f"ckpt{s}") for s, c in steps.items()}
    common = dict(meta=meta.url, job=f"validate-{ROWS.index((model, train, infer))}", transport="file",
                  directory=str(tmp_path / "files"), timeout_s=30.0)
    writers = [WeightWriter(t, **common) for t in ranks]
    inst = _instance(spec, infer)
    reader = WeightReader(inst, instance_id=0, instances=1, validate_every=1, validate_checkpoint=ckpt.__getitem__,
                          **common)
    with ThreadPoolExecutor(len(writers) + 1) as pool:
        for f in [pool.submit(w.connect) for w in writers] + [pool.submit(reader.connect)]:
            f.result(timeout=60)
        for step, canonical in steps.items():
            for t in ranks:
                fill_from(t.layout, t.tensors, canonical)
            writes = [pool.submit(w.write, step) for w in writers]
            assert reader.update(step) == step  # raises ValidationMismatch naming the tensors otherwise
            for f in writes:
                f.result(timeout=60)
            v = reader.last_validation
            assert v.ok and v.step == step and v.via == ("from_pretrained" if infer == "hf" else "layout")
            assert v.summary.tensors >= len(make_layout(spec, infer).layout(0).tensors), v.summary
    reader.close()
    for w in writers:
        w.close()


# -- the demo ---------------------------------------------------------------------------------------------


def test_demo_validates_and_names_a_corrupted_element():
    """``weightsync demo --corrupt`` (a transformers trainer -> a transformers instance, one step): the instance is
    validated against the trainer's checkpoint of the step (``WeightWriter.save_checkpoint``) by
    ``from_pretrained``; the flipped element is named, in the JSON and in the one-line error, and the run fails.
    (One demo run, the cheapest: it costs seconds of process start-up. Layout workers validate through the same
    ``WeightReader.validate`` in the rows above.)"""
    from weightsync.demo import DemoConfig, run

    out = run(DemoConfig(model="tiny-qwen3", train="hf", infer=("hf",), steps=1, corrupt=True), print_fn=lambda s: None)
    assert not out["verified"] and len(out["errors"]) == 1
    assert "validation" in out["errors"][0] and "model.norm.weight (rank 0) [64] bfloat16: 1 of 64" in out["errors"][0]
    (step,) = out["steps"]
    (inst,) = step["instances"]
    v = inst["validation"]
    assert (v["via"], v["ok"], v["mismatches"], v["checks"][0]["first_index"]) == ("from_pretrained", False,
                                                                                  ["model.norm.weight"], [0])
    assert not step["verified"] and inst["exact"] is False  # the piece check against the trainers sees it too
