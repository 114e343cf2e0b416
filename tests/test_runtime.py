"""End to end: real trainers (transformers, FSDP2, megatron-core on gloo) -> real instances, bit-exact."""

import time

import pytest
from e2e import Pulled, StepDone, UpdateFailed, Wrote, assert_clean, infer_errors, run_job, train_errors


def updated_steps(result) -> list[int]:
    return [u.step for u in result.of(StepDone)]


CASES = [
    # every training engine and every inference layout appears; odd cases: KV-head replication
    # (vllm tp=8 > 2 KV heads), vocab padding (250 -> 256), tied embeddings (tiny-qwen3), uneven PP,
    # MoE with EP, DP attention, 2 instances
    dict(model="tiny-qwen3", train="hf", infer="hf", instances=2),
    dict(model="tiny-qwen3", train="fsdp:dp=2", infer="vllm:tp=2", instances=2),
    dict(model="tiny-llama3", train="fsdp:dp=2", infer="vllm:tp=8", bucket_bytes=4096),
    dict(model="tiny-qwen3", train="megatron:pp=2", infer="vllm:tp=4"),
    dict(model="tiny-llama3", train="megatron:tp=2,pp=2,pp_first=3", infer="sglang:tp=2", instances=2),
    dict(model="tiny-qwen3-moe", train="megatron:ep=2,dp=2", infer="vllm:tp=2,dp=2,ep=4"),
    dict(model="tiny-qwen3", train="megatron:tp=2", infer="sglang:tp=4,dp=2,dp_attention=1"),
    dict(model="tiny-deepseek-v3", train="hf", infer="sglang:tp=2"),
    dict(model="tiny-qwen3-moe", train="fsdp:dp=2", infer="hf"),
    dict(model="tiny-qwen2", train="fsdp:dp=2,tp=2", infer="vllm:tp=1", instances=2),
    # fp32 master weights travel as fp32; receivers round to nearest as a checkpoint load does
    dict(model="tiny-qwen3", train="fsdp:dp=2", infer="vllm:tp=2", fp32=True),
    dict(model="tiny-deepseek-v3", train="hf", infer="sglang:tp=2", fp32=True),
    # co-located: inference workers open the trainers' shared memory and proxy for them
    dict(model="tiny-qwen3", train="megatron:tp=2", infer="vllm:tp=2", colocate=True),
    dict(model="tiny-llama3", train="fsdp:dp=2", infer="vllm:tp=2", instances=2, colocate=True),
    dict(model="tiny-qwen3-moe", train="megatron:ep=2,dp=2", infer="sglang:tp=2", colocate=True),
    dict(model="tiny-deepseek-v3", train="hf", infer="hf", instances=2, colocate=True),
]


@pytest.mark.parametrize("job", CASES, ids=[f"{c['model']}-{c['train']}-{c['infer']}x{c.get('instances', 1)}{'-colo' if c.get('colocate') else ''}"
                                     f"{'-fp32' if c.get('fp32') else ''}"
                                     for c in CASES])
def test_end_to_end_bit_exact(job):
    job = dict(job, steps=2)
    assert_clean(run_job(job), job)


def test_file_transport_end_to_end(tmp_path):
    job = dict(model="tiny-qwen3-moe", train="fsdp:dp=2", infer="vllm:tp=2", instances=2, steps=3,
               transport="file", directory=str(tmp_path), bucket_bytes=8192)
    assert_clean(run_job(job), job)
    assert not list(tmp_path.glob("*.safetensors"))  # every file consumed


def test_mixed_transports_refused(tmp_path):
    # timeout 20 s: the job's deadline is 5x it; 10 s (50 s) was passed by process start-up alone on a loaded
    # 2-core machine (a full make test with vLLM engines beside it), the refusal itself takes ~1 s
    job = dict(model="tiny-qwen3", train="hf", infer="hf", steps=1, timeout=20.0, transport="file",
               directory=str(tmp_path), reader_transport="p2p")
    result = run_job(job)
    errors = result.failures
    assert errors and "transport" in " ".join(f.message for f in errors), result.events


