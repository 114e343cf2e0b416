"""The file transport: buckets moved through a directory of safetensors files, on CPU.

In-process runs call every sender, then every receiver, of a job in turn; two-process runs start a
sending and a receiving process (multiprocessing spawn) that share only the directory, the receiver
polling before the sender has written anything and the sender free to run steps ahead. Every
destination starts NaN-poisoned and must end bitwise equal to its reference layout, every step.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import traceback

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import record_landings

from weightsync.engines import make_layout
from weightsync.layout.materialize import TORCH_DTYPES, fill_from, scatter
from weightsync.plan.planner import Planner, pair_hash
from weightsync.spec import load_spec
from weightsync.testing import random_canonical
from weightsync.transport import file as file_mod
from weightsync.transport.file import FORMAT, FileTransport, file_name
from weightsync.transport.p2p import TransferStats, TransportError, describe

CASES = {
    "qwen3 hf -> vllm:tp=2 x2": dict(model="tiny-qwen3", train="hf", infer="vllm:tp=2", instances=2, budget=16 << 10),
    "llama3 fsdp:dp=2 -> sglang:tp=2, 512 B buckets": dict(
        model="tiny-llama3", train="fsdp:dp=2", infer="sglang:tp=2", instances=1, budget=512
    ),
}
STEPS = [(1, 11), (2, 12), (3, 13)]  # (step, seed of that step's weights)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN (the padding the plan never writes must keep its poison)."""
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def _poisoned(layout) -> dict[str, torch.Tensor]:
    return {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype]) for n, t in layout.tensors.items()}


class Job:
    """Everything both ends of one case derive on their own: layouts, planner, plans."""

    def __init__(self, case: dict, budget: int | None = None):
        self.spec = load_spec(case["model"])
        self.src, self.dst = make_layout(self.spec, case["train"]), make_layout(self.spec, case["infer"])
        self.instances = case["instances"]
        self.planner = Planner(self.src, self.dst, self.instances, bucket_bytes=budget or case["budget"])
        self.dsts = [(i, j) for i in range(self.instances) for j in range(self.dst.world_size)]

    def send_all(self, transport: FileTransport, step: int, seed: int, live: dict | None = None) -> dict:
        """Every training rank sends step ``step`` (weights of ``seed``) from its live tensors."""
        canonical = random_canonical(self.spec, seed)
        live = {} if live is None else live
        for r in range(self.src.world_size):
            if r in live:
                fill_from(self.src.layout(r), live[r], canonical)  # new weights, same tensors
            else:
                live[r] = scatter(self.src.layout(r), canonical)
            transport.send(self.planner.send_plan(r), live[r], step=step)
        return live

    def recv_check(self, transport: FileTransport, step: int, seed: int, live: dict) -> None:
        """Every inference rank receives step ``step`` in place and must equal the reference of ``seed``."""
        canonical = random_canonical(self.spec, seed)
        for who in self.dsts:
            layout = self.dst.layout(who[1])
            if who not in live:
                live[who] = _poisoned(layout)
            ptrs = {n: t.data_ptr() for n, t in live[who].items()}
            plans = self.planner.recv_plan(*who)
            stats = transport.recv(plans, live[who], step=step)
            assert stats.bytes == sum(b.nbytes for bs in plans.values() for b in bs)
            want = scatter(layout, canonical)
            bad = [n for n in want if not _same(live[who][n], want[n])]
            assert not bad, f"step {step}, instance {who[0]} rank {who[1]}: wrong values in {bad[:5]}"
            assert ptrs == {n: t.data_ptr() for n, t in live[who].items()}, "destination tensors were reallocated"


# -- in-process -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_in_process_several_steps(name, tmp_path):
    job = Job(CASES[name])
    transport = FileTransport(tmp_path, timeout_s=2)
    src_live, dst_live = {}, {}
    for step, seed in STEPS:
        job.send_all(transport, step, seed, src_live)
        pairs = {p for r in range(job.src.world_size) for p in job.planner.send_plan(r)}
        assert sorted(os.listdir(tmp_path)) == sorted(file_name(step, p) for p in pairs)  # one file a pair
        job.recv_check(transport, step, seed, dst_live)
        assert os.listdir(tmp_path) == [], "every file is deleted once consumed"


