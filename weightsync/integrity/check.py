"""Per-step integrity: the writer posts what it sent, each worker compares what landed, before `held`.

The cadence (``integrity=N``, the writer's and reader's option, which every participant registers and
must agree on): steps with ``step % N == 0`` are checked, ``N=1`` every step, ``0`` (or None/False)
never. On a checked step

- every training rank, after sending and before posting ``written``, computes each of its buckets'
  checksum over the source boxes (:mod:`.sums`) and posts them (:mod:`.exchange`: one value a rank
  in a large job);
- every inference worker, once every byte of the step landed (after the transport returned, and
  co-located after every worker of its instance returned, since they write into each other), computes
  the same over its destination boxes, reads its senders' values and compares, bucket by bucket; a
  staged worker checks its copy before committing it, so a bad step never reaches the live weights.

A mismatch raises :class:`~weightsync.errors.IntegrityError` from the worker, so ``update`` (or an
async ``pull``) fails and the reader does not report the step held (its ``version`` stays None, or
the old step when staged). Before raising, the finer exchange (:mod:`.answer`, on a mismatch only)
fetches the senders' per-copy sums, so the error names the exact tensors, boxes and (one flipped bit,
:mod:`.locate`) the element. Async pulls compare with the sums posted with the staged snapshot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weightsync.errors import ConfigError, IntegrityError, MetaError
from weightsync.integrity import exchange
from weightsync.integrity.locate import BadCopy, bad_copies
from weightsync.integrity.sums import PairSums, StepSums, SumPlan, destination_dtypes, step_sums, sum_plan
from weightsync.plan.planner import Bucket, Pair

log = logging.getLogger("weightsync.integrity")


def agree(people: list[dict], mine: int, client=None) -> None:
    """Refuse a job whose participants registered different cadences (a worker would wait for sums no
    trainer posts), aborting it through ``client`` so every peer stops at once."""
    from weightsync.errors import JobMismatch
    from weightsync.runtime.job import check_agreement

    try:
        theirs = check_agreement(people, "integrity", "the integrity cadence (integrity=N)")
        if theirs is not None and theirs != mine:
            raise ConfigError(f"this participant checks every {mine} steps, the job every {theirs}")
    except (JobMismatch, ConfigError) as e:
        if client is not None:
            try:
                client.abort(str(e))
            except MetaError:
                pass
        raise


@dataclass(frozen=True)
class IntegrityCheck:
    """What a reader hands its workers for a checked step (crosses process boundaries: plain values)."""

    timeout_s: float  # how long a worker waits for its senders' sums
    #: async pulls: a snapshot whose sums already moved on to a later step is not a mismatch, pull again
    pulled: bool = False
    every: int = 1  # async pulls: the cadence (which pulled steps are checked)

    def due(self, step: int) -> bool:
        from weightsync.integrity.cadence import due

        return due(self.every, step)


@dataclass(frozen=True)
class Checked:
    """One side's part of one checked step."""

    step: int
    buckets: int
    seconds: float
    #: False: an async pull's senders already posted a later snapshot's sums (nothing compared: pull again)
    current: bool = True


#: how long a worker whose check failed waits for its senders' per-copy sums (the finer exchange): a
#: sender answers at once, or once its answerer's current long-poll slice ended (answer.SLOW_POLL_S)
ASK_S = 12.0


class SentSums:
    """A training rank's side: the regions of its plan (derived at the first checked step), posting, and
    answering the finer exchange (:mod:`.answer`) for the last checked step."""

    def __init__(self, rank: int, plans: Mapping[Pair, list[Bucket]], tensors: Mapping[str, torch.Tensor],
                 planner=None):
        self.rank, self.plans, self.tensors, self.planner = rank, plans, tensors, planner
        self._plan: SumPlan | None = None
        self._plan_of: int | None = None
        self.answerer = None

    def plan(self, tensors: Mapping[str, torch.Tensor] | None = None) -> SumPlan:
        tensors = self.tensors if tensors is None else tensors
        if self._plan is None or self._plan_of != id(tensors):
            dtypes = destination_dtypes(self.planner, self.plans) if self.planner is not None else None
            self._plan, self._plan_of = sum_plan(self.plans, tensors, sending=True, dst_dtypes=dtypes), id(tensors)
        return self._plan

    def sums(self, tensors: Mapping[str, torch.Tensor] | None = None) -> StepSums:
        tensors = self.tensors if tensors is None else tensors
        return step_sums(self.plan(tensors), tensors)

    def post(self, client, step: int, tensors: Mapping[str, torch.Tensor] | None = None) -> Checked:
        """Post the bucket sums of ``step`` (of ``tensors``: default the live weights; async, the staged
        snapshot) and arm the answerer with its copy sums."""
        from weightsync.integrity.answer import Answerer

        t0 = time.perf_counter()
        sums = self.sums(tensors)
        exchange.publish(client, self.rank, step, sums.buckets)
        if self.answerer is None:
            self.answerer = Answerer(client, self.rank)
        self.answerer.arm(step, {p: tuple(v for b in bs for v in b) for p, bs in sums.copies.items()})
        return Checked(step, sum(len(v) for v in sums.buckets.values()), time.perf_counter() - t0)

    def disarm(self) -> None:
        if self.answerer is not None:
            self.answerer.disarm()

    def close(self) -> None:
        if self.answerer is not None:
            self.answerer.close()


