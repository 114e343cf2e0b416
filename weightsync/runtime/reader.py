"""WeightReader: the inference side, one per instance, in the instance's control process.

It registers every worker (GPU) of its instance, checks the job like the writers do, and drives one
worker reader per GPU through :meth:`InferenceInstance.call`: each worker plans its own receives,
joins the train+inference group and, every step, receives its buckets straight into the engine's
live parameters. ``update(step)`` returns the step every worker now fully holds; after a failed
update ``version`` is None (the tensors are a mix of two steps) until a later update succeeds --
unless the reader is ``staged``: then each worker receives into a copy of its tensors (twice the
memory) and commits only a complete step, so a failed update leaves the old version intact.

``update(step)``, in order (``pull()`` the same, with ``worker.pull`` in 3 and the sums posted with
the trainers' snapshot in 4)::

    1. co-located: wait until every training rank announced the step written
    2. instance.pause()
    3. worker.receive on every worker                    the step lands (staged: in each worker's copy)
    4. _settle: on the integrity cadence worker.verify on every worker, once all returned; staged: then
       worker.commit on every worker, together
    5. instance.after_update(); resume()                 a non-staged failure withholds the instance first
    6. validate (on its cadence); version = step; set_version; report the step held

(Co-located or NIXL, on an instance with ``call_when``, ``early_call`` on (the default): 2, then 3 sent at once, its
workers setting up while the reader waits for 1; their first copy waits for the go (:mod:`weightsync.transport.gate`).
A step that never comes is called off before any copy: the workers keep what they held, nothing is withheld.)

On an elastic transport (file, nixl) a reader may join a running job -- an ``instance_id`` beyond the
``instances`` the job started with, or a gone or left instance's id -- and its first ``update`` may
ask for the latest step written; ``close`` leaves the job (the session's "membership").
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from weightsync.errors import IntegrityError, StepMismatch, StepNotWritten, TransportError, WeightsMoved
from weightsync.integrity.cadence import DEFAULT_EVERY as DEFAULT_INTEGRITY
from weightsync.integrity.cadence import due as integrity_due
from weightsync.integrity.cadence import every as integrity_every
from weightsync.meta.client import MetaClient, MetaError, MetaTimeout
from weightsync.plan.planner import DEFAULT_BUCKET_BYTES
from weightsync.runtime import worker
from weightsync.runtime.doorbell import wait_rung
from weightsync.runtime.instance import InferenceInstance
from weightsync.runtime.job import DEFAULT_MEMORY_BUDGET
from weightsync.runtime.session import InstanceSession, SessionDriven, SessionOptions, check_instance_id
from weightsync.runtime.worker import WorkerReport
from weightsync.transport.base import DEFAULT_WRITTEN_TIMEOUT_S, MetaLink
from weightsync.transport.liveness import TrainerLost


#: how long a wait for the trainers' `written` runs before the reader looks whether they wrote another step instead
NUMBERING_CHECK_S = 1.0


class _Written:
    """One update's wait for the trainers' `written`, run as the gate of a call sent early
    (:meth:`InferenceInstance.call_when`) or before the call: what it raised (the step never came), when it let the
    copies go, the wait for the step's record."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.went: float | None = None
        self.recorded: Future | None = None

    def wait(self, reader: "WeightReader", step: int, held: int | None) -> None:
        try:
            self.recorded = reader._wait_written(step, held)
        except BaseException as e:
            self.error = e
            raise
        self.went = time.perf_counter()


