"""How an inference engine's layers receive a step, as one worker classified them at set-up.

vLLM (:mod:`weightsync.vllm.live`) and SGLang (:mod:`weightsync.sglang.live`) each name their own paths and keep
their own report; the record of one layer and the reads over a worker's list of them are one definition, here,
so both engines' reports answer ``counts()`` / ``path_of()`` alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class LayerPath:
    """How one layer receives a step: its path (one of its engine's ``PATHS``) and the tensors it holds (layout
    tensor names; for ``derived``, the derived attributes)."""

    layer: str
    path: str
    tensors: tuple[str, ...]
    detail: str = ""  # the kernel or method behind the path, in words


class LayerPaths:
    """The reads over a report's ``layers``: a base of each engine's report, which sets ``paths`` (its paths, in
    the order they print)."""

    paths: ClassVar[tuple[str, ...]]
    layers: Sequence[LayerPath]

    def counts(self) -> dict[str, int]:
        """How many layers take each path, in ``paths`` order; paths no layer takes are left out."""
        c = Counter(p.path for p in self.layers)
        return {path: c[path] for path in self.paths if c[path]}

    def path_of(self, layer: str) -> str:
        """The path of the layer named ``layer`` (KeyError when the report has no such layer)."""
        for p in self.layers:
            if p.layer == layer:
                return p.path
        raise KeyError(layer)


__all__ = ["LayerPath", "LayerPaths"]
