"""Exceptions: each names what was wrong so a user can fix it without reading our code."""


class WeightSyncError(Exception):
    """Base class for every error weightsync raises on purpose."""


class SpecError(WeightSyncError):
    """A model config that cannot be turned into a model spec."""


class ConfigError(WeightSyncError):
    """A parallel config that does not fit the model or the engine."""


class LayoutMismatch(WeightSyncError):
    """Live tensors differ from the derived layout; the message lists every difference."""


class PlanError(WeightSyncError):
    """A plan that cannot be built (uncovered canonical region, overlapping sources...)."""


class WeightsMoved(WeightSyncError):
    """Tensors other processes reach by address (co-located sharing) were reallocated since they were
    shared: the others would still read or write the old memory."""


class JobMismatch(WeightSyncError):
    """Participants of one job disagree (model, parallel config, layouts, versions, plan)."""


class TransportError(WeightSyncError):
    """A transfer failed or timed out: the peer died, stalled, or the plans disagree.

    ``peer`` (its group rank), ``pair`` and ``bucket`` say where, when known."""

    def __init__(self, message: str, peer: int | None = None, pair: tuple[int, int, int] | None = None,
                 bucket: int | None = None):
        super().__init__(message)
        self.peer, self.pair, self.bucket = peer, pair, bucket


class MetaError(WeightSyncError):
    """The MetaServer refused a request; ``status`` is the HTTP status, the message is the server's (after the
    request's method and route); ``reason`` is the server's words alone, for a message of one's own."""

    def __init__(self, message: str, status: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.reason = message if reason is None else reason


class MetaAborted(MetaError):
    """The job was aborted (a peer died or refused the job); every waiter of the job gets this."""


class GroupTimeout(WeightSyncError, TimeoutError):
    """A trainer group's collective did not complete within its deadline (a member or the
    representative died, hangs, or is not writing the same step)."""


class MetaTimeout(MetaError, TimeoutError):
    """A deadline passed: a long-poll's condition did not hold in time."""


class MetaUnavailable(MetaTimeout):
    """The deadline passed while the server could not be reached (down, restarting, stopping)."""


class InstanceError(WeightSyncError):
    """An inference instance could not run a call (closed, a worker died or stalled)."""


class WorkerError(InstanceError):
    """A worker raised an exception that could not be re-raised as itself (unpicklable)."""


class WorkerDied(InstanceError):
    """A worker process exited while a call was running; the instance is shut down."""


class WorkerTimeout(InstanceError):
    """Workers did not answer within the call's timeout; the instance is shut down."""


class ValidationMismatch(WeightSyncError):
    """What an inference engine computes with differs from what it holds after loading the checkpoint
    it was validated against (``WeightReader.validate(..., raise_on_mismatch=True)``); names the tensors."""


class IntegrityError(TransportError):
    """What landed in a step differs from what was sent (per-step checksums, :mod:`weightsync.integrity`):
    names the step, the pair and the bucket; the step is not reported held."""


class StepNotWritten(TransportError):
    """The step asked for never began to arrive: its training ranks did not announce it within the reader's
    ``written_timeout_s``, or one was lost first. Nothing of it landed, so the instance still holds what it held."""


class StepMismatch(StepNotWritten):
    """The training ranks announced another step than the reader asked for (both sides must number steps alike):
    refused before any byte of it landed; the job is aborted, so every participant learns of it at once."""
