"""The benchmark baselines (naive, bucketed) move the same bits as weightsync: real gloo groups, CPU."""

from datetime import timedelta

import pytest
import torch

from helpers import forkserver
from weightsync.bench.baselines import sync_step
from weightsync.engines import make_layout
from weightsync.layout.materialize import scatter
from weightsync.spec import load_spec
from weightsync.testing import random_canonical
from weightsync.transport.group import free_port, new_group
from weightsync.transport.p2p import JobRanks


def _ctx():
    """Members fork from a server that has imported torch and weightsync once (spawned ones imported them each:
    35 processes of this file's 7 cases, most of its CPU time on CI's two cores)."""
    return forkserver()  # preloads this module too


def _member(rank: int, port: int, case: tuple, failures) -> None:
    model, train, infer, instances, kind = case
    torch.set_num_threads(1)
    spec = load_spec(model)
    src, dst = make_layout(spec, train), make_layout(spec, infer)
    ranks = JobRanks(src.world_size, dst.world_size, instances)
    group = new_group("127.0.0.1", port, rank, ranks.world_size, "gloo", 60)
    canonical = random_canonical(spec, seed=21)
    if rank < src.world_size:
        tensors = scatter(src.layout(rank), canonical, fill=0.0)
        where = dict(train_rank=rank)
        want = None
    else:
        inst, r = divmod(rank - src.world_size, dst.world_size)
        tensors = scatter(dst.layout(r), canonical, fill=float("nan"))
        want = {n: t.clone() for n, t in tensors.items()}
        for t in tensors.values():
            t.fill_(float("nan"))
        where = dict(infer=(inst, r))
    sync_step(kind, group, ranks, src, dst, tensors=tensors, device=torch.device("cpu"), timeout=timedelta(seconds=60), **where)
    if want is not None:
        for n, t in tensors.items():
            same = torch.equal(t.isnan(), want[n].isnan()) and torch.equal(t.nan_to_num(), want[n].nan_to_num())
            if not same:
                failures.put(f"rank {rank}: {n}")


# each baseline kind at least once over a split trainer (naive: megatron EP; bucketed: megatron TP+PP) and
# into one and two instances; every case costs seconds of process starts on CI's two cores
CASES = [
    ("tiny-qwen3", "hf", "vllm:tp=2", 2, "bucketed"),
    ("tiny-qwen3-moe", "megatron:ep=2,dp=2", "sglang:tp=2", 1, "naive"),
    ("tiny-llama3", "megatron:tp=2,pp=2,pp_first=3", "vllm:tp=4", 1, "bucketed"),
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_baseline_moves_the_right_bits(case):
    spec = load_spec(case[0])
    world = make_layout(spec, case[1]).world_size + make_layout(spec, case[2]).world_size * case[3]
    ctx = _ctx()
    failures = ctx.Queue()
    port = free_port()
    _run_all(ctx, _member, [(r, port, case, failures) for r in range(world)], failures)


def _run_all(ctx, target, arg_lists: list[tuple], failures) -> None:
    """One spawned process per argument tuple; every one must exit cleanly and report no failure."""
    procs = [ctx.Process(target=target, args=args) for args in arg_lists]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]  # None: still running past its time
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert all(c == 0 for c in codes), codes
    assert failures.empty(), failures.get()


# -- co-located: hand-over through exported buffers (shared memory on CPU, CUDA IPC on GPU) --------


def _colo_member(role: str, rank: int, port: int, meta: str, case: tuple, failures, group_port: int = 0) -> None:
    from torch.distributed import TCPStore

    from weightsync.bench.baselines import ColocatedTrainer, ColocatedWorker, needs_training_group
    from weightsync.meta.client import MetaClient

    model, train, infer, kind = case
    torch.set_num_threads(1)
    spec = load_spec(model)
    src, dst = make_layout(spec, train), make_layout(spec, infer)
    store = TCPStore("127.0.0.1", port, is_master=role == "train" and rank == 0, timeout=timedelta(seconds=60),
                     wait_for_workers=False)
    client = MetaClient(meta, "colo-baseline", timeout=60)
    group = None
    if role == "train" and needs_training_group(src):  # the trainers gather split tensors over their own group
        group = new_group("127.0.0.1", group_port, rank, src.world_size, "gloo", 60, name="train")
    wait = timedelta(seconds=60)
    for step in range(2):  # the second step must overwrite the first everywhere
        canonical = random_canonical(spec, seed=30 + step)
        if role == "train":
            tensors = scatter(src.layout(rank), canonical, fill=0.0)
            if step == 0:
                side = ColocatedTrainer(kind, src, rank, tensors, store, dst.world_size, client.publish, group)
            else:  # new values in the same (exported) storage, as an optimizer step leaves them
                for n, t in tensors.items():
                    side.tensors[n].copy_(t)
            side.step(step, wait)
        else:
            if step == 0:
                live = {n: torch.full(t.shape, float("nan"), dtype=getattr(torch, t.dtype))
                        for n, t in dst.layout(rank).tensors.items()}
                side = ColocatedWorker(kind, src, dst.layout(rank), rank, live, store,
                                       lambda key: client.lookup(key, timeout=60))
            side.step(step, wait)
            want = scatter(dst.layout(rank), canonical, fill=float("nan"))
            for n, t in side.tensors.items():
                if not (torch.equal(t.isnan(), want[n].isnan()) and torch.equal(t.nan_to_num(), want[n].nan_to_num())):
                    failures.put(f"worker {rank} step {step}: {n}")
    # training rank 0 serves the store: it must outlast every other trainer's and worker's last wait
    if role == "train":
        side.finish(wait)
    else:
        side.finish()


# each kind once with whole tensors on a rank (PP) and once split (TP or FSDP): the split cases share the
# gather-to-owner path, so the full 3 x 2 matrix re-tested it twice over
COLOCATED = [("megatron:pp=2", "naive"), ("megatron:tp=2", "bucketed"), ("fsdp:dp=2", "naive"), ("megatron:pp=2", "bucketed")]


@pytest.mark.parametrize(("train", "kind"), COLOCATED, ids=["-".join(c) for c in COLOCATED])
def test_colocated_baseline_moves_the_right_bits(kind, train):
    """Whole tensors on a training rank (PP), or split over the training ranks and gathered to their
    owner first (TP, FSDP), handed over to TP=2 workers: every worker bit-exact, two steps."""
    from weightsync.meta.server import MetaServer

    case = ("tiny-qwen3", train, "vllm:tp=2", kind)
    spec = load_spec(case[0])
    ctx = _ctx()
    failures = ctx.Queue()
    port, group_port = free_port(), free_port()
    with MetaServer(port=0) as meta:
        _run_all(ctx, _colo_member, [(role, r, port, meta.url, case, failures, group_port)
                                     for role, n in (("train", make_layout(spec, case[1]).world_size), ("infer", 2))
                                     for r in range(n)], failures)


def test_colocated_baselines_need_a_group_for_split_training_tensors():
    from weightsync.bench.baselines import ColocatedTrainer, needs_training_group
    from weightsync.errors import ConfigError

    spec = load_spec("tiny-qwen3")
    assert not needs_training_group(make_layout(spec, "megatron:pp=2"))
    tp2 = make_layout(spec, "megatron:tp=2")
    assert needs_training_group(tp2)
    with pytest.raises(ConfigError, match="group of the training ranks"):
        ColocatedTrainer("bucketed", tp2, 0, scatter(tp2.layout(0), random_canonical(spec, 1)), None, 2, None)
