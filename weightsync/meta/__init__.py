"""The MetaServer (job-level coordinator) and its client.

``MetaServer`` is imported lazily so that ``python -m weightsync.meta.server`` does not import its
own module twice.
"""

from weightsync.meta.client import MetaAborted, MetaClient, MetaError, MetaTimeout, MetaUnavailable

__all__ = ["MetaAborted", "MetaClient", "MetaError", "MetaServer", "MetaTimeout", "MetaUnavailable"]


def __getattr__(name: str):
    if name == "MetaServer":
        from weightsync.meta.server import MetaServer

        return MetaServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
