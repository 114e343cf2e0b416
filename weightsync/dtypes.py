"""The one dtype table: the names layouts and specs use, their byte sizes, and torch's dtypes.

Specs, layouts and plans speak dtype *names* (torch's own spelling without ``torch.``: ``"bfloat16"``)
so that planning runs without torch; the torch dtypes are looked up lazily, only by code that
already holds tensors. Adding a dtype is one row of :data:`DTYPE_SIZES`.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from weightsync.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: every dtype a canonical or local tensor may have -> bytes per element
DTYPE_SIZES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


def itemsize(name: str) -> int:
    """Bytes per element of dtype ``name``; an unknown name is refused saying which are known."""
    try:
        return DTYPE_SIZES[name]
    except KeyError:
        raise SpecError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPE_SIZES)}") from None


@cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """``{"bfloat16": torch.bfloat16, ...}`` for every dtype of :data:`DTYPE_SIZES` (imports torch)."""
    import torch

    return {name: getattr(torch, name) for name in DTYPE_SIZES}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (``"bfloat16"`` -> ``torch.bfloat16``)."""
    itemsize(name)  # refuses an unknown name with the list of known ones
    return torch_dtypes()[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, the spelling layouts use.

    Any torch dtype is named (not only the table's), so a surprising live dtype is reported by a layout
    check instead of failing here.
    """
    return str(dtype).removeprefix("torch.")


__all__ = ["DTYPE_SIZES", "itemsize", "torch_dtype", "torch_dtypes", "dtype_name"]