@pytest.mark.parametrize("staged", [False, True])
def test_async_instances_pull_when_they_choose(staged):
    job = dict(model="tiny-qwen3", train="fsdp:dp=2", infer="vllm:tp=2", instances=2, steps=3, mode="async",
               staged=staged)
    result = run_job(job)
    errors = result.failures
    assert not errors, errors
    pulled = result.of(Pulled)
    assert sorted((p.participant.index, p.version) for p in pulled) == [(0, 1), (0, 3), (1, 3)]
    for p in pulled:
        assert p.problems == (), f"{p.participant} claims step {p.version}: {p.problems}"
    first = next(p for p in pulled if p.participant.index == 0 and p.version == 1)
    # the MetaServer reports which instance holds which step: instance 0 at 1 while the trainers moved on
    assert first.summary["held"]["0"] == 1


def test_trainer_killed_mid_transfer():
    job = dict(model="tiny-qwen3", train="hf", infer="vllm:tp=2", instances=1, steps=2, timeout=10.0,
               bucket_bytes=2048, fault="train-dies")
    result = run_job(job)
    failed = result.of(UpdateFailed)
    assert failed, result.events
    f = failed[0]
    assert f.step == 2 and f.kind in ("WorkerError", "TransportError"), failed
    assert "training rank 0" in f.message or "group rank 0" in f.message, f.message
    assert f.version is None and f.intact is False  # part of step 2 landed: no version is claimed
    assert updated_steps(result) == [1]


def test_staged_reader_keeps_the_old_version_when_a_trainer_dies():
    job = dict(model="tiny-qwen3", train="hf", infer="vllm:tp=2", instances=1, steps=2, timeout=10.0,
               bucket_bytes=2048, fault="train-dies", staged=True)
    result = run_job(job)
    failed = result.of(UpdateFailed)
    assert failed, result.events
    f = failed[0]
    assert f.version == 1 and f.intact is True  # the live weights are still exactly step 1


def test_colocated_trainer_dying_before_its_step_leaves_the_old_version():
    """Co-located, the workers copy only once every trainer announced the step: a trainer that dies first
    makes the reader give up within seconds -- it watches the trainers' liveness while it waits for their bells
    (weightsync.transport.liveness) -- naming the dead rank, still holding (and reporting) exactly step 1."""
    job = dict(model="tiny-qwen3", train="megatron:pp=2", infer="vllm:tp=2", instances=1, steps=2, timeout=20.0,
               bucket_bytes=4096, colocate=True, fault="train-dies-before-write")  # set-up too fits in the timeout
    # (20 s: under a loaded 2-core machine two megatron pp=2 trainers took over 10 s to register)
    arrived: dict[type, float] = {}
    result = run_job(job, on_event=lambda ev: arrived.setdefault(type(ev), time.monotonic()))
    failed = result.of(UpdateFailed)
    assert failed, result.events
    f = failed[0]
    assert f.step == 2 and f.kind == "TrainerLost" and "training rank 0's written of step 2" in f.message, failed
    assert "training rank 0 is gone" in f.message and "still hold step 1" in f.message, f.message
    assert f.version == 1 and f.intact is True, failed  # nothing of step 2 was copied
    assert updated_steps(result) == [1]
    # in seconds, not at its own timeout (before: the whole 20 s): timed from step 1, so that a slow set-up on a
    # loaded machine does not count
    assert arrived[UpdateFailed] - arrived[StepDone] < job["timeout"] / 2, arrived


