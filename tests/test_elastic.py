"""Elastic instances (issue 16): join, leave, die and rejoin while the trainers run, over an elastic
transport (file), with real WeightWriters and WeightReaders, a real MetaServer over HTTP and real files.

To stay fast, every participant runs in this process: training ranks are threads holding their layout's
tensors (the file transport needs no process group), and each instance's workers are called in turn by
:class:`ThreadInstance` (its contexts are what a worker process would hold). A "killed" instance stops
answering exactly as a SIGKILLed one does for the trainers (no more posts); the demo's ``--kill-at``
(tests/test_demo.py style, below) SIGKILLs a real instance process.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from weightsync.engines import make_layout
from weightsync.errors import ConfigError
from weightsync.layout.layout import EngineLayout, Layout
from weightsync.layout.materialize import TORCH_DTYPES, fill_from, scatter
from weightsync.meta.client import Member, MetaClient, MetaError
from weightsync.meta.server import MetaServer
from weightsync.runtime.instance import NoEngineHooks, WorkerContext
from weightsync.runtime.reader import WeightReader
from weightsync.runtime.writer import WeightWriter
from weightsync.spec import load_spec
from weightsync.spec.model import ModelSpec
from weightsync.testing import random_canonical

MODEL, TRAIN, INFER = "tiny-qwen3", "fsdp:dp=2", "vllm:tp=2"
#: how long a step waits for an instance before dropping it: well above a step's time here (nixl: its
#: loopback reads on a loaded 2-core machine take seconds)
INSTANCE_TIMEOUT = {"file": 3.0, "nixl": 5.0}


@dataclass
class TrainRank:
    """A training rank's side as WeightWriter takes it (weightsync.runtime.writer.TrainSide)."""

    engine: EngineLayout
    rank: int
    layout: Layout
    tensors: dict[str, torch.Tensor]
    spec: ModelSpec


class ThreadInstance(NoEngineHooks):
    """An inference instance whose workers' contexts live in this process (NaN-poisoned tensors)."""

    def __init__(self, spec: ModelSpec, engine: str):
        self.engine, self.model_config = engine, dict(spec.config)
        layout = make_layout(spec, engine)
        self.contexts = []
        for r in range(layout.world_size):
            tensors = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype])
                       for n, t in layout.layout(r).tensors.items()}
            self.contexts.append(WorkerContext(r, torch.device("cpu"), tensors))

    @property
    def world_size(self) -> int:
        return len(self.contexts)

    def call(self, fn, *args, timeout_s=None):
        return [fn(ctx, *args) for ctx in self.contexts]

    def close(self) -> None:
        pass


def canonical(spec: ModelSpec, step: int) -> dict[str, torch.Tensor]:
    return random_canonical(spec, seed=500 + step)


def exact(spec: ModelSpec, inst: ThreadInstance, step: int) -> bool:
    """Every worker's tensors hold exactly ``step`` (padding still NaN)."""
    want = canonical(spec, step)
    layout = make_layout(spec, inst.engine)
    for ctx in inst.contexts:
        for name, exp in scatter(layout.layout(ctx.rank), want).items():
            got = ctx.tensors[name]
            if not (torch.equal(got.isnan(), exp.isnan()) and torch.equal(got.nan_to_num(), exp.nan_to_num())):
                return False
    return True


