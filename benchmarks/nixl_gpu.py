"""NIXL on one GPU: two processes, VRAM registered on both sides, READ and WRITE timed under UCX settings.

    python benchmarks/nixl_gpu.py [--bytes N] [--out results.json]
    python benchmarks/nixl_gpu.py --layout qwen3-8b [--out results.json]   # a model's tensors: see run_layout

For each UCX setting (its environment is set before the child processes load NIXL): a target process
registers ``--bytes`` of VRAM filled with seeded random data, an initiator process registers as much,
loads the target's metadata and times, over 5 repetitions each, READ and WRITE as one descriptor and
as 1,024 descriptors of ``bytes / 1024``, checking after the first READ that every byte arrived
(``torch.equal`` against the same seeded data). The initiator also times a device copy of the same
bytes (the ceiling) and, through CUDA IPC (the co-located path: the target's tensor opened in the
initiator), a copy out of the other process's memory. Why READ is slow with UCX's defaults on a
one-GPU host: docs/nixl.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

SETTINGS = {
    "defaults": {},
    # cuda_ipc's get (READ) is off by default ("auto") where UCX sees no NVLink between GPUs: one GPU
    "cuda_ipc get on": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"},
    "cuda_ipc get on, tls cuda_ipc,cuda_copy,tcp": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
                                                   "UCX_TLS": "cuda_ipc,cuda_copy,tcp"},
}


def _seeded(n: int, seed: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 255, (n,), generator=g, device="cuda", dtype=torch.uint8)


def _target(env: dict, n: int, q, done) -> None:
    os.environ.update(env)
    import torch

    from weightsync.transport.nixl_wire import load_nixl

    nixl = load_nixl()
    torch.cuda.set_device(0)
    src = _seeded(n, 7)
    sink = torch.zeros(n, dtype=torch.uint8, device="cuda")  # WRITE lands here
    torch.cuda.synchronize()
    agent = nixl.nixl_agent("target", nixl.nixl_agent_config(backends=["UCX"]))
    agent.register_memory([src, sink])
    from torch.multiprocessing.reductions import reduce_tensor

    q.put((agent.get_agent_metadata(), src.data_ptr(), sink.data_ptr(), reduce_tensor(src)))
    done.wait(600)
    q.put(("sink_ok", bool(torch.equal(sink, _seeded(n, 8)))))


def _time(agent, h, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        if state != "DONE":
            raise RuntimeError(f"transfer ended {state}")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _initiator(env: dict, n: int, q, out, done) -> None:
    os.environ.update(env)
    import torch

    from weightsync.transport.nixl_wire import load_nixl

    nixl = load_nixl()
    torch.cuda.set_device(0)
    md, src_addr, sink_addr, ipc = q.get(timeout=300)
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    mine = _seeded(n, 8)  # what WRITE sends
    torch.cuda.synchronize()
    agent = nixl.nixl_agent("initiator", nixl.nixl_agent_config(backends=["UCX"]))
    agent.register_memory([dst, mine])
    peer = agent.add_remote_agent(md)
    res: dict = {"bytes": n}
    k = 1024
    chunk = n // k
    for label, local_base, remote_base, op in (("read", dst.data_ptr(), src_addr, "READ"),
                                               ("write", mine.data_ptr(), sink_addr, "WRITE")):
        for count in (1, k):
            size = n if count == 1 else chunk
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(local_base + i * size, size, 0) for i in range(count)], "VRAM")
            rh = agent.prep_xfer_dlist(peer, [(remote_base + i * size, size, 0) for i in range(count)], "VRAM")
            h = agent.make_prepped_xfer(op, lh, list(range(count)), rh, list(range(count)))
            t0 = time.perf_counter()
            first = _time(agent, h, reps=1)
            if label == "read" and count == 1:
                res["read_exact"] = bool(torch.equal(dst, _seeded(n, 7)))
            s = _time(agent, h)
            res[f"{label}_{count}desc_s"] = s
            res[f"{label}_{count}desc_GBps"] = n / s / 1e9
            res[f"{label}_{count}desc_first_s"] = first
            del t0
    # the ceiling: a device copy of the same bytes in this process
    a, b = torch.empty_like(dst), torch.empty_like(dst)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.copy_(b)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    res["device_copy_s"] = statistics.median(times)
    res["device_copy_GBps"] = n / res["device_copy_s"] / 1e9
    # the co-located path: CUDA IPC, the target's tensor opened here and copied out of
    fn, args = ipc
    remote = fn(*args)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(remote)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    res["cuda_ipc_copy_s"] = statistics.median(times)
    res["cuda_ipc_copy_GBps"] = n / res["cuda_ipc_copy_s"] / 1e9
    res["cuda_ipc_exact"] = bool(torch.equal(dst, _seeded(n, 7)))
    done.set()
    out.put(res)


# -- a model's tensors, one allocation each (the bench's trainer): where a step's READ time goes --------------


def _layout_sizes(model: str) -> list[int]:
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES
    from weightsync.spec import load_spec

    layout = make_layout(load_spec(model), "hf").layout(0)
    return [t.numel * TORCH_DTYPES[t.dtype].itemsize for t in layout.tensors.values()]


def _layout_data(n: int, k: int, device: str):
    import torch

    g = torch.Generator(device=device).manual_seed(1000 + k)
    return torch.randint(0, 255, (n,), generator=g, device=device, dtype=torch.uint8)


def _layout_target(model: str, device: str, q, done) -> None:
    """The trainer's side: every tensor of ``model``'s hf layout its own allocation (as the bench's trainer
    allocates them), registered as weightsync.transport.nixl does (allocator segments), plus the same bytes
    in ONE flat allocation registered once."""
    import torch

    from weightsync.transport.nixl import _agent, _regions, _storages
    from weightsync.transport.nixl_wire import load_nixl

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    sizes = _layout_sizes(model)
    tensors = [_layout_data(n, k, device) for k, n in enumerate(sizes)]
    flat = torch.cat(tensors)
    mem = "VRAM" if cuda else "DRAM"
    if cuda:
        torch.cuda.synchronize()
    agent, _ = _agent(load_nixl(), "target")
    segs = _regions(tensors)
    agent.register_memory([(a, n, 0, "") for a, n in segs], mem)
    agent.register_memory([(a, n, 0, "") for a, n in _storages([flat])], mem)
    ipcs = None
    if cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        ipcs = [reduce_tensor(t) for t in tensors]
    q.put((agent.get_agent_metadata(), [t.data_ptr() for t in tensors], flat.data_ptr(), len(segs), ipcs))
    done.wait(600)


def _layout_initiator(model: str, device: str, q, out, done) -> None:
    """The reader: READs the tensors into one flat local buffer as the transport's program does (one
    descriptor a tensor), in one transfer and in chunks of POST_CHUNK, with and without NIXL's progress
    thread; then the same bytes from the one flat remote allocation as one descriptor and as one
    descriptor a tensor (local order shuffled, so nothing merges: per-descriptor cost within one
    registration); beside the device copy (ceiling) and torch copies of the tensors opened by CUDA IPC
    (the co-located path). Every READ variant is checked bit for bit once."""
    import random

    import torch

    from weightsync.plan.descriptors import POST_CHUNK
    from weightsync.transport.nixl import _agent
    from weightsync.transport.nixl_wire import load_nixl

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mem = "VRAM" if cuda else "DRAM"
    if cuda:
        torch.cuda.set_device(0)
    md, addrs, flat_addr, nsegs, ipcs = q.get(timeout=300)
    sizes = _layout_sizes(model)
    total = sum(sizes)
    dst = torch.zeros(total, dtype=torch.uint8, device=device)
    offs = [0]
    for n in sizes[:-1]:
        offs.append(offs[-1] + n)
    want = torch.cat([_layout_data(n, k, device) for k, n in enumerate(sizes)])
    nixl = load_nixl()
    res: dict = {"model": model, "device": device, "tensors": len(sizes), "bytes": total, "target_regions": nsegs,
                 "post_chunk": POST_CHUNK}
    agents = {"thread": _agent(nixl, "rd-thread", True)[0], "nothread": _agent(nixl, "rd-nothread", False)[0]}

    def timed(agent, handles, reps=5, check=None):
        if check is not None:
            dst.fill_(0)
        posts, dones = [], []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            for h in handles:
                if agent.transfer(h) == "ERR":
                    raise RuntimeError("transfer ERR")
            t1 = time.perf_counter()
            for h in handles:
                while (st := agent.check_xfer_state(h)) == "PROC":
                    pass
                if st != "DONE":
                    raise RuntimeError(f"transfer ended {st}")
            posts.append(t1 - t0)
            dones.append(time.perf_counter() - t0)
            if check is not None:
                res[f"{check}_exact"] = bool(torch.equal(dst, want))
                check = None
        return statistics.median(posts), statistics.median(dones)

    for label, agent in agents.items():
        agent.register_memory([(dst.data_ptr(), total, 0, "")], mem)
        peer = agent.add_remote_agent(md)
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst.data_ptr() + o, n, 0) for o, n in zip(offs, sizes)], mem)
        rh = agent.prep_xfer_dlist(peer, [(a, n, 0) for a, n in zip(addrs, sizes)], mem)
        idx = list(range(len(sizes)))
        one = [agent.make_prepped_xfer("READ", lh, idx, rh, idx)]
        chunks = [agent.make_prepped_xfer("READ", lh, idx[k:k + POST_CHUNK], rh, idx[k:k + POST_CHUNK])
                  for k in range(0, len(idx), POST_CHUNK)]
        timed(agent, one, reps=1)  # connects
        res[f"{label}_per_tensor_1xfer_post_s"], res[f"{label}_per_tensor_1xfer_s"] = timed(agent, one, check=f"{label}_1xfer")
        res[f"{label}_per_tensor_chunked_post_s"], res[f"{label}_per_tensor_chunked_s"] = timed(agent, chunks, check=f"{label}_chunked")
        if label == "thread":  # one registration: one descriptor, then one a tensor that cannot merge
            fl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst.data_ptr(), total, 0)], mem)
            fr = agent.prep_xfer_dlist(peer, [(flat_addr, total, 0)], mem)
            res["flat_1desc_post_s"], res["flat_1desc_s"] = timed(agent, [agent.make_prepped_xfer("READ", fl, [0], fr, [0])],
                                                                  check="flat_1desc")
            perm = list(range(len(sizes)))
            random.Random(5).shuffle(perm)
            loc, at = [0] * len(sizes), 0
            for k in perm:
                loc[k] = at
                at += sizes[k]
            sl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst.data_ptr() + loc[k], n, 0) for k, n in enumerate(sizes)], mem)
            sr = agent.prep_xfer_dlist(peer, [(flat_addr + o, n, 0) for o, n in zip(offs, sizes)], mem)
            res["flat_per_tensor_post_s"], res["flat_per_tensor_s"] = timed(agent, [agent.make_prepped_xfer("READ", sl, idx, sr, idx)])
    # the ceiling: a device copy of the same bytes; and the co-located path's copies, one a tensor
    b = torch.empty_like(dst)
    times, ipc_times = [], []
    remote = [fn(*args) for fn, args in ipcs] if ipcs else []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        b.copy_(dst)
        sync()
        times.append(time.perf_counter() - t0)
        if remote:
            t0 = time.perf_counter()
            for o, n, r in zip(offs, sizes, remote):
                dst[o:o + n].copy_(r)
            sync()
            ipc_times.append(time.perf_counter() - t0)
    res["device_copy_s"] = statistics.median(times)
    if ipc_times:
        res["ipc_copy_per_tensor_s"] = statistics.median(ipc_times)
        res["ipc_exact"] = bool(torch.equal(dst, want))
    res["ceiling_GBps"] = total / res["device_copy_s"] / 1e9
    done.set()
    out.put(res)


def run_layout(model: str, device: str = "cuda") -> dict:
    ctx = mp.get_context("spawn")
    q, out, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    t = ctx.Process(target=_layout_target, args=(model, device, q, done))
    i = ctx.Process(target=_layout_initiator, args=(model, device, q, out, done))
    t.start()
    i.start()
    try:
        res = out.get(timeout=300)
    except Exception as e:  # noqa: BLE001
        res = {"error": f"{type(e).__name__}: {e}"}
    for p in (i, t):
        p.join(30)
        if p.is_alive():
            p.kill()
    print(json.dumps(res), flush=True)
    return res


def run(nbytes: int, settings: dict) -> dict:
    ctx = mp.get_context("spawn")
    results = {}
    for name, env in settings.items():
        q, out, done = ctx.Queue(), ctx.Queue(), ctx.Event()
        t = ctx.Process(target=_target, args=(env, nbytes, q, done))
        i = ctx.Process(target=_initiator, args=(env, nbytes, q, out, done))
        t.start()
        i.start()
        try:
            res = out.get(timeout=300)
            sink = q.get(timeout=60)
            res["write_exact"] = sink[1]
        except Exception as e:  # noqa: BLE001 - one setting failing must not hide the others
            res = {"error": f"{type(e).__name__}: {e}"}
        for p in (i, t):
            p.join(30)
            if p.is_alive():
                p.kill()
            if p.exitcode not in (0, None):
                res.setdefault("exitcodes", []).append(p.exitcode)
        res["env"] = env
        results[name] = res
        print(json.dumps({name: res}), flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, default=1 << 30)
    p.add_argument("--out", default=None)
    p.add_argument("--only", default=None, help="one setting's name")
    p.add_argument("--layout", default=None, help="a model: READ its hf tensors, one allocation each")
    p.add_argument("--device", default="cuda", help="--layout on cpu: a rehearsal (UCX over shared memory)")
    a = p.parse_args()
    if a.layout:
        res = run_layout(a.layout, a.device)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
        return 0 if "error" not in res else 1
    settings = {a.only: SETTINGS[a.only]} if a.only else SETTINGS
    res = run(a.bytes, settings)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
