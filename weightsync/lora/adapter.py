"""A LoRA adapter's canonical tensors, from its PEFT config and the base model's spec alone.

The canonical tensors of an adapter sync are the adapter's own, named as PEFT's ``save_pretrained`` writes
them (``adapter_model.safetensors``): ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
``base_model.model.<module>.lora_B.weight`` ``[out, r]`` for every adapted module. The frozen base is no
part of it. Which modules are adapted, and each one's ``in`` / ``out``, follow from the adapter's config
(``target_modules``, ``r``) and the base model's canonical tensors (each linear module's
``<module>.weight`` ``[out, in]``), so any process computes the same :class:`AdapterSpec` from the same two
inputs (:func:`adapter_spec`); a live PEFT model is checked against it when it binds
(:mod:`weightsync.lora.peft`).

What is refused, by name, before any byte moves (:func:`adapter_config`): PEFT features whose adapter is no
plain ``x @ A.T @ B.T * scaling`` on a base linear (DoRA, LoRA bias, ``bias != "none"``, ``modules_to_save``,
per-module ``rank_pattern`` / ``alpha_pattern``, ``layers_to_transform``, ``fan_in_fan_out``,
``target_parameters``, trainable tokens, layer replication, aLoRA, QALoRA, BD-LoRA, inits that modify the base
weights); and targets weightsync does not sync yet (:func:`adapter_spec`): anything but the decoder's dense
attention and MLP projections (``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``) -- embeddings,
``lm_head``, MoE experts and routers, MLA's projections. docs/lora.md says what stands and what remains.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

from weightsync.errors import ConfigError, SpecError
from weightsync.spec.model import ModelSpec

#: the HF module names an adapter may target and that weightsync syncs: module short name -> its block
PROJECTIONS: dict[str, str] = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                               "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

#: what PEFT writes before a module's name in ``adapter_model.safetensors`` (``PeftModel`` over a causal LM)
PEFT_PREFIX = "base_model.model."

#: PEFT LoRA features that make an adapter something other than plain LoRA on base linears, with their
#: neutral value; any other value is refused by name
_NEUTRAL: dict[str, Any] = {
    "use_dora": False, "lora_bias": False, "bias": "none", "modules_to_save": None, "rank_pattern": {},
    "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None, "fan_in_fan_out": False,
    "target_parameters": None, "trainable_token_indices": None, "layer_replication": None,
    "alora_invocation_tokens": None, "use_qalora": False, "use_bdlora": None, "exclude_modules": None,
}
#: ``init_lora_weights`` values that only set the adapter's first values (the base is untouched), as vLLM's
#: PEFTHelper lists them (vllm/lora/peft_helper.py:89-100)
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


@dataclass(frozen=True)
class AdapterConfig:
    """What of a PEFT ``LoraConfig`` a sync needs: rank, alpha, rsLoRA, the targets, the adapter's dtype.

    ``targets``: PEFT's ``target_modules`` as given, a tuple of names (each matches a module whose name is it
    or ends with ``.`` + it), or one regular expression (``regex``: matched whole against module names), or
    ``("all-linear",)``. ``dtype``: the adapter tensors' dtype on the trainer (PEFT keeps a bf16 model's
    adapter in fp32 by default: ``autocast_adapter_dtype``)."""

    r: int
    alpha: float
    targets: tuple[str, ...]
    regex: bool = False
    rslora: bool = False
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ConfigError(f"LoRA rank r must be positive, got {self.r}")
        if not self.targets:
            raise ConfigError("the adapter targets no module (target_modules is empty)")

    @property
    def scaling(self) -> float:
        """What PEFT multiplies the adapter's output by: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA
        (peft/tuners/lora/layer.py ``update_layer``; vllm/lora/peft_helper.py:117-120 computes the same)."""
        return self.alpha / math.sqrt(self.r) if self.rslora else self.alpha / self.r

    def matches(self, module: str) -> bool:
        """Whether PEFT adapts module ``module`` (a full dotted name) under these targets."""
        if self.regex:
            return re.fullmatch(self.targets[0], module) is not None
        return any(module == t or module.endswith("." + t) for t in self.targets)


def adapter_config(peft_config: Any, dtype: str = "float32") -> AdapterConfig:
    """The :class:`AdapterConfig` of a PEFT ``LoraConfig`` (or its ``adapter_config.json`` as a dict); every
    unsupported feature refused at once, by name."""
    cfg = peft_config.to_dict() if hasattr(peft_config, "to_dict") else dict(peft_config)
    problems = []
    peft_type = str(cfg.get("peft_type", "LORA")).rsplit(".", 1)[-1].upper()
    if peft_type != "LORA":
        problems.append(f"peft_type {peft_type} (only LoRA adapters sync)")
    for key, neutral in _NEUTRAL.items():
        v = cfg.get(key, neutral)
        if v != neutral and not (neutral in (None, {}, False) and not v):
            problems.append(f"{key}={v!r}")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        problems.append(f"init_lora_weights={init!r} (it changes the base weights)")
    if problems:
        raise ConfigError("this LoRA adapter cannot sync: unsupported " + "; ".join(problems))
    targets = cfg.get("target_modules")
    if targets is None:
        raise ConfigError("the adapter's target_modules is not set (PEFT's per-model defaults are not resolved "
                          "here: name the modules)")
    regex = isinstance(targets, str) and targets != "all-linear"
    targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
    return AdapterConfig(r=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), targets=targets, regex=regex,
                         rslora=bool(cfg.get("use_rslora", False)), dtype=dtype)


@dataclass(frozen=True)
class AdapterTensor:
    """One canonical adapter tensor: ``lora_A`` (``kind`` "A", ``[r, in]``) or ``lora_B`` ("B", ``[out, r]``) of
    the base module ``module`` (``model.layers.3.self_attn.q_proj``), whose short name is ``proj``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    module: str
    kind: str
    layer: int
    proj: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BaseShape:
    """What of the base model an engine's LoRA buffers are shaped by: its decoder layers, KV heads (k / v's TP
    blocks), and every projection's ``(name, out, in)`` (layer 0's; the same in every dense layer), adapted or
    not."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    projections: tuple[tuple[str, int, int], ...]

    def dims(self, proj: str) -> tuple[int, int]:
        for name, out_f, in_f in self.projections:
            if name == proj:
                return out_f, in_f
        raise SpecError(f"the base model has no {proj}")


@dataclass(frozen=True)
class AdapterSpec:
    """Every canonical tensor of one adapter over one base model (what the planner's ``spec`` needs:
    ``name``, ``tensors``, ``by_name``, ``digest``), plus the config the engines' transforms need (scaling)."""

    name: str
    base: str  # the base model spec's name
    base_digest: str
    config: AdapterConfig
    tensors: tuple[AdapterTensor, ...]
    shape: BaseShape

    @cached_property
    def by_name(self) -> dict[str, AdapterTensor]:
        return {t.name: t for t in self.tensors}

    @cached_property
    def digest(self) -> str:
        """A short fingerprint of the base model, the config (rank, alpha, rsLoRA: the scaling) and every tensor."""
        h = hashlib.blake2b(digest_size=8)
        c = self.config
        h.update(f"{self.base_digest};r={c.r};alpha={c.alpha!r};rslora={c.rslora};".encode())
        for t in self.tensors:
            h.update(f"{t.name}:{t.shape}:{t.dtype};".encode())
        return h.hexdigest()

    @property
    def modules(self) -> tuple[str, ...]:
        """The adapted base modules, in order."""
        return tuple(dict.fromkeys(t.module for t in self.tensors))

    @property
    def nbytes(self) -> int:
        from weightsync.dtypes import itemsize

        return sum(t.numel * itemsize(t.dtype) for t in self.tensors)

    def tensor(self, name: str) -> AdapterTensor:
        try:
            return self.by_name[name]
        except KeyError:
            raise SpecError(f"{self.name}: no adapter tensor named {name!r}") from None


