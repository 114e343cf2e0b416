"""Test harness for real vLLM engines (tests/test_vllm*.py): checkpoints, engines, trainers, checks.

- :func:`checkpoint`: an HF checkpoint of a tiny preset saved by transformers' ``save_pretrained``
  from random weights (a seed), scaled so greedy decoding differs between seeds.
- :func:`start_llm`: a real multiprocess ``vllm.LLM`` on CPU (enforce_eager, 64 MiB KV cache) with
  weightsync's worker extension (for ``VLLMInstance`` and for inspecting any engine) and, when
  asked, the ``weightsync`` weight-transfer backend.
- :class:`Reference`: what a FRESH engine loaded from a checkpoint computes with
  (:func:`weightsync.vllm.verify.computed`) and its greedy tokens.
- :class:`Trainers`: training processes (``weightsync.local.trainers``: hf / fsdp / megatron) that
  write the weights of a checkpoint seed per step through a real ``WeightWriter``.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import queue
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weightsync.engines import make_layout
from weightsync.spec import load_spec
from weightsync.spec.model import ModelSpec

EXTENSION = "weightsync.vllm.extension.WeightSyncExtension"
PROMPTS = [[3, 17, 42, 99, 7, 128], [200, 5, 61, 11]]
MAX_TOKENS = 8


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
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
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
    computed: list[dict[str, torch.Tensor]]
    tokens: list[list[int]]


def reference(inst, llm, seed: int) -> Reference:
    from weightsync.vllm.verify import computed

    return Reference(seed, inst.call(computed), generate(llm))


def check_engine(inst, llm, ref: Reference, spec: ModelSpec) -> None:
    """Every loaded-form tensor bit-exact to the checkpoint, every computed tensor bit-exact to the fresh
    engine's, and the same greedy tokens."""
    from weightsync.vllm.verify import computed, differences, loaded_problems

    canonical = weights(spec, ref.seed)
    problems = [p for ps in inst.call(loaded_problems, canonical) for p in ps]
    assert not problems, problems[:10]
    got = inst.call(computed)
    for rank, (mine, fresh) in enumerate(zip(got, ref.computed)):
        diff = differences(mine, fresh)
        assert not diff, f"rank {rank}: {diff[:10]}"
        assert len(mine) > 0
    assert generate(llm) == ref.tokens


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
    extra: dict = field(default_factory=dict)


def _trainer_main(rank: int, world: int, port: int, job: TrainJob, q: Any) -> None:
    import torch.distributed as dist

    from weightsync.layout.materialize import fill_from
    from weightsync.local.trainers import build_trainer
    from weightsync.runtime.writer import WeightWriter

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=job.timeout_s))
        spec = load_spec(job.model)
        bound = build_trainer(spec, job.train, rank, world).bound
        writer = WeightWriter(bound, meta=job.meta, job=job.job, timeout_s=job.timeout_s, mode=job.mode).connect()
        for step, seed in job.steps:
            with torch.no_grad():
                fill_from(bound.layout, bound.tensors, weights(spec, seed))
            if job.die_at == step and rank == 0:
                _die_after_posts(3)
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


class Trainers:
    """The training processes of one job (spawned; killed on exit)."""

    def __init__(self, job: TrainJob):
        from weightsync.transport.group import free_port

        self.job = job
        self.world = make_layout(load_spec(job.model), job.train).world_size
        ctx = mp.get_context("spawn")
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
