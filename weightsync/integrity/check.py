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

A mismatch raises :class:`~weightsync.errors.IntegrityError` naming the step, pair, bucket and the
tensors in it, from the worker, so ``update`` fails and the reader does not report the step held
(its ``version`` stays None, or the old step when staged).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weightsync.errors import ConfigError, IntegrityError
from weightsync.integrity import exchange
from weightsync.integrity.sums import PairSums, SumPlan, bucket_sums, destination_dtypes, sum_plan
from weightsync.plan.planner import Bucket, Pair

log = logging.getLogger("weightsync.integrity")


def agree(people: list[dict], mine: int, client=None) -> None:
    """Refuse a job whose participants registered different cadences (a worker would wait for sums no
    trainer posts), aborting it through ``client`` so every peer stops at once."""
    from weightsync.errors import JobMismatch, MetaError
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


@dataclass(frozen=True)
class Checked:
    """One side's part of one checked step."""

    step: int
    buckets: int
    seconds: float


class SentSums:
    """A training rank's side: the regions of its plan (derived at the first checked step) and posting."""

    def __init__(self, rank: int, plans: Mapping[Pair, list[Bucket]], tensors: Mapping[str, torch.Tensor],
                 planner=None):
        self.rank, self.plans, self.tensors, self.planner = rank, plans, tensors, planner
        self._plan: SumPlan | None = None

    def plan(self) -> SumPlan:
        if self._plan is None:
            dtypes = destination_dtypes(self.planner, self.plans) if self.planner is not None else None
            self._plan = sum_plan(self.plans, self.tensors, sending=True, dst_dtypes=dtypes)
        return self._plan

    def sums(self) -> PairSums:
        return bucket_sums(self.plan(), self.tensors)

    def post(self, client, step: int) -> Checked:
        t0 = time.perf_counter()
        sums = self.sums()
        exchange.publish(client, self.rank, step, sums)
        return Checked(step, sum(len(v) for v in sums.values()), time.perf_counter() - t0)


def landed_plan(plans: Mapping[Pair, list[Bucket]], targets: Mapping[str, torch.Tensor]) -> SumPlan:
    return sum_plan(plans, targets, sending=False)


def compare(step: int, who: str, plan: SumPlan, expected: PairSums, landed: PairSums) -> None:
    """Raise IntegrityError naming every pair and bucket whose landed sum differs from the sent one."""
    bad = []
    for pair in plan.pairs:
        want, got = expected.get(pair), landed[pair]
        if want is None:  # elastic jobs: the trainers plan one instance slot (instance 0) for every instance
            want = expected.get((pair[0], 0, pair[2]))
        if want is None:
            raise IntegrityError(f"{who}: training rank {pair[0]} posted no checksums for instance {pair[1]} rank "
                                 f"{pair[2]} at step {step}; the step is not reported held", pair=pair)
        if len(want) != len(got):
            raise IntegrityError(f"{who}: step {step}: training rank {pair[0]} posted {len(want)} bucket sums for "
                                 f"instance {pair[1]} rank {pair[2]}, this worker planned {len(got)} buckets",
                                 pair=pair)
        for (b, regions), w, g in zip(plan.buckets[pair], want, got):
            if w != g:
                bad.append((pair, b, regions))
    if not bad:
        return
    pair, b, regions = bad[0]
    tensors = sorted({r.tensor for r in regions})
    listed = ", ".join(tensors[:6]) + (f" and {len(tensors) - 6} more" if len(tensors) > 6 else "")
    more = f" ({len(bad)} buckets differ in all: " + ", ".join(
        f"training rank {p[0]} bucket {bb.index}" for p, bb, _ in bad[:8]) + ")" if len(bad) > 1 else ""
    raise IntegrityError(
        f"{who}: step {step}: what landed differs from what training rank {pair[0]} sent in bucket {b.index} "
        f"({b.nbytes} bytes, {len(b.copies)} copies into {listed}) of training rank {pair[0]} -> instance {pair[1]} "
        f"rank {pair[2]}{more}; the step is not reported held: the bytes were corrupted or missed on the way, "
        "or something else wrote these tensors during the update",
        pair=pair, bucket=b.index,
    )


def verify(client, step: int, who: str, plans: Mapping[Pair, list[Bucket]], targets: Mapping[str, torch.Tensor],
           timeout_s: float, cache: dict) -> Checked:
    """A worker's check of one step: its destination boxes' sums against its senders' posted sums.
    ``cache`` keeps the derived regions between steps (keyed by the targets' identity)."""
    t0 = time.perf_counter()
    key = ("landed", id(targets))
    plan = cache.get(key)
    if plan is None:
        plan = cache[key] = landed_plan(plans, targets)
    landed = bucket_sums(plan, targets)
    expected = exchange.fetch(client, {p[0] for p in plan.pairs}, step, timeout_s)
    compare(step, who, plan, expected, landed)
    return Checked(step, sum(len(v) for v in landed.values()), time.perf_counter() - t0)


def verify_worker(context, step: int, plans: Mapping[Pair, list[Bucket]], targets: Mapping[str, torch.Tensor],
                  check: IntegrityCheck) -> Checked:
    """:func:`verify` on an inference worker (``context``: its ReceiverContext, whose ``extra`` keeps the
    MetaServer client and the derived regions between steps)."""
    state = context.extra.setdefault("integrity", {})
    client = state.get("client")
    if client is None:
        client = state["client"] = context.link.client(check.timeout_s)
    who = f"instance {context.instance} rank {context.rank}"
    got = verify(client, step, who, plans, targets, check.timeout_s, state)
    log.debug("%s: step %d checked (%d buckets) in %.3f s", who, step, got.buckets, got.seconds)
    return got
