"""Per-step integrity (weightsync.integrity): the checksum, a plan's bucket sums, and real jobs whose
landed bytes are corrupted failing the step before it is reported held."""

from dataclasses import dataclass, replace

import pytest
import torch
from e2e import StepDone, UpdateFailed, run_job, train_errors

from weightsync.engines import make_layout
from weightsync.errors import ConfigError
from weightsync.integrity import checksum, every, reference, to_ints
from weightsync.integrity.check import compare
from weightsync.integrity.sums import bucket_sums, sum_plan
from weightsync.layout.box import slices
from weightsync.layout.materialize import TORCH_DTYPES
from weightsync.local.events import Event, Ready
from weightsync.plan.planner import Planner
from weightsync.spec import load_spec


def ints(*sums):
    return to_ints(list(sums))


# -- the checksum ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn, torch.int64])
def test_checksum_matches_the_word_by_word_definition_whatever_the_strides(dtype):
    g = torch.Generator().manual_seed(1)
    for shape in [(), (7,), (3, 5), (4, 8), (4, 6, 12), (2, 3, 4, 8)]:
        t = (torch.randn(shape, generator=g) * 40).to(dtype)
        for base in (0, 12345, 2**62):
            assert ints(checksum(t, base)) == [reference(t, base)], (shape, base)
        if t.dim() >= 2:  # strided views: transposed, column slices (aligned or not), row slices, extra dims
            for v in (t.transpose(-1, -2), t[..., 1:], t[..., 4:], t[1:], t.unsqueeze(0)):
                assert ints(checksum(v, 3)) == [reference(v, 3)], (shape, v.stride())


def test_checksum_catches_a_flipped_bit_in_every_element_and_every_bit():
    t = torch.randn(6, 8).to(torch.bfloat16)
    clean = ints(checksum(t, 9))[0]
    for i in range(t.numel()):
        for bit in (0, 7, 15):
            bad = t.clone()
            bad.view(torch.int16).view(-1)[i] ^= (1 << bit) if bit < 15 else -(1 << 15)
            assert ints(checksum(bad, 9))[0] != clean, (i, bit)


def test_checksum_catches_swapped_and_shifted_pieces_and_is_equal_for_equal_bytes():
    t = torch.randn(8, 16).to(torch.bfloat16)
    clean = ints(checksum(t))[0]
    swapped = t.clone()
    swapped[[0, 5]] = t[[5, 0]]  # two rows exchanged
    shifted = torch.roll(t, 1, dims=1)  # every row shifted by one element
    halves = t.clone()
    halves[:, :8], halves[:, 8:] = t[:, 8:], t[:, :8]  # two column halves exchanged (within words too)
    for bad in (swapped, shifted, halves):
        assert ints(checksum(bad))[0] != clean
    # the same bytes in another layout (a contiguous copy of a transposed view) give the same number
    assert ints(checksum(t.t().contiguous().t()))[0] == clean


def test_integrity_option():
    assert every(1) == 1 and every(True) == 1 and every(None) == 0 and every(False) == 0 and every(50) == 50
    with pytest.raises(ConfigError, match="integrity must be"):
        every(-1)


# -- a real plan's bucket sums (one process) ------------------------------------------------------


@pytest.fixture(scope="module")
def moved():
    """A real plan (Megatron TP=2 -> vLLM TP=2, small buckets) moved by pack/unpack: the sources of
    training rank 0, and instance 0 rank 0's targets after every bucket of that pair landed."""
    return _moved(4096)


@pytest.fixture(scope="module")
def moved_whole():
    """The same with the default bucket size: the pair's whole share of the model in one bucket."""
    return _moved(256 << 20)


def _moved(bucket_bytes: int):
    from weightsync.testing import random_canonical
    from weightsync.layout.materialize import scatter
    from weightsync.payload.pack import pack, unpack

    spec = load_spec("tiny-qwen3")
    src, dst = make_layout(spec, "megatron:tp=2"), make_layout(spec, "vllm:tp=2")
    planner = Planner(src, dst, bucket_bytes=bucket_bytes)
    canonical = random_canonical(spec, seed=3)
    sources = scatter(src.layout(0), canonical)
    pair = (0, 0, 0)
    plans = {pair: planner.send_plan(0)[pair]}
    assert len(plans[pair]) > 3 or bucket_bytes > 4096
    targets = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype])
               for n, t in dst.layout(0).tensors.items()}
    for b in plans[pair]:
        unpack(b, pack(b, sources), targets)
    return plans, sources, targets


