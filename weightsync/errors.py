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