def linear_modules(base: ModelSpec) -> dict[str, tuple[int, int]]:
    """Every linear module of the base model with a 2-D canonical weight: module name -> (out, in). Embeddings
    and ``lm_head`` are listed too (PEFT may be told to target them); norms and biases are not."""
    out = {}
    for t in base.tensors:
        if t.name.endswith(".weight") and len(t.shape) == 2:
            out[t.name[: -len(".weight")]] = (t.shape[0], t.shape[1])
    return out


_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)$")


def adapter_spec(base: ModelSpec, config: AdapterConfig) -> AdapterSpec:
    """The adapter's canonical tensors over ``base``: for every module the config targets, ``lora_A``
    ``[r, in]`` then ``lora_B`` ``[out, r]``, in the base model's tensor order. A target naming no module, and a
    module weightsync does not sync (see the module docstring), are refused by name."""
    modules = linear_modules(base)
    if config.targets == ("all-linear",):  # PEFT: every linear layer but the output layer
        adapted = [m for m in modules if not m.endswith(("lm_head", "embed_tokens"))]
    else:
        adapted = [m for m in modules if config.matches(m)]
    if not config.regex and (heads := [t for t in config.targets if t in ("lm_head", "embed_tokens")]):
        raise ConfigError(f"the adapter targets {heads}: weightsync does not sync LoRA on embeddings or lm_head (only "
                          f"the decoder's dense {', '.join(PROJECTIONS)})")
    if not config.regex and config.targets != ("all-linear",):
        unmatched = [t for t in config.targets if not any(m == t or m.endswith("." + t) for m in modules)]
        if unmatched:
            raise ConfigError(f"the adapter targets {unmatched}, which name no linear module of {base.name}")
    if not adapted:
        raise ConfigError(f"the adapter's target_modules {list(config.targets)} match no module of {base.name}")
    refused = []
    tensors = []
    for m in adapted:
        hit = _LAYER.search(m)
        if hit is None or PROJECTIONS.get(hit.group(3)) != hit.group(2) or ".experts." in m:
            refused.append(m)
            continue
        out_f, in_f = modules[m]
        layer, proj = int(hit.group(1)), hit.group(3)
        tensors.append(AdapterTensor(f"{PEFT_PREFIX}{m}.lora_A.weight", (config.r, in_f), config.dtype, m, "A",
                                     layer, proj))
        tensors.append(AdapterTensor(f"{PEFT_PREFIX}{m}.lora_B.weight", (out_f, config.r), config.dtype, m, "B",
                                     layer, proj))
    if refused:
        shown = ", ".join(refused[:6]) + (f" and {len(refused) - 6} more" if len(refused) > 6 else "")
        raise ConfigError(f"the adapter targets modules weightsync does not sync with LoRA: {shown} (only the "
                          f"decoder's dense {', '.join(PROJECTIONS)})")
    name = f"lora:{base.name}:r={config.r}"
    projections = tuple((proj, *modules[f"model.layers.0.{block}.{proj}"]) for proj, block in PROJECTIONS.items()
                        if f"model.layers.0.{block}.{proj}" in modules)
    shape = BaseShape(base.num_layers, base.attention.num_kv_heads, base.attention.head_dim, projections)
    return AdapterSpec(name, base.name, base.digest, config, tuple(tensors), shape)


def peft_names(spec: AdapterSpec, adapter_name: str = "default") -> Mapping[str, str]:
    """Canonical name -> the live PEFT model's parameter name (``...lora_A.<adapter_name>.weight``)."""
    out = {}
    for t in spec.tensors:
        head = t.name[: -len(".weight")]
        out[t.name] = f"{head}.{adapter_name}.weight"
    return out


__all__ = ["AdapterConfig", "AdapterSpec", "BaseShape", "AdapterTensor", "PEFT_PREFIX", "PROJECTIONS", "adapter_config",
           "adapter_spec", "linear_modules", "peft_names"]
