"""``worker_extension_cls`` for the offline entry point: ``LLM(..., worker_extension_cls=EXTENSION)``.

vLLM appends this class to every worker's bases (``worker_base.py``, ``init_worker``) and calls a worker's methods
by name: ``collective_rpc(name, args=...)``, which in dev mode is also the HTTP ``/collective_rpc`` route, open to
whoever reaches the server. So the class has two methods and both take only a message signed by the control
process (:mod:`weightsync.runtime.wire`: an HMAC under a key in a private directory of the engine's user on its
host), each run at most once, and nothing else:

- ``weightsync_call(payload: bytes) -> bytes``: weightsync's own calls (:mod:`weightsync.vllm.rpc`; nothing is
  pickled on the client, ``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off); the answer is bytes and it never
  raises;
- ``weightsync_json(message: str)``: the same for a JSON caller (a vLLM server's HTTP ``/collective_rpc``,
  :func:`weightsync.vllm.rpc.json_request`): the message base64 text, the answer the function's JSON-safe result
  or ``{"error": ...}``.

Set-up, the call mailbox, refresh, close, the transfer engine's shutdown, the digests and the validation were
unsigned methods of their own; they are functions sent through these now (:data:`weightsync.vllm.side.HOST_CALLS`,
:func:`weightsync.vllm.side.refresh`, :func:`weightsync.vllm.verify.computed_digests`,
:func:`weightsync.vllm.verify.validation`).
"""

from __future__ import annotations

from typing import Any

from weightsync.vllm.rpc import answer, unpack_call

#: the qualname to pass as ``worker_extension_cls`` (the one definition; also ``weightsync.vllm.EXTENSION``)
EXTENSION = "weightsync.vllm.extension.WeightSyncExtension"


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``model_runner``, ``vllm_config``, ``device``)."""

    def weightsync_call(self, payload: bytes) -> bytes:
        """Run a signed ``(fn, args)`` message (:func:`weightsync.vllm.side.run_call`); refused, nothing decoded,
        when its signature does not check or it was run before."""
        def run():
            from weightsync.vllm.side import last_seq, run_call

            fn, args = unpack_call(payload, last_seq(self))
            return run_call(self, fn, args)

        return answer(run)

    def weightsync_json(self, message: str) -> Any:
        """:meth:`weightsync_call` for JSON: ``message`` the signed bytes as base64 text; the answer the call's
        result (JSON-safe: the functions sent this way answer dicts) or ``{"error": ...}``. Never raises."""
        try:
            import base64
            import binascii

            from weightsync.runtime.wire import WireError
            from weightsync.vllm.side import last_seq, run_call

            if not isinstance(message, str):
                raise WireError(f"weightsync_json takes weightsync's signed message as base64 text, not "
                                f"{type(message).__name__}")
            try:
                blob = base64.b64decode(message, validate=True)
            except (binascii.Error, ValueError) as e:
                raise WireError(f"weightsync_json: not base64 ({e})") from e
            fn, args = unpack_call(blob, last_seq(self))
            return run_call(self, fn, args)
        except Exception as e:  # noqa: BLE001 -- never raised out of a worker RPC
            return {"error": f"{type(e).__name__}: {e}"}
