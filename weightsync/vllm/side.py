"""The worker side shared by both entry points: one vLLM worker as one weightsync worker reader.

Whether the offline :class:`~weightsync.instances.vllm.VLLMInstance` (through the
``worker_extension_cls``) or the plug-in backend (inside ``WeightTransferEngine``) drives it, a worker
runs :mod:`weightsync.runtime.worker`'s functions on a :class:`~weightsync.runtime.instance.WorkerContext`
whose tensors are its model's loaded-form tensors (:class:`~weightsync.vllm.live.LiveModel`). There is
one :class:`VLLMWorker` per model object, kept on the model, so both entry points in one process
share it (and its staging memory).

The offline entry point's calls arrive either through vLLM (``collective_rpc("weightsync_call")``, on the
worker's main thread) or, once :func:`host_mailbox` ran, through the instance's call mailbox
(:mod:`weightsync.runtime.mailbox`, on a thread of the worker): the same signed message, the same
:func:`~weightsync.vllm.rpc.unpack_call` (one replay record for both doors), the same :func:`run_call`,
the same answer bytes.

Every way in is signed: vLLM calls a worker method by name for anyone who reaches ``collective_rpc`` (vLLM's
HTTP ``/collective_rpc`` in dev mode), so the extension has no method but its signed ones, and what used to
be methods of their own (set-up, the mailbox, close, the transfer engine's shutdown) are the *host calls*
here (:data:`HOST_CALLS`): signed like any call, run on the vLLM worker object rather than the context.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from weightsync.runtime.instance import WorkerContext
from weightsync.vllm.config import EngineInfo, describe
from weightsync.vllm.live import LiveModel, LiveReport

_ATTR = "_weightsync_worker"


class VLLMWorker:
    """One vLLM worker's weightsync state: its engine description, loaded-form tensors and context."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, device: torch.device | str):
        from vllm.distributed import get_tensor_model_parallel_rank

        from weightsync.engines import make_layout
        from weightsync.spec.model import spec_from_config

        self.info: EngineInfo = describe(vllm_config)
        self.rank = get_tensor_model_parallel_rank()
        self.device = torch.device(device)
        spec = spec_from_config(self.info.model_config)
        engine_layout = make_layout(spec, self.info.engine)
        if getattr(engine_layout.config, "quant", 0):  # served in block FP8: the live tensors are e4m3 + scales
            from weightsync.quant.layout import fp8_layout

            engine_layout = fp8_layout(engine_layout)
        layout = engine_layout.layout(self.rank)
        where = f"{self.info.engine} rank {self.rank} ({spec.name})"
        self.live = LiveModel(model, layout, self.device, where)
        self.ctx = WorkerContext(self.rank, self.device, self.live.tensors,
                                 state={"model": model, "live": self.live, "vllm_config": vllm_config})

    @property
    def report(self) -> LiveReport:
        return self.live.report

    def run(self, fn: Callable[..., Any], args: tuple) -> Any:
        """``fn(ctx, *args)`` without autograd, and without vLLM's parameter subclasses' Python
        ``__torch_function__`` (``BasevLLMParameter``'s only hands every op to ``Parameter``'s, which disables
        it: the results are the same plain tensors). Each op on such a parameter otherwise costs ~1.7 us of
        Python: a step looks up every live tensor's address (``transport.graphs``), +0.6 ms for 400 of them
        here; the 0.44 ms more before the first copy than the faithful receiver's, measured on the H200."""
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            return fn(self.ctx, *args)

    def refresh(self) -> int:
        return self.live.refresh()

    def close(self) -> None:
        from weightsync.runtime import worker

        worker.disconnect(self.ctx)


def host_worker(host: Any) -> VLLMWorker:
    """The :class:`VLLMWorker` of the vLLM worker object ``host`` (the one the extension is mixed into)."""
    return worker_of(host.model_runner.get_model(), host.vllm_config, host.device)


def last_seq(host: Any) -> dict[str, int]:
    """The worker's replay record: the last call number run, per instance (both doors share it)."""
    return host.__dict__.setdefault("_weightsync_last_seq", {})


def host_setup(host: Any) -> LiveReport:
    """Build this worker's loaded-form tensors; its :class:`~weightsync.vllm.live.LiveReport` (a host call)."""
    return host_worker(host).report


def host_mailbox(host: Any, directory: str) -> bool:
    """Serve the instance's call mailbox in its private key directory ``directory`` on a thread of this worker
    (:func:`serve_mailbox`; a host call, made once through ``collective_rpc``)."""
    serve_mailbox(host, str(directory), last_seq(host))
    return True


