"""Delta updates over the nixl transport (its frame reads, weightsync.codec.delta): real NIXL agents (UCX on loopback),
a real MetaServer, random sparse changes per step, poisoned destinations, ``torch.equal``.

One job is shared by the module's cases (set-up is the cost): two instances, so a gap in one shows
it falls back to a full read alone while the other keeps reading deltas.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from weightsync.codec.delta import DeltaCodec
from weightsync.engines import make_layout
from weightsync.layout.materialize import TORCH_DTYPES, fill_from, scatter
from weightsync.meta.client import MetaClient
from weightsync.meta.server import MetaServer
from weightsync.plan.planner import Planner
from weightsync.spec import load_spec
from weightsync.testing import random_canonical
from weightsync.transport.base import MetaLink, ReceiverContext, SenderContext, TransportOptions
from helpers import nixl_missing

NIXL = nixl_missing()

pytestmark = pytest.mark.skipif(NIXL is not None, reason=f"nixl not importable: {NIXL}")

TIMEOUT_S = 30.0  # a step of this tiny job reads in milliseconds; 5 s was passed under a loaded make test (2026-12-07)
CHANGED = 0.01  # the fraction of elements a step changes (RL learning rates: ~1%)


def poisoned(layout) -> dict[str, torch.Tensor]:
    return {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype]) for n, t in layout.tensors.items()}


class Job:
    """Real NixlSender/NixlReceiver pairs with delta=True; ``canon[step]`` the step's canonical weights."""

    def __init__(self, url: str, train: str = "fsdp:dp=2", sender_instances: int = 2, mode: str = "sync",
                 bucket_bytes: int = 4096):
        from weightsync.transport.nixl import NixlReceiver, NixlSender

        self.spec = load_spec("tiny-qwen3")
        self.src, self.dst = make_layout(self.spec, train), make_layout(self.spec, "vllm:tp=2")
        self.planner = Planner(self.src, self.dst, 2, bucket_bytes=bucket_bytes)
        # an elastic trainer plans one instance slot (weightsync.runtime.session)
        sending = Planner(self.src, self.dst, sender_instances, bucket_bytes=bucket_bytes)
        job = f"dnixl-{uuid.uuid4().hex[:8]}"
        self.link = MetaLink(url, job)
        self.client = MetaClient(url, job, timeout=TIMEOUT_S)
        self.options = TransportOptions("nixl", mode, timeout_s=TIMEOUT_S, codec=DeltaCodec())
        self.canon = {0: random_canonical(self.spec, seed=7)}
        self.gen = torch.Generator().manual_seed(11)
        self.train = {r: scatter(self.src.layout(r), self.canon[0]) for r in range(self.src.world_size)}
        self.senders = {}
        for r, t in self.train.items():
            s = NixlSender(self.options)
            s.connect(SenderContext(self.link, self.client, None, r, sending, sending.send_plan(r), t))
            self.senders[r] = s
        self.targets, self.receivers = {}, {}
        for i in range(2):
            for j in range(self.dst.world_size):
                rx = NixlReceiver(self.options)
                live = poisoned(self.dst.layout(j))
                rx.connect(ReceiverContext(self.link, None, i, j, self.planner, self.planner.recv_plan(i, j), live,
                                           torch.device("cpu")))
                self.targets[i, j], self.receivers[i, j] = live, rx

    def write(self, step: int) -> None:
        """A sparse random change of the previous step (as an optimizer step at RL learning rates)."""
        prev = self.canon[max(self.canon)]
        cur = {}
        for n, t in prev.items():
            t = t.clone()
            mask = torch.rand(t.shape, generator=self.gen) < CHANGED
            t[mask] = torch.randn(int(mask.sum()), generator=self.gen).to(t.dtype)
            cur[n] = t
        self.canon[step] = cur
        for r, t in self.train.items():
            fill_from(self.src.layout(r), t, cur)  # in place
            self.senders[r].send(step)  # async: stages the snapshot (and its delta) and returns
            self.senders[r].check(step)

    def wrong(self, key, step: int, got=None) -> list[str]:
        got = self.targets[key] if got is None else got
        want = scatter(self.dst.layout(key[1]), self.canon[step])
        return [n for n, w in want.items()
                if not (torch.equal(got[n].isnan(), w.isnan()) and torch.equal(got[n].nan_to_num(), w.nan_to_num()))]

    def close(self) -> None:
        for x in [*self.receivers.values(), *self.senders.values()]:
            x.close()