class WeightReader(SessionDriven):
    """Receives every step into one inference instance's live weights.

    The constructor checks the options and does no I/O; :meth:`connect` (or the first ``update`` /
    ``pull``) sets the job up, waiting for every participant."""

    def __init__(
        self,
        instance: InferenceInstance,
        *,
        meta: str,
        job: str,
        instance_id: int,
        instances: int,
        token: str | None = None,
        colocate: bool = False,
        peer_copies: bool = True,
        transport: str = "p2p",
        directory: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        memory_budget: int | None = DEFAULT_MEMORY_BUDGET,
        timeout_s: float = 60.0,
        staged: bool = False,
        mode: str = "sync",
        push: bool = True,
        integrity: int | bool | None = DEFAULT_INTEGRITY,
        validate_every: int = 0,
        validate_checkpoint: str | Callable[[int], str] | None = None,
        codec: str | None = None,
        delta: bool = False,
        instance_timeout_s: float | None = None,
        early_call: bool = True,
        written_timeout_s: float = DEFAULT_WRITTEN_TIMEOUT_S,
    ):
        # written_timeout_s (sync): how long update(step) waits for the trainers to announce the step while they are
        # alive -- a training step may take minutes; timeout_s bounds the transfer once the step began.
        # instance_timeout_s (async): the MetaServer marks this instance gone once its heartbeat has been
        # silent that long (default timeout_s; weightsync.meta.heartbeat). early_call (co-located or NIXL, sync):
        # update(step) pauses the instance and sends the step's call before the trainers' `written`, where the
        # instance can (call_when); False: it waits for `written` first, so the engine serves until then
        if validate_every < 0 or (validate_every and validate_checkpoint is None):
            raise ValueError("validate_every=N (N >= 1) needs validate_checkpoint=: the checkpoint directory, or "
                             "a callable step -> directory, to validate every Nth update against")
        options = SessionOptions(colocate=colocate, mode=mode, transport=transport, directory=directory,
                                 bucket_bytes=bucket_bytes, memory_budget=memory_budget, timeout_s=timeout_s,
                                 peer_copies=peer_copies, integrity=integrity_every(integrity),
                                 codec=codec, delta=delta,  # as the writers (weightsync.codec.registry)
                                 written_timeout_s=written_timeout_s)
        check_instance_id(instance_id, instances, options)  # beyond the job's start: elastic transports only
        self.instance, self.instance_id, self.timeout_s = instance, instance_id, timeout_s
        self.written_timeout_s = written_timeout_s
        self.staged, self.mode, self.colocate, self.early_call = staged, mode, colocate, early_call
        self._next_pull = 0
        self.client = MetaClient(meta, job, token=token, timeout=timeout_s)
        self.session = InstanceSession(self.client, MetaLink(meta, job, token), instance, instance_id, instances,
                                       options, push=push, staged=staged, instance_timeout_s=instance_timeout_s)
        #: rejoin(): a new session of the same options (a new incarnation)
        self._new_session = lambda: InstanceSession(self.client, MetaLink(meta, job, token), instance, instance_id,
                                                    instances, options, push=push, staged=staged,
                                                    instance_timeout_s=instance_timeout_s)
        self.version: int | None = None
        self._integrity_s: float | None = None  # the last settle's integrity check (inside `workers`)
        self._announcer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-held")
        self._report_error: Exception | None = None  # the first held report that failed, until raised
        self._report_lock = threading.Lock()  # the announcer thread sets it while the caller takes it
        self.last_stats: list[WorkerReport] = []
        #: seconds the last update spent waiting for the trainers (co-located), in the workers (of which
        #: ``transport`` in the slowest worker's transport, ``posting`` until its CPU had posted everything,
        #: co-located ``started`` until it posted its first copy) and handing the step's ``held`` report over
        self.last_timing: dict[str, float] = {}
        #: validation (weightsync.validate): every ``validate_every``-th update, against ``validate_checkpoint``
        self.validate_every, self.validate_checkpoint = validate_every, validate_checkpoint
        self.last_validation = None  # the last ValidationReport
        self._updates = 0
        self._validated_s = 0.0

    @property
    def since(self) -> int:
        """The first step this instance holds (elastic: the first step written after it joined, which
        its first ``update`` should ask for; the trainers wait for it from that step on)."""
        return self.connect().session.since

    def update(self, step: int) -> int:
        """Receive step ``step`` into every worker; return it once every worker fully holds it."""
        if self.mode != "sync":
            raise ValueError("update(step) is for sync mode; in async mode call pull()")
        session = self.connect().session
        t0 = time.perf_counter()
        self._check_announced(wait=False)
        if session.incarnation is not None:  # elastic: a member of the job only while the MetaServer says so
            self._check_member()
        held = self.version
        written = _Written()
        # co-located (or NIXL): the trainers' memory holds `step` once every trainer announced it. Where the instance
        # can, its call goes out first and the workers set up while the trainers still write; their copies wait for
        # the gate (weightsync.transport.gate). Else the wait comes first, then the call.
        early = (session.reads_after_written and self.early_call
                 and callable(getattr(self.instance, "call_when", None)))
        if session.reads_after_written and not early:
            written.recorded = self._wait_written(step, held)
        if not self.staged:
            self.version = None  # from here until success the live tensors may mix two steps
        t1 = time.perf_counter()
        self.instance.pause()
        landed = called_off = False
        try:
            timeout = worker.call_timeout(self.timeout_s) + session.step_wait_s  # (p2p: the step may be training)
            if early:
                self.last_stats = self.instance.call_when(lambda: written.wait(self, step, held), worker.receive, step,
                                                          self.staged, timeout_s=timeout)
            else:
                self.last_stats = self.instance.call(worker.receive, step, self.staged, timeout_s=timeout)
            self._settle(step)  # on the cadence every worker checks what landed; staged: all commit
            self.instance.after_update()
            landed = True
        except WeightsMoved as e:  # no later step can succeed either: stop the trainers waiting for us now
            with contextlib.suppress(MetaError):
                self.client.abort(str(e))
            raise
        except IntegrityError as e:  # the trainers wait for this step held in vain: tell them why, now
            if not session.shape.elastic:  # (elastic: they drop this instance and go on)
                with contextlib.suppress(MetaError):
                    self.client.abort(str(e))
            raise
        except StepMismatch as e:  # the two sides number steps apart: no step can meet; every participant learns now
            with contextlib.suppress(MetaError):
                self.client.abort(str(e))
            raise
        except StepNotWritten as e:  # say which step the trainers did write
            if e is written.error:  # (sent early: every worker called it off before its first copy)
                called_off, self.version = True, held
            raise self._not_written(step, e, held) from e
        except BaseException as e:
            if e is written.error:  # the step never came: every worker called it off before its first copy
                called_off, self.version = True, held
            raise
        finally:
            if not (landed or called_off or self.staged):
                if self._moved_nothing():  # no worker wrote a byte of the step: it still serves what it held
                    self.version = held
                else:  # the live weights may mix two steps: serve none of them
                    self._withhold(f"instance {self.instance_id}: update({step}) failed part-way, so its weights "
                                   "may mix two steps")
            self.instance.resume()
        recorded = written.recorded
        if recorded is not None:  # long done, normally: raises MetaAborted for a trainer that found its weights moved
            self._recorded(recorded, step)
        t2 = time.perf_counter()
        t2 += self._validate_due(step)  # validate_every: before the step is reported held (last_timing["validate"])
        self.version = step
        self.instance.set_version(step)
        self._announce(step)
        t1 = written.went or t1  # sent early: the workers' part of the step runs from the go
        self.last_timing = {"wait_written": t1 - t0, "workers": t2 - t1, "held": time.perf_counter() - t2,
                            "transport": max(r.stats.seconds for r in self.last_stats),
                            "posting": max(r.stats.posted for r in self.last_stats)}
        if session.reads_after_written:
            self.last_timing["started"] = max(r.stats.started for r in self.last_stats)
        if self._validated_s:
            self.last_timing["validate"] = self._validated_s
        if self._integrity_s is not None:  # inside `workers`: the workers' checksums and the wait for the trainers'
            self.last_timing["integrity"] = self._integrity_s
        return step

    def _moved_nothing(self) -> bool:
        """After a failed update: whether every worker says its receive wrote nothing into its targets (the step
        never began: :meth:`~weightsync.transport.base.Receiver.landed`). A worker that cannot answer counts as
        having written."""
        try:
            return not any(self.instance.call(worker.landed, timeout_s=worker.call_timeout(self.timeout_s)))
        except Exception:  # noqa: BLE001 -- failing already: withhold rather than trust an instance in doubt
            return False

    def _not_written(self, step: int, cause: BaseException, held: int | None) -> StepNotWritten:
        """``cause`` -- the step never began to arrive -- naming the latest step the trainers did write and ``held``,
        the step the instance still serves (a live reader's ``version`` is None until the update's end)."""
        try:
            latest = self.client.summary().get("latest_written")
        except Exception:  # noqa: BLE001 -- the message loses a detail, nothing else
            latest = "unknown (the MetaServer did not answer)"
        if isinstance(latest, int) and latest >= step:  # it was written, and is gone: the trainers moved on
            return type(cause)(f"instance {self.instance_id}: step {step} never arrived, and the trainers have since "
                               f"written step {latest} (this reader fell behind, or was dropped); nothing of it was "
                               f"received, and the instance still holds step {held}. {cause}",
                               peer=getattr(cause, "peer", None))
        return type(cause)(f"instance {self.instance_id}: no training rank has written step {step} (latest written: "
                           f"{latest}); nothing of it was received, and the instance still holds step "
                           f"{held}. {cause}", peer=getattr(cause, "peer", None))

    def _check_numbering(self, step: int, held: int | None) -> None:
        """A sync job whose trainers wrote a step this reader neither holds nor asked for: the two sides number
        steps apart (the trainers wait for that step held in vain). Refuse it by name and abort the job. (Elastic
        jobs are exempt: a reader joining may ask for the latest step.)"""
        if self.session.shape.elastic:
            return
        latest = self.client.summary().get("latest_written")
        if latest is not None and latest != step and latest != held:
            error = StepMismatch(f"instance {self.instance_id}: update({step}) waits for step {step}, but the training "
                                 f"ranks wrote step {latest}, which this instance does not hold (it holds {held}): "
                                 "both sides must number steps alike (the trainers' write(step) and the reader's "
                                 "update(step), from the same first step); nothing was received")
            with contextlib.suppress(MetaError):
                self.client.abort(str(error))
            raise error

    def _wait_written(self, step: int, held: int | None) -> Future | None:
        """Wait until every training rank announced ``step`` written (their bells, or the MetaServer); return the wait
        for its record on the MetaServer (after bells: the step is reported held only once recorded; a staged step
        is copied only from recorded weights), or None. Its errors say that nothing of the step was copied."""
        session = self.session
        checked_at = time.monotonic() + NUMBERING_CHECK_S

        def poll(timeout: float) -> list[int]:
            nonlocal checked_at
            try:
                return self.client.wait_written(step, timeout=timeout)
            except MetaTimeout:
                if checked_at is not None and time.monotonic() >= checked_at:  # waited a while: numbered apart?
                    checked_at = None
                    self._check_numbering(step, held)
                raise

        try:  # as long as the trainers are alive: a training step may take minutes (written_timeout_s)
            wait_rung(session.written_bells, step, self.written_timeout_s, poll, watch=session.trainers)
        except MetaTimeout as e:  # nothing copied yet: say so, and what the workers still hold
            raise StepNotWritten(f"instance {self.instance_id}: not every training rank announced step {step} "
                                 f"within {self.written_timeout_s:g} s (written_timeout_s), so nothing of it was "
                                 f"copied; the workers still hold step {held} ({e})") from e
        except TrainerLost as e:  # a trainer died or stopped before announcing it: likewise, in seconds
            raise TrainerLost(f"instance {self.instance_id}: {e}; nothing of step {step} was copied, the "
                              f"workers still hold step {held}", peer=e.peer) from e
        if session.written_bells is None:
            return None
        # a trainer rings before it checks its weights are where it shared them, and records the step on the
        # MetaServer after: copy now, report the step held only once it is recorded
        recorded = self._announcer.submit(self.client.wait_written, step, timeout=self.timeout_s)
        if self.staged:
            self._recorded(recorded, step)
        return recorded

    def _recorded(self, recorded: Future, step: int) -> None:
        """Wait for the trainers' `written` of ``step`` to be recorded (after their bells rang): a trainer that
        dies or stops between its bell and its record ends the wait in seconds, naming it."""
        watch = self.session.trainers
        if watch is None:
            recorded.result()
            return
        watch.result(recorded, watch.ranks, self.timeout_s + 1.0,
                     f"instance {self.instance_id}: waiting for step {step} to be recorded written after every "
                     "training rank's doorbell rang")

    # -- validation (weightsync.validate) --------------------------------------------------------------
    def validate(self, checkpoint: str | None = None, *, raise_on_mismatch: bool = False):
        """Compare every tensor the engine computes with against what the same engine holds after loading
        ``checkpoint`` (an HF safetensors directory; default: ``validate_checkpoint`` of this version)
        through its own loader; returns a :class:`~weightsync.validate.ValidationReport` (also kept as
        ``last_validation``). The engine keeps its weights. See :mod:`weightsync.validate`."""
        from weightsync.validate import validate

        if checkpoint is None:
            if self.validate_checkpoint is None:
                raise ValueError("validate(): pass checkpoint=, or give the reader validate_checkpoint=")
            checkpoint = self._checkpoint_of(self.version)
        self.last_validation = validate(self.instance, checkpoint, step=self.version,
                                        raise_on_mismatch=raise_on_mismatch)
        return self.last_validation

    def _checkpoint_of(self, step: int | None) -> str:
        c = self.validate_checkpoint
        if callable(c):
            if step is None:
                raise ValueError("validate(): the reader holds no whole version, so validate_checkpoint(step) "
                                 "has no step; pass checkpoint=")
            return str(c(step))
        return str(c)

    def _settle(self, step: int, pulled: bool = False) -> bool:
        """What follows a step's landing on every worker, the same for ``update`` and ``pull``:

            1. integrity (``integrity=N``, step ``step`` on the cadence): every worker checks what landed
               (:func:`worker.verify`), once ALL returned (co-located workers write into each other);
               a mismatch raises IntegrityError and nothing is committed
            2. staged: every worker commits its copy, all together, never one alone

        ``pulled`` (async): False where the snapshot's sums already moved on to a later step (nothing was
        compared nor committed: pull again)."""
        self._integrity_s = None
        if integrity_due(self.session.options.integrity, step):
            ti = time.perf_counter()
            done = self.instance.call(worker.verify, step, self.staged, pulled,
                                      timeout_s=worker.call_timeout(self.timeout_s))
            self._integrity_s = time.perf_counter() - ti
            if not all(c.current for c in done):
                return False
        if self.staged:
            self.instance.call(worker.commit, timeout_s=worker.call_timeout(self.timeout_s))
        return True

    def _validate_due(self, step: int) -> float:
        """Every ``validate_every``-th successful update: validate against step ``step``'s checkpoint; a
        mismatch raises :class:`~weightsync.errors.ValidationMismatch` and the reader holds no version."""
        self._validated_s = 0.0
        self._updates += 1
        if not self.validate_every or self._updates % self.validate_every:
            return 0.0
        from weightsync.validate import validate

        report = validate(self.instance, self._checkpoint_of(step), step=step)
        self.last_validation = report
        self._validated_s = report.seconds
        if not report.ok:
            self.version = None
            report.raise_if_mismatched()
        return report.seconds

    def pull(self, attempts: int = 5) -> int:
        """Async mode: receive the latest staged step; return it (pulling again while steps were mixed)."""
        from weightsync.transport.pull import claim_pull

        if self.mode != "async":
            raise ValueError("pull() is for async mode; in sync mode call update(step)")
        self.connect()
        self._check_announced(wait=False)  # a held report that failed since the last call raises here, as in update
        for _ in range(attempts):
            n = claim_pull(self.client, self.instance_id, self._next_pull)
            self._next_pull = n + 1
            if not self.staged:
                self.version = None
            self.instance.pause()
            landed = False
            try:
                results = self.instance.call(worker.pull, self.staged, timeout_s=worker.call_timeout(self.timeout_s))
                steps = set().union(*(r.steps for r in results))
                # every worker pulled the same step whole: checked on the cadence, then (staged) committed
                if len(steps) == 1 and not self._settle(next(iter(steps)), pulled=True):
                    steps.add(-1)  # the snapshot moved on before its sums were read: pull again
                self.instance.after_update()
                landed = len(steps) == 1
            finally:
                if not landed and not self.staged:  # the live weights may mix two steps: serve none of them
                    self._withhold(f"instance {self.instance_id}: a pull failed or straddled two steps")
                self.instance.resume()
            self.last_stats = results
            if len(steps) == 1:
                self._validate_due(next(iter(steps)))  # validate_every: before the step is reported held
                self.version = steps.pop()
                self.instance.set_version(self.version)
                self._announce(self.version)
                return self.version
        raise TransportError(f"instance {self.instance_id}: training ranks kept serving different steps")

    def _withhold(self, reason: str) -> None:
        """Tell the instance to serve nothing until its next good update (``set_version``), where it can."""
        withhold = getattr(self.instance, "withhold", None)
        if withhold is not None:
            try:
                withhold(reason)
            except Exception:  # noqa: BLE001 -- failing already: the update's own error is the one to raise
                pass

    def _check_member(self) -> None:
        """Elastic: raise at once when the MetaServer no longer counts this reader (the trainers dropped it for
        silence, or another reader rejoined under its id): no step can reach it until it joins again."""
        mine = self.client.members().get(self.instance_id)
        incarnation = self.session.incarnation
        if mine is not None and mine.joined and (mine.incarnation in (None, incarnation)):
            return
        why = "it never joined" if mine is None else (
            f"it was {'dropped (gone)' if mine.state == 'gone' else mine.state}"
            + (f": {mine.reason}" if mine.reason else "")
            + (f"; another reader rejoined under its id" if mine.joined else ""))
        raise MetaError(f"instance {self.instance_id} is no member of job {self.client.job}: {why}. Dropped: join "
                        "again -- reader.rejoin() sets it up again under its id (the next step written after it "
                        "joins is its first)", 409)

    def rejoin(self) -> "WeightReader":
        """Join the job again under this reader's id after it was dropped (``update`` said so), in one call:
        the old session's transports are closed (its leave is refused: it is no member), a new session (a new
        incarnation) registers, plans, connects and joins. Its first update is then ``since`` (the first step
        written after it joined). The instance keeps what it holds meanwhile."""
        with contextlib.suppress(Exception):
            self.session.close()
        self.session = self._new_session()
        return self.connect()

    def _announce(self, step: int) -> None:
        """Report ``step`` held to the MetaServer off the critical path: the workers already hold it
        whole, so the instance may serve it now; the trainers, waiting for the report before they
        overwrite their weights, see it one round trip later (on this host at once, by the bell).
        Reports go out in order, one at a time (one thread); the first that fails is kept and raises
        at the next update or pull (the trainers meanwhile time out waiting for it)."""
        if self.session.held_bell is not None:
            self.session.held_bell.ring(step)
        self._announcer.submit(self._report, step)

    def _report(self, step: int) -> None:
        try:
            self.client.held(self.instance_id, step, incarnation=self.session.incarnation)
        except Exception as e:  # noqa: BLE001 - raised in the caller's thread by _check_announced
            with self._report_lock:
                self._report_error = self._report_error or e

    def _check_announced(self, wait: bool) -> None:
        """Raise the first failed report's error (``wait``: once every report so far went out)."""
        if wait:
            self._announcer.submit(lambda: None).result(timeout=self.timeout_s)
        with self._report_lock:
            e, self._report_error = self._report_error, None
        if e is not None:
            raise e

    def close(self) -> None:
        try:
            self._check_announced(wait=True)
        finally:
            self._announcer.shutdown(wait=False)
            self.session.close()
