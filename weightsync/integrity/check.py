"""Per-step integrity: the codec stage's proof of what it put on the wire, checked where it landed.

What is summed is the codec's to say, on both sides (:meth:`weightsync.payload.codec.Codec.on_wire` on a
training rank, :meth:`~weightsync.payload.codec.Codec.landed` on a worker); this module sums it along the
proven plan (:mod:`.sums`), moves the per-bucket sums through the MetaServer (:mod:`.exchange`) and
compares. The sums travel beside the payloads, not in the codec's per-bucket :class:`Header`: the full
codec has no header where a transport moves the plan's bytes zero-copy (p2p and co-located post or copy
the live tensors' views, nixl reads them), and a check must cost nothing on a step off the cadence.

The cadence (``integrity=N``: steps with ``step % N == 0`` are checked, ``N=1`` every step, ``0`` never)
is one of the session terms every participant registers (:class:`weightsync.meta.records.SessionTerms`):
a participant with another cadence is refused at set-up, on every side, naming it. Where it is 0 neither
side makes its part, so an unchecked job does no integrity work at all.

Call order on a training rank (:class:`SentCheck`, made by the session once the plan is made)::

    1. SentCheck.for_session(client, rank, plans, tensors, codec, planner, every, sync)
                                      None where every is 0; else the regions, derived once; no I/O
    2. every step, after the transport's send returned and before ``written`` is posted:
       sent(step) -> Checked | None   sync: the last checked step is held, so its answerer is disarmed;
                                      a step on the cadence: the bucket sums of what the codec puts on
                                      the wire are posted and the answerer armed with its copy sums
                                      (async: ``send`` staged the snapshot from these very tensors inside
                                      the same call, so their sums are the snapshot's)
    3. close()

Call order on an inference worker (:class:`LandedCheck`, made by ``worker.plan``)::

    1. LandedCheck(plans, who, targets, timeout_s, codec)   the landed regions, derived once; no I/O
    2. connect(link)                                          its MetaServer client
    3. a step on the cadence, once EVERY worker's receive (or pull) returned -- co-located workers write
       into each other -- and before any worker commits a staged copy (:mod:`weightsync.runtime.reader`):
       verify(step, targets, pulled) -> Checked   raises IntegrityError naming the copies that differ;
                                                  ``pulled`` (async): Checked(current=False) where the
                                                  senders already posted a later snapshot's sums

A mismatch raises :class:`~weightsync.errors.IntegrityError` from the worker, so ``update`` (or an async
``pull``) fails and the reader does not report the step held (its ``version`` stays None, or the old
step when staged: nothing was committed). Before raising, the finer exchange (:mod:`.answer`, on a
mismatch only) fetches the senders' per-copy sums, so the error names the exact tensors, boxes and (one
flipped bit, :mod:`.locate`) the element.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weightsync.payload.codec import landed, on_wire
from weightsync.errors import IntegrityError, MetaError
from weightsync.integrity import exchange
from weightsync.integrity.cadence import due
from weightsync.integrity.locate import BadCopy, bad_copies
from weightsync.integrity.sums import PairSums, StepSums, SumPlan, destination_dtypes, step_sums, sum_plan
from weightsync.plan.planner import Bucket, Pair

log = logging.getLogger("weightsync.integrity")


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


class SentCheck:
    """A training rank's part (call order in the module docstring): the regions of its plan in what its
    codec puts on the wire, derived once, the posting, and the answerer of the finer exchange (:mod:`.answer`)
    for the last checked step."""

    def __init__(self, client, rank: int, plans: Mapping[Pair, list[Bucket]], tensors: Mapping[str, torch.Tensor],
                 every: int, codec=None, dst_dtypes: Mapping[tuple[Pair, str], torch.dtype] | None = None,
                 sync: bool = True):
        self.client, self.rank, self.tensors, self.every = client, rank, tensors, every
        self.codec, self.sync = codec, sync
        #: what each step's sums read: the codec's wire tensors, named as the plan's sources
        self.plan = sum_plan(plans, on_wire(codec, tensors), sending=True, dst_dtypes=dst_dtypes)
        self.answerer = None
        self.last: Checked | None = None  # the last checked step's part

    @classmethod
    def for_session(cls, client, rank: int, plans: Mapping[Pair, list[Bucket]], tensors: Mapping[str, torch.Tensor],
                    codec, planner, every: int, sync: bool) -> SentCheck | None:
        """The part a training rank's session makes at set-up: None where the cadence is 0 (nothing to do)."""
        if not every:
            return None
        return cls(client, rank, plans, tensors, every, codec, destination_dtypes(planner, plans), sync)

    def sent(self, step: int) -> Checked | None:
        """After the transport sent ``step`` (step 2 of the call order): on the cadence, post its sums."""
        if self.sync:  # the last checked step is held by now: no worker asks for its copy sums any more
            self.disarm()
        if not due(self.every, step):
            return None
        t0 = time.perf_counter()
        sums = step_sums(self.plan, on_wire(self.codec, self.tensors))
        exchange.publish(self.client, self.rank, step, sums.buckets)
        if self.answerer is None:
            from weightsync.integrity.answer import Answerer

            self.answerer = Answerer(self.client, self.rank)
        self.answerer.arm(step, {p: tuple(v for b in bs for v in b) for p, bs in sums.copies.items()})
        self.last = Checked(step, sum(len(v) for v in sums.buckets.values()), time.perf_counter() - t0)
        return self.last

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


class LandedCheck:
    """An inference worker's part (call order in the module docstring): the landed regions of its plan,
    derived once from its tensors (a staged copy has the same names, boxes and dtypes), and its MetaServer
    client. One for sync steps and async pulls alike."""

    def __init__(self, plans: Mapping[Pair, list[Bucket]], who: str, targets: Mapping[str, torch.Tensor],
                 timeout_s: float, codec=None):
        self.who, self.timeout_s, self.codec = who, timeout_s, codec
        self.plan = landed_plan(plans, landed(codec, targets))
        self.client = None

    def connect(self, link) -> None:
        self.client = link.client(self.timeout_s)

    def verify(self, step: int, targets: Mapping[str, torch.Tensor], pulled: bool = False) -> Checked:
        """:func:`verify` of what landed in ``targets`` (the live tensors, or a staged reader's copy)."""
        if self.client is None:
            raise RuntimeError(f"{self.who}: the integrity check was not connected (worker.connect runs first)")
        got = verify(self.client, step, self.who, self.plan, landed(self.codec, targets), self.timeout_s,
                     pulled=pulled)
        log.debug("%s: step %d checked (%d buckets) in %.3f s", self.who, step, got.buckets, got.seconds)
        return got
