"""What the installed transformers keeps in fp32 beside a bf16/fp16 model, read from the library itself.

A model class's ``_keep_in_fp32_modules_strict`` lists name patterns; loading a bf16 or fp16 model
keeps every parameter or buffer whose name matches one in fp32 (modeling_utils.py
``_get_dtype_plan``; core_model_loading.py matches with ``build_glob_alternation``: ``*`` becomes
``.*`` and the alternation is ``re.search``-ed in the full name). The list changes between versions:
DeepSeek-V3's router weight ``mlp.gate.weight`` is not in it in 5.19-5.23 and is from 5.24 on. So
the answer is read here once, the hf/fsdp layouts record it in their config (``fp32_router``,
``fp32_router_bias``) and both ends of a job plan from the recorded value, never from their own
library.

Without transformers (a MetaServer, a planner on a bare host) or without the class, the behaviour of
the newest version we know (:data:`NEWEST_KNOWN`) is assumed: every kind the architecture lists in
``Architecture.hf_fp32`` is kept in fp32.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from weightsync.errors import SpecError
from weightsync.spec.architecture import Architecture
from weightsync.spec.model import ModelSpec
from weightsync.spec.roles import Kind

log = logging.getLogger("weightsync.engines.hf_fp32")

#: the newest transformers whose lists ``Architecture.hf_fp32`` records (assumed without transformers)
NEWEST_KNOWN = "5.24.0"


@dataclass(frozen=True)
class StrictList:
    """One model class's ``_keep_in_fp32_modules_strict`` and where it was read."""

    patterns: tuple[str, ...]
    source: str  # "transformers 5.19.0" or why the newest known version was assumed

    def keeps(self, name: str) -> bool:
        """Whether transformers keeps the tensor ``name`` in fp32 (its own matching rule, see the module doc)."""
        if not self.patterns:
            return False
        return re.search("|".join(f"({p.replace('*', '.*')})" for p in self.patterns), name) is not None


def installed_strict_list(hf_class: str) -> StrictList | None:
    """``transformers.<hf_class>._keep_in_fp32_modules_strict`` of the installed transformers; None
    when transformers or the class is missing (the caller then assumes :data:`NEWEST_KNOWN`).

    Read each time (cheap once transformers is imported), so a patched class is seen at once."""
    try:
        import transformers
    except ImportError:
        log.debug("transformers is not installed: %s is assumed to keep what transformers %s does", hf_class, NEWEST_KNOWN)
        return None
    try:
        cls = getattr(transformers, hf_class)
    except (AttributeError, ImportError, RuntimeError):
        log.info("transformers %s has no %s: assuming what transformers %s keeps in fp32",
                 transformers.__version__, hf_class, NEWEST_KNOWN)
        return None
    patterns = tuple(sorted(getattr(cls, "_keep_in_fp32_modules_strict", None) or ()))
    return StrictList(patterns, f"transformers {transformers.__version__}")


def kept_in_fp32(spec: ModelSpec, kind: Kind) -> bool:
    """Whether transformers keeps ``spec``'s tensors of ``kind`` (one of ``spec.arch.hf_fp32``) in fp32
    when it loads the model in bf16/fp16. Every tensor of the kind must agree (one config key says it)."""
    arch: Architecture = spec.arch
    template = arch.hf_fp32[kind]
    strict = installed_strict_list(arch.hf_class)
    if strict is None:
        return True  # NEWEST_KNOWN keeps every kind hf_fp32 lists
    names = [template.format(layer=t.role.layer) for t in spec.tensors if t.role.kind is kind]
    kept = {n: strict.keeps(n) for n in names}
    if len(set(kept.values())) > 1:
        raise SpecError(
            f"{strict.source} keeps only some {kind.value} tensors of {spec.name} in fp32 "
            f"({_keep_in_fp32_modules_strict(strict)}: kept {[n for n, k in kept.items() if k][:3]}, "
            f"not {[n for n, k in kept.items() if not k][:3]}); weightsync's fp32 keys are per kind"
        )
    answer = any(kept.values())
    log.debug("%s: %s keeps %s %s fp32", arch.hf_class, strict.source, kind.value, "in" if answer else "out of")
    return answer


def _keep_in_fp32_modules_strict(strict: StrictList) -> str:
    return f"_keep_in_fp32_modules_strict={list(strict.patterns)}"


__all__ = ["NEWEST_KNOWN", "StrictList", "installed_strict_list", "kept_in_fp32"]
