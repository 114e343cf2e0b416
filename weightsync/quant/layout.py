"""An engine's layout as an FP8-served engine holds it: FP8 weights in e4m3, each with its scale, sharded with it.

A scale tensor is a canonical tensor too (``<weight>_scale_inv``, fp32, the weight's shape counted in 128 blocks:
:func:`fp8_spec` lists them after their weights), and its pieces follow the weight's: a weight piece at rows
``[o, o + n)`` of its local tensor, holding rows ``[c, c + n)`` of its canonical weight, gives a scale piece at rows
``[o / 128, o / 128 + ceil(n / 128))`` of the local ``<local>_scale_inv``, holding those block rows of the canonical
scale; the same along columns; leading dims (stacked experts) as they are. So a fused ``qkv_proj.weight`` gets a
fused ``qkv_proj.weight_scale_inv`` ([q; k; v] blocks, per TP rank) and vLLM's ``w13_weight`` its
``w13_weight_scale_inv`` -- the parameters vLLM's ``Fp8LinearMethod`` / ``Fp8MoEMethod`` create. This holds only
where every piece starts on a block (:func:`weightsync.quant.config.check_layout` refuses the rest first).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from weightsync.layout.layout import EngineLayout, Piece, Shard
from weightsync.quant.config import BlockFP8, FP8Tensor, check_layout, checkpoint_tensors, fp8_tensors
from weightsync.quant.fp8 import BLOCK
from weightsync.spec.model import ModelSpec
from weightsync.spec.records import TensorSpec
from weightsync.spec.roles import Role


@dataclass(frozen=True)
class FP8Spec(ModelSpec):
    """A model spec whose canonical tensors are its FP8 checkpoint's: FP8 weights in e4m3, each followed by its
    ``_scale_inv``, the rest as in the bf16 spec. Roles stay those of the weights (a scale shares its weight's role,
    so :attr:`by_role` lists the weights only)."""

    quant: BlockFP8 = BlockFP8()

    @cached_property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return checkpoint_tensors(ModelSpec(**{f.name: getattr(self, f.name) for f in fields(ModelSpec)}), self.quant)

    @cached_property
    def scales(self) -> dict[str, TensorSpec]:
        """Scale name -> its weight's canonical tensor."""
        names = [t.name for t in self.tensors]
        return {n: self.tensors[i - 1] for i, n in enumerate(names) if i and n == names[i - 1] + "_scale_inv"}

    @cached_property
    def by_role(self) -> dict[Role, TensorSpec]:
        return {t.role: t for t in self.tensors if t.name not in self.scales}


def fp8_spec(spec: ModelSpec, quant: BlockFP8) -> FP8Spec:
    """``spec`` with its FP8 checkpoint's canonical tensors (see :class:`FP8Spec`)."""
    if isinstance(spec, FP8Spec):
        return spec
    return FP8Spec(**{f.name: getattr(spec, f.name) for f in fields(ModelSpec)}, quant=quant)


def _blocks(box: Any, lead: int) -> tuple[tuple[int, int], ...]:
    """A box of a weight (``lead`` leading dims, then rows and columns) counted in 128 blocks."""
    return (*box[:lead], *((o // BLOCK, -(-n // BLOCK)) for o, n in box[lead:]))


class FP8Layout(EngineLayout):
    """``base`` (an inference engine's layout) as the engine holds its weights in block FP8 (see the module)."""

    def __init__(self, base: EngineLayout, quant: BlockFP8):
        self.base, self.quant = base, quant
        self.engine = base.engine
        self.keys = base.keys
        self.config = base.config
        self.fp8: dict[str, FP8Tensor] = {f.weight.name: f for f in check_layout(base, quant)}
        self.by_scale = {f.scale.name: f for f in self.fp8.values()}
        super().__init__(fp8_spec(base.spec, quant), list(base.meshes.values()))

    def _shards(self, canonical: str) -> Iterable[Shard]:
        f = self.by_scale.get(canonical)
        if f is not None:
            for s in self.base.shards(f.weight.name):
                p, lead = s.piece, len(s.shape) - 2
                shape = (*s.shape[:lead], *(-(-d // BLOCK) for d in s.shape[lead:]))
                piece = Piece(p.tensor + "_scale_inv", _blocks(p.local_box, lead), canonical, _blocks(p.canon_box, 0))
                yield Shard(s.group, piece, shape, "float32")
            return
        for s in self.base.shards(canonical):
            yield Shard(s.group, s.piece, s.shape, "float8_e4m3fn") if canonical in self.fp8 else s

    def canonical_names(self, rank: int) -> Iterable[str]:
        for name in self.base.canonical_names(rank):
            yield name
            if name in self.fp8:
                yield self.fp8[name].scale.name

    def describe(self) -> str:
        return self.base.describe()


def fp8_layout(base: EngineLayout, quant: BlockFP8 | None = None) -> FP8Layout:
    """``base`` as an FP8 engine holds it (``quant``: the engine's quantization, by default plain block FP8);
    a piece that cuts a block is refused first (ConfigError, one line)."""
    return FP8Layout(base, quant or BlockFP8())


__all__ = ["FP8Layout", "FP8Spec", "fp8_layout", "fp8_spec", "fp8_tensors"]