class Job:
    """Training ranks and instances of one elastic job, driven step by step from the test."""

    def __init__(self, url: str, directory: str, instances: int = 2, staged: tuple[int, ...] = (),
                 transport: str = "file", job: str = "elastic", infer: str = INFER):
        self.url, self.directory, self.initial, self.staged = url, directory, instances, staged
        self.transport, self.job, self.infer = transport, job, infer
        where = {"directory": directory} if transport == "file" else {}
        self.spec = load_spec(MODEL)
        engine = make_layout(self.spec, TRAIN)
        first = canonical(self.spec, 0)
        self.ranks = [TrainRank(engine, r, engine.layout(r), scatter(engine.layout(r), first), self.spec)
                      for r in range(engine.world_size)]
        self.writers = [WeightWriter(t, meta=url, job=job, transport=transport, **where,
                                     bucket_bytes=64 << 10, timeout_s=20.0,
                                     instance_timeout_s=INSTANCE_TIMEOUT[transport])
                        for t in self.ranks]
        self.readers: dict[int, tuple[WeightReader, ThreadInstance]] = {}
        self.pool = ThreadPoolExecutor(max_workers=8)
        self.client = MetaClient(url, job, timeout=10.0)

    def reader(self, i: int) -> tuple[WeightReader, ThreadInstance]:
        inst = ThreadInstance(self.spec, self.infer)
        where = {"directory": self.directory} if self.transport == "file" else {}
        r = WeightReader(inst, meta=self.url, job=self.job, instance_id=i, instances=self.initial,
                         transport=self.transport, **where, bucket_bytes=64 << 10, timeout_s=20.0,
                         staged=i in self.staged)
        self.readers[i] = (r, inst)
        return r, inst

    def start(self) -> None:
        jobs = [self.pool.submit(w.connect) for w in self.writers]
        jobs += [self.pool.submit(self.reader(i)[0].connect) for i in range(self.initial)]
        for j in jobs:
            j.result(timeout=60)

    def step(self, step: int, updating: list[int]) -> tuple[float, dict[int, bool]]:
        """Write ``step`` on every rank while the ``updating`` instances update; the slowest write's
        seconds and each updating instance's bit-exactness."""
        for t in self.ranks:
            with torch.no_grad():
                fill_from(t.layout, t.tensors, canonical(self.spec, step))

        def write(w: WeightWriter) -> float:
            t0 = time.monotonic()
            w.write(step)
            return time.monotonic() - t0

        writes = [self.pool.submit(write, w) for w in self.writers]
        updates = {i: self.pool.submit(self.readers[i][0].update, step) for i in updating}
        held = {i: u.result(timeout=60) for i, u in updates.items()}
        seconds = max(f.result(timeout=60) for f in writes)
        assert held == {i: step for i in updating}
        return seconds, {i: exact(self.spec, self.readers[i][1], step) for i in updating}

    def close(self) -> None:
        self.pool.shutdown(wait=False)


@pytest.fixture(scope="module")
def server():
    with MetaServer(port=0) as s:
        yield s


def _nixl_or_skip() -> None:
    try:
        from weightsync.transport.nixl_wire import load_nixl

        load_nixl()
    except Exception as e:  # noqa: BLE001 - not installed, or no build for this machine
        pytest.skip(f"NIXL not usable here: {e}")


#: nixl: one worker per instance (each NIXL agent takes seconds to start on this machine)
@pytest.mark.parametrize("transport, infer", [("file", INFER), ("nixl", "hf")])
def test_join_leave_die_rejoin_bit_exact(server, tmp_path, transport, infer):
    """Two instances start; a third (id beyond the start count, staged) joins before step 2; instance 1
    leaves before step 3; instance 0 dies in step 4 (dropped after instance_timeout, the trainers go
    on); it rejoins under its id before step 5. Every update is bit-exact, the trainers never re-plan,
    and the MetaServer shows it all."""
    if transport == "nixl":
        _nixl_or_skip()
    job = Job(server.url, str(tmp_path), instances=2, staged=(2,), transport=transport, job=f"elastic-{transport}",
              infer=infer)
    timeout = INSTANCE_TIMEOUT[transport]
    try:
        job.start()
        plans = [w.session.plans for w in job.writers]
        assert job.client.summary()["topology_version"] == 2
        seconds, ok = job.step(1, [0, 1])
        assert ok == {0: True, 1: True}
        # readers that copy out of the trainers' memory (nixl) wait for `written` on the trainers' doorbells
        # on this host, not on the MetaServer; file readers wait for the files
        assert all((r.session.written_bells is not None) == (transport == "nixl") for r, _ in job.readers.values())

        # join: instance 2 (beyond the two the job started with) plans for itself alone
        joiner, _ = job.reader(2)
        joiner.connect()
        summary = job.client.summary()
        assert summary["topology_version"] == 3 and summary["instances"] == [0, 1, 2]
        assert summary["members"]["2"]["state"] == "joined" and joiner.since == 2
        assert not joiner.session.hashes or job.client.check_plan_hashes()["mismatches"] == []
        seconds, ok = job.step(2, [0, 1, 2])
        assert ok == {0: True, 1: True, 2: True}  # its first update holds the latest written step
        assert [w.session.plans for w in job.writers] == plans  # the trainers did not re-plan

        # leave: out from the next step
        job.readers[1][0].close()
        assert job.client.members()[1].state == "left"
        seconds, ok = job.step(3, [0, 2])
        assert ok == {0: True, 2: True} and seconds < timeout  # nobody waited for instance 1

        # die: instance 0 stops answering during step 4; dropped after instance_timeout, never longer
        seconds, ok = job.step(4, [2])
        assert ok == {2: True}
        assert timeout <= seconds < timeout + 3.0, seconds
        members = job.client.members()
        assert members[0].state == "gone" and "step 4" in members[0].reason
        # the first rank to time out drops it (the other may find it gone already)
        assert {0: 4} in [w.dropped for w in job.writers]
        with pytest.raises(MetaError, match="gone"):  # what the dead one would be told, had it lived on
            job.client.held(0, 4)

        # rejoin under its id: a fresh (poisoned) instance holds the next step, bit-exact
        dead = job.readers[0][0]
        again, fresh = job.reader(0)
        assert not exact(job.spec, fresh, 4)  # poisoned
        again.connect()
        assert again.since == 5 and job.client.members()[0].state == "joined"
        seconds, ok = job.step(5, [0, 2])
        assert ok == {0: True, 2: True} and seconds < timeout
        # the dead reader's process, had it come back, is fenced off: its reports and its leave count no more
        with pytest.raises(MetaError, match="rejoined .* after this reader was dropped"):
            job.client.held(0, 5, incarnation=dead.session.incarnation)
        dead.close()
        assert job.client.members()[0].state == "joined"

        summary = job.client.summary()
        assert summary["topology_version"] == 6  # joined 0, 1, 2; left 1; gone 0; joined 0
        assert {i: m["state"] for i, m in summary["members"].items()} == {"0": "joined", "1": "left", "2": "joined"}
        assert summary["members"]["2"]["held"] == 5
        metrics = job.client.metrics()
        assert f'weightsync_meta_topology_version{{job="{job.job}"}} 6' in metrics
        assert f'weightsync_meta_member{{job="{job.job}",instance="1",state="left"}} 1' in metrics
        for w in job.writers:
            w.close()
        assert not list(tmp_path.glob("*.safetensors"))  # every step's files removed once held
    finally:
        job.close()