def _landed(plans, targets):
    plan = sum_plan(plans, targets, sending=False)
    return plan, bucket_sums(plan, targets)


def test_bucket_sums_agree_on_a_clean_transfer(moved):
    plans, sources, targets = moved
    sent = bucket_sums(sum_plan(plans, sources, sending=True), sources)
    plan, landed = _landed(plans, targets)
    assert sent == landed
    compare(5, "instance 0 rank 0", plan, sent, landed)  # no error


def _expect_caught(plans, sources, targets, bucket_index):
    sent = bucket_sums(sum_plan(plans, sources, sending=True), sources)
    plan, landed = _landed(plans, targets)
    from weightsync.errors import IntegrityError

    with pytest.raises(IntegrityError, match=rf"step 5: .* bucket {bucket_index} .*training rank 0 -> instance 0 rank 0"):
        compare(5, "instance 0 rank 0", plan, sent, landed)


def test_a_flipped_element_is_caught_and_its_bucket_named(moved):
    plans, sources, targets = moved
    bad = {n: t.clone() for n, t in targets.items()}
    b = plans[(0, 0, 0)][2]
    c = b.copies[-1]
    region = bad[c.dst_tensor][slices(c.dst_box)]
    region[(0,) * region.dim()].view(torch.int16).bitwise_xor_(1)
    _expect_caught(plans, sources, bad, b.index)


def test_a_skipped_piece_is_caught(moved):
    plans, sources, targets = moved
    stale = {n: t.clone() for n, t in targets.items()}
    b = plans[(0, 0, 0)][1]
    c = b.copies[0]
    # the piece was never written: it still holds the previous step's values
    stale[c.dst_tensor][slices(c.dst_box)] = torch.randn(stale[c.dst_tensor][slices(c.dst_box)].shape).to(torch.bfloat16)
    _expect_caught(plans, sources, stale, b.index)


def test_a_swapped_piece_is_caught(moved):
    plans, sources, targets = moved
    bad = {n: t.clone() for n, t in targets.items()}
    # two copies of the same shape landed in each other's place
    copies = [(b, c) for b in plans[(0, 0, 0)] for c in b.copies]
    (b1, c1), (b2, c2) = next(((x, y) for i, x in enumerate(copies) for y in copies[i + 1:]
                               if x[1].dst_box != y[1].dst_box and [n for _, n in x[1].dst_box] == [n for _, n in y[1].dst_box]
                               and x[1].dst_tensor != y[1].dst_tensor))
    r1, r2 = bad[c1.dst_tensor][slices(c1.dst_box)], bad[c2.dst_tensor][slices(c2.dst_box)]
    a = r1.clone()
    r1.copy_(r2)
    r2.copy_(a)
    _expect_caught(plans, sources, bad, min(b1.index, b2.index))


def test_sender_converts_to_the_destination_dtype_like_the_receiver():
    """fp32 master weights, bf16 engine: the sender's sums are of its regions rounded to bf16."""
    src = torch.randn(4, 8) * (1 + 3 / 512)
    dst = src.to(torch.bfloat16)
    assert ints(checksum(src.to(torch.bfloat16)))[0] == ints(checksum(dst))[0]


# -- real jobs (trainer and instance processes, gloo, MetaServer) ----------------------------------


def _failed(result):
    return [e for e in result.events if isinstance(e, UpdateFailed)]


