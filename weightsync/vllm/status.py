"""What the plug-in backend says about each call, through the MetaServer (no vLLM needed to read it).

A worker RPC must not raise at TP >= 2 (vLLM's executor would answer the next call with a stale
result), so the backend's rank 0 publishes the outcome of every ``init`` / ``update`` / ``pull``
as a :class:`CallStatus` under the rendezvous names :func:`status_key` (the latest) and
:func:`call_key` (one per call id the driver chose), and the driver raises it
(:func:`wait_status`). JSON, at most 512 characters (the MetaServer's limit for a value).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from weightsync import errors
from weightsync.meta.client import MetaClient

_LIMIT = 512


@dataclass(frozen=True)
class CallStatus:
    """One backend call's outcome on one instance."""

    instance: int
    call: str  # the driver's call id ("" when it gave none)
    what: str  # "init", "update" or "pull"
    ok: bool
    step: int | None = None  # the step the instance now holds (update, pull)
    error_type: str = ""
    error: str = ""

    def to_json(self) -> str:
        d = asdict(self)
        text = json.dumps(d)
        if len(text) > _LIMIT:  # keep it valid JSON: shorten the message
            d["error"] = d["error"][: max(0, len(d["error"]) - (len(text) - _LIMIT) - 3)] + "..."
            text = json.dumps(d)
        return text

    @staticmethod
    def from_json(text: str) -> "CallStatus":
        return CallStatus(**json.loads(text))

    def raise_error(self) -> None:
        """Raise the recorded error as its weightsync type when it is one (else InstanceError)."""
        if self.ok:
            return
        cls = getattr(errors, self.error_type, None)
        message = f"instance {self.instance}: vLLM weightsync {self.what} failed: {self.error_type}: {self.error}"
        if isinstance(cls, type) and issubclass(cls, errors.WeightSyncError):
            try:
                raise cls(message)
            except TypeError:
                pass
        raise errors.InstanceError(message)


def status_key(instance: int) -> str:
    return f"vllm.status.{instance}"


def call_key(instance: int, call: str) -> str:
    return f"vllm.call.{instance}.{call}"


def publish(client: MetaClient, status: CallStatus) -> None:
    text = status.to_json()
    client.publish(status_key(status.instance), text, replace=True)
    if status.call:
        client.publish(call_key(status.instance, status.call), text, replace=True)


def abort_reason(instance: int, status: CallStatus) -> str:
    """What the backend aborts the job with when this instance refuses it (:func:`wait_status` reads it back)."""
    return f"vLLM instance {instance}: {status.error_type}: {status.error}"


def wait_status(client: MetaClient, instance: int, call: str, timeout_s: float) -> CallStatus:
    """The status of call ``call`` (waiting for it), its error raised. When this instance's refusal aborted
    the job, the MetaServer answers nothing more of it: the refusal is raised from the abort's reason."""
    try:
        text = client.lookup(call_key(instance, call), timeout=timeout_s)
    except errors.MetaAborted as e:
        mine = re.search(rf"vLLM instance {instance}: (\w+): (.*)", str(e), re.S)
        if mine:
            CallStatus(instance, call, "init", False, None, mine[1], mine[2]).raise_error()
        raise
    status = CallStatus.from_json(text)
    status.raise_error()
    return status
