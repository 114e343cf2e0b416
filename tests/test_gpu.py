"""GPU paths (NCCL, CUDA IPC): run on the GPU host with `make test-gpu`; skipped without CUDA GPUs."""

import pytest
import torch
from e2e import StepDone, UpdateFailed, assert_clean, run_job, train_errors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (run on the GPU host: make test-gpu)"),
]


@pytest.mark.parametrize("model,infer", [("tiny-qwen3", "vllm:tp=1"), ("qwen3-0.6b", "vllm:tp=1"),
                                         ("tiny-qwen3-moe", "sglang:tp=1")])
def test_nccl_separated_bit_exact(model, infer):
    # trainer on cuda:0, the inference instance on cuda:1, over NCCL in a group beside the default one
    job = dict(model=model, train="hf", infer=infer, steps=3, timeout=120.0, gpu_base=1)
    assert_clean(run_job(job), job)


@pytest.mark.parametrize("model", ["tiny-qwen3", "qwen3-0.6b"])
def test_cuda_ipc_colocated_bit_exact(model):
    # trainer and instance share cuda:0: the worker opens the trainer's weights by CUDA IPC once and
    # copies device to device every step
    job = dict(model=model, train="hf", infer="vllm:tp=1", steps=3, timeout=120.0, gpu_base=0, colocate=True)
    assert_clean(run_job(job), job)


@pytest.mark.parametrize("scenario", ["sep-1to1", "colo-1gpu", "colo-pp2-tp2"])
def test_bench_scenarios_bit_exact_with_baselines(scenario):
    # the bench's own runs on a small model: ours (stream-ordered NCCL, coalesced both-way units, CUDA IPC)
    # and every baseline must leave exactly the trainer's bits on every inference rank
    from weightsync.bench.run import run

    r = run(scenario, "qwen3-0.6b", steps=2, timeout=120.0, baselines=("naive", "bucketed"))
    assert not r["errors"], r["errors"]
    assert r["verified"], r
    # the H200s reach each other's memory: the workers found so and copied the other GPU's pieces directly
    assert r["peer_copies"] is (True if r["colocate"] else None)
    # and on two GPUs each pushed its own GPU's trainer's pieces into the other worker's tensors
    assert r["pushed_bytes"] is None if not r["colocate"] else (r["pushed_bytes"] > 0) == (scenario == "colo-pp2-tp2")
    for kind, b in r["baselines"].items():
        assert b["ran"] and b["verified"], (kind, b)


def test_colocated_with_expandable_segments(monkeypatch):
    # Megatron and RL frameworks often run with the allocator's expandable segments; CUDA IPC (the
    # trainers' weights opened by the workers, the workers' by each other for the push) must work there
    # too, bit-exact. The spawned trainers and workers read the setting when they start CUDA.
    from weightsync.bench.run import run

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    r = run("colo-pp2-tp2", "qwen3-0.6b", steps=2, timeout=120.0, baselines=())
    assert not r["errors"], r["errors"]
    assert r["verified"] and r["peer_copies"] and r["pushed_bytes"] > 0, r


def test_colocated_without_peer_copies_goes_through_nccl():
    # as on GPUs without peer access: same-GPU pieces are still direct copies, the other GPU's go through
    # the workers' NCCL group (the trainers' proxies send them), bit-exact
    from weightsync.bench.run import run

    r = run("colo-pp2-tp2", "qwen3-0.6b", steps=2, timeout=120.0, baselines=(), peer_copies=False)
    assert not r["errors"], r["errors"]
    assert r["verified"] and r["peer_copies"] is False and r["pushed_bytes"] == 0, r


def test_nccl_inference_process_killed_fails_the_trainer_in_bounded_time():
    import time

    job = dict(model="tiny-qwen3", train="hf", infer="vllm:tp=1", steps=2, timeout=10.0, gpu_base=1,
               bucket_bytes=2048, fault="infer-dies")
    t0 = time.monotonic()
    result = run_job(job)
    errors = train_errors(result)
    assert errors, result.events
    assert errors[0].kind in ("TransportError", "MetaAborted", "MetaTimeout"), errors
    assert time.monotonic() - t0 < 120


def test_nccl_trainer_killed_mid_transfer_reports_no_version():
    job = dict(model="tiny-qwen3", train="hf", infer="vllm:tp=1", steps=2, timeout=10.0, gpu_base=1,
               bucket_bytes=2048, fault="train-dies")
    result = run_job(job)
    failed = result.of(UpdateFailed)
    assert failed, result.events
    f = failed[0]
    assert f.step == 2 and f.kind in ("WorkerError", "TransportError", "WorkerDied", "WorkerTimeout"), failed
    assert f.version is None  # whatever landed, no step is claimed
    assert [u.step for u in result.of(StepDone)] == [1]
