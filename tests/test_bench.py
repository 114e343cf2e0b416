"""The bench: its data (any rank regenerates any region, each step's bits differ), its floor inputs, and
every scenario rehearsed end to end on CPU."""

import pytest
import torch

from weightsync.bench.run import SCENARIOS, advance, check, init_weights, moved_per_gpu
from weightsync.engines import make_layout
from weightsync.layout.materialize import TORCH_DTYPES
from weightsync.runtime.instance import WorkerContext
from weightsync.spec import load_spec


def test_doubling_steps_are_checked_exactly():
    spec = load_spec("tiny-qwen3-moe")
    engine = make_layout(spec, "vllm:tp=2,ep=2")
    layout = engine.layout(1)
    tensors = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype]) for n, t in layout.tensors.items()}
    init_weights(layout, tensors, spec)
    for _ in range(3):
        advance(tensors)
    ctx = WorkerContext(rank=1, device=torch.device("cpu"), tensors=tensors)
    assert check(ctx, spec.name, "vllm:tp=2,ep=2", 3)
    assert not check(ctx, spec.name, "vllm:tp=2,ep=2", 2)  # a stale step never passes


class _Relay:
    """A kernel that re-lays FP8 after loading, as DeepGEMM's UE8M0 requantization does: not idempotent (each run
    flips the weight's low bit and doubles the scales), so a check that ran it twice, or never, would fail."""

    def process_weights_after_loading(self, module) -> None:
        module.w.view(torch.uint8).bitwise_xor_(1)
        module.s.mul_(2)


