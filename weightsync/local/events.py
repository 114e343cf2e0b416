"""What the processes of a local job tell its driver: frozen records, one per kind of news.

Every event names its :class:`Participant`; the runner (:mod:`weightsync.local.runner`) adds
:class:`Done` when a participant's function returns and :class:`Failed` when it raises, dies or
the job runs out of time. Users (the demo, the bench, the end-to-end tests) may define events of
their own by subclassing :class:`Event` in an importable module (they are pickled across processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, order=True)
class Participant:
    """One process of a local job: a training rank, or an inference instance (of ``job`` when a driver
    runs several jobs at once). ``str()`` is the name every message uses."""

    role: str  # "train" or "infer"
    index: int
    job: str = ""

    @staticmethod
    def trainer(rank: int) -> "Participant":
        return Participant("train", rank)

    @staticmethod
    def instance(index: int, job: str = "") -> "Participant":
        return Participant("infer", index, job)

    def __str__(self) -> str:
        if self.role == "train":
            return f"training rank {self.index}"
        return f"instance {self.index}" + (f" of {self.job}" if self.job else "")


@dataclass(frozen=True)
class Event:
    participant: Participant


@dataclass(frozen=True)
class Ready(Event):
    """Set-up done: the participant's WeightWriter / WeightReader exists (every set-up check passed)."""


@dataclass(frozen=True)
class StepStarted(Event):
    """A training rank is about to ``write(step)``; ``at`` is the wall clock (``time.time()``), so the
    driver can time a step from the first write to the last update across processes."""

    step: int
    at: float
    loss: float | None = None


@dataclass(frozen=True)
class Wrote(Event):
    """A training rank's ``write(step)`` returned."""

    step: int


@dataclass(frozen=True)
class StepDone(Event):
    """An instance's ``update(step)`` returned: how long it took, the bytes it received, and whether its
    tensors were checked bit-exact (``exact``; None when not checked this step). ``version`` is what
    the reader says it holds; ``problems`` names what differed; ``end`` is the wall clock at return;
    ``transfer_seconds`` the slowest worker's time inside the transport."""

    step: int
    seconds: float
    bytes: int
    exact: bool | None
    version: int | None = None
    problems: tuple[str, ...] = ()
    logits_equal: bool | None = None
    end: float = 0.0
    transfer_seconds: float = 0.0
    validation: Any = None  # a weightsync.validate.ValidationReport when the step was validated (demo --validate)
    tokens_equal: bool | None = None  # demo --engines real: greedy tokens equal a fresh engine's on the step


@dataclass(frozen=True)
class Pulled(Event):
    """An asynchronous instance pulled ``version``; ``summary`` is the MetaServer's job summary then."""

    version: int
    problems: tuple[str, ...]
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class UpdateFailed(Event):
    """``update(step)`` raised ``kind: message``; the reader then claims ``version``, and ``intact`` says
    whether its tensors still hold exactly the previous step (None when not checked)."""

    step: int
    kind: str
    message: str
    version: int | None
    intact: bool | None


@dataclass(frozen=True)
class Done(Event):
    """The participant's function returned (sent by the runner)."""


@dataclass(frozen=True)
class Failed(Event):
    """The participant raised ``kind: message`` (``traceback`` is the formatted one), died, or the job
    ran out of time (kinds ``ProcessDied`` and ``Timeout``, sent by the runner)."""

    kind: str
    message: str
    traceback: str = ""

    @staticmethod
    def of(participant: Participant, exc: BaseException) -> "Failed":
        import traceback

        return Failed(participant, type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)))

    def line(self, limit: int = 400) -> str:
        """One line: who failed, with what, and what it said (a multi-line message's lines joined, any
        traceback in it left out, cut at ``limit`` characters)."""
        parts: list[str] = []
        for raw in self.message.splitlines():
            text = raw.strip()
            if text.startswith("Traceback (most recent call last)"):
                break
            if text:
                parts.append(text)
        said = ""
        for text in parts:
            said += text if not said else (" " if said.endswith((":", ";", ",")) else "; ") + text
        said = said.removesuffix("; worker traceback:").removesuffix(" worker traceback:") or "(no message)"
        if len(said) > limit:
            said = said[: limit - 4].rstrip() + " ..."
        return f"{self.participant}: {self.kind}: {said}"


__all__ = ["Participant", "Event", "Ready", "StepStarted", "Wrote", "StepDone", "Pulled", "UpdateFailed", "Done",
           "Failed"]
