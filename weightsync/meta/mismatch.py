"""Why a registration is refused for its model, in the words every participant of the job receives.

The MetaServer holds every participant's ``model_config`` (the model's ``config.json``); when a
registrant's model spec digest differs from a registered participant's, it rebuilds both specs
(:mod:`weightsync.spec`, no torch) and names the first canonical tensor that differs, its shape and
dtype on each side, both participants, and what to do. That reason aborts the job, so the refused
registrant and every peer already waiting fail at once with the same message.

Rebuilding a spec costs ~0.5 s for a 671B MoE config on a loaded 2-core host, so it runs on a thread
of its own (one at a time), never on the event loop, and within :data:`EXPLAIN_S`; a config the spec
module cannot read, or a slow rebuild, falls back to the digests alone. A config whose spec would be
larger than any model's is refused at registration, before anything is built: :func:`spec_size`
computes the spec's tensor count and bytes from the config's arithmetic in milliseconds (a count of
layers above :data:`MAX_LAYERS` or experts above :data:`MAX_EXPERTS` is refused before even that), and
:data:`MAX_SPEC_TENSORS` and :data:`MAX_SPEC_BYTES` bound them. Before, a 591-byte config of 4,096
layers x 65,536 experts was refused after 5 s while the server went on building 805 million tensor
records (58 s of CPU, 2.85 GB).

Every count the spec builder reads must be a JSON integer (:func:`check_counts`): the builder ``int()``s
its values, so ``"num_hidden_layers": "3000000"`` (or ``1e12``) used to pass a bound that read ints only
and was built, for 24 s on the server's event loop. A count anywhere in the config (a VLM's
``text_config`` too) is bounded whatever its JSON type, and a registration sizes its config on a thread
of its own (:func:`check_spec_size_async`). A spec that fails to build for any reason but the spec
module's own "cannot read this config" (:class:`~weightsync.errors.SpecError`) -- a ``MemoryError``
above all -- is a refusal (:class:`SpecNotBuilt`); before, it was swallowed and the config accepted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from weightsync.spec.compare import TensorDifference

log = logging.getLogger("weightsync.meta.mismatch")

EXPLAIN_S = 5.0  # the longest a refusal waits for the tensor-level reason before giving the digests
MAX_LAYERS = 4096  # configs claiming more layers (or experts) are not rebuilt: a crafted one must not
MAX_EXPERTS = 65536  # hold the server's thread for minutes

#: the most canonical tensors a registered model's spec may have (Kimi-K2, 1T parameters: ~70,000; each
#: costs ~10 us and ~1 KB to build)
MAX_SPEC_TENSORS = 1 << 18
#: the most bytes its tensors may hold (Kimi-K2 in bf16: ~2 TB)
MAX_SPEC_BYTES = 1 << 45

#: config.json keys the spec builder reads that are not counts (names, dtypes, flags; a list of layer
#: indices, checked apart); every other key it reads is ``int()``ed, so it must be a JSON integer (or null)
NOT_COUNTS = frozenset({"architectures", "model_type", "torch_dtype", "dtype", "tie_word_embeddings", "topk_method",
                        "attention_bias", "mlp_bias", "mlp_only_layers"})
#: keys holding a list of layer indices
INDEX_LISTS = frozenset({"mlp_only_layers"})

_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meta-mismatch")
#: sizes a registered config (never on the event loop); apart from ``_pool``, whose comparisons take longer
_sizer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meta-spec-size")


@dataclasses.dataclass(frozen=True)
class SpecSize:
    """What a config's spec would hold, computed without building its tensors."""

    tensors: int
    nbytes: int
    layers: int

    @property
    def too_large(self) -> bool:
        return self.tensors > MAX_SPEC_TENSORS or self.nbytes > MAX_SPEC_BYTES

    def refusal(self) -> str:
        return (f"model_config describes a model of {self.layers:,} layers, {self.tensors:,} tensors and "
                f"{self.nbytes:,} bytes, over the {MAX_SPEC_TENSORS:,} tensors and {MAX_SPEC_BYTES:,} bytes any "
                f"model spec may have here; send the model's real config.json")


class ConfigTooLarge(ValueError):
    """A config claiming more layers or experts than any model (before its layers are even listed)."""


class BadCount(ValueError):
    """A count the spec builder reads that is not a JSON integer (a string, a float, a bool)."""


class SpecNotBuilt(ValueError):
    """Building the spec failed otherwise than the spec module refusing the config (a MemoryError, say)."""


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "a boolean"
    return {str: "a string", float: "a number with a fraction or an exponent", list: "a list",
            dict: "an object"}.get(type(v), type(v).__name__)


