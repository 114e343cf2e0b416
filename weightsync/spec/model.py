"""Model specs: every canonical tensor of a model, derived from its HF ``config.json`` alone.

A canonical tensor is a tensor as named and shaped in the model's Hugging Face checkpoint
(safetensors on disk): per-expert MoE weights, unfused q/k/v and gate/up. Engine layouts map their
local tensors onto these, so the spec is the one vocabulary both sides of a sync share.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from weightsync.dtypes import itemsize
from weightsync.errors import SpecError
from weightsync.spec.arch import ARCHITECTURES, Architecture, architecture
from weightsync.spec.records import Attention, Layer, TensorSpec
from weightsync.spec.roles import Role

PRESET_DIR = Path(__file__).parent / "presets"


@dataclass(frozen=True)
class ModelSpec:
    """The canonical tensors of a model plus the structure engines shard by."""

    name: str
    architecture: str
    config: Mapping[str, Any] = field(repr=False, compare=False)
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: str
    attention: Attention
    layers: tuple[Layer, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def arch(self) -> Architecture:
        """The record of this spec's architecture (weightsync/spec/arch/)."""
        return architecture(self.architecture)

    @cached_property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return tuple(self.arch.tensors(self))

    @cached_property
    def by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    @cached_property
    def by_role(self) -> dict[Role, TensorSpec]:
        out: dict[Role, TensorSpec] = {}
        for t in self.tensors:
            if t.role in out:
                raise SpecError(f"{self.architecture}: {out[t.role].name} and {t.name} have the same role ({t.role})")
            out[t.role] = t
        return out

    def tensor(self, name: str) -> TensorSpec:
        try:
            return self.by_name[name]
        except KeyError:
            raise SpecError(f"{self.name}: no canonical tensor named {name!r}") from None

    def tensor_of(self, role: Role) -> TensorSpec:
        """The canonical tensor with this role (the ``up`` beside a ``gate``: ``tensor_of(role.sibling(Kind.UP))``)."""
        try:
            return self.by_role[role]
        except KeyError:
            raise SpecError(f"{self.name}: no canonical tensor is {role}") from None

    @cached_property
    def _by_layer(self) -> dict[int | None, tuple[TensorSpec, ...]]:
        out: dict[int | None, list[TensorSpec]] = {}
        for t in self.tensors:
            out.setdefault(t.role.layer, []).append(t)
        return {k: tuple(v) for k, v in out.items()}

    def layer_tensors(self, layer: int | None) -> tuple[TensorSpec, ...]:
        """The canonical tensors of one decoder layer (``None``: those outside every layer), in checkpoint order."""
        return self._by_layer.get(layer, ())

    @property
    def num_parameters(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def is_moe(self) -> bool:
        return any(layer.moe for layer in self.layers)

    @cached_property
    def digest(self) -> str:
        """A short fingerprint of every canonical name, shape and dtype."""
        h = hashlib.blake2b(digest_size=8)
        for t in self.tensors:
            h.update(f"{t.name}:{t.shape}:{t.dtype};".encode())
        return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Building a spec from config.json

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def spec_from_config(config: Mapping[str, Any] | str | Path, name: str | None = None) -> ModelSpec:
    """Build a ModelSpec from a config.json path or an already-parsed dict."""
    if not isinstance(config, Mapping):
        path = Path(config)
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise SpecError(f"no such config file: {path}") from None
        except json.JSONDecodeError as e:
            raise SpecError(f"{path} is not valid JSON: {e}") from None
        name = name or path.stem
    else:
        cfg = dict(config)
    archs = cfg.get("architectures") or []
    arch = architecture(archs[0] if archs else None)
    try:
        return _build(cfg, arch, name or cfg.get("model_type", arch.name))
    except KeyError as e:
        raise SpecError(f"config for {arch.name} lacks required key {e.args[0]!r}") from None


def _build(cfg: dict[str, Any], arch: Architecture, name: str) -> ModelSpec:
    """The spec of ``cfg``: the common keys here, attention and layers by the architecture's own readers."""
    view = arch.view(cfg)
    hidden = int(view["hidden_size"])
    dtype = str(view.get("torch_dtype") or view.get("dtype") or "bfloat16")
    itemsize(dtype)  # SpecError naming the supported dtypes
    return ModelSpec(
        name=name,
        architecture=arch.name,
        config=cfg,
        hidden_size=hidden,
        vocab_size=int(view["vocab_size"]),
        tie_word_embeddings=bool(view.get("tie_word_embeddings", False)),
        dtype=dtype,
        attention=arch.attention(view),
        layers=arch.layers(view),
    )


# --------------------------------------------------------------------------------------------
# Presets


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_spec(model: str | Path | Mapping[str, Any]) -> ModelSpec:
    """A preset name, a config.json path, or a config dict."""
    if isinstance(model, Mapping):
        return spec_from_config(model)
    preset = PRESET_DIR / f"{model}.json"
    if isinstance(model, str) and preset.exists():
        return spec_from_config(preset, name=model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.exists():
        return spec_from_config(path)
    raise SpecError(f"unknown model {str(model)!r}: not a preset ({', '.join(preset_names())}) nor a config.json path")
