"""``weightsync demo``: every training engine trains and syncs bit-exact, and any failure ends it in one line.

Each run is small (tiny presets, 2 steps, one transformers instance): real training processes, a
real MetaServer and real instances, through :class:`weightsync.local.runner.LocalJob`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from weightsync.cli import main

needs_mcore = pytest.mark.skipif(__import__("importlib").util.find_spec("megatron") is None,
                                 reason="megatron-core is not importable")


def demo(capsys, monkeypatch, *args: str) -> tuple[int, dict]:
    """Run the demo; and check its MetaServer ran with an admin token (issue 25's model) and every participant was
    handed its job's token only (each trainer one for every job it writes to): one without a token, or with
    another job's, would be refused (401/403), one with the admin's could open every job."""
    from helpers import assert_job_tokens_only, record_local_job_tokens

    tokens, handed = record_local_job_tokens(monkeypatch)
    code = main(["demo", *args, "--steps", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    if code == 0:
        jobs = sorted({p.job for p, _ in handed if p.job})  # the instances' jobs: every trainer writes to each
        assert_job_tokens_only(tokens, handed, lambda p: [p.job] if p.job else jobs)
    return code, out


def assert_verified(code: int, out: dict) -> None:
    assert code == 0 and out["verified"] and not out["errors"], out
    assert [s["step"] for s in out["steps"]] == [1, 2]
    for s in out["steps"]:
        assert s["bytes"] > 0 and all(i["exact"] and i["version"] == s["step"] for i in s["instances"]), s


@needs_mcore
@pytest.mark.megatron
def test_megatron_tp2_trains_and_syncs(capsys, monkeypatch):
    # megatron-core GPTModel over gloo, TP=2: real forward/backward/AdamW, each rank's shards sent
    code, out = demo(capsys, monkeypatch, "--model", "tiny-qwen3", "--train", "megatron:tp=2", "--infer", "hf")
    assert_verified(code, out)
    assert all(s["loss"] is not None for s in out["steps"])
    # no logits check against a megatron trainer (its forward is another implementation)
    assert all(i["logits_equal"] is None for s in out["steps"] for i in s["instances"])


def test_fsdp2_deepseek_keeps_its_fp32_router(capsys, monkeypatch):
    # transformers 5.24 keeps DeepSeek-V3's router weight fp32 beside bf16 weights: FSDP2 needs one dtype
    # per group, so the router is a group of its own and stays fp32 (the binding's dtype check would refuse
    # it cast); under 5.19-5.23 only the (unsharded) fp32 bias differs, and this runs the plain grouping
    code, out = demo(capsys, monkeypatch, "--model", "tiny-deepseek-v3", "--train", "fsdp:dp=2", "--infer", "hf")
    assert_verified(code, out)
    assert all(i["logits_equal"] is True for s in out["steps"] for i in s["instances"])


def test_fsdp2_with_tp_trains_and_syncs(capsys, monkeypatch):
    # torchtitan's TP plan (activations kept whole) under FSDP2 on a 1 x 2 mesh: each rank's TP shards sent
    code, out = demo(capsys, monkeypatch, "--model", "tiny-llama3", "--train", "fsdp:dp=1,tp=2", "--infer", "hf")
    assert_verified(code, out)


def test_a_failure_ends_the_demo_in_one_line():
    # a 10 ms timeout: the job's deadline (4 x 10 ms) passes before any process is through; every process
    # is stopped and the first one still running is named. Participants spawn (a fresh interpreter each,
    # started at once): the default fork server would first import torch, transformers and megatron-core,
    # seconds of CPU for processes killed as soon as they start; the error line is the same either way
    p = subprocess.run([sys.executable, "-m", "weightsync", "demo", "--train", "hf", "--infer", "hf", "--steps", "1",
                        "--timeout", "0.01"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "WEIGHTSYNC_START_METHOD": "spawn"})
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightsync demo: error: "), p.stderr
    assert "training rank 0: Timeout: the job did not finish within 0.04 s; still running: training rank 0, " \
           "instance 0 of demo-0-hf" in lines[0], lines[0]
    assert "every process's log: " in lines[0]
    assert "Traceback" not in p.stdout + p.stderr


@pytest.mark.parametrize("args,message", [
    (["--train", "vllm:tp=2"], "not a training layout"),
    (["--model", "tiny-deepseek-v3", "--train", "megatron:tp=2"], "multi-latent attention"),
    (["--train", "megatron:pp=3"], "pp"),
    (["--model", "tiny-qwen3-moe", "--train", "fsdp:dp=1,tp=2"], "tp=2"),
    (["--steps", "0"], "at least 1"),
])
def test_bad_options_are_refused_before_anything_starts(capsys, args, message):
    assert main(["demo", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightsync: error:") and message in lines[0], err
