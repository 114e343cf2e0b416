"""Co-located mode on CPU: shared-memory export/import and the co-located transport over gloo.

Real processes throughout: a "trainer" process per training rank holds its local tensors, exports
them once (:mod:`weightsync.transport.share`) and publishes the description in a file; inference
worker processes import those they read once and run :class:`ColocatedTransport` for several steps,
while the trainers overwrite their weights in place between steps. Every case runs twice: on one
host (every bucket a direct copy out of the trainer's memory, no group) and with each GPU a host of
its own (``gpus_per_host=1``: cross-GPU buckets go through the inference-only gloo group). Processes come from a forkserver (see tests/test_p2p.py); the parent only relays
"update"/"step" commands through multiprocessing queues (local pipes, no network).
"""

from __future__ import annotations

import json
import os
import queue
import time
import traceback

import pytest
import torch

from helpers import canonical_weights as _canonical
from helpers import forkserver
from helpers import record_landings
from helpers import same as _same
from helpers import simulate
from weightsync.codec.full import FullCodec
from weightsync.engines import make_layout
from weightsync.errors import ConfigError
from weightsync.layout.materialize import TORCH_DTYPES, scatter
from weightsync.plan.planner import Planner
from weightsync.plan.topology import Topology
from weightsync.spec import load_spec
from weightsync.testing import random_canonical
from weightsync.transport import colocated, share
from weightsync.transport.colocated import ColocatedRanks, ColocatedTransport, proxy_of
from weightsync.transport.group import free_port, new_group
from weightsync.payload.pack import DIRECT_MIN_BYTES
from weightsync.transport.p2p import TransportError, order_key

TIMEOUT_S = 4.0
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


def _ctx():
    return forkserver()  # preloads this module too


