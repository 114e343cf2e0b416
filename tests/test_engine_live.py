"""Live layout checks against real vLLM / SGLang engines: they run wherever the engine is importable
with a CUDA GPU (the GPU host, with a kit on the path: `make test-gpu`), and are skipped with the reason
elsewhere. Each case runs its engine in a spawned process of its own (tests/engine_gpu.py: the pytest process may
have initialized CUDA, and an engine forked after that dies), and a model the installed vLLM lacks kernels for is
skipped naming the missing library."""

import importlib.util
from pathlib import Path

import pytest
import torch
from engine_gpu import run_spawned, vllm_lacks
from hf_models import save_checkpoint

from weightsync.engines import make_layout
from weightsync.layout.layout import check_live
from weightsync.layout.materialize import scatter
from weightsync.spec import load_spec
from weightsync.testing import random_canonical


def needs(module: str):
    if importlib.util.find_spec(module) is None:
        return pytest.mark.skip(reason=f"{module} is not installed here; its live layout check runs where it is")
    if not torch.cuda.is_available():
        return pytest.mark.skip(reason=f"{module} needs a CUDA GPU")
    return pytest.mark.gpu


#: DeepSeek-V3-shaped with the MLA head dims vLLM 0.26's GPU attention backends take (qk_nope 128, rope 64, v 128;
#: the tiny-deepseek-v3 preset's 16/8/16 has no MLA prefill backend on Hopper: "No valid MLA prefill backend found")
DEEPSEEK_HOPPER = str(Path(__file__).resolve().parent.parent / "benchmarks" / "configs" / "tiny-deepseek-v3-hopper.json")


@needs("vllm")
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe", DEEPSEEK_HOPPER],
                         ids=["tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3-hopper"])
def test_vllm_live_layout(tmp_path, model):
    lacks = vllm_lacks(model)
    if lacks:
        pytest.skip(lacks)
    run_spawned(_vllm_live_layout, str(tmp_path), model)


def _vllm_live_layout(path: str, model: str) -> None:
    """In a spawned process: a real engine on a saved checkpoint holds exactly the layout's tensors, bit-exact."""
    from vllm import LLM

    spec = load_spec(model)
    canonical = random_canonical(spec, seed=5)
    save_checkpoint(spec, canonical, path)
    llm = LLM(model=path, tensor_parallel_size=1, enforce_eager=True, load_format="safetensors",
              skip_tokenizer_init=True, gpu_memory_utilization=0.2)
    # each parameter's bytes: vLLM's RPC reply encoding hands a tensor back as a list of numbers (seen on the
    # H200 with vLLM 0.26), bytes stay bytes
    live = llm.collective_rpc(
        lambda self: {n: (tuple(p.shape), str(p.dtype).removeprefix("torch."),
                          p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                      for n, p in self.model_runner.get_model().named_parameters()}
    )[0]
    engine = make_layout(spec, "vllm:tp=1")
    layout = engine.layout(0)
    check_live(layout, {n: v[:2] for n, v in live.items()}, ignore=engine.derived_tensors)
    want = scatter(layout, canonical, fill=0.0)
    for name in layout.tensors:
        shape, _, raw = live[name]
        got = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(want[name].dtype).view(shape)
        assert torch.equal(got, want[name]), name


#: SGLang cases: tiny models whose shapes the SGLang GPU kit's prebuilt JIT kernels cover (head_dim 64, 2 KV
#: heads: its RoPE and KV-cache store kernels; another shape compiles with nvcc on the host, 10-30 s a kernel)
SGLANG_MODELS = {"tiny-qwen3-kv2": ("tiny-qwen3-h64", {"num_key_value_heads": 2}),
                 "tiny-qwen3-moe-h64": ("tiny-qwen3-moe-h64", {})}


@needs("sglang")
@pytest.mark.parametrize("model", sorted(SGLANG_MODELS))
def test_sglang_live_layout(tmp_path, model):
    run_spawned(_sglang_live_layout, str(tmp_path), model)


def _sglang_live_layout(path: str, model: str) -> None:
    """In a spawned process: a real SGLang engine on a saved checkpoint holds exactly the layout's tensors.

    Checked through weightsync's own calls into the engine's workers, not ``Engine.get_weights_by_name`` (SGLang
    0.5.14 implements it for Llama-style models only; Qwen3 answers None): ``SGLangInstance``'s set-up compares
    every worker's ``named_parameters()`` names, shapes and dtypes with the layout (``check_live``), then
    :func:`weightsync.sglang.verify.loaded_problems` compares every piece of every layout tensor with the
    checkpoint, bit for bit, on the worker."""
    from weightsync.sglang.engine import EngineOptions, start
    from weightsync.sglang.verify import loaded_problems

    base, overrides = SGLANG_MODELS[model]
    cfg = dict(load_spec(base).config, **overrides)
    spec = load_spec(cfg)
    canonical = random_canonical(spec, seed=5)
    save_checkpoint(spec, canonical, path)
    own = start(cfg, "sglang:tp=1", EngineOptions(eager=True), checkpoint=path)
    try:
        layout = make_layout(spec, "sglang:tp=1").layout(0)
        assert set(own.instance.engine_layout.layout(0).tensors) == set(layout.tensors)
        problems = [p for ps in own.instance.call(loaded_problems, canonical, cfg, own.instance.engine) for p in ps]
        assert not problems, problems[:5]
        # the check above is not vacuous: every layout tensor has pieces, and a poisoned copy is found
        assert all(t.pieces for t in layout.tensors.values())
        poisoned = {n: (t + 1 if n == next(iter(canonical)) else t) for n, t in canonical.items()}
        found = [p for ps in own.instance.call(loaded_problems, poisoned, cfg, own.instance.engine) for p in ps]
        assert found and next(iter(canonical)) in found[0], found
    finally:
        own.close()