@pytest.fixture(scope="module")
def meta():
    with MetaServer().start() as s:
        yield s.url


@pytest.fixture(scope="module")
def job(meta):
    j = Job(meta)
    try:
        yield j
    finally:
        j.close()


def full_of(rx) -> int:
    return sum(b.nbytes for bs in rx.ctx.plans.values() for b in bs)


def test_deltas_bit_exact_gap_falls_back_alone(job):
    # step 1: nobody holds a base -> full reads
    job.write(1)
    for k, rx in job.receivers.items():
        st = rx.receive(1, job.targets[k])
        assert bool(rx.decoder.stats.whole_pairs) and st.bytes == full_of(rx) == st.full_bytes
        assert not job.wrong(k, 1), job.wrong(k, 1)
    # steps 2, 3: every worker proves its base -> only the changes move, bit-exact
    for step in (2, 3):
        job.write(step)
        for k, rx in job.receivers.items():
            st = rx.receive(step, job.targets[k])
            assert not bool(rx.decoder.stats.whole_pairs), k
            assert 0 < st.bytes < 0.2 * full_of(rx) and st.full_bytes == full_of(rx), (k, st)
            assert not job.wrong(k, step), (k, job.wrong(k, step))
    # step 4: instance 1 misses it (a failed or skipped update); step 5: instance 1 reads in full, alone
    job.write(4)
    for k, rx in job.receivers.items():
        if k[0] == 0:
            rx.receive(4, job.targets[k])
    job.write(5)
    for k, rx in job.receivers.items():
        st = rx.receive(5, job.targets[k])
        assert bool(rx.decoder.stats.whole_pairs) == (k[0] == 1), k
        assert st.bytes == (full_of(rx) if k[0] == 1 else st.bytes) and (k[0] == 1 or st.bytes < 0.2 * full_of(rx))
        assert not job.wrong(k, 5), (k, job.wrong(k, 5))
    # step 6: something touched one of instance 0's tensors -> its proof fails -> a full read heals it
    k0 = (0, 0)
    name = next(iter(job.targets[k0]))
    job.targets[k0][name].view(-1)[0] += 1
    job.write(6)
    for k, rx in job.receivers.items():
        rx.receive(6, job.targets[k])
        assert bool(rx.decoder.stats.whole_pairs) == (k == k0), k
        assert not job.wrong(k, 6), (k, job.wrong(k, 6))
    # step 7: a staged copy (other tensors, poisoned) proves nothing -> full; the live ones stay at 6
    job.write(7)
    k1 = (1, 1)
    staged = poisoned(job.dst.layout(1))
    rx = job.receivers[k1]
    rx.receive(7, staged)
    assert bool(rx.decoder.stats.whole_pairs) and not job.wrong(k1, 7, staged) and not job.wrong(k1, 6)


def test_sync_payloads_re_encoded_under_the_read_raise_and_heal(job):
    """A trainer encoding its next step while a worker reads this one's payloads (an elastic trainer
    that dropped the slow worker and went on): nothing torn is applied, the receive raises naming the
    trainer, and that worker's next receive reads in full, bit-exact."""
    from weightsync.transport.nixl import Restaged

    step = max(job.canon) + 1
    job.write(step)
    for k, rx in job.receivers.items():
        rx.receive(step, job.targets[k])
    k = (1, 0)
    rx = job.receivers[k]
    job.write(step + 1)
    real = rx.frames._apply

    def racing(plan, targets):
        job.write(step + 2)
        return real(plan, targets)

    rx.frames._apply = racing
    try:
        with pytest.raises(Restaged, match=r"training rank \d -> instance 1 rank 0: the trainer encoded new frames"):
            rx.receive(step + 1, job.targets[k])
    finally:
        del rx.frames._apply
    assert rx.decoder.version is None
    rx.receive(step + 2, job.targets[k])
    assert bool(rx.decoder.stats.whole_pairs) and not job.wrong(k, step + 2), job.wrong(k, step + 2)


