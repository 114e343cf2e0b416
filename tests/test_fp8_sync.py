"""FP8 on the wire, end to end (issue 24): real FSDP2 training processes (gloo) and a layout-faithful FP8 vLLM
instance (``vllm:tp=2,quant=fp8``: worker processes holding e4m3 weights and fp32 ``_scale_inv`` as vLLM's
Fp8LinearMethod does) through a real MetaServer, over p2p, file, co-located and nixl. After each step every tensor
of every worker equals, bit for bit, what an FP8 checkpoint of that step's weights (``save_checkpoint(dir,
quant="fp8")``'s recipe: the reference quantizer per tensor) loads into that layout. A job into an FP8 engine that
the fp8 codec cannot serve is refused at set-up on both sides, by name: nothing syncs bf16 bytes into an FP8-served
engine."""

from __future__ import annotations

import json

import pytest
import torch
from e2e import step_canonical, trainer
from helpers import tiny

from weightsync.errors import ConfigError

DENSE = dict(hidden_size=256, head_dim=128, num_key_value_heads=2, intermediate_size=512)


def _model(tmp_path) -> str:
    """A tiny Qwen3 whose every TP=2 / FSDP dp=2 shard holds whole 128 blocks, as a config.json path."""
    (tmp_path / "config.json").write_text(json.dumps(dict(tiny("tiny-qwen3-h64", **DENSE).config)))
    return str(tmp_path)


def check_fp8(ctx, model: str, engine: str, step: int) -> list[str]:
    """In a worker: the tensors that differ from the FP8 checkpoint of step ``step`` loaded into this rank."""
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES, fill_from
    from weightsync.quant.fp8 import quantize_reference
    from weightsync.quant.layout import fp8_layout
    from weightsync.spec import load_spec

    spec = load_spec(model)
    layout = fp8_layout(make_layout(spec, engine))
    canonical = step_canonical(spec, step)
    for name, f in layout.fp8.items():
        q = quantize_reference(canonical[name])
        canonical[name], canonical[f.scale.name] = q.weight, q.scale_inv
    mine = layout.layout(ctx.rank)
    want = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype]) for n, t in mine.tensors.items()}
    fill_from(mine, want, canonical)  # over the same poison: padding nobody writes stays NaN on both sides
    if set(want) != set(ctx.tensors):
        return [f"rank {ctx.rank}: tensors {sorted(set(want) ^ set(ctx.tensors))[:4]}"]
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    out = [f"rank {ctx.rank}: {n}" for n, w in want.items()
           if w.dtype != ctx.tensors[n].dtype or not torch.equal(w.view(bits[w.element_size()]),
                                                                 ctx.tensors[n].view(bits[w.element_size()]))]
    if not any(t.dtype == torch.float8_e4m3fn for t in ctx.tensors.values()):
        out.append(f"rank {ctx.rank}: no FP8 tensor")
    return out


def reader(emit, inst: int, meta: str, job: dict) -> None:
    from weightsync.local.events import Ready, StepDone
    from weightsync.local.instances import build_instance
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    torch.set_num_threads(1)
    spec, engine = load_spec(job["model"]), job["infer"]
    local = build_instance(spec, engine, device="cpu", seed=1)
    try:
        r = WeightReader(local.instance, meta=meta, job=job["job"], instance_id=inst, instances=1,
                         timeout_s=job["timeout"], token=job["token"], bucket_bytes=job["bucket_bytes"],
                         transport=job.get("transport", "p2p"), directory=job.get("directory"),
                         colocate=job.get("colocate", False), integrity=job["integrity"]).connect()
        emit(Ready(emit.participant))
        for step in range(1, job["steps"] + 1):
            r.update(step)
            problems = tuple(p for ps in local.instance.call(check_fp8, job["model"], engine, step) for p in ps)
            emit(StepDone(emit.participant, step, 0.0, 0, not problems, version=r.version, problems=problems))
    finally:
        local.close()


def run(job: dict):
    from weightsync.engines import make_layout
    from weightsync.local.runner import LocalJob
    from weightsync.local.events import Participant
    from weightsync.spec import load_spec
    from weightsync.transport.group import free_port

    job = {"job": "fp8", "steps": 2, "timeout": 60.0, "bucket_bytes": 1 << 20, "integrity": 0, **job}
    world = make_layout(load_spec(job["model"]), job["train"]).world_size
    with LocalJob(deadline_s=job["timeout"] * (job["steps"] + 4), stop_on_failure=False, exit_grace_s=5.0) as local:
        job["token"] = local.job_token(job["job"])
        port = free_port()
        for r in range(world):
            local.add(Participant.trainer(r), trainer, r, world, port, local.meta_url, job)
        local.add(Participant.instance(0), reader, 0, local.meta_url, job)
        return local.run()


