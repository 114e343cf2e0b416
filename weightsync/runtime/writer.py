"""WeightWriter: the training side, one per training process.

Set-up (:class:`~weightsync.runtime.session.TrainerSession`, on :meth:`WeightWriter.connect` or the
first ``write``): register, agree, plan, budget, bells, prove, connect. Every step, ``write(step)``
hands this rank's part to its transport and returns once it left (async) or once every instance
holds the step (sync; on an elastic transport every *live* instance: one that does not report the
step within ``instance_timeout_s`` is dropped, see the session's "membership"). In order::

    1. Sender.send(step)             this rank's part left (async: staged in the transport's snapshot)
    2. ring the `written` bell       co-located workers on this host start copying
    3. Sender.check(step)            refuse to record a step the workers did not read (weights moved)
    4. integrity.sent(step)          on the cadence: the sums of what the codec put on the wire
                                     (weightsync.integrity.check.SentCheck; none for integrity=0)
    5. MetaServer: written
    6. sync: wait `held`, then Sender.held(step) (without `held` bells 5 and 6 are one request:
                                     ``MetaClient.written_until_held``; last_timing's "wait_held" covers both)
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Protocol

import torch

from weightsync.errors import ConfigError, StepMismatch, WeightSyncError
from weightsync.integrity.cadence import DEFAULT_EVERY as DEFAULT_INTEGRITY
from weightsync.integrity.cadence import every as integrity_every
from weightsync.layout.layout import EngineLayout, Layout
from weightsync.meta.client import DEADLINE_MARGIN_S, MetaClient, MetaError, MetaTimeout
from weightsync.plan.planner import DEFAULT_BUCKET_BYTES
from weightsync.runtime.doorbell import wait_rung
from weightsync.runtime.job import DEFAULT_MEMORY_BUDGET
from weightsync.runtime.session import SessionDriven, SessionOptions, TrainerSession
from weightsync.runtime.trainer_group import Outcome, TrainerGroup
from weightsync.spec.model import ModelSpec
from weightsync.transport.base import MetaLink, StepStats

log = logging.getLogger("weightsync.writer")


class TrainSide(Protocol):
    """A training process's live weights bound to its layout (see :mod:`weightsync.bind`)."""

    engine: EngineLayout
    rank: int
    layout: Layout
    tensors: dict[str, torch.Tensor]
    spec: ModelSpec


