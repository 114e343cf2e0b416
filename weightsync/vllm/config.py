"""What a vLLM engine is, as weightsync sees it: its layout string, its model, its dtype.

Both entry points (the offline :class:`~weightsync.instances.vllm.VLLMInstance` in the driver, the
plug-in backend inside every worker) derive the same :class:`EngineInfo` from the engine's own
``VllmConfig``, so the control side and each worker agree on the layout without exchanging it.

The model dtype is the engine's (``model_config.dtype``), not the checkpoint's: an engine started
with ``dtype="float32"`` on a bf16 checkpoint holds fp32 parameters, and its layout says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from weightsync.errors import ConfigError
from weightsync.plan.planner import DEFAULT_BUCKET_BYTES
from weightsync.runtime.job import DEFAULT_MEMORY_BUDGET
from weightsync.transport.base import DEFAULT_WRITTEN_TIMEOUT_S


@dataclass(frozen=True)
class EngineInfo:
    """One vLLM engine's weightsync description."""

    engine: str  # the layout string, e.g. "vllm:tp=2"
    model_config: dict[str, Any]  # config.json keys of the served model, dtype set to the engine's
    dtype: str  # the engine's model dtype ("bfloat16")
    tp: int


@dataclass
class InitInfo:
    """What ``init_weight_transfer_engine({"init_info": {...}})`` carries to the backend: the WeightReader's
    options (JSON-safe, they cross vLLM's msgpack hop as a dict) and the driver's id for the call.

    One dataclass for both sides: the driver (:class:`~weightsync.vllm.driver.VLLMWeightSync`) builds it,
    the backend parses the dict into a subclass of it that is also vLLM's ``WeightTransferInitInfo``.
    Not frozen, because vLLM's base dataclass is not (a frozen dataclass cannot extend a plain one)."""

    meta: str
    job: str
    instance_id: int = 0
    instances: int = 1
    token: str | None = None
    mode: str = "sync"
    staged: bool = False
    timeout_s: float = 60.0
    written_timeout_s: float = DEFAULT_WRITTEN_TIMEOUT_S  # update(step)'s wait for the trainers to write the step
    transport: str = "p2p"
    directory: str | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    memory_budget: int | None = DEFAULT_MEMORY_BUDGET
    colocate: bool = False  # the trainers share this engine's GPUs: CUDA IPC (shared memory on CPU)
    peer_copies: bool = True
    call: str = ""  # the driver's id for this call: its status is published under it

    def as_dict(self, call: str = "") -> dict[str, Any]:
        return {**asdict(self), "call": call}

    def reader_options(self) -> dict[str, Any]:
        """The ``WeightReader`` keyword arguments (everything but ``call``)."""
        return {f.name: getattr(self, f.name) for f in fields(InitInfo) if f.name != "call"}


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def quantization(model_config: Any) -> Any:
    """The engine's quantization, read from its model config: None (unquantized) or the default
    :class:`weightsync.quant.config.BlockFP8` (128 x 128 e4m3, fp32 ``weight_scale_inv``, dynamic activations: what
    ``quant=fp8`` in an engine string means), else a ConfigError naming it -- refused before any byte moves.

    vLLM 0.26 and 0.32 read the checkpoint's ``quantization_config`` from the HF config into ``model_config.quantization``
    (``ModelConfig._verify_quantization``); an engine asked to quantize a bf16 checkpoint itself
    (``quantization="fp8"`` with no ``quantization_config``) holds per-tensor scales of its own making: refused."""
    from weightsync.quant.config import from_hf

    method = getattr(model_config, "quantization", None)
    qc = getattr(model_config.hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    if not qc:
        if method:
            raise ConfigError(f"vllm: the engine quantizes a checkpoint that is not quantized itself "
                              f"(quantization={method!r}, no quantization_config): weightsync syncs only engines "
                              "served from a block-FP8 checkpoint (save_checkpoint(dir, quant='fp8')) or unquantized")
        return None
    q = from_hf(qc)
    if q is not None and not q.plain():
        raise ConfigError(f"vllm: the engine's block-FP8 checkpoint leaves modules {list(q.ignored)[:4]} unquantized "
                          "(ignored_layers); weightsync's quant=fp8 means every linear layer in FP8: serve a "
                          "checkpoint without ignored_layers")
    return q


def describe(vllm_config: Any) -> EngineInfo:
    """The :class:`EngineInfo` of an engine, or a ConfigError for a parallel config weightsync cannot map."""
    from weightsync.instances.hf import SPEC_KEYS
    from weightsync.bind import hf_config_dict

    pc, mc = vllm_config.parallel_config, vllm_config.model_config
    tp, pp, dp = pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.data_parallel_size
    if pp != 1:
        raise ConfigError(f"vllm: pipeline_parallel_size={pp}: the vllm layout has no pipeline parallelism; "
                          "start the engine with pipeline_parallel_size=1")
    if dp != 1:
        raise ConfigError(f"vllm: data_parallel_size={dp}: weightsync drives one vLLM data-parallel rank per "
                          "instance; start one engine per instance (data_parallel_size=1)")
    ep = tp if pc.enable_expert_parallel and tp > 1 else 1
    quant = quantization(mc)
    engine = f"vllm:tp={tp}" + (f",ep={ep}" if ep > 1 else "") + (",quant=fp8" if quant is not None else "")
    dtype = dtype_name(mc.dtype)
    cfg = hf_config_dict(mc.hf_config)
    cfg = {k: cfg[k] for k in SPEC_KEYS if k in cfg and cfg[k] is not None}
    cfg["torch_dtype"] = dtype
    cfg.pop("dtype", None)
    if not cfg.get("architectures"):
        cfg["architectures"] = list(getattr(mc, "architectures", None) or [])
    return EngineInfo(engine, cfg, dtype, tp)
