"""Which asyncio HTTP stack for the MetaServer? The same two routes on each, measured on this machine.

    .venv/bin/python benchmarks/meta_stack.py [--n 1000] [--polls 5000]

Candidates: aiohttp's web server, and uvicorn (httptools parser) serving a Starlette app. Each runs in
its own process with the MetaServer's shape of work: ``POST /v1/post`` parses a ~1 KB JSON body and
answers a small JSON object; ``GET /v1/wait`` is a long-poll woken by ``POST /v1/wake``; ``GET
/health``. Phases (raw HTTP from ``meta_loadgen``, no retries): N clients connecting and posting at
once; N long-polls held open, ``/health`` probed while they wait, then all woken at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from meta_loadgen import Conn, Result, at_once, cpu_seconds, request_bytes  # noqa: E402

BODY = {"role": "train", "rank": 1, "engine_config": {"engine": "megatron:tp=8,pp=4", "world": 1024},
        "model_config": {f"key_{i}": i * 1.5 for i in range(40)}}


def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    wake = asyncio.Event()

    async def post(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        return web.Response(body=json.dumps({"name": f"train:{body['rank']}", "created": True}).encode(),
                            content_type="application/json")

    async def wait(request: web.Request) -> web.Response:
        await wake.wait()
        return web.Response(body=b'{"ready": true}', content_type="application/json")

    async def do_wake(request: web.Request) -> web.Response:
        await request.read()
        wake.set()
        return web.Response(body=b"{}", content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b'{"status": "ok"}', content_type="application/json")

    app = web.Application()
    app.add_routes([web.post("/v1/post", post), web.get("/v1/wait", wait), web.post("/v1/wake", do_wake),
                    web.get("/health", health)])
    web.run_app(app, host="127.0.0.1", port=port, backlog=4096, print=None, access_log=None,
                handle_signals=True)


def serve_uvicorn(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    wake = asyncio.Event()

    async def post(request):
        body = json.loads(await request.body())
        return Response(json.dumps({"name": f"train:{body['rank']}", "created": True}), media_type="application/json")

    async def wait(request):
        await wake.wait()
        return Response(b'{"ready": true}', media_type="application/json")

    async def do_wake(request):
        await request.body()
        wake.set()
        return Response(b"{}", media_type="application/json")

    async def health(request):
        return Response(b'{"status": "ok"}', media_type="application/json")

    app = Starlette(routes=[Route("/v1/post", post, methods=["POST"]), Route("/v1/wait", wait),
                            Route("/v1/wake", do_wake, methods=["POST"]), Route("/health", health)])
    uvicorn.run(app, host="127.0.0.1", port=port, backlog=4096, log_level="warning", access_log=False,
                http="httptools", loop="asyncio", limit_concurrency=None, timeout_keep_alive=60)


async def _wait_up(port: int) -> None:
    for _ in range(200):
        try:
            c = await Conn.open("127.0.0.1", port)
            await c.call(request_bytes("GET", "/health"))
            c.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError("server did not start")


async def _drive(port: int, pid: int, n: int, polls: int) -> list[dict]:
    await _wait_up(port)
    out = []
    post = request_bytes("POST", "/v1/post", BODY)
    out.append((await at_once(f"{n} connect+POST at once", "127.0.0.1", port, [[post]] * n, pid)).summary())
    out.append((await at_once(f"{n} x 5 POSTs kept alive", "127.0.0.1", port, [[post] * 5] * n, pid)).summary())

    # long-polls held open, /health probed meanwhile, then one wake answers them all
    conns = []
    for _ in range(polls):
        conns.append(await Conn.open("127.0.0.1", port))
    waiting = [asyncio.create_task(c.call(request_bytes("GET", "/v1/wait"))) for c in conns]
    await asyncio.sleep(1.0)
    health = Result(f"/health with {polls} long-polls open")
    probe = await Conn.open("127.0.0.1", port)
    for _ in range(20):
        t0 = time.perf_counter()
        status, _ = await probe.call(request_bytes("GET", "/health"))
        health.latencies.append(time.perf_counter() - t0)
    out.append(health.summary())
    woke = Result(f"{polls} long-polls woken at once", server_cpu_s=None)
    cpu0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    await probe.call(request_bytes("POST", "/v1/wake", {}))
    for w in asyncio.as_completed(waiting):
        status, _ = await w
        woke.latencies.append(time.perf_counter() - t0)
    woke.wall_s = time.perf_counter() - t0
    woke.server_cpu_s = cpu_seconds(pid) - cpu0
    out.append(woke.summary())
    for c in conns + [probe]:
        c.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--polls", type=int, default=5000)
    p.add_argument("--stacks", default="aiohttp,uvicorn")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=18765)
    args = p.parse_args()
    if args.serve:
        {"aiohttp": serve_aiohttp, "uvicorn": serve_uvicorn}[args.serve](args.port)
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    for stack in args.stacks.split(","):
        proc = subprocess.Popen([sys.executable, __file__, "--serve", stack, "--port", str(args.port)])
        try:
            for row in asyncio.run(_drive(args.port, proc.pid, args.n, args.polls)):
                print(json.dumps({"stack": stack, **row}), flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
