"""The records a validation returns, and the one element-wise comparison every path uses.

A :class:`TensorCheck` is one tensor of one worker compared with what the same engine holds after
loading the checkpoint; a :class:`ValidationReport` is every check of one instance with its
:class:`ValidationSummary` (``tensors``, ``mismatched``, ``mismatches``). All are frozen and plain
(ints, floats, strings, tuples), so they pickle across vLLM's and the faithful workers' process hops
and print as JSON (:meth:`ValidationReport.to_json`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from weightsync.errors import ValidationMismatch

#: how the reference was produced: the engine's own loader, or weightsync's layout (labelled as such)
VIA_HF = "from_pretrained"
VIA_VLLM = "vllm-loader"
VIA_LAYOUT = "layout"


@dataclass(frozen=True)
class TensorCheck:
    """One tensor of worker ``rank``: ``differing`` elements (of ``numel``) differ from the reference,
    the largest by ``max_abs_diff``, the first (row-major) at ``first_index``. ``problem`` is set, and
    nothing is counted, when the two cannot be compared element-wise (missing on one side, other shape
    or dtype)."""

    name: str
    rank: int
    shape: tuple[int, ...]
    dtype: str
    numel: int
    differing: int
    max_abs_diff: float
    first_index: tuple[int, ...] | None
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem and self.differing == 0

    def line(self) -> str:
        if self.problem:
            return f"{self.name} (rank {self.rank}): {self.problem}"
        return (f"{self.name} (rank {self.rank}) {list(self.shape)} {self.dtype}: {self.differing} of {self.numel} "
                f"elements differ, max |diff| {self.max_abs_diff:g}, first at {list(self.first_index or ())}")


@dataclass(frozen=True)
class ValidationSummary:
    tensors: int  # checks made (one per tensor per worker)
    mismatched: int  # checks that failed
    mismatches: tuple[str, ...]  # the names of the tensors that failed, first occurrence order, once each


@dataclass(frozen=True)
class ValidationReport:
    """Every tensor of one instance against the checkpoint at ``checkpoint`` (``step``: the reader's
    version when it ran, if any). ``via`` says how the reference was made (:data:`VIA_HF`,
    :data:`VIA_VLLM`, :data:`VIA_LAYOUT`)."""

    engine: str
    via: str
    checkpoint: str
    checks: tuple[TensorCheck, ...]
    seconds: float
    step: int | None = None

    @property
    def summary(self) -> ValidationSummary:
        bad = [c for c in self.checks if not c.ok]
        return ValidationSummary(len(self.checks), len(bad), tuple(dict.fromkeys(c.name for c in bad)))

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks) and bool(self.checks)

    def mismatched(self) -> tuple[TensorCheck, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def message(self, limit: int = 10) -> str:
        s = self.summary
        if not self.checks:
            return f"{self.engine}: nothing was compared against {self.checkpoint} (via {self.via})"
        head = (f"{self.engine}: {s.mismatched} of {s.tensors} tensors differ from what the engine holds after "
                f"loading {self.checkpoint} (via {self.via})")
        if not s.mismatched:
            return head
        lines = [c.line() for c in self.mismatched()[:limit]]
        more = f"\n  ... and {s.mismatched - limit} more" if s.mismatched > limit else ""
        return head + ":\n  " + "\n  ".join(lines) + more

    def raise_if_mismatched(self) -> "ValidationReport":
        if not self.ok:
            raise ValidationMismatch(self.message())
        return self

    def to_json(self, checks: str = "mismatched") -> dict:
        """JSON-safe: the summary and (``checks``: "mismatched", "all" or "none") the per-tensor checks."""
        s = self.summary
        out: dict = {"engine": self.engine, "via": self.via, "checkpoint": self.checkpoint, "step": self.step,
                     "ok": self.ok, "seconds": self.seconds, "tensors": s.tensors, "mismatched": s.mismatched,
                     "mismatches": list(s.mismatches)}
        chosen = {"all": self.checks, "mismatched": self.mismatched(), "none": ()}[checks]
        out["checks"] = [_json_check(c) for c in chosen]
        return out


def _json_check(c: TensorCheck) -> dict:
    d = asdict(c)
    d["shape"] = list(c.shape)
    d["first_index"] = list(c.first_index) if c.first_index is not None else None
    if not math.isfinite(d["max_abs_diff"]):
        d["max_abs_diff"] = str(d["max_abs_diff"])
    return d


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def compare(name: str, rank: int, got: torch.Tensor | None, want: torch.Tensor | None) -> TensorCheck:
    """``got`` (what the engine holds) against ``want`` (what it holds after loading the checkpoint),
    element by element on ``got``'s device. Equal means equal values; NaN equals NaN in the same place
    (a region both sides leave unwritten, e.g. padding, is not a difference)."""
    if got is None or want is None:
        t = got if got is not None else want
        where = "only in the engine, not after loading the checkpoint" if want is None else \
            "missing in the engine, present after loading the checkpoint"
        return TensorCheck(name, rank, tuple(t.shape), _dtype(t), t.numel(), 0, 0.0, None, where)
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return TensorCheck(name, rank, tuple(got.shape), _dtype(got), got.numel(), 0, 0.0, None,
                           f"the engine holds {list(got.shape)} {_dtype(got)}, the checkpoint loads as "
                           f"{list(want.shape)} {_dtype(want)}")
    with torch.no_grad():
        a, b = got.detach(), want.detach().to(got.device)
        if a.dtype.is_floating_point or a.dtype.is_complex:
            ne = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
        else:
            ne = a != b
        count = int(ne.sum())
        if count == 0:
            return TensorCheck(name, rank, tuple(a.shape), _dtype(a), a.numel(), 0, 0.0, None)
        flat = int(ne.reshape(-1).to(torch.uint8).argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
        if a.dtype.is_floating_point:
            diff = (a.double() - b.double()).abs()[ne]
            big = float(diff.nan_to_num(nan=math.inf).max())
        else:
            big = float((a.double() - b.double()).abs()[ne].max())
    return TensorCheck(name, rank, tuple(a.shape), _dtype(a), a.numel(), count, big, index)
