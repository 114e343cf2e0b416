"""What runs inside SGLang's scheduler (TP worker) processes for every weightsync call, whichever way it came:
through SGLang's ``update_weights_from_tensor`` (:func:`weightsync.instances.sglang.rpc_loader`, on the scheduler
thread) or through the call mailbox (:mod:`weightsync.sglang.mailbox`, on a thread of its own). Kept below both so
that neither imports the other: each rank's context, the replay record of signed call numbers, the live model of
the call this thread runs, an answer's record, and the KV-cache flush bookkeeping (``forward_ct``)."""

from __future__ import annotations

import contextlib
import operator
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.errors import WeightsMoved
from weightsync.runtime.instance import WorkerContext

# per worker process: one context per (instance id, TP rank), and (per thread) the model of the call being run
CONTEXTS: dict[tuple[str, int], WorkerContext] = {}
CURRENT = threading.local()
LAST_SEQ: dict[tuple[str, int], int] = {}  # per (instance id, TP rank): the last call sequence number run

@dataclass(frozen=True)
class RpcAnswer:
    """A rank's answer, written to ``<dir>/<seq>.<rank>``: ``ok`` with ``value``, or ``error`` (an error_record)."""

    ok: bool
    value: Any = None
    error: tuple | None = None
    #: a mailbox call's handler phases, (name, seconds): where a call's time goes beside the transport's own
    spent: tuple[tuple[str, float], ...] = ()


#: how many modules and parameters were registered in this process (``torch.nn.Module.__setattr__``,
#: ``register_parameter``, ``register_module``), counted by global hooks installed with the first binding
_REGISTRATIONS = [0]
_COUNTING: list[Any] = []  # the hooks' handles, once installed


def _count_registrations() -> None:
    if _COUNTING:
        return
    from torch.nn.modules.module import (register_module_module_registration_hook,
                                         register_module_parameter_registration_hook)

    def counted(*_args: Any) -> None:
        _REGISTRATIONS[0] += 1

    _COUNTING.extend([register_module_module_registration_hook(counted),
                      register_module_parameter_registration_hook(counted)])


_PARAMETERS = operator.attrgetter("_parameters")


class _Binding:
    """The model's module tree as weightsync bound it, to tell cheaply that nothing was replaced since.

    Per call (:meth:`intact`), where no module or parameter was registered anywhere in the process since the
    binding (torch's global registration hooks count every ``module.x = Module/Parameter``, ``register_parameter``
    and ``register_module``: how SGLang's post-load transforms and reloads replace them): every bound parameter is
    still the one its module holds under its name (a C-level ``map``: catches a deletion or a direct ``_parameters``
    write, which fire no hook). Where something was registered since, the whole tree as bound: every parent -> child
    edge, every module's parameter and child counts, every parameter object (~0.2 ms on a qwen3-8b tree on a CPU
    host; measured 0.75 ms a call inside an SGLang scheduler process on the GPU host at 831d61c, against ~0.02 ms
    for the per-call check now). Either says what the name-by-name check says (a parameter or module replaced, one
    added or removed), and that check names them. Not seen by any of them: ``param.data = other`` (the same
    object over new storage) and a direct ``_modules`` write."""

    def __init__(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor]):
        _count_registrations()
        self.registrations = _REGISTRATIONS[0]
        mods = list(model.named_modules())
        self.model = model
        self.edges = [(m, n, c) for _, m in mods for n, c in m._modules.items()]
        self.counts = [(m, len(m._parameters), len(m._modules)) for _, m in mods]
        params = [(m, n, p) for _, m in mods for n, p in m._parameters.items() if p is not None]
        self.param_owners = [m for m, _, _ in params]
        self.param_names = [n for _, n, _ in params]
        self.param_objects = [p for _, _, p in params]
        owned = {id(p) for p in self.param_objects}
        #: False where the tree does not hold every bound tensor (a model keeping them elsewhere): the slow check then
        self.covers = all(id(t) in owned for t in tensors.values())

    def intact(self, model: torch.nn.Module) -> bool:
        if model is not self.model or not self.covers:
            return False
        held = map(dict.get, map(_PARAMETERS, self.param_owners), self.param_names)  # each module's dict as it is now
        if not all(map(operator.is_, held, self.param_objects)):
            return False
        if _REGISTRATIONS[0] == self.registrations:
            return True
        if not self._tree_intact():
            return False
        self.registrations = _REGISTRATIONS[0]  # registrations elsewhere, not in this tree
        return True

    def _tree_intact(self) -> bool:
        """The edges and counts as bound (the parameter objects were checked just before, in :meth:`intact`)."""
        for m, n, c in self.edges:
            if m._modules.get(n) is not c:
                return False
        return all(len(m._parameters) == n_params and len(m._modules) == n_mods for m, n_params, n_mods in self.counts)