def check_counts(cfg: Mapping[str, Any]) -> None:
    """BadCount naming the key and its value when a count the spec builder reads is not a JSON integer (null:
    absent); ConfigTooLarge when a count anywhere in ``cfg`` claims more layers or experts than any model,
    whatever its JSON type. Milliseconds; builds nothing."""
    from weightsync.spec.arch import config_keys

    for key in config_keys():
        v = cfg.get(key)
        if v is None or (key in NOT_COUNTS and key not in INDEX_LISTS):
            continue
        if key in INDEX_LISTS:
            if not isinstance(v, list) or any(type(x) is not int for x in v):
                raise BadCount(f"model_config[{key!r}] must be a list of integers (layer indices), got "
                               f"{_short(v)}")
        elif type(v) is not int:  # bool is an int subclass: refused too
            raise BadCount(f"model_config[{key!r}] must be an integer (a count), got {_short(v)} ({_json_type(v)}); "
                           f"send the model's real config.json")
    where = _too_large(cfg)
    if where is not None:
        key, v = where
        raise ConfigTooLarge(f"model_config's {key} is {_short(v)}: more than the {MAX_LAYERS:,} layers or "
                             f"{MAX_EXPERTS:,} experts any model has; send the model's real config.json")


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def spec_size(cfg: Mapping[str, Any]) -> SpecSize | None:
    """The tensor count and bytes of ``cfg``'s spec, exactly, without building its tensors: the layers are
    listed (at most :data:`MAX_LAYERS`), then the tensors of one layer of each kind are built (a MoE layer
    with one expert and with two: its tensors grow linearly with its experts) and multiplied out. None when
    the spec module cannot read ``cfg`` (a SpecError: then no spec is built from it either); BadCount or
    ConfigTooLarge (:func:`check_counts`) before anything is built; SpecNotBuilt when building failed any
    other way (a MemoryError: refused, never taken for "cannot read")."""
    check_counts(cfg)
    from weightsync.errors import SpecError
    from weightsync.spec.model import spec_from_config

    try:
        spec = spec_from_config(cfg)
        base = dataclasses.replace(spec, layers=())

        def measure(layers: tuple) -> tuple[int, int]:
            ts = dataclasses.replace(base, layers=layers).tensors
            return len(ts), sum(t.nbytes for t in ts)

        n0, b0 = measure(())
        tensors, nbytes = n0, b0
        for layer, count in Counter(dataclasses.replace(x, index=0) for x in spec.layers).items():
            if layer.moe and layer.num_experts > 2:
                n1, b1 = measure((dataclasses.replace(layer, num_experts=1),))
                n2, b2 = measure((dataclasses.replace(layer, num_experts=2),))
                n, b = n1 + (n2 - n1) * (layer.num_experts - 1), b1 + (b2 - b1) * (layer.num_experts - 1)
            else:
                n, b = measure((layer,))
            tensors += count * (n - n0)
            nbytes += count * (b - b0)
    except SpecError as e:  # a config the spec module cannot read: no spec is built from it
        log.debug("spec size of a model config not computed (%s)", e)
        return None
    except Exception as e:  # noqa: BLE001 - MemoryError, RecursionError, a count the builder chokes on: refused
        raise SpecNotBuilt(f"model_config's spec could not be built ({type(e).__name__}: {str(e)[:200]}); send the "
                           f"model's real config.json") from None
    return SpecSize(tensors, nbytes, len(spec.layers))


def check_spec_size(cfg: Mapping[str, Any]) -> None:
    """ValueError (its message says why) when ``cfg``'s spec would be larger than any model's, or has a count
    that is not an integer, or could not be built. Every participant of a job registers the same config: it is
    sized once (~4 ms for a MoE), not per rank."""
    size = _sized(json.dumps(cfg, sort_keys=True))
    if size is not None and size.too_large:
        raise ValueError(size.refusal())


async def check_spec_size_async(cfg: Mapping[str, Any]) -> None:
    """:func:`check_spec_size` on a thread of its own: the event loop, which serves every job, never builds
    any part of a spec (the registration checked its counts first: :func:`check_counts`, milliseconds)."""
    text = json.dumps(cfg, sort_keys=True)
    try:
        size = await asyncio.get_running_loop().run_in_executor(_sizer, _sized, text)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a MemoryError outside the builder (parsing the copy): refused too
        raise SpecNotBuilt(f"model_config could not be sized ({type(e).__name__}: {str(e)[:200]})") from None
    if size is not None and size.too_large:
        raise ValueError(size.refusal())


@functools.lru_cache(maxsize=64)
def _sized(config_json: str) -> SpecSize | None:
    return spec_size(json.loads(config_json))


def who(name: str) -> str:
    """A participant's name (``train:3``, ``infer:1:0``) in words."""
    parts = name.split(":")
    if parts[0] == "infer" and len(parts) == 3:
        return f"inference rank {parts[2]} of instance {parts[1]}"
    return f"training rank {parts[-1]}" if parts[0] == "train" else name


def digest_reason(name: str, rec: Mapping[str, Any], other: str, orec: Mapping[str, Any]) -> str:
    """The refusal's first sentence: who has which model spec (always given; the tensor follows when known)."""
    return (f"{who(name)} ({name}) has model spec {rec['spec_digest']} but {who(other)} ({other}) has "
            f"{orec['spec_digest']}: both ends must load the same model")


def _model(rec: Mapping[str, Any]) -> str:
    m = rec.get("model")
    return m if isinstance(m, str) and m else "its model"


