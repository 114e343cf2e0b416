"""FP8 on the wire, end to end (issue 24): real training processes (gloo) and layout-faithful FP8 vLLM workers
through a real MetaServer. A job whose engine is declared ``quant=fp8`` where the fp8 codec cannot run is refused
at set-up on both sides, by name: nothing syncs bf16 bytes into an FP8-served engine."""

from __future__ import annotations

import pytest
from e2e import run_job

from weightsync.errors import ConfigError


def test_check_engine_refuses_quant_fp8_where_the_fp8_codec_cannot_run():
    from weightsync.codec.fp8 import check_engine, engine_quant

    assert engine_quant("vllm:tp=2,quant=fp8") == "fp8" and engine_quant("vllm:tp=2") == "none"
    assert engine_quant("sglang:tp=2,quant=fp8") == "fp8"
    check_engine("vllm:tp=2", "full", "p2p", "sync")  # unquantized: nothing to refuse
    with pytest.raises(ConfigError, match=r"quant=fp8 needs the fp8 codec, which .*vllm:tp=2,quant=fp8"):
        check_engine("vllm:tp=2,quant=fp8", "full", "colocated", "sync")


def test_a_job_into_an_fp8_engine_the_codec_cannot_serve_is_refused_on_both_sides():
    result = run_job(dict(model="tiny-qwen3", train="fsdp:dp=2", infer="vllm:tp=2,quant=fp8", steps=1,
                          timeout=60.0))
    sides = {f.participant.role for f in result.failures}
    assert sides == {"train", "infer"}, result.failures
    for f in result.failures:
        assert "quant=fp8 needs the fp8 codec" in f.message or "refused" in f.message, f.line()
    assert any("quant=fp8 needs the fp8 codec" in f.message for f in result.failures)
    assert not [e for e in result.events if type(e).__name__ in ("StepDone", "Wrote")]
