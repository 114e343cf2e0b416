"""MetaServer load on this machine, raw HTTP, no retries: the server of a commit against today's.

    .venv/bin/python benchmarks/meta_load.py [--before COMMIT | --before-tree DIR] [--only after] [--quick]
    .venv/bin/python benchmarks/meta_load.py --phases job --groups 1 --steps 5 --rounds 2 \
        --before-tree /tmp/ws-before --variants before,after,after1    # (git archive COMMIT | tar -x -C DIR)

Each phase starts a fresh server process (``--state`` in a temp directory where the phase says so)
and drives it from one asyncio process (``meta_loadgen``), every participant on its own connection,
all at once:

- ``register N``: N training participants register with Qwen3-8B's config.json as model_config.
- ``step by 640 ranks``: 640 registered ranks post ``written`` for the same step at once (3 steps).
- ``job 1024x128``: 1,024 trainers and 128 instances (each instance one connection), set-up (register,
  join), then steps: every trainer posts ``written`` and long-polls ``held``; every instance long-polls
  ``written`` and then posts ``held``. A step's time is from its first post to the last trainer's answer.
  ``--groups G``: the trainers signal in groups of G as ``WeightWriter(group=...)`` does (its first rank
  posts ``written`` with ``ranks`` for the group and long-polls ``held``; the others ask the server
  nothing, their outcome comes over the group): G=1 is the per-rank path, G=1024 one group for the job.
  ``--one-request``: each trainer (or group's first rank) posts ``written`` with ``held`` (the step written and
  the wait for it held in one request, as ``WeightWriter`` does since 2026-12-07 where no bells serve), and
  long-polls ``held`` again only if that request's slice ends first.
- ``long-polls``: K long-polls held open, ``/health`` timed meanwhile.

Latencies are per request (connect included for the first); server CPU is the process's utime+stime
over the phase. The "before" server is ``weightsync/meta/server.py`` as of ``--before``, run from a
temp copy against this checkout's package (it needs nothing newer), or with ``--before-tree DIR`` the whole
package of another checkout (``python -m weightsync.meta.server`` with ``PYTHONPATH=DIR``). ``--variants``:
which servers run, each phase back to back (``--rounds`` times): ``before``, ``after``, ``after1`` (after,
``--one-request`` in the job phase). Every row carries the load average when its phase ended.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from meta_loadgen import Conn, Result, at_once, cpu_seconds, request_bytes  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(REPO, "weightsync", "spec", "presets", "qwen3-8b.json")) as f:
    CONFIG = json.load(f)
HOST = "127.0.0.1"


def reg(rank: int, role: str = "train", instance: int | None = None) -> bytes:
    """A trainer's registration as weightsync.meta.records.Registration posts it (the model config beside it)."""
    body = {"role": role, "rank": rank, "host": f"node{rank // 8}", "gpu": f"GPU-{rank:08x}-0000-0000-0000-000000000000",
            "spec_digest": "ab" * 16, "version": "0.1.0", "address": f"10.0.{rank // 256}.{rank % 256}:29500",
            "model": "qwen3-8b", "layout": {"engine": "megatron:tp=8,pp=4", "world": 1024, "digest": "cd" * 8},
            "terms": {"transport": "p2p", "mode": "sync", "colocate": False, "bucket_bytes": 1 << 28, "integrity": 1,
                      "codec": "full"},
            "model_config": CONFIG}
    if instance is not None:
        body["instance"] = instance
    return request_bytes("POST", "/v1/jobs/bench/participants", body)


