"""The nixl transport on CPU: real NIXL agents (UCX over loopback / shared memory), a real MetaServer.

Most cases drive real :class:`NixlSender`/:class:`NixlReceiver` pairs in this process (every agent its
own, as separate processes would be: NIXL reads through UCX even here) over layouts of every trainer
row (hf, fsdp, megatron) and inference column (vLLM, SGLang, hf), poisoned destinations, random data,
``torch.equal``. A training rank in a child process is killed in the middle of a worker's reads; and
whole jobs over nixl (real trainer and instance processes through WeightWriter/WeightReader) run in
tests/test_elastic.py (join, leave, die, rejoin; async) and tests/test_bench.py (the nixl-1gpu
scenario rehearsed on CPU), so none is repeated here (the suite's 20-minute budget).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import uuid

import pytest
import torch

from weightsync.codec.full import FullCodec
from weightsync.engines import make_layout
from weightsync.errors import TransportError, WeightsMoved
from weightsync.layout.materialize import TORCH_DTYPES, fill_from, scatter
from weightsync.meta.client import MetaClient
from weightsync.meta.server import MetaServer
from weightsync.plan.planner import Planner
from weightsync.spec import load_spec
from weightsync.testing import random_canonical
from weightsync.transport.base import MetaLink, ReceiverContext, SenderContext, TransportOptions
from helpers import nixl_missing, record_landings

NIXL = nixl_missing()

pytestmark = pytest.mark.skipif(NIXL is not None, reason=f"nixl not importable: {NIXL}")

TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def meta():
    with MetaServer().start() as s:
        yield s.url


_CANONICAL: dict = {}


def canonical(spec, step: int) -> dict:
    key = (spec.name, step)
    if key not in _CANONICAL:  # every rank and every check of a step reads the same data
        _CANONICAL[key] = random_canonical(spec, seed=1000 + step)
    return _CANONICAL[key]


def poisoned(layout) -> dict[str, torch.Tensor]:
    return {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype]) for n, t in layout.tensors.items()}


def exact(got: dict, layout, spec, step: int) -> list[str]:
    """Tensors of ``got`` that differ from what ``step`` puts there (padding must stay NaN)."""
    want = scatter(layout, canonical(spec, step))
    return [n for n, w in want.items()
            if not (torch.equal(got[n].isnan(), w.isnan()) and torch.equal(got[n].nan_to_num(), w.nan_to_num()))]


class Job:
    """Senders for every training rank and receivers for every (instance, rank), each its own agent. An engine
    declared ``quant=fp8`` holds its FP8 layout (e4m3 weights, fp32 ``_scale_inv``) and the job runs the fp8 codec,
    as the session sets it up (weightsync.codec.fp8 ``fp8_options``, a block-aligned plan); any other runs the full
    codec, as the session does (``codec``: another, or None)."""

    def __init__(self, meta: str, model: str, train: str, infer: str, instances: int = 1, mode: str = "sync",
                 bucket_bytes: int = 4096, tensors=None, sender_instances: int | None = None,
                 codec: FullCodec | None = FullCodec()):
        from weightsync.codec.fp8 import fp8_options
        from weightsync.plan.job import block_aligned
        from weightsync.quant.layout import fp8_layout
        from weightsync.transport.nixl import NixlReceiver, NixlSender

        self.spec = load_spec(model)
        self.src, self.dst = make_layout(self.spec, train), make_layout(self.spec, infer)
        fp8 = fp8_options(TransportOptions("nixl", mode, timeout_s=TIMEOUT_S), infer, self.spec)
        self.held = fp8_layout(self.dst) if fp8 is not None else None  # what an FP8 engine holds
        self.planner = Planner(self.src, self.dst, instances, bucket_bytes=bucket_bytes,
                               block_aligned=block_aligned(self.spec, self.dst))
        # an elastic trainer plans one instance slot (weightsync.runtime.session): sender_instances=1
        sending = self.planner if sender_instances is None else Planner(
            self.src, self.dst, sender_instances, bucket_bytes=bucket_bytes,
            block_aligned=block_aligned(self.spec, self.dst))
        job = f"nixl-{uuid.uuid4().hex[:8]}"
        self.link = MetaLink(meta, job)
        self.client = MetaClient(meta, job, timeout=TIMEOUT_S)
        options = fp8 or TransportOptions("nixl", mode, timeout_s=TIMEOUT_S, codec=codec)
        self.train = {r: scatter(self.src.layout(r), canonical(self.spec, 0)) for r in range(self.src.world_size)}
        if tensors is not None:
            tensors(self.train)
        self.senders = {}
        for r, t in self.train.items():
            s = NixlSender(options)
            s.connect(SenderContext(self.link, self.client, None, r, sending, sending.send_plan(r), t))
            self.senders[r] = s
        self.targets, self.receivers = {}, {}
        for i in range(instances):
            for j in range(self.dst.world_size):
                rx = NixlReceiver(options)
                plans = self.planner.recv_plan(i, j)
                live = poisoned((self.held or self.dst).layout(j))
                rx.connect(ReceiverContext(self.link, None, i, j, self.planner, plans, live, torch.device("cpu")))
                self.targets[i, j], self.receivers[i, j] = live, rx

    def write(self, step: int) -> None:
        for r, t in self.train.items():
            fill_from(self.src.layout(r), t, canonical(self.spec, step))  # in place, as an optimizer step
            self.senders[r].send(step)
            self.senders[r].check(step)

    def wrong(self, step: int) -> dict:
        """{(instance, rank): [tensors not bit-exact]} over every receiver (FP8: against the FP8 checkpoint of the
        step's weights, ``save_checkpoint(dir, quant="fp8")``'s recipe, loaded over the same poison)."""
        if self.held is not None:
            from test_fp8_codec import bits, expected_fp8

            want = {k: expected_fp8(self.held, canonical(self.spec, step), k[1]) for k in self.targets}
            bad = {k: [n for n, w in want[k].items() if w.dtype != t[n].dtype or not torch.equal(bits(t[n]), bits(w))]
                   for k, t in self.targets.items()}
        else:
            bad = {k: exact(t, self.dst.layout(k[1]), self.spec, step) for k, t in self.targets.items()}
        return {k: v for k, v in bad.items() if v}

    def close(self) -> None:
        for x in [*self.receivers.values(), *self.senders.values()]:
            x.close()


PAIRS = {  # every trainer row and inference column
    "qwen3 hf -> vllm:tp=2 x2": dict(model="tiny-qwen3", train="hf", infer="vllm:tp=2", instances=2),
    "qwen3-moe fsdp:dp=2 -> sglang:tp=2": dict(model="tiny-qwen3-moe", train="fsdp:dp=2", infer="sglang:tp=2"),
    "llama3 megatron:tp=2 -> hf": dict(model="tiny-llama3", train="megatron:tp=2", infer="hf"),
    # fp32 master weights travel as fp32 and are converted into bf16 by the worker, through the slots
    "qwen3 fsdp:dp=2,fp32=1 -> vllm:tp=2": dict(model="tiny-qwen3", train="fsdp:dp=2,fp32=1", infer="vllm:tp=2"),
    "qwen3-moe megatron:ep=2,dp=2 -> vllm:tp=2": dict(model="tiny-qwen3-moe", train="megatron:ep=2,dp=2",
                                                     infer="vllm:tp=2"),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_sync_bit_exact_live_and_staged(meta, name):
    job = Job(meta, **PAIRS[name])
    try:
        stage = {k: poisoned(job.dst.layout(k[1])) for k in job.receivers}  # a staged reader's copy
        for step in (1, 2, 3):
            job.write(step)
            for k, rx in job.receivers.items():
                # steps 1 and 3 land in the live tensors, step 2 in the staged copy (a second prepared program)
                stats = rx.receive(step, stage[k] if step == 2 else job.targets[k])
                assert stats.bytes == sum(b.nbytes for bs in rx.ctx.plans.values() for b in bs)
            if step == 2:
                bad = {k: exact(t, job.dst.layout(k[1]), job.spec, 2) for k, t in stage.items()}
                assert not any(bad.values()), bad
                assert not job.wrong(1)  # the live tensors still hold step 1
            else:
                assert not job.wrong(step), job.wrong(step)
        if "fp32" in name:  # converted on the worker: every such piece went through a staging slot
            assert all(p.staged and not p.direct for rx in job.receivers.values() for p in rx.programs.values())
        # every byte of the plan moved once: the planner's zero redundancy unchanged
        moved = sum(b.nbytes for rx in job.receivers.values() for bs in rx.ctx.plans.values() for b in bs)
        assert moved == sum(b.nbytes for r in job.senders for bs in job.planner.send_plan(r).values() for b in bs)
    finally:
        job.close()


def test_a_cast_lands_as_the_codecs_work(meta, monkeypatch):
    """fp32 masters (random fp32 values, most not bf16-exact) into a bf16 engine: each staged bucket lands as the full
    codec's landing -- byte copies for the transport, the casts as its work -- and the targets (poisoned) equal the
    reference cast, ``src.to(bf16)``, bit for bit. Without a codec the worker refuses the cast by name before it
    writes a byte of the step."""
    landed = record_landings(monkeypatch.setattr)
    spec = load_spec("tiny-qwen3")
    g = torch.Generator().manual_seed(7)
    canon = {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}  # fp32, not rounded to bf16
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in canon.values())
    want = scatter(make_layout(spec, "vllm:tp=2").layout(0), {n: v.to(torch.bfloat16) for n, v in canon.items()})
    for codec in (FullCodec(), None):
        job = Job(meta, model="tiny-qwen3", train="hf:fp32=1", infer="vllm:tp=2", codec=codec)
        try:
            for r, t in job.train.items():
                fill_from(job.src.layout(r), t, canon)
                job.senders[r].send(1)
            rx, got = job.receivers[0, 0], job.targets[0, 0]
            if codec is None:
                with pytest.raises(ValueError, match=r"torch.float32 .* lands in a torch.bfloat16 .* no codec was "
                                                     r"given to cast it: pass the full codec"):
                    rx.receive(1, got)
                assert all(t.isnan().all() for t in got.values())
                continue
            rx.receive(1, got)
            bad = [n for n, w in want.items() if not (torch.equal(got[n].isnan(), w.isnan())
                                                      and torch.equal(got[n].nan_to_num(), w.nan_to_num()))]
            assert not bad, bad
            assert landed and all(n == 0 or (ld.work is not None and all(d.dtype == s.dtype for d, s in ld.copies))
                                  for n, ld in landed)
            assert sum(n for n, _ in landed) > 0  # every fp32 piece went through a slot and the codec's cast
        finally:
            job.close()


def test_staged_slots_and_merged_descriptors(meta):
    """A row-parallel weight that megatron tp=2 holds in halves lands strided in hf's full tensor: read
    whole into a registered slot, then unpacked; contiguous runs merge into few descriptors."""
    job = Job(meta, model="tiny-llama3", train="megatron:tp=2", infer="hf", bucket_bytes=256 << 20)
    try:
        job.write(1)
        rx = job.receivers[0, 0]
        rx.receive(1, job.targets[0, 0])
        assert not job.wrong(1)
        prog = next(iter(rx.programs.values()))
        assert prog.staged, "a strided destination must go through the staging slots"
        assert rx.memory(rx.ctx).slots == 2 and rx.slots[0].numel() == rx.memory(rx.ctx).largest
        # one in-place handle per trainer, however many segments: runs merged across tensors
        assert len(prog.direct) == len(rx.peers)
    finally:
        job.close()


def test_async_pull_whole_or_mixed(meta):
    job = Job(meta, model="tiny-qwen3", train="fsdp:dp=2", infer="vllm:tp=2", mode="async")
    try:
        rx = {k: r for k, r in job.receivers.items()}
        job.write(1)  # staged
        for k, r in rx.items():
            assert r.pull(job.targets[k]).steps == {1}
        assert not job.wrong(1)
        for r, t in job.train.items():  # training moves on without staging: pulls still read step 1 whole
            fill_from(job.src.layout(r), t, canonical(job.spec, 2))
        for k, r in rx.items():
            assert r.pull(job.targets[k]).steps == {1}
        assert not job.wrong(1)
        job.write(3)
        # a trainer re-stages while a worker reads: the pull reports a mix (never a version)
        r00 = rx[0, 0]
        real = r00._read

        def restage_then_read(targets, t0):
            job.write(4)
            return real(targets, t0)

        r00._read = restage_then_read
        got = r00.pull(job.targets[0, 0]).steps
        assert -1 in got and len(got) > 1
        r00._read = real
        for k, r in rx.items():
            assert r.pull(job.targets[k]).steps == {4}
        assert not job.wrong(4)
    finally:
        job.close()


FP8 = dict(model="tiny-qwen3-fp8", train="megatron:tp=2", infer="vllm:tp=2,quant=fp8", instances=2,
           bucket_bytes=64 << 10)  # Megatron's interleaved QKV and both TP splits, into e4m3 weights split over 2 ranks


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fp8_frames_land_the_fp8_checkpoint_bit_exact(meta, mode):
    """quant=fp8 (weightsync.codec.fp8 on the frame path): each trainer quantizes every distinct bucket into its
    registered region once (both instances read the same frames); every worker READs only the payloads -- e4m3
    bytes, fp32 scales, the bf16 rest: about half the plan's bytes, never a full read -- and lands, bit for bit,
    the FP8 checkpoint of the step's weights in NaN-poisoned targets, step after step (every weight changed).
    Where the frames cannot serve a step the worker reads nothing in full (the plan's bf16 bytes would land in e4m3
    weights without their scales): sync, a step the trainer did not encode fails naming it; async, a re-stage under
    the payload reads is reported as a mix and the next pull reads the new step."""
    from weightsync.transport.nixl import Restaged

    job = Job(meta, mode=mode, **FP8)
    try:
        for r, s in job.senders.items():  # instances of one layout share each frame
            assert 0 < len(s.distinct) < sum(len(bs) for bs in job.planner.send_plan(r).values())
        for step in (1, 2, 3):
            job.write(step)
            for k, rx in job.receivers.items():
                if mode == "sync":
                    st = rx.receive(step, job.targets[k])
                else:
                    pulled = rx.pull(job.targets[k])
                    assert pulled.steps == {step}, (k, pulled)
                    st = pulled.stats
                assert 0.4 * st.full_bytes < st.bytes < 0.6 * st.full_bytes, (k, st)
                assert not rx.programs and not rx.decoder.stats.whole_pairs  # nothing read in full
            assert not job.wrong(step), job.wrong(step)
        rx = job.receivers[0, 0]
        if mode == "sync":
            with pytest.raises(Restaged, match=r"training rank 0 -> instance 0 rank 0, step 4: its frames index names "
                                               r"step 3 .*nothing read: the fp8 codec's frames are the only form"):
                rx.receive(4, job.targets[0, 0])
            assert not rx.programs and not job.wrong(3).get((0, 0))  # untouched: still step 3
            return
        real = rx.frames._unchanged

        def restage_then_check(peers, moved):
            job.write(4)  # new frames stamped over the region while the payloads of step 3 were read
            return real(peers, moved)

        rx.frames._unchanged = restage_then_check
        got = rx.pull(job.targets[0, 0]).steps
        assert -1 in got and rx.decoder.version is None, got
        rx.frames._unchanged = real
        assert rx.pull(job.targets[0, 0]).steps == {4} and not rx.programs
        assert not job.wrong(4).get((0, 0)), job.wrong(4)
    finally:
        job.close()


def test_fp8_bucket_no_trainer_encodes_is_refused_not_read_in_full(meta):
    """Elastic trainers plan one instance slot: with replicated training ranks (megatron tp=2, dp=2) a second
    instance's buckets may come from a replica that encodes nothing for them. Its workers fail naming the trainer
    and the bucket, and read nothing in full (instance 0 lands bit for bit)."""
    job = Job(meta, **dict(FP8, train="megatron:tp=2,dp=2"), sender_instances=1)
    try:
        job.write(1)
        for j in range(2):
            assert job.receivers[0, j].receive(1, job.targets[0, j]).bytes > 0
        assert not {k: v for k, v in job.wrong(1).items() if k[0] == 0}
        with pytest.raises(TransportError, match=r"training rank \d -> instance 1 rank \d, step 1: it encodes no frame "
                                                 r"for bucket \d+ .*replicated training ranks.*nothing read"):
            for j in range(2):
                job.receivers[1, j].receive(1, job.targets[1, j])
        assert not job.receivers[1, 0].programs and all(t.isnan().all() for t in job.targets[1, 0].values())
    finally:
        job.close()


def test_fp8_encode_follows_reallocated_weights(meta):
    """The trainer's encode of a step is one landing replayed (a CUDA graph on a GPU; here the same copy tables)
    holding the sources' addresses: when the trainer reallocates its weights (``.data`` replaced, as offloading and
    reloading would), the next encode is rebuilt from where the bytes are now -- the frames carry the new step, not
    the old storage's bytes, which the first landing still holds alive -- and sync mode's check still refuses it."""
    job = Job(meta, **dict(FP8, instances=1))
    try:
        job.write(1)
        for k, rx in job.receivers.items():
            rx.receive(1, job.targets[k])
        assert not job.wrong(1)
        for t in job.train[0].values():
            t.data = t.data.clone()  # every tensor of rank 0 moves: FP8 weights and the bf16 rest
        for r, t in job.train.items():
            fill_from(job.src.layout(r), t, canonical(job.spec, 2))
            job.senders[r].send(2)
        with pytest.raises(WeightsMoved, match="training rank 0"):
            job.senders[0].check(2)
        for k, rx in job.receivers.items():  # the frames themselves hold step 2 (read here despite the refusal)
            rx.receive(2, job.targets[k])
        assert not job.wrong(2), job.wrong(2)
    finally:
        job.close()


def test_mismatched_descriptors_refused_before_any_byte(meta):
    spec = load_spec("tiny-qwen3")
    name = next(iter(make_layout(spec, "hf").layout(0).tensors))

    def reshape(train):
        t = train[0][name]
        train[0][name] = torch.randn(t.shape[0] + 1, *t.shape[1:]).to(t.dtype)  # registered with the wrong shape

    job = Job(meta, model="tiny-qwen3", train="hf", infer="vllm:tp=2", tensors=reshape)
    try:
        job.write(1)
        for k, rx in job.receivers.items():
            with pytest.raises(TransportError, match=rf"training rank 0.*{name}|{name}.*training rank 0") as e:
                rx.receive(1, job.targets[k])
            assert "refusing" in str(e.value) or "expects" in str(e.value)
            assert all(t.isnan().all() for t in job.targets[k].values()), "a byte moved before the refusal"
    finally:
        job.close()


def test_other_layout_refused(meta):
    """A trainer that registered for another job's layout (fsdp) is refused by a worker planned for hf."""
    job = Job(meta, model="tiny-qwen3", train="hf", infer="hf")
    other = Planner(make_layout(job.spec, "fsdp:dp=2"), job.dst, 1, bucket_bytes=4096)
    from weightsync.transport.nixl import NixlSender

    s = NixlSender(TransportOptions("nixl", "sync", timeout_s=TIMEOUT_S))
    tensors = scatter(other.src.layout(0), canonical(job.spec, 0))
    s.connect(SenderContext(job.link, job.client, None, 0, other, other.send_plan(0), tensors))  # replaces rank 0's
    try:
        with pytest.raises(TransportError, match="another layout"):
            job.receivers[0, 0].receive(1, job.targets[0, 0])
        assert all(t.isnan().all() for t in job.targets[0, 0].values())
    finally:
        s.close()
        job.close()


