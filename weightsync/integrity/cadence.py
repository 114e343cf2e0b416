"""The integrity cadence (``integrity=`` of WeightWriter and WeightReader), without torch."""

from __future__ import annotations

from weightsync.errors import ConfigError

#: check the steps divisible by DEFAULT_EVERY (step 0 included). Measured (BENCHMARKS.md, "Per-step
#: integrity (2026-12-01)"): a checked step cost ~11x a co-located 8B step on an H200 (104 against 9 ms)
#: and ~3x a CPU gloo step, so every step is far over 2%; every 1,000th costs ~1% (GPU) and ~0.3% (CPU)
DEFAULT_EVERY = 1000


def every(option: int | bool | None) -> int:
    """The cadence an ``integrity=`` option selects: N > 0 checks the steps divisible by N (1: every
    step); 0, None or False: none; True: every step."""
    if option is None or option is False:
        return 0
    if option is True:
        return 1
    if isinstance(option, int) and option >= 0:
        return option
    raise ConfigError(f"integrity must be a step interval N >= 0 (1: every step, 0: never) or a bool, got {option!r}")


def due(n: int, step: int) -> bool:
    """Whether step ``step`` is checked at cadence ``n``."""
    return n > 0 and step % n == 0
