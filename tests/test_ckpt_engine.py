"""The checkpoint-engine baseline: its placement (CPU), its refusal where it cannot run (CPU), and real
runs of checkpoint-engine 0.4.2 on GPUs (skipped without CUDA GPUs or without the package: on the GPU
host, install the wheels of .whl and put them on PYTHONPATH, then `make test-gpu`)."""

import importlib

import pytest
import torch

from weightsync.bench.ckpt_engine import placement, run_checkpoint_engine, unavailable
from weightsync.bench.run import SCENARIOS
from weightsync.engines import make_layout
from weightsync.errors import ConfigError
from weightsync.spec import load_spec


def _ckpt_engine_missing() -> str | None:
    try:
        for module in ("zmq", "checkpoint_engine.ps", "checkpoint_engine.worker"):
            importlib.import_module(module)
    except Exception as e:  # noqa: BLE001
        return f"checkpoint_engine is not importable ({type(e).__name__}: {e}); install the wheels in .whl"
    return None


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_placement(scenario):
    scen = SCENARIOS[scenario]
    spec = load_spec("qwen3-8b")
    train, infer = make_layout(spec, scen.train), make_layout(spec, scen.infer)
    place = placement(spec, scen)
    assert place.gpus == scen.gpus
    for t in spec.tensors:  # registered whole by a training rank that holds part of it
        owner = place.owners[t.name]
        assert owner in {r for s in train.shards(t.name) for r in train.group_ranks(s.group)}
    owned = place.owned_bytes(spec)
    assert sum(owned.values()) == sum(t.nbytes for t in spec.tensors)
    assert all(b == 0 for r, b in owned.items() if r >= train.world_size)
    largest = max(t.nbytes for t in spec.tensors)
    busy = [b for r, b in owned.items() if r < train.world_size]
    if scen.train.startswith(("megatron:tp", "fsdp")):  # full tensors spread evenly over the holders
        assert max(busy) - min(busy) <= largest
    expected = {}  # the inference workers where run.py puts them
    shared = scen.colocate or scen.gpus == 1  # one GPU for both sides (nixl-1gpu: separate processes)
    for inst in range(scen.instances):
        base = 0 if shared else train.world_size + inst * infer.world_size
        for k in range(infer.world_size):
            expected[base + k] = (inst, k)
    assert place.receivers == expected
    assert set(place.sinks) == set(range(scen.gpus)) - set(expected)
    assert (not place.sinks) == shared


def test_unknown_scenario():
    with pytest.raises(ConfigError):
        unavailable("no-such-scenario")


def test_says_why_it_cannot_run():
    if unavailable("colo-1gpu") is None:
        pytest.skip("checkpoint_engine and a CUDA GPU are here: test_gpu_run covers this host")
    got = run_checkpoint_engine("tiny-qwen3", "colo-1gpu", steps=1, timeout=10)
    assert got["ran"] is False and got["why"]


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_gpu_run(scenario, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA GPUs (run on the GPU host: make test-gpu)")
    missing = _ckpt_engine_missing()
    if missing:
        pytest.skip(missing)
    if torch.cuda.device_count() < SCENARIOS[scenario].gpus:
        pytest.skip(f"{scenario} needs {SCENARIOS[scenario].gpus} GPUs, {torch.cuda.device_count()} visible")
    # 128 KiB buckets (2**-13 GiB: a multiple of 256 bytes, as its double buffer's second half must start on one):
    # several per step, both halves of its double buffer used
    monkeypatch.setenv("PS_MAX_BUCKET_SIZE_GB", str(2**-13))
    got = run_checkpoint_engine("tiny-qwen3", scenario, steps=2, timeout=120)
    assert got["ran"], got
    assert got["verified"] and got["all_tensors_every_step"], got
    assert len(got["step_seconds"]) == 2 and got["buckets_per_step"] > 1
    assert 0 <= got["median_seconds_without_h2d"] <= got["median_seconds"]