@pytest.mark.parametrize("staged", [True], ids=["staged"])  # live: test_a_flipped_bit_names_the_exact_tensor...
def test_corrupted_landing_fails_the_step_and_no_version_is_reported(staged):
    job = dict(model="tiny-qwen3", train="megatron:tp=2", infer="vllm:tp=2", integrity=1, steps=2,
               bucket_bytes=4096, fault="infer-corrupts", staged=staged, timeout=20.0)
    result = run_job(job)
    (clean,) = result.of(StepDone)  # step 1 was checked too, and passed, bit-exact
    assert clean.step == 1 and clean.version == 1 and clean.problems == ()
    (failed,) = _failed(result)
    assert failed.step == 2 and failed.kind == "IntegrityError", failed
    # the finer exchange names the exact tensor, box and (one flipped bit) element: the harness flips bit 3
    # of the first element of worker 0's first planned destination box (tests/e2e.py _corrupt_in_worker)
    assert "instance 0 rank 0: step 2: model.embed_tokens.weight differs from what was sent" in failed.message
    assert "model.embed_tokens.weight [0:32, 0:64] (one flipped bit: element [0, 0], bit 3 of 16" in failed.message
    # the reader aborted the job, so the trainers waiting for step 2 held fail at once, with the reason
    trainers = train_errors(result)
    assert trainers and all(f.kind == "MetaAborted" and "differs from what was sent" in f.message
                            for f in trainers), trainers
    if staged:  # the copy was checked before it was committed: the live weights still hold step 1
        assert failed.version == 1 and failed.intact
    else:
        assert failed.version is None


def test_colocated_job_checks_what_the_workers_pushed_into_each_other():
    job = dict(model="tiny-qwen3", train="megatron:tp=2", infer="vllm:tp=2", colocate=True, integrity=1, steps=2,
               fault="infer-corrupts", timeout=20.0)
    result = run_job(job)
    (failed,) = _failed(result)
    assert failed.step == 2 and failed.kind == "IntegrityError", failed


def test_file_transport_checks_the_steps_of_the_cadence_only(tmp_path):
    """Over the (elastic) file transport, integrity=2: step 2 is checked and passes; step 3 is not
    checked, so a bit flipped in what lands goes unnoticed by integrity (the test's own check sees it)."""
    job = dict(model="tiny-qwen3", train="hf", infer="vllm:tp=2", transport="file", directory=str(tmp_path),
               integrity=2, steps=3, fault="infer-corrupts", timeout=20.0)
    result = run_job(job)
    assert not _failed(result) and not result.failures, result.failures
    done = {u.step: u for u in result.of(StepDone)}
    assert sorted(done) == [1, 2, 3] and not done[1].problems and not done[2].problems and done[3].problems


# -- the delta measurement's counting (weightsync.delta.measure) -----------------------------------


def test_delta_measure_counts_bf16_elements_whose_bits_change():
    from weightsync.delta.measure import changed, count_step, kind_of, wire

    w = (torch.randn(1000) * 0.02).to(torch.bfloat16).float()  # fp32 masters exactly on the bf16 grid
    moved = w.clone()
    moved[::10] *= 1.05  # 100 elements move by 5%: far more than a bf16 step (2**-8 relative)
    moved[1::10] *= 1 + 1e-4  # 100 more move by less than half a bf16 step: their bf16 bits stay
    assert changed(wire(w), wire(moved)) == 100
    assert [kind_of(n) for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_norm.weight",
                                 "model.layers.3.mlp.down_proj.weight", "model.embed_tokens.weight", "lm_head.weight",
                                 "model.norm.weight")] == ["attention", "norm", "mlp", "embedding", "embedding", "norm"]
    step = count_step(1, {"model.layers.0.mlp.up_proj.weight": wire(w), "model.norm.weight": wire(w)},
                      {"model.layers.0.mlp.up_proj.weight": wire(moved), "model.norm.weight": wire(w)})
    assert step.changed == {"attention": 0, "mlp": 100, "norm": 0, "embedding": 0} and step.total_changed == 100


def test_delta_measure_trains_a_real_model():
    from weightsync.delta.measure import summary, train

    still = train(0.0, steps=1, hidden=64, layers=1, vocab=256, batch=2, seq=16)
    assert still.steps[0].total_changed == 0
    moving = summary(train(1e-3, steps=2, hidden=64, layers=1, vocab=256, batch=2, seq=16))
    assert 0.5 < moving["mean"] <= 1.0 and set(moving["kinds"]) == {"attention", "mlp", "norm", "embedding"}