def test_async_join_and_leave_over_nixl(server, tmp_path):
    """Async (nixl): the trainers stage each step and return; an instance that joins mid-job pulls the
    latest staged step whole, bit-exact; one that leaves blocks nothing."""
    _nixl_or_skip()
    spec = load_spec(MODEL)
    engine = make_layout(spec, "hf")
    rank = TrainRank(engine, 0, engine.layout(0), scatter(engine.layout(0), canonical(spec, 0)), spec)
    kw = dict(meta=server.url, job="elastic-async", transport="nixl", mode="async", bucket_bytes=64 << 10,
              timeout_s=20.0)
    writer = WeightWriter(rank, **kw)
    readers = {}

    def reader(i: int) -> tuple[WeightReader, ThreadInstance]:
        inst = ThreadInstance(spec, "hf")
        readers[i] = (WeightReader(inst, instance_id=i, instances=1, **kw), inst)
        return readers[i]

    def write(step: int) -> float:
        with torch.no_grad():
            fill_from(rank.layout, rank.tensors, canonical(spec, step))
        t0 = time.monotonic()
        writer.write(step)
        return time.monotonic() - t0

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(reader(0)[0].connect)
        writer.connect()
        first.result(timeout=60)
    try:
        write(1)
        assert readers[0][0].pull() == 1 and exact(spec, readers[0][1], 1)
        joiner, inst = reader(1)  # beyond the one instance the job started with
        joiner.connect()
        assert writer.client.summary()["instances"] == [0, 1]
        assert joiner.pull() == 1 and exact(spec, inst, 1)  # the latest staged step, whole
        write(2)
        readers[0][0].close()
        assert writer.client.members()[0].state == "left"
        assert write(3) < 1.0  # nobody is waited for in async mode
        assert joiner.pull() == 3 and exact(spec, inst, 3)
    finally:
        writer.close()


def test_a_step_with_no_live_instance_does_not_wait(server, tmp_path):
    """Once every instance has left, a sync write returns at once (nobody to wait for)."""
    client = MetaClient(server.url, "empty", timeout=5.0)
    client.register("train", 0)
    client.join(0)
    client.leave(0)
    client.written(1, 0)
    t0 = time.monotonic()
    assert client.wait_held(1, timeout=3.0) == {}
    assert time.monotonic() - t0 < 1.0


