"""Where two model specs differ, in words: the first canonical tensor whose name, shape or dtype differs.

Used by a refused registrant (:mod:`weightsync.runtime.job`) and by the MetaServer, which tells every
participant of the job the same reason (:mod:`weightsync.meta.mismatch`); needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.spec.model import ModelSpec


@dataclass(frozen=True)
class TensorDifference:
    """The first canonical tensor two specs disagree on (``None`` shape/dtype: that side lacks it)."""

    name: str
    mine_shape: tuple[int, ...] | None
    mine_dtype: str | None
    theirs_shape: tuple[int, ...] | None
    theirs_dtype: str | None


def tensor_difference(mine: ModelSpec, theirs: ModelSpec) -> TensorDifference | None:
    """The first tensor of ``mine`` (in its order) that ``theirs`` lacks or holds otherwise, then the
    first one only ``theirs`` has; None when every name, shape and dtype agree."""
    b = theirs.by_name
    for t in mine.tensors:
        o = b.get(t.name)
        if o is None:
            return TensorDifference(t.name, tuple(t.shape), t.dtype, None, None)
        if o.shape != t.shape or o.dtype != t.dtype:
            return TensorDifference(t.name, tuple(t.shape), t.dtype, tuple(o.shape), o.dtype)
    a = mine.by_name
    extra = next((o for o in theirs.tensors if o.name not in a), None)
    return None if extra is None else TensorDifference(extra.name, None, None, tuple(extra.shape), extra.dtype)


def first_difference(mine: ModelSpec, theirs: ModelSpec) -> str:
    """The first canonical tensor whose name, shape or dtype differs, in words."""
    d = tensor_difference(mine, theirs)
    if d is None:
        return "same tensors, different config"
    if d.theirs_shape is None:
        return f"{d.name} {list(d.mine_shape)} exists only in {mine.name}"
    if d.mine_shape is None:
        return f"{d.name} exists only in {theirs.name}"
    return (f"{d.name}: {list(d.mine_shape)} {d.mine_dtype} in {mine.name}, "
            f"{list(d.theirs_shape)} {d.theirs_dtype} in {theirs.name}")