def worker_context(model: torch.nn.Module, instance: str, rank: int) -> WorkerContext:
    """This rank's context, built once; later calls check SGLang did not replace a parameter meanwhile."""
    ctx = CONTEXTS.get((instance, rank))
    if ctx is not None:
        binding = ctx.state.get("binding")
        if isinstance(binding, _Binding) and binding.intact(model):
            return ctx
    params = dict(model.named_parameters())
    if ctx is None:
        first = next(iter(params.values()))
        ctx = CONTEXTS[instance, rank] = WorkerContext(rank=rank, device=first.device, tensors=params,
                                                        state={"model": model, "binding": _Binding(model, params)})
        return ctx
    moved = [n for n, t in ctx.tensors.items() if n not in params or params[n] is not t
             or params[n].data_ptr() != t.data_ptr() or params[n].shape != t.shape]
    if moved or len(params) != len(ctx.tensors):
        raise WeightsMoved(
            f"rank {rank}: SGLang replaced {len(moved)} parameters since weightsync bound them "
            f"(first: {moved[:3]}); a post-load transform re-allocates them, so writes would land in dead memory"
        )
    ctx.state["model"] = model
    ctx.state["binding"] = _Binding(model, params)
    return ctx


@contextlib.contextmanager
def running(model: torch.nn.Module):
    """The live model of the call this thread runs (:func:`find_model`): the scheduler thread's (``rpc_loader``) or
    a mailbox thread's (:mod:`weightsync.sglang.mailbox`)."""
    before = getattr(CURRENT, "model", None)
    CURRENT.model = model
    try:
        yield
    finally:
        CURRENT.model = before


@dataclass(frozen=True)
class Flushed:
    """A call's value and whether SGLang's scheduler flushed its cache right after it, in the same request
    (:func:`_then_flush`): True, False (not idle: SGLang refused), None (no scheduler flush found)."""

    value: Any
    flushed: bool | None
    seconds: float = 0.0  # the flush itself, in the scheduler
    waited: float = 0.0  # what the call waited for it after its own work (the flush ran beside the copies: ~0)
    skipped: bool = False  # nothing ran since this worker's last flush: the cache holds nothing to drop


#: per scheduler: its ``forward_ct`` when :func:`_then_flush` last flushed its cache
FLUSHED_AT: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def scheduler_owner() -> Any | None:
    """The object whose ``update_weights_from_tensor`` runs the loader we are in, if it holds the scheduler's own
    ``flush_cache`` and ``is_fully_idle``.

    0.5.14: ``managers/scheduler_components/weight_updater.py:SchedulerWeightUpdaterManager.
    update_weights_from_tensor`` calls the worker, whose custom loader we are; its ``self`` holds ``flush_cache``
    (``scheduler.py:Scheduler.flush_cache(empty_cache)``: resets the radix tree and the KV pools when
    ``is_fully_idle()``, else returns False), ``is_fully_idle`` and ``scheduler`` (``scheduler.py:1661``). That
    flush is the call the request's own ``flush_cache=True`` makes after the loader
    (``flush_cache_after_weight_update``), except that there a refusal is an ``assert`` that ends the scheduler
    process; called from here, a refusal is an answer."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "update_weights_from_tensor":
            owner = frame.f_locals.get("self")
            if callable(getattr(owner, "flush_cache", None)) and callable(getattr(owner, "is_fully_idle", None)):
                return owner
        frame = frame.f_back
    return None


def flush_due(sched: Any) -> int | None | bool:
    """Whether scheduler ``sched`` needs a KV-cache flush after new weights: False where it ran no batch since
    weightsync last flushed it (its ``forward_ct``, counted in ``scheduler.py:Scheduler.run_batch``, unchanged: KV
    enters the radix cache only from a batch's forward, so the cache holds nothing computed since, with any weights);
    else the count to record once flushed (:func:`flushed_at`; None where it cannot be recorded). Never False with
    SGLang's hierarchical cache (its host copy is not ours to reason about): flushed every time there."""
    count = getattr(sched, "forward_ct", None)
    plain = not getattr(getattr(sched, "server_args", None), "enable_hierarchical_cache", False)
    if not isinstance(count, int):
        return None
    try:
        last = FLUSHED_AT.get(sched) if plain else None
    except TypeError:  # not weak-referenceable: flush every time
        return None
    return False if last is not None and last == count else count


def flushed_at(sched: Any, count: int | None) -> None:
    """Record that ``sched`` was flushed at batch count ``count`` (:func:`flush_due`)."""
    if isinstance(count, int):
        with contextlib.suppress(TypeError):
            FLUSHED_AT[sched] = count


def find_model(ctx: WorkerContext) -> torch.nn.Module:
    """The live SGLang model of the call being run (set by :func:`rpc_loader` or the mailbox thread)."""
    model = getattr(CURRENT, "model", None)
    return ctx.state["model"] if model is None else model


__all__ = ["RpcAnswer", "Flushed", "CONTEXTS", "LAST_SEQ", "worker_context", "running", "find_model", "scheduler_owner",
           "flush_due", "flushed_at"]