class Server:
    """A MetaServer process: today's (``python -m weightsync.meta.server``) or a commit's copy."""

    def __init__(self, which: str, before: str, state: bool, tmp: str, before_tree: str | None = None):
        cmd = [sys.executable]
        path = REPO
        if which != "before":
            cmd += ["-m", "weightsync.meta.server"]
        elif before_tree:
            cmd += ["-m", "weightsync.meta.server"]
            path = before_tree
        else:
            path = os.path.join(tmp, "server_before.py")
            with open(path, "wb") as f:
                f.write(subprocess.check_output(["git", "show", f"{before}:weightsync/meta/server.py"], cwd=REPO))
            cmd += [path]
        cmd += ["--port", "0"]
        if state:
            cmd += ["--state", os.path.join(tmp, f"state-{which}-{time.monotonic_ns()}")]
        env = dict(os.environ, PYTHONPATH=path)
        self.proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        m = re.search(r"listening on http://[^:]+:(\d+)", line)
        assert m, line
        self.port, self.pid = int(m.group(1)), self.proc.pid

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _register_all(port: int, reqs: list[bytes]) -> None:
    """Set-up outside the timed phase: few connections, one after another."""
    conns = [await Conn.open(HOST, port) for _ in range(8)]
    for i in range(0, len(reqs), 8):
        await asyncio.gather(*(c.call(r) for c, r in zip(conns, reqs[i:i + 8])))
    for c in conns:
        c.close()


async def phase_register(srv: Server, n: int) -> list[dict]:
    res = await at_once(f"register {n}", HOST, srv.port, [[reg(r)] for r in range(n)], srv.pid)
    return [res.summary()]


async def phase_step(srv: Server, ranks: int, steps: int = 3) -> list[dict]:
    """Registered ranks, each on a kept-alive connection (opened a few at a time beforehand, as a
    job's would be by its set-up), post ``written`` for one step at once."""
    await _register_all(srv.port, [reg(r) for r in range(ranks)])
    conns: list[Conn] = []
    for i in range(0, ranks, 8):
        conns += await asyncio.gather(*(Conn.open(HOST, srv.port) for _ in range(min(8, ranks - i))))
    out = []
    for step in range(1, steps + 1):
        res = Result(f"step by {ranks} ranks (written, kept-alive)")
        cpu0, t0 = cpu_seconds(srv.pid), time.perf_counter()

        async def one(c: Conn, r: int) -> None:
            t = time.perf_counter()
            try:
                status, _ = await asyncio.wait_for(
                    c.call(request_bytes("POST", f"/v1/jobs/bench/steps/{step}/written", {"rank": r})), 120)
            except Exception as e:  # noqa: BLE001 - counted
                res.error(f"io {type(e).__name__}")
                return
            (res.latencies.append(time.perf_counter() - t) if status == 200 else res.error(f"status {status}"))

        await asyncio.gather(*(one(c, r) for r, c in enumerate(conns)))
        res.wall_s, res.server_cpu_s = time.perf_counter() - t0, cpu_seconds(srv.pid) - cpu0
        out.append(res.summary())
    for c in conns:
        c.close()
    return out


def ready(answer: bytes) -> bool:
    """A long-poll's ``ready`` (the server writes it first), without decoding the whole answer."""
    if answer.startswith(b'{"ready": '):
        return answer.startswith(b'{"ready": true')
    return bool(json.loads(answer)["ready"])


