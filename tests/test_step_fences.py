"""A reader never lands what it did not ask for, never reports a step nobody wrote, and does not take a slow training
step for a dead transfer (issue 40, "correctness first"), on real parts: a real MetaServer, real trainer processes
writing through real gloo groups, a live instance's tensors poisoned first.

- a trainer stopped mid-bucket, given up on, then resumed (SIGCONT) after a new job synced the same instance: its
  abandoned transfer lands nothing (before: every small tensor it carried -- the RMSNorms -- held its bytes);
- a reader asking for step k while the trainers write step j != k: refused before any byte lands, naming both steps,
  the job aborted so the trainers learn it at once; a step never written: "no training rank has written step k;
  latest written j", within ``written_timeout_s``, the engine untouched and not withheld;
- a training step longer than ``timeout_s``: the reader waits for it (the trainers are alive) and lands it whole.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from test_reader_faults import BUCKET, MODEL, Instance, TrainRank, same, weights
from test_reader_faults import server, spawn  # noqa: F401 -- the shared fixtures


def _writer(meta: str, job: str, steps: list[int], timeout_s: float, colocate: bool = False,
            stop_posts: int = 0, pause_before: dict[int, float] | None = None, linger_s: float = 0.0,
            directory: str | None = None) -> None:
    """One training rank (layout hf, world 1) writing ``steps`` (each step's weights from its number); with
    ``stop_posts``, it stops dead (SIGSTOP) right after that many bucket posts of its last step; ``pause_before``
    step -> seconds of "training" before writing it; then it stays alive ``linger_s``."""
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import fill_from, scatter
    from weightsync.runtime.writer import WeightWriter
    from weightsync.spec import load_spec

    torch.set_num_threads(1)
    spec = load_spec(MODEL)
    engine = make_layout(spec, "hf")
    rank = TrainRank(engine, 0, engine.layout(0), scatter(engine.layout(0), weights(spec, 0)), spec)
    writer = WeightWriter(rank, meta=meta, job=job, timeout_s=timeout_s, bucket_bytes=BUCKET, colocate=colocate,
                          transport="file" if directory else "p2p", directory=directory).connect()
    for step in steps:
        with torch.no_grad():
            fill_from(rank.layout, rank.tensors, weights(spec, step))
        time.sleep((pause_before or {}).get(step, 0.0))
        if stop_posts and step == steps[-1]:
            from vllm_harness import stop_after_posts

            stop_after_posts(stop_posts, signal.SIGSTOP)
        writer.write(step)
    time.sleep(linger_s)
    writer.close()


def expected(spec, step: int, inst: Instance) -> dict[str, torch.Tensor]:
    """What the instance's one worker holds after a good sync of ``step``: its layout's pieces of that step."""
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import scatter

    return scatter(make_layout(spec, inst.engine).layout(0), weights(spec, step))


def _transfers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "weightsync-transfer"]


def test_a_transfer_given_up_on_lands_nothing_when_its_trainer_resumes(server, spawn):
    """The issue's late resume: the trainer is SIGSTOPped with step 2's second bucket in flight; the (not staged)
    reader gives up within seconds. A new job syncs step 5 into the same instance, bit-exact. Then the old trainer
    resumes: its abandoned messages arrive -- and land nowhere: every tensor still holds step 5's bytes."""
    from weightsync.errors import TransportError
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    spec = load_spec(MODEL)
    inst = Instance(spec)
    old = spawn(_writer, server.url, "fence-old", [1, 2], 30.0, stop_posts=2)
    reader = WeightReader(inst, meta=server.url, job="fence-old", instance_id=0, instances=1, timeout_s=30.0,
                          bucket_bytes=BUCKET).connect()
    assert reader.update(1) == 1
    with pytest.raises(TransportError, match="training rank 0"):
        reader.update(2)
    assert reader.version is None  # not staged: bytes of step 2 may have landed before the stop
    stuck = _transfers()
    assert stuck, "the abandoned receive's helper thread should still wait in gloo"

    new = spawn(_writer, server.url, "fence-new", [5], 30.0)
    fresh = WeightReader(inst, meta=server.url, job="fence-new", instance_id=0, instances=1, timeout_s=30.0,
                         bucket_bytes=BUCKET).connect()
    assert fresh.update(5) == 5
    want = expected(spec, 5, inst)
    assert same(inst.snapshot(), want)

    os.kill(old.pid, signal.SIGCONT)  # the abandoned messages arrive now
    deadline = time.monotonic() + 25
    while any(t.is_alive() for t in stuck) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(t.is_alive() for t in stuck), "the abandoned receive never finished: the test proves nothing"
    got = inst.snapshot()
    moved = [n for n in want if not torch.equal(got[n].nan_to_num(), want[n].nan_to_num())]
    assert not moved, f"the resumed trainer's bytes landed in {len(moved)} tensors: {moved[:5]}"
    fresh.close()
    new.join(20)


@pytest.mark.parametrize("colocate", [False, True], ids=["p2p", "colocated"])
def test_a_reader_numbering_steps_apart_is_refused_before_any_byte(server, spawn, colocate):
    """The trainer writes 0, 1, 2; the reader asks for 1 (the README's trainer counted from 0, the engine example
    from 1): update(1) is refused within seconds, naming both steps, the instance untouched and not withheld; the
    job is aborted, so the trainer's write(0) fails at once instead of waiting out its timeout."""
    from weightsync.errors import StepMismatch
    from weightsync.spec import load_spec
    from weightsync.runtime.reader import WeightReader

    spec = load_spec(MODEL)
    inst = Instance(spec)
    job = f"numbering-{'colo' if colocate else 'p2p'}"
    trainer = spawn(_writer, server.url, job, [0, 1, 2], 30.0, colocate=colocate)
    reader = WeightReader(inst, meta=server.url, job=job, instance_id=0, instances=1, timeout_s=30.0,
                          bucket_bytes=BUCKET, colocate=colocate, early_call=False).connect()
    before = inst.snapshot()
    withheld = []
    inst.withhold = withheld.append
    t0 = time.monotonic()
    with pytest.raises(StepMismatch, match=r"step 0.*step 1|step 1.*step 0") as e:
        reader.update(1)
    assert time.monotonic() - t0 < 10.0
    assert "number steps alike" in str(e.value)
    assert same(inst.snapshot(), before) and not withheld  # nothing landed: nothing to withhold
    trainer.join(15)
    assert trainer.exitcode not in (0, None), "the trainer's write(0) should have failed: the job was aborted"


def test_a_step_never_written_says_so_and_withholds_nothing(server, spawn):
    """The trainer writes 0, 1, 2 and then trains on (alive, writing nothing): update(3) fails once
    ``written_timeout_s`` (3 s here) passed -- not gloo's "Timed out waiting ... for recv" -- saying that no training
    rank has written step 3 and the latest written is 2; the instance keeps serving step 2 (version 2, not withheld)."""
    from weightsync.errors import StepNotWritten
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    spec = load_spec(MODEL)
    inst = Instance(spec)
    spawn(_writer, server.url, "never-written", [0, 1, 2], 30.0, linger_s=30.0)
    reader = WeightReader(inst, meta=server.url, job="never-written", instance_id=0, instances=1, timeout_s=30.0,
                          bucket_bytes=BUCKET, written_timeout_s=3.0).connect()
    for step in (0, 1, 2):
        assert reader.update(step) == step
    withheld = []
    inst.withhold = withheld.append
    t0 = time.monotonic()
    with pytest.raises(StepNotWritten, match=r"no training rank has written step 3 \(latest written: 2\)") as e:
        reader.update(3)
    assert "the instance still holds step 2" in str(e.value), str(e.value)  # not "step None": it was never withheld
    assert 2.5 < time.monotonic() - t0 < 15.0
    assert reader.version == 2 and not withheld
    assert same(inst.snapshot(), expected(spec, 2, inst))


@pytest.mark.parametrize("transport", ["p2p", "file"])
def test_a_training_step_longer_than_the_timeout_is_waited_for(server, spawn, tmp_path, transport):
    """A training step of 6 s against a 2 s ``timeout_s``, into a faithful instance (a worker process, whose calls
    have deadlines): update(2) waits for it (the trainer is alive: its beat, or its liveness listener) and lands it
    whole, where it used to fail at the timeout and withhold an engine nothing had touched."""
    from weightsync.instances.faithful import FaithfulInstance, snapshot
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    spec = load_spec(MODEL)
    inst = FaithfulInstance(MODEL, "vllm:tp=1")
    try:
        directory = str(tmp_path) if transport == "file" else None
        job = f"slow-step-{transport}"
        spawn(_writer, server.url, job, [1, 2], 2.0, pause_before={2: 6.0}, directory=directory)
        reader = WeightReader(inst, meta=server.url, job=job, instance_id=0, instances=1, timeout_s=2.0,
                              bucket_bytes=BUCKET, transport=transport, directory=directory).connect()
        assert reader.update(1) == 1
        t0 = time.monotonic()
        assert reader.update(2) == 2
        assert time.monotonic() - t0 > 4.0  # it did wait for the training step
        (got,) = inst.call(snapshot)
        assert same(got, expected(spec, 2, Instance(spec)))
        reader.close()
    finally:
        inst.close()