@pytest.mark.parametrize("staged", [False, True])
def test_colocated_trainer_weights_moved_fail_the_step_on_both_sides(staged):
    """Co-located workers copy from where a trainer's weights were shared at start-up. A trainer that
    reallocated one (as offloading and reloading does) rings its bell, so the workers copy -- the stale
    memory the export keeps alive -- while it checks; it then says which tensor moved and aborts the job
    instead of recording the step as written, and the reader, which reports a step held only once it is
    recorded, fails the update: with no version if it copied, still at step 1 if it learnt of the abort
    first. A staged reader copies only recorded steps: it still holds exactly step 1. (``fault="train-moves"``: rank 0 reallocates a tensor before step 2.)"""
    job = dict(model="tiny-qwen3", train="megatron:pp=2", infer="vllm:tp=2", instances=1, steps=2, timeout=30.0,
               bucket_bytes=4096, colocate=True, fault="train-moves", staged=staged)
    result = run_job(job)
    by_rank = {f.participant.index: f for f in train_errors(result)}
    assert by_rank[0].kind == "WeightsMoved", by_rank
    assert "training rank 0: tensor" in by_rank[0].message and "moved since it was shared" in by_rank[0].message
    assert "Step 2 is not recorded as written" in by_rank[0].message, by_rank[0]
    failed = result.of(UpdateFailed)
    assert failed, result.events
    f = failed[0]
    assert f.step == 2 and f.kind == "MetaAborted" and "moved since it was shared" in f.message, failed
    # a plain reader that copied reports no version; one that learnt of the abort first (its report of
    # step 1 was refused: the trainer saw it on the bell and moved on) did not copy, and keeps step 1
    allowed = [(1, True)] if staged else [(None, False), (1, True)]
    assert (f.version, f.intact) in allowed, failed
    assert updated_steps(result) == [1]


def test_colocated_worker_weights_moved_fail_the_update():
    """A worker whose live tensors moved since it shared them with the workers pushing into it fails the
    step, naming the tensor, instead of letting them write into the old memory; the reader reports no
    version and aborts the job, so the trainers stop waiting for it at once."""
    job = dict(model="tiny-qwen3", train="megatron:pp=2", infer="vllm:tp=2", instances=1, steps=2, timeout=30.0,
               bucket_bytes=4096, colocate=True, fault="infer-moves")
    result = run_job(job)
    failed = result.of(UpdateFailed)
    assert failed, result.events
    f = failed[0]
    assert f.step == 2 and f.kind == "WeightsMoved" and "instance 0 worker 0: tensor" in f.message, failed
    assert "moved since it was shared with the instance's other workers" in f.message, f.message
    assert f.version is None, failed
    assert updated_steps(result) == [1]
    errors = train_errors(result)
    assert {e.kind for e in errors} == {"MetaAborted"} and "worker 0: tensor" in errors[0].message, errors


def test_colocated_worker_dying_mid_copy_fails_both_sides():
    job = dict(model="tiny-qwen3", train="megatron:pp=2", infer="vllm:tp=2", instances=1, steps=2, timeout=10.0,
               bucket_bytes=4096, colocate=True, fault="infer-dies")  # set-up too fits in the timeout
    result = run_job(job)
    errors = infer_errors(result)
    assert errors and "died (exit code 3) during receive" in errors[0].message, result.events
    assert updated_steps(result) == [1], result.events
    # the trainers learn it from the missing `held`, within their timeout
    errors = train_errors(result)
    assert errors and {e.kind for e in errors} == {"MetaTimeout"}, errors


