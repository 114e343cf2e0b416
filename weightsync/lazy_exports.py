"""A package's names imported on first use (PEP 562), so importing the package imports none of its heavy modules.

A package lists ``{name: module}`` and sets ``__getattr__ = lazy_exports(__name__, table)``; the import-cycle test
reads the same table to follow a name to the module it lives in.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: a name in ``table`` from its module (imported then), any other name an
    AttributeError, as for a module without one."""

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__all__ = ["lazy_exports"]
