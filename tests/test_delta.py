"""Delta updates (weightsync.delta): the codec, and whole jobs over p2p (real gloo groups) and file.

Codec: random sparse changes at 0.1-30% (and none, and all) round-trip bit-exact over many steps in
bf16, fp16, fp32 and odd sizes, through every encoding, applied onto a base held in one piece or cut
into parts. Transports: a trainer taking Adam steps on fp32 master weights (bf16 on the wire) sends
deltas; every receiver is bit-exact against the trainer's weights after every step, and each kind of
gap -- a new instance, a skipped step, a failed update, a staged copy rolled back, tensors touched
behind the reader's back, a sender that lost its previous version -- makes exactly that pair go
whole while the others stay deltas.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback

from dataclasses import dataclass

import pytest
import torch
from helpers import same

from weightsync.local.events import Event

from weightsync.delta import codec
from weightsync.delta.walk import AdamWalk

# -- codec ------------------------------------------------------------------------------------------

FRACTIONS = [0.0, 0.001, 0.01, 0.05, 0.1, 0.3, 1.0]


def _mutate(x: torch.Tensor, frac: float, g: torch.Generator) -> torch.Tensor:
    y = x.clone()
    m = torch.rand(x.shape, generator=g) < frac
    y[m] = (torch.randn(int(m.sum()), generator=g) * 3).to(x.dtype)
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 7, 31, 33, 4099])
def test_codec_round_trips_over_many_steps(dtype, n):
    """A receiver applying each step's encoding onto what it holds tracks the sender bit-exactly."""
    g = torch.Generator().manual_seed(n)
    sender = torch.randn(n, generator=g).to(dtype)
    held = sender.clone()  # the receiver's copy: one piece and cut in three
    cut = held.clone()
    seen = set()
    for step in range(24):
        base = sender
        sender = _mutate(sender, FRACTIONS[step % len(FRACTIONS)], g)
        w = sender.element_size()
        enc = codec.encode(codec.as_words(sender.view(torch.uint8), w), codec.as_words(base.view(torch.uint8), w))
        assert enc.nbytes == codec.payload_bytes(enc.kind, enc.count, n, w)
        assert enc.nbytes <= n * w
        seen.add(enc.kind)
        codec.apply([codec.as_words(held.view(torch.uint8), w)], enc.kind, enc.count, w, enc.payload.clone())
        words = codec.as_words(cut.view(torch.uint8), w)
        a, b = n // 3, 2 * n // 3
        codec.apply([words[:a], words[a:b], words[b:]], enc.kind, enc.count, w, enc.payload.clone())
        assert torch.equal(held.view(torch.uint8), sender.view(torch.uint8)), (step, codec.KIND_NAMES[enc.kind])
        assert torch.equal(cut.view(torch.uint8), sender.view(torch.uint8)), (step, codec.KIND_NAMES[enc.kind])
    if n > 1000:
        assert {codec.SAME, codec.INDICES, codec.BITMAP} <= seen


@pytest.mark.parametrize("kind", [codec.INDICES, codec.BITMAP, codec.BLOCKS, codec.FULL])
def test_every_encoding_round_trips(kind):
    g = torch.Generator().manual_seed(kind)
    for dtype, n in [(torch.bfloat16, 1001), (torch.float32, 257), (torch.bfloat16, 64)]:
        base = torch.randn(n, generator=g).to(dtype)
        for frac in FRACTIONS:
            cur = _mutate(base, frac, g)
            w = cur.element_size()
            cw, bw = codec.as_words(cur.view(torch.uint8), w), codec.as_words(base.view(torch.uint8), w)
            changed = cw != bw
            count = int(codec._block_mask(changed).sum()) if kind == codec.BLOCKS else int(changed.sum())
            enc = codec.encode_as(kind, cw, changed, count, bw)
            assert enc.nbytes == codec.payload_bytes(kind, count, n, w)
            held = base.clone()
            codec.apply([codec.as_words(held.view(torch.uint8), w)], kind, count, w, enc.payload)
            assert torch.equal(held.view(torch.uint8), cur.view(torch.uint8)), (dtype, n, frac)