class WeightWriter(SessionDriven):
    """Sends this training rank's part of every step to every inference instance.

    The constructor checks the options and does no I/O; :meth:`connect` (or the first :meth:`write`)
    sets the job up, waiting for every participant.

    ``group``: a torch.distributed process group of this job's trainers (their own; every member calls
    ``write(step)`` together): the group signals each step as one -- its first rank posts ``written``
    for all and waits ``held`` once, then tells every member the outcome, errors included
    (:mod:`weightsync.runtime.trainer_group`). None: this rank signals on its own."""

    def __init__(
        self,
        train: TrainSide,
        *,
        meta: str,
        job: str,
        token: str | None = None,
        mode: str = "sync",
        colocate: bool = False,
        peer_copies: bool = True,
        transport: str = "p2p",
        directory: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        memory_budget: int | None = DEFAULT_MEMORY_BUDGET,
        backend: str | None = None,
        timeout_s: float = 60.0,
        host: str = "127.0.0.1",
        integrity: int | bool | None = DEFAULT_INTEGRITY,
        instance_timeout_s: float | None = None,
        codec: str | None = None,
        delta: bool = False,
        delta_host: bool = False,
        group: object | None = None,
    ):
        # codec: what each bucket's payload holds, by name (weightsync.codec.registry; every writer and reader alike;
        # an engine declared quant=fp8 takes fp8). delta=True: codec="delta", each bucket as what changed since the
        # version its receiver proves it holds (docs/delta.md); delta_host: keep that previous version in host memory
        options = SessionOptions(colocate=colocate, mode=mode, transport=transport, directory=directory,
                                 bucket_bytes=bucket_bytes, memory_budget=memory_budget, timeout_s=timeout_s,
                                 peer_copies=peer_copies, host=host, backend=backend,
                                 integrity=integrity_every(integrity), codec=codec, delta=delta,
                                 delta_host=delta_host)
        if instance_timeout_s is not None and instance_timeout_s <= 0:
            raise ConfigError(f"instance_timeout_s must be positive, got {instance_timeout_s}")
        self.train, self.mode, self.timeout_s = train, mode, timeout_s
        #: elastic sync jobs: how long a step waits for an instance's `held` before dropping it (gone)
        self.instance_timeout_s = timeout_s if instance_timeout_s is None else instance_timeout_s
        #: instances this writer dropped, with the step they missed
        self.dropped: dict[int, int] = {}
        self.client = MetaClient(meta, job, token=token, timeout=timeout_s)
        self.session = TrainerSession(self.client, MetaLink(meta, job, token), train, options)
        #: the trainer group this rank signals steps with (``group=``), or None
        self.group = TrainerGroup(group) if group is not None else None
        self.last: StepStats | None = None
        #: seconds the last write spent sending, announcing the step and (sync) waiting until it is held
        self.last_timing: dict[str, float] = {}

    @property
    def plans(self):
        return self.connect().session.plans

    @property
    def bytes_per_step(self) -> int:
        return sum(b.nbytes for bs in self.plans.values() for b in bs)

    def write(self, step: int) -> StepStats | None:
        """Send step ``step``; in sync mode also wait until every instance holds it.

        Co-located, the weights are already shared: announcing the step lets the inference workers
        copy it, and (sync) waiting for them keeps the optimizer from changing it meanwhile.
        Async, the step is staged in a snapshot and this returns at once; instances pull it when they
        choose (:mod:`weightsync.transport.pull`).
        """
        s = self.connect().session
        if self.group is not None:
            return self._write_grouped(step)
        t0 = time.perf_counter()
        try:
            self.last = s.sender.send(step)
        except StepMismatch as e:  # the readers number steps apart: no step can meet; every participant learns now
            with contextlib.suppress(MetaError):
                self.client.abort(str(e))
            raise
        t1 = time.perf_counter()
        if s.written_bell is not None:
            s.written_bell.ring(step)  # the workers on this host start copying now...
        self._check(step)  # ...while the transport checks what they read is the step
        self._sent(step)  # a checked step: what this rank's codec put on the wire, for the workers to compare
        if self.mode == "sync" and not s.shape.elastic and s.held_bells is None:
            # no bells (a reader on another host): announce the step and wait for it held in one request
            t2 = time.perf_counter()
            self.client.written_until_held(step, self.train.rank, range(s.shape.instances), timeout=self.timeout_s)
        else:
            self.client.written(step, self.train.rank)
            t2 = time.perf_counter()
        if self.mode == "sync" and s.shape.elastic:
            self._wait_live(step)
        elif self.mode == "sync" and s.held_bells is not None:
            instances = range(s.shape.instances)
            wait_rung(s.held_bells, step, self.timeout_s, lambda t: self.client.wait_held(step, instances, timeout=t))
        if self.mode == "sync":
            s.sender.held(step)
        self.last_timing = {"send": t1 - t0, "written": t2 - t1, "wait_held": time.perf_counter() - t2}
        last = self.last_integrity
        if last is not None and last.step == step:  # inside `written`
            self.last_timing["integrity"] = last.seconds
        return self.last

    def _write_grouped(self, step: int) -> StepStats | None:
        """``write`` for a trainer group: this rank's part, then one ``written`` and one ``held`` wait for
        the whole group by its representative, whose outcome every member returns or raises with."""
        s, g = self.session, self.group
        t0 = time.perf_counter()
        mine, local_error = Outcome(step, self.train.rank, self.client.job), None
        try:
            self.last = s.sender.send(step)
            if s.written_bell is not None:
                s.written_bell.ring(step)
            self._check(step)
            self._sent(step)
        except Exception as e:  # noqa: BLE001 - told to the group, then raised here
            mine, local_error = Outcome.failed(step, self.train.rank, self.client.job, e), e
        t1 = time.perf_counter()
        parts = g.gather(mine, self.timeout_s)  # every member's part has left, or failed
        t2 = time.perf_counter()
        outcome: Outcome | None = None
        if g.leader:
            outcome = self._signal_for_group(step, parts)
        outcome = g.broadcast(outcome, step, self._leader_bound_s())
        for i, missed in outcome.dropped:
            self.dropped[i] = missed
        self.last_timing = {"send": t1 - t0, "gather": t2 - t1, "wait_held": time.perf_counter() - t2}
        if local_error is not None:
            raise local_error
        if outcome.error is not None:
            raise outcome.exception()
        if self.mode == "sync":
            s.sender.held(step)
        return self.last

    def _signal_for_group(self, step: int, parts: list[Outcome]) -> Outcome:
        """The representative: a member's failure aborts the job (the readers stop too); else post
        ``written`` for every member at once and (sync) wait until the step is held."""
        s = self.session
        failed = next((p for p in parts if p.error is not None), None)
        if failed is not None:
            with contextlib.suppress(MetaError):
                self.client.abort(f"training rank {failed.rank} failed to write step {step}: {failed.error}: "
                                  f"{failed.message}"[:1024])
            return failed
        before = dict(self.dropped)
        try:
            self.client.written(step, [p.rank for p in parts])
            if self.mode == "sync" and s.shape.elastic:
                self._wait_live(step)
            elif self.mode == "sync":
                instances = range(s.shape.instances)
                wait_rung(s.held_bells, step, self.timeout_s,
                          lambda t: self.client.wait_held(step, instances, timeout=t))
        except Exception as e:  # noqa: BLE001 - every member raises it
            return Outcome.failed(step, self.train.rank, self.client.job, e)
        dropped = tuple((i, m) for i, m in sorted(self.dropped.items()) if before.get(i) != m)
        return Outcome(step, self.train.rank, self.client.job, dropped=dropped)

    def _leader_bound_s(self) -> float:
        """How long a member waits for its representative's outcome: the representative's own calls'
        deadlines (``written``; ``held``, or the elastic wait, its look at the members and one more
        short wait), each plus the client's margin, and a second for the collectives."""
        margin = DEADLINE_MARGIN_S
        bound = self.timeout_s + margin + 1.0
        if self.mode == "sync":
            bound += self.timeout_s + margin
            if self.session.shape.elastic:
                bound += self.instance_timeout_s + 2 * (self.timeout_s + margin) + 1.0 + margin
        return bound

    def _wait_live(self, step: int) -> None:
        """Elastic: wait until every live member holds ``step`` (the MetaServer knows who they are); drop
        each that has not within ``instance_timeout_s`` (state ``gone``: it may rejoin) and go on, so a
        dead instance holds a trainer up no longer than that."""
        try:
            self.client.wait_held(step, None, timeout=self.instance_timeout_s)
            return
        except MetaTimeout:
            pass
        late = {i: m.incarnation for i, m in self.client.members().items() if m.owes(step)}
        for i, incarnation in late.items():
            reason = (f"training rank {self.train.rank}: no report of step {step} held within "
                      f"{self.instance_timeout_s:g} s")
            log.warning("dropping instance %d from job %s: %s", i, self.client.job, reason)
            # only the incarnation found late: one that rejoined meanwhile stays
            self.client.gone(i, reason=reason, incarnation=incarnation)
            self.dropped[i] = step
        # the live ones hold it by now, or the membership changed meanwhile: one more short look
        with contextlib.suppress(MetaTimeout):
            self.client.wait_held(step, None, timeout=min(1.0, self.instance_timeout_s))

    def _sent(self, step: int) -> None:
        """Step 4 of ``write`` (module docstring): the session's integrity part, where the cadence is not 0
        (the job agreed on it at set-up); each worker compares what landed before its step is held (async:
        before its pull reports the step)."""
        if self.session.integrity is not None:
            self.session.integrity.sent(step)

    @property
    def last_integrity(self):
        """The last checked step's part (:class:`weightsync.integrity.check.Checked`), or None."""
        check = self.session.integrity
        return check.last if check is not None else None

    def _check(self, step: int) -> None:
        """Refuse to record ``step`` as written when the transport says the receivers did not read it
        (co-located: the weights moved since they were shared), and abort the job so the readers fail
        at once."""
        try:
            self.session.sender.check(step)
        except WeightSyncError as e:
            error = type(e)(f"{e} Step {step} is not recorded as written, so no instance reports it held.")
            with contextlib.suppress(MetaError):  # the error itself is what matters; the readers then time out
                self.client.abort(str(error))
            raise error from None

    def save_checkpoint(self, directory: str, **options):
        """This trainer's live weights as a Hugging Face checkpoint in ``directory`` (collective over the
        training ranks; no MetaServer needed): :func:`weightsync.checkpoint.save_checkpoint`."""
        from weightsync.checkpoint import save_checkpoint

        return save_checkpoint(self.train, directory, **options)

    def close(self) -> None:
        self.session.close()
