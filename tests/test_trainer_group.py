"""Trainer groups (issue 15, "less traffic per step"): ``WeightWriter(group=...)`` makes a step's signalling
one ``written`` post and one ``held`` wait for the whole group, and every rank of the group returns or
raises with the representative's outcome. Real processes: megatron-core trainers on gloo (their WORLD group
is the writer's group), layout-faithful vLLM workers, a real MetaServer whose /metrics counts the requests."""

from __future__ import annotations

import re

from e2e import StepDone, UpdateFailed, run_job, train_errors

from weightsync.meta import MetaClient, MetaServer

WRITTEN = re.compile(r'weightsync_meta_requests_total\{route="POST /v1/jobs/\{job\}/steps/\{S\}/written",'
                     r'status="200"\} (\d+)')


def _written_posts(server: MetaServer) -> int:
    m = WRITTEN.search(MetaClient(server.url, "any").metrics())
    return int(m.group(1)) if m else 0


def test_a_group_signals_once_a_step_and_a_members_failure_reaches_every_rank():
    """Two co-located training ranks (megatron pp=2) in one group, into vLLM TP=2 workers. Steps 1 and 2
    are bit-exact on every worker, and the MetaServer saw exactly one `written` post a step (two
    without the group), recording both ranks. Before step 3, training rank 1 (not the representative)
    reallocates a tensor: its check fails; the representative learns it from the step's gather, aborts
    the job and tells every rank, so both trainers raise with rank 1's reason (WeightsMoved, not a
    timeout) and the reader's update fails with the abort; step 3 is never recorded as written.
    (One job for both halves: the processes' start is most of the cost.)"""
    job = dict(model="tiny-qwen3", train="megatron:pp=2", infer="vllm:tp=2", steps=3, timeout=30.0,
               bucket_bytes=4096, colocate=True, fault="train-moves", fault_rank=1, writer_group=True,
               job="group2")
    with MetaServer().start() as server:
        result = run_job(job, meta_server=server)
        done = sorted(u.step for u in result.of(StepDone) if u.problems == ())
        assert done == [1, 2], result.events
        by_rank = {f.participant.index: f for f in train_errors(result)}
        assert sorted(by_rank) == [0, 1], result.events
        for f in by_rank.values():
            assert f.kind == "WeightsMoved", by_rank
            assert "moved since it was shared" in f.message and "Step 3 is not recorded as written" in f.message
        assert by_rank[0].message.startswith("training rank 1"), by_rank[0]
        failed = result.of(UpdateFailed)
        assert failed and failed[0].step == 3 and failed[0].kind == "MetaAborted", result.events
        summary = MetaClient(server.url, "group2").summary()
        assert "training rank 1" in summary["aborted"], summary
        assert summary["written"] == {"1": [0, 1], "2": [0, 1]}, summary
        assert _written_posts(server) == 2  # steps 1 and 2, once each for both ranks


def test_an_outcome_crosses_the_group_as_its_error_class_with_a_long_message_cut():
    """What the representative broadcasts: a fixed slot, the message cut to fit, rebuilt as the error
    class it was raised as (a MetaError keeps its status); no group without torch.distributed."""
    import pytest

    from weightsync.errors import ConfigError, MetaAborted, WeightsMoved
    from weightsync.runtime.trainer_group import SLOT, Outcome, TrainerGroup

    long = Outcome.failed(7, 3, "j", WeightsMoved("x" * 10 * SLOT))
    back = Outcome.decode(long.encode())
    assert (back.step, back.rank, back.job, back.error) == (7, 3, "j", "WeightsMoved")
    assert back.message.endswith(" [...]") and len(back.message) < SLOT
    e = back.exception()
    assert type(e) is WeightsMoved and str(e).startswith("training rank 3: WeightsMoved: xxx")
    aborted = Outcome.decode(Outcome.failed(2, 0, "j", MetaAborted("job j aborted: r", 409)).encode()).exception()
    assert type(aborted) is MetaAborted and aborted.status == 409
    ok = Outcome.decode(Outcome(4, 0, "j", dropped=((1, 4),)).encode())
    assert ok.error is None and ok.dropped == ((1, 4),)
    with pytest.raises(ConfigError, match="needs torch.distributed initialised"):
        TrainerGroup(object())