def test_participants_disagreeing_on_the_cadence_are_refused_at_set_up_on_both_sides():
    """The cadence is a session term (weightsync.meta.records.SessionTerms), agreed at set-up with the
    other options: the writer's and the reader's set-up (job_shape, from each side's own terms) both refuse
    a job whose participants registered different cadences, naming it; there is no later agreement
    (integrity.check.agree is gone). The same over real processes, both sides told at connect within
    seconds: tests/test_registration.py::test_an_integrity_cadence_mismatch_is_refused_at_set_up_and_both_
    sides_are_told."""
    import weightsync.integrity.check as check
    from weightsync.errors import JobMismatch
    from weightsync.meta.records import LayoutInfo, Registration, SessionTerms
    from weightsync.meta.view import sides_of
    from weightsync.runtime.job import job_shape

    def terms(n):
        return SessionTerms("p2p", "sync", False, 1 << 20, n, "full")

    def person(role, n):
        return Registration(role, 0, 0 if role == "infer" else None, layout=LayoutInfo("hf", 1), terms=terms(n))

    people = [person("train", 1), person("infer", 1000)]
    for mine in (terms(1), terms(1000)):  # the writer's set-up, the reader's
        with pytest.raises(JobMismatch,
                           match=r"integrity cadence .*1: training rank 0; 1000: inference rank 0 of instance 0"):
            job_shape(*sides_of(people), mine)
    agreed = [person("train", 1000), person("infer", 1000)]
    assert job_shape(*sides_of(agreed), terms(1000)).train == "hf"
    with pytest.raises(ConfigError, match="integrity: this participant 1, the job 1000"):
        job_shape(*sides_of(agreed), terms(1))  # a participant whose own terms differ from the job's it joins
    assert not hasattr(check, "agree")


def test_integrity_zero_makes_no_part_on_either_side():
    """integrity=0: neither side makes an integrity part (the session's SentCheck is None, so the writer's
    step 4 does nothing; a worker reader has no LandedCheck), and a worker planned without one refuses a
    verify rather than checking nothing."""
    from types import SimpleNamespace

    from weightsync.integrity.check import SentCheck
    from weightsync.runtime import worker
    from weightsync.runtime.instance import WorkerContext

    assert SentCheck.for_session(None, 0, {}, {}, None, None, 0, sync=True) is None
    ctx = WorkerContext(rank=0, device=torch.device("cpu"), tensors={})
    ctx.reader = worker.WorkerReader(instance=0, shape=None, plans={}, receiver=SimpleNamespace(), context=None)
    assert ctx.reader.check is None
    with pytest.raises(RuntimeError, match="planned with integrity=0"):
        worker.verify(ctx, 3)


# -- the exact copy: per-copy sums, one flipped bit located (one process) --------------------------


def test_one_flipped_bit_is_located_to_its_element_and_bit_in_every_dtype():
    from weightsync.integrity.locate import single_flip
    from weightsync.integrity.sums import Region

    g = torch.Generator().manual_seed(5)
    for dtype, ints_of in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32),
                           (torch.float8_e4m3fn, torch.int8)):
        full = (torch.randn(40, 96, generator=g) * 3).to(dtype)
        view = full[3:23, 8:72]  # a strided destination box [3:23, 8:72]
        region, bits = Region("t", ((3, 20), (8, 64)), None, 777), full.element_size() * 8
        clean = ints(checksum(view, 777))[0]
        located = 0
        for _ in range(60):
            i, j, bit = (int(torch.randint(n, (), generator=g)) for n in (20, 64, bits))
            bad = view.clone()
            bad[i, j].view(ints_of).bitwise_xor_((1 << bit) if bit < bits - 1 else -(1 << bit))
            flip = single_flip(ints(checksum(bad, 777))[0] - clean, region, (20, 64), full.element_size())
            if flip is not None:  # never a wrong place; None only where the word is ambiguous (high bits)
                assert (flip.index, flip.bit, flip.bits) == ((3 + i, 8 + j), bit, bits), (dtype, i, j, bit)
                located += 1
        assert located > 40, (dtype, located)
        two = view.clone()
        two[0, :5] = 0  # five elements: no single flip explains it
        assert single_flip(ints(checksum(two, 777))[0] - clean, region, (20, 64), full.element_size()) is None


