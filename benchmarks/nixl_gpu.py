"""NIXL on one GPU: two processes, VRAM registered on both sides, READ and WRITE timed under UCX settings.

    python benchmarks/nixl_gpu.py [--bytes N] [--out results.json]

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
    a = p.parse_args()
    settings = {a.only: SETTINGS[a.only]} if a.only else SETTINGS
    res = run(a.bytes, settings)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