def test_bits_not_values_are_compared():
    """-0.0 against 0.0 and NaN payloads differ in bits: they are sent; equal NaNs are not."""
    base = torch.tensor([0.0, float("nan"), 1.0, 2.0], dtype=torch.float32)
    cur = torch.tensor([-0.0, float("nan"), 1.0, 2.5], dtype=torch.float32)
    cw, bw = codec.as_words(cur.view(torch.uint8), 4), codec.as_words(base.view(torch.uint8), 4)
    enc = codec.encode(cw, bw)
    assert enc.count == 2
    held = base.clone()
    codec.apply([codec.as_words(held.view(torch.uint8), 4)], enc.kind, enc.count, 4, enc.payload)
    assert torch.equal(held.view(torch.int32), cur.view(torch.int32))


def test_choice_is_the_smallest():
    n, w = 1 << 20, 2
    assert codec.choose(0, None, n, w) == (codec.SAME, 0)
    assert codec.choose(n // 100, None, n, w)[0] == codec.INDICES  # 1%: 6 bytes a change < n/8
    assert codec.choose(n // 10, None, n, w)[0] == codec.BITMAP
    assert codec.choose(n, None, n, w)[0] == codec.FULL
    assert codec.choose(n // 10, 10, n, w)[0] == codec.BLOCKS  # clustered: 10 blocks hold every change


def test_checksum_sees_any_bit_and_ignores_the_cut():
    """The integrity digest, chained over parts: one buffer and its in-place pieces agree."""
    from weightsync.integrity.digest import checksum as digest, to_ints

    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 255, (3 * 8192 + 6,), generator=g, dtype=torch.uint8)
    whole = codec.checksum([x])
    assert whole == to_ints([digest(x)])[0]
    assert codec.checksum([x[:1000], x[1000:3002], x[3002:]]) == whole  # cut off word boundaries
    assert codec.checksum([x[:8192], x[8192:16384], x[16384:]]) == whole  # on them
    for at in (0, 17, 3 * 8192 + 5):
        y = x.clone()
        y[at] ^= 4
        assert codec.checksum([y]) != whole


def test_payload_size_is_checked():
    with pytest.raises(ValueError, match="payload"):
        codec.apply([torch.zeros(8, dtype=torch.int16)], codec.INDICES, 2, 2, torch.zeros(3, dtype=torch.uint8))


# -- whole jobs over p2p ----------------------------------------------------------------------------

TIMEOUT_S = 10.0
LR = 1e-4  # about 3% of the tiny model's bf16 elements change a step


def _ctx():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "weightsync.codec.delta", "weightsync.engines", "test_delta"])
    return ctx


def _trajectory(spec, steps: int):
    from weightsync.testing import random_canonical

    walk = AdamWalk(random_canonical(spec, 5), LR, seed=7)
    out = [walk.weights()]
    for _ in range(steps - 1):
        out.append(walk.step())
    return out


#: step -> {(instance, rank): what happens to that receiver just before the step}
GAPS = {
    3: {(1, 0): "new instance"},
    4: {(0, 1): "skipped step"},
    5: {(1, 1): "failed update"},
    6: {(0, 0): "staged rollback"},
    7: {(1, 0): "touched"},
}
SENDER_FORGETS = 8  # the sender lost its previous version (a failed send): every pair goes whole
STEPS = 10