def host_close(host: Any) -> None:
    """Forget this worker's :class:`VLLMWorker` (a host call: the instance closes)."""
    forget(host.model_runner.get_model())


def host_shutdown_transfer(host: Any) -> None:
    """The weight-transfer engine's ``shutdown`` (vLLM 0.26 has no ``shutdown_weight_transfer_engine``; a host call)."""
    engine = getattr(host, "weight_transfer_engine", None)
    if engine is not None:
        engine.shutdown()


#: signed calls run on the vLLM worker object, not on a context (:func:`run_call`)
HOST_CALLS = frozenset({host_setup, host_mailbox, host_close, host_shutdown_transfer})


def host_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a module-level function of another weightsync module as a host call (run on the vLLM worker object,
    like :data:`HOST_CALLS`): :mod:`weightsync.lora.vllm`'s, which reach vLLM's LoRA manager and must run on an
    engine whose loaded-form tensors no :class:`VLLMWorker` is built for. The call is signed all the same."""
    fn.weightsync_host_call = True  # type: ignore[attr-defined]
    return fn


def run_call(host: Any, fn: Callable[..., Any], args: tuple) -> Any:
    """A checked call's ``fn``: ``fn(host, *args)`` for a host call, else ``fn(ctx, *args)`` on this worker's
    context (its :class:`VLLMWorker` looked up per call: one the plug-in's shutdown forgot is rebuilt)."""
    if fn in HOST_CALLS or getattr(fn, "weightsync_host_call", False) is True:
        return fn(host, *args)
    return host_worker(host).run(fn, args)


def refresh(ctx: WorkerContext) -> int:
    """The post-load transforms re-run from the loaded form (a call: through the mailbox, the refresh of an update
    is no trip through the engine)."""
    return ctx.state["live"].refresh()


_MAILBOXES = "_weightsync_mailboxes"


def serve_mailbox(host: Any, directory: str, last_seq: dict[str, int]) -> None:
    """Serve an instance's call mailbox in ``directory`` on a thread of this vLLM worker ``host`` (the worker
    object the extension is mixed into), replacing one already serving that directory (each instance on the engine
    has its own). Each request is a signed call run exactly as ``weightsync_call`` runs it: checked by
    :func:`~weightsync.vllm.rpc.unpack_call` (``last_seq``: the worker's replay record, shared with
    ``weightsync_call``), run by :func:`run_call` and answered with the same bytes. The thread ends when the
    instance closes its end of the mailbox."""
    from weightsync.runtime.mailbox import MailboxAddress, serve
    from weightsync.vllm.rpc import answer, unpack_call

    first = host_worker(host)  # its rank names the FIFOs; its device is the thread's
    servers = host.__dict__.setdefault(_MAILBOXES, {})
    stop_mailbox(host, directory)
    for d in [d for d, server in servers.items() if not server.alive]:  # their instance closed: forget them
        del servers[d]

    keys: dict[str, bytes] = {}  # the instance's key, read and checked at the first call

    def handle(payload: bytes) -> bytes:
        def run():
            fn, args = unpack_call(payload, last_seq, directory, keys)
            return run_call(host, fn, args)

        return answer(run)

    servers[directory] = serve(MailboxAddress(directory), first.rank, handle, first.device,
                               name="weightsync-vllm-mailbox")


def stop_mailbox(host: Any, directory: str | None = None) -> None:
    """Stop the mailbox thread of ``host`` serving ``directory`` (None: every one)."""
    servers = host.__dict__.get(_MAILBOXES, {})
    for d in list(servers) if directory is None else [directory]:
        server = servers.pop(d, None)
        if server is not None:
            server.stop()


def worker_of(model: torch.nn.Module, vllm_config: Any, device: torch.device | str) -> VLLMWorker:
    """The model's :class:`VLLMWorker`, built on first use (a refusal raises, and is raised again next time)."""
    w = model.__dict__.get(_ATTR)
    if isinstance(w, Exception):
        raise w
    if w is None:
        try:
            w = VLLMWorker(model, vllm_config, device)
        except Exception as e:
            model.__dict__[_ATTR] = e
            raise
        model.__dict__[_ATTR] = w
    return w


def existing(model: torch.nn.Module) -> VLLMWorker | None:
    """The model's :class:`VLLMWorker` if one was built."""
    w = model.__dict__.get(_ATTR)
    return w if isinstance(w, VLLMWorker) else None


def forget(model: torch.nn.Module) -> None:
    w = model.__dict__.pop(_ATTR, None)
    if isinstance(w, VLLMWorker):
        w.close()
