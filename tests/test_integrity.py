"""Per-step integrity (weightsync.integrity): the checksum, a plan's bucket sums, and real jobs whose
landed bytes are corrupted failing the step before it is reported held."""

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
    from weightsync.testing import random_canonical
    from weightsync.layout.materialize import scatter
    from weightsync.transport.pack import pack, unpack

    spec = load_spec("tiny-qwen3")
    src, dst = make_layout(spec, "megatron:tp=2"), make_layout(spec, "vllm:tp=2")
    planner = Planner(src, dst, bucket_bytes=4096)
    canonical = random_canonical(spec, seed=3)
    sources = scatter(src.layout(0), canonical)
    pair = (0, 0, 0)
    plans = {pair: planner.send_plan(0)[pair]}
    assert len(plans[pair]) > 3
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


@pytest.mark.parametrize("staged", [False, True], ids=["live", "staged"])
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


def test_participants_disagreeing_on_the_cadence_are_refused():
    from weightsync.errors import JobMismatch
    from weightsync.integrity.check import agree

    people = [{"role": "train", "rank": 0, "engine_config": {"integrity": 1}},
              {"role": "infer", "rank": 0, "instance": 0, "engine_config": {"integrity": 1000}}]

    class Client:
        reason = None

        def abort(self, reason):
            Client.reason = reason

    with pytest.raises(JobMismatch, match="integrity cadence"):
        agree(people, 1, Client())
    assert "integrity cadence" in Client.reason  # the job was aborted, so the peers stop at once
    agree(people[:1], 1)  # agreeing participants pass