def test_a_cast_lands_as_the_codecs_work(tmp_path, monkeypatch):
    """fp32 masters (random fp32 values, most not bf16-exact) into a bf16 engine: every bucket read from its file
    lands as the full codec's landing -- byte copies, the casts as the codec's work -- and the poisoned targets end
    bit for bit the reference cast, ``src.to(bf16)``. A reader given no codec refuses the cast by name and writes
    nothing."""
    from weightsync.codec.full import FullCodec

    landed = record_landings(monkeypatch.setattr)
    job = Job(dict(model="tiny-qwen3", train="fsdp:dp=2,fp32=1", infer="vllm:tp=2", instances=1, budget=16 << 10))
    g = torch.Generator().manual_seed(5)
    canon = {t.name: torch.randn(t.shape, generator=g) for t in job.spec.tensors}  # fp32, not rounded to bf16
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in canon.values())
    for r in range(job.src.world_size):
        FileTransport(tmp_path).send(job.planner.send_plan(r), scatter(job.src.layout(r), canon), step=1)
    cast = {n: v.to(torch.bfloat16) for n, v in canon.items()}
    for who in job.dsts:
        plans, got = job.planner.recv_plan(*who), _poisoned(job.dst.layout(who[1]))
        with pytest.raises(ValueError, match=r"torch.float32 .* lands in a torch.bfloat16 .* no codec was given to "
                                             r"cast it: pass the full codec"):
            FileTransport(tmp_path, consume=False, timeout_s=2).recv(plans, got, step=1)
        assert all(t.isnan().all() for t in got.values())
        FileTransport(tmp_path, consume=False, timeout_s=2, codec=FullCodec()).recv(plans, got, step=1)
        want = scatter(job.dst.layout(who[1]), cast)
        bad = [n for n in want if not _same(got[n], want[n])]
        assert not bad, f"instance {who[0]} rank {who[1]}: wrong values in {bad[:5]}"
    assert landed and all(n == 0 or (ld.work is not None and all(d.dtype == s.dtype for d, s in ld.copies))
                          for n, ld in landed)
    assert sum(n for n, _ in landed) > 0  # the casts were the codec's


def test_file_is_plain_safetensors(tmp_path):
    """What a person debugging finds: one bucket.{i} uint8 tensor per bucket, and the metadata."""
    job = Job(CASES["llama3 fsdp:dp=2 -> sglang:tp=2, 512 B buckets"])
    job.send_all(FileTransport(tmp_path), step=7, seed=1)
    pair = (1, 0, 1)
    buckets = job.planner.send_plan(1)[pair]
    with safe_open(tmp_path / file_name(7, pair), framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == FORMAT and meta["step"] == "7" and meta["pair"] == "1,0,1"
        assert meta["pair_hash"] == pair_hash(buckets) and meta["buckets"] == str(len(buckets)) > "1"
        assert sorted(f.keys()) == sorted(f"bucket.{b.index}" for b in buckets)
        for b in buckets:
            t = f.get_tensor(f"bucket.{b.index}")
            assert t.dtype == torch.uint8 and t.numel() == b.nbytes


def test_step_fn_supplies_the_step(tmp_path):
    job = Job(CASES["qwen3 hf -> vllm:tp=2 x2"])
    current = [4]
    transport = FileTransport(tmp_path, step_fn=lambda: current[0], timeout_s=2)
    live = scatter(job.src.layout(0), random_canonical(job.spec, 21))
    with pytest.raises(ValueError, match="step"):  # neither step= nor a step_fn
        FileTransport(tmp_path).send(job.planner.send_plan(0), live)
    transport.send(job.planner.send_plan(0), live)  # no step=: step_fn says 4
    assert all(n.startswith("step000000004.") for n in os.listdir(tmp_path))
    dst = {}
    for who in job.dsts:
        dst[who] = _poisoned(job.dst.layout(who[1]))
        transport.recv(job.planner.recv_plan(*who), dst[who])
        want = scatter(job.dst.layout(who[1]), random_canonical(job.spec, 21))
        assert all(_same(dst[who][n], want[n]) for n in want)
    assert transport.recv({}, {}) == TransferStats(0, 0, 0.0)


# -- two processes ----------------------------------------------------------------------------------


def _sender_main(case: dict, directory: str, steps, results) -> None:
    try:
        job = Job(case)
        transport = FileTransport(directory, timeout_s=10)
        time.sleep(0.3)  # let the receiver poll an empty directory first
        live = {}
        for step, seed in steps:
            job.send_all(transport, step, seed, live)
        results.put(("send", "ok", ""))
    except BaseException as e:  # noqa: BLE001 - report everything, the parent asserts
        results.put(("send", type(e).__name__, traceback.format_exc()))


def _receiver_main(case: dict, directory: str, steps, results) -> None:
    try:
        job = Job(case)
        transport = FileTransport(directory, timeout_s=10, poll_s=0.005)
        live = {}
        for step, seed in steps:
            job.recv_check(transport, step, seed, live)
        results.put(("recv", "ok", ""))
    except BaseException as e:  # noqa: BLE001
        results.put(("recv", type(e).__name__, traceback.format_exc()))


@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_several_steps(name, tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=main, args=(CASES[name], str(tmp_path), STEPS, results), daemon=True)
        for main in (_receiver_main, _sender_main)
    ]
    for p in procs:
        p.start()
    got, end = {}, time.monotonic() + 25
    while len(got) < 2 and time.monotonic() < end:
        try:
            side, status, detail = results.get(timeout=0.2)
            got[side] = (status, detail)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    assert set(got) == {"send", "recv"}, f"missing reports: {got}, exit codes {[p.exitcode for p in procs]}"
    failed = {s: r for s, r in got.items() if r[0] != "ok"}
    assert not failed, "\n".join(f"{s}: {st}\n{d}" for s, (st, d) in failed.items())
    assert os.listdir(tmp_path) == []