class _RelayStep:
    """The shape of ``weightsync.vllm.live._Requant`` that ``check_fp8`` reads: ``kernel``, ``live``, ``run()``."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, kernel=None):
        self.kernel, self.live = kernel or _Relay(), {"w": weight, "s": scale}
        self.module = type("Layer", (), {"w": weight, "s": scale})()

    def run(self) -> None:
        self.kernel.process_weights_after_loading(self.module)


class _Copy:
    def process_weights_after_loading(self, module) -> None:
        pass


def test_fp8_check_runs_a_relaying_kernel_on_the_reference_and_names_what_differs():
    """``check_fp8`` on a worker whose kernel re-lays FP8 after loading: for that layer the reference checkpoint form
    goes through the kernel's own step once and must equal what the synced step left; everywhere else the
    checkpoint form; every tensor that differs is named."""
    from weightsync.bench.run import check_fp8
    from weightsync.quant.layout import fp8_layout

    model, engine = "tiny-qwen3-fp8", "vllm:tp=1,quant=fp8"
    layout = fp8_layout(make_layout(load_spec(model), engine))
    tensors = {n: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype]) for n, t in layout.layout(0).tensors.items()}
    for t in tensors.values():
        t.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(5))  # poisoned
    live = type("Live", (), {})()
    ctx = WorkerContext(0, torch.device("cpu"), tensors, state={"live": live})
    # every layer "re-laid" by a kernel that keeps the form: the check writes the reference form into each
    live.transforms = [_RelayStep(t, t, _Copy()) for t in tensors.values()]
    assert len(check_fp8(ctx, model, engine, 3)) == len(tensors)  # the poison, named
    assert check_fp8(ctx, model, engine, 3) == []
    weight = next(w for w in layout.fp8 if w in tensors)
    scale = layout.fp8[weight].scale.name
    step = _RelayStep(tensors[weight], tensors[scale])
    step.run()  # what a synced step leaves on that layer: the reference form, re-laid once
    live.transforms = [step]  # every other tensor: compared in the checkpoint form
    assert check_fp8(ctx, model, engine, 3) == []
    other = next(n for n in sorted(tensors) if n not in (weight, scale))
    tensors[other].view(torch.uint8).view(-1)[0] ^= 1
    tensors[weight].view(torch.uint8).view(-1)[0] ^= 2
    assert sorted(check_fp8(ctx, model, engine, 3)) == sorted([other, f"{weight} (after _Relay's post-load step)"])
    stale = check_fp8(ctx, model, engine, 4)  # a stale step: every scale and bf16 tensor differs (e4m3 keeps)
    assert {n.split(" ")[0] for n in stale} == {n for n, t in tensors.items() if t.dtype != torch.float8_e4m3fn}


def test_floor_inputs_split_local_and_remote_bytes():
    spec = load_spec("qwen3-8b")
    s = SCENARIOS["colo-pp2-tp2"]
    per = moved_per_gpu(make_layout(spec, s.train), make_layout(spec, s.infer), s)
    assert set(per) == {0, 1}
    assert all(local > 0 and remote > 0 for local, remote in per.values())
    s = SCENARIOS["sep-1to1"]
    assert moved_per_gpu(make_layout(spec, s.train), make_layout(spec, s.infer), s) == {1: (0, spec.nbytes)}


def test_fp8_floor_counts_the_quantizer_and_over_nixl_the_readers_copy():
    """``--quant fp8``'s floor input: co-located, each FP8 weight's quantizer traffic ((read + written) / 2) and the
    rest's bytes; nixl-1gpu the same plus the reader's copy of every e4m3 byte and fp32 scale the trainer wrote
    (each FP8 canonical weight once at TP=1). A scenario the fp8 bench does not run is refused before any process."""
    from weightsync.bench.run import fp8_copy_bytes, run
    from weightsync.errors import ConfigError
    from weightsync.quant.layout import fp8_layout

    spec = load_spec("qwen3-8b")
    got = {}
    for name in ("colo-1gpu", "nixl-1gpu"):
        s = SCENARIOS[name]
        got[name] = fp8_copy_bytes(make_layout(spec, s.train), make_layout(spec, f"{s.infer},quant=fp8"), s)
    held = fp8_layout(make_layout(spec, "vllm:tp=1,quant=fp8"))
    written = sum(f.weight.numel + 4 * f.scale.numel for f in held.fp8.values())
    assert 0.7 * spec.nbytes < got["colo-1gpu"] < 0.8 * spec.nbytes  # bf16 read, about half of it written
    assert got["nixl-1gpu"] - got["colo-1gpu"] == written
    with pytest.raises(ConfigError, match=r"--quant fp8 runs one-GPU scenarios .*colo-1gpu, nixl-1gpu"):
        run("sep-1to1", "tiny-qwen3-fp8", steps=1, baselines=(), device="cpu", quant="fp8")


def test_fp8_over_nixl_writers_get_their_frames_region_within_the_budget():
    """nixl-1gpu --quant fp8: the trainer keeps every distinct bucket's FP8 frame registered (qwen3-8b: ~9.4 GB, over
    the 2 GiB default budget); the bench grants it on top (writer_budget), and what NixlSender.memory asks for at
    set-up fits; bf16 and co-located FP8 writers keep the default. Over the default, the refusal says to raise the
    budget (smaller buckets would not shrink the frames)."""
    from dataclasses import replace

    from weightsync.bench.run import writer_budget
    from weightsync.codec.fp8 import fp8_options
    from weightsync.plan.job import block_aligned
    from weightsync.plan.planner import Planner
    from weightsync.errors import ConfigError
    from weightsync.runtime.job import DEFAULT_MEMORY_BUDGET, enforce_memory_budget
    from weightsync.transport.base import SenderContext, TransportOptions
    from weightsync.transport.nixl import NixlSender

    spec = load_spec("qwen3-8b")
    s = SCENARIOS["nixl-1gpu"]
    fp8 = replace(s, infer=f"{s.infer},quant=fp8")
    src, dst = make_layout(spec, s.train), make_layout(spec, fp8.infer)
    held = src.layout(0).bytes_held(spec)
    assert writer_budget(s, held) == writer_budget(replace(SCENARIOS["colo-1gpu"], infer=fp8.infer), held) \
        == DEFAULT_MEMORY_BUDGET
    planner = Planner(src, dst, 1, block_aligned=block_aligned(spec, dst))
    tensors = {n: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device="meta")
               for n, t in src.layout(0).tensors.items()}
    ctx = SenderContext(None, None, None, 0, planner, planner.send_plan(0), tensors)
    buffers = NixlSender(fp8_options(TransportOptions("nixl"), fp8.infer, spec)).memory(ctx)
    need = buffers.bytes
    assert DEFAULT_MEMORY_BUDGET < need <= writer_budget(fp8, held), (need, writer_budget(fp8, held))
    aborted = []  # the job's abort (a MetaClient's), recorded
    client = type("Client", (), {"abort": lambda self, why: aborted.append(why)})()
    assert enforce_memory_budget(client, writer_budget(fp8, held), buffers, "training rank 0") == need
    with pytest.raises(ConfigError, match=rf"over nixl a framed codec's frames of every bucket stay registered.*"
                                          rf"raise memory_budget \(at least {need}\)"):  # not 'smaller buckets'
        enforce_memory_budget(client, DEFAULT_MEMORY_BUDGET, buffers, "training rank 0")
    assert len(aborted) == 1


def test_results_record_where_they_were_measured():
    from weightsync.bench.run import environment

    env = environment()
    assert {"date", "gpus", "torch", "nccl", "weightsync", "commit"} <= env.keys()
    assert env["torch"] == torch.__version__


def test_every_scenario_plans_and_places_on_its_gpus():
    # the 4-GPU scenarios have not run on a GPU yet: at least their plans, GPU placement and the
    # co-located baselines' hand-over are checked here
    from weightsync.bench.baselines import colocated_buckets, needs_training_group

    spec = load_spec("qwen3-8b")
    for name, s in SCENARIOS.items():
        train, infer = make_layout(spec, s.train), make_layout(spec, s.infer)
        per = moved_per_gpu(train, infer, s)
        assert set(per) <= set(range(s.gpus)), (name, per)
        # every instance receives the whole model once, from its own GPU or from the others
        assert sum(local + remote for local, remote in per.values()) >= s.instances * spec.nbytes, name
        if not s.colocate:
            continue
        # every canonical tensor handed over exactly once; TP-split ones gathered over the trainers first
        buckets = colocated_buckets("bucketed", train)
        assert sorted(t.name for bs in buckets.values() for b in bs for t in b) == sorted(spec.by_name), name
        assert needs_training_group(train) == (train.config.get("tp", 1) > 1), name


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "nixl-1gpu"])  # nixl-1gpu: with --delta below
def test_every_scenario_rehearses_on_cpu(scenario, monkeypatch):
    """``weightsync bench --device cpu``: the scenario's real processes -- MetaServer, writers, readers driving
    layout-faithful workers, the baselines' groups (gloo) and hand-overs (shared memory) -- with a small MoE
    model, every step and every baseline checked bit for bit. The 4-GPU scenarios have not run on GPUs: this
    is their wiring, tested before a GPU host is spent on it. The MetaServer runs with an admin token and every
    participant is handed the bench job's token only (issue 25's model): writers, readers and the co-located
    baselines' hand-over lookups would be refused without it."""
    from weightsync.bench.run import run
    from helpers import assert_job_tokens_only, record_local_job_tokens

    tokens, handed = record_local_job_tokens(monkeypatch)
    r = run(scenario, "tiny-qwen3-moe", steps=2, timeout=60.0, baselines=("naive", "bucketed"), device="cpu")
    assert not r["errors"], r["errors"]
    assert_job_tokens_only(tokens, handed, lambda p: ["bench"])
    assert r["verified"] and len(r["step_seconds"]) == 2
    assert r["floor_seconds"] is None and r["efficiency"] is None  # no ceilings on CPU
    assert r["peer_copies"] is (True if r["colocate"] else None)  # shared memory: every worker reaches every trainer
    # co-located over several GPUs, the workers write the pieces of their own GPU's trainers into each other
    assert r["pushed_bytes"] is None if not r["colocate"] else (r["pushed_bytes"] > 0) == (scenario != "colo-1gpu")
    if r["transport"] != "p2p":  # the baselines run over p2p's NCCL/gloo group (nixl-1gpu has none)
        assert r["baselines"] == {}
        return
    for kind in ("naive", "bucketed"):
        assert r["baselines"][kind]["ran"] and r["baselines"][kind]["verified"], (kind, r["baselines"][kind])


