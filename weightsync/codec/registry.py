"""Every codec by name, the one place a job's codec is chosen, and the set-up check that a transport serves it.

A participant asks for a codec by name (``codec=`` on a writer or reader; ``delta=True`` is the older spelling of
``codec="delta"``): :func:`requested`. Once the job is agreed, the engine may decide (an engine declared
``quant=fp8`` takes the fp8 codec where the full one was asked): :func:`job_codec_name`; the codec is then made for
the job (:func:`make_job_codec`, each codec's :meth:`~weightsync.payload.codec.Codec.for_job`). The session and
``weightsync plan`` ask here; the simulator keeps its own size rules for the codecs it models (full, fp8, delta).

A new codec is one module (an :class:`~weightsync.payload.codec.Codec` with its two sides) and one line in
:data:`CODECS`; a transport says what it serves per mode in its registry entry
(:attr:`weightsync.transport.base.TransportEntry.serves`).
"""

from __future__ import annotations

import importlib

from weightsync.payload.codec import Codec, CodecJob
from weightsync.engines.config import engine_quant
from weightsync.errors import ConfigError
from weightsync.transport.base import SOURCES, TRANSPORTS

#: every codec, imported only when a job uses it
CODECS: dict[str, str] = {
    "full": "weightsync.codec.full:FullCodec",
    "delta": "weightsync.codec.delta:DeltaCodec",
    "fp8": "weightsync.codec.fp8:FP8Codec",  # chosen by an engine declared quant=fp8 (job_codec_name)
    "cast": "weightsync.codec.cast:CastCodec",  # each copy in the narrower dtype: an fp32 master into a bf16 engine
}

#: why a codec gains nothing where a transport lacks what it needs (said beside the refusal)
_WHY = {("delta", "colocated"): "delta gains nothing co-located (the workers copy GPU memory, no link is crossed)"}


def codec_class(name: str) -> type[Codec]:
    path = CODECS.get(name)
    if path is None:
        raise ConfigError(f"unknown codec {name!r}; known: {', '.join(CODECS)}")
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def make_codec(name: str, **options) -> Codec:
    """The codec ``name`` with its options (delta: ``host``)."""
    return codec_class(name)(**options)


def requested(codec: str | None, delta: bool = False) -> str:
    """The codec a participant's options ask for: ``codec`` by name, or ``delta=True`` (kept: the older spelling of
    ``codec="delta"``), else the full codec; an unknown name, or the two spellings asking for two codecs, refused."""
    if codec is None:
        return "delta" if delta else "full"
    codec_class(codec)  # an unknown name: refused, naming the known ones
    if delta and codec != "delta":
        raise ConfigError(f"delta=True asks for the delta codec and codec={codec!r} for another; pass one of them")
    return codec


def job_codec_name(asked: str, infer: str, transport: str, mode: str, integrity: int = 0) -> str:
    """The job's codec, once the agreed shape names the engine (``infer``): what the options asked, except that an
    engine declared ``quant=fp8`` is served by the fp8 codec only (asked for the full codec: fp8 in its place;
    another refused by :func:`check_engine`, saying why), and the fp8 codec serves no other
    engine. Refused at set-up, before any byte moves."""
    if engine_quant(infer) == "none":
        if asked == "fp8":
            raise ConfigError(f"the fp8 codec lands block-FP8 weights and their scales, and {infer} is not declared "
                              "quant=fp8: declare the engine's quantization (quant=fp8) or use the full codec")
        return asked
    check_engine(infer, asked, transport, mode, integrity)
    return "fp8"


def make_job_codec(name: str, job: CodecJob) -> Codec:
    """Codec ``name`` made for ``job`` (:meth:`~weightsync.payload.codec.Codec.for_job`)."""
    return codec_class(name).for_job(job)


def _served(cls: type[Codec], transport: str, mode: str) -> bool:
    """Whether ``transport`` in ``mode`` runs codec ``cls``: it serves what the codec needs, or it lets the
    receiver read the sources in place (:data:`SOURCES`, co-located) and the codec lands from them itself (its
    ``land``: the full and fp8 codecs; a delta has no base to land against there); and the codec names no
    narrower list (its ``runs_on``, ``(transport, mode)`` pairs: what was built and tested for it)."""
    serves = TRANSPORTS[transport].serves.get(mode, frozenset())
    if not (cls.needs <= serves or (getattr(cls, "lands", False) and SOURCES in serves)):
        return False
    only = getattr(cls, "runs_on", None)
    return only is None or (transport, mode) in only


def serving(name: str) -> list[str]:
    """Where codec ``name`` runs: ``transport/mode`` for every transport and mode serving it."""
    cls = codec_class(name)
    return [f"{t}/{m}" for t, e in TRANSPORTS.items() for m in sorted(e.modes) if _served(cls, t, m)]


def check(name: str, transport: str, mode: str) -> None:
    """Refuse, at set-up and by name, codec ``name`` over a ``transport`` and ``mode`` that do not serve
    what it needs (or that the codec was not built for), saying where it runs."""
    cls = codec_class(name)
    if _served(cls, transport, mode):
        return
    missing = cls.needs - TRANSPORTS[transport].serves.get(mode, frozenset())
    if not missing:  # served, but not built for it
        why = getattr(cls, "why_not", {}).get((transport, mode), "not built for it")
        raise ConfigError(f"the {name} codec does not run over the {transport} transport in {mode} mode ({why}); "
                          f"it runs over {', '.join(serving(name))}: use one of those, or the full codec")
    why = _WHY.get((name, transport))
    raise ConfigError(f"the {name} codec needs {' and '.join(sorted(missing))}, which the {transport} transport "
                      f"does not serve in {mode} mode" + (f" ({why})" if why else "")
                      + f"; the {name} codec runs over {', '.join(serving(name))}: use one of those, or the full codec")


def check_engine(infer: str, codec: str, transport: str, mode: str, integrity: int = 0) -> None:
    """Refuse, at set-up, a job whose inference engine is declared ``quant=fp8`` where the fp8 codec cannot run
    (``codec``: the codec the session's own options chose, full or delta; ``transport``/``mode``: the agreed ones,
    checked as :func:`weightsync.codec.registry.check` checks the fp8 codec; ``integrity``: the agreed cadence)."""
    if engine_quant(infer) == "none":
        return
    why = None
    if codec == "delta":
        why = "delta and FP8 together are not built (a delta of the e4m3 bytes); drop delta"
    elif codec not in ("full", "fp8"):
        why = f"the {codec} codec lands other bytes than an FP8-served engine holds; use the full codec"
    elif integrity:
        why = ("integrity sums cover the trainer's bf16 bytes, not the FP8 bytes and scales that land; "
               "set integrity=0")
    else:
        try:
            check("fp8", transport, mode)
        except ConfigError as e:
            why = str(e)
    if why:
        raise ConfigError(f"quant=fp8 needs the fp8 codec, which cannot run in this job ({infer}; {transport} "
                          f"transport, {mode} mode, {codec} codec): {why}. Syncing bf16 weights into an FP8-served "
                          "engine would cast them to e4m3 without their block scales")