def test_colocated_worker_stopped_mid_step_is_named_by_its_peers():
    """Co-located without peer copies (two instances, cross-GPU pieces through the inference workers' group):
    instance 0's rank 1 -- the proxy of training rank 1 -- stops dead as step 2 begins. Instance 1's rank 0, which
    receives training rank 1's pieces from it, gives up within seconds (the group's beats) naming that worker, not
    a training rank: the group's ranks are inference workers."""
    job = dict(model="tiny-qwen3", train="megatron:pp=2", infer="vllm:tp=2", instances=2, steps=2, timeout=20.0,
               bucket_bytes=4096, colocate=True, reader_peer_copies=False, fault="infer-stops")
    arrived: dict[tuple, float] = {}
    result = run_job(job, on_event=lambda ev: arrived.setdefault((type(ev), ev.participant.index), time.monotonic()))
    failed = [f for f in result.of(UpdateFailed) if f.participant.index == 1]
    assert failed and failed[0].step == 2 and failed[0].kind == "TransferAbandoned", result.events
    message = failed[0].message
    assert "instance 0 rank 1 (the proxy of training rank 1) has given no sign of life" in message, message
    assert "training rank 1 has given" not in message, message
    assert arrived[UpdateFailed, 1] - arrived[StepDone, 1] < job["timeout"] / 2, arrived


def test_inference_process_killed():
    job = dict(model="tiny-qwen3", train="hf", infer="vllm:tp=2", instances=1, steps=2, timeout=10.0,
               bucket_bytes=2048, fault="infer-dies")
    result = run_job(job)
    errors = train_errors(result)
    assert errors, result.events
    assert errors[0].kind == "TransportError", errors
    # the worker died inside step 2's transfer (not before it), and the reader said so
    errors = infer_errors(result)
    assert errors and "died (exit code 3) during receive" in errors[0].message, result.events


@pytest.mark.parametrize("side", ["writer", "reader"])
def test_transient_memory_over_budget_refused_before_any_transfer(side):
    # buffers are window x the largest bucket: with 4 KiB buckets, a 5 KiB budget is too small. The refusal
    # comes at set-up, so the timeout costs nothing here; it must outlast the instance's start (its two
    # worker processes) on a loaded machine, or the trainer times out waiting for it before planning
    job = dict(model="tiny-qwen3", train="hf", infer="vllm:tp=2", steps=1, timeout=30.0, bucket_bytes=4096)
    job["memory_budget" if side == "writer" else "reader_memory_budget"] = 5000
    result = run_job(job)
    assert not result.of(Wrote, StepDone), result.events
    errors = result.failures
    assert {e.participant.role for e in errors} == {"train", "infer"}, errors  # the whole job stops, not just the refuser
    text = " ".join(e.message for e in errors)
    assert "memory budget of 5000 bytes" in text and "bucket_bytes <=" in text, text


def test_colocated_on_one_host_needs_no_buffer():
    """Co-located on one host every bucket is a direct copy out of the trainer's memory: any budget fits."""
    job = dict(model="tiny-qwen3", train="megatron:pp=2", infer="vllm:tp=2", steps=2, timeout=10.0,
               bucket_bytes=4096, colocate=True, reader_memory_budget=5000)
    result = run_job(job)
    assert not result.failures, result.events
    updated = result.of(StepDone)
    assert len(updated) == 2 and all(u.problems == () for u in updated), result.events  # both steps, bit-exact


@pytest.mark.parametrize("options", [dict(reader_push=False), dict(staged=True)], ids=["push-off", "staged"])
def test_colocated_workers_that_do_not_push_read_the_other_gpu(options):
    """By default a worker writes its GPU's trainer's pieces into the other workers of its instance; with
    pushing off (an engine whose weights cannot be exported), or staged (each worker commits its own copy
    once its own copies end), every worker reads the other GPU's pieces itself, bit-exact."""
    job = dict(model="tiny-qwen3", train="megatron:pp=2", infer="vllm:tp=2", steps=2, timeout=20.0,
               bucket_bytes=4096, colocate=True, **options)
    assert_clean(run_job(job), job)