def _native_threads() -> set[int]:
    """This process's threads that Python did not start (NIXL's and UCX's, among others)."""
    import threading

    return {int(t) for t in os.listdir("/proc/self/task")} - {t.native_id for t in threading.enumerate()}


def test_close_releases_every_agent(meta, caplog):
    """close() lets each agent go (NIXL has no destroy call: an agent goes with its last reference, every
    prepared list and transfer handle included), and with it the UCX progress thread (a trainer's), which
    would poll on (~0.15 CPU s a second each) until the process exits; none is left referenced (no warning)."""
    import weakref

    before = _native_threads()
    job = Job(meta, model="tiny-qwen3", train="fsdp:dp=2", infer="vllm:tp=2", mode="async")
    job.write(1)
    for k, rx in job.receivers.items():  # programs, header handles and staged slots all made
        assert rx.pull(job.targets[k]).steps == {1}
    assert not job.wrong(1)
    started = _native_threads() - before
    # each trainer's agent runs NIXL's progress thread (readers poll their own transfers: nixl._agent)
    assert len(started) >= len(job.senders), "each trainer's agent runs a progress thread"
    agents = [weakref.ref(x.agent) for x in [*job.senders.values(), *job.receivers.values()]]
    with caplog.at_level("WARNING", logger="weightsync.transport.nixl"):
        job.close()
    assert not [r.message for r in caplog.records if "still referenced" in r.message]
    assert all(a() is None for a in agents), "a closed transport's agent is still alive"
    deadline = time.monotonic() + 5
    while _native_threads() & started and time.monotonic() < deadline:  # joined as each agent goes
        time.sleep(0.05)
    assert not _native_threads() & started, f"threads left after close: {sorted(_native_threads() & started)}"