def test_colocated_bench_without_peer_copies_goes_through_the_group():
    """``--no-peer-copies``: the other GPU's pieces cross the workers' group (gloo here), still bit-exact, and
    the result says so."""
    from weightsync.bench.run import run

    r = run("colo-pp2-tp2", "tiny-qwen3-moe", steps=2, timeout=60.0, baselines=(), device="cpu", peer_copies=False)
    assert not r["errors"], r["errors"]
    assert r["verified"] and r["peer_copies"] is False and r["pushed_bytes"] == 0


# -- --delta ----------------------------------------------------------------------------------------


def test_delta_changes_exactly_the_fraction_alike_on_any_box():
    """Each step flips exactly round(numel * F) elements, and a piece holding a box of the tensor flips
    the same ones the whole tensor does: trainer shards and the readers' replay agree."""
    from weightsync.bench.delta import changed_count, toggle

    g = torch.Generator().manual_seed(3)
    shape = (37, 53)
    base = torch.randn(shape, generator=g).to(torch.bfloat16)
    for frac, step in ((0.001, 1), (0.01, 2), (0.1, 3), (1.0, 4)):
        whole = base.clone()
        assert toggle(whole, "w", shape, ((0, 37), (0, 53)), frac, step) == changed_count(37 * 53, frac)
        differ = whole.view(torch.int16) != base.view(torch.int16)
        assert int(differ.sum()) == changed_count(37 * 53, frac) == round(37 * 53 * frac)
        assert torch.isfinite(whole.float()).all()
        box = ((5, 20), (11, 30))
        part = base[5:25, 11:41].clone()
        toggle(part, "w", shape, box, frac, step)
        assert torch.equal(part.view(torch.int16), whole[5:25, 11:41].view(torch.int16))
        if frac < 1:
            other = base.clone()
            toggle(other, "w", shape, ((0, 37), (0, 53)), frac, step + 1)  # another step: other positions
            assert not torch.equal(other.view(torch.int16), whole.view(torch.int16))


