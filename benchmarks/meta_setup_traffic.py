"""Set-up traffic of a job at the MetaServer: N participants register, agree and prove the plan, as the
checkout's own runtime does it (``weightsync.runtime.job``: ``register``; then what ``JobSession.agree``
downloads: ``wait_side`` for both sides' listings before 2026-12-07, since then ``sides`` (each side's
census) and ``placed`` (the placement that concerns the participant); then ``wait_plan_proven``), against a
real MetaServer process of the same checkout.

    PYTHONPATH=CHECKOUT .venv/bin/python benchmarks/meta_setup_traffic.py --trainers 1024 --instances 128

Run it once with PYTHONPATH at a checkout of the commit before the change and once at the change
(``git worktree add`` or ``git archive COMMIT | tar -x -C DIR``); each uses its own client and server.

The trainers are ``megatron:tp=8,pp=4,dp=T/32`` ranks of Qwen3-8B (its config.json as the model
config), 8 to a host, each with its own GPU UUID; the instances are ``vllm`` (TP 1) on other hosts'
GPUs; every GPU UUID random (as real ones are). Phases: every participant registers (8 at a time), then each downloads what its ``agree`` step
downloads (8 at a time; by then everybody has registered, so every long-poll is answered at once:
the real job's early arrivals poll meanwhile, which can only add). ``--prove``: then every participant
posts its pair hashes (each training rank one pair with every inference rank, as a plan whose cells are
striped over all of a shard's replicas has), one plan check is asked with half of them posted (what a
participant waiting meanwhile downloads each time it asks), and each participant waits for the proof
(8 at a time, every hash posted by then). Traffic is what the participants sent and received over the
phases, both directions, HTTP headers included (:class:`Counted`). Also: the server's peak memory
(VmHWM) and the phases' wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor


class Counted:
    """Every byte this process's sockets send and receive (the participants' side of every request,
    HTTP headers included), counted where ``http.client`` hands them to the kernel."""

    total = 0
    lock = threading.Lock()

    @classmethod
    def install(cls) -> None:
        import _socket
        import socket

        def sendall(self, data, *a):
            with cls.lock:
                cls.total += len(data)
            return _socket.socket.sendall(self, data, *a)

        def recv_into(self, buf, *a):
            n = _socket.socket.recv_into(self, buf, *a)
            with cls.lock:
                cls.total += n
            return n

        socket.socket.sendall, socket.socket.recv_into = sendall, recv_into


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) / 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trainers", type=int, default=1024)
    p.add_argument("--instances", type=int, default=128)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--prove", action="store_true", help="also post every pair hash and wait for the proof")
    args = p.parse_args()

    import weightsync
    from weightsync.engines import make_layout
    from weightsync.meta.client import MetaClient
    from weightsync.runtime import job
    from weightsync.spec import load_spec

    Counted.install()
    typed = hasattr(job, "registration")  # the typed registration (weightsync.meta.records)
    spec = load_spec("qwen3-8b")
    T, I = args.trainers, args.instances
    train = make_layout(spec, f"megatron:tp=8,pp=4,dp={T // 32}")
    infer = make_layout(spec, "vllm:tp=1")
    assert train.world_size == T
    terms = dict(transport="p2p", mode="sync", colocate=False, bucket_bytes=256 << 20, integrity=1, delta=False)

    server = subprocess.Popen([sys.executable, "-m", "weightsync.meta.server", "--port", "0"], stdout=subprocess.PIPE,
                              text=True)
    try:
        url = re.search(r"listening on (\S+)", server.stdout.readline()).group(1)
        layouts = {}
        here = threading.local()

        class Hosts:  # each simulated participant's own host name, where the runtime asks the socket module
            @staticmethod
            def gethostname() -> str:
                return here.host

        job.socket = Hosts

        def register(who: tuple[str, int, int | None]) -> None:
            role, rank, inst = who
            engine = train if role == "train" else infer
            layout = layouts.get((role, rank)) or layouts.setdefault((role, rank), engine.layout(rank))
            gpu = uuids[rank if role == "train" else T + inst]
            here.host = f"{role}-node{(rank if role == 'train' else inst) // 8}"
            c = MetaClient(url, "setup", timeout=120)
            if typed:
                from weightsync.meta.records import SessionTerms

                rec = job.registration(spec, role, rank, engine, layout, instance=inst, terms=SessionTerms(**terms),
                                       gpu=gpu, backend="nccl" if role == "train" else None,
                                       instances=I if role == "infer" else None)
                job.register(c, rec, spec)
            else:
                extra = {**terms, "peer_copies": True, "gpu": gpu}
                extra.update({"backend": "nccl"} if role == "train" else {"instances": I})
                job.register(c, spec, role, rank, engine, layout, instance=inst, extra=extra)
            c._drop_connection()

        def agree(who: tuple[str, int, int | None]) -> int:
            role = who[0]
            other = "infer" if role == "train" else "train"
            c = MetaClient(url, "setup", timeout=120)
            if hasattr(job, "placed"):  # since 2026-12-07: censuses, then the placement that concerns it
                from weightsync.meta.records import SessionTerms

                train_side, infer_side = job.sides(c, role, T if role == "train" else I, 120)
                shape = job.job_shape(train_side, infer_side, SessionTerms(**terms))
                assert job.placed(c, shape, who[2]).placement is not None
                c._drop_connection()
                return train_side.count + infer_side.count
            own = job.wait_side(c, role, 120, count=T if role == "train" else I)
            theirs = job.wait_side(c, other, 120)
            c._drop_connection()
            return len(own) + len(theirs)

        def post_hashes(who: tuple[str, int, int | None]) -> None:
            role, rank, inst = who
            c = MetaClient(url, "setup", timeout=120)
            if role == "train":
                c.post_plan_hashes("train", rank, {(rank, i, 0): "ab" * 16 for i in range(I)})
            else:
                c.post_plan_hashes("infer", 0, {(t, inst, 0): "ab" * 16 for t in range(T)}, instance=inst)
            c._drop_connection()

        def prove(who: tuple[str, int, int | None]) -> None:
            c = MetaClient(url, "setup", timeout=600)
            job.wait_plan_proven(c, 600, T + I)
            c._drop_connection()

        people = [("train", r, None) for r in range(T)] + [("infer", 0, i) for i in range(I)]
        rng = random.Random(0)  # GPU UUIDs as random as real ones (gzip cannot shrink them below their entropy)
        uuids = [f"GPU-{uuid.UUID(int=rng.getrandbits(128), version=4)}" for _ in range(T + I)]
        base = Counted.total
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(register, people))
            t1 = time.perf_counter()
            registered = Counted.total
            seen = list(pool.map(agree, people))
            t2 = time.perf_counter()
            agreed = Counted.total
            if args.prove:
                list(pool.map(post_hashes, people[:T:2] + people[T::2]))  # half the trainers, half the instances
                mid = Counted.total
                MetaClient(url, "setup", timeout=600).check_plan_hashes()
                check_mid = Counted.total - mid
                list(pool.map(post_hashes, people[1:T:2] + people[T + 1::2]))
                posted = Counted.total - check_mid
                list(pool.map(prove, people))
        t3 = time.perf_counter()
        total = Counted.total
        assert all(n == T + I for n in seen), set(seen)
        print(json.dumps({
            "weightsync": os.path.dirname(weightsync.__file__), "typed_registrations": typed,
            "participants": T + I, "trainers": T, "instances": I,
            "register_mb": round((registered - base) / 1e6, 2), "agree_mb": round((agreed - registered) / 1e6, 2),
            "total_mb": round((agreed - base) / 1e6, 2),
            "per_participant_kb": round((agreed - base) / 1e3 / (T + I), 1),
            **({"post_hashes_mb": round((posted - agreed) / 1e6, 2), "check_half_posted_mb": round(check_mid / 1e6, 3),
                "prove_mb": round((total - posted - check_mid) / 1e6, 2), "prove_s": round(t3 - t2, 2)}
               if args.prove else {}),
            "server_peak_rss_mb": round(peak_rss_mb(server.pid), 1),
            "register_s": round(t1 - t0, 2), "agree_s": round(t2 - t1, 2),
        }))
    finally:
        server.terminate()
        server.wait(timeout=20)


if __name__ == "__main__":
    main()
