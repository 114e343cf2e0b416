"""The ``vllm.general_plugins`` entry point: registers the ``weightsync`` weight-transfer backend.

vLLM runs every general plug-in once in each of its processes (driver, engine core, workers) before
the model loads, so ``LLM(..., weight_transfer_config={"backend": "weightsync"})`` finds the backend
without the user importing anything. Registered lazily (by module path: nothing of weightsync's
runtime is imported until a worker creates the engine) and only once (the factory refuses a name
registered twice).
"""

from __future__ import annotations

import logging

log = logging.getLogger("weightsync.vllm")

#: the backend name for ``weight_transfer_config={"backend": BACKEND}`` (the one definition; also
#: ``weightsync.vllm.BACKEND``)
BACKEND = "weightsync"


def register() -> None:
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if BACKEND in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(BACKEND, "weightsync.vllm.backend", "WeightSyncTransferEngine")
    log.debug("registered the %r vLLM weight-transfer backend", BACKEND)