@pytest.mark.parametrize("budget", [5000, 2 << 30])
def test_colocated_without_peer_copies_goes_through_the_group(budget):
    """A reader registered with peer_copies=False (as one whose workers cannot reach the other GPUs would
    be) turns them off for the whole job: cross-GPU pieces go through the workers' group, bit-exact, and
    its buffers count against the budget again."""
    job = dict(model="tiny-qwen3", train="megatron:pp=2", infer="vllm:tp=2", steps=2, timeout=10.0,
               bucket_bytes=4096, colocate=True, reader_memory_budget=budget, reader_peer_copies=False)
    result = run_job(job)
    if budget == 5000:
        errors = result.failures
        assert errors and not result.of(Wrote, StepDone), result.events
        assert "memory budget of 5000 bytes" in " ".join(e.message for e in errors), errors
        return
    assert not result.failures, result.events
    updated = result.of(StepDone)
    assert len(updated) == 2 and all(u.problems == () for u in updated), result.events


def test_mismatched_model_refused_before_any_transfer():
    job = dict(model="tiny-qwen3", infer_model="tiny-llama3", train="hf", infer="hf", steps=1, timeout=10.0)
    result = run_job(job)
    errors = result.failures
    assert errors and not result.of(Wrote, StepDone)
    text = " ".join(e.message for e in errors)
    assert "JobMismatch" in {e.kind for e in errors}, errors
    assert "model.embed_tokens.weight" in text or "model.layers.0" in text, text


def test_wrong_token_refused():
    # refused at the first request, so the timeout costs nothing; it bounds the job (5 x timeout), which must
    # outlast both processes' start on a loaded machine (5 s: the job's 25 s passed before either asked)
    job = dict(model="tiny-qwen3", train="hf", infer="hf", steps=1, timeout=20.0, server_token="s3cret", token="wrong")
    result = run_job(job)
    errors = result.failures
    assert errors and all("401" in e.message or "token" in e.message.lower() for e in errors), errors


def test_meta_server_restart_between_steps(tmp_path):
    from weightsync.meta.server import MetaServer

    state = tmp_path / "meta.json"
    flag = tmp_path / "restarted"
    server = MetaServer(port=0, state_path=str(state)).start()

    def restart(old):
        port = old.port
        old.stop()
        new = MetaServer(port=port, state_path=str(state)).start()
        flag.write_text("yes")
        return new

    job = dict(model="tiny-qwen3", train="hf", infer="vllm:tp=2", steps=3, timeout=20.0,
               restart_meta_before=2, restart_flag=str(flag))
    try:
        result = run_job(job, meta_server=server, on_restart=restart)
    finally:
        pass
    assert_clean(result, job)


def test_held_reports_go_out_in_order_and_a_failed_one_raises_later():
    """The reader posts ``held`` from a background thread: the server sees every report, in order, and
    one the server refuses (here: an instance that never joined) raises at the reader's next check."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from weightsync.meta.client import MetaClient, MetaError
    from weightsync.meta.server import MetaServer
    from weightsync.runtime.reader import WeightReader

    with MetaServer(port=0) as server:
        reader = WeightReader.__new__(WeightReader)  # only the reporting half: no engine, no workers
        reader.client, reader.instance_id, reader.timeout_s = MetaClient(server.url, "j"), 0, 10.0
        reader._announcer, reader._report_error, reader._report_lock = ThreadPoolExecutor(1), None, threading.Lock()
        # no doorbell: reports go to the MetaServer only; a fixed-membership job: no incarnation
        reader.session = SimpleNamespace(held_bell=None, incarnation=None)
        reader.client.join(0)
        reader.client.register("train", 0)
        for step in (1, 2, 3, 4):  # the MetaServer takes `held` only for a step some trainer wrote
            reader.client.written(step, 0)
        for step in (1, 2, 3):  # out of order, the server would refuse the lower step
            reader._announce(step)
        reader._check_announced(wait=True)
        assert reader.client.summary()["held"] == {"0": 3}
        reader.instance_id = 5  # never joined: the server refuses its report
        reader._announce(4)
        with pytest.raises(MetaError):
            reader._check_announced(wait=True)
        reader._announcer.shutdown()