def landed_plan(plans: Mapping[Pair, list[Bucket]], targets: Mapping[str, torch.Tensor]) -> SumPlan:
    return sum_plan(plans, targets, sending=False)


def _expected(expected: Mapping[Pair, tuple], pair: Pair):
    want = expected.get(pair)
    if want is None:  # elastic jobs: the trainers plan one instance slot (instance 0) for every instance
        want = expected.get((pair[0], 0, pair[2]))
    return want


def differing(step: int, who: str, plan: SumPlan, expected: PairSums, landed: PairSums) -> list[tuple[Pair, int]]:
    """Every ``(pair, bucket number)`` whose landed sum differs from the sent one; an IntegrityError
    where a sender posted nothing (or another bucket count) for a pair."""
    bad = []
    for pair in plan.pairs:
        want, got = _expected(expected, pair), landed[pair]
        if want is None:
            raise IntegrityError(f"{who}: training rank {pair[0]} posted no checksums for instance {pair[1]} rank "
                                 f"{pair[2]} at step {step}; the step is not reported held", pair=pair)
        if len(want) != len(got):
            raise IntegrityError(f"{who}: step {step}: training rank {pair[0]} posted {len(want)} bucket sums for "
                                 f"instance {pair[1]} rank {pair[2]}, this worker planned {len(got)} buckets",
                                 pair=pair)
        bad += [(pair, k) for k, (w, g) in enumerate(zip(want, got)) if w != g]
    return bad


_WHAT_TO_DO = ("the step is not reported held. The bytes were corrupted or missed on the way, or something else "
               "wrote these tensors during the update: retry the step (a transient fault passes on a resend); if "
               "the same tensor fails again, check this worker's transport and memory (GPU ECC errors) and that "
               "nothing else writes the engine's weights while it updates")


def mismatch_error(step: int, who: str, plan: SumPlan, bad: list[tuple[Pair, int]],
                   copies: list[BadCopy] | None, why_not: str = "") -> IntegrityError:
    """The error of a failed check: the exact differing copies where the senders' copy sums are known
    (``copies``), else every differing bucket with the tensors it holds (``why_not``: why not exact)."""
    pair, k = bad[0]
    b, regions = plan.buckets[pair][k]
    where = f"training rank {pair[0]} -> instance {pair[1]} rank {pair[2]}"
    if copies:
        listed = "; ".join(c.describe() for c in copies[:8]) + (f"; and {len(copies) - 8} more copies"
                                                               if len(copies) > 8 else "")
        tensors = sorted({c.copy.dst_tensor for c in copies})
        error = IntegrityError(
            f"{who}: step {step}: {', '.join(tensors[:8])} differ{'' if len(tensors) > 1 else 's'} from what was "
            f"sent ({len(copies)} differing {'copies' if len(copies) > 1 else 'copy'} in {len(bad)} "
            f"bucket{'s' if len(bad) > 1 else ''}, first {where} bucket {b.index}): {listed}; {_WHAT_TO_DO}",
            pair=pair, bucket=b.index)
        error.tensors = tuple(tensors)
        return error
    tensors = sorted({r.tensor for r in regions})
    listed = ", ".join(tensors[:6]) + (f" and {len(tensors) - 6} more" if len(tensors) > 6 else "")
    more = f" ({len(bad)} buckets differ in all: " + ", ".join(
        f"training rank {p[0]} bucket {plan.buckets[p][kk][0].index}" for p, kk in bad[:8]) + ")" \
        if len(bad) > 1 else ""
    return IntegrityError(
        f"{who}: step {step}: what landed differs from what training rank {pair[0]} sent in bucket {b.index} "
        f"({b.nbytes} bytes, {len(b.copies)} copies into {listed}) of {where}{more}; which of these tensors "
        f"differ is unknown ({why_not or 'no per-copy sums'}); {_WHAT_TO_DO}",
        pair=pair, bucket=b.index,
    )


