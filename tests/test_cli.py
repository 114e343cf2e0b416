"""`weightsync plan`: its JSON, its readable summary and its one-line errors."""

import json
import subprocess
import sys

import pytest

from weightsync.cli import main

KEYS = {
    "canonical_bytes", "bytes_needed", "bytes_sent", "redundancy", "max_rank_send_bytes", "max_rank_recv_bytes",
    "send_balance", "messages", "buckets", "plan_hash", "plan_seconds", "predicted_seconds",
}


def run_json(capsys, *args):
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_job_json(capsys):
    out = run_json(capsys, "--model", "qwen3-8b", "--train", "megatron:tp=2,pp=2,dp=2", "--infer", "vllm:tp=4", "--instances", "2")
    assert KEYS <= out.keys()
    assert out["canonical_bytes"] == 16_381_470_720
    assert out["bytes_needed"] == out["bytes_sent"] > 2 * 16_381_470_720  # norms are held by every TP rank
    assert out["redundancy"] == 1.0
    assert out["send_balance"] < 1.1


def test_replicated_norms_counted_per_rank(capsys):
    out = run_json(capsys, "--model", "tiny-qwen3", "--train", "hf", "--infer", "vllm:tp=2")
    spec_bytes = out["canonical_bytes"]
    assert out["bytes_needed"] > spec_bytes  # norms and kv heads held by both ranks
    assert out["redundancy"] == 1.0


def test_rank_scope_matches_job(capsys):
    args = ["--model", "tiny-qwen3-moe", "--train", "megatron:ep=2,dp=2", "--infer", "vllm:tp=2,dp=2,ep=4", "--instances", "2"]
    job = run_json(capsys, *args)
    assert len(job["send_bytes"]) == 2  # world = tp*pp*dp; EP is carved out of DP
    sends = [run_json(capsys, *args, "--rank", f"train:{r}")["bytes_sent"] for r in range(2)]
    recvs = [run_json(capsys, *args, "--rank", f"infer:{i}:{r}")["bytes_sent"] for i in range(2) for r in range(4)]
    assert sum(sends) == sum(recvs) == job["bytes_sent"]
    assert max(sends) == job["max_rank_send_bytes"]


def test_readable_summary(capsys):
    assert main(["plan", "--model", "tiny-llama3", "--train", "fsdp:dp=2", "--infer", "sglang:tp=2", "--colocate"]) == 0
    out = capsys.readouterr().out
    assert "redundancy 1.0000" in out and "predicted time" in out and "train    1" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "nope", "--train", "hf", "--infer", "hf"], "unknown model 'nope'"),
        (["--model", "tiny-qwen3", "--train", "deepspeed", "--infer", "hf"], "unknown engine 'deepspeed'"),
        (["--model", "tiny-qwen3", "--train", "hf", "--infer", "vllm:tp=3"], "not divisible by attention TP 3"),
        (["--model", "tiny-qwen3", "--train", "megatron:pp=3", "--infer", "hf"], "pp"),
        (["--model", "tiny-qwen3", "--train", "hf", "--infer", "hf", "--instances", "0"], "at least 1"),
        (["--model", "tiny-qwen3", "--train", "hf", "--infer", "hf", "--rank", "train:5"], "outside"),
    ],
)
def test_errors_are_one_line_and_nonzero(capsys, args, message):
    """Each error through ``main`` in this process (a process start costs seconds of torch imports on CI's two
    cores); the command-line process itself -- exit status, nothing on stdout, nothing else on stderr -- is
    ``test_an_error_is_one_line_and_nonzero_from_the_command_line``."""
    assert main(["plan", *args]) != 0
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightsync: error:"), err
    assert message in lines[0]


def test_an_error_is_one_line_and_nonzero_from_the_command_line():
    p = subprocess.run([sys.executable, "-m", "weightsync", "plan", "--model", "tiny-qwen3", "--train", "hf",
                        "--infer", "vllm:tp=3"], capture_output=True, text=True)
    assert p.returncode != 0
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightsync: error:"), p.stderr
    assert "not divisible by attention TP 3" in lines[0]


@pytest.mark.parametrize("args,message", [
    (["bench"], "give a --scenario (or --lora RANK for an adapter sync)"),
    (["bench", "--lora", "16", "--scenario", "colo-1gpu"], "--lora runs alone"),
    (["bench", "--lora", "0"], "--lora takes adapter ranks of at least 1"),
])
def test_bench_lora_refusals(capsys, args, message):
    """``weightsync bench --lora RANK``'s argument errors, before any engine starts (its run: tests/test_lora_vllm.py
    and BENCHMARKS.md)."""
    assert main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--lora", "600"], "rank 600 is above vLLM's largest max_lora_rank 512: give a rank of at most 512"),
    (["--lora", "32", "--max-lora-rank", "16"], "rank 32 is above the engine's max_lora_rank 16: give a rank of at "
                                                "most 16 or a larger --max-lora-rank"),
    (["--lora", "8", "--max-lora-rank", "12"], "--max-lora-rank 12 is not one vLLM accepts"),
    (["--lora", "8", "--lora-targets", "q_proj,lm_head"], "weightsync syncs LoRA on the decoder's q_proj"),
    (["--lora", "8", "--infer", "hf", "--delta"], "demo --lora runs alone (one PEFT trainer, one real vLLM engine "
                                                  "with LoRA slots): drop --infer, --delta"),
    (["--lora", "0"], "the adapter rank must be at least 1"),
    (["--max-lora-rank", "16"], "--max-lora-rank and --lora-targets go with --lora RANK"),
])
def test_demo_lora_refusals(capsys, args, message):
    """``weightsync demo --lora RANK``'s refusals: one line, exit 2, before any engine starts (its run:
    tests/test_lora_vllm.py)."""
    assert main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_demo_lora_refuses_without_vllm(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert main(["demo", "--lora", "8"]) == 2
    assert "demo --lora needs vLLM: pip install weightsync[vllm]" in capsys.readouterr().err