# -- faults -----------------------------------------------------------------------------------------


def test_tampered_hash_raises_naming_the_pair(tmp_path):
    job = Job(CASES["qwen3 hf -> vllm:tp=2 x2"])
    job.send_all(FileTransport(tmp_path), step=1, seed=5)
    pair = (0, 1, 0)
    path = tmp_path / file_name(1, pair)
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = dict(f.metadata())
    meta["pair_hash"] = "0" * 32
    save_file(tensors, path, metadata=meta)
    transport = FileTransport(tmp_path, timeout_s=2)
    with pytest.raises(TransportError) as err:
        transport.recv(job.planner.recv_plan(1, 0), _poisoned(job.dst.layout(0)), step=1)
    assert err.value.pair == pair and describe(pair) in str(err.value) and "pair hash" in str(err.value)
    assert path.exists(), "a rejected file stays for inspection"
    # the other instance's file was untouched and still goes through
    transport.recv(job.planner.recv_plan(0, 0), _poisoned(job.dst.layout(0)), step=1)


def test_plans_that_disagree_raise(tmp_path):
    """Sender and receiver planned with different bucket budgets: the pair hashes differ."""
    case = CASES["llama3 fsdp:dp=2 -> sglang:tp=2, 512 B buckets"]
    Job(case, budget=512).send_all(FileTransport(tmp_path), step=3, seed=1)
    other = Job(case, budget=4096)
    with pytest.raises(TransportError, match="pair hash") as err:
        FileTransport(tmp_path, timeout_s=2).recv(other.planner.recv_plan(0, 0), _poisoned(other.dst.layout(0)), step=3)
    assert err.value.pair[1:] == (0, 0)


def test_renamed_file_of_another_step_raises(tmp_path):
    job = Job(CASES["qwen3 hf -> vllm:tp=2 x2"])
    job.send_all(FileTransport(tmp_path), step=1, seed=5)
    for who in job.dsts:
        os.replace(tmp_path / file_name(1, (0, *who)), tmp_path / file_name(2, (0, *who)))
    with pytest.raises(TransportError, match="has step '1', expected '2'") as err:
        FileTransport(tmp_path, timeout_s=2).recv(job.planner.recv_plan(0, 1), _poisoned(job.dst.layout(1)), step=2)
    assert err.value.pair == (0, 0, 1)