def test_delta_steps_are_checked_exactly():
    from weightsync.bench.delta import apply_step, check_changed

    spec = load_spec("tiny-qwen3-moe")
    train, infer = make_layout(spec, "fsdp:dp=2"), make_layout(spec, "vllm:tp=2,ep=2")
    schedule = (0.0, 0.01, 0.1, 0.1)
    # what the trainers hold after the schedule, gathered as canonical tensors, scattered into rank 1's layout
    canonical = {}
    for r in range(train.world_size):
        layout = train.layout(r)
        tensors = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype]) for n, t in layout.tensors.items()}
        init_weights(layout, tensors, spec)
        for step, frac in enumerate(schedule):
            if frac:
                apply_step(layout, tensors, spec, frac, step)
        from weightsync.layout.materialize import local_view

        for name, t in layout.tensors.items():
            for p in t.pieces:
                c = spec.by_name[p.canonical]
                full = canonical.setdefault(c.name, torch.full(c.shape, float("nan"), dtype=TORCH_DTYPES[c.dtype]))
                full[tuple(slice(o, o + n) for o, n in p.canon_box)] = local_view(tensors[name], p)
    from weightsync.layout.materialize import scatter

    ctx = WorkerContext(rank=1, device=torch.device("cpu"), tensors=scatter(infer.layout(1), canonical))
    assert check_changed(ctx, spec.name, "vllm:tp=2,ep=2", schedule)
    assert not check_changed(ctx, spec.name, "vllm:tp=2,ep=2", schedule[:-1])  # a missed step never passes
    assert not check_changed(ctx, spec.name, "vllm:tp=2,ep=2", (0.0, 0.01, 0.01, 0.1))


