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


def _trainer(meta: str, job: str, steps: list[int], timeout_s: float, stop_at: int | None, sig: int,
             fault: str = "p2p", directory: str | None = None) -> None:
    """One training rank (layout hf, world 1) writing ``steps`` over ``fault``'s transport (FAULTS); at ``stop_at``
    it stops dead (``sig``: SIGSTOP or SIGKILL) where ``fault`` says, mid-step."""
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import fill_from, scatter
    from weightsync.runtime.writer import WeightWriter
    from weightsync.spec import load_spec

    torch.set_num_threads(1)
    spec = load_spec(MODEL)
    engine = make_layout(spec, "hf")
    rank = TrainRank(engine, 0, engine.layout(0), scatter(engine.layout(0), weights(spec, 0)), spec)
    transport = {**FAULTS, **OTHER_FAULTS}[fault][0]
    if transport == "nixl":
        os.environ.update(UCX_OVER_TCP)
    writer = WeightWriter(rank, meta=meta, job=job, timeout_s=timeout_s, bucket_bytes=BUCKET, directory=directory,
                          transport="p2p" if transport == "colocated" else transport,
                          colocate=transport == "colocated").connect()
    for step in steps:
        with torch.no_grad():
            fill_from(rank.layout, rank.tensors, weights(spec, step))
        if step == stop_at:
            _stop_dead(writer, fault, sig)
        writer.write(step)
    writer.close()


def _stop_dead(writer, fault: str, sig: int) -> None:
    """Fault hooks (not races): this trainer stops dead (``sig``) at the point of its next step that ``fault`` names."""

    def die() -> None:
        time.sleep(0.05)  # let what was handed over (a posted bucket, a written one) leave
        os.kill(os.getpid(), sig)

    if fault == "p2p":  # right after posting the step's first bucket: its messages are in flight
        from vllm_harness import stop_after_posts

        stop_after_posts(1, sig)
    elif fault == "file":  # with the step's first bucket written into the pair's file, the rest never comes
        import weightsync.transport.file as file

        real, calls = file.pack, [0]

        def pack(*a, **k):
            calls[0] += 1
            if calls[0] == 2:
                die()
            return real(*a, **k)

        file.pack = pack
    elif fault.startswith("nixl-written"):  # inside send: the step is never stamped, rung nor announced
        sender = writer.session.sender
        real_send = sender.send

        def send(step):
            die()
            return real_send(step)

        sender.send = send
    elif fault == "colocated-unwritten":  # instead of ringing `written`: the step never comes
        writer.session.written_bell.ring = lambda step: die()
    elif fault == "colocated":  # right after ringing `written` (the reader may copy), before recording it
        bell = writer.session.written_bell
        real_ring = bell.ring

        def ring(step):
            real_ring(step)
            die()

        bell.ring = ring
    # nixl-read: the trainer is passive while its memory is read; the reader's hook stops it (_stop_on_first_read)


def _stop_on_first_read(inst: Instance, pid: int, sig: int) -> None:
    """The reader's NIXL worker stops the trainer dead (``sig``) as it posts its first READ of the next step: the
    signal is sent, the trainer seen stopped or dead (/proc), then the read posted (posted first, a small read
    may complete before the signal lands)."""
    rx, posted = inst.ctx.reader.receiver, []
    real = rx._post

    def post(h, pair, bucket):
        if not posted:
            posted.append(bucket)
            os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while _state(pid) not in "TtZX" and time.monotonic() < deadline:
                time.sleep(0.001)
        real(h, pair, bucket)

    rx._post = post


