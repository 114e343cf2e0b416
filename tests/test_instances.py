"""Inference instances: layout-faithful worker processes, a live transformers model, and (where the
engine and a GPU exist) vLLM / SGLang."""

import importlib.util
import os
import time

import pytest
import torch
from hf_models import build_hf_model, live_tensors, load_canonical_into

from weightsync.engines import make_layout
from weightsync.engines.hf import HFLayout
from weightsync.errors import LayoutMismatch
from weightsync.instances import InstanceError, WorkerDied, WorkerTimeout
from weightsync.instances.faithful import FaithfulInstance, live_shapes, snapshot
from weightsync.instances.hf import HFInstance
from weightsync.layout.layout import check_live
from weightsync.layout.materialize import fill_from, scatter
from weightsync.runtime.instance import WorkerContext
from weightsync.spec import load_spec
from weightsync.testing import random_canonical

# -- functions run on workers (module level, so they pickle by reference) -------------------------


def check_layout(ctx: WorkerContext, model, engine):
    """check_live inside the worker, against the layout the worker's rank derives; returns a summary."""
    layout = make_layout(load_spec(model), engine).layout(ctx.rank)
    check_live(layout, live_shapes(ctx))
    all_nan = all(bool(torch.isnan(t.float()).all()) for t in ctx.tensors.values())
    return ctx.rank, os.getpid(), str(ctx.device), len(ctx.tensors), all_nan


def remember(ctx: WorkerContext, value):
    ctx.state.setdefault("seen", []).append(value)
    return ctx.rank, list(ctx.state["seen"])


def fail_on(ctx: WorkerContext, rank, message):
    if ctx.rank == rank:
        raise ValueError(message)
    return ctx.rank


def die_on(ctx: WorkerContext, rank):
    if ctx.rank == rank:
        os._exit(3)
    return ctx.rank


def stall_on(ctx: WorkerContext, rank, seconds):
    if ctx.rank == rank:
        time.sleep(seconds)
    return ctx.rank


def write_canonical(ctx: WorkerContext, canonical, model, engine):
    """The reference load: canonical values into this rank's tensors, following its own layout."""
    fill_from(make_layout(load_spec(model), engine).layout(ctx.rank), ctx.tensors, canonical)
    return sorted(ctx.tensors)


