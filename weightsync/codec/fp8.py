"""The fp8 codec: bf16/fp32 trainer weights sent as 128 x 128 block FP8 into an FP8-served engine.

Set-up refusal (:func:`check_engine`): an inference engine declared ``quant=fp8`` holds its linear weights in
e4m3 with fp32 ``weight_scale_inv``; syncing the trainer's bf16 bytes into it would cast them to e4m3 without
their scales. Until a job can run the fp8 codec, such a job is refused at set-up on every side, by name.
"""

from __future__ import annotations

from weightsync.engines.config import parse_engine
from weightsync.errors import ConfigError


def engine_quant(infer: str) -> str:
    """The quantization an inference layout string (``vllm:tp=2,quant=fp8``) declares: ``none`` or ``fp8``."""
    cfg = parse_engine(infer)
    q = getattr(cfg, "quant", 0)
    return "fp8" if q else "none"


def check_engine(infer: str, codec: str, transport: str, mode: str) -> None:
    """Refuse, at set-up, a job whose inference engine is declared ``quant=fp8`` where the fp8 codec cannot
    run (``codec``: the codec the session chose; ``transport``/``mode``: the agreed ones)."""
    if engine_quant(infer) == "none":
        return
    raise ConfigError(f"quant=fp8 needs the fp8 codec, which this weightsync cannot run yet ({infer}; "
                      f"{transport} transport, {mode} mode, {codec} codec): syncing bf16 weights into an FP8-served "
                      "engine would cast them to e4m3 without their block scales; serve the engine unquantized "
                      "(drop quant=fp8)")


__all__ = ["check_engine", "engine_quant"]
