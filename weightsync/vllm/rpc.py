"""Calls into vLLM workers as bytes, and answers that never raise.

vLLM's client -> engine-core hop is msgpack: dataclasses arrive as dicts, tuples as lists, worker
exceptions as a plain ``Exception`` with a message, and a callable only with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. Bytes cross it unchanged. So a weightsync call is a pickled
``(module-level function, args)`` sent as bytes to a ``worker_extension_cls`` method called by name,
and its answer is a pickled ``("ok", result)`` or ``("err", error record)``: the worker method never
raises (at TP >= 2 a raising worker leaves vLLM's ``MultiprocExecutor`` reading stale answers on
the next call), and the control side re-raises the worker's own exception, with its type.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

from weightsync.instances import error_record, rebuild_error


def pack_call(fn: Callable[..., Any], args: tuple) -> bytes:
    """``(fn, args)`` as bytes; ``fn`` must be a module-level function importable in the worker."""
    try:
        return pickle.dumps((fn, tuple(args)))
    except Exception as e:
        raise TypeError(f"cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments to the vLLM workers "
                        f"(fn must be a module-level function, arguments picklable): {e}") from e


def unpack_call(blob: bytes) -> tuple[Callable[..., Any], tuple]:
    fn, args = pickle.loads(blob)
    return fn, args


def answer(thunk: Callable[[], Any]) -> bytes:
    """Run ``thunk`` and return its outcome as bytes, whatever happens (never raises an Exception)."""
    try:
        result = thunk()
        try:
            return pickle.dumps(("ok", result))
        except Exception as e:  # the result does not pickle: say so, as an error of this call
            raise TypeError(f"the worker's result {type(result).__name__} does not pickle: {e}") from e
    except Exception as e:  # noqa: BLE001 -- shipped to the control side, re-raised there
        return pickle.dumps(("err", error_record(e)))


def result(blob: Any, rank: int, where: str) -> Any:
    """The result in one worker's answer, or its exception raised here (same type, worker traceback noted)."""
    if not isinstance(blob, (bytes, bytearray)):
        raise TypeError(f"rank {rank} of {where} answered {type(blob).__name__}, not weightsync's bytes: is "
                        "worker_extension_cls weightsync.vllm.extension.WeightSyncExtension?")
    status, payload = pickle.loads(blob)
    if status == "ok":
        return payload
    raise rebuild_error(payload, rank, where)