def compare(step: int, who: str, plan: SumPlan, expected: PairSums, landed: PairSums) -> None:
    """Raise IntegrityError naming every pair and bucket whose landed sum differs from the sent one
    (bucket sums only: :func:`verify` names the exact copies through the finer exchange)."""
    bad = differing(step, who, plan, expected, landed)
    if bad:
        raise mismatch_error(step, who, plan, bad, None, "compared by bucket only")


def locate(client, step: int, who: str, plan: SumPlan, bad: list[tuple[Pair, int]], landed: StepSums,
           targets: Mapping[str, torch.Tensor], wait_s: float) -> tuple[list[BadCopy] | None, str]:
    """The finer exchange of a failed step: ask every sender of a differing bucket for its per-copy sums
    and name the copies that differ; ``(None, why)`` where they did not answer within ``wait_s``."""
    srcs = sorted({p[0] for p, _ in bad})
    try:
        for src in srcs:
            exchange.ask(client, src, step, who)
    except MetaError as e:
        return None, f"asking for the per-copy sums failed: {e}"
    try:
        sent = exchange.fetch(client, srcs, step, wait_s, kind=exchange.COPIES, stale_ok=True)
    except (IntegrityError, MetaError):  # not answered in time, or the job ended meanwhile: name the buckets
        sent = None
    if sent is None:
        return None, f"training ranks {srcs} did not answer with their per-copy sums within {wait_s:g} s"
    flat = {}
    for pair, _ in bad:
        want = _expected(sent, pair)
        if want is None or len(want) != sum(len(rs) for _, rs in plan.buckets[pair]):
            return None, f"training rank {pair[0]} answered with no or other per-copy sums for this pair"
        flat[pair] = want
    found = bad_copies(plan, bad, flat, landed.copies, targets)
    return (found, "") if found else (None, "the per-copy sums agree (a sender's copy sums changed?)")


def verify(client, step: int, who: str, plan: SumPlan, targets: Mapping[str, torch.Tensor], timeout_s: float,
           pulled: bool = False) -> Checked:
    """A worker's check of one step: its destination boxes' sums (``plan``: :func:`landed_plan`) against
    its senders' posted sums; on a mismatch the finer exchange names the exact copies. ``pulled``
    (async): senders already past ``step`` answer ``current=False`` instead of failing."""
    t0 = time.perf_counter()
    landed = step_sums(plan, targets)
    expected = exchange.fetch(client, {p[0] for p in plan.pairs}, step, timeout_s, stale_ok=pulled)
    if expected is None:
        return Checked(step, 0, time.perf_counter() - t0, current=False)
    bad = differing(step, who, plan, expected, landed.buckets)
    if bad:
        copies, why_not = locate(client, step, who, plan, bad, landed, targets, min(ASK_S, timeout_s))
        raise mismatch_error(step, who, plan, bad, copies, why_not)
    return Checked(step, sum(len(v) for v in landed.buckets.values()), time.perf_counter() - t0)


class Verifier:
    """An inference worker's side: its MetaServer client and the landed regions of each set of targets
    it checks (the live tensors; a staged reader's copy), derived at the first check of each and kept."""

    def __init__(self, link, instance: int, rank: int, plans: Mapping[Pair, list[Bucket]]):
        self.link, self.plans = link, plans
        self.who = f"instance {instance} rank {rank}"
        self.client = None
        self._landed: dict[bool, SumPlan] = {}

    def verify(self, step: int, targets: Mapping[str, torch.Tensor], check: IntegrityCheck, staged: bool) -> Checked:
        """:func:`verify` of ``targets`` (``staged``: the staged copy, else the live tensors)."""
        if self.client is None:
            self.client = self.link.client(check.timeout_s)
        plan = self._landed.get(staged)
        if plan is None:
            plan = self._landed[staged] = landed_plan(self.plans, targets)
        got = verify(self.client, step, self.who, plan, targets, check.timeout_s, pulled=check.pulled)
        log.debug("%s: step %d checked (%d buckets) in %.3f s", self.who, step, got.buckets, got.seconds)
        return got
