"""Validation (issue 17): what an engine computes with, tensor by tensor, against what the same engine holds
after loading an HF checkpoint through its own loader (``weightsync.validate``, ``WeightReader.validate``).

- records and the comparison (a flipped element found with its index, NaN-for-NaN padding is no difference);
- a transformers instance against ``from_pretrained``: clean, a flipped element, a skipped tensor;
- layout-faithful workers (vLLM TP=2 layout) through the layout, labelled ``via="layout"``;
- e2e rows (real trainers, MetaServer, instances) with ``validate_every=1``: every step validates clean.

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
    from weightsync.testing import build_hf_model
    from weightsync.validate.checkpoint import save_hf_checkpoint

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


# -- e2e rows: trainers -> instances, validate_every=1 --------------------------------------------------


def validating_reader(emit, inst: int, meta: str, job: dict) -> None:
    """An inference participant whose reader validates every update against that step's checkpoint
    (written here with save_pretrained from the step's canonical weights) and raises on a mismatch."""
    import os
    import tempfile

    from e2e import expected_canonical

    from weightsync.local.events import Ready, StepDone
    from weightsync.local.instances import build_instance
    from weightsync.runtime.reader import WeightReader
    from weightsync.validate.checkpoint import save_hf_checkpoint

    torch.set_num_threads(1)
    spec = load_spec(job["model"])
    root = tempfile.mkdtemp(prefix="validate-")

    def checkpoint_of(step: int) -> str:
        d = os.path.join(root, f"step{step}")
        if not os.path.isdir(d):
            save_hf_checkpoint(spec, expected_canonical(spec, step), d)
        return d

    local = build_instance(spec, job["infer"], seed=1)
    try:
        r = WeightReader(local.instance, meta=meta, job=job["job"], instance_id=inst, instances=job["instances"],
                         timeout_s=job["timeout"], validate_every=1, validate_checkpoint=checkpoint_of).connect()
        emit(Ready(emit.participant))
        for step in range(1, job["steps"] + 1):
            r.update(step)  # raises ValidationMismatch if anything differs
            v = r.last_validation
            emit(StepDone(emit.participant, step, v.seconds, 0, v.ok, version=r.version,
                          problems=tuple(f"{v.via}:{n}" for n in v.summary.mismatches) if not v.ok else (f"{v.via}",)))
        r.close()
    finally:
        local.close()


#: a selection of tests/test_runtime.py's rows (each costs a whole job): experts unstacked by from_pretrained
#: under an FSDP2 trainer; MLA and DeepSeek's fp32 router bias through the SGLang layout
ROWS = [
    dict(model="tiny-qwen3-moe", train="fsdp:dp=2", infer="hf"),
    dict(model="tiny-deepseek-v3", train="hf", infer="sglang:tp=2"),
]


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['model']}-{r['train']}-{r['infer']}" for r in ROWS])
def test_e2e_rows_validate_clean_every_step(row):
    from e2e import trainer

    from weightsync.engines import make_layout
    from weightsync.local.events import Participant, StepDone
    from weightsync.local.runner import LocalJob
    from weightsync.transport.group import free_port

    job = {"job": "validate", "steps": 2, "instances": 1, "timeout": 60.0, **row}
    world = make_layout(load_spec(job["model"]), job["train"]).world_size
    with LocalJob(deadline_s=240, stop_on_failure=True, exit_grace_s=5.0) as local:
        port = free_port()
        for rank in range(world):
            local.add(Participant.trainer(rank), trainer, rank, world, port, local.meta_url, job)
        local.add(Participant.instance(0), validating_reader, 0, local.meta_url, job)
        result = local.run()
    assert not result.failures, "\n".join(f"{f.line()}\n{f.traceback}" for f in result.failures)
    done = result.of(StepDone)
    via = "layout" if row["infer"] != "hf" else "from_pretrained"
    assert [(d.step, d.exact, d.version, d.problems) for d in done] == [(s, True, s, (via,)) for s in (1, 2)]
