"""Every codec by name, and the set-up check that a transport serves what a codec needs.

A new codec is one module (an :class:`~weightsync.payload.codec.Codec` with its two sides) and one line in
:data:`CODECS`; a transport says what it serves per mode in its registry entry
(:attr:`weightsync.transport.base.TransportEntry.serves`).
"""

from __future__ import annotations

import importlib

from weightsync.payload.codec import Codec
from weightsync.errors import ConfigError
from weightsync.transport.base import SOURCES, TRANSPORTS

#: every codec, imported only when a job uses it
CODECS: dict[str, str] = {
    "full": "weightsync.codec.full:FullCodec",
    "delta": "weightsync.codec.delta:DeltaCodec",
    "fp8": "weightsync.codec.fp8:FP8Codec",  # chosen by an engine declared quant=fp8 (codec/fp8.fp8_options)
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