def _publish(path: str, desc: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(desc, f)
    os.replace(path + ".tmp", path)  # readers never see half a file


# -- share.py ------------------------------------------------------------------------------------

def _share_tensors(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(64, generator=g).to(device)
    base = torch.randn(6, 8, generator=g).to(device, torch.bfloat16)
    return {
        "param": torch.nn.Parameter(torch.randn(4, 5, generator=g).to(device)),
        "flat": flat,
        "flat_view": flat[10:34].view(4, 6),  # storage offset 10, aliases "flat"
        "bf16_t": base.t(),  # non-contiguous (stride (1, 8))
        "bf16_cols": base[:, 2:5],  # non-contiguous with an offset
        "empty": torch.empty(0, 3, device=device),
    }


def _share_child(desc_path: str, seed: int, device: str, cmds, replies) -> None:
    try:
        cmds.get(timeout=30)
        with open(desc_path) as f:
            got = share.import_tensors(json.load(f))
        want = _share_tensors(seed, device)
        for n, w in want.items():
            t = got[n]
            assert t.device == w.device, (n, t.device)
            assert t.dtype == w.dtype and t.shape == w.shape and t.stride() == w.stride(), n
            assert t.storage_offset() == w.storage_offset(), n
            assert torch.equal(t, w.detach()), n
        assert torch.equal(got["kept"].cpu(), torch.arange(5.0)), "a dropped export must stay alive until released"
        got["flat"][10] = -7.0  # aliasing inside the importer: the view sees the flat buffer's write
        assert got["flat_view"][0, 0].item() == -7.0
        assert got["flat_view"].untyped_storage().data_ptr() == got["flat"].untyped_storage().data_ptr()
        assert share.import_tensors(json.load(open(desc_path)))["param"].data_ptr() == got["param"].data_ptr()
        replies.put(("ok", ""))
        cmds.get(timeout=30)  # the trainer took an optimizer step and added 1 in place
        assert torch.equal(got["param"], want["param"].detach() - 1), "optimizer step not visible"
        w = want["flat"].clone()
        w[10] = -7.0
        w += 1
        assert torch.equal(got["flat"], w) and torch.equal(got["flat_view"], w[10:34].view(4, 6))
        assert torch.equal(got["bf16_t"], want["bf16_t"] + 1)
        got["param"].mul_(0).add_(3.0)  # and the other way round
        got["bf16_cols"].fill_(2.0)
        if device == "cuda":
            torch.cuda.synchronize()
        replies.put(("ok", ""))
    except BaseException:  # noqa: BLE001
        replies.put(("fail", traceback.format_exc()))


@pytest.mark.parametrize("device", DEVICES)
def test_share_aliases_memory_across_processes(tmp_path, device):
    """An unrelated process opens the live tensors by description; writes flow both ways, views alias."""
    seed = 3
    tensors = _share_tensors(seed, device)
    before = {n: t.data_ptr() for n, t in tensors.items()}
    ids = {n: id(t) for n, t in tensors.items()}
    opt = torch.optim.SGD([tensors["param"]], lr=1.0)
    kept = {"kept": torch.arange(5.0, device=device)}
    desc = share.export_tensors({**tensors, **kept})
    del kept  # only the module's keep-alive holds it now
    json.loads(json.dumps(desc))  # plain JSON
    assert {n: id(t) for n, t in tensors.items()} == ids
    if device == "cpu":
        assert all(t.untyped_storage().is_shared() for n, t in tensors.items() if n != "empty")
        assert tensors["param"].data_ptr() != before["param"], "CPU storage should have moved to shared memory"
    assert tensors["flat_view"].data_ptr() - tensors["flat"].data_ptr() == 40
    assert torch.equal(tensors["param"].detach(), _share_tensors(seed, device)["param"].detach())
    assert len(desc["storages"]) == 5  # flat and its view share one storage; bf16 views share another
    path = str(tmp_path / "desc.json")
    _publish(path, desc)

    ctx = _ctx()
    cmds, replies = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_share_child, args=(path, seed, device, cmds, replies), daemon=True)
    p.start()
    try:
        cmds.put("go")
        status, detail = replies.get(timeout=30)
        assert status == "ok", detail
        assert tensors["flat"][10].item() == -7.0, "the importer's write is not visible to the exporter"
        tensors["param"].grad = torch.ones_like(tensors["param"])
        opt.step()  # p -= 1, in place on the shared storage
        with torch.no_grad():
            tensors["flat"].add_(1)
            tensors["bf16_t"].add_(1)
        if device == "cuda":
            torch.cuda.synchronize()  # the "weights ready" barrier orders later writes
        cmds.put("go")
        status, detail = replies.get(timeout=30)
        assert status == "ok", detail
        assert torch.equal(tensors["param"].detach().cpu(), torch.full((4, 5), 3.0))
        assert torch.equal(tensors["bf16_cols"].cpu(), torch.full((6, 3), 2.0, dtype=torch.bfloat16))
    finally:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    share.release(desc)


def test_share_opening_tries_again_when_the_shm_manager_is_slow(monkeypatch):
    """torch's shared-memory manager must answer an opening within 1 s, which a loaded host can miss: the
    opening is tried again; any other failure is reported at once."""
    tensors = {"w": torch.randn(64)}
    desc = share.export_tensors(tensors)
    real, calls = torch.UntypedStorage._new_shared_filename_cpu, []

    def slow_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("Shared memory manager connection has timed out")
        return real(*args)

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_filename_cpu", slow_once)
    assert torch.equal(share.import_tensors(desc)["w"], tensors["w"]) and len(calls) == 2

    def gone(*args):
        raise RuntimeError("No such file or directory")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_filename_cpu", gone)
    with pytest.raises(RuntimeError, match="cannot open shared storage .*No such file"):
        share.import_tensors(share.export_tensors({"v": torch.randn(8)}))


def _export_and_wait(out, done) -> None:
    out.put(json.dumps(share.export_tensors({"w": torch.randn(64, generator=torch.Generator().manual_seed(3))})))
    done.wait(120)


def test_a_spawned_exporter_can_be_joined_while_its_memory_is_open():
    """A trainer process started by ``multiprocessing`` shares its weights and exits while an engine still
    maps them: its parent's ``join`` returns at once. Before: torch's shared memory daemon, started from
    the trainer, held the write end of ``join``'s sentinel pipe as long as any process mapped a segment,
    and ``join(30)`` waited all 30 s (examples/train_to_vllm.py --colocate: 120 s a run)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_export_and_wait, args=(out, done))
    p.start()
    try:
        desc = json.loads(out.get(timeout=120))
        opened = share.import_tensors(desc)  # this process maps the segment: the daemon stays up
        assert torch.equal(opened["w"], torch.randn(64, generator=torch.Generator().manual_seed(3)))
        done.set()
        t0 = time.monotonic()
        p.join(30)
        waited = time.monotonic() - t0
        assert p.exitcode == 0 and waited < 15, f"join waited {waited:.1f} s for an exited exporter"
    finally:
        done.set()
        if p.is_alive():
            p.kill()


def test_share_rejects_bad_input():
    with pytest.raises(ValueError, match="format"):
        share.import_tensors({"format": "other"})
    with pytest.raises(ValueError, match="strided"):
        share.export_tensors({"s": torch.eye(2).to_sparse()})


def test_check_in_place_names_the_tensor_that_moved():
    from weightsync.errors import WeightsMoved

    tensors = {"a": torch.randn(3), "b": torch.randn(2, 4)}
    shared_at = share.addresses(tensors)
    tensors["a"].mul_(2)  # in place: fine
    share.check_in_place(tensors, shared_at, "rank 0", "readers")
    tensors["b"].data = tensors["b"].data.clone()  # same object, new memory
    with pytest.raises(WeightsMoved, match=r"rank 0: tensor 'b' \(2, 4\) torch.float32 moved since it was shared with readers"):
        share.check_in_place(tensors, shared_at, "rank 0", "readers")
    with pytest.raises(WeightsMoved, match="3 tensors now, 2 when they were shared"):
        share.check_in_place({**tensors, "c": torch.zeros(1)}, shared_at, "rank 0", "readers")


# -- the proxy rule and set-up ---------------------------------------------------------------------

class _FakeGroup:
    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_proxy_rule():
    r = ColocatedRanks(train_world=2, infer_world=2, instances=2)
    assert [r.gpu(g) for g in range(4)] == [0, 1, 0, 1]
    assert [r.proxy(t) for t in range(2)] == [0, 1]
    assert r.proxied_by(0) == [0] and r.proxied_by(2) == []
    r = ColocatedRanks(train_world=4, infer_world=3, instances=2)  # GPUs of workers 0..5: 0 1 2 3 0 1
    assert [r.proxy(t) for t in range(4)] == [0, 1, 2, 3]
    assert proxy_of(Topology.colocated(4, 3, 2), 3) == 3


@pytest.mark.parametrize("peer,push", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("gpus_per_host", [8, 2, 1])
@pytest.mark.parametrize("model,train,infer,instances", [
    ("tiny-llama3", "fsdp:dp=4", "vllm:tp=2", 2),
    ("tiny-qwen3-moe", "megatron:ep=2,dp=2", "sglang:tp=4", 1),
    ("tiny-qwen3", "megatron:pp=2", "vllm:tp=2", 2),
])
def test_direct_rule_agrees_on_both_sides(model, train, infer, instances, gpus_per_host, peer, push):
    """A worker opens only training ranks that export for it, and pushes exactly into the workers that
    open their tensors for it; every piece has one mover; one host with peer access needs no group."""
    spec = load_spec(model)
    src, dst = make_layout(spec, train), make_layout(spec, infer)
    ranks = ColocatedRanks(src.world_size, dst.world_size, instances, gpus_per_host, peer, push)
    planner = Planner(src, dst, instances, topology=ranks.topology, bucket_bytes=4096)
    send_plans = {g: {t: planner.send_plan(t) for t in ranks.trainers_on_gpu_of(g)} for g in range(ranks.world_size)}
    recv_plans = {g: planner.recv_plan(*ranks.where(g)) for g in range(ranks.world_size)}
    sources = {g: ranks.sources(g, recv_plans[g], send_plans[g]) for g in range(ranks.world_size)}
    for t in range(ranks.train_world):
        importers = ranks.importers(t, planner.send_plan(t))
        assert {g for g in range(ranks.world_size) if t in sources[g]} <= set(importers), t
        assert ranks.proxy(t) in importers
        for g in importers:
            assert ranks.direct(t, g) or g == ranks.proxy(t)
    pushed = {}
    for g in range(ranks.world_size):
        for into, buckets in ranks.pushes(g, send_plans[g]).items():
            assert g in ranks.pushers_into(into, recv_plans[into])  # it opened its tensors for me
            assert ranks.where(into)[0] == ranks.where(g)[0] and ranks.gpu(into) != ranks.gpu(g)
            pushed.update((id(b), b) for b in buckets)
        for p in ranks.pushers_into(g, recv_plans[g]):
            assert g in ranks.pushes(p, send_plans[p])
    # a pushed piece is exactly one its receiver would have read from another GPU of its host where its
    # instance has a worker (else the receiver still reads it: fsdp:dp=4 -> 2 x tp=2 puts instance 0 on
    # GPUs 0 and 1 only, and trainers 2 and 3 on GPUs 2 and 3)
    crossing = [b for g in range(ranks.world_size) for bs in recv_plans[g].values() for b in bs
                if b.nbytes and ranks.direct(b.src_rank, g) and ranks.topology.train_gpu(b.src_rank) != ranks.gpu(g)
                and ranks.push_candidate(b.src_rank, g) is not None]
    assert sorted((b.pair, b.index) for b in pushed.values()) == (
        sorted((b.pair, b.index) for b in crossing) if push and peer else [])
    gpus = {ranks.gpu(g) for g in range(ranks.world_size)}
    hosts = {ranks.topology.host(gpu) for gpu in gpus}
    assert ranks.needs_group == (len(hosts) > 1 or (not peer and len(gpus) > 1))


def test_one_host_needs_no_group_but_a_rank():
    ranks = ColocatedRanks(train_world=2, infer_world=2)
    with pytest.raises(ValueError, match="pass this worker's rank"):
        ColocatedTransport(None, ranks)
    assert ColocatedTransport(None, ranks, me=1).me == 1
    with pytest.raises(ConfigError, match="need a group"):
        ColocatedTransport(None, ColocatedRanks(train_world=2, infer_world=2, gpus_per_host=1), me=0)


def test_work_during_the_copies_raises_once_they_are_done():
    """``run(..., during=...)``: CPU work overlapping the copies (the reader's check that its tensors did
    not move); what it raises comes out only once the step's copies are all done."""
    case = dict(model="tiny-qwen3", train="hf", infer="vllm:tp=1", instances=1, budget=4096)
    spec, src, dst, ranks, planner = _setup(case)
    canonical = random_canonical(spec, 3)
    trainer = scatter(src.layout(0), canonical)
    want = scatter(dst.layout(0), canonical)
    live = {n: torch.full_like(t, float("nan")) for n, t in want.items()}

    def during():
        raise RuntimeError("found during the copies")

    with pytest.raises(RuntimeError, match="found during the copies"):
        ColocatedTransport(None, ranks, me=0).run(planner.recv_plan(0, 0), {}, live, {0: trainer}, during=during)
    assert all(_same(live[n], want[n]) for n in want)  # every copy done (the padding keeps its poison)


def test_unproxied_training_rank_fails_at_setup():
    ranks = ColocatedRanks(train_world=4, infer_world=1, instances=2)  # GPUs 2 and 3 have no worker
    with pytest.raises(ConfigError, match=r"training rank\(s\) \[2, 3\] have no inference worker"):
        ColocatedTransport(_FakeGroup(2), ranks)
    with pytest.raises(ConfigError, match="no inference worker"):
        ranks.proxy(3)


# -- the transport, end to end ---------------------------------------------------------------------

def _setup(case: dict):
    spec = load_spec(case["model"])
    src, dst = make_layout(spec, case["train"]), make_layout(spec, case["infer"])
    ranks = ColocatedRanks(src.world_size, dst.world_size, case["instances"], case.get("gpus_per_host", 8),
                           case.get("peer", True), case.get("push", False))
    planner = Planner(src, dst, case["instances"], topology=ranks.topology, bucket_bytes=case["budget"])
    return spec, src, dst, ranks, planner






def trainer(case: dict, t: int, path: str, cmds, results) -> None:
    """Training rank ``t``: hold the local tensors, export them once, overwrite them in place on command."""
    try:
        spec, src, _, _, _ = _setup(case)
        layout = src.layout(t)
        dev = case.get("device", "cpu")
        tensors = scatter(layout, _canonical(case, spec, case["seeds"][0]), device=dev)
        params = {n: torch.nn.Parameter(x, requires_grad=False) for n, x in tensors.items()}  # as a model holds them
        _publish(path, share.export_tensors(params))
        results.put((("train", t), "ready", ""))
        while True:
            cmd = cmds.get(timeout=60)
            if cmd[0] == "exit":
                return
            new = scatter(layout, _canonical(case, spec, cmd[1]), device=dev)
            with torch.no_grad():
                for n, p in params.items():
                    p.mul_(0).add_(new[n])  # a training step: same tensors, new values
            if dev != "cpu":
                torch.cuda.synchronize()  # weights ready before we say so
            results.put((("train", t), "updated", cmd[1]))
    except BaseException:  # noqa: BLE001
        results.put((("train", t), "fail", traceback.format_exc()))


def _die_after(calls: int) -> None:
    """Vanish (no cleanup, like a crash) on the ``calls + 1``-th unit this process posts from now on."""
    real, count = colocated.post, [0]

    def dying(*args, **kwargs):
        count[0] += 1
        if count[0] > calls:
            os._exit(3)
        return real(*args, **kwargs)

    colocated.post = dying


def worker(case: dict, g: int, port: int, paths: list[str], together, cmds, results) -> None:
    """Inference worker ``g``: open the trainers' tensors it reads, pushes or proxies once (and, pushing,
    the other workers' tensors it pushes into), then run one transport step per command."""
    who, start = ("infer", g), time.monotonic()
    try:
        spec, src, dst, ranks, planner = _setup(case)
        i, j = ranks.where(g)
        layout = dst.layout(j)
        recv_plans = planner.recv_plan(i, j)
        send_plans = {t: planner.send_plan(t) for t in ranks.send_plan_ranks(g)}
        srcs = {}
        for t in ranks.sources(g, recv_plans, send_plans):  # import ONCE
            assert g in ranks.importers(t, planner.send_plan(t))  # what the trainer exports for
            with open(paths[t]) as f:
                srcs[t] = share.import_tensors(json.load(f))
        pg = new_group("127.0.0.1", port, g, ranks.world_size, timeout_s=30) if ranks.needs_group else None
        transport = ColocatedTransport(pg, ranks, me=g, window=case.get("window", 2), timeout_s=TIMEOUT_S,
                                       direct_min=case.get("direct_min", DIRECT_MIN_BYTES),
                                       codec=FullCodec() if case.get("codec") == "full" else None)
        landed = record_landings(full_too=True) if case.get("fp32_data") else None
        dsts = {
            n: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=case.get("device", "cpu"))
            for n, t in layout.tensors.items()
        }
        where = os.path.dirname(paths[0])
        for p in ranks.pushers_into(g, recv_plans):  # they write into my tensors
            _publish(os.path.join(where, f"dst{g}-for{p}.json"), share.export_tensors(dsts))
        targets = {}
        for q in ranks.pushes(g, send_plans):
            path = os.path.join(where, f"dst{q}-for{g}.json")
            while not os.path.exists(path):
                time.sleep(0.01)
            with open(path) as f:
                targets[q] = share.import_tensors(json.load(f))
        ptrs = {n: x.data_ptr() for n, x in dsts.items()}
        src_ptrs = {t: {n: x.data_ptr() for n, x in ts.items()} for t, ts in srcs.items()}
        buffers = None
        results.put((who, "ready", ""))
        while True:
            cmd = cmds.get(timeout=60)
            if cmd[0] == "exit":
                return
            seed = cmd[1]
            if case.get("die") == g and seed == case["die_step"]:
                _die_after(case["die_after"])
            if case.get("stall") == g and seed == case["stall_step"]:  # alive, in the group, posts nothing
                time.sleep(TIMEOUT_S + 3)
                results.put((who, "stalled", ""))
                return
            for x in dsts.values():
                x.fill_(float("nan"))  # poison: every element the plan owns must be written this step
            if ranks.push:
                together.wait(30)  # nobody pushes into my tensors before I poisoned them
            start = time.monotonic()
            stats = transport.run(recv_plans, send_plans, dsts, srcs, targets)
            if ranks.push:
                together.wait(30)  # nor do I check them before everyone pushing into them is done
            want = scatter(layout, _canonical(case, spec, seed, cast=True))
            bad = [n for n in want if not _same(dsts[n].cpu(), want[n])]
            assert not bad, f"step seed {seed}: wrong values in {bad[:5]}"
            if landed is not None:  # every cast the codec's work, after byte copies (BatchedCopy refuses a cast)
                assert landed and all(n == 0 or (ld.work is not None and all(d.dtype == s.dtype for d, s in ld.copies))
                                      for n, ld in landed), landed
                assert sum(n for n, _ in landed) > 0, "no piece was cast"
            assert ptrs == {n: x.data_ptr() for n, x in dsts.items()}, "destination tensors were reallocated"
            assert src_ptrs == {t: {n: x.data_ptr() for n, x in ts.items()} for t, ts in srcs.items()}
            now = [b.data_ptr() for b in transport._buffers]
            assert buffers is None or now == buffers, "transfer buffers were reallocated between steps"
            buffers = now
            results.put((who, "ok", stats))
    except TransportError as e:
        results.put((who, "TransportError", (time.monotonic() - start, e.peer, str(e))))
    except BaseException:  # noqa: BLE001
        results.put((who, "fail", traceback.format_exc()))


