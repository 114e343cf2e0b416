"""weightsync inside stock SGLang (imported lazily: ``import weightsync`` never imports SGLang).

- :mod:`weightsync.runtime.wire`: the call messages into SGLang's workers (signed, no code on decode);
- :class:`~weightsync.instances.sglang.SGLangInstance`: ``sglang.Engine`` behind a ``WeightReader``;
- :mod:`weightsync.sglang.engine`: a real engine weightsync starts and owns (bench, demo, GPU tests);
- :mod:`weightsync.sglang.verify`: what a worker computes with, to compare with a fresh engine;
- :mod:`weightsync.sglang.mailbox`: a quiet update's calls straight to a thread in every scheduler process (no
  SGLang request), the KV flush by the scheduler's own thread;
- :mod:`weightsync.sglang.worker`: what every call runs on in a scheduler process, whichever way it came.
- :mod:`weightsync.sglang.live`: each layer's path (in place, constant, derived) or its refusal: block FP8 on
  Hopper's default kernels and MLA's ``w_kc``/``w_vc`` re-derived after every update.

Start the engine with ``custom_weight_loader=[RPC_LOADER]``.
"""

from __future__ import annotations

RPC_LOADER = "weightsync.instances.sglang.rpc_loader"

__all__ = ["RPC_LOADER"]
