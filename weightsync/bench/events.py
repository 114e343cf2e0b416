"""What the bench's processes report beyond the runner's common events (:mod:`weightsync.local.events`).

A training rank sends :class:`~weightsync.local.events.StepStarted` before each of our ``write``
calls; an instance sends :class:`~weightsync.local.events.StepDone` after each ``update`` (its
``end`` wall clock, ``bytes`` received and the slowest worker's ``transfer_seconds``). The records
below carry the rest, each read by the driver where it builds the result.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.local.events import Event


@dataclass(frozen=True)
class Phases(Event):
    """Where one timed step's time went on training rank 0 (``side="writer"``) or instance 0 (``"reader"``)."""

    side: str
    seconds: dict[str, float]


@dataclass(frozen=True)
class LinkReady(Event):
    """Training rank 0 is about to send the link-ceiling messages (``sizes``, from group rank
    ``group_rank``): the driver hands this to instance 0, which receives them."""

    sizes: tuple[int, ...]
    group_rank: int


@dataclass(frozen=True)
class BaselineStarted(Event):
    """A training rank starts step ``step`` of baseline ``kind`` at wall clock ``at``."""

    kind: str
    step: int
    at: float


@dataclass(frozen=True)
class BaselineEnded(Event):
    """An instance's workers all finished step ``step`` of baseline ``kind`` by wall clock ``at``."""

    kind: str
    step: int
    at: float


@dataclass(frozen=True)
class BaselineVerified(Event):
    """Whether an instance held exactly the trainers' last step of baseline ``kind``."""

    kind: str
    exact: bool


@dataclass(frozen=True)
class TrainerMeasured(Event):
    """A training rank's totals: bytes it sends per step, the raw link bandwidth (rank 0 separated on
    GPUs, else None) and the peak transient memory of its writes."""

    sent: int
    link_bytes_per_s: float | None
    peak_bytes: int


@dataclass(frozen=True)
class InstanceMeasured(Event):
    """An instance's totals: the last step bit-exact, the device-copy and peer-copy ceilings (co-located
    on GPUs, else None), peak transient memory, whether its workers copied other GPUs' pieces directly,
    and the bytes they pushed into each other in the last step; the tensors that failed the check, where named."""

    exact: bool
    copy_bytes_per_s: float | None
    peak_bytes: int
    nvlink_bytes_per_s: float | None
    peer_copies: bool
    pushed_bytes: int
    mismatched: tuple[str, ...] = ()  # the local tensors that do not hold the last step (FP8 checks name them)


__all__ = ["Phases", "LinkReady", "BaselineStarted", "BaselineEnded", "BaselineVerified", "TrainerMeasured",
           "InstanceMeasured"]