class Job:
    """Trainer and worker processes of one case, driven step by step from the test."""

    def __init__(self, case: dict, tmp_path):
        self.case = case
        _, _, _, self.ranks, _ = _setup(case)
        self.ctx = _ctx()
        self.results = self.ctx.Queue()
        self.procs, self.cmds = {}, {}
        paths = [str(tmp_path / f"train{t}.json") for t in range(self.ranks.train_world)]
        for t in range(self.ranks.train_world):
            self._start(("train", t), trainer, (case, t, paths[t]))
        self.wait({("train", t) for t in range(self.ranks.train_world)}, "ready")
        port = free_port()
        self.workers = {("infer", g) for g in range(self.ranks.world_size)}
        together = self.ctx.Barrier(self.ranks.world_size)
        for g in range(self.ranks.world_size):
            self._start(("infer", g), worker, (case, g, port, paths, together))
        self.wait(self.workers, "ready")

    def _start(self, who, target, args):
        self.cmds[who] = self.ctx.Queue()
        self.procs[who] = self.ctx.Process(target=target, args=(*args, self.cmds[who], self.results), daemon=True)
        self.procs[who].start()

    def collect(self, expect: set, deadline_s: float) -> dict:
        got, end = {}, time.monotonic() + deadline_s
        while set(got) < expect and time.monotonic() < end:
            try:
                who, status, detail = self.results.get(timeout=0.2)
            except queue.Empty:
                continue
            got[who] = (status, detail)
            if status == "fail":
                raise AssertionError(f"{who} failed:\n{detail}")
        return got

    def wait(self, expect: set, status: str, deadline_s: float = 30.0) -> dict:
        got = self.collect(expect, deadline_s)
        assert set(got) == expect, f"no answer from {sorted(expect - set(got))} (exit codes {self.codes()})"
        bad = {w: r for w, r in got.items() if r[0] != status}
        assert not bad, bad
        return {w: d for w, (_, d) in got.items()}

    def update_trainers(self, seed: int) -> None:
        for t in range(self.ranks.train_world):
            self.cmds[("train", t)].put(("update", seed))
        self.wait({("train", t) for t in range(self.ranks.train_world)}, "updated")

    def step(self, seed: int) -> None:
        for w in self.workers:
            self.cmds[w].put(("step", seed))

    def codes(self):
        return {w: p.exitcode for w, p in self.procs.items()}

    def close(self):
        """Workers first, then the trainers (producers outlive their importers, as CUDA IPC wants)."""
        for role in ("infer", "train"):
            mine = [w for w in self.procs if w[0] == role]
            for w in mine:
                if self.procs[w].is_alive():
                    self.cmds[w].put(("exit",))
            for w in mine:
                p = self.procs[w]
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()


