"""Live layout checks against real vLLM / SGLang engines: they run wherever the engine is importable
with a CUDA GPU (the GPU host, with a kit on the path: `make test-gpu`), and are skipped with the reason
elsewhere. Each vLLM case runs in a spawned process of its own, and a model the installed vLLM lacks
kernels for is skipped naming the missing library (tests/engine_gpu.py)."""

import importlib.util

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


@needs("vllm")
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"])
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


@needs("sglang")
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_sglang_live_layout(tmp_path, model):
    import sglang

    spec = load_spec(model)
    canonical = random_canonical(spec, seed=5)
    save_checkpoint(spec, canonical, tmp_path)
    engine = sglang.Engine(model_path=str(tmp_path), tp_size=1, skip_tokenizer_init=True, mem_fraction_static=0.2)
    try:
        layout = make_layout(spec, "sglang:tp=1").layout(0)
        want = scatter(layout, canonical, fill=0.0)
        for name, t in layout.tensors.items():
            got = torch.as_tensor(engine.get_weights_by_name(name, truncate_size=t.numel))
            assert tuple(got.shape) == t.shape, name
            assert torch.equal(got.to(want[name].dtype), want[name]), name
    finally:
        engine.shutdown()