def test_check_engine_refuses_quant_fp8_where_the_fp8_codec_cannot_run():
    from weightsync.codec.registry import check_engine, engine_quant

    assert engine_quant("vllm:tp=2,quant=fp8") == "fp8" and engine_quant("vllm:tp=2") == "none"
    assert engine_quant("sglang:tp=2,quant=fp8") == "fp8"
    check_engine("vllm:tp=2", "full", "p2p", "async")  # unquantized: nothing to refuse
    for transport in ("p2p", "file", "colocated", "nixl"):
        check_engine("vllm:tp=2,quant=fp8", "full", transport, "sync")
    check_engine("vllm:tp=2,quant=fp8", "full", "nixl", "async")
    with pytest.raises(ConfigError, match=r"quant=fp8 needs the fp8 codec, which .*vllm:tp=2,quant=fp8; p2p "
                                          r"transport, async mode"):
        check_engine("vllm:tp=2,quant=fp8", "full", "p2p", "async")


def test_fsdp2_to_an_fp8_vllm_layout_lands_the_fp8_checkpoint_bit_exact(tmp_path):
    from weightsync.local.events import StepDone

    result = run(dict(model=_model(tmp_path), train="fsdp:dp=2", infer="vllm:tp=2,quant=fp8"))
    assert not result.failures, "\n".join(f"{f.line()}\n{f.traceback}" for f in result.failures)
    done = result.of(StepDone)
    assert [d.step for d in done] == [1, 2], result.events
    for d in done:
        assert d.problems == () and d.version == d.step, d


@pytest.mark.parametrize("transport", ["file", "colocated", "nixl"])
def test_fsdp2_to_an_fp8_vllm_layout_over_file_colocated_and_nixl(tmp_path, transport):
    """The same over the file transport (each pair's file holds the FP8 payloads: weightsync.transport.file
    ``forms``: weightsync.encoded/1), co-located (shared memory on CPU: each worker quantizes straight from the trainers'
    tensors into its live e4m3 weights and scales, weightsync.codec.fp8 ``FP8Codec.land``) and nixl (real agents:
    each trainer quantizes into its registered frames region, each worker READs the payloads alone,
    weightsync.transport.nixl ``FrameReads``)."""
    from weightsync.local.events import StepDone

    if transport == "nixl":
        from helpers import nixl_missing

        if nixl_missing():
            pytest.skip(nixl_missing())
    extra = {"directory": str(tmp_path / "files")} if transport == "file" else {
        "colocate": True} if transport == "colocated" else {}
    (tmp_path / "m").mkdir()
    result = run(dict(model=_model(tmp_path / "m"), train="fsdp:dp=2", infer="vllm:tp=2,quant=fp8",
                      transport=transport, **extra))
    assert not result.failures, "\n".join(f"{f.line()}\n{f.traceback}" for f in result.failures)
    done = result.of(StepDone)
    assert [d.step for d in done] == [1, 2], result.events
    for d in done:
        assert d.problems == () and d.version == d.step, d


def test_an_fp8_job_the_codec_cannot_serve_is_refused_on_both_sides(tmp_path):
    """Integrity sums with FP8 (they would cover the bf16 sources): both sides fail at set-up with the line, no step
    is written. (Delta, other transports: the same check, tests/test_fp8_codec.py.)"""
    result = run(dict(model=_model(tmp_path), train="fsdp:dp=2", infer="vllm:tp=2,quant=fp8", steps=1,
                      integrity=1000))
    sides = {f.participant.role for f in result.failures}
    assert sides == {"train", "infer"}, result.failures
    assert any("quant=fp8 needs the fp8 codec" in f.message and "set integrity=0" in f.message
               for f in result.failures), result.failures
    assert not [e for e in result.events if type(e).__name__ in ("StepDone", "Wrote")]


def test_the_demo_verifies_an_fp8_vllm_instance():
    """``weightsync demo --infer vllm:tp=2,quant=fp8``: real FSDP2 training steps, the FP8 instance checked bit for
    bit against the reference quantizer's FP8 checkpoint of the step's weights (tiny-qwen3-fp8: whole blocks)."""
    from weightsync.demo import run
    from weightsync.local.demo_job import DemoConfig, check

    cfg = DemoConfig(model="tiny-qwen3-fp8", infer=("vllm:tp=2,quant=fp8",), steps=1)
    check(cfg)
    result = run(cfg, print_fn=lambda s: None)
    assert result["verified"], result["errors"]
    with pytest.raises(ConfigError, match="try --model tiny-qwen3-fp8"):
        check(DemoConfig(model="tiny-qwen3", infer=("vllm:tp=2,quant=fp8",)))
    with pytest.raises(ConfigError, match="AMX"):
        check(DemoConfig(model="tiny-qwen3-fp8", infer=("vllm:tp=2,quant=fp8",), engines="real"))