async def phase_job(srv: Server, trainers: int, instances: int, steps: int, group: int = 1,
                    one_request: bool = False) -> list[dict]:
    """A sync job's set-up and steps, every participant at once, no retries (``group``: trainers signal
    in groups of that many, by their first rank; ``one_request``: ``written`` carries the ``held`` wait)."""
    tag = f"job {trainers}x{instances}" + (f" groups of {group}" if group > 1 else "") + (
        ", written+held in one request" if one_request else "")
    setup = Result(f"{tag}: set-up (register + join)")
    conns: dict[str, Conn] = {}
    cpu0, t0 = cpu_seconds(srv.pid), time.perf_counter()

    async def trainer_setup(r: int) -> None:
        t = time.perf_counter()
        try:
            c = conns[f"t{r}"] = await asyncio.wait_for(Conn.open(HOST, srv.port), 120)
            status, _ = await c.call(reg(r))
            (setup.latencies.append(time.perf_counter() - t) if status == 200 else setup.error(f"status {status}"))
        except Exception as e:  # noqa: BLE001
            setup.error(type(e).__name__)

    async def instance_setup(i: int) -> None:
        t = time.perf_counter()
        try:
            c = conns[f"i{i}"] = await asyncio.wait_for(Conn.open(HOST, srv.port), 120)
            status, _ = await c.call(reg(0, "infer", i))
            status2, _ = await c.call(request_bytes("POST", f"/v1/jobs/bench/instances/{i}/join", {}))
            ok = status == status2 == 200
            (setup.latencies.append(time.perf_counter() - t) if ok else setup.error(f"status {status}/{status2}"))
        except Exception as e:  # noqa: BLE001
            setup.error(type(e).__name__)

    await asyncio.gather(*(trainer_setup(r) for r in range(trainers)), *(instance_setup(i) for i in range(instances)))
    setup.wall_s, setup.server_cpu_s = time.perf_counter() - t0, cpu_seconds(srv.pid) - cpu0
    out = [setup.summary()]
    if setup.errors:
        return out
    req_lat = Result(f"{tag}: a step's requests")
    step_res = Result(f"{tag}: step (first post to last trainer answered)")
    cpu0 = cpu_seconds(srv.pid)
    ids = ",".join(str(i) for i in range(instances))
    sent = [0]  # every request of the steps, long-poll slices included
    for step in range(1, steps + 1):
        # each participant's requests made beforehand (a real one makes its own, in its own process): the
        # generator's CPU in the step is the HTTP alone
        posts = {}
        for r in range(0, trainers, group):
            body: dict = {"rank": r} if group == 1 else {"ranks": list(range(r, min(r + group, trainers)))}
            if one_request:
                body["held"] = {"instances": ids, "timeout": 25}
            posts[r] = request_bytes("POST", f"/v1/jobs/bench/steps/{step}/written", body)
        poll_held = request_bytes("GET", f"/v1/jobs/bench/held?min_step={step}&instances={ids}&timeout=25")
        poll_written = request_bytes("GET", f"/v1/jobs/bench/steps/{step}/written?timeout=25")
        holds = {i: request_bytes("POST", f"/v1/jobs/bench/instances/{i}/held", {"step": step})
                 for i in range(instances)}
        t0 = time.perf_counter()

        async def call(c: Conn, req: bytes) -> bool:
            sent[0] += 1
            t = time.perf_counter()
            try:
                status, body = await c.call(req)
            except Exception as e:  # noqa: BLE001
                req_lat.error(f"io {type(e).__name__}")
                return False
            if status != 200:
                req_lat.error(f"status {status}")
                return False
            req_lat.latencies.append(time.perf_counter() - t)
            return True

        async def trainer(r: int) -> None:
            c = conns[f"t{r}"]
            if one_request:
                sent[0] += 1
                status, answer = await c.call(posts[r])
                if status != 200:
                    req_lat.error(f"status {status}")
                    return
                if ready(answer):
                    return
            else:
                await call(c, posts[r])
            while True:  # a long-poll slice; again if not ready (as the client does)
                sent[0] += 1
                status, body = await c.call(poll_held)
                if status != 200 or ready(body):
                    break

        async def instance(i: int) -> None:
            c = conns[f"i{i}"]
            while True:
                sent[0] += 1
                status, body = await c.call(poll_written)
                if status != 200 or ready(body):
                    break
            await call(c, holds[i])

        await asyncio.gather(*(trainer(r) for r in range(0, trainers, group)), *(instance(i) for i in range(instances)))
        step_res.latencies.append(time.perf_counter() - t0)
    step_res.server_cpu_s = cpu_seconds(srv.pid) - cpu0
    per_step = step_res.summary()
    per_step.update(requests_per_step=sent[0] / steps, server_cpu_s_per_step=round(step_res.server_cpu_s / steps, 3),
                    server_cpu_us_per_request=round(1e6 * step_res.server_cpu_s / max(1, sent[0]), 1))
    out += [per_step, req_lat.summary()]
    for c in conns.values():
        c.close()
    return out


