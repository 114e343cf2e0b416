"""The point-to-point transport over real multi-process gloo groups on CPU.

Every case starts one process per training rank and per (instance, inference rank); each builds its
own plan and local tensors, as a real job would, and reports back through a queue. Processes come
from the shared forkserver (tests/helpers.py), which has torch, weightsync and this module imported
already, so each start costs milliseconds and no process inherits the test runner's threads.
"""

from __future__ import annotations

import os
import queue
import time
import traceback

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers import canonical_weights as _canonical
from helpers import forkserver
from helpers import record_landings
from helpers import same as _same
from helpers import simulate

from weightsync.codec.full import FullCodec
from weightsync.engines import make_layout
from weightsync.layout.materialize import TORCH_DTYPES, fill_from, scatter
from weightsync.plan.planner import Planner
from weightsync.spec import load_spec
from weightsync.transport import p2p
from weightsync.transport.group import free_port, new_group
from weightsync.payload.pack import DIRECT_MIN_BYTES
from weightsync.transport.p2p import JobRanks, P2PTransport, TransportError, order_key

TIMEOUT_S = 4.0  # every wait in the transport; a fault must surface within this (plus slack)
STALL_S = TIMEOUT_S + 3  # how long a stalled peer sits in the group without posting anything


def _ctx():
    return forkserver()  # the shared one (tests/helpers.py): its preload imports this module too


def _die_after(name: str, calls: int) -> None:
    """Make this process vanish (no cleanup, like a crash) on the ``calls + 1``-th call of p2p.<name>."""
    real = getattr(p2p, name)
    count = [0]

    def dying(*args, **kwargs):
        count[0] += 1
        if count[0] > calls:
            os._exit(3)
        return real(*args, **kwargs)

    setattr(p2p, name, dying)