def test_delta_options_parse_and_refuse_what_cannot_run():
    import argparse

    from weightsync.bench.delta import DEFAULT_FRACTIONS, DeltaOptions
    from weightsync.bench.run import add_arguments, delta_options, run
    from weightsync.errors import ConfigError

    p = argparse.ArgumentParser()
    add_arguments(p)
    parse = lambda *a: delta_options(p.parse_args(["--scenario", "nixl-1gpu", *a]))
    assert parse() is None
    assert parse("--delta") == DeltaOptions(DEFAULT_FRACTIONS, 5, ("device",)) and DEFAULT_FRACTIONS == (0.001, 0.01, 0.1)
    got = parse("--delta", "--change-fraction", "0.01,0.1", "--change-fraction", "0.3", "--steps", "4",
                "--delta-previous", "both")
    assert got == DeltaOptions((0.01, 0.1, 0.3), 4, ("device", "host"))
    with pytest.raises(ConfigError, match="go with --delta"):
        parse("--change-fraction", "0.01")
    with pytest.raises(ConfigError, match="takes numbers"):
        parse("--delta", "--change-fraction", "1%")
    # refused before any process starts
    with pytest.raises(ConfigError, match="co-located"):
        run("colo-1gpu", "tiny-qwen3-moe", steps=1, baselines=(), device="cpu", delta=DeltaOptions())
    with pytest.raises(ConfigError, match=r"in \(0, 1\]"):
        run("nixl-1gpu", "tiny-qwen3-moe", steps=1, baselines=(), device="cpu", delta=DeltaOptions((0.0, 0.1)))
    with pytest.raises(ConfigError, match="device and/or host"):
        run("nixl-1gpu", "tiny-qwen3-moe", steps=1, baselines=(), device="cpu", delta=DeltaOptions(previous=("gpu",)))


def test_nixl_bench_with_delta_rehearses_on_cpu(monkeypatch):
    """``weightsync bench --scenario nixl-1gpu --delta --device cpu``: the full steps as every scenario's
    rehearsal, then a delta job with the previous version on the device and one in host memory
    (``delta_host=True``), real NIXL agents (UCX over shared memory): every delta step reads only the
    changes (no worker falls back), the bytes are the encodings' (indices at 1%, bitmap at 10%), and the
    readers hold every step's changes bit for bit at the end."""
    from weightsync.bench.delta import DeltaOptions
    from weightsync.bench.run import run
    from weightsync.meta.auth import job_token
    from helpers import assert_job_tokens_only, nixl_missing, record_local_job_tokens

    if nixl_missing():
        pytest.skip(nixl_missing())
    tokens, handed = record_local_job_tokens(monkeypatch)
    r = run("nixl-1gpu", "tiny-qwen3-moe", steps=1, timeout=60.0, baselines=(), device="cpu",
            delta=DeltaOptions((0.01, 0.1), 1, ("device", "host")))
    assert not r["errors"], r["errors"]
    assert len(tokens) == 3  # the full run's MetaServer, then each delta run's: each its own admin token
    assert_job_tokens_only(tokens, handed, lambda p: [])
    held = [{j for a in tokens for j in ("bench", "bench-delta") if job_token(a, j) in repr(args)}
            for _, args in handed]
    assert all(len(h) == 1 for h in held) and set().union(*held) == {"bench", "bench-delta"}, held
    assert r["verified"] and len(r["step_seconds"]) == 1 and r["baselines"] == {}
    d = r["delta"]
    assert d["verified"] and d["full"]["bytes_moved"] == r["bytes_moved"] > 0
    assert [x["previous"] for x in d["runs"]] == ["device", "host"]
    for x in d["runs"]:
        assert not x["errors"], x["errors"]
        assert x["first_step_bytes"] == r["bytes_moved"]  # no base yet: whole
        assert x["memory_budget_bytes"] > x["sender_device_bytes"] >= 0
        one, ten = x["rows"]
        for row, lo, hi in ((one, 0.02, 0.05), (ten, 0.12, 0.22)):  # indices 6 B / changed bf16; bitmap n/8 + 2k
            assert row["full_reads"] == 0 and len(row["step_seconds"]) == 1
            assert abs(row["changed_fraction"] - row["fraction"]) < 0.1 * row["fraction"]
            assert all(lo < b / r["bytes_moved"] < hi for b in row["bytes_per_step"]), row["bytes_per_step"]
            assert row["p90_seconds"] >= row["median_seconds"] > 0 and row["floor_seconds"] is None
