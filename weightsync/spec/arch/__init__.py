"""The supported model architectures: one module each, every module defining ``ARCH``.

Modules are found by listing this package, so adding an architecture is adding a module (see
``llama3.py`` for the smallest; ``weightsync/spec/architecture.py`` says what the record holds).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence

from weightsync.errors import SpecError
from weightsync.spec.architecture import Architecture


def _discover() -> dict[str, Architecture]:
    found: dict[str, Architecture] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        arch = getattr(module, "ARCH", None)
        if not isinstance(arch, Architecture):
            raise ImportError(f"{module.__name__} defines no ARCH = Architecture(...)")
        if arch.name in found:
            raise ImportError(f"{module.__name__}: architecture {arch.name} is defined twice")
        found[arch.name] = arch
    return found


#: HF architecture name (config.json ``architectures[0]``) -> its record
ARCHITECTURES: dict[str, Architecture] = _discover()


def architecture(name: str | None) -> Architecture:
    """The record of architecture ``name``; an unsupported one is refused saying how to add it."""
    try:
        return ARCHITECTURES[name]  # type: ignore[index]
    except KeyError:
        raise SpecError(
            f"unsupported architecture {name!r}; supported: {', '.join(ARCHITECTURES)}. To add one, write a "
            "module under weightsync/spec/arch/ defining ARCH = Architecture(...) (llama3.py is the smallest), a "
            "tiny preset in weightsync/spec/presets/ and its test in tests/test_arch.py"
        ) from None


def config_keys() -> tuple[str, ...]:
    """Every config.json key some architecture's spec is built from (what a config rebuilt from a live module needs)."""
    out: dict[str, None] = {}
    for arch in ARCHITECTURES.values():
        out.update(dict.fromkeys(arch.keys))
    return tuple(out)


def known_class(class_names: Sequence[str]) -> str | None:
    """The first of ``class_names`` (a module's MRO, say) that is a supported architecture, or None.

    A model built with ``from_config`` records no ``architectures``; its class names it (FSDP2 swaps
    in a subclass ``FSDP<Class>``, hence the MRO).
    """
    return next((n for n in class_names if n in ARCHITECTURES), None)


__all__ = ["ARCHITECTURES", "Architecture", "architecture", "config_keys", "known_class"]
