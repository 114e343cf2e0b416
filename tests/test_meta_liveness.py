"""Liveness of async instances: no step waits for one, so each proves it is alive (``alive`` heartbeats within
its ``liveness_s``) and the MetaServer marks a silent one ``gone`` -- in the members list and in /metrics.

A real MetaServer over HTTP throughout; the last test runs a real async job (a training process, two
instance processes with WeightReaders) and SIGKILLs one of the instances.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import pytest

from weightsync.errors import ConfigError
from weightsync.local.events import Done, Event, Participant, Ready
from weightsync.local.runner import Emit, LocalJob
from weightsync.meta.client import Member, MetaClient, MetaError
from weightsync.meta.heartbeat import Heartbeat
from weightsync.meta.server import MetaServer

LIVENESS = 1.0  # the silent members' heartbeat deadline (the server sweeps every 0.25 s)
BEATING = 2.0  # a beating member's: a beat every 0.5 s, so a loaded machine's stalls do not drop it


@pytest.fixture(scope="module")
def server():
    with MetaServer() as s:
        yield s


def wait_state(client: MetaClient, instance: int, state: str, within: float) -> Member:
    deadline = time.monotonic() + within
    while True:
        m = client.members()[instance]
        if m.state == state or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_a_silent_member_is_marked_gone_and_a_beating_one_stays(server):
    c = MetaClient(server.url, "liveness", timeout=5.0)
    c.register("train", 0)
    c.join(0, liveness_s=BEATING)  # beats
    c.join(1, liveness_s=LIVENESS)  # falls silent
    c.join(2)  # no deadline: only a step (sync) notices it
    c.join(3, liveness_s=BEATING)  # reports steps held (every 0.25 s): that is heard from too
    version = c.instances()["version"]
    beat = Heartbeat(c, 0, BEATING).start()
    try:
        for step in range(1, 9):  # 2 s: twice the deadline
            c.written(step, 0)
            c.held(3, step)
            time.sleep(0.25)
        gone = wait_state(c, 1, "gone", within=1.0)
        assert gone.state == "gone" and "no heartbeat" in gone.reason and f"liveness_s of {LIVENESS:g} s" in gone.reason
        assert gone.liveness_s == LIVENESS
        members = c.members()
        assert {i: m.state for i, m in members.items()} == {0: "joined", 1: "gone", 2: "joined", 3: "joined"}
        assert members[3].held == 8 and members[0].liveness_s == BEATING and members[2].liveness_s is None
        # a topology change like any other: the version grew (its waiters woke)
        assert c.wait_topology(version, timeout=0.1)["instances"] == [0, 2, 3]
        text = c.metrics()
        assert 'weightsync_meta_member{job="liveness",instance="1",state="gone"} 1' in text
        assert 'weightsync_meta_member{job="liveness",instance="0",state="joined"} 1' in text
        # the dropped one is told so when it speaks again, and may join again
        with pytest.raises(MetaError, match=r"dropped \(gone\) \(no heartbeat .*join again") as e:
            c.alive(1)
        assert e.value.status == 409
        assert c.join(1, liveness_s=LIVENESS)["changed"] is True and c.members()[1].state == "joined"
    finally:
        beat.stop()
    assert beat.error is None
    assert wait_state(c, 0, "gone", within=BEATING + 1.0).state == "gone"  # once its heartbeat stopped
    with pytest.raises(MetaError, match=r"liveness_s must be a number of seconds in \[0.5, 86400\], got 0.1"):
        c.join(4, liveness_s=0.1)
    with pytest.raises(MetaError, match="unknown fields"):
        c._request("POST", f"{c._job_path}/instances/2/leave", {"liveness_s": 1.0})


def test_a_heartbeat_refused_stops_and_says_why(server):
    """A heartbeat of another incarnation than the joined one (a reader replaced by a rejoin) is refused:
    its thread stops and check() raises, naming the rejoin."""
    c = MetaClient(server.url, "liveness-rejoin", timeout=5.0)
    c.join(0, incarnation="aa", liveness_s=LIVENESS)
    c.join(0, incarnation="bb", liveness_s=LIVENESS)  # a new reader under the same id
    stale = Heartbeat(c, 0, LIVENESS, incarnation="aa").start()
    deadline = time.monotonic() + 3.0
    while stale.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(MetaError, match="stopped counting it as alive: .*rejoined"):
        stale.check()
    stale.stop()


def test_after_a_restart_every_deadline_starts_again(tmp_path):
    """When a member was last heard is not stored: after a restart longer than its deadline it is still
    joined, and marked gone only once a whole deadline passes without a heartbeat."""
    path = str(tmp_path / "state.db")
    with MetaServer(state_path=path) as s:
        c = MetaClient(s.url, "j", timeout=5.0)
        c.join(0, liveness_s=LIVENESS)
        port = s.port
    time.sleep(LIVENESS + 0.5)
    with MetaServer(port=port, state_path=path) as s:
        t0 = time.monotonic()
        assert c.members()[0] == Member(0, "joined", since=0, version=1, liveness_s=LIVENESS)
        m = wait_state(c, 0, "gone", within=LIVENESS + 1.0)
        assert m.state == "gone" and time.monotonic() - t0 >= LIVENESS - 0.3
    with MetaServer(port=port, state_path=path) as s:
        assert c.members()[0].state == "gone"  # the drop was saved


def test_the_reader_option_is_checked_before_any_io():
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    @dataclass
    class Unused:  # what a reader's constructor reads of its instance
        engine: str
        model_config: dict

    instance = Unused("hf", dict(load_spec("tiny-qwen3").config))
    with pytest.raises(ConfigError, match=r"instance_timeout_s .* within \[0.5, 86400\] s, got 0.1"):
        WeightReader(instance, meta="http://127.0.0.1:1", job="x", instance_id=0, instances=1, mode="async",
                     instance_timeout_s=0.1)
    # sync mode: no heartbeat, so no deadline; async without one: the reader's timeout
    assert WeightReader(instance, meta="http://127.0.0.1:1", job="x", instance_id=0, instances=1,
                        instance_timeout_s=0.1).session.liveness_s is None
    assert WeightReader(instance, meta="http://127.0.0.1:1", job="x", instance_id=0, instances=1, mode="async",
                        timeout_s=7.0).session.liveness_s == 7.0


# -- a real async job, an instance SIGKILLed ---------------------------------------------------------


@dataclass(frozen=True)
class Dying(Done):
    """An instance is about to SIGKILL itself (a Done: the job goes on without it)."""


@dataclass(frozen=True)
class Seen(Event):
    """The trainer saw the members as they were once the killed instance was marked gone, ``after_s`` after
    the kill."""

    members: tuple[Member, ...]
    after_s: float


JOB, KILLED_LIVENESS, TIMEOUT = "liveness-async", 1.5, 30.0


def _trainer(emit: Emit, port: int, meta: str) -> None:
    import torch
    import torch.distributed as dist

    from weightsync.local.trainers import build_trainer
    from weightsync.runtime.writer import WeightWriter
    from weightsync.spec import load_spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    trainer = build_trainer(load_spec("tiny-qwen3"), "hf", 0, 1)
    writer = WeightWriter(trainer.bound, meta=meta, job=JOB, mode="async", timeout_s=TIMEOUT).connect()
    emit(Ready(emit.participant))
    writer.write(1)
    writer.client.wait_held(1, [0, 1], timeout=TIMEOUT)
    killed = float(writer.client.lookup("killed", timeout=TIMEOUT))  # instance 0's wall clock, just before
    while (members := writer.client.members())[0].state == "joined" and time.time() < killed + TIMEOUT:
        time.sleep(0.05)
    emit(Seen(emit.participant, tuple(members[i] for i in sorted(members)), time.time() - killed))
    writer.write(2)  # the job goes on: the live instance pulls it
    writer.client.wait_held(2, [1], timeout=TIMEOUT)
    writer.close()
    dist.destroy_process_group()


def _reader(emit: Emit, inst: int, meta: str) -> None:
    import torch

    from weightsync.local.instances import build_instance
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    torch.set_num_threads(1)
    local = build_instance(load_spec("tiny-qwen3"), "hf")
    reader = WeightReader(local.instance, meta=meta, job=JOB, instance_id=inst, instances=2, mode="async",
                          timeout_s=TIMEOUT, instance_timeout_s=KILLED_LIVENESS if inst == 0 else TIMEOUT).connect()
    emit(Ready(emit.participant))
    reader.client.wait_written(1, timeout=TIMEOUT)
    assert reader.pull() == 1
    if inst == 0:  # once step 1 is reported held, die with no word to anybody (workers included)
        reader.client.wait_held(1, [0], timeout=TIMEOUT)
        reader.client.publish("killed", repr(time.time()))
        emit(Dying(emit.participant))
        emit.flush()
        os.killpg(os.getpgrp(), signal.SIGKILL)
    reader.client.wait_written(2, timeout=TIMEOUT)
    assert reader.pull() == 2
    reader.close()  # a clean close leaves: state left, not gone
    local.close()


def test_a_killed_async_instance_is_marked_gone():
    from weightsync.transport.group import free_port

    with LocalJob(deadline_s=3 * TIMEOUT) as job:
        job.add(Participant.trainer(0), _trainer, free_port(), job.meta_url)
        for i in range(2):
            job.add(Participant.instance(i), _reader, i, job.meta_url)
        result = job.run()
        assert result.ok, f"{result.failure.line()}\n{result.failure.traceback}"
        final = MetaClient(job.meta_url, JOB, timeout=5.0).members()
    (seen,) = result.of(Seen)
    dead, live = seen.members
    assert dead.state == "gone" and dead.liveness_s == KILLED_LIVENESS and "no heartbeat" in dead.reason, dead
    assert live.state == "joined" and live.held == 1 and live.liveness_s == TIMEOUT, live
    # marked within its deadline and a sweep (and the trainer's look): never before the deadline passed
    # (its last word, the step's held report, came a moment before the kill; a beat at most 1/4 deadline)
    assert KILLED_LIVENESS * 3 / 4 - 0.1 <= seen.after_s < KILLED_LIVENESS + 2.5, seen.after_s
    assert final[0].state == "gone" and final[1].state == "left" and final[1].held == 2


def test_a_heartbeat_whose_owner_is_gone_stops(server):
    """A reader dropped without close() must not leave a thread claiming it alive for the process's life: the
    heartbeat holds its owner (the reader's session) weakly and stops once it is garbage."""
    import gc

    class Owner:
        pass

    c = MetaClient(server.url, "liveness-owner", timeout=5.0)
    c.join(0, liveness_s=LIVENESS)
    owner = Owner()
    beat = Heartbeat(c, 0, LIVENESS, owner=owner).start()
    time.sleep(LIVENESS / 2)
    assert beat._thread.is_alive() and c.members()[0].state == "joined"
    del owner
    gc.collect()
    beat._thread.join(timeout=LIVENESS)
    assert not beat._thread.is_alive(), "the heartbeat outlived its owner"
    assert wait_state(c, 0, "gone", within=LIVENESS + 1.5).state == "gone"
    beat.stop()