def test_per_copy_sums_name_exactly_the_differing_copy(moved_whole):
    from weightsync.integrity.check import differing, mismatch_error
    from weightsync.integrity.locate import bad_copies
    from weightsync.integrity.sums import step_sums

    plans, sources, targets = moved_whole
    pair = (0, 0, 0)
    sent = step_sums(sum_plan(plans, sources, sending=True), sources)
    plan = sum_plan(plans, targets, sending=False)
    assert step_sums(plan, targets) == sent  # clean: every bucket's and every copy's sum agree
    # the bucket with the most copies; one element of a copy in its middle gets one flipped bit
    k, (b, _) = max(enumerate(plan.buckets[pair]), key=lambda kb: len(kb[1][0].copies))
    assert len({x.dst_tensor for x in b.copies}) > 10
    c = b.copies[len(b.copies) // 2]
    bad = {n: t.clone() for n, t in targets.items()}
    region = bad[c.dst_tensor][slices(c.dst_box)]
    at = tuple(n // 2 for n in region.shape)
    region[at].view(torch.int16).bitwise_xor_(1 << 5)
    landed = step_sums(plan, bad)
    assert differing(5, "w", plan, sent.buckets, landed.buckets) == [(pair, k)]
    flat = {pair: tuple(v for bs in sent.copies[pair] for v in bs)}
    (found,) = bad_copies(plan, [(pair, k)], flat, landed.copies, bad)
    assert found.copy == c and found.flip.bit == 5
    assert found.flip.index == tuple(o + i for (o, _), i in zip(c.dst_box, at))
    error = mismatch_error(5, "instance 0 rank 0", plan, [(pair, k)], [found])
    assert f"step 5: {c.dst_tensor} differs from what was sent" in str(error) and error.tensors == (c.dst_tensor,)
    others = {x.dst_tensor for x in b.copies} - {c.dst_tensor}
    assert others and not any(f"{o} [" in str(error) for o in others)
    # two elements: the copy is still named, the flip is not claimed
    region.view(-1)[0].view(torch.int16).bitwise_xor_(1)
    (found,) = bad_copies(plan, [(pair, k)], flat, step_sums(plan, bad).copies, bad)
    assert found.copy == c and found.flip is None


# -- real jobs where one copy of a many-copy bucket is corrupted; async pulls ------------------------


@dataclass(frozen=True)
class Flipped(Event):
    """A worker flipped ``bit`` of element ``index`` of ``tensor`` after the transport landed it."""

    rank: int
    tensor: str
    index: tuple[int, ...]
    bit: int
    tensors_in_bucket: tuple[str, ...]


@dataclass(frozen=True)
class Outcome(Event):
    """A reader's update or pull: the version it reports after, what the MetaServer says it holds,
    its error (kind and message, '' when it succeeded) and whether its tensors hold exactly ``step``."""

    step: int | None
    version: int | None
    held: int | None
    error_kind: str
    message: str
    exact: bool
    withheld: str = ""  # why the reader told the instance to serve nothing (a failed non-staged update/pull)


def _flip_next_landing(ctx, rank: int, bit: int) -> Flipped | None:
    """Worker ``rank``'s next receive (sync) or pull (async) flips ``bit`` of the middle element of the
    middle copy of its bucket with the most copies, after the transport returned."""
    from weightsync.layout.box import slices

    if ctx.rank != rank:
        return None
    receiver = ctx.reader.receiver
    bucket = max((b for bs in ctx.reader.plans.values() for b in bs), key=lambda b: len(b.copies))
    copy = bucket.copies[len(bucket.copies) // 2]
    at = tuple(n // 2 for _, n in copy.dst_box)

    def flip(targets):
        region = targets[copy.dst_tensor][slices(copy.dst_box)]
        region[at].view(torch.int16).bitwise_xor_(1 << bit)

    real_receive, real_pull = receiver.receive, receiver.pull

    def receive(step, targets):
        stats = real_receive(step, targets)
        flip(targets)
        receiver.receive, receiver.pull = real_receive, real_pull
        return stats

    def pull(targets):
        got = real_pull(targets)
        flip(targets)
        receiver.receive, receiver.pull = real_receive, real_pull
        return got

    receiver.receive, receiver.pull = receive, pull
    return Flipped(None, rank, copy.dst_tensor, tuple(o + i for (o, _), i in zip(copy.dst_box, at)), bit,
                   tuple(sorted({c.dst_tensor for c in bucket.copies})))


def _job_trainer(emit, meta: str, port: int, job: dict) -> None:
    import datetime

    import torch.distributed as dist
    from e2e import step_canonical

    from weightsync.layout.materialize import fill_from
    from weightsync.local.trainers import build_trainer
    from weightsync.runtime.writer import WeightWriter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    spec = load_spec(job["model"])
    bound = build_trainer(spec, job["train"], 0, 1, same_start=False).bound
    writer = WeightWriter(bound, meta=meta, job=job["job"], timeout_s=job["timeout"], mode=job["mode"],
                          integrity=1).connect()
    emit(Ready(emit.participant))
    for step in (1, 2):
        with torch.no_grad():
            fill_from(bound.layout, bound.tensors, step_canonical(spec, step))
        writer.write(step)
        if job["mode"] == "async":  # the reader pulls each step before the next is staged
            writer.client.wait_held(step, [0], timeout=job["timeout"])
    writer.close()


def _job_reader(emit, meta: str, job: dict) -> None:
    from e2e import check_step

    from weightsync.local.instances import build_instance
    from weightsync.runtime.reader import WeightReader

    torch.set_num_threads(1)
    spec = load_spec(job["model"])
    local = build_instance(spec, job["infer"], device="cpu", seed=1)
    instance = local.instance
    withheld: list[str] = []
    instance.withhold = withheld.append  # what the reader tells the instance (serve nothing until set_version)
    try:
        r = WeightReader(instance, meta=meta, job=job["job"], instance_id=0, instances=1, timeout_s=job["timeout"],
                         mode=job["mode"], staged=job["staged"], integrity=1).connect()
        emit(Ready(emit.participant))

        def once(step: int, corrupt: bool) -> None:
            if corrupt:
                for f in instance.call(_flip_next_landing, 1, 5):
                    if f is not None:
                        emit(replace(f, participant=emit.participant))
            kind = message = ""
            withheld.clear()
            try:
                if job["mode"] == "async":
                    r.client.wait_written(step, timeout=job["timeout"])
                    r.pull()
                else:
                    r.update(step)
            except Exception as e:  # noqa: BLE001 - reported to the test
                kind, message = type(e).__name__, str(e)
            if not kind:  # the report goes out off the critical path: wait for it
                r.client.wait_held(r.version, [0], timeout=job["timeout"])
            held = r.client.members()[0].held
            exact = r.version is not None and not any(instance.call(check_step, spec.name, job["infer"], r.version))
            emit(Outcome(emit.participant, step, r.version, held, kind, message, exact, "; ".join(withheld)))

        once(1, False)
        once(2, True)
        if job["mode"] == "async":
            once(2, False)  # the next pull of the same snapshot is clean, checked, and reported
        r.close()
    finally:
        local.close()


def _run_corrupting_job(mode: str, staged: bool):
    from weightsync.local.events import Participant
    from weightsync.local.runner import LocalJob
    from weightsync.transport.group import free_port

    job = dict(job=f"exact-{mode}", model="tiny-qwen3", train="hf", infer="vllm:tp=2", mode=mode, staged=staged,
               timeout=20.0)
    with LocalJob(deadline_s=90, stop_on_failure=False, exit_grace_s=5.0) as local:
        local.add(Participant.trainer(0), _job_trainer, local.meta_url, free_port(), job)
        local.add(Participant.instance(0), _job_reader, local.meta_url, job)
        return local.run()


def test_a_flipped_bit_names_the_exact_tensor_element_and_bit():
    """Sync, live: worker 1 flips one bit of one copy in its bucket holding most copies (the whole
    tiny model: one bucket); the check names that tensor, the element and the bit, no other tensor of
    the bucket; the trainer, waiting for `held`, fails with the same reason."""
    result = _run_corrupting_job("sync", staged=False)
    (flipped,) = result.of(Flipped)
    first, second = result.of(Outcome)
    assert first.error_kind == "" and first.version == 1 and first.exact
    assert second.error_kind == "IntegrityError" and second.version is None and second.held == 1, second
    assert f"instance 0 rank 1: step 2: {flipped.tensor} differs from what was sent" in second.message
    assert (f"{flipped.tensor} [" in second.message and f"one flipped bit: element {list(flipped.index)}, bit 5 "
            "of 16" in second.message), second.message
    others = set(flipped.tensors_in_bucket) - {flipped.tensor}
    assert len(others) > 3 and not any(f"{o} [" in second.message for o in others), second.message
    assert "retry the step" in second.message
    (trainer,) = train_errors(result)
    assert trainer.kind == "MetaAborted" and flipped.tensor in trainer.message


def test_async_pulls_are_checked_and_a_corrupted_pull_is_not_reported_held():
    """Async, staged, integrity=1: a clean pull is checked against the sums posted with the staged
    snapshot and reported; a pull whose landing got one flipped bit fails naming the tensor, is not
    committed, and the reader (and the MetaServer) still report the previous step; pulling again is
    clean and reported."""
    result = _run_corrupting_job("async", staged=True)
    assert not result.failures, "\n".join(f"{f.line()}\n{f.traceback}" for f in result.failures)
    (flipped,) = result.of(Flipped)
    clean, corrupted, again = result.of(Outcome)
    assert clean.error_kind == "" and clean.version == 1 and clean.held == 1 and clean.exact, clean
    assert corrupted.error_kind == "IntegrityError", corrupted
    assert f"step 2: {flipped.tensor} differs from what was sent" in corrupted.message, corrupted.message
    assert f"element {list(flipped.index)}, bit 5" in corrupted.message
    assert corrupted.version == 1 and corrupted.held == 1 and corrupted.exact  # step 1 intact, still reported
    assert again.error_kind == "" and again.version == 2 and again.held == 2 and again.exact, again
    assert not (clean.withheld or corrupted.withheld or again.withheld)  # staged: the live weights stay whole


def test_a_corrupted_live_pull_withholds_the_instance_until_a_good_pull():
    """Async, not staged, integrity=1: a pull whose landing got one flipped bit fails naming the tensor and
    leaves ``version`` None -- and the instance is told to serve nothing (``withhold``), as a failed
    non-staged ``update`` does, since its live weights are not the step; the next clean pull is checked,
    reported and served again (``set_version``). Before, a failed pull withheld nothing: the engine went
    on serving the corrupted weights."""
    result = _run_corrupting_job("async", staged=False)
    assert not result.failures, "\n".join(f"{f.line()}\n{f.traceback}" for f in result.failures)
    (flipped,) = result.of(Flipped)
    clean, corrupted, again = result.of(Outcome)
    assert clean.error_kind == "" and clean.version == 1 and clean.exact and not clean.withheld, clean
    assert corrupted.error_kind == "IntegrityError" and corrupted.version is None, corrupted
    assert f"step 2: {flipped.tensor} differs from what was sent" in corrupted.message, corrupted.message
    assert "instance 0: a pull failed" in corrupted.withheld, corrupted
    assert again.error_kind == "" and again.version == 2 and again.held == 2 and again.exact, again
    assert not again.withheld


def test_the_exchange_moves_on_and_the_answerer_answers_only_its_armed_step():
    """On a real MetaServer: sums longer than one value round-trip; an async pull's fetch of an older
    step answers None (the snapshot moved on, pull again) where a sync check fails; an armed answerer
    posts its copy sums of that step when asked, and of no other step."""
    from weightsync.errors import IntegrityError
    from weightsync.integrity import exchange
    from weightsync.integrity.answer import Answerer
    from weightsync.meta.client import MetaClient
    from weightsync.meta.server import MetaServer

    sums = {(0, 0, r): tuple((2**64 - 1 - 7919 * k * (r + 1)) for k in range(40)) for r in range(3)}
    with MetaServer().start() as server:
        client = MetaClient(server.url, "x", timeout=5.0)
        assert exchange.publish(client, 0, 4, sums) > 1
        assert exchange.fetch(client, [0], 4, 2.0) == sums
        assert exchange.fetch(client, [0], 3, 2.0, stale_ok=True) is None
        with pytest.raises(IntegrityError, match="posted the checksums of step 4 while this worker checks step 3"):
            exchange.fetch(client, [0], 3, 2.0)
        with pytest.raises(IntegrityError, match=r"training ranks \[0\] did not post the checksums of step 5"):
            exchange.fetch(client, [0], 5, 0.2)
        answerer = Answerer(MetaClient(server.url, "x", timeout=5.0), 0)
        try:
            answerer.arm(4, sums)
            exchange.ask(client, 0, 4, "instance 0 rank 1")
            exchange.ask(client, 0, 4, "instance 0 rank 2")  # a second asker: the same answer serves it
            assert exchange.fetch(client, [0], 4, 5.0, kind=exchange.COPIES) == sums
            exchange.ask(client, 0, 5, "instance 0 rank 1")  # not the armed step: no answer
            with pytest.raises(IntegrityError, match="did not post"):
                exchange.fetch(client, [0], 5, 1.5, kind=exchange.COPIES)
        finally:
            answerer.close()


def test_nixl_async_pulls_are_checked_against_the_staged_step_while_training_moves_on():
    """Async over nixl with delta (real NIXL agents on loopback, a real MetaServer, the elastic session,
    worker threads), integrity=1, a live and a staged reader. The trainer's sums are of what write()
    staged -- taken from its live weights inside the same call -- so pulls made after training moved the
    live weights on are checked clean and hold the staged step bit for bit; a bit flipped in a worker's
    landing fails that pull naming the tensor (staged: the previous step kept and served; live: no
    version, the instance withheld); the next pull of the same snapshot heals and is checked clean."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    from helpers import nixl_missing
    from test_elastic import ThreadInstance, TrainRank, canonical, exact

    from weightsync.errors import IntegrityError
    from weightsync.layout.materialize import fill_from, scatter
    from weightsync.meta.server import MetaServer
    from weightsync.runtime.reader import WeightReader
    from weightsync.runtime.writer import WeightWriter

    missing = nixl_missing()
    if missing is not None:
        pytest.skip(f"nixl not importable: {missing}")
    spec = load_spec("tiny-qwen3")
    engine = make_layout(spec, "hf")
    ranks = [TrainRank(engine, r, engine.layout(r), scatter(engine.layout(r), canonical(spec, 0)), spec)
             for r in range(engine.world_size)]
    instances = [ThreadInstance(spec, "vllm:tp=2") for _ in range(2)]
    withheld = {0: [], 1: []}
    for i, inst in enumerate(instances):
        inst.withhold = withheld[i].append
    with MetaServer().start() as server:
        kw = dict(meta=server.url, job="nixl-async-integrity", transport="nixl", mode="async", delta=True,
                  integrity=1, bucket_bytes=32 << 10, timeout_s=20.0)
        writers = [WeightWriter(r, **kw) for r in ranks]
        readers = [WeightReader(inst, instance_id=i, instances=2, staged=i == 1, **kw)
                   for i, inst in enumerate(instances)]
        with ThreadPoolExecutor(4) as pool:
            for f in [pool.submit(x.connect) for x in [*readers, *writers]]:
                f.result(timeout=120)
        try:
            for step in (1, 2):
                for r, w in zip(ranks, writers):
                    with torch.no_grad():
                        fill_from(r.layout, r.tensors, canonical(spec, step))
                    assert w.write(step) is None and w.last_integrity.step == step
                    with torch.no_grad():  # training goes on: the live weights leave the staged step
                        fill_from(r.layout, r.tensors, canonical(spec, 100 + step))
                if step == 2:  # worker 1 of each instance flips bit 5 of one element after its pull landed
                    flips = [next(f for f in inst.call(_flip_next_landing, 1, 5) if f is not None)
                             for inst in instances]
                    for i, (r, flipped) in enumerate(zip(readers, flips)):
                        want = re.escape(f"step 2: {flipped.tensor} differs from what was sent") + ".*" + \
                            re.escape(f"element {list(flipped.index)}, bit 5")
                        with pytest.raises(IntegrityError, match=want):
                            r.pull()
                    assert readers[0].version is None and withheld[0]  # live: torn, served no more
                    assert readers[1].version == 1 and exact(spec, instances[1], 1) and not withheld[1]
                for i, r in enumerate(readers):
                    assert r.pull() == step and exact(spec, instances[i], step), (i, step)
                    assert r.last_timing is not None
        finally:
            for x in [*readers, *writers]:
                x.close()