def test_moved_weights_refused(meta):
    job = Job(meta, model="tiny-qwen3", train="hf", infer="hf")
    try:
        t = next(iter(job.train[0].values()))
        t.data = t.data.clone()  # as offloading and reloading would
        with pytest.raises(WeightsMoved, match="training rank 0"):
            job.senders[0].check(1)
    finally:
        job.close()


# -- a training rank killed mid-read ------------------------------------------------------------------


def _trainer_child(url: str, job: str, ready) -> None:
    """Both training ranks of a vllm:tp=2 source, each its own agent, in one process killed at once."""
    from weightsync.transport.nixl import NixlSender

    spec = load_spec("tiny-qwen3")
    src, dst = make_layout(spec, "vllm:tp=2"), make_layout(spec, "hf")
    planner = Planner(src, dst, 1, bucket_bytes=2048)
    keep = []
    for r in range(src.world_size):
        tensors = scatter(src.layout(r), canonical(spec, 1))
        s = NixlSender(TransportOptions("nixl", "sync", timeout_s=TIMEOUT_S))
        s.connect(SenderContext(MetaLink(url, job), MetaClient(url, job), None, r, planner, planner.send_plan(r),
                                tensors))
        s.send(1)
        keep.append((s, tensors))
    ready.set()
    time.sleep(120)