# expect_remote: some buckets cross GPUs (direct peer copies on one host, the group across hosts)
CASES = {
    "qwen3 megatron:tp=2 -> vllm:tp=2 x1 (all same-GPU)": dict(
        model="tiny-qwen3", train="megatron:tp=2", infer="vllm:tp=2", instances=1, budget=16 << 10,
        expect_remote=False,
    ),
    "llama3 fsdp:dp=2 -> vllm:tp=2 x2 (cross-GPU)": dict(
        model="tiny-llama3", train="fsdp:dp=2", infer="vllm:tp=2", instances=2, budget=8 << 10,
        expect_remote=True,
    ),
    "qwen3-moe megatron:ep=2,dp=2 -> sglang:tp=2": dict(
        model="tiny-qwen3-moe", train="megatron:ep=2,dp=2", infer="sglang:tp=2", instances=1, budget=16 << 10,
        window=3, expect_remote=True,
    ),
    # segments of 256 bytes and more travel alone, in place where contiguous (8 MiB for real models)
    "qwen3 megatron:pp=2 -> vllm:tp=2, in place": dict(
        model="tiny-qwen3", train="megatron:pp=2", infer="vllm:tp=2", instances=1, budget=16 << 10,
        expect_remote=True, direct_min=256,
    ),
    # each expert's [gate; up] half (2 KiB) is a small segment: a stretch of 4 KiB into w13 / w2 is a message
    # of several segments, packed by the sender (Megatron's per-expert tensors) and received in place
    "qwen3-moe megatron:pp=2 -> vllm:tp=2, expert stretches in place": dict(
        model="tiny-qwen3-moe", train="megatron:pp=2", infer="vllm:tp=2", instances=1, budget=16 << 10,
        expect_remote=True, direct_min=4096,
    ),
}


