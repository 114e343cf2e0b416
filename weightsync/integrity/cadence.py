"""The integrity cadence (``integrity=`` of WeightWriter and WeightReader), without torch."""

from __future__ import annotations

from weightsync.errors import ConfigError

#: check every DEFAULT_EVERY-th step (steps divisible by it): the measured cost of a check is about a
#: transfer's own (BENCHMARKS.md, "Per-step integrity"), so checking every step would cost far more than 2%
DEFAULT_EVERY = 100


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
