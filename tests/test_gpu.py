"""GPU paths (NCCL, CUDA IPC): run on the GPU host with `make test-gpu`; skipped without CUDA GPUs."""

import pytest
import torch
from e2e import run_job
from test_runtime import assert_clean

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
