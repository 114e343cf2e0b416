"""A vLLM offline engine (``vllm.LLM``) as an inference instance.

Written against vLLM 0.33.0's documented APIs (/work/notes/vllm-layout.md §8); it cannot run on our
machines (tests/test_instances.py runs it where vLLM and a GPU exist).

- ``call`` uses ``LLM.collective_rpc(callable, timeout=, args=)``: the callable receives the worker as
  ``self``. vLLM V1 ships callables to its workers only when ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
  is set before the LLM is created.
- Each worker keeps its :class:`WorkerContext` on the worker object (``worker._weightsync_ctx``),
  built once from ``model_runner.get_model().named_parameters()`` minus the tensors vLLM derives
  after loading (``VLLMLayout.derived_tensors``: MLA ``W_UK_T``/``W_UV``).
- The layout rank of a worker is ``data_parallel_rank * tp + tp_rank`` (VLLMLayout). One offline LLM
  drives the workers of its own DP rank; ``world_size`` counts those, ``ranks`` lists their layout ranks.
- The offline LLM generates only inside ``generate()``, so ``pause`` has nothing to stop; ``resume``
  resets the prefix cache (KV blocks computed with the old weights). ``after_update`` re-runs MLA
  ``process_weights_after_loading`` on layers whose ``W_UK_T``/``W_UV`` are copies, not views, of
  ``kv_b_proj`` (fp8 and AITER paths; bf16 ones are views and see the new weights already).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from weightsync.bind import hf_config_dict
from weightsync.engines import make_layout
from weightsync.errors import ConfigError
from weightsync.engines.vllm import VLLMLayout
from weightsync.layout.layout import check_live
from weightsync.runtime.instance import WorkerContext
from weightsync.spec.model import spec_from_config

DERIVED = VLLMLayout.derived_tensors


# -- functions run on the vLLM workers (``self`` is the worker) ----------------------------------


def _layout_rank(worker) -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    pc = worker.vllm_config.parallel_config
    return pc.data_parallel_rank * pc.tensor_parallel_size + get_tensor_model_parallel_rank()


def _worker_ctx(worker) -> WorkerContext:
    ctx = getattr(worker, "_weightsync_ctx", None)
    if ctx is None:
        model = worker.model_runner.get_model()
        tensors = {n: p for n, p in model.named_parameters() if not n.endswith(DERIVED)}
        ctx = WorkerContext(rank=_layout_rank(worker), device=torch.device(worker.device), tensors=tensors)
        worker._weightsync_ctx = ctx
    return ctx


def _worker_call(worker, fn: Callable[..., Any], args: tuple) -> Any:
    ctx = _worker_ctx(worker)
    with torch.no_grad():
        return fn(ctx, *args)


def _worker_probe(worker) -> tuple[int, dict[str, tuple[tuple[int, ...], str]]]:
    model = worker.model_runner.get_model()
    live = {n: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters()}
    return _layout_rank(worker), live


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _worker_after_update(worker) -> int:
    """Recompute MLA W_UK_T/W_UV where they are copies of kv_b_proj; returns how many layers were redone."""
    model = worker.model_runner.get_model()
    dtype = worker.vllm_config.model_config.dtype
    redone = 0
    with torch.no_grad():
        for _, mod in model.named_modules():
            w_uk, w_uv, kv_b = getattr(mod, "W_UK_T", None), getattr(mod, "W_UV", None), getattr(mod, "kv_b_proj", None)
            if w_uk is None or w_uv is None or kv_b is None or not hasattr(mod, "process_weights_after_loading"):
                continue
            weight = getattr(kv_b, "weight", None)
            if weight is not None and _same_storage(w_uk, weight) and _same_storage(w_uv, weight):
                continue  # views: they already see the new kv_b_proj
            mod.process_weights_after_loading(dtype)
            redone += 1
    return redone


class VLLMInstance:
    """``vllm.LLM`` behind the :class:`~weightsync.runtime.instance.InferenceInstance` protocol.

    At construction every worker's ``named_parameters()`` (names, shapes, dtypes) is checked against
    the derived ``vllm`` layout of its rank, ignoring ``W_UK_T``/``W_UV``; any difference raises
    :class:`~weightsync.errors.LayoutMismatch` naming the tensor and rank.
    """

    def __init__(self, llm: Any, *, timeout_s: float | None = 600.0):
        import vllm  # noqa: F401 -- fail here, clearly, where vLLM is missing

        self.llm = llm
        self.timeout_s = timeout_s
        vc = llm.llm_engine.vllm_config
        pc = vc.parallel_config
        tp, dp, pp = pc.tensor_parallel_size, pc.data_parallel_size, pc.pipeline_parallel_size
        if pp != 1:
            raise ConfigError(f"vllm: pipeline_parallel_size={pp}: the vllm layout has no PP (only tp, dp, ep)")
        ep = tp * dp if pc.enable_expert_parallel and tp * dp > 1 else 1
        self.engine = f"vllm:tp={tp},dp={dp},ep={ep}"
        cfg = hf_config_dict(vc.model_config.hf_config)
        self.model_config: dict = cfg
        self.spec = spec_from_config(cfg)
        self.engine_layout = make_layout(self.spec, self.engine)
        probes = self.llm.collective_rpc(_worker_probe, timeout=timeout_s)
        self.ranks = [rank for rank, _ in probes]
        for rank, live in probes:
            where = f"{self.engine} rank {rank} ({self.spec.name})"
            check_live(self.engine_layout.layout(rank), live, where=where, ignore=DERIVED)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        results = self.llm.collective_rpc(_worker_call, timeout=timeout_s or self.timeout_s, args=(fn, args))
        return list(results)

    def pause(self) -> None:
        # The offline LLM generates only inside generate(); an AsyncLLM-style engine can pause in place.
        pause = getattr(self.llm, "pause_generation", None)
        if pause is not None:
            pause(mode="keep")

    def resume(self) -> None:
        self.llm.reset_prefix_cache()
        resume = getattr(self.llm, "resume_generation", None)
        if resume is not None:
            resume()

    def set_version(self, step: int) -> None:
        """Report the weight version to the engine where it has the API (documented; not run here)."""
        update = getattr(self.llm, "update_weight_version", None)
        if update is not None:
            update(str(step))

    def after_update(self) -> None:
        self.llm.collective_rpc(_worker_after_update, timeout=self.timeout_s)

    def close(self) -> None:
        try:
            self.llm.collective_rpc(_worker_forget, timeout=self.timeout_s)
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"VLLMInstance({self.spec.name}, {self.engine!r}, ranks={self.ranks})"


def _worker_forget(worker) -> None:
    worker.__dict__.pop("_weightsync_ctx", None)


__all__ = ["VLLMInstance"]