def test_missing_sender_times_out_naming_the_pair(tmp_path):
    job = Job(CASES["llama3 fsdp:dp=2 -> sglang:tp=2, 512 B buckets"])
    transport = FileTransport(tmp_path, timeout_s=0.5)
    dst = _poisoned(job.dst.layout(1))
    start = time.monotonic()
    with pytest.raises(TransportError, match="no file for") as err:  # nobody sent at all
        transport.recv(job.planner.recv_plan(0, 1), dst, step=1)
    took = time.monotonic() - start
    assert 0.5 <= took < 3, took
    assert describe((0, 0, 1)) in str(err.value) and describe((1, 0, 1)) in str(err.value)
    # only training rank 0 sends: rank 0's file is consumed, the error names training rank 1 alone
    live = scatter(job.src.layout(0), random_canonical(job.spec, 2))
    transport.send(job.planner.send_plan(0), live, step=1)
    with pytest.raises(TransportError) as err:
        transport.recv(job.planner.recv_plan(0, 1), dst, step=1)
    assert err.value.pair == (1, 0, 1) and describe((0, 0, 1)) not in str(err.value)
    assert not (tmp_path / file_name(1, (0, 0, 1))).exists()


def test_a_receive_behind_the_trainers_gives_up_at_its_timeout_not_at_written_timeout(tmp_path):
    """Waiting for a step's first file may take ``first_s`` (the trainers may still train), but not where they are
    past it: a reader resumed after a long pause, whose step's files were consumed or swept while later steps were
    written, learns it from the later step's files within about a second past ``timeout_s`` -- "moved on past it",
    not "never written" -- and nothing lands."""
    from weightsync.errors import StepNotWritten

    job = Job(CASES["llama3 fsdp:dp=2 -> sglang:tp=2, 512 B buckets"])
    import threading

    live = scatter(job.src.layout(0), random_canonical(job.spec, 2))
    sender = FileTransport(tmp_path, timeout_s=0.5)
    sender.send(job.planner.send_plan(0), live, step=9)  # an earlier job's leftover of a later step: not "moved on"
    old = time.time() - 60
    for name in os.listdir(tmp_path):
        os.utime(tmp_path / name, (old, old))

    def trainers_move_on() -> None:  # while this reader waits, the trainers write step 7 for the others only
        time.sleep(0.3)
        sender.send(job.planner.send_plan(0), live, step=7)
        for name in os.listdir(tmp_path):  # (this instance, rank 1, was dropped: its files are gone)
            if name.startswith("step000000007") and ".r1." in name:
                os.remove(tmp_path / name)

    dst = _poisoned(job.dst.layout(1))
    before = {n: t.clone() for n, t in dst.items()}
    receiver = FileTransport(tmp_path, timeout_s=0.5)
    threading.Thread(target=trainers_move_on, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(TransportError, match=r"step 5: the trainers already wrote step 7 .* moved on past it") as err:
        receiver.recv(job.planner.recv_plan(0, 1), dst, step=5, first_s=60.0)
    assert time.monotonic() - start < 3 and not isinstance(err.value, StepNotWritten) and not receiver.landed
    assert all(torch.equal(dst[n].view(torch.uint8), t.view(torch.uint8)) for n, t in before.items())  # (NaN poison)


def test_a_receive_takes_its_total_budget_at_most_however_steadily_files_arrive(tmp_path):
    """``total_s`` (a job's receivers: their ``timeout_s``) bounds the whole transfer, counted from the step's first
    file (before it, the trainers may still be training: ``first_s``), so a worker's call returns before the engine's
    RPC deadline: training rank 0's file arrives after 1.5 s, rank 1's after 3 s -- never 2 s without a new file, so
    the idle timeout alone waits them out (3 s); with a 1 s budget the receive fails 1 s after the first file (2.5 s)
    naming the missing pair."""
    import threading

    job = Job(CASES["llama3 fsdp:dp=2 -> sglang:tp=2, 512 B buckets"])
    canonical = random_canonical(job.spec, 4)

    def trickle(transport: FileTransport, step: int) -> threading.Thread:
        def run() -> None:
            for r in range(job.src.world_size):
                time.sleep(1.5)
                transport.send(job.planner.send_plan(r), scatter(job.src.layout(r), canonical), step=step)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    dst = _poisoned(job.dst.layout(1))
    slow = trickle(FileTransport(tmp_path, timeout_s=2.0), 1)
    start = time.monotonic()
    FileTransport(tmp_path, timeout_s=2.0).recv(job.planner.recv_plan(0, 1), dst, step=1)  # idle timeout only
    assert time.monotonic() - start >= 2.5
    slow.join()
    slow = trickle(FileTransport(tmp_path, timeout_s=2.0), 2)
    start = time.monotonic()
    with pytest.raises(TransportError, match="1s after its first file arrived, though files kept arriving") as err:
        FileTransport(tmp_path, timeout_s=2.0, total_s=1.0).recv(job.planner.recv_plan(0, 1), dst, step=2)
    assert 2.5 <= time.monotonic() - start < 2.9 and err.value.pair == (1, 0, 1)
    slow.join()


def test_reader_never_sees_a_partial_file(tmp_path, monkeypatch):
    """A slow sender streams many buckets per file while a reader and a watcher poll hard."""
    job = Job(CASES["qwen3 hf -> vllm:tp=2 x2"], budget=2048)  # ~100 buckets a file
    real_pack = file_mod.pack

    def slow_pack(*args, **kwargs):
        time.sleep(0.002)
        return real_pack(*args, **kwargs)

    monkeypatch.setattr(file_mod, "pack", slow_pack)
    seen = {"tmp": 0, "final": 0, "bad": []}
    done = threading.Event()

    def watch():  # every file under a final name must open and hold every byte it promises
        while not done.is_set():
            for name in os.listdir(tmp_path):
                if name.endswith(".tmp"):
                    seen["tmp"] += 1
                    continue
                try:
                    with safe_open(tmp_path / name, framework="pt") as f:
                        meta = f.metadata()
                        size = sum(f.get_tensor(k).numel() for k in f.keys())
                    seen["final"] += 1
                    if size != int(meta["bytes"]):
                        seen["bad"].append(name)
                except FileNotFoundError:
                    pass  # consumed meanwhile
                except Exception as e:  # noqa: BLE001
                    if (tmp_path / name).exists():
                        seen["bad"].append(f"{name}: {e}")
            time.sleep(0.0005)

    sender_error = []

    def send():
        try:
            job.send_all(FileTransport(tmp_path), step=1, seed=9)
        except BaseException as e:  # noqa: BLE001
            sender_error.append(e)

    threads = [threading.Thread(target=watch), threading.Thread(target=send)]
    for t in threads:
        t.start()
    try:
        job.recv_check(FileTransport(tmp_path, timeout_s=10, poll_s=0.0005), 1, 9, {})
    finally:
        done.set()
        for t in threads:
            t.join()
    assert not sender_error, sender_error
    assert not seen["bad"], seen["bad"]
    assert seen["tmp"] > 0, "the test never caught a file being written"


def test_stale_files_are_ignored_overwritten_and_swept(tmp_path):
    """A crashed earlier step left a complete file, a half-written temp file and, under this step's
    name, garbage: the sender overwrites the garbage, the reader ignores the rest, sweep clears it."""
    job = Job(CASES["qwen3 hf -> vllm:tp=2 x2"])
    transport = FileTransport(tmp_path, timeout_s=2)
    job.send_all(transport, step=4, seed=1)  # never received
    (tmp_path / f".{file_name(4, (0, 0, 0))}.123.abcd.tmp").write_bytes(b"half a file")
    (tmp_path / file_name(5, (0, 1, 1))).write_bytes(b"garbage from a crashed run")
    job.send_all(transport, step=5, seed=2)
    job.recv_check(transport, 5, 2, {})
    left = sorted(os.listdir(tmp_path))
    assert left and all(n.startswith(("step000000004.", ".step000000004.")) for n in left), left
    mine = job.planner.recv_plan(0, 0)  # a receiver sweeping only its own pairs leaves the others'
    assert transport.sweep(before_step=5, pairs=mine) == 2  # its step-4 file and the temp file
    assert transport.sweep(before_step=4) == 0
    assert transport.sweep(before_step=5) == len(left) - 2 and os.listdir(tmp_path) == []


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        FileTransport(tmp_path, timeout_s=0)
    with pytest.raises(ValueError, match="non-negative"):
        FileTransport(tmp_path).recv({}, {}, step=-1)
    assert not list(tmp_path.iterdir())
