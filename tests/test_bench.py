"""The bench: its data (any rank regenerates any region, each step's bits differ), its floor inputs, and
every scenario rehearsed end to end on CPU."""

import pytest
import torch

from weightsync.bench.run import SCENARIOS, advance, check, init_weights, moved_per_gpu
from weightsync.engines import make_layout
from weightsync.layout.materialize import TORCH_DTYPES
from weightsync.runtime.instance import WorkerContext
from weightsync.spec import load_spec


def test_doubling_steps_are_checked_exactly():
    spec = load_spec("tiny-qwen3-moe")
    engine = make_layout(spec, "vllm:tp=2,ep=2")
    layout = engine.layout(1)
    tensors = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype]) for n, t in layout.tensors.items()}
    init_weights(layout, tensors, spec)
    for _ in range(3):
        advance(tensors)
    ctx = WorkerContext(rank=1, device=torch.device("cpu"), tensors=tensors)
    assert check(ctx, spec.name, "vllm:tp=2,ep=2", 3)
    assert not check(ctx, spec.name, "vllm:tp=2,ep=2", 2)  # a stale step never passes


def test_floor_inputs_split_local_and_remote_bytes():
    spec = load_spec("qwen3-8b")
    s = SCENARIOS["colo-pp2-tp2"]
    per = moved_per_gpu(make_layout(spec, s.train), make_layout(spec, s.infer), s)
    assert set(per) == {0, 1}
    assert all(local > 0 and remote > 0 for local, remote in per.values())
    s = SCENARIOS["sep-1to1"]
    assert moved_per_gpu(make_layout(spec, s.train), make_layout(spec, s.infer), s) == {1: (0, spec.nbytes)}


def test_results_record_where_they_were_measured():
    from weightsync.bench.run import environment

    env = environment()
    assert {"date", "gpus", "torch", "nccl", "weightsync", "commit"} <= env.keys()
    assert env["torch"] == torch.__version__


def test_every_scenario_plans_and_places_on_its_gpus():
    # the 4-GPU scenarios have not run on a GPU yet: at least their plans, GPU placement and the
    # co-located baselines' hand-over are checked here
    from weightsync.bench.baselines import colocated_buckets, needs_training_group

    spec = load_spec("qwen3-8b")
    for name, s in SCENARIOS.items():
        train, infer = make_layout(spec, s.train), make_layout(spec, s.infer)
        per = moved_per_gpu(train, infer, s)
        assert set(per) <= set(range(s.gpus)), (name, per)
        # every instance receives the whole model once, from its own GPU or from the others
        assert sum(local + remote for local, remote in per.values()) >= s.instances * spec.nbytes, name
        if not s.colocate:
            continue
        # every canonical tensor handed over exactly once; TP-split ones gathered over the trainers first
        buckets = colocated_buckets("bucketed", train)
        assert sorted(t.name for bs in buckets.values() for b in bs for t in b) == sorted(spec.by_name), name
        assert needs_training_group(train) == (train.config.get("tp", 1) > 1), name


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_scenario_rehearses_on_cpu(scenario):
    """``weightsync bench --device cpu``: the scenario's real processes -- MetaServer, writers, readers driving
    layout-faithful workers, the baselines' groups (gloo) and hand-overs (shared memory) -- with a small MoE
    model, every step and every baseline checked bit for bit. The 4-GPU scenarios have not run on GPUs: this
    is their wiring, tested before a GPU host is spent on it."""
    from weightsync.bench.run import run

    r = run(scenario, "tiny-qwen3-moe", steps=2, timeout=60.0, baselines=("naive", "bucketed"), device="cpu")
    assert not r["errors"], r["errors"]
    assert r["verified"] and len(r["step_seconds"]) == 2
    assert r["floor_seconds"] is None and r["efficiency"] is None  # no ceilings on CPU
    assert r["peer_copies"] is (True if r["colocate"] else None)  # shared memory: every worker reaches every trainer
    # co-located over several GPUs, the workers write the pieces of their own GPU's trainers into each other
    assert r["pushed_bytes"] is None if not r["colocate"] else (r["pushed_bytes"] > 0) == (scenario != "colo-1gpu")
    if r["transport"] != "p2p":  # the baselines run over p2p's NCCL/gloo group (nixl-1gpu has none)
        assert r["baselines"] == {}
        return
    for kind in ("naive", "bucketed"):
        assert r["baselines"][kind]["ran"] and r["baselines"][kind]["verified"], (kind, r["baselines"][kind])


def test_colocated_bench_without_peer_copies_goes_through_the_group():
    """``--no-peer-copies``: the other GPU's pieces cross the workers' group (gloo here), still bit-exact, and
    the result says so."""
    from weightsync.bench.run import run

    r = run("colo-pp2-tp2", "tiny-qwen3-moe", steps=2, timeout=60.0, baselines=(), device="cpu", peer_copies=False)
    assert not r["errors"], r["errors"]
    assert r["verified"] and r["peer_copies"] is False and r["pushed_bytes"] == 0
