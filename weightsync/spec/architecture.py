"""The record that binds one model architecture: how to read its config and name its tensors.

Each module of ``weightsync/spec/arch/`` defines one :class:`Architecture` as ``ARCH``. Adding an
architecture is one such module (plus a tiny preset and its test): the spec builder, the engines and
the HF instance's list of config keys all read this record, never the architecture's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightsync.errors import SpecError
from weightsync.spec.records import Attention, Layer, TensorSpec
from weightsync.spec.roles import Kind

if TYPE_CHECKING:  # pragma: no cover
    from weightsync.spec.model import ModelSpec

#: config.json keys the spec builder reads for every architecture
COMMON_KEYS = (
    "architectures", "model_type", "torch_dtype", "dtype", "hidden_size", "vocab_size", "tie_word_embeddings",
    "num_hidden_layers",
)


@dataclass(frozen=True)
class Architecture:
    """Everything weightsync knows about one architecture.

    ``attention`` and ``layers`` read the config through a view that refuses any key not in
    ``COMMON_KEYS + config_keys``, so the declared keys are all a spec needs (the HF instance keeps
    exactly those when it rebuilds a config from a live module). ``tensors`` lists the canonical
    tensors, in checkpoint order, each with its role.

    The remaining fields say what other model code does with this architecture; each engine reads
    its own and nothing else.
    """

    name: str  # config.json "architectures"[0], e.g. "Qwen3MoeForCausalLM"
    config_keys: tuple[str, ...]
    attention: Callable[[Mapping[str, Any]], Attention]
    layers: Callable[[Mapping[str, Any]], tuple[Layer, ...]]
    tensors: Callable[[ModelSpec], Iterable[TensorSpec]]
    #: the transformers model class (``transformers.<hf_class>``); empty: ``name``
    hf_class: str = ""
    #: what transformers may keep in fp32 beside a bf16/fp16 model: each kind with the name its
    #: module gives a tensor of that kind (``{layer}``: the layer index). Whether the installed
    #: transformers does is read from ``hf_class``'s ``_keep_in_fp32_modules_strict`` (patterns
    #: matched against these names) and recorded in the hf/fsdp layouts' ``fp32_*`` keys
    #: (:mod:`weightsync.engines.hf_fp32`); without transformers, every kind listed here is fp32, as in
    #: the newest version we know (5.24).
    hf_fp32: Mapping[Kind, str] = field(default_factory=dict)
    #: transformers holds these as persistent buffers, not parameters (FSDP2 leaves them whole)
    hf_buffers: frozenset[Kind] = field(default_factory=frozenset)
    #: SGLang's model code has DP attention (--enable-dp-attention)
    sglang_dp_attention: bool = True
    #: SGLang fuses a single shared expert into the routed ones by default (without EP)
    sglang_fuse_shared: bool = False
    #: SGLang's model makes every layer MoE (so ``mlp_only_layers`` cannot be mirrored)
    sglang_all_moe: bool = False

    def __post_init__(self) -> None:
        if not self.hf_class:  # dataclasses.replace keeps the class of the record it copies
            object.__setattr__(self, "hf_class", self.name)

    @property
    def keys(self) -> tuple[str, ...]:
        """Every config.json key a spec of this architecture is built from."""
        return COMMON_KEYS + tuple(k for k in self.config_keys if k not in COMMON_KEYS)

    def view(self, cfg: Mapping[str, Any]) -> Mapping[str, Any]:
        return _DeclaredKeys(cfg, frozenset(self.keys), self.name)


class _DeclaredKeys(Mapping[str, Any]):
    """A config that answers only the keys its architecture declared (a missing one is a KeyError)."""

    def __init__(self, cfg: Mapping[str, Any], keys: frozenset[str], arch: str):
        self._cfg, self._keys, self._arch = cfg, keys, arch

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise SpecError(
                f"{self._arch} reads config key {key!r} its Architecture does not declare: add it to "
                "config_keys in its module under weightsync/spec/arch/"
            )
        return self._cfg[key]

    def __iter__(self) -> Iterator[str]:
        return (k for k in self._cfg if k in self._keys)

    def __len__(self) -> int:
        return sum(1 for _ in self)


__all__ = ["COMMON_KEYS", "Architecture"]