MODES = {"one host": {}, "one host, pushing": {"push": True}, "one host, no peer access": {"peer": False},
         "a host per GPU": {"gpus_per_host": 1}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CASES))
def test_colocated_several_steps(name, mode, tmp_path):
    """After every step each inference tensor equals scatter(its layout, the trainers' current weights)."""
    _run_steps({**CASES[name], "seeds": [21, 22, 23], **MODES[mode]}, tmp_path)


@pytest.mark.parametrize("mode", ["one host", "a host per GPU"])
def test_a_cast_lands_as_the_codecs_work(mode, tmp_path):
    """fp32 masters (random fp32 values, most not bf16-exact) into a bf16 engine, the full codec given: the direct
    copies (its ``land``) and, a host per GPU, the buckets received through the group (its ``unpacked``) land as
    byte copies batched by the transport and the casts as the codec's work after them; every poisoned target ends
    bit for bit the reference cast ``src.to(bf16)``, every step (the landings are built once and replayed)."""
    case = dict(model="tiny-qwen3", train="fsdp:dp=2,fp32=1", infer="vllm:tp=2", instances=1, budget=16 << 10,
                expect_remote=True, codec="full", fp32_data=True)
    _run_steps({**case, "seeds": [21, 22], **MODES[mode]}, tmp_path)