def test_membership_endpoints(server):
    c = MetaClient(server.url, "members", timeout=5.0)
    c.register("train", 0)
    c.join(0)
    c.written(1, 0)
    c.join(1)  # joins after step 1 was written: the default held wait for step 1 does not count it
    assert c.members()[1].since == 2 and c.members()[0].since == 0
    c.held(0, 1)
    assert c.wait_held(1, timeout=1.0) == {0: 1}
    assert c.gone(1, reason="no answer")["changed"] is True
    assert c.gone(1)["changed"] is False  # idempotent
    m = c.members()[1]
    assert m == Member(1, "gone", since=2, version=3, reason="no answer")
    with pytest.raises(MetaError, match=r"dropped \(gone\) .*no answer.*join again") as e:
        c.held(1, 1)
    assert e.value.status == 409
    c.join(1)
    assert c.members()[1].state == "joined" and c.summary()["topology_version"] == 4
    text = c.metrics()
    assert 'weightsync_meta_member{job="members",instance="1",state="joined"} 1' in text
    # incarnations: a reader's own id; a new one replaces the joined member and fences the old one off
    assert c.join(2, incarnation="aa")["changed"] is True
    assert c.join(2, incarnation="aa")["changed"] is False  # a retried join
    assert c.join(2, incarnation="bb")["changed"] is True  # a new reader under the same id
    with pytest.raises(MetaError, match="rejoined"):
        c.held(2, 1, incarnation="aa")
    assert c.held(2, 1, incarnation="bb")["step"] == 1
    assert c.leave(2, incarnation="aa")["changed"] is False and c.gone(2, incarnation="aa")["changed"] is False
    assert c.members()[2].incarnation == "bb" and c.leave(2, incarnation="bb")["changed"] is True
    with pytest.raises(MetaError, match="unknown fields"):
        c._request("POST", f"{c._job_path}/instances/1/gone", {"why": "x"})


def test_membership_survives_a_restart(tmp_path):
    path = str(tmp_path / "state.db")
    with MetaServer(state_path=path) as s:
        c = MetaClient(s.url, "j", timeout=5.0)
        c.join(0)
        c.join(1)
        c.gone(1, reason="killed")
        port = s.port
    with MetaServer(port=port, state_path=path) as s:
        members = MetaClient(s.url, "j", timeout=5.0).members()
        assert members[0].state == "joined" and members[1] == Member(1, "gone", since=0, version=3, reason="killed")


@pytest.mark.parametrize("transport", ["p2p"])
def test_join_on_a_fixed_membership_transport_is_refused(transport):
    spec = load_spec(MODEL)
    with pytest.raises(ConfigError, match=r"instance 2 cannot join .* elastic transport \(.*file"):
        WeightReader(ThreadInstance(spec, INFER), meta="http://127.0.0.1:1", job="x", instance_id=2, instances=2,
                     transport=transport)
    with pytest.raises(ConfigError, match="instance_timeout_s must be positive"):
        engine = make_layout(spec, "hf")
        WeightWriter(TrainRank(engine, 0, engine.layout(0), {}, spec), meta="http://127.0.0.1:1", job="x",
                     instance_timeout_s=0)


def test_demo_join_and_kill_with_real_processes():
    """``weightsync demo --transport file --join-at 2 --kill-at 3``: real processes; instance 0 is
    SIGKILLed (with its workers) during step 3, the trainers drop it after the instance timeout and every
    remaining holder of every step is bit-exact."""
    from weightsync.demo import DemoConfig, run

    cfg = DemoConfig(train="hf", infer=("hf",), steps=3, transport="file", join_at=2, kill_at=3,
                     instance_timeout_s=2.0, timeout_s=30.0)
    out = run(cfg, print_fn=lambda s: None)
    assert out["verified"] and not out["errors"], out
    assert [{k: v for k, v in e.items() if k != "job"} for e in out["events"]] == [
        {"step": 2, "joined": 1}, {"step": 3, "killed": 0}]
    holders = {s["step"]: sorted(i["instance"] for i in s["instances"] if i["exact"]) for s in out["steps"]}
    assert holders == {1: [0], 2: [0, 1], 3: [1]}


@pytest.mark.parametrize("args,message", [
    (["--join-at", "2"], "need an elastic transport (file"),
    (["--transport", "file", "--kill-at", "9", "--steps", "3"], "--kill-at 9 is not one of the steps 1..3"),
])
def test_demo_elastic_options_refused_before_anything_starts(capsys, args, message):
    from weightsync.cli import main

    assert main(["demo", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err, err
