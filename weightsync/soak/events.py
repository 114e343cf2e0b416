"""What a soak's processes tell its driver, beside the local runner's own events (:mod:`weightsync.local.events`).

Every record carries ``at``, the wall clock (``time.time()``) when it happened, so the driver can time
each fault's detection and recovery across processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.local.events import Event


@dataclass(frozen=True)
class InstanceUp(Event):
    """A reader's instance is up: its worker processes' ids (a fault may hit one)."""

    pids: tuple[int, ...]
    at: float


@dataclass(frozen=True)
class Held(Event):
    """A reader says it holds ``step`` (``update``/``pull`` returned it) and checked its tensors against the
    step's weights: ``exact`` (every piece bit for bit), else ``problems`` names what differed."""

    step: int
    exact: bool
    problems: tuple[str, ...]
    at: float


@dataclass(frozen=True)
class Claim(Event):
    """After a failed update a reader still claims ``version`` (None: none); ``exact`` says whether its
    tensors hold that version bit for bit (None when it claims none)."""

    version: int | None
    exact: bool | None
    problems: tuple[str, ...]
    at: float


@dataclass(frozen=True)
class Noticed(Event):
    """weightsync told a participant of a fault: a call raised ``kind: message``, or a trainer dropped an
    instance that did not hold its step (kind ``Dropped``)."""

    kind: str
    message: str
    at: float


@dataclass(frozen=True)
class Rejoined(Event):
    """A reader left its failed session and joined the job again (in the same process); it holds from ``since``."""

    since: int
    at: float


@dataclass(frozen=True)
class Stepped(Event):
    """A training rank's ``write(step)`` returned after ``seconds``."""

    step: int
    seconds: float
    at: float


@dataclass(frozen=True)
class Training(Event):
    """A training rank is training before ``write(step)`` for as long as the driver says (a slow step: the
    driver's ``train`` file exists), having written every step before ``step`` it was to write."""

    step: int
    at: float


__all__ = ["Claim", "Held", "InstanceUp", "Noticed", "Rejoined", "Stepped", "Training"]
