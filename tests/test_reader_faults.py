"""Faults a WeightReader must survive quickly and say plainly (issue 25), on real parts: a real MetaServer,
real trainer processes writing through real gloo groups, a live transformers model as the instance.

- a trainer that stops dead (SIGSTOP) or is killed (SIGKILL) with a bucket in flight: gloo alone notices
  neither until its own timeout; the worker's watch of the trainers' beats does, in seconds, names the
  trainer, and a staged reader keeps the previous step bit for bit;
- an elastic reader dropped for silence is told "dropped: join again" at its next update, and
  ``rejoin()`` is one call;
- a worker that hangs gives the reader a :class:`~weightsync.errors.WorkerTimeout` (not ``WorkerDied``)
  within twice its timeout.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from weightsync.runtime.instance import NoEngineHooks

MODEL = "tiny-qwen3"
BUCKET = 64 << 10


def weights(spec, seed: int) -> dict[str, torch.Tensor]:
    from weightsync.testing import random_canonical

    return random_canonical(spec, seed=700 + seed)


@dataclass
class TrainRank:
    """A training rank's side as WeightWriter takes it: its layout's tensors, no framework (starts in a blink)."""

    engine: Any
    rank: int
    layout: Any
    tensors: dict[str, torch.Tensor]
    spec: Any


class Instance(NoEngineHooks):
    """An instance whose one worker's context lives in this process (NaN-poisoned tensors)."""

    def __init__(self, spec, engine: str = "vllm:tp=1"):
        from weightsync.engines import make_layout
        from weightsync.layout.materialize import TORCH_DTYPES
        from weightsync.runtime.instance import WorkerContext

        self.engine, self.model_config = engine, dict(spec.config)
        layout = make_layout(spec, engine).layout(0)
        self.ctx = WorkerContext(0, torch.device("cpu"), {n: torch.full(t.shape, float("nan"),
                                                                       dtype=TORCH_DTYPES[t.dtype])
                                                          for n, t in layout.tensors.items()})
        self.world_size = 1

    def call(self, fn, *args, timeout_s=None):
        return [fn(self.ctx, *args)]

    def close(self) -> None:
        pass

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.ctx.tensors.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].nan_to_num(), b[n].nan_to_num()) for n in a)


def _trainer(meta: str, job: str, steps: list[int], timeout_s: float, stop_at: int | None, sig: int) -> None:
    """One training rank (layout hf, world 1) writing ``steps``; at ``stop_at`` it posts the first bucket of the
    step and then stops dead (``sig``: SIGSTOP or SIGKILL) with it in flight."""
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import fill_from, scatter
    from weightsync.runtime.writer import WeightWriter
    from weightsync.spec import load_spec
    from vllm_harness import stop_after_posts

    torch.set_num_threads(1)
    spec = load_spec(MODEL)
    engine = make_layout(spec, "hf")
    rank = TrainRank(engine, 0, engine.layout(0), scatter(engine.layout(0), weights(spec, 0)), spec)
    writer = WeightWriter(rank, meta=meta, job=job, timeout_s=timeout_s, bucket_bytes=BUCKET).connect()
    for step in steps:
        with torch.no_grad():
            fill_from(rank.layout, rank.tensors, weights(spec, step))
        if step == stop_at:
            stop_after_posts(1, sig)
        writer.write(step)
    writer.close()


@pytest.fixture(scope="module")
def server():
    from weightsync.meta.server import MetaServer

    with MetaServer(port=0) as s:
        yield s


@pytest.fixture()
def spawn():
    """Start processes from the shared fork server; every one is SIGKILLed at the end (stopped ones too)."""
    from helpers import forkserver

    ctx, procs = forkserver(), []

    def start(fn, *args):
        p = ctx.Process(target=fn, args=args, daemon=True)
        p.start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(10)


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_trainer_dead_with_a_bucket_in_flight(server, spawn, sig):
    """The trainer stops dead right after posting step 2's first bucket: the reader's update(2) fails within
    seconds (timeout 30 s), naming training rank 0, the staged instance still holds step 1 bit for bit, and the
    next update is refused at once (the job's group cannot be used again)."""
    from weightsync.errors import TransportError
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    job, timeout = f"dead-trainer-{sig}", 30.0
    trainer = spawn(_trainer, server.url, job, [1, 2, 3], timeout, 2, sig)
    inst = Instance(load_spec(MODEL))
    reader = WeightReader(inst, meta=server.url, job=job, instance_id=0, instances=1, staged=True,
                          timeout_s=timeout, bucket_bytes=BUCKET).connect()
    assert reader.update(1) == 1
    step1 = inst.snapshot()
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="training rank 0") as e:
        reader.update(2)
    took = time.monotonic() - t0
    assert took < 8.0, f"noticed after {took:.1f} s: {e.value}"  # gloo alone, stopped: the whole 30 s
    if sig == signal.SIGSTOP:  # (killed after its whole message left, gloo may see the connection close first)
        assert "stopped or dead" in str(e.value)
    assert reader.version == 1
    assert same(inst.snapshot(), step1)  # staged: step 1 whole, bit for bit
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="refused: an earlier transfer failed"):
        reader.update(3)
    assert time.monotonic() - t0 < 1.0
    if sig == signal.SIGSTOP:
        assert trainer.is_alive()  # stopped, not dead: only its beat said so
