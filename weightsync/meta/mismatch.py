"""Why a registration is refused for its model, in the words every participant of the job receives.

The MetaServer holds every participant's ``model_config`` (the model's ``config.json``); when a
registrant's model spec digest differs from a registered participant's, it rebuilds both specs
(:mod:`weightsync.spec`, no torch) and names the first canonical tensor that differs, its shape and
dtype on each side, both participants, and what to do. That reason aborts the job, so the refused
registrant and every peer already waiting fail at once with the same message.

Rebuilding a spec costs ~0.5 s for a 671B MoE config on a loaded 2-core host, so it runs on a thread
of its own (one at a time), never on the event loop, and within :data:`EXPLAIN_S`; a config too
large to be a model (:data:`MAX_LAYERS`, :data:`MAX_EXPERTS`), one the spec module cannot read, or
a slow rebuild falls back to the digests alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, Mapping

log = logging.getLogger("weightsync.meta.mismatch")

EXPLAIN_S = 5.0  # the longest a refusal waits for the tensor-level reason before giving the digests
MAX_LAYERS = 4096  # configs claiming more layers (or experts) are not rebuilt: a crafted one must not
MAX_EXPERTS = 65536  # hold the server's thread for minutes

_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meta-mismatch")


def who(name: str) -> str:
    """A participant's name (``train:3``, ``infer:1:0``) in words."""
    parts = name.split(":")
    if parts[0] == "infer" and len(parts) == 3:
        return f"inference rank {parts[2]} of instance {parts[1]}"
    return f"training rank {parts[-1]}" if parts[0] == "train" else name


def digest_reason(name: str, rec: Mapping[str, Any], other: str, orec: Mapping[str, Any]) -> str:
    """The refusal's first sentence: who has which model spec (always given; the tensor follows when known)."""
    return (f"{name} has model spec {rec['spec_digest']} but {other} has {orec['spec_digest']}: both ends must "
            f"load the same model")


def _model(rec: Mapping[str, Any]) -> str:
    m = rec.get("engine_config", {}).get("model")
    return m if isinstance(m, str) and m else "its model"


def _too_large(cfg: Mapping[str, Any]) -> bool:
    """Counts no real model has (nested configs included: a VLM's text_config)."""
    stack: list[Any] = [cfg]
    while stack:
        d = stack.pop()
        if isinstance(d, Mapping):
            for k, v in d.items():
                key = str(k).lower()
                if isinstance(v, int) and not isinstance(v, bool) and (
                        ("layer" in key and v > MAX_LAYERS) or ("expert" in key and v > MAX_EXPERTS)):
                    return True
                if isinstance(v, (Mapping, list)):
                    stack.append(v)
        elif isinstance(d, list):
            stack.extend(d)
    return False


def tensor_reason(name: str, rec: Mapping[str, Any], other: str, orec: Mapping[str, Any]) -> str | None:
    """The first differing tensor in words (both sides' shapes and dtypes, both participants), or None
    when the configs cannot be compared (runs on a worker thread: it imports and builds specs)."""
    from weightsync.spec.compare import tensor_difference
    from weightsync.spec.model import spec_from_config

    cfg, ocfg = rec.get("model_config") or {}, orec.get("model_config") or {}
    if not cfg or not ocfg or _too_large(cfg) or _too_large(ocfg):
        return None
    mine, theirs = spec_from_config(cfg, name=_model(rec)), spec_from_config(ocfg, name=_model(orec))
    d = tensor_difference(mine, theirs)
    if d is None:
        return None
    a, b = who(name), who(other)

    def side(shape: tuple[int, ...] | None, dtype: str | None, whom: str, model: str) -> str:
        held = "absent" if shape is None else f"{list(shape)} {dtype}"
        return f"{held} on {whom} ({model})"

    return (f"the first tensor that differs is {d.name}: {side(d.mine_shape, d.mine_dtype, a, mine.name)}, "
            f"{side(d.theirs_shape, d.theirs_dtype, b, theirs.name)}. Give every trainer and every instance the "
            f"same model (the same config.json), then start the job again (under a new job id, or delete this "
            f"one: it stays aborted)")


async def refusal(name: str, rec: Mapping[str, Any], other: str, orec: Mapping[str, Any]) -> str:
    """The reason a registration is refused for its model: the digests, and the first differing tensor
    when it can be found within :data:`EXPLAIN_S`."""
    base = digest_reason(name, rec, other, orec)
    loop = asyncio.get_running_loop()
    try:
        detail = await asyncio.wait_for(loop.run_in_executor(_pool, tensor_reason, name, rec, other, orec), EXPLAIN_S)
    except asyncio.TimeoutError:
        log.warning("refusing %s: its spec was not compared with %s's within %g s; giving the digests", name, other,
                    EXPLAIN_S)
        return base
    except Exception as e:  # noqa: BLE001 - a config the spec module cannot read: the digests still say it
        log.info("refusing %s: its model config was not compared with %s's (%s: %s)", name, other,
                 type(e).__name__, e)
        return base
    return f"{base}; {detail}" if detail else base