def gone(pids, within=5.0):
    """True once none of ``pids`` is a live process (zombies count as gone)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split(")")[-1].split()[0] != "Z":
                        alive.append(pid)
            except FileNotFoundError:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


# -- FaithfulInstance -----------------------------------------------------------------------------

CONFIGS = [("tiny-qwen3-moe", "vllm:tp=2"), ("tiny-deepseek-v3", "sglang:tp=4,dp=2,dp_attention=1")]


@pytest.mark.parametrize("model,engine", CONFIGS)
def test_faithful_workers_hold_the_layout(model, engine):
    spec = load_spec(model)
    derived = make_layout(spec, engine)
    with FaithfulInstance(model, engine) as inst:
        assert inst.world_size == derived.world_size
        assert inst.engine == engine and inst.model_config == dict(spec.config)
        got = inst.call(check_layout, model, engine, timeout_s=30)
        assert [g[0] for g in got] == list(range(inst.world_size))  # rank order
        assert len({g[1] for g in got}) == inst.world_size  # one process per rank
        assert all(g[2] == "cpu" and g[4] for g in got)  # all NaN
        for rank, snap in enumerate(inst.call(snapshot)):
            layout = derived.layout(rank)
            assert list(snap) == list(layout.tensors)  # the engine's own order
            for name, t in layout.tensors.items():
                assert tuple(snap[name].shape) == t.shape and str(snap[name].dtype) == f"torch.{t.dtype}", name
                assert torch.isnan(snap[name].float()).all(), name
    pids = inst.pids
    assert gone(pids)


def test_faithful_call_state_errors_and_writes():
    model, engine = "tiny-qwen3-moe", "vllm:tp=2"
    spec = load_spec(model)
    derived = make_layout(spec, engine)
    inst = FaithfulInstance(dict(spec.config), engine, fill=0.0)
    try:
        assert inst.call(remember, "a") == [(0, ["a"]), (1, ["a"])]
        assert inst.call(remember, "b") == [(0, ["a", "b"]), (1, ["a", "b"])]  # state persists
        with pytest.raises(ValueError, match="boom on one") as info:
            inst.call(fail_on, 1, "boom on one", timeout_s=30)
        assert info.value.rank == 1
        assert any("fail_on" in n and "rank 1" in n for n in info.value.__notes__)  # the worker's traceback
        assert inst.call(fail_on, 7, "never", timeout_s=30) == [0, 1]  # still usable after an exception
        with pytest.raises(TypeError, match="module-level"):
            inst.call(lambda ctx: 1)
        # writes land in the worker's tensors and stay there
        canonical = random_canonical(spec, seed=3)
        inst.call(write_canonical, canonical, model, engine, timeout_s=30)
        for rank, snap in enumerate(inst.call(snapshot)):
            for name, t in scatter(derived.layout(rank), canonical, fill=0.0).items():
                assert torch.equal(snap[name], t), (rank, name)
    finally:
        inst.close()
    assert gone(inst.pids)
    with pytest.raises(InstanceError, match="closed"):
        inst.call(remember, "c")


def test_faithful_worker_death_and_stall_raise_within_timeout():
    inst = FaithfulInstance("tiny-qwen3", "vllm:tp=2")
    pids = inst.pids
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match="rank 1 .*exit code 3"):
        inst.call(die_on, 1, timeout_s=20)
    assert time.monotonic() - t0 < 5
    assert gone(pids)  # the other worker was shut down too
    with pytest.raises(InstanceError, match="died"):
        inst.call(remember, "x")

    inst = FaithfulInstance("tiny-qwen3", "vllm:tp=2")
    t0 = time.monotonic()
    # rank 0 stalls; rank 1 answers at once, though on a loaded 2-core host maybe not within the deadline too
    # (seen once: the suite run serially beside other work), so rank 0 must be named, rank 1 may be
    with pytest.raises(WorkerTimeout, match=r"ranks \[0[],]"):
        inst.call(stall_on, 0, 60, timeout_s=1.5)
    assert time.monotonic() - t0 < 5
    assert gone(inst.pids)


def test_faithful_gc_and_bad_config():
    inst = FaithfulInstance("tiny-qwen3", "vllm:tp=2")
    pids = inst.pids
    del inst  # garbage collection stops the workers
    import gc

    gc.collect()
    assert gone(pids)
    from weightsync.errors import ConfigError

    with pytest.raises(ConfigError):
        FaithfulInstance("tiny-qwen3", "vllm:tp=3")  # refused before any process starts


# -- HFInstance -----------------------------------------------------------------------------------


def write_all(ctx: WorkerContext, canonical, layout):
    fill_from(layout, ctx.tensors, canonical)
    return sorted(ctx.tensors)


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_hf_instance_writes_into_the_live_module(model):
    spec = load_spec(model)
    module = build_hf_model(spec)
    inst = HFInstance(module)
    assert inst.world_size == 1 and inst.engine.partition(":")[0] == "hf"  # plus what it keeps in fp32 (DeepSeek)
    from weightsync.spec.model import spec_from_config

    assert spec_from_config(inst.model_config).digest == spec.digest
    layout = HFLayout(spec).layout(0)
    canonical = random_canonical(spec, seed=11)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    names = inst.call(write_all, canonical, layout)[0]
    assert names == sorted(layout.tensors)
    if spec.architecture == "DeepseekV3ForCausalLM":
        assert any(n.endswith("e_score_correction_bias") for n in names)
    # the module now holds exactly what a reference load gives
    ref = build_hf_model(spec)
    load_canonical_into(ref, spec, canonical)
    after = module.state_dict()
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert changed
    for name, t in live_tensors(ref).items():
        assert torch.equal(after[name], t), name
    inst.close()


def test_hf_instance_refuses_a_mismatched_module():
    spec = load_spec("tiny-qwen3")
    module = build_hf_model(spec)
    module.model.norm.weight = torch.nn.Parameter(torch.ones(spec.hidden_size + 1, dtype=torch.bfloat16))
    with pytest.raises(LayoutMismatch, match="model.norm.weight"):
        HFInstance(module)


# -- real engines (only where they and a GPU exist) -------------------------------------------------


def needs(module: str):
    if importlib.util.find_spec(module) is None:
        return pytest.mark.skip(reason=f"{module} is not installed here; its instance test runs where it is (with a GPU)")
    if not torch.cuda.is_available():
        return pytest.mark.skip(reason=f"{module} needs a CUDA GPU")
    return pytest.mark.gpu


def rank_and_names(ctx: WorkerContext):
    return ctx.rank, sorted(ctx.tensors)


@needs("vllm")
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_vllm_instance(tmp_path, model):
    """On a GPU host (the CPU vLLM tests are tests/test_vllm*.py), in a spawned process of its own; a model
    the installed vLLM lacks kernels for is skipped naming them (tests/engine_gpu.py)."""
    from engine_gpu import run_spawned, vllm_lacks

    lacks = vllm_lacks(model)
    if lacks:
        pytest.skip(lacks)
    run_spawned(_vllm_instance, str(tmp_path), model)


def _vllm_instance(path: str, model: str) -> None:
    from hf_models import save_checkpoint
    from vllm import LLM

    from weightsync.instances.vllm import VLLMInstance

    spec = load_spec(model)
    canonical = random_canonical(spec, seed=5)
    save_checkpoint(spec, canonical, path)
    llm = LLM(model=path, tensor_parallel_size=1, enforce_eager=True, load_format="safetensors",
              skip_tokenizer_init=True, gpu_memory_utilization=0.2,
              worker_extension_cls="weightsync.vllm.extension.WeightSyncExtension")
    inst = VLLMInstance(llm)
    assert inst.engine.startswith("vllm:tp=1")
    layout = make_layout(spec, inst.engine).layout(0)
    assert inst.call(rank_and_names) == [(0, sorted(layout.tensors))]
    inst.pause()
    inst.call(write_canonical, random_canonical(spec, seed=6), model, inst.engine)
    inst.after_update()
    inst.resume()


@needs("sglang")
def test_sglang_instance(tmp_path):
    from hf_models import save_checkpoint

    from weightsync.sglang.engine import EngineOptions, start

    spec = load_spec("tiny-qwen3-moe")
    save_checkpoint(spec, random_canonical(spec, seed=5), tmp_path)
    # started as weightsync starts SGLang (weightsync.sglang.engine): Triton attention -- the GPU kit has no FA3,
    # SGLang's default on Hopper, whose missing library ends the scheduler and, through SGLang's own handler, the
    # process that started the engine (this test's xdist worker: "node down" in make test-gpu)
    owned = start(dict(spec.config), "sglang:tp=1", EngineOptions(eager=True), checkpoint=str(tmp_path))
    try:
        inst = owned.instance
        layout = make_layout(spec, inst.engine).layout(0)
        assert inst.call(rank_and_names) == [(0, sorted(layout.tensors))]
        inst.pause()
        inst.call(write_canonical, random_canonical(spec, seed=6), "tiny-qwen3-moe", inst.engine)
        inst.after_update()
        inst.resume()
        with pytest.raises(ValueError, match="boom"):
            inst.call(fail_on, 0, "boom")
    finally:
        owned.close()
