"""``worker_extension_cls`` for the offline entry point: ``LLM(..., worker_extension_cls=EXTENSION)``.

vLLM appends this class to every worker's bases (``worker_base.py``, ``init_worker``), so its methods
are called by name through ``collective_rpc("weightsync_call", args=(payload,))``: nothing is
pickled on the client and ``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off. Every method takes and
returns bytes (:mod:`weightsync.vllm.rpc`) and never raises. ``weightsync_call`` runs only messages signed
by the instance's control process (:mod:`weightsync.runtime.wire`), each at most once.
"""

from __future__ import annotations

from weightsync.vllm.rpc import answer, unpack_call

#: the qualname to pass as ``worker_extension_cls`` (the one definition; also ``weightsync.vllm.EXTENSION``)
EXTENSION = "weightsync.vllm.extension.WeightSyncExtension"


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``model_runner``, ``vllm_config``, ``device``)."""

    def _weightsync_worker(self):
        from weightsync.vllm.side import worker_of

        return worker_of(self.model_runner.get_model(), self.vllm_config, self.device)

    def weightsync_setup(self) -> bytes:
        """Build this worker's loaded-form tensors; answers its :class:`~weightsync.vllm.live.LiveReport`."""
        return answer(lambda: self._weightsync_worker().report)

    def weightsync_call(self, payload: bytes) -> bytes:
        """Run a signed ``(fn, args)`` message as ``fn(ctx, *args)`` on this worker's context (refused, nothing
        decoded, when its signature does not check or it was run before)."""
        def run():
            last_seq = self.__dict__.setdefault("_weightsync_last_seq", {})
            fn, args = unpack_call(payload, last_seq)
            return self._weightsync_worker().run(fn, args)

        return answer(run)

    def weightsync_mailbox(self, directory: str) -> bytes:
        """Serve the instance's call mailbox (:mod:`weightsync.runtime.mailbox`, FIFOs in its private key directory
        ``directory``) on a thread of this worker: after this one call, the instance's calls reach the worker
        without a trip through vLLM's engine core. Each is checked and run as :meth:`weightsync_call` runs it."""
        def run():
            from weightsync.vllm.side import serve_mailbox

            serve_mailbox(self, str(directory), self.__dict__.setdefault("_weightsync_last_seq", {}))
            return True

        return answer(run)

    def weightsync_refresh(self) -> bytes:
        """Re-run the post-load transforms from the loaded form (after an update)."""
        return answer(lambda: self._weightsync_worker().refresh())

    def weightsync_digests(self) -> dict[str, str]:
        """JSON-safe, for vLLM's HTTP ``/collective_rpc`` (dev mode): a digest of every tensor this worker computes
        with (:func:`weightsync.vllm.verify.computed`), or ``{"error": ...}``."""
        try:
            from weightsync.vllm.verify import computed, digests

            return digests(self._weightsync_worker().run(computed, ()))
        except Exception as e:  # noqa: BLE001 -- never raised out of a worker RPC
            return {"error": f"{type(e).__name__}: {e}"}

    def weightsync_validate(self, checkpoint: str) -> dict:
        """JSON-safe, for vLLM's HTTP ``/collective_rpc`` (dev mode): this worker against vLLM's own fresh load of the
        HF checkpoint in ``checkpoint`` (:mod:`weightsync.validate.vllm`), as
        :meth:`~weightsync.validate.ValidationReport.to_json` (the failed checks listed), or ``{"error": ...}``."""
        try:
            import time

            from weightsync.validate.report import VIA_VLLM, ValidationReport
            from weightsync.validate.vllm import check_vllm

            t0 = time.perf_counter()
            worker = self._weightsync_worker()
            checks = worker.run(check_vllm, (str(checkpoint),))
            return ValidationReport(worker.info.engine, VIA_VLLM, str(checkpoint), tuple(checks),
                                    time.perf_counter() - t0).to_json()
        except Exception as e:  # noqa: BLE001 -- never raised out of a worker RPC
            return {"error": f"{type(e).__name__}: {e}"}

    def weightsync_shutdown_transfer(self) -> bytes:
        """The weight-transfer engine's ``shutdown`` (vLLM 0.26 has no ``shutdown_weight_transfer_engine``)."""
        def run():
            engine = getattr(self, "weight_transfer_engine", None)
            if engine is not None:
                engine.shutdown()

        return answer(run)

    def weightsync_close(self) -> bytes:
        from weightsync.vllm.side import forget

        return answer(lambda: forget(self.model_runner.get_model()))