def test_trainer_killed_mid_read_fails_bounded(meta):
    from weightsync.transport.nixl import NixlReceiver

    job = f"kill-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_trainer_child, args=(meta, job, ready), daemon=True)
    child.start()
    try:
        assert ready.wait(60), "the trainer child did not start"
        spec = load_spec("tiny-qwen3")
        # vllm:tp=2 -> hf: the row-parallel halves land strided in hf's tensors (staged buckets, many posts)
        src, dst = make_layout(spec, "vllm:tp=2"), make_layout(spec, "hf")
        planner = Planner(src, dst, 1, bucket_bytes=2048)
        rx = NixlReceiver(TransportOptions("nixl", "sync", timeout_s=TIMEOUT_S))
        live = poisoned(dst.layout(0))
        rx.connect(ReceiverContext(MetaLink(meta, job), None, 0, 0, planner, planner.recv_plan(0, 0), live,
                                   torch.device("cpu")))
        real, posts = rx._post, []

        def post_then_kill(h, pair, bucket):
            real(h, pair, bucket)
            posts.append(bucket)
            if len(posts) == 1:  # the trainers die with this worker's first read posted
                os.kill(child.pid, signal.SIGKILL)
                child.join(10)

        rx._post = post_then_kill
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"NIXL READ of .*training rank [01] -> instance 0 rank 0") as e:
            rx.receive(1, live)
        assert time.monotonic() - t0 < TIMEOUT_S + 5
        assert e.value.pair[1:] == (0, 0) and e.value.pair[0] in (0, 1)
        assert any(t.isnan().any() for t in live.values()), "the step cannot have landed whole"
        rx.close()
    finally:
        if child.is_alive():
            child.kill()
        child.join()


