"""The cast codec (weightsync.codec.cast): each copy on the wire in the narrower of its two dtypes.

In process: an fp32 master's buckets encoded and decoded into poisoned bf16 targets equal what the receiver's own
cast (a checkpoint load) gives, bit for bit, in half the bytes; a widening copy goes in its source dtype; a header
the receiver's plan does not make is refused. Whole jobs (real writer and reader processes, a MetaServer): an fp32
transformers trainer into a vLLM-layout instance over p2p, files and NIXL, ``codec="cast"`` on both sides, every
tensor bit-exact after every step and half the full codec's bytes on the wire.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from e2e import FP32_SCALE, assert_clean, run_job
from helpers import same

from weightsync.errors import ConfigError, TransportError


def _fp32_job():
    """hf (fp32 masters) -> vllm:tp=2 (bf16): the plan with every copy's source dtype float32."""
    from weightsync.engines import make_layout
    from weightsync.plan.planner import Bucket, Planner
    from weightsync.spec import load_spec
    from weightsync.testing import random_canonical

    spec = load_spec("tiny-qwen3")
    src, dst = make_layout(spec, "hf"), make_layout(spec, "vllm:tp=2")
    planner = Planner(src, dst, 1, bucket_bytes=16 << 10)
    canon = {n: t.float() * FP32_SCALE for n, t in random_canonical(spec, seed=5).items()}  # off the bf16 grid
    plans = {pair: [Bucket(b.src_rank, b.dst_instance, b.dst_rank, b.index,
                           tuple(replace(c, dtype="float32") for c in b.copies)) for b in bs]
             for pair, bs in planner.send_plan(0).items()}
    dtypes = {n: t.dtype for j in range(dst.world_size) for n, t in dst.layout(j).tensors.items()}
    return spec, src, dst, plans, canon, dtypes


def test_an_fp32_master_lands_as_the_receivers_cast_in_half_the_bytes():
    from weightsync.codec.cast import CastCodec
    from weightsync.layout.materialize import TORCH_DTYPES, scatter

    spec, src, dst, plans, canon, dtypes = _fp32_job()
    codec = CastCodec(tuple(sorted(dtypes.items())))
    sources = scatter(src.layout(0), canon)
    enc, dec = codec.encoder(plans, torch.device("cpu")), codec.decoder(plans)
    for j in range(dst.world_size):
        targets = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype])
                   for n, t in dst.layout(j).tensors.items()}
        moved = full = 0
        for pair, bs in plans.items():
            if pair[2] != j:
                continue
            for b in bs:
                slot = torch.empty(max(b.nbytes, enc.bound(b)), dtype=torch.uint8)
                frame = enc.encode(b, sources, slot)
                assert not frame.header.whole and dec.size(b, frame.header) == frame.header.nbytes
                dec.decode(b, frame.header, frame.payload, targets, torch.empty(0, dtype=torch.uint8))
                moved, full = moved + frame.header.nbytes, full + b.nbytes
        # what a checkpoint load gives: each fp32 value rounded once to the engine's bf16
        want = scatter(dst.layout(j), {n: t.to(TORCH_DTYPES[spec.by_name[n].dtype]) for n, t in canon.items()})
        assert all(same(targets[n], want[n]) for n in want), [n for n in want if not same(targets[n], want[n])][:3]
        assert full / 2 <= moved < full / 2 * 1.01  # half, alignment aside
        assert dec.stats.kinds["cast"] > 0


def test_a_widening_copy_travels_in_its_source_dtype_and_a_foreign_header_is_refused():
    from weightsync.codec.cast import KIND_CAST, CastCodec, cast_layout, wire_dtype
    from weightsync.payload.codec import Header

    assert wire_dtype("float32", "bfloat16") == "bfloat16" and wire_dtype("bfloat16", "float32") == "bfloat16"
    assert wire_dtype("bfloat16", "bfloat16") == "bfloat16"
    spec, src, dst, plans, canon, dtypes = _fp32_job()
    b = next(b for bs in plans.values() for b in bs if b.nbytes)
    narrow, n = cast_layout(b, dtypes)
    wide, m = cast_layout(b, {k: "float32" for k in dtypes})  # an fp32 engine: nothing to narrow
    assert all(p.dtype == "bfloat16" for p in narrow) and all(p.dtype == "float32" for p in wide) and m >= b.nbytes > n
    dec = CastCodec(tuple(sorted(dtypes.items()))).decoder(plans)
    with pytest.raises(TransportError, match="every writer and reader must pass codec='cast'"):
        dec.decode(b, Header(KIND_CAST, 0, n + 8), torch.zeros(n + 8, dtype=torch.uint8), {}, torch.empty(0))


def test_it_is_asked_by_name_and_refused_where_it_cannot_run():
    from weightsync.codec.registry import job_codec_name, serving
    from weightsync.runtime.session import SessionOptions

    assert sorted(serving("cast")) == ["file/sync", "nixl/async", "nixl/sync", "p2p/sync"]
    assert SessionOptions(codec="cast").terms().codec == "cast"
    with pytest.raises(ConfigError, match="the cast codec needs a sender step"):
        SessionOptions(codec="cast", colocate=True)
    with pytest.raises(ConfigError, match="the cast codec lands other bytes than an FP8-served engine holds"):
        job_codec_name("cast", "vllm:tp=1,quant=fp8", "p2p", "sync")


@pytest.mark.parametrize("transport", ["p2p", "file", "nixl"])
def test_whole_jobs_bit_exact_in_half_the_bytes(transport, tmp_path):
    from weightsync.engines import make_layout
    from weightsync.local.events import StepDone
    from weightsync.spec import load_spec

    job = dict(model="tiny-qwen3", train="hf", infer="vllm:tp=2", steps=2, fp32=True, codec="cast",
               transport=transport, bucket_bytes=64 << 10,
               **({"directory": str(tmp_path)} if transport == "file" else {}))
    result = run_job(job)
    assert_clean(result, job)
    spec = load_spec("tiny-qwen3")
    engine = make_layout(spec, "vllm:tp=2")
    held = sum(engine.layout(r).bytes_held(spec) for r in range(engine.world_size))  # bf16: what lands
    for done in result.of(StepDone):
        assert held <= done.bytes < 1.02 * held, (done.bytes, held)  # the full codec moves 2 * held (fp32)
