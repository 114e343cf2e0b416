"""Calls into vLLM workers as bytes, and answers that never raise.

vLLM's client -> engine-core hop is msgpack: dataclasses arrive as dicts, tuples as lists, worker
exceptions as a plain ``Exception`` with a message, and a callable only with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. Bytes cross it unchanged. So a weightsync call is a signed
:mod:`weightsync.runtime.wire` message (module-level function by name, arguments in a restricted pickle)
sent as bytes to a ``worker_extension_cls`` method called by name (the extension's only methods are the
signed ones: :mod:`weightsync.vllm.extension`). ``collective_rpc`` is also vLLM's HTTP
``/collective_rpc`` in dev mode, so the worker checks the message's HMAC under the key in the instance's
private 0700 directory before decoding anything, decodes no global but weightsync's record types, and
runs a signed message at most once (:func:`unpack_call`); nothing from the request is ``pickle.loads``-ed.
The answer is a pickled ``("ok", result)`` or ``("err", error record)`` (worker -> control process, read
only by the control process that asked): the worker method never
raises (at TP >= 2 a raising worker leaves vLLM's ``MultiprocExecutor`` reading stale answers on
the next call), and the control side re-raises the worker's own exception, with its type.
"""

from __future__ import annotations

import base64
import contextlib
import pickle
import shutil
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from weightsync.instances import error_record, rebuild_error
from weightsync.runtime import wire


@dataclass(frozen=True)
class CallChannel:
    """The control process's side of the signed channel: the instance's id, its private key directory and key."""

    instance: str
    dir: str
    key: bytes


def pack_call(channel: CallChannel, seq: int, fn: Callable[..., Any], args: tuple) -> bytes:
    """Call number ``seq`` (increasing per instance) of ``fn(ctx, *args)`` as a signed message; ``fn`` must be a
    module-level function of weightsync's, or of a module the engine's ``$WEIGHTSYNC_WORKER_CALLS`` names (the
    worker refuses any other: :func:`weightsync.runtime.wire.resolve`), the arguments values, tensors or weightsync
    records."""
    try:
        return wire.encode(channel.key, channel.instance, channel.dir, seq, fn, tuple(args))
    except TypeError as e:
        raise TypeError(f"cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments to the vLLM workers "
                        f"(fn must be a module-level function; arguments values, tensors or weightsync records): "
                        f"{e}") from e


@contextlib.contextmanager
def one_time_channel() -> Iterator[CallChannel]:
    """A fresh key directory and instance id for calls made outside a ``VLLMInstance`` (the plug-in driver's, an
    HTTP client's), removed on exit: make the calls inside (the workers read the key as each arrives). Only a
    process of the engine's user on its host can make one, as for the instance's own channel."""
    directory, key = wire.new_key_dir(wire.VLLM_DIR_PREFIX)
    try:
        yield CallChannel(uuid.uuid4().hex, directory, key)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def json_request(fn: Callable[..., Any], *args: Any) -> Iterator[dict]:
    """The JSON body of ``POST /collective_rpc`` that runs ``fn(ctx, *args)`` on every worker of a vLLM server
    started with weightsync's extension (dev mode), e.g. ``weightsync.vllm.verify.computed_digests``; ``fn``'s
    result must be JSON-safe. Signed with a :func:`one_time_channel`: post it inside the ``with`` block::

        with json_request(computed_digests) as body:
            answers = requests.post(url + "/collective_rpc", json=body).json()["results"]
    """
    with one_time_channel() as channel:
        message = base64.b64encode(pack_call(channel, 1, fn, args)).decode("ascii")
        yield {"method": "weightsync_json", "args": [message]}


def unpack_call(blob: Any, last_seq: dict[str, int], directory: str | None = None,
                keys: dict[str, bytes] | None = None) -> tuple[Callable[..., Any], tuple]:
    """Authenticate and decode a message (worker side): :class:`~weightsync.runtime.wire.WireError`, before
    anything is unpickled, for bytes not signed by the instance's control process, and for a message already
    run (``last_seq``: this worker's last call number per instance, updated here). ``directory``: the message
    must name this key directory (a mailbox's: its instance's own key, not another instance's of this user).
    ``keys``: the keys read so far (:func:`weightsync.runtime.wire.decode`: a mailbox reads its key once)."""
    if not isinstance(blob, (bytes, bytearray)):
        raise wire.WireError(f"weightsync_call takes weightsync's signed bytes, not {type(blob).__name__}")
    call = wire.decode(bytes(blob), keys)
    if directory is not None and call.dir != directory:
        raise wire.WireError(f"a call signed for {call.dir!r} arrived in the mailbox of {directory!r}: refused")
    last = last_seq.get(call.instance, 0)
    if call.seq <= last:  # signed, but already run: a replayed message is not run twice
        raise wire.WireError(f"call {call.seq} of instance {call.instance} replayed (last run: {last})")
    last_seq[call.instance] = call.seq
    return call.fn, call.args


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