def _state(pid: int) -> str:
    """A process's state letter (R, S, T: stopped, Z: dead, not yet reaped), X where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "X"


#: NIXL's UCX over TCP on loopback, as between hosts without RDMA: a READ then needs the trainer's own progress, so
#: one of a stopped trainer's memory stays posted. (On one host UCX reads a stopped process's memory through the
#: kernel and the step lands whole -- rightly: the trainer announced it and holds it still; across hosts over RDMA
#: likewise. A READ from a dead host's memory stays posted over RDMA too.)
UCX_OVER_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}

#: where the trainer stops dead mid-step: the transport, and what the reader then waits on
FAULTS = {
    "p2p": ("p2p", "its posted bucket, in the group it shares with the trainer (the group's beats)"),
    "file": ("file", "the pair's file, its first bucket written (the trainer's liveness beacon)"),
    "nixl-read": ("nixl", "its posted READ of the trainer's memory (the beacon)"),
    "nixl-written": ("nixl", "the trainer's `written`, never rung (the beacon)"),
    "nixl-written-long-poll": ("nixl", "the same, long-polled as by a reader on another host (no bells)"),
    "colocated": ("colocated", "the trainer's `written`, rung but not recorded (the beacon)"),
}
#: faults with tests of their own (not test_trainer_dead_with_a_bucket_in_flight's)
OTHER_FAULTS = {
    "colocated-unwritten": ("colocated", "the trainer's `written`, never rung: a call sent early is called off"),
}


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

    def start(fn, *args, **kwargs):
        p = ctx.Process(target=fn, args=args, kwargs=kwargs, daemon=True)
        p.start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(10)


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_trainer_dead_with_a_bucket_in_flight(server, spawn, tmp_path, monkeypatch, fault, sig):
    """The trainer stops dead mid-step 2 (FAULTS: with a bucket posted, written or being read, or between its
    steps's send and its announcement): the reader's update(2) fails within seconds (timeout 30 s), naming
    training rank 0, the staged instance still holds step 1 bit for bit, and the next update fails at once
    (p2p: the group cannot be used again) or again within seconds (the trainer is
    still stopped or dead; nixl-read, resumed: its reads of step 2 may still land, so it reads no more). Before,
    every transport but p2p waited out the whole timeout."""
    from weightsync.errors import TransportError
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    transport = FAULTS[fault][0]
    if transport == "nixl":
        from helpers import nixl_missing

        if (why := nixl_missing()) is not None:
            pytest.skip(f"nixl not importable: {why}")
        for k, v in UCX_OVER_TCP.items():
            monkeypatch.setenv(k, v)
    if fault.endswith("long-poll"):  # the trainers' bells are not opened: their `written` is long-polled
        import weightsync.runtime.session as session

        monkeypatch.setattr(session, "open_bells", lambda *a, **k: None)
    job, timeout = f"dead-trainer-{fault}-{sig}", 30.0
    directory = str(tmp_path) if transport == "file" else None
    trainer = spawn(_trainer, server.url, job, [1, 2, 3], timeout, 2, sig, fault, directory)
    inst = Instance(load_spec(MODEL))
    reader = WeightReader(inst, meta=server.url, job=job, instance_id=0, instances=1, staged=True, timeout_s=timeout,
                          bucket_bytes=BUCKET, directory=directory, transport="p2p" if transport == "colocated" else
                          transport, colocate=transport == "colocated").connect()
    assert reader.update(1) == 1
    if reader.session.reads_after_written:  # (nixl, co-located) the trainers' bells, or their written long-polled
        assert (reader.session.written_bells is None) == fault.endswith("long-poll")
    step1 = inst.snapshot()
    if fault == "nixl-read":
        _stop_on_first_read(inst, trainer.pid, sig)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="training rank 0") as e:
        reader.update(2)
    took = time.monotonic() - t0
    assert took < 8.0, f"noticed after {took:.1f} s: {e.value}"  # before (but p2p): the whole 30 s
    if sig == signal.SIGSTOP:  # (killed after its whole message left, gloo may see the connection close first)
        assert ("stopped or dead" if fault == "p2p" else "stopped or hung") in str(e.value), e.value
    elif fault != "p2p":  # the beacon's connection closed, or (nixl-read) UCX saw the disconnect first
        assert "is gone" in str(e.value) or "DISCONNECT" in str(e.value), e.value
    assert reader.version == 1
    assert same(inst.snapshot(), step1)  # staged: step 1 whole, bit for bit
    if sig == signal.SIGSTOP:
        assert trainer.is_alive()  # stopped, not dead: only its beat (p2p) or its beacon said so
    t0 = time.monotonic()
    if fault == "p2p":
        with pytest.raises(TransportError, match="refused: an earlier transfer failed"):
            reader.update(3)
        assert time.monotonic() - t0 < 1.0
    elif fault == "nixl-read" and sig == signal.SIGSTOP:  # resumed, step 2 announced: but the old reads may land
        os.kill(trainer.pid, signal.SIGCONT)
        with pytest.raises(TransportError, match="refused: reads of an earlier step may still land"):
            reader.update(2)
        assert time.monotonic() - t0 < 1.0
    else:  # still stopped or dead
        with pytest.raises(TransportError, match="training rank 0"):
            reader.update(3)
        assert time.monotonic() - t0 < 8.0
    assert reader.version == 1 and same(inst.snapshot(), step1)


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_step_never_written_is_called_off_before_any_copy(server, spawn, sig):
    """Co-located, on an instance whose calls can go out early (a faithful worker process): update(2) sends its
    call while the trainer still writes, and the worker sets up and waits at its first copy for the go
    (weightsync.transport.gate). The trainer stops dead instead of announcing step 2: the update fails within
    seconds naming training rank 0, every worker called the step off before any copy, so the reader -- not
    staged -- still holds step 1 bit for bit, says so (``version``) and withholds nothing; the workers stay in
    step for the next call."""
    from weightsync.instances.faithful import FaithfulInstance, snapshot
    from weightsync.local.instances import worker_start_method
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec
    from weightsync.transport.liveness import TrainerLost

    class Spied(FaithfulInstance):
        early, withheld = 0, []

        def call_when(self, gate, fn, *args, timeout_s=None):
            Spied.early += 1
            return super().call_when(gate, fn, *args, timeout_s=timeout_s)

        def withhold(self, reason):
            Spied.withheld.append(reason)

    job, timeout = f"unwritten-{sig}", 30.0
    trainer = spawn(_trainer, server.url, job, [1, 2], timeout, 2, sig, "colocated-unwritten", None)
    spec = load_spec(MODEL)
    inst = Spied(dict(spec.config), "vllm:tp=1", fill=float("nan"), start_method=worker_start_method())
    try:
        reader = WeightReader(inst, meta=server.url, job=job, instance_id=0, instances=1, timeout_s=timeout,
                              bucket_bytes=BUCKET, colocate=True).connect()
        assert reader.update(1) == 1 and Spied.early == 1
        step1 = inst.call(snapshot)[0]
        t0 = time.monotonic()
        with pytest.raises(TrainerLost, match="training rank 0") as e:
            reader.update(2)
        assert time.monotonic() - t0 < 8.0, e.value
        assert "nothing of step 2 was copied, the workers still hold step 1" in str(e.value)
        assert Spied.early == 2 and Spied.withheld == []
        assert reader.version == 1
        assert same(inst.call(snapshot)[0], step1)  # in step, and step 1 bit for bit
        reader.close()
    finally:
        inst.close()


def test_early_call_false_waits_for_written_before_the_call(server, spawn):
    """``early_call=False``: the reader sends the step's call only once the trainer announced it (the engine serves
    until then); the step lands all the same."""
    from weightsync.instances.faithful import FaithfulInstance
    from weightsync.local.instances import worker_start_method
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    class Spied(FaithfulInstance):
        early = 0

        def call_when(self, gate, fn, *args, timeout_s=None):
            Spied.early += 1
            return super().call_when(gate, fn, *args, timeout_s=timeout_s)

    spawn(_trainer, server.url, "late-call", [1, 2], 30.0, None, signal.SIGKILL, "colocated", None)
    inst = Spied(dict(load_spec(MODEL).config), "vllm:tp=1", fill=float("nan"), start_method=worker_start_method())
    try:
        reader = WeightReader(inst, meta=server.url, job="late-call", instance_id=0, instances=1, timeout_s=30.0,
                              bucket_bytes=BUCKET, colocate=True, early_call=False).connect()
        assert reader.update(1) == 1 and reader.update(2) == 2 and Spied.early == 0
        reader.close()
    finally:
        inst.close()


# -- a dropped reader is told, and rejoins in one call -------------------------------------------------------


def test_a_dropped_reader_is_told_and_rejoins_in_one_call(server, tmp_path):
    """Elastic (file): the reader sits out step 2 for longer than the trainer's instance_timeout_s, so the trainer
    drops it and goes on (steps 2, 3). Its update(2) then says "dropped: join again" at once (before: each update
    waited its whole timeout for a file no trainer would write, "is the sender alive?"), and ``rejoin()`` is the
    one call that brings it back: its next update holds the next step written, bit for bit."""
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.engines import make_layout
    from weightsync.layout.materialize import fill_from, scatter
    from weightsync.meta.client import MetaError
    from weightsync.runtime.reader import WeightReader
    from weightsync.runtime.writer import WeightWriter
    from weightsync.spec import load_spec

    spec = load_spec(MODEL)
    engine = make_layout(spec, "hf")
    rank = TrainRank(engine, 0, engine.layout(0), scatter(engine.layout(0), weights(spec, 0)), spec)
    kw = dict(meta=server.url, job="dropped-reader", transport="file", directory=str(tmp_path), bucket_bytes=BUCKET,
              timeout_s=10.0)
    writer = WeightWriter(rank, instance_timeout_s=1.5, **kw)
    inst = Instance(spec)
    reader = WeightReader(inst, instance_id=0, instances=1, **kw)

    def write(step: int) -> None:
        with torch.no_grad():
            fill_from(rank.layout, rank.tensors, weights(spec, step))
        writer.write(step)

    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(writer.connect), pool.submit(reader.connect)]:
            f.result(timeout=60)
        w = pool.submit(write, 1)
        assert reader.update(1) == 1
        w.result(timeout=30)
        write(2)  # the reader is silent: dropped after 1.5 s, and the trainer goes on
        write(3)
        assert writer.client.members()[0].state == "gone"
        t0 = time.monotonic()
        with pytest.raises(MetaError, match="Dropped: join again") as e:
            reader.update(2)
        assert time.monotonic() - t0 < 2.0 and "no report of step 2 held" in str(e.value)
        assert reader.rejoin() is reader  # one call
        assert writer.client.members()[0].state == "joined" and reader.since == 4
        w = pool.submit(write, 4)
        assert reader.update(reader.since) == 4
        w.result(timeout=30)
    want = scatter(make_layout(spec, inst.engine).layout(0), weights(spec, 4))
    assert same(inst.snapshot(), want)
    reader.close()
    writer.close()


# -- a hung worker: WorkerTimeout within twice the timeout ---------------------------------------------------


def _hang_rank_1(ctx) -> int:
    """On a worker: rank 1 stops dead (a hung worker: it never answers); rank 0 answers."""
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    return ctx.rank


@pytest.mark.parametrize("timeout_s", [1.0, 2.0])
def test_a_hung_worker_times_out_within_twice_the_timeout(timeout_s):
    """A worker that never answers a reader's call (deadline :func:`weightsync.runtime.worker.call_timeout` of
    the reader's timeout) gives a WorkerTimeout -- not WorkerDied: nothing died -- naming the call and its
    deadline, within twice the timeout (before: a fixed ~4.5 s more, T = 2 s -> 6.5 s: a stopped process ignored
    the polite stop and SIGTERM for 2.5 s)."""
    from weightsync.errors import InstanceError, WorkerDied, WorkerTimeout
    from weightsync.instances.faithful import FaithfulInstance
    from weightsync.local.instances import worker_start_method
    from weightsync.runtime.worker import call_timeout
    from weightsync.spec import load_spec

    inst = FaithfulInstance(dict(load_spec(MODEL).config), "vllm:tp=2", start_method=worker_start_method())
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeout, match=r"did not answer _hang_rank_1 within") as e:
            inst.call(_hang_rank_1, timeout_s=call_timeout(timeout_s))
        took = time.monotonic() - t0
        assert not isinstance(e.value, WorkerDied)
        assert took < 2 * timeout_s, took
        with pytest.raises(InstanceError):
            inst.call(_hang_rank_1)
    finally:
        inst.close()


def test_a_staged_worker_never_commits_alone():
    """A staged worker whose receive (sync) or pull (async) returned whole does not copy its staged step
    into the live tensors on its own: the reader commits every worker's copy together, once all returned
    the same one step. Before, each worker committed as soon as it alone was done, so a failure on another
    worker -- or, async, a peer that pulled a later step (found by ``weightsync soak``) -- left the instance
    serving two steps across its ranks."""
    from types import SimpleNamespace

    from weightsync.layout.box import full_box
    from weightsync.plan.planner import Bucket, Copy
    from weightsync.runtime import worker
    from weightsync.runtime.instance import WorkerContext
    from weightsync.transport.base import Pulled, StepStats

    live = {"w": torch.randn(4, 3)}
    before = live["w"].clone()
    new = torch.randn(4, 3)
    stats = StepStats(buckets=1, bytes=48, seconds=0.0)

    class Landing:  # a receiver that lands the whole tensor, as a transport would
        options = SimpleNamespace(timeout_s=5.0)
        sets_up_before_ready = False

        def receive(self, step, targets):
            targets["w"].copy_(new)
            return stats

        def pull(self, targets):
            targets["w"].copy_(new)
            return Pulled(frozenset({7}), stats)

        def group_wait(self):
            return None  # it waits in no group

    box = full_box((4, 3))
    copy = Copy(canonical="w", canon_box=box, src_rank=0, src_tensor="w", src_box=box, dst_instance=0, dst_rank=0,
                dst_tensor="w", dst_box=box, dtype="float32")
    plans = {(0, 0): [Bucket(src_rank=0, dst_instance=0, dst_rank=0, index=0, copies=(copy,))]}
    ctx = WorkerContext(rank=0, device=torch.device("cpu"), tensors=live)
    ctx.reader = worker.WorkerReader(instance=0, shape=None, plans=plans, receiver=Landing(), context=None)
    worker.receive(ctx, 3, staged=True)
    assert torch.equal(live["w"], before)  # landed in the stage only
    worker.pull(ctx, staged=True)
    assert torch.equal(live["w"], before)
    worker.commit(ctx)  # the reader's call, once every worker returned the same step
    assert torch.equal(live["w"], new)
