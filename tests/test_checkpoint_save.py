"""``save_checkpoint``: real trainers (transformers in process; FSDP2 and megatron-core TP=2 PP=2 in one
4-process gloo world) write their live weights as an HF checkpoint, which transformers' ``from_pretrained``
loads to weights bit-identical to the trainer's canonical weights (random, never zeros).

Every save uses a small ``chunk_bytes`` (4 KiB: smaller than most tensors, so every large tensor is
assembled in many windows) and a small ``shard_bytes`` (several files per owner). Each rank counts the
messages it sends and receives through ``torch.distributed`` itself (patched in the worker), besides
what ``SaveResult`` reports: no message exceeds ``chunk_bytes``, the buffer peak stays under the plan's
bound (smaller than the largest tensor: no tensor is gathered whole), and the bytes copied locally
plus the bytes sent add up to the checkpoint exactly once (each element from one source).

Run as a script (``python tests/test_checkpoint_save.py worker JSON``) it is one rank of a world.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import pytest  # noqa: E402
import torch  # noqa: E402

from weightsync.dtypes import torch_dtype  # noqa: E402
from weightsync.spec import load_spec  # noqa: E402
from weightsync.testing import random_canonical  # noqa: E402

CHUNK = 4096
SHARD = 64 << 10
FP32_SCALE = 1 + 3 / 512  # moves bf16 values off the bf16 grid: the save must round them to nearest


def trainer_canonical(spec, seed: int, fp32: bool = False) -> dict[str, torch.Tensor]:
    """What the trainer holds (fp32 master weights off the bf16 grid when ``fp32``)."""
    c = random_canonical(spec, seed)
    return {n: t.float() * FP32_SCALE for n, t in c.items()} if fp32 else c


def check_loaded(directory: Path, spec, seed: int, fp32: bool = False) -> None:
    """``from_pretrained`` the directory; every canonical tensor equals the trainer's, in the canonical dtype."""
    from transformers import AutoModelForCausalLM

    from weightsync.checkpoint.format import INDEX_NAME
    from weightsync.checkpoint.hf import hf_canonical

    index = json.loads((directory / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == {t.name for t in spec.tensors}
    files = sorted(directory.glob("*.safetensors"))
    assert {f.name for f in files} == set(index["weight_map"].values())
    n = len(files)
    assert [f.name for f in files] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not list(directory.glob("*.tmp"))
    model = AutoModelForCausalLM.from_pretrained(directory)
    got = hf_canonical(model, spec)
    want = trainer_canonical(spec, seed, fp32)
    assert set(got) == set(want)
    for name, w in want.items():
        w = w.to(torch_dtype(spec.by_name[name].dtype))
        g = got[name]
        assert g.dtype == w.dtype and torch.equal(g, w), f"{spec.name}: {name} differs after from_pretrained"


def check_results(results: list[dict], spec) -> None:
    """Bounded memory, bounded messages, every byte from exactly one source, every file written once."""
    total = results[0]["total_bytes"]
    assert total == sum(t.nbytes for t in spec.tensors)
    largest_tensor = max(t.nbytes for t in spec.tensors)
    assert sum(r["bytes_local"] + r["bytes_sent"] for r in results) == total
    assert sum(r["bytes_sent"] for r in results) == sum(r["bytes_received"] for r in results)
    assert sum(r["bytes_written"] for r in results) == total
    files = [f for r in results for f in r["files"]]
    assert len(files) == len(set(files))
    for r in results:
        assert r["bound_bytes"] <= 2 * CHUNK < largest_tensor
        assert r["peak_buffer_bytes"] <= r["bound_bytes"], r
        assert r["largest_message"] <= CHUNK and r["seen_largest_message"] <= CHUNK, r
        assert r["seen_messages"] == r["messages"], r


# --------------------------------------------------------------------------------------------
# The plan alone, for a real-sized model (no processes)


def test_plan_of_a_large_model_is_balanced_and_zero_redundant():
    """Qwen3-8B from Megatron TP=2 PP=2 DP=2: every byte read once, owners' bytes even, windows bounded."""
    from weightsync.checkpoint import make_plan
    from weightsync.engines import make_layout

    spec = load_spec("qwen3-8b")
    engine = make_layout(spec, "megatron:tp=2,pp=2,dp=2")
    plan = make_plan(engine, chunk_bytes=64 << 20, shard_bytes=2 << 30)
    assert plan.total_bytes == spec.nbytes
    assert sum(s.nbytes for w in plan.windows for s in w.sources) == spec.nbytes
    assert max(w.nbytes for w in plan.windows) <= 64 << 20 and plan.bound_bytes <= 128 << 20
    written = [sum(f.data_bytes for f in plan.files if f.owner == r) for r in range(engine.world_size)]
    assert max(written) < 1.05 * min(written), written
    sent = [0] * engine.world_size
    for w in plan.windows:
        for s in w.sources:
            if s.rank != w.owner:
                sent[s.rank] += s.nbytes
    assert all(sent), f"every rank, replicas too, sends its share: {sent}"
    names = [f.name for f in plan.files]
    assert names == [f"model-{i:05d}-of-{len(names):05d}.safetensors" for i in range(1, len(names) + 1)]


# --------------------------------------------------------------------------------------------
# In process: transformers trainers (one rank), and the refusals


def hf_trainer(name: str, seed: int, fp32: bool = False):
    from weightsync.bind.train import HFTrainEngine
    from weightsync.layout.materialize import fill_from
    from weightsync.checkpoint.hf import build_hf_model

    spec = load_spec(name)
    model = build_hf_model(spec, seed=0)
    if fp32:
        model = model.float()
    bound = HFTrainEngine(model).bound
    with torch.no_grad():
        fill_from(bound.layout, bound.tensors, trainer_canonical(spec, seed, fp32))
    return spec, model, bound


@pytest.mark.parametrize("name,fp32", [("tiny-qwen3-moe", False), ("tiny-deepseek-v3", False), ("tiny-qwen3", True)])
def test_hf_save_loads_bit_identical(tmp_path, name, fp32):
    from weightsync.checkpoint import save_checkpoint

    spec, _, bound = hf_trainer(name, seed=11, fp32=fp32)
    r = save_checkpoint(bound, tmp_path, chunk_bytes=CHUNK, shard_bytes=SHARD)
    assert r.bytes_sent == r.bytes_received == 0 and r.bytes_local == r.total_bytes == r.bytes_written
    assert len(r.files) > 1 and r.peak_buffer_bytes <= r.bound_bytes
    check_loaded(tmp_path, spec, 11, fp32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [spec.architecture]


def test_writer_saves_without_a_meta_server(tmp_path):
    """``WeightWriter.save_checkpoint`` before (and without) any set-up: no MetaServer is reached."""
    from weightsync.runtime.writer import WeightWriter

    spec, _, bound = hf_trainer("tiny-qwen3", seed=12)
    writer = WeightWriter(bound, meta="http://127.0.0.1:9", job="no-server", timeout_s=1.0)
    r = writer.save_checkpoint(str(tmp_path), chunk_bytes=CHUNK)
    assert r.files == ("model-00001-of-00001.safetensors",)
    check_loaded(tmp_path, spec, 12)


def test_refusals_write_nothing(tmp_path):
    from weightsync.checkpoint import save_checkpoint
    from weightsync.errors import ConfigError

    spec, model, bound = hf_trainer("tiny-qwen3", seed=13)
    save_checkpoint(bound, tmp_path, chunk_bytes=CHUNK)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    with pytest.raises(ConfigError, match="already holds a checkpoint.*overwrite=True"):
        save_checkpoint(bound, tmp_path)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before

    name = "model.layers.1.mlp.up_proj.weight"
    bound.tensors[name] = torch.zeros(3, 5, dtype=torch.bfloat16)  # what a re-bind after reallocation would miss
    empty = tmp_path / "empty"
    with pytest.raises(ConfigError, match=rf"(?s)nothing was written.*rank 0.*{name}: live shape \[3, 5\]"):
        save_checkpoint(bound, empty)
    assert list(empty.iterdir()) == []

    bound.tensors[name] = dict(model.named_parameters())[name]
    save_checkpoint(bound, tmp_path, chunk_bytes=CHUNK, overwrite=True)
    check_loaded(tmp_path, spec, 13)


# --------------------------------------------------------------------------------------------
# One 4-process gloo world: FSDP2 (dp=4; dp=2 x tp=2) and megatron-core TP=2 PP=2 (dense; MoE with EP=2)
# save one after another, so the processes (and megatron-core's imports, most of the time here) start once.

FSDP_CASES = [("tiny-qwen3", "fsdp:dp=4"), ("tiny-qwen3-moe", "fsdp:dp=4"), ("tiny-llama3", "fsdp:dp=2,tp=2")]
MEGATRON_CASES = [("tiny-qwen3", "megatron:tp=2,pp=2"), ("tiny-qwen3-moe", "megatron:tp=2,pp=2,ep=2")]


def _have_mcore() -> bool:
    """Without importing it here (seconds): the workers do."""
    import importlib.util

    try:
        return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


HAVE_MCORE = _have_mcore()
CASES = FSDP_CASES + (MEGATRON_CASES if HAVE_MCORE else [])


def run_world(world: int, job: dict, timeout: float = 180) -> list[list[dict]]:
    """Start ``world`` ranks of this file as workers; per case, every rank's result."""
    from helpers import run_rank_processes

    outs = run_rank_processes(__file__, job, world, timeout)
    per_rank = [[json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")] for out in outs]
    return [list(case) for case in zip(*per_rank)]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[Path, list[list[dict]]]:
    d = tmp_path_factory.mktemp("world")
    results = run_world(4, {"cases": CASES, "dir": str(d)})
    assert len(results) == len(CASES)
    return d, results


def _check_case(world, case: tuple[str, str]) -> None:
    d, results = world
    i = CASES.index(case)
    name, train = case
    spec, per_rank = load_spec(name), results[i]
    assert sorted(r["rank"] for r in per_rank) == [0, 1, 2, 3]
    check_results(per_rank, spec)
    assert sum(r["bytes_sent"] for r in per_rank) > 0, f"{train}: some tensor must be assembled across ranks"
    assert sum(bool(r["files"]) for r in per_rank) == 4, f"{train}: every rank owns some tensors"
    check_loaded(d / f"case{i}", spec, seed=20 + i)


@pytest.mark.parametrize("case", FSDP_CASES, ids=[f"{m}-{t}" for m, t in FSDP_CASES])
def test_fsdp2_save(world, case):
    _check_case(world, case)


@pytest.mark.megatron
@pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not importable")
@pytest.mark.parametrize("case", MEGATRON_CASES, ids=[f"{m}-{t}" for m, t in MEGATRON_CASES])
def test_megatron_save(world, case):
    _check_case(world, case)


# ---- worker side ---------------------------------------------------------------------------


def _count_messages(seen: dict) -> None:  # pragma: no cover - runs in subprocesses
    """Record every point-to-point message's size where torch.distributed sends and receives it."""
    import torch.distributed as dist

    for op in ("send", "recv"):
        real = getattr(dist, op)

        def counted(t, *a, _real=real, **k):
            seen["n"] += 1
            seen["largest"] = max(seen["largest"], t.numel() * t.element_size())
            return _real(t, *a, **k)

        setattr(dist, op, counted)


def _worker(job: dict) -> None:  # pragma: no cover - runs in subprocesses
    from dataclasses import asdict
    from datetime import timedelta

    import torch.distributed as dist

    from weightsync.checkpoint import save_checkpoint
    from weightsync.layout.materialize import fill_from
    from weightsync.local.trainers import build_trainer

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    seen = {"n": 0, "largest": 0}
    _count_messages(seen)
    for i, (name, train) in enumerate(job["cases"]):
        spec = load_spec(name)
        bound = build_trainer(spec, train, rank, world, same_start=False).bound
        with torch.no_grad():
            fill_from(bound.layout, bound.tensors, trainer_canonical(spec, 20 + i))
        seen.update(n=0, largest=0)
        r = save_checkpoint(bound, Path(job["dir"]) / f"case{i}", chunk_bytes=CHUNK, shard_bytes=SHARD)
        counted = {"seen_messages": seen["n"], "seen_largest_message": seen["largest"]}
        print("RESULT " + json.dumps({**asdict(r), **counted}), flush=True)
        if train.startswith("megatron"):
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
    print(f"RANK {rank} OK", flush=True)
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads can abort there


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    _worker(json.loads(sys.argv[2]))