def test_runs_and_merging():
    """box_runs covers exactly a box's bytes in row-major order; merge_pairs never joins across regions."""
    import numpy as np

    from weightsync.transport.nixl_wire import box_runs, merge_pairs

    g = torch.Generator().manual_seed(3)
    for shape, box in [((6, 8), ((0, 6), (2, 3))), ((6, 8), ((1, 3), (0, 8))), ((4, 3, 5), ((1, 2), (0, 3), (1, 4))),
                       ((4, 3, 5), ((0, 4), (1, 1), (0, 5))), ((7,), ((2, 4),)), ((2, 1, 6), ((1, 1), (0, 1), (0, 6)))]:
        full = torch.randint(0, 1 << 30, shape, generator=g, dtype=torch.int32)
        runs = box_runs(full.data_ptr(), full.shape, full.stride(), 4, box)
        got = torch.cat([full.view(-1)[(a - full.data_ptr()) // 4:(a - full.data_ptr() + n) // 4] for a, n in runs])
        want = full[tuple(slice(o, o + n) for o, n in box)].reshape(-1)
        assert torch.equal(got, want), (shape, box, runs)
        assert all(runs[1:, 0] != runs[:-1, 0] + runs[:-1, 1])  # merged
    local = np.array([[0, 10], [10, 10], [20, 10]], dtype=np.int64)
    remote = np.array([[100, 10], [110, 10], [120, 10]], dtype=np.int64)
    assert merge_pairs(local, remote)[0].tolist() == [[0, 30]]
    # the remote side registered [100, 110) and [110, 130) apart: never one descriptor across them
    loc, rem = merge_pairs(local, remote, [(0, 30)], [(100, 10), (110, 20)])
    assert loc.tolist() == [[0, 10], [10, 20]] and rem.tolist() == [[100, 10], [110, 20]]


def test_strided_boxes_packed_one_descriptor_each(meta, monkeypatch):
    """hf -> vLLM TP=2 reads o_proj / down_proj in column halves (one byte run a row in the trainer): the
    trainer packs each half every step and the worker reads it as ONE descriptor; bit-exact over steps,
    the packed bytes refreshed every send; with packing off (WEIGHTSYNC_NIXL_PACK=0) one descriptor a row."""
    def runs(job):  # each worker's remote byte runs, before merging: what it would post at most
        return {k: sum(len(d.runs) for p in rx.peers.values() for d in p.direct)
                + sum(len(b.runs) for p in rx.peers.values() for b in p.batches) for k, rx in job.receivers.items()}

    got = {}
    for pack in ("1", "0"):
        monkeypatch.setenv("WEIGHTSYNC_NIXL_PACK", pack)
        job = Job(meta, model="tiny-qwen3", train="hf", infer="vllm:tp=2", bucket_bytes=1 << 20)
        try:
            assert bool(job.senders[0].packed) == (pack == "1")
            for step in (1, 2):
                job.write(step)
                for k, rx in job.receivers.items():
                    rx.receive(step, job.targets[k])
                assert not job.wrong(step), job.wrong(step)
            got[pack] = runs(job)
        finally:
            job.close()
    for k in got["1"]:
        assert got["1"][k] * 4 < got["0"][k], (k, got)


def test_readers_poll_without_the_progress_thread(meta, monkeypatch):
    """Readers start their agent without NIXL's progress thread unless WEIGHTSYNC_NIXL_RX_PROGRESS_THREAD=1
    (on one H200 the thread cost every READ descriptor ~15 us); trainers keep theirs. Bit-exact both ways."""
    import weightsync.transport.nixl as nx

    real, seen = nx._agent, []

    def agent(nixl, role, progress_thread=True):
        seen.append((role[0], progress_thread))
        return real(nixl, role, progress_thread)

    monkeypatch.setattr(nx, "_agent", agent)
    for env, want in ((None, False), ("1", True)):
        if env is None:
            monkeypatch.delenv("WEIGHTSYNC_NIXL_RX_PROGRESS_THREAD", raising=False)
        else:
            monkeypatch.setenv("WEIGHTSYNC_NIXL_RX_PROGRESS_THREAD", env)
        seen.clear()
        job = Job(meta, model="tiny-qwen3", train="hf", infer="vllm:tp=2")
        try:
            job.write(1)
            for k, rx in job.receivers.items():
                rx.receive(1, job.targets[k])
            assert not job.wrong(1)
            assert {p for r, p in seen if r == "i"} == {want} and {p for r, p in seen if r == "t"} == {True}, seen
        finally:
            job.close()


def test_allocator_segments_cover_their_tensors():
    """On a GPU each storage is registered as the allocator segment that holds it (adjacent tensors of one
    segment then merge); a storage in no known segment stays itself; segments are registered once."""
    from weightsync.transport.nixl import _cover

    segs = [(1000, 500), (2000, 100), (4096, 1 << 20)]
    storages = [(1000, 100), (1100, 200), (2000, 100), (3000, 50), (4096 + 512, 4096), (1450, 100)]
    assert _cover(storages, segs) == [(1000, 500), (1450, 100), (2000, 100), (3000, 50), (4096, 1 << 20)]
    assert _cover(storages, []) == sorted(storages)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu on the device host)")
def test_gpu_nixl_1gpu_bench_bit_exact():
    """VRAM registered on both sides, a trainer and an inference process on one GPU, the plan through
    NIXL (UCX cuda_ipc READs), bit-exact; the bench's ceiling (a device copy) measured in the same run."""
    from weightsync.bench.run import run

    r = run("nixl-1gpu", "tiny-qwen3", steps=2, timeout=120.0, baselines=(), device="cuda")
    assert not r["errors"], r["errors"]
    assert r["verified"] and r["transport"] == "nixl" and r["ceiling_bytes_per_s"] > 0


def test_a_receive_takes_its_timeout_in_all_however_steadily_reads_progress(meta):
    """A step's reads take ``timeout_s`` (5 s) in all, so a worker's call returns before the engine's RPC deadline:
    every read here completes 0.5 s after it is first asked about (a slow link) -- never 5 s without progress, so
    the idle timeout alone would wait the ~20 buckets out -- and the receive fails at 5 s naming a bucket; the
    posted reads may still land, so the receiver refuses the next receive at once."""
    job = Job(meta, model="tiny-qwen3", train="vllm:tp=2", infer="hf", bucket_bytes=2048)
    try:
        job.write(1)
        rx = job.receivers[0, 0]
        real, first = rx.agent.check_xfer_state, {}

        def slow(h):
            seen = first.setdefault(id(h), time.monotonic())
            return real(h) if time.monotonic() - seen >= 0.5 else "PROC"

        rx.agent.check_xfer_state = slow
        start = time.monotonic()
        with pytest.raises(TransportError, match=r"the step's reads did not finish within 5s"):
            rx.receive(1, job.targets[0, 0])
        assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 1.0
        assert len(first) > 2  # several reads completed meanwhile: never an idle timeout
        rx.agent.check_xfer_state = real
        with pytest.raises(TransportError, match="refused: reads of an earlier step may still land"):
            rx.receive(1, job.targets[0, 0])
    finally:
        job.close()
