"""A call into a vLLM engine whose engine core died fails instead of waiting forever.

vLLM's multiprocess engine client (``SyncMPClient`` behind an offline ``LLM``, ``AsyncMPClient`` behind an
``AsyncLLM``; 0.32) answers a utility call -- ``collective_rpc``, ``reset_prefix_cache``,
``get_weight_version``, ``update_weight_version``, the weight-transfer calls -- by waiting, with no bound, on a
future that only the engine core's answer resolves. Nothing fails the waiting futures when the engine core
dies: a call that reached the engine core after its busy loop had failed (a worker died: "Executor failed.")
but before the client learnt of it (``ENGINE_CORE_DEAD``, a few milliseconds later) is never answered, and its
caller waits for ever (a ``collective_rpc(timeout=...)`` too: the timeout bounds the workers' answer inside
the engine core, not the client's wait). In the suite, ``test_worker_dies_mid_update_tp2`` asks
``get_weight_version`` about 0.08 s after a worker died, about when the engine core fails: a call that lands in
that window waits until pytest-timeout ends the xdist worker ("node down: Not properly terminated";
docs/testing.md, *Crashes and hangs*).

:func:`watch` gives an engine one daemon thread that waits until the client knows its engine core is dead
(``resources.engine_dead``: set by the ``ENGINE_CORE_DEAD`` message, by vLLM's own monitor when the engine core
process exits, or by shutdown) and then fails every utility call still waiting with vLLM's ``EngineDeadError``,
as vLLM does for every call made after that moment. Every engine weightsync is handed is watched
(:class:`~weightsync.instances.vllm.VLLMInstance`, :class:`~weightsync.vllm.driver.VLLMWeightSync`), so its
calls, and its user's own calls into the same engine, end within :data:`POLL_S` of vLLM knowing the engine
dead. An in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or a client without these attributes
(another vLLM) is not watched: :func:`watch` answers False.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from typing import Any

log = logging.getLogger("weightsync.vllm")

#: how often the watcher looks at the client's ``engine_dead`` flag (seconds)
POLL_S = 0.2

_lock = threading.Lock()
_watched: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the engine clients that have a watcher


def engine_client(engine: Any) -> Any:
    """The engine-core client of an offline ``LLM`` (``llm.llm_engine.engine_core``) or an ``AsyncLLM``
    (``engine_core``), or None."""
    llm_engine = getattr(engine, "llm_engine", None)
    return getattr(llm_engine if llm_engine is not None else engine, "engine_core", None)


def watch(engine: Any) -> bool:
    """Fail ``engine``'s waiting utility calls once its engine core is dead (module docstring); one watcher per
    engine however often it is called. Whether the engine is watched."""
    client = engine_client(engine)
    resources = getattr(client, "resources", None)
    pending = getattr(client, "utility_results", None)
    if resources is None or not isinstance(pending, dict) or not hasattr(resources, "engine_dead"):
        return False
    with _lock:
        if client in _watched:
            return True
        _watched.add(client)
    # the thread holds the client's resources and its futures, never the client (vLLM shuts an engine down when
    # its client is collected)
    threading.Thread(target=_watch, args=(resources, pending), daemon=True,
                     name=f"weightsync-vllm-watch-{id(client):x}").start()
    return True


def _watch(resources: Any, pending: dict) -> None:
    while not resources.engine_dead:
        time.sleep(POLL_S)
    failed = fail_pending(pending)
    if failed:
        log.warning("vLLM's engine core is dead: %d call(s) into it that it never answered now raise "
                    "EngineDeadError", failed)


def fail_pending(pending: dict) -> int:
    """Fail every future in vLLM's ``utility_results`` that is not done with ``EngineDeadError``; how many."""
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # pragma: no cover -- a vLLM without it
        EngineDeadError = RuntimeError  # noqa: N806
    failed = 0
    for future in list(pending.values()):
        if future.done():
            continue
        failed += 1
        loop = getattr(future, "get_loop", None)
        if loop is not None:  # an asyncio future (AsyncLLM): failed on its own loop
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits on it any more
                loop().call_soon_threadsafe(_fail, future, EngineDeadError)
        else:
            _fail(future, EngineDeadError)
    return failed


def _fail(future: Any, error: type) -> None:
    with contextlib.suppress(Exception):  # answered meanwhile
        if not future.done():
            future.set_exception(error("the engine core died before it answered this call (weightsync.vllm.watch)"))


__all__ = ["watch", "engine_client", "fail_pending", "POLL_S"]
