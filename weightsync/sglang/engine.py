"""A real SGLang engine that weightsync itself starts and owns, as the receiver of a local job.

The bench (``weightsync bench --receiver sglang``), the demo (``weightsync demo --engines real --infer
sglang:tp=1``) and benchmarks/sglang_gpu.py put a real ``sglang.Engine`` where they otherwise put a
layout-faithful worker: started with weightsync's loader (``custom_weight_loader=[RPC_LOADER]``), behind an
unchanged :class:`~weightsync.instances.sglang.SGLangInstance`. The first step overwrites every weight, so the
engine starts on the model's ``config.json`` alone with ``load_format="dummy"`` unless a checkpoint is given.

Options as the SGLang GPU kit (0.5.14, one H200) runs them: Triton attention (the kit carries no FA3),
PyTorch sampling, no tokenizer (token ids in and out), decode CUDA graphs for batch sizes 1-8 unless
``eager``, the prefill (piecewise, torch.compile) graph off. Memory: SGLang sizes its KV pool from the free
memory it sees while loading (0.5.14 ``model_runner_kv_cache_mixin.py:_profile_available_bytes``: free now
minus ``(1 - mem_fraction_static)`` x free before loading), which a co-located trainer allocating at the same
time disturbs; a large ``mem_fraction_static`` with ``max_total_tokens`` capping the pool keeps the pool
small and the start robust. Argument names differ between versions (``cuda_graph_max_bs`` became
``cuda_graph_max_bs_decode`` by 0.5.14): :meth:`EngineOptions.engine_args` uses the ones this SGLang has.
SGLang spawns its scheduler processes: start this from an import-safe main module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from weightsync.engines import make_layout
from weightsync.errors import ConfigError
from weightsync.instances.owned import Owned, config_dir, discard
from weightsync.sglang import RPC_LOADER
from weightsync.spec.model import spec_from_config

log = logging.getLogger("weightsync.sglang")

#: greedy-decoding prompts (token ids): fixed, so two engines can be compared
PROMPTS = ([3, 17, 42, 99, 7, 128], [200, 5, 61, 11], [1, 2, 3])
MAX_TOKENS = 8


@dataclass(frozen=True)
class EngineOptions:
    """How to start one engine."""

    eager: bool = False  # False: decode CUDA graphs for batch sizes 1-8
    mem_fraction_static: float = 0.5
    max_total_tokens: int = 16384  # caps the KV pool (tokens)
    loader: bool = True  # start with weightsync's custom_weight_loader (False: an engine weightsync must refuse)
    log_level: str = "warning"
    extra: dict[str, Any] = field(default_factory=dict)  # any other sgl.Engine(...) argument

    def engine_args(self, model_path: str, tp: int, dummy: bool, dtype: str = "bfloat16") -> dict[str, Any]:
        from sglang.srt.server_args import ServerArgs

        have = {f.name for f in dataclasses.fields(ServerArgs)}
        args: dict[str, Any] = dict(model_path=model_path, dtype=dtype, tp_size=tp, attention_backend="triton",
                                    sampling_backend="pytorch", skip_tokenizer_init=True, random_seed=0,
                                    mem_fraction_static=self.mem_fraction_static,
                                    max_total_tokens=self.max_total_tokens, log_level=self.log_level)
        if self.loader:
            args["custom_weight_loader"] = [RPC_LOADER]
        if dummy:
            args["load_format"] = "dummy"
        if "disable_flashinfer_autotune" in have:
            args["disable_flashinfer_autotune"] = True
        if self.eager:
            args["disable_cuda_graph"] = True
        else:
            args["cuda_graph_max_bs_decode" if "cuda_graph_max_bs_decode" in have else "cuda_graph_max_bs"] = 8
        if "disable_prefill_cuda_graph" in have:
            args["disable_prefill_cuda_graph"] = True
        args.update(self.extra)
        unknown = sorted(k for k in args if k not in have)
        if unknown:
            raise ConfigError(f"this SGLang's ServerArgs has no {unknown}: drop them from EngineOptions.extra")
        return args


def generate(engine: Any, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Greedy tokens of ``prompts`` (token ids in, token ids out)."""
    outs = engine.generate(input_ids=[list(p) for p in prompts],
                           sampling_params={"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True})
    return [list(o["output_ids"]) for o in outs]


class OwnedEngine(Owned):
    """An ``sglang.Engine`` this process started, its :class:`SGLangInstance`, and what to remove when it stops."""

    def __init__(self, engine: Any, workdir: str | None, startup_s: float, timeout_s: float = 600.0):
        from weightsync.instances.sglang import SGLangInstance

        self.engine, self.workdir, self.startup_s = engine, workdir, startup_s
        self.instance = SGLangInstance(engine, timeout_s=timeout_s)
        if workdir is not None:  # dummy weights: zero what no step writes (vocab padding), as a checkpoint load leaves it
            self.instance.call(zero_unwritten, dict(self.instance.model_config), self.instance.engine)

    def tokens(self) -> list[list[int]]:
        return generate(self.engine)

    def digests(self) -> list[dict[str, str]]:
        """Per worker, a digest of every tensor it computes with (:func:`weightsync.sglang.verify.computed`)."""
        from weightsync.sglang.verify import computed_digests

        return self.instance.call(computed_digests)

    def shutdown(self) -> None:
        stop(self.engine)


def zero_unwritten(ctx: Any, model_config: dict, engine: str) -> int:
    """On a worker: zero every element of the layout's tensors that no piece covers (vocab padding rows, which a
    checkpoint load leaves zero and dummy weights random); returns how many tensors had any."""
    from weightsync.layout.materialize import zero_uncovered
    from weightsync.sglang.verify import held_layout

    return zero_uncovered(held_layout(model_config, engine).layout(ctx.rank), ctx.tensors)


def stop(engine: Any) -> None:
    """Shut the engine's processes down now."""
    with contextlib.suppress(Exception):
        engine.shutdown()
    gc.collect()


def check_engine(model_config: dict[str, Any], engine: str) -> int:
    """Refuse, in one line and before anything starts, a real SGLang engine that cannot run here or that weightsync
    cannot sync; returns its TP size. (What only the live engine shows is refused again at set-up, by layer.)"""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise ConfigError("a real SGLang engine needs SGLang on a CUDA GPU host (it has no CPU build): put the SGLang "
                          "GPU kit on the path (../shared/sglang-gpu-kit, `. .sgkit/go.sh`)")
    spec = spec_from_config(model_config)
    layout = make_layout(spec, engine)
    if layout.engine != "sglang":
        raise ConfigError(f"{engine!r} is not an sglang layout")
    cfg = layout.config
    if cfg.dp != 1 or cfg.ep != 1 or cfg.dp_attention:
        raise ConfigError(f"{engine}: a real SGLang engine here takes tp only (dp={cfg.dp}, ep={cfg.ep}); start one "
                          "engine per data-parallel rank")
    import torch

    if torch.cuda.device_count() < cfg.tp:
        raise ConfigError(f"{engine}: needs {cfg.tp} CUDA GPUs, {torch.cuda.device_count()} visible (SGLang has no "
                          "CPU build)")
    return cfg.tp


def start(model_config: dict[str, Any], engine: str, options: EngineOptions = EngineOptions(),
          checkpoint: str | None = None, timeout_s: float = 600.0) -> OwnedEngine:
    """Start a real SGLang engine for the inference layout ``engine`` (``sglang:tp=N``) of ``model_config``: on
    ``checkpoint`` (an HF folder) if given, else on dummy weights. Refuses what it cannot start."""
    tp = check_engine(model_config, engine)
    workdir = None
    if checkpoint is None:
        workdir = tempfile.mkdtemp(prefix="weightsync-sglang-model-")
        checkpoint = config_dir(model_config, workdir)
    import sglang

    t0 = time.perf_counter()
    dtype = str(model_config.get("torch_dtype") or model_config.get("dtype") or "bfloat16")
    try:
        eng = sglang.Engine(**options.engine_args(checkpoint, tp, dummy=workdir is not None, dtype=dtype))
    except BaseException:
        discard(workdir)
        raise
    startup = time.perf_counter() - t0
    log.info("SGLang %s %s started in %.1f s on %s", sglang.__version__, engine, startup,
             "dummy weights" if workdir else checkpoint)
    try:
        return OwnedEngine(eng, workdir, startup, timeout_s)
    except BaseException:
        stop(eng)
        discard(workdir)
        raise


__all__ = ["EngineOptions", "OwnedEngine", "start", "stop", "check_engine", "config_dir", "generate", "zero_unwritten",
           "PROMPTS", "MAX_TOKENS"]