def test_colocated_refuses_a_cast_without_a_codec():
    """With no codec a direct copy between two dtypes is refused by name at the first step, before any byte moved
    (the cast is the full codec's)."""
    spec = load_spec("tiny-qwen3")
    src, dst = make_layout(spec, "hf:fp32=1"), make_layout(spec, "hf")
    ranks = ColocatedRanks(1, 1)
    planner = Planner(src, dst, 1, topology=ranks.topology, bucket_bytes=16 << 10)
    trainer = scatter(src.layout(0), random_canonical(spec, 1))
    live = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype]) for n, t in dst.layout(0).tensors.items()}
    with pytest.raises(ValueError, match=r"torch.float32 .* lands in a torch.bfloat16 .* no codec was given to cast "
                                         r"it: pass the full codec"):
        ColocatedTransport(None, ranks, me=0).run(planner.recv_plan(0, 0), {}, live, {0: trainer})
    assert all(t.isnan().all() for t in live.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_colocated_cuda_ipc_local_copies(tmp_path):
    """On a GPU: trainers' tensors opened through CUDA IPC, same-GPU pieces copied device to device.
    (All processes share cuda:0 here; only the all-local case runs, gloo moves no CUDA tensors.)"""
    name = "qwen3 megatron:tp=2 -> vllm:tp=2 x1 (all same-GPU)"
    _run_steps({**CASES[name], "seeds": [21, 22, 23], "device": "cuda"}, tmp_path)


def _run_steps(case: dict, tmp_path) -> None:
    job = Job(case, tmp_path)
    try:
        for k, seed in enumerate(case["seeds"]):
            if k:
                job.update_trainers(seed)  # in place, while the workers are idle
            job.step(seed)
            stats = job.wait(job.workers, "ok")
            total_local = sum(s.local_bytes for s in stats.values())
            total_peer = sum(s.peer_bytes for s in stats.values())
            total_sent = sum(s.sent_bytes for s in stats.values())
            total_pushed = sum(s.pushed_bytes for s in stats.values())
            assert total_local > 0
            assert total_sent == sum(s.recv_bytes for s in stats.values())
            crossing = total_peer + total_pushed if not job.ranks.needs_group else total_sent
            assert (crossing > 0) == case["expect_remote"], stats
            assert total_peer == 0 or total_sent == 0, stats  # one host, or a host per GPU
            if job.ranks.push:  # every cross-GPU piece pushed by a worker of the receiver's instance
                assert total_peer == 0, stats
            for (_, g), s in stats.items():
                if not job.ranks.proxied_by(g):
                    assert s.sent_buckets == 0, (g, s)
    finally:
        job.close()


def test_proxy_dying_mid_step_fails_the_others_fast(tmp_path):
    """Worker 1 (proxy of training rank 1) crashes after posting two units of step 2: every other worker
    raises a TransportError naming a peer within the timeout; nobody hangs."""
    case = {**CASES["llama3 fsdp:dp=2 -> vllm:tp=2 x2 (cross-GPU)"], "gpus_per_host": 1, "seeds": [31, 32],
            "die": 1, "die_step": 32, "die_after": 2}
    job = Job(case, tmp_path)
    try:
        job.step(31)
        job.wait(job.workers, "ok")
        job.update_trainers(32)
        job.step(32)
        survivors = job.workers - {("infer", 1)}
        got = job.collect(survivors, deadline_s=TIMEOUT_S + 10)
        assert set(got) == survivors, f"hung: {sorted(survivors - set(got))}"
        job.procs[("infer", 1)].join(timeout=5)
        assert job.procs[("infer", 1)].exitcode == 3, job.codes()
        _check_errors(got, dead=1)
    finally:
        job.close()


def test_stalled_proxy_times_out(tmp_path):
    """Worker 1 stays alive but never posts its step-2 operations: the others time out naming a peer."""
    case = {**CASES["llama3 fsdp:dp=2 -> vllm:tp=2 x2 (cross-GPU)"], "gpus_per_host": 1, "seeds": [31, 32],
            "stall": 1, "stall_step": 32}
    job = Job(case, tmp_path)
    try:
        job.step(31)
        job.wait(job.workers, "ok")
        job.update_trainers(32)
        job.step(32)
        got = job.collect(job.workers, deadline_s=TIMEOUT_S + 10)
        assert set(got) == job.workers, f"hung: {sorted(job.workers - set(got))}"
        assert got.pop(("infer", 1))[0] == "stalled"
        _check_errors(got, dead=1)
    finally:
        job.close()


def _check_errors(got: dict, dead: int) -> None:
    """Every survivor raised a TransportError naming a peer, soon; someone named the faulty proxy."""
    peers = {}
    for w, (status, detail) in got.items():
        assert status == "TransportError", (w, status, detail)
        took, peer, msg = detail
        assert took < TIMEOUT_S + 2, f"{w} raised only after {took:.1f}s: {msg}"
        assert peer is not None and f"group rank {peer} failed" in msg and "bucket" in msg, msg
        peers[w] = peer
    # those that exchange buckets with the faulty proxy name it (or a peer that already failed)
    assert dead in peers.values(), peers


# -- the merged-order argument, checked exhaustively on real plans ----------------------------------

def _colocated_ops(planner: Planner, ranks: ColocatedRanks, merged: bool) -> dict[int, list[tuple]]:
    ops: dict[int, list[tuple]] = {}
    for g in range(ranks.world_size):
        i, j = ranks.where(g)
        recvs = [
            (order_key(b), ranks.proxy(b.src_rank))
            for bs in planner.recv_plan(i, j).values()
            for b in bs
            if ranks.proxy(b.src_rank) != g
        ]
        sends = [
            (order_key(b), ranks.receiver((b.src_rank, b.dst_instance, b.dst_rank)))
            for t in ranks.proxied_by(g)
            for bs in planner.send_plan(t).values()
            for b in bs
            if ranks.receiver((b.src_rank, b.dst_instance, b.dst_rank)) != g
        ]
        ops[g] = sorted(sends + recvs) if merged else sorted(sends) + sorted(recvs)
    return ops


@pytest.mark.parametrize(
    "model,train,infer,instances",
    [
        ("tiny-llama3", "fsdp:dp=2", "vllm:tp=2", 2),
        ("tiny-qwen3-moe", "megatron:ep=2,dp=2", "sglang:tp=2", 1),
        ("tiny-qwen3", "megatron:pp=2,dp=2", "vllm:tp=2", 2),
        ("tiny-llama3", "fsdp:dp=3", "vllm:tp=2", 3),
    ],
)
def test_merged_order_never_deadlocks(model, train, infer, instances):
    """Each worker's ONE list of sends and receives in the global order completes even strictly in order;
    sends-then-receives would wedge (control)."""
    spec = load_spec(model)
    src, dst = make_layout(spec, train), make_layout(spec, infer)
    ranks = ColocatedRanks(src.world_size, dst.world_size, instances)
    planner = Planner(src, dst, instances, topology=ranks.topology, bucket_bytes=2048)
    for window in (1, 2, 3):
        assert simulate(_colocated_ops(planner, ranks, merged=True), window)
    assert not simulate(_colocated_ops(planner, ranks, merged=False), 1)


def test_share_tries_again_when_the_shm_manager_is_slow(monkeypatch):
    """libshm's manager daemon not answering in time (a loaded host) is tried again, not a failed job."""
    real = torch.UntypedStorage._share_filename_cpu_
    calls = []

    def slow_once(self, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("Shared memory manager connection has timed out")
        return real(self, *a, **k)

    monkeypatch.setattr(share, "_MANAGER_STARTED_IN", os.getpid())  # its daemon up: the share below is the first
    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", slow_once)
    t = {"w": torch.randn(8, 4)}
    want = t["w"].clone()
    desc = share.export_tensors(t)
    assert len(calls) == 2 and desc["storages"][0]["kind"] == "cpu_shm"
    assert torch.equal(t["w"], want) and t["w"].untyped_storage().is_shared()