def _p2p_member(role: str, who: tuple, port: int, results) -> None:
    from weightsync.codec.delta import DeltaCodec
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES, fill_from, scatter
    from weightsync.plan.planner import Planner
    from weightsync.spec import load_spec
    from weightsync.transport.group import new_group
    from weightsync.transport.p2p import Framing, JobRanks, P2PTransport

    torch.set_num_threads(1)
    g_rank = None
    try:
        spec = load_spec("tiny-qwen3")
        src, dst = make_layout(spec, "fsdp:dp=2"), make_layout(spec, "vllm:tp=2")
        ranks = JobRanks(src.world_size, dst.world_size, 2)
        planner = Planner(src, dst, 2, bucket_bytes=24 << 10)
        g_rank = ranks.train(*who) if role == "train" else ranks.infer(*who)
        pg = new_group("127.0.0.1", port, g_rank, ranks.world_size, timeout_s=30)
        transport = P2PTransport(pg, ranks, timeout_s=TIMEOUT_S, direct_min=2048)  # some buckets land in place
        traj = _trajectory(spec, STEPS)
        report = []
        if role == "train":
            layout, plans = src.layout(who[0]), planner.send_plan(who[0])
            tensors = scatter(layout, traj[0])
            codec = DeltaCodec()
            sender = codec.encoder(plans, torch.device("cpu"))
            for step in range(STEPS):
                fill_from(layout, tensors, traj[step])
                if step == SENDER_FORGETS:
                    sender.fail()
                stats = transport.send(plans, tensors, frames=Framing(step, sender, codec, proofs=True))
                report.append((step, sorted(sender.stats.whole_pairs), stats.bytes, stats.full_bytes,
                               dict(sender.stats.kinds)))
        else:
            layout, plans = dst.layout(who[1]), planner.recv_plan(*who)

            def poisoned():
                return {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype])
                        for n, t in layout.tensors.items()}

            tensors = poisoned()
            codec = DeltaCodec()
            receiver = codec.decoder(plans)
            history = {}
            for step in range(STEPS):
                gap = GAPS.get(step, {}).get(tuple(who))
                if gap == "new instance":  # a fresh reader: nothing held, nothing provable
                    receiver, tensors = codec.decoder(plans), poisoned()
                elif gap == "skipped step":  # holds step - 2 whole, as if it missed step - 1
                    fill_from(layout, tensors, traj[step - 2])
                    receiver.version = step - 2
                elif gap == "failed update":  # a receive that raised half-way
                    for t in list(tensors.values())[::2]:
                        t.view(-1)[: t.numel() // 2] = 7.0
                    receiver.version = None
                elif gap == "staged rollback":  # a staged copy rolled back: the version claims more
                    fill_from(layout, tensors, traj[step - 3])
                elif gap == "touched":  # one element changed behind the reader's back
                    t = next(iter(tensors.values()))
                    t.view(-1)[0] = t.view(-1)[0] + 1
                stats = transport.recv(plans, tensors, frames=Framing(step, receiver, codec, proofs=True))
                want = scatter(layout, traj[step])
                bad = [n for n in want if not same(tensors[n], want[n])]
                assert not bad, f"step {step}: wrong values in {bad[:4]}"
                history[step] = stats.bytes
                report.append((step, stats.bytes, stats.full_bytes, dict(receiver.stats.kinds)))
        results.put((g_rank, "ok", report))
    except BaseException:  # noqa: BLE001 - the parent asserts
        results.put((g_rank, "error", traceback.format_exc()))


def _run(target, members: list[tuple[str, tuple]], args: tuple, deadline_s: float = 90.0) -> dict:
    from weightsync.transport.group import free_port

    ctx = _ctx()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(role, who, port, *args, results), daemon=True) for role, who in members]
    for p in procs:
        p.start()
    got = {}
    end = time.monotonic() + deadline_s
    while len(got) < len(procs) and time.monotonic() < end:
        try:
            g, status, detail = results.get(timeout=0.2)
            got[g] = (status, detail)
        except queue.Empty:
            pass
    for p in procs:
        p.join(timeout=max(0.1, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    assert len(got) == len(procs), f"only {sorted(got)} of {len(procs)} processes reported"
    failed = {g: d for g, (s, d) in got.items() if s != "ok"}
    assert not failed, "\n".join(f"group rank {g}:\n{d}" for g, d in failed.items())
    return {g: d for g, (_, d) in got.items()}


@pytest.fixture(scope="module")
def p2p_job():
    members = [("train", (0,)), ("train", (1,))] + [("infer", (i, j)) for i in range(2) for j in range(2)]
    return _run(_p2p_member, members, ())


def test_p2p_bit_exact_every_step_with_fp32_master_weights(p2p_job):
    """Every receiver equalled the trainer's bf16 weights after every step (checked in the workers)."""
    for g in (2, 3, 4, 5):
        assert [r[0] for r in p2p_job[g]] == list(range(STEPS))


def test_p2p_gaps_fall_back_to_whole_pairs(p2p_job):
    """Step 0 goes whole; each gap sends exactly that receiver's pairs whole (a touched element: the
    pair holding it); the rest are deltas, a tenth of the bytes at most."""
    for step in range(STEPS):
        whole = {p for t in (0, 1) for p in p2p_job[t][step][1]}
        if step in (0, SENDER_FORGETS):
            assert whole == {(t, i, j) for t in (0, 1) for i in range(2) for j in range(2)}, step
            continue
        gaps = GAPS.get(step, {})
        want = {(t, i, j) for t in (0, 1) for (i, j), gap in gaps.items() if gap != "touched"}
        touched = {p for p in whole if (p[1], p[2]) in gaps and gaps[(p[1], p[2])] == "touched"}
        assert whole - touched == want, (step, sorted(whole))
        assert len(touched) == (1 if "touched" in gaps.values() else 0), (step, sorted(whole))
        for t in (0, 1):
            _, full_pairs, moved, full, kinds = p2p_job[t][step]
            if not full_pairs:
                assert moved < full / 10, (t, step, moved, full, kinds)  # ~3% changed
    for g in (2, 3, 4, 5):
        i, j = divmod(g - 2, 2)
        for step, moved, full, kinds in p2p_job[g]:
            whole = step in (0, SENDER_FORGETS) or (i, j) in GAPS.get(step, {})
            if GAPS.get(step, {}).get((i, j)) == "touched":
                assert "full" in kinds, (i, j, step, kinds)
            elif whole:
                assert kinds == {"full": sum(kinds.values())} and moved > full, (i, j, step, moved, full, kinds)
            else:
                assert "full" not in kinds and moved < full / 10, (i, j, step, moved, full, kinds)


# -- the file transport (one process: a directory needs no group) ---------------------------------


def test_file_bit_exact_and_gaps_read_the_full_file(tmp_path):
    """Two trainers write full and delta files each step; four receivers (2 instances x tp=2) read the
    delta when they prove its base, else the full file -- each gap exactly where it happens."""
    from weightsync.codec.delta import DeltaCodec
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES, fill_from, scatter
    from weightsync.plan.planner import Planner
    from weightsync.spec import load_spec
    from weightsync.payload.codec import Framing
    from weightsync.transport.file import FileTransport

    spec = load_spec("tiny-qwen3")
    src, dst = make_layout(spec, "fsdp:dp=2"), make_layout(spec, "vllm:tp=2")
    planner = Planner(src, dst, 1, bucket_bytes=24 << 10)  # elastic file: every instance reads slot 0's files
    traj = _trajectory(spec, STEPS)
    codec = DeltaCodec()
    senders = []
    for r in range(2):
        tensors = scatter(src.layout(r), traj[0])
        senders.append((r, tensors, codec.encoder(planner.send_plan(r), torch.device("cpu"))))

    def poisoned(j):
        return {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype])
                for n, t in dst.layout(j).tensors.items()}

    plans = {j: planner.recv_plan(0, j) for j in range(2)}
    receivers = {(i, j): [codec.decoder(plans[j]), poisoned(j)] for i in range(2) for j in range(2)}
    for step in range(STEPS):
        for r, tensors, sender in senders:
            fill_from(src.layout(r), tensors, traj[step])
            if step == SENDER_FORGETS:
                sender.fail()
            stats = FileTransport(tmp_path).send(planner.send_plan(r), tensors, frames=Framing(step, sender, codec))
            assert stats.bytes >= stats.full_bytes
        for (i, j), held in receivers.items():
            receiver, tensors = held
            layout = dst.layout(j)
            gap = GAPS.get(step, {}).get((i, j))
            if gap == "new instance":
                receiver = held[0] = codec.decoder(plans[j])
                tensors = held[1] = poisoned(j)
            elif gap == "skipped step":
                fill_from(layout, tensors, traj[step - 2])
                receiver.version = step - 2
            elif gap == "failed update":
                for t in list(tensors.values())[::2]:
                    t.view(-1)[: t.numel() // 2] = 7.0
                receiver.version = None
            elif gap == "staged rollback":
                fill_from(layout, tensors, traj[step - 3])
            elif gap == "touched":
                t = next(iter(tensors.values()))
                t.view(-1)[0] = t.view(-1)[0] + 1
            stats = FileTransport(tmp_path, consume=False).recv(plans[j], tensors, frames=Framing(step, receiver, codec))
            want = scatter(layout, traj[step])
            bad = [n for n in want if not same(tensors[n], want[n])]
            assert not bad, f"step {step} instance {i} rank {j}: wrong values in {bad[:4]}"
            whole = step in (0, SENDER_FORGETS) or (gap is not None and gap != "touched")
            if whole:
                assert len(receiver.stats.whole_pairs) == 2 and stats.bytes == stats.full_bytes, (step, i, j, gap)
            elif gap == "touched":
                assert len(receiver.stats.whole_pairs) == 1, (step, i, j, receiver.stats.whole_pairs)
            else:
                assert not receiver.stats.whole_pairs and stats.bytes < stats.full_bytes / 10, (step, i, j, stats)
        for r, _, sender in senders:
            FileTransport(tmp_path).sweep(step + 1, pairs=planner.send_plan(r))
    assert not [n for n in __import__("os").listdir(tmp_path) if "step" in n and int(n.split(".")[0][4:]) < STEPS - 1]


# -- whole jobs through WeightWriter / WeightReader (delta=True) ------------------------------------

_TRAJ: dict = {}


def _walk_step(model: str, step: int) -> dict:
    """The trainer's bf16 weights at ``step`` (1-based in jobs), computed once per process."""
    from weightsync.spec import load_spec

    if model not in _TRAJ:
        _TRAJ[model] = _trajectory(load_spec(model), JOB_STEPS + 1)
    return _TRAJ[model][step]


JOB_STEPS = 4


@dataclass(frozen=True)
class DeltaWrote(Event):
    step: int
    bytes: int
    full_bytes: int


@dataclass(frozen=True)
class DeltaDone(Event):
    step: int
    bytes: int
    full_bytes: int
    version: int | None
    problems: tuple[str, ...]


def _check_worker(ctx, model: str, engine: str, step: int) -> str:
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import scatter
    from weightsync.spec import load_spec

    want = scatter(make_layout(load_spec(model), engine).layout(ctx.rank), _walk_step(model, step))
    bad = [n for n, w in want.items() if not same(ctx.tensors[n].detach().cpu(), w)]
    return f"rank {ctx.rank}: {bad[:3]} differ" if bad else ""


def _job_trainer(emit, rank: int, world: int, port: int, meta: str, job: dict) -> None:
    import datetime

    import torch.distributed as dist

    from weightsync.layout.materialize import fill_from
    from weightsync.local.events import Ready
    from weightsync.local.trainers import build_trainer
    from weightsync.runtime.writer import WeightWriter
    from weightsync.spec import load_spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    spec = load_spec(job["model"])
    bound = build_trainer(spec, job["train"], rank, world, same_start=False).bound
    writer = WeightWriter(bound, meta=meta, job=job["job"], timeout_s=job["timeout"], bucket_bytes=16 << 10,
                          transport=job["transport"], directory=job.get("directory"), delta=True).connect()
    emit(Ready(emit.participant))
    for step in range(1, JOB_STEPS + 1):
        with torch.no_grad():
            fill_from(bound.layout, bound.tensors, _walk_step(job["model"], step))
        stats = writer.write(step)
        emit(DeltaWrote(emit.participant, step, stats.bytes, stats.full_bytes))


def _job_reader(emit, inst: int, meta: str, job: dict) -> None:
    from weightsync.local.events import Ready
    from weightsync.local.instances import build_instance
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    torch.set_num_threads(1)
    spec = load_spec(job["model"])
    local = build_instance(spec, job["infer"], device="cpu", seed=1)
    try:
        r = WeightReader(local.instance, meta=meta, job=job["job"], instance_id=inst, instances=job["instances"],
                         timeout_s=job["timeout"], bucket_bytes=16 << 10, transport=job["transport"],
                         directory=job.get("directory"), staged=inst == 1, delta=True).connect()
        emit(Ready(emit.participant))
        for step in range(1, JOB_STEPS + 1):
            r.update(step)
            problems = tuple(p for p in local.instance.call(_check_worker, spec.name, job["infer"], step) if p)
            moved = sum(s.bytes for s in r.last_stats)
            full = sum(s.stats.full_bytes for s in r.last_stats)
            emit(DeltaDone(emit.participant, step, moved, full, r.version, problems))
    finally:
        local.close()


@pytest.mark.parametrize("transport, infer", [("p2p", "vllm:tp=2")])
def test_writer_and_readers_with_delta(transport, infer, tmp_path):
    """hf trainer -> 2 vLLM-layout instances (tp=2; instance 1 staged), delta=True: bit-exact every
    step; the first step moves whole, later ones a tenth of the bytes at most."""
    from weightsync.local.events import Participant
    from weightsync.local.runner import LocalJob
    from weightsync.transport.group import free_port

    job = dict(job="delta", model="tiny-qwen3", train="hf", infer=infer, instances=2, timeout=30.0,
               transport=transport, directory=str(tmp_path) if transport == "file" else None)
    with LocalJob(deadline_s=120, stop_on_failure=True, exit_grace_s=5.0) as local:
        local.add(Participant.trainer(0), _job_trainer, 0, 1, free_port(), local.meta_url, job)
        for i in range(2):
            local.add(Participant.instance(i), _job_reader, i, local.meta_url, job)
        result = local.run()
    assert not result.failures, "\n".join(f"{f.line()}\n{f.traceback}" for f in result.failures)
    done = result.of(DeltaDone)
    assert len(done) == 2 * JOB_STEPS
    for d in done:
        assert d.problems == () and d.version == d.step, d
        if d.step == 1:
            assert d.bytes >= d.full_bytes, d
        else:
            assert d.bytes < d.full_bytes / 10, d
    for w in result.of(DeltaWrote):
        if transport == "p2p" and w.step > 1:  # the file writer writes the full file too
            assert w.bytes < w.full_bytes / 10, w


def test_demo_delta_with_an_instance_joining(tmp_path):
    """``weightsync demo --delta --lr 1e-6 --transport file --join-at 3``: AdamW on fp32 master weights
    (bf16 wire), every tensor verified each step; the joiner's first step moves whole, every other
    step after the first a tenth of the bytes at most."""
    from weightsync.demo import DemoConfig, run

    cfg = DemoConfig(train="hf", infer=("vllm:tp=2",), steps=4, transport="file", join_at=3, delta=True, lr=1e-6,
                     timeout_s=60.0)
    result = run(cfg, print_fn=lambda s: None)
    assert result["verified"], result["errors"]
    full = None
    for s in result["steps"]:
        for inst in s["instances"]:
            first = s["step"] == 1 or (inst["instance"] == 1 and s["step"] == 3)
            if s["step"] == 1:
                full = inst["bytes"]
            assert (inst["bytes"] == full) if first else (inst["bytes"] < full / 10), (s["step"], inst)
    assert [len(s["instances"]) for s in result["steps"]] == [1, 1, 2, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_encode_without_blocks_finds_the_same_changes(dtype):
    """The transports' path (8-byte words first, no word mask) encodes exactly the mask path's bytes."""
    g = torch.Generator().manual_seed(11)
    for n in (8, 1000, 4096 + 4):
        base = torch.randn(n, generator=g).to(dtype)
        for frac in FRACTIONS:
            cur = _mutate(base, frac, g)
            w = cur.element_size()
            cw, bw = codec.as_words(cur.view(torch.uint8), w), codec.as_words(base.view(torch.uint8), w)
            fast = codec.encode(cw, bw, blocks=False)
            changed = cw != bw
            kind, count = codec.choose(int(changed.sum()), None, n, w)
            slow = codec.encode_as(kind, cw, changed, count)
            assert (fast.kind, fast.count) == (slow.kind, slow.count) and torch.equal(fast.payload, slow.payload)


# -- options and memory -----------------------------------------------------------------------------


def test_delta_is_refused_where_it_does_not_run():
    from weightsync.errors import ConfigError
    from weightsync.runtime.session import SessionOptions

    with pytest.raises(ConfigError, match="co-located"):
        SessionOptions(colocate=True, delta=True)
    with pytest.raises(ConfigError, match="sync mode"):
        SessionOptions(mode="async", delta=True)
    assert SessionOptions(transport="nixl", delta=True).delta  # sync over nixl runs deltas (tests/test_delta_nixl.py)
    assert SessionOptions(transport="nixl", mode="async", delta=True).delta  # tests/test_delta_nixl.py
    opts = SessionOptions(delta=True, delta_host=True).transport_options("gloo")
    assert opts.framed and opts.codec.name == "delta" and opts.codec.host


def test_the_previous_version_counts_against_the_budget():
    """The sender's previous version is in Buffers.bytes (on the device) and refused over the budget
    with a message naming it; kept in host memory it leaves the device budget."""
    from weightsync.codec.delta_state import PreviousVersion, previous_buffers_bytes, previous_bytes
    from weightsync.engines import make_layout
    from weightsync.errors import ConfigError
    from weightsync.plan.planner import Planner
    from weightsync.runtime.job import enforce_memory_budget
    from weightsync.spec import load_spec
    from weightsync.transport.base import Buffers

    spec = load_spec("tiny-qwen3")
    planner = Planner(make_layout(spec, "hf"), make_layout(spec, "vllm:tp=2"), 2, bucket_bytes=24 << 10)
    plans = planner.send_plan(0)
    n = previous_bytes(plans)
    assert n == sum(b.nbytes for (_, i, _), bs in plans.items() if i == 0 for b in bs)  # instances alike: once
    assert PreviousVersion(plans, torch.device("cpu")).nbytes == n
    assert previous_buffers_bytes(plans, host=True) == 0 and previous_buffers_bytes(plans, host=False) == n

    class Client:
        aborted = None

        def abort(self, reason):
            Client.aborted = reason

    b = Buffers(2, 24 << 10, codec=n)
    assert b.bytes == 2 * (24 << 10) + n
    with pytest.raises(ConfigError, match="previous version for delta updates"):
        enforce_memory_budget(Client(), n, b, "training rank 0")
    assert "delta_host=True" in Client.aborted
    assert enforce_memory_budget(Client(), b.bytes, b, "training rank 0") == b.bytes