def worker(case: dict, role: str, who: tuple[int, ...], port: int, results) -> None:
    """One process of the job: join the group, run ``case['seeds']`` steps, check, report."""
    group_rank, start = None, time.monotonic()
    try:
        spec = load_spec(case["model"])
        src, dst = make_layout(spec, case["train"]), make_layout(spec, case["infer"])
        ranks = JobRanks(src.world_size, dst.world_size, case["instances"])
        planner = Planner(src, dst, case["instances"], bucket_bytes=case["budget"])
        group_rank = ranks.train(*who) if role == "train" else ranks.infer(*who)
        if case.get("default_group"):  # the trainer's (or the engine's) own world, created first
            import torch.distributed as dist

            if role == "train":
                base, size, local = case["ports"][0], src.world_size, who[0]
            else:
                base, size, local = case["ports"][1 + who[0]], dst.world_size, who[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{base}", rank=local, world_size=size)
        pg = new_group("127.0.0.1", port, group_rank, ranks.world_size, timeout_s=30)
        transport = P2PTransport(pg, ranks, window=case.get("window", 2), timeout_s=TIMEOUT_S,
                                 direct_min=case.get("direct_min", DIRECT_MIN_BYTES),
                                 codec=FullCodec() if case.get("codec") == "full" else None)
        landed = record_landings() if case.get("fp32_data") and role == "infer" else None
        if case.get("die") == (role, who):
            _die_after("pack_pairs" if role == "train" else "unpack_pairs", case["die_after"])
        if case.get("stall") == (role, who):  # alive, in the group, but never posts its side
            time.sleep(STALL_S)
            results.put((group_rank, "stalled", ""))
            return
        if role == "train":
            layout, plans = src.layout(who[0]), planner.send_plan(who[0])
        else:
            layout, plans = dst.layout(who[1]), planner.recv_plan(*who)
        tensors, ptrs, buffers = None, None, None
        for seed in case["seeds"]:
            canonical = _canonical(case, spec, seed)
            if role == "train":
                if tensors is None:
                    tensors = scatter(layout, canonical)
                else:
                    fill_from(layout, tensors, canonical)  # new weights, same live tensors
                start = time.monotonic()
                transport.send(plans, tensors)
            else:
                if tensors is None:
                    shapes = {n: (t.shape, TORCH_DTYPES[t.dtype]) for n, t in layout.tensors.items()}
                    tensors = {n: torch.full(shape, float("nan"), dtype=dt) for n, (shape, dt) in shapes.items()}
                    ptrs = {n: t.data_ptr() for n, t in tensors.items()}
                start = time.monotonic()
                transport.recv(plans, tensors)
                want = scatter(layout, _canonical(case, spec, seed, cast=True))
                bad = [n for n in want if not _same(tensors[n], want[n])]
                assert not bad, f"step seed {seed}: wrong values in {bad[:5]}"
                assert ptrs == {n: t.data_ptr() for n, t in tensors.items()}, "destination tensors were reallocated"
            now = [b.data_ptr() for b in transport._buffers]
            assert buffers is None or now == buffers, "transfer buffers were reallocated between steps"
            buffers = now
        if landed is not None:  # every cast was the codec's work, after byte copies (BatchedCopy refuses a cast)
            assert landed and all(n == 0 or (ld.work is not None and all(d.dtype == s.dtype for d, s in ld.copies))
                                  for n, ld in landed), landed
            assert sum(n for n, _ in landed) > 0, "no piece was cast"
        if case.get("default_group"):
            import torch.distributed as dist

            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == dist.get_world_size(), "default group broken"
            dist.destroy_process_group()
        results.put((group_rank, "ok", ""))
    except TransportError as e:
        results.put((group_rank, "TransportError", f"{time.monotonic() - start:.2f}s {e}"))
    except BaseException as e:  # noqa: BLE001 - report everything, the parent asserts
        results.put((group_rank, type(e).__name__, traceback.format_exc()))


def run_job(case: dict, deadline_s: float = 40.0) -> tuple[dict[int, tuple[str, str]], dict[int, int | None]]:
    """Start every process of ``case``; return {group rank: (status, detail)} and exit codes."""
    spec = load_spec(case["model"])
    src, dst = make_layout(spec, case["train"]), make_layout(spec, case["infer"])
    ranks = JobRanks(src.world_size, dst.world_size, case["instances"])
    if case.get("default_group"):
        case = {**case, "ports": [free_port() for _ in range(1 + case["instances"])]}
    ctx = _ctx()
    results = ctx.Queue()
    port = free_port()
    members = [("train", (r,)) for r in range(src.world_size)]
    members += [("infer", (i, j)) for i in range(case["instances"]) for j in range(dst.world_size)]
    procs = {}
    for role, who in members:
        g = ranks.train(*who) if role == "train" else ranks.infer(*who)
        procs[g] = ctx.Process(target=worker, args=(case, role, who, port, results), daemon=True)
        procs[g].start()
    got: dict[int, tuple[str, str]] = {}
    end = time.monotonic() + deadline_s
    dead = {g for g, (role, who) in zip(procs, members) if case.get("die") == (role, who)}  # never report
    while len(got) < len(procs) - len(dead) and time.monotonic() < end:
        try:
            g, status, detail = results.get(timeout=0.2)
            got[g] = (status, detail)
        except queue.Empty:
            pass
    for p in procs.values():
        p.join(timeout=max(0.1, end - time.monotonic()))
    codes = {g: p.exitcode for g, p in procs.items()}
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join()
    return got, codes


CASES = {
    "qwen3 hf -> vllm:tp=2 x2": dict(
        model="tiny-qwen3", train="hf", infer="vllm:tp=2", instances=2, budget=16 << 10
    ),
    # segments of 256 bytes and more travel as messages of their own, sent from / received into the
    # live tensors wherever they lie contiguous there (a few bytes stand for the 8 MiB of real models)
    "qwen3 hf -> vllm:tp=2, in place": dict(
        model="tiny-qwen3", train="hf", infer="vllm:tp=2", instances=1, budget=16 << 10, direct_min=256
    ),
    "qwen3-moe vllm:tp=2 -> sglang:tp=2": dict(  # an inference layout as the source too
        model="tiny-qwen3-moe", train="vllm:tp=2", infer="sglang:tp=2", instances=1, budget=32 << 10
    ),
    "llama3 fsdp:dp=2 -> vllm:tp=4, 512 B buckets": dict(  # ~400 buckets a sender, many copies split
        model="tiny-llama3", train="fsdp:dp=2", infer="vllm:tp=4", instances=1, budget=512, window=3,
        direct_min=64,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_end_to_end_several_steps(name):
    """Every inference rank ends bitwise equal to its reference layout, for each of three steps."""
    got, codes = run_job({**CASES[name], "seeds": [11, 12, 13]})
    assert len(got) == len(codes), f"some processes never reported: {sorted(set(codes) - set(got))}, exit codes {codes}"
    failed = {g: r for g, r in got.items() if r[0] != "ok"}
    assert not failed, "\n".join(f"group rank {g}: {s}\n{d}" for g, (s, d) in failed.items())


def test_a_cast_lands_as_the_codecs_work():
    """fp32 masters (random fp32 values, most not bf16-exact) into a bf16 engine, the full codec given: each staged
    bucket lands as its landing -- byte copies batched by the transport, the casts as the codec's work after them
    (the same CUDA graph on a GPU) -- and every poisoned target ends bit for bit the reference cast
    ``src.to(bf16)``, every step (the landings are built once and replayed)."""
    case = dict(model="tiny-qwen3", train="fsdp:dp=2,fp32=1", infer="vllm:tp=2", instances=1, budget=16 << 10,
                direct_min=256, codec="full", fp32_data=True, seeds=[11, 12])
    got, codes = run_job(case)
    assert len(got) == len(codes), f"some processes never reported: {sorted(set(codes) - set(got))}, exit codes {codes}"
    failed = {g: r for g, r in got.items() if r[0] != "ok"}
    assert not failed, "\n".join(f"group rank {g}: {s}\n{d}" for g, (s, d) in failed.items())


def test_beside_the_default_group():
    """Trainers and each inference instance own a default group; ours is built beside and both work."""
    case = {**CASES["qwen3 hf -> vllm:tp=2 x2"], "train": "fsdp:dp=2", "seeds": [5, 6], "default_group": True}
    got, codes = run_job(case)
    assert len(got) == len(codes) and all(s == "ok" for s, _ in got.values()), got


def _check_fault(case: dict, bad_rank: int, must_raise: set[int]) -> None:
    """The ranks in ``must_raise`` raise a TransportError naming ``bad_rank`` within the timeout; none hangs."""
    got, codes = run_job(case, deadline_s=STALL_S + 10)
    if "die" in case:
        assert codes[bad_rank] == 3, f"the faulty process should have crashed, exit codes {codes}"
    for g in must_raise:
        assert g in got, f"group rank {g} hung (no report), got {got}"
        status, detail = got[g]
        assert status == "TransportError", f"group rank {g}: {status}\n{detail}"
        took = float(detail.split("s ", 1)[0])
        assert took < TIMEOUT_S + 2, f"group rank {g} raised only after {took}s: {detail}"
        assert f"group rank {bad_rank} failed" in detail and "bucket" in detail, detail
    # nobody hangs: every survivor reported (success, a TransportError, or its stall) before the deadline
    alive = set(codes) - ({bad_rank} if "die" in case else set())
    assert set(got) == alive, f"hung: {alive - set(got)}"
    assert all(s in ("ok", "TransportError", "stalled") for s, _ in got.values()), got


def test_sender_crash_mid_transfer_fails_receivers_fast():
    """The only trainer exits after packing 5 buckets; both inference ranks raise naming it."""
    case = dict(model="tiny-qwen3", train="hf", infer="vllm:tp=2", instances=1, budget=8 << 10, seeds=[1],
                die=("train", (0,)), die_after=5)
    _check_fault(case, bad_rank=0, must_raise={1, 2})


def test_receiver_crash_mid_transfer_fails_sender_fast():
    """Inference rank (0, 1) exits after unpacking 3 buckets; the trainer raises within the timeout."""
    case = dict(model="tiny-qwen3", train="hf", infer="vllm:tp=2", instances=1, budget=8 << 10, seeds=[1],
                die=("infer", (0, 1)), die_after=3)
    _check_fault(case, bad_rank=2, must_raise={0})


def test_stalled_peer_times_out():
    """Inference rank (0, 0) joins the group, then never posts a receive: the trainer times out."""
    case = dict(model="tiny-qwen3", train="hf", infer="vllm:tp=2", instances=1, budget=8 << 10, seeds=[1],
                stall=("infer", (0, 0)))
    _check_fault(case, bad_rank=1, must_raise={0})


# -- in-process checks of the ordering argument ----------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(
    case=st.sampled_from(
        [
            ("tiny-llama3", "fsdp:dp=3", "vllm:tp=4"),
            ("tiny-qwen3-moe", "megatron:ep=2,dp=2", "vllm:tp=2,dp=2,ep=4"),
            ("tiny-qwen3", "megatron:pp=2,dp=2", "sglang:tp=4,dp=2,dp_attention=1"),
        ]
    ),
    instances=st.integers(1, 3),
    budget=st.sampled_from([2048, 16 << 10]),
    window=st.integers(1, 3),
)
def test_global_order_never_deadlocks(case, instances, budget, window):
    """Every rank walking its own buckets in the one global order completes, even strictly in order."""
    spec = load_spec(case[0])
    src, dst = make_layout(spec, case[1]), make_layout(spec, case[2])
    planner = Planner(src, dst, instances, bucket_bytes=budget)
    ranks = JobRanks(src.world_size, dst.world_size, instances)
    ops: dict[int, list[tuple]] = {}
    for r in range(src.world_size):
        buckets = sorted((b for bs in planner.send_plan(r).values() for b in bs), key=order_key)
        ops[ranks.train(r)] = [(order_key(b), ranks.infer(b.dst_instance, b.dst_rank)) for b in buckets]
    for i in range(instances):
        for j in range(dst.world_size):
            buckets = sorted((b for bs in planner.recv_plan(i, j).values() for b in bs), key=order_key)
            ops[ranks.infer(i, j)] = [(order_key(b), ranks.train(b.src_rank)) for b in buckets]
    assert simulate(ops, window)


def test_simulator_sees_deadlocks():
    """Control: inconsistent per-rank orders wedge the simulator (so the test above can fail)."""
    a, b, s0, s1 = 2, 3, 0, 1
    ops = {
        s0: [("0a", a), ("0b", b)],
        s1: [("1b", b), ("1a", a)],
        a: [("1a", s1), ("0a", s0)],
        b: [("0b", s0), ("1b", s1)],
    }
    assert not simulate(ops, window=1)


def test_rank_map_and_validation():
    ranks = JobRanks(train_world=2, infer_world=4, instances=3)
    assert ranks.world_size == 14
    assert ranks.infer(0, 0) == 2 and ranks.infer(2, 3) == 13
    assert ranks.sender((1, 2, 3)) == 1 and ranks.receiver((1, 2, 3)) == 13
