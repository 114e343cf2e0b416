"""A trainer group: training ranks that share a torch.distributed process group signal a step as one.

Without a group every training rank posts ``written`` and long-polls ``held`` itself each step: 2 x
ranks requests at the MetaServer (a 1,024-rank job: 2,048 a step, most of a step's signalling time).
With ``WeightWriter(group=...)`` (the trainers' own group, or any subgroup of them) the ranks gather
their own part's outcome at the group's first rank, the *representative*; it posts ``written`` once
for every rank of the group (``{"ranks": [...]}``), waits ``held`` once, and broadcasts the outcome
(errors included: a member's failure, an abort, the instances dropped), so every rank returns or
raises at once with the same message, and the job's signalling is O(groups + instances).

Two collectives a step over the group, of a fixed :data:`SLOT` bytes a rank (CPU tensors on gloo,
the current CUDA device's otherwise), each waited for within a deadline: a rank whose
representative died or hangs raises :class:`GroupTimeout` naming it, it does not hang.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync import errors
from weightsync.errors import ConfigError, GroupTimeout, WeightSyncError

log = logging.getLogger("weightsync.trainer_group")

SLOT = 4096  # bytes a rank contributes to a collective: an outcome's JSON, its message cut to fit


@dataclass(frozen=True)
class Outcome:
    """What a rank (or the representative, for the group) says of a step: done, or the error to raise."""

    step: int
    rank: int  # the training rank that says it
    job: str
    error: str | None = None  # the exception's class name (one of weightsync.errors where it is one)
    message: str = ""
    status: int | None = None  # a MetaError's HTTP status
    dropped: tuple[tuple[int, int], ...] = field(default=())  # (instance, step it missed), elastic

    @classmethod
    def failed(cls, step: int, rank: int, job: str, e: BaseException) -> "Outcome":
        return cls(step, rank, job, type(e).__name__, str(e), getattr(e, "status", None))

    def encode(self) -> torch.Tensor:
        d: dict[str, Any] = {"step": self.step, "rank": self.rank, "job": self.job, "error": self.error,
                             "message": self.message, "status": self.status, "dropped": [list(x) for x in self.dropped]}
        data = json.dumps(d).encode()
        if len(data) > SLOT:  # only the message can be long
            cut = len(data) - SLOT + 16
            d["message"] = self.message[: max(0, len(self.message) - cut)] + " [...]"
            data = json.dumps(d).encode()
            while len(data) > SLOT:
                d["message"] = d["message"][:-64]
                data = json.dumps(d).encode()
        out = torch.zeros(SLOT, dtype=torch.uint8)
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return out

    @classmethod
    def decode(cls, t: torch.Tensor) -> "Outcome":
        raw = bytes(t.cpu().numpy().tobytes()).rstrip(b"\0")
        d = json.loads(raw)
        return cls(int(d["step"]), int(d["rank"]), str(d["job"]), d["error"], str(d["message"]), d["status"],
                   tuple((int(i), int(s)) for i, s in d["dropped"]))

    def exception(self) -> WeightSyncError:
        """The error this outcome reports, as the class it was raised as where weightsync has it."""
        kind = getattr(errors, self.error or "", None)
        message = self.message if self.message.startswith("training rank") else \
            f"training rank {self.rank}: {self.error}: {self.message}"
        if isinstance(kind, type) and issubclass(kind, errors.MetaError):
            return kind(message, self.status)
        if isinstance(kind, type) and issubclass(kind, WeightSyncError):
            try:
                return kind(message)
            except TypeError:  # an error class with its own signature
                pass
        return WeightSyncError(message)


class TrainerGroup:
    """This rank's view of its trainer group (see the module docstring). Construction does no I/O."""

    def __init__(self, group: Any):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("WeightWriter(group=...) needs torch.distributed initialised (the trainers' own "
                              "process group); leave group=None to signal every rank on its own")
        try:
            self.size = dist.get_world_size(group)
            self.me = dist.get_rank(group)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"WeightWriter(group=...): not a process group this rank belongs to: {e}") from None
        if self.me < 0:
            raise ConfigError("WeightWriter(group=...): this rank is not a member of the group given")
        self.group = group if group is not None else dist.group.WORLD
        self.backend = str(dist.get_backend(self.group))
        self.leader_global = dist.get_global_rank(self.group, 0)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))
        self.ranks: list[int] | None = None  # the group's training ranks, learnt at the first gather

    @property
    def leader(self) -> bool:
        """Whether this rank is the group's representative (its first rank)."""
        return self.me == 0

    def gather(self, mine: Outcome, timeout_s: float) -> list[Outcome]:
        """Every member's outcome (in group rank order), on every member; checks they write the same
        step of the same job and learns the group's training ranks."""
        import torch.distributed as dist

        inp = mine.encode().to(self.device)
        outs = [torch.empty_like(inp) for _ in range(self.size)]
        work = dist.all_gather(outs, inp, group=self.group, async_op=True)
        self._wait(work, timeout_s, f"step {mine.step}: gathering every member's part")
        got = [Outcome.decode(t) for t in outs]
        odd = [o for o in got if (o.step, o.job) != (mine.step, mine.job)]
        if odd:
            raise ConfigError(f"training rank {mine.rank}: its trainer group is not writing the same step of one job: "
                              f"training rank {odd[0].rank} writes step {odd[0].step} of job {odd[0].job!r}, this rank "
                              f"step {mine.step} of job {mine.job!r}; give group= a group of this job's trainers, "
                              f"every one calling write(step) together")
        ranks = [o.rank for o in got]
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"trainer group lists training ranks {ranks}: each must be another training rank")
        self.ranks = ranks
        return got

    def broadcast(self, outcome: Outcome | None, step: int, timeout_s: float) -> Outcome:
        """The representative's ``outcome``, on every member (members pass None)."""
        import torch.distributed as dist

        t = outcome.encode().to(self.device) if outcome is not None else torch.zeros(SLOT, dtype=torch.uint8,
                                                                                     device=self.device)
        work = dist.broadcast(t, src=self.leader_global, group=self.group, async_op=True)
        self._wait(work, timeout_s, f"step {step}: waiting for the representative (training rank of group rank 0, "
                                    f"global rank {self.leader_global}) to say whether the step is held")
        return Outcome.decode(t)

    def _wait(self, work: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            if self.backend == "gloo":
                work.wait(timeout=datetime.timedelta(seconds=max(0.001, timeout_s)))
                return
            while not work.is_completed():  # NCCL: wait() would only order a stream; ask the CPU side
                if time.monotonic() > deadline:
                    raise TimeoutError("timed out")
                time.sleep(20e-6)
            work.wait()
        except Exception as e:  # noqa: BLE001 - a timed-out or broken collective is this rank's error
            raise GroupTimeout(f"trainer group ({self.backend}, {self.size} ranks): {what}: not done within "
                               f"{timeout_s:.3g} s ({type(e).__name__}: {str(e)[:200]}); a member or the "
                               f"representative died, hangs, or does not call write(step) with the others") from None