def _magnitude(v: Any) -> float | None:
    """What a count would be read as, whatever its JSON type: an int, a float, a numeric string (None: none)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v) if not isinstance(v, int) or v.bit_length() < 1000 else float("inf")
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            return None
    return None


def _too_large(cfg: Mapping[str, Any]) -> tuple[str, Any] | None:
    """The first count no real model has, as (its dotted key, its value), nested configs included (a VLM's
    text_config), whatever its JSON type ("3000000" and 1e12 as much as 3000000); None when there is none."""
    stack: list[tuple[Any, str]] = [(cfg, "")]
    while stack:
        d, path = stack.pop()
        if isinstance(d, Mapping):
            for k, v in d.items():
                key, where = str(k).lower(), f"{path}.{k}" if path else str(k)
                m = _magnitude(v)
                if m is not None and (("layer" in key and m > MAX_LAYERS) or ("expert" in key and m > MAX_EXPERTS)):
                    return where, v
                if isinstance(v, (Mapping, list)):
                    stack.append((v, where))
        elif isinstance(d, list):
            stack.extend((x, f"{path}[{i}]") for i, x in enumerate(d))
    return None


def tensor_reason(name: str, rec: Mapping[str, Any], other: str, orec: Mapping[str, Any]) -> str | None:
    """The first differing tensor in words (both sides' shapes and dtypes, both participants), or None
    when the configs cannot be compared (runs on a worker thread: it imports and builds specs)."""
    from weightsync.spec.compare import tensor_difference
    from weightsync.spec.model import spec_from_config

    cfg, ocfg = rec.get("model_config") or {}, orec.get("model_config") or {}
    if not cfg or not ocfg:
        return None
    for c in (cfg, ocfg):  # registration refused these already; a record saved by an older server may hold one
        try:
            size = spec_size(c)
        except ValueError:  # ConfigTooLarge, BadCount, SpecNotBuilt
            return None
        if size is None or size.too_large:
            return None
    mine, theirs = spec_from_config(cfg, name=_model(rec)), spec_from_config(ocfg, name=_model(orec))
    d = tensor_difference(mine, theirs)
    if d is None:
        return None
    a, b = model_labels(mine.name, cfg, theirs.name, ocfg)
    return f"{difference_words(d, who(name), a, who(other), b)}. {_AGAIN}"


#: config.json keys that say nothing of the model's tensors
_NOT_SHAPES = frozenset({"architectures", "model_type", "transformers_version", "auto_map"})


def model_labels(a_name: str, a_cfg: Mapping[str, Any], b_name: str, b_cfg: Mapping[str, Any],
                 most: int = 3) -> tuple[str, str]:
    """Each side's model in words: its name, and where the names do not tell them apart (two configs both
    named by their model_type, "llama"), the first ``most`` config.json values that differ ("llama,
    hidden_size=128, num_attention_heads=2, ..." against "llama, hidden_size=64, num_attention_heads=8, ...")."""
    if a_name != b_name:
        return a_name, b_name
    keys = [k for k in a_cfg if not k.startswith("_") and k not in _NOT_SHAPES and _scalar(a_cfg.get(k))
            and _scalar(b_cfg.get(k)) and a_cfg.get(k) != b_cfg.get(k)]
    keys += [k for k in b_cfg if k not in a_cfg and not k.startswith("_") and k not in _NOT_SHAPES
             and _scalar(b_cfg[k])]
    more = ", ..." if len(keys) > most else ""

    def label(name: str, cfg: Mapping[str, Any]) -> str:
        shown = ", ".join(f"{k}={_value(cfg.get(k))}" for k in keys[:most])
        return f"{name}, {shown}{more}" if shown else name

    return label(a_name, a_cfg), label(b_name, b_cfg)


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _value(v: Any) -> str:
    return v[:40] if isinstance(v, str) else _short(v)


_AGAIN = "Then start the job again (under a new job id, or delete this one: it stays aborted)"


def difference_words(d: TensorDifference, a: str, a_model: str, b: str, b_model: str) -> str:
    """The first differing tensor in words, each side named by its rank and role (``a``, ``b``: "training rank
    0") and model: by its dtype when only the dtype differs (both sides' models may be named alike, "llama"),
    else by its shape and dtype, or as absent on one side; and what to do."""
    if d.mine_shape is not None and d.mine_shape == d.theirs_shape:
        return (f"the first tensor that differs is {d.name}, by its dtype: {d.mine_dtype} on {a} ({a_model}) but "
                f"{d.theirs_dtype} on {b} ({b_model}), shape {list(d.mine_shape)} on both: load the model in "
                f"the same dtype on every side (the torch_dtype of config.json, or the engine's dtype option)")

    def side(shape: tuple[int, ...] | None, dtype: str | None, whom: str, model: str) -> str:
        held = "absent" if shape is None else f"shape {list(shape)}, dtype {dtype}"
        return f"{held} on {whom} ({model})"

    return (f"the first tensor that differs is {d.name}: {side(d.mine_shape, d.mine_dtype, a, a_model)}; "
            f"{side(d.theirs_shape, d.theirs_dtype, b, b_model)}: give every trainer and every instance the same "
            f"model (the same config.json)")


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
