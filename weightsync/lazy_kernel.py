"""A Triton kernel compiled on first use, and when it may be used.

The checksum (:mod:`weightsync.integrity.fastsum`) and block-FP8 (:mod:`weightsync.quant.fp8`) kernels each keep a
torch path beside them; this is their one rule for choosing the kernel: Triton imports and builds here, the
environment has not turned it off, and the tensor lies where the kernel can read it. Triton is imported only by the
``build`` function, on first use.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

K = TypeVar("K")


class LazyKernel(Generic[K]):
    """What ``build`` returns, built once on first use; unavailable for good once building it failed (no Triton, or
    one that cannot build here), and unused while the environment variable ``switch`` is ``0``."""

    def __init__(self, build: Callable[[], K], switch: str, log: logging.Logger, name: str, fallback: str):
        self._build, self.switch, self._log, self.name, self.fallback = build, switch, log, name, fallback
        self._built: Any = None  # None: not tried yet; False: unavailable

    def enabled(self) -> bool:
        """Whether the kernel may be used at all (built, or built now; not turned off by ``switch=0``)."""
        if os.environ.get(self.switch, "1") == "0":
            return False
        if self._built is None:
            try:
                self._built = self._build()
            except Exception as e:  # no Triton, or one that cannot build here: the torch path stays
                self._log.info("%s: no Triton kernel (%s); using %s", self.name, e, self.fallback)
                self._built = False
        return self._built is not False

    @property
    def kernel(self) -> K:
        """The built kernel (once :meth:`enabled` said so)."""
        return self._built


def readable(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can read ``t`` where it lies: on CUDA, or anywhere under Triton's interpreter
    (``TRITON_INTERPRET=1``, for tests)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


__all__ = ["LazyKernel", "readable"]