async def phase_polls(srv: Server, k: int) -> list[dict]:
    conns = []
    for _ in range(k):
        conns.append(await Conn.open(HOST, srv.port))
    waits = [asyncio.create_task(c.call(request_bytes("GET", "/v1/jobs/polls/held?min_step=1&instances=0&timeout=60")))
             for c in conns]
    probe = await Conn.open(HOST, srv.port)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 60:  # every poll arrived and waits (the server says so)
        _, text = await probe.call(request_bytes("GET", "/metrics"))
        m = re.search(rb'weightsync_meta_waiting\{route="held"\} (\d+)', text)
        if m and int(m.group(1)) >= k:
            break
        await asyncio.sleep(0.2)
    res = Result(f"/health with {k} long-polls open")
    for _ in range(50):
        t = time.perf_counter()
        await probe.call(request_bytes("GET", "/health"))
        res.latencies.append(time.perf_counter() - t)
        await asyncio.sleep(0.01)
    for w in waits:
        w.cancel()
    for c in conns + [probe]:
        c.close()
    return [res.summary()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", default="0e83882^", help="commit whose server is 'before'")
    p.add_argument("--only", choices=["before", "after"])
    p.add_argument("--before-tree", help="a checkout's directory whose whole package serves as 'before'")
    p.add_argument("--variants", default="before,after", help="servers to run: before, after, after1 "
                   "(after with --one-request in the job phase)")
    p.add_argument("--rounds", type=int, default=1, help="run every phase this many times, variants back to back")
    p.add_argument("--phases", default="register,step,job,polls")
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    p.add_argument("--groups", default="1", help="job phase: trainer group sizes to run, comma-separated (1: per rank)")
    p.add_argument("--steps", type=int, default=3, help="job phase: steps")
    p.add_argument("--one-request", action="store_true",
                   help="job phase: written carries the held wait (one request a trainer a step)")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    q = args.quick
    plan: list[tuple[str, bool, Callable]] = []  # (phase, --state, driver)
    if "register" in args.phases:
        plan += [(f"register {n}", False, lambda srv, n=n: phase_register(srv, n)) for n in (200, 1000)]
    if "step" in args.phases:
        plan += [("step 640", st, lambda srv: phase_step(srv, 64 if q else 640)) for st in (False, True)]
    if "job" in args.phases:
        sizes = (128, 16) if q else (1024, 128)
        plan += [(f"job groups {g}", st, lambda srv, g=g, one=False: phase_job(srv, *sizes, args.steps, g,
                                                                             one or args.one_request))
                 for g in (int(x) for x in args.groups.split(",")) for st in (False, True)]
    if "polls" in args.phases:
        plan += [(f"polls {k}", False, lambda srv, k=k: phase_polls(srv, k)) for k in ((500,) if q else (1000, 10000))]
    variants = [args.only] if args.only else args.variants.split(",")
    for _ in range(args.rounds):
        for name, state, fn in plan:
            for which in variants:
                if which == "before" and name == "polls 10000" and not args.before_tree:
                    continue  # a thread each on the old server: 1,000 is measured
                run = (lambda srv, fn=fn: fn(srv, one=True)) if which == "after1" and name.startswith("job") else fn
                with tempfile.TemporaryDirectory() as tmp:
                    srv = Server(which, args.before, state, tmp, args.before_tree)
                    try:
                        rows = asyncio.run(asyncio.wait_for(run(srv), 300))
                    except Exception as e:  # noqa: BLE001 - a phase the server cannot finish is a result too
                        rows = [{"phase": name, "failed": f"{type(e).__name__}: {e}"[:200]}]
                    finally:
                        srv.stop()
                for row in rows:
                    print(json.dumps({"server": which, "state": state, "load": os.getloadavg(), **row}), flush=True)


if __name__ == "__main__":
    main()