def test_memory_counts_the_previous_version_and_the_region(job):
    from weightsync.codec.delta_state import previous_bytes

    for r, s in job.senders.items():
        plans = job.planner.send_plan(r)
        buf = s.memory(SenderContext(job.link, job.client, None, r, job.planner, plans, job.train[r]))
        packed = 0 if s.pack is None else s.pack.numel()  # the strided boxes it packs every step (nixl.pack_layout)
        assert buf.codec == previous_bytes(plans) + s.region.numel() + packed
        assert buf.codec == s.encoder.previous.nbytes + s.region.numel() + packed
        assert s.region.numel() == sum(-(-b.nbytes // 8) * 8 for b in s.distinct)  # each slot its worst case
    rx = job.receivers[0, 0]
    assert rx.memory(rx.ctx).codec == 2 * max(b.nbytes for bs in rx.ctx.plans.values() for b in bs)


def test_a_bucket_the_trainer_did_not_plan_reads_in_full(meta):
    """Elastic: the trainers plan one instance slot; with DP replicas, instance 1 reads some buckets
    from a replica whose plan does not hold them: no slot in its index, so that worker reads in full
    every step (bit-exact), while the workers the plan covers read deltas."""
    j = Job(meta, train="megatron:tp=2,dp=2", sender_instances=1)
    try:
        for step in (1, 2):
            j.write(step)
            for k, rx in j.receivers.items():
                rx.receive(step, j.targets[k])
                assert not j.wrong(k, step), (k, j.wrong(k, step))
        covered = {k: not bool(rx.decoder.stats.whole_pairs) for k, rx in j.receivers.items()}
        assert covered[0, 0] and covered[0, 1] and not all(covered.values()), covered
    finally:
        j.close()


# -- async mode: the trainers stage snapshots, workers pull when they choose ----------------------------


@pytest.fixture(scope="module")
def async_job(meta):
    j = Job(meta, mode="async", bucket_bytes=16 << 10)  # fewer buckets: every pull proves each one
    try:
        yield j
    finally:
        j.close()


def pulled(job, k, step: int, read: str, targets=None) -> None:
    """Worker ``k`` pulls; it must report exactly ``step``, have read as ``read`` says ("full", "delta":
    only the changes, "none": it held the step already) and hold ``step`` bit-exact."""
    rx = job.receivers[k]
    p = rx.pull(job.targets[k] if targets is None else targets)
    assert p.steps == {step}, (k, p.steps)
    assert bool(rx.decoder.stats.whole_pairs) == (read == "full"), (k, step)
    assert p.stats.full_bytes == full_of(rx), (k, p.stats)
    moved = {"full": lambda n: n == full_of(rx), "delta": lambda n: 0 < n < 0.2 * full_of(rx),
             "none": lambda n: n == 0}[read]
    assert moved(p.stats.bytes), (k, read, p.stats)
    assert rx.decoder.version == step
    assert not job.wrong(k, step, targets), (k, job.wrong(k, step, targets))


def test_async_pulls_read_deltas_only_on_the_staged_base(async_job):
    job = async_job
    job.write(1)  # nobody holds a base
    for k in job.receivers:
        pulled(job, k, 1, "full")
    job.write(2)  # every worker holds the step before the snapshot's
    for k in job.receivers:
        pulled(job, k, 2, "delta")
    pulled(job, (0, 0), 2, "none")  # the same snapshot again: it proves it holds it, reads nothing
    job.write(3)  # instance 1 does not pull 3: at 4 it holds 2, the delta's base is 3
    for k in job.receivers:
        if k[0] == 0:
            pulled(job, k, 3, "delta")
    job.write(4)
    for k in job.receivers:
        pulled(job, k, 4, "full" if k[0] == 1 else "delta")
    # a staged copy (other tensors, poisoned) proves nothing: full, the live tensors untouched
    job.write(5)
    staged = poisoned(job.dst.layout(1))
    pulled(job, (1, 1), 5, "full", targets=staged)
    assert not job.wrong((1, 1), 4)
    pulled(job, (1, 0), 5, "delta")
    # at 6 (base 5) that worker's version is the base, but its live tensors hold 4: the checksums
    # disagree, so it reads in full, alone
    job.write(6)
    pulled(job, (1, 1), 6, "full")
    pulled(job, (1, 0), 6, "delta")


@pytest.mark.parametrize("when", ["under the payload reads", "after applying"])
def test_async_pull_torn_by_a_restage_is_a_mix_then_reads_in_full(async_job, when):
    """The trainer stages the next snapshot while a worker pulls this one's delta -- before its payload
    reads (they would read the new encoding: nothing is applied) or after it applied them (the data is
    whole, but the header moved): the pull reports a mix, never the step, and the next pull reads in
    full, bit-exact."""
    job = async_job
    k = (0, 1)
    rx = job.receivers[k]
    step = max(job.canon) + 1
    job.write(step)
    rx.pull(job.targets[k])  # whole: the base of the next snapshot
    job.write(step + 1)
    real = rx.frames._apply

    def racing(plan, targets):
        if when == "after applying":
            moved = real(plan, targets)
            job.write(step + 2)
            return moved
        job.write(step + 2)  # staged between reading the index and reading the payloads
        return real(plan, targets)

    rx.frames._apply = racing
    try:
        p = rx.pull(job.targets[k])
    finally:
        del rx.frames._apply
    assert p.steps == {step + 1, -1} and not bool(rx.decoder.stats.whole_pairs) and rx.decoder.version is None, p.steps
    if when == "after applying":
        assert not job.wrong(k, step + 1)  # whole, yet not reported: the header moved
    pulled(job, k, step + 2, "full")


def test_async_writer_and_readers_with_delta(meta):
    """WeightWriter/WeightReader, mode="async", delta=True over nixl (a real MetaServer, the elastic
    session, worker.pull): a live and a staged reader pull sparse steps; each pull that holds the
    base moves a fraction of the bytes, one that skipped a snapshot moves them all; every pull bit-exact."""
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.runtime.reader import WeightReader
    from weightsync.runtime.writer import WeightWriter
    from test_elastic import ThreadInstance, TrainRank

    spec = load_spec("tiny-qwen3")
    engine = make_layout(spec, "hf")
    gen = torch.Generator().manual_seed(5)
    canon = {0: random_canonical(spec, seed=3)}
    ranks = [TrainRank(engine, r, engine.layout(r), scatter(engine.layout(r), canon[0]), spec)
             for r in range(engine.world_size)]
    kw = dict(meta=meta, job=f"dasync-{uuid.uuid4().hex[:8]}", transport="nixl", mode="async", delta=True,
              bucket_bytes=32 << 10, timeout_s=20.0)
    writers = [WeightWriter(r, **kw) for r in ranks]
    instances = [ThreadInstance(spec, "vllm:tp=2") for _ in range(2)]
    readers = [WeightReader(inst, instance_id=i, instances=2, staged=i == 1, **kw) for i, inst in enumerate(instances)]

    def write(step: int) -> None:
        cur = {}
        for n, t in canon[step - 1].items():
            t = t.clone()
            mask = torch.rand(t.shape, generator=gen) < CHANGED
            t[mask] = torch.randn(int(mask.sum()), generator=gen).to(t.dtype)
            cur[n] = t
        canon[step] = cur
        for r, w in zip(ranks, writers):
            with torch.no_grad():
                fill_from(r.layout, r.tensors, cur)
            assert w.write(step) is None  # async: staged, nothing moved yet

    def pull(i: int, step: int) -> tuple[int, int]:
        assert readers[i].pull() == step
        layout = make_layout(spec, "vllm:tp=2")
        for ctx in instances[i].contexts:
            for n, want in scatter(layout.layout(ctx.rank), canon[step]).items():
                got = ctx.tensors[n]
                assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), \
                    (i, step, ctx.rank, n)
        stats = [r.stats for r in readers[i].last_stats]
        return sum(s.bytes for s in stats), sum(s.full_bytes for s in stats)

    with ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(x.connect) for x in [*readers, *writers]]:
            f.result(timeout=120)
    try:
        write(1)
        for i in (0, 1):
            moved, full = pull(i, 1)
            assert moved == full > 0
        write(2)
        for i in (0, 1):
            moved, full = pull(i, 2)
            assert 0 < moved < 0.2 * full, (i, moved, full)
        write(3)  # instance 1 skips 3
        moved, full = pull(0, 3)
        assert 0 < moved < 0.2 * full, (moved, full)
        assert pull(0, 3)[0] == 0  # the same snapshot again: it proves it holds it and reads nothing
        write(4)
        moved, full = pull(1, 4)
        assert moved == full, (moved, full)
        moved, full = pull(0, 4)
        assert 0 < moved < 0.2 * full, (moved, full)
    finally:
        for x in [*readers, *writers]:
            x.close()
