"""An SGLang offline engine (``sglang.Engine``) as an inference instance.

Written against SGLang 0.5.23's documented APIs (/work/notes/sglang-layout.md §8); it cannot run on
our machines (tests/test_instances.py runs it where SGLang and a GPU exist).

SGLang's ``Engine.collective_rpc`` only calls named Scheduler methods and returns nothing, so
``call`` rides on the one documented hook that runs our code in every TP worker with the model:
a *custom weight loader*. The engine must be started with
``custom_weight_loader=[weightsync.instances.sglang.RPC_LOADER]``; ``call`` then sends
``update_weights_from_tensor([("__weightsync_rpc__", <pickled (fn, args) as uint8>)],
load_format=RPC_LOADER, flush_cache=False)``, and each worker's :func:`rpc_loader` runs
``fn(ctx, *args)`` on its live parameters and writes its result (or exception) to a per-call file in
a directory of this instance, which the control process reads in rank order (one host).

- The layout rank is the TP rank (world = tp with DP attention; dp > 1 without DP attention runs
  independent replicas and is refused here). The parallel config and shared-expert fusion come from
  ``engine.server_args`` and the live model, then every rank's ``named_parameters()`` is checked
  against the derived ``sglang`` layout (:class:`~weightsync.errors.LayoutMismatch`).
- SGLang 0.5.23 accepts tensor updates only inside a ``begin_weight_update()`` /
  ``end_weight_update()`` session: ``pause`` opens one (after ``pause_generation``) and ``resume``
  closes it, then flushes the cache and continues generation; a ``call`` outside a session opens and
  closes its own. On engines without sessions these steps are skipped.
- ``after_update`` recomputes MLA ``w_kc``/``w_vc`` (copies of ``kv_b_proj``) with the model's
  ``post_load_weights()``: in-place writes bypass ``load_weights``, so SGLang would not.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import threading
import time
import uuid
from typing import Any, Callable

import torch

from weightsync.bind import hf_config_dict
from weightsync.engines import make_layout
from weightsync.errors import ConfigError
from weightsync.instances import InstanceError, WorkerTimeout, error_record, rebuild_error
from weightsync.layout.layout import check_live
from weightsync.runtime.instance import WorkerContext
from weightsync.spec.model import spec_from_config

RPC_LOADER = "weightsync.instances.sglang.rpc_loader"
RPC_NAME = "__weightsync_rpc__"

# per worker process: one context per instance id, and the model of the call being run
_CONTEXTS: dict[str, WorkerContext] = {}
_CURRENT: dict[str, Any] = {}


def rpc_loader(model: torch.nn.Module, named_tensors: list) -> None:
    """SGLang custom weight loader (runs in each TP worker): execute one weightsync call."""
    from sglang.srt.distributed import get_tensor_model_parallel_rank

    payload = dict(named_tensors)[RPC_NAME]
    msg = pickle.loads(payload.detach().cpu().numpy().tobytes())
    rank = get_tensor_model_parallel_rank()
    try:
        ctx = _CONTEXTS.get(msg["instance"])
        if ctx is None:
            first = next(model.parameters())
            ctx = WorkerContext(rank=rank, device=first.device, tensors=dict(model.named_parameters()))
            _CONTEXTS[msg["instance"]] = ctx
        _CURRENT["model"] = model
        try:
            with torch.no_grad():
                out = ("ok", msg["fn"](ctx, *msg["args"]))
        finally:
            _CURRENT.pop("model", None)
    except BaseException as e:  # noqa: BLE001 -- reported to the control process, the engine stays up
        out = ("err", error_record(e))
    path = os.path.join(msg["dir"], f"{msg['seq']}.{rank}")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(out, f)
    os.replace(path + ".tmp", path)


def _probe(ctx: WorkerContext):
    return ctx.rank, {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in ctx.tensors.items()}


class SGLangInstance:
    """``sglang.Engine`` as an :class:`~weightsync.runtime.instance.InferenceInstance` (see the module docstring)."""

    def __init__(self, engine: Any, *, timeout_s: float = 600.0):
        import sglang  # noqa: F401 -- fail here, clearly, where SGLang is missing

        self.sgl = engine
        self.timeout_s = timeout_s
        args = engine.server_args
        if RPC_LOADER not in (getattr(args, "custom_weight_loader", None) or []):
            raise ConfigError(
                f"start the SGLang engine with custom_weight_loader=[{RPC_LOADER!r}] (weightsync runs its calls through it)"
            )
        tp, dp, ep = args.tp_size, args.dp_size, getattr(args, "ep_size", 1) or 1
        dp_attention = int(bool(getattr(args, "enable_dp_attention", False)))
        if dp > 1 and not dp_attention:
            raise ConfigError(
                "sglang: dp > 1 without DP attention (independent replicas) is not supported by SGLangInstance yet"
            )
        if getattr(args, "pp_size", 1) != 1:
            raise ConfigError("sglang: the sglang layout has no PP")
        from transformers import AutoConfig

        trust = getattr(args, "trust_remote_code", False)
        cfg = hf_config_dict(AutoConfig.from_pretrained(args.model_path, trust_remote_code=trust))
        self.model_config: dict = cfg
        self.spec = spec_from_config(cfg)
        self._id = uuid.uuid4().hex
        self._dir = tempfile.mkdtemp(prefix="weightsync-sglang-")
        self._seq = 0
        self._session = False
        self._world = tp
        fused = self._call(_fused_shared, timeout_s)[0]
        parts = [f"tp={tp}", f"dp={dp}", f"ep={ep}", f"dp_attention={dp_attention}"]
        if getattr(args, "enable_dp_lm_head", False):
            parts.append("dp_lm_head=1")
        if fused is not None:
            parts.append(f"fuse_shared={int(bool(fused))}")
        self.engine = "sglang:" + ",".join(parts)
        self.engine_layout = make_layout(self.spec, self.engine)
        for rank, live in self._call(_probe, timeout_s):
            check_live(self.engine_layout.layout(rank), live, where=f"{self.engine} rank {rank} ({self.spec.name})")

    @property
    def world_size(self) -> int:
        return self._world

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        return self._call(fn, timeout_s or self.timeout_s, *args)

    def pause(self) -> None:
        if hasattr(self.sgl, "pause_generation"):
            self.sgl.pause_generation()
        if hasattr(self.sgl, "begin_weight_update") and not self._session:
            self.sgl.begin_weight_update()
            self._session = True

    def set_version(self, step: int) -> None:
        """Report the weight version to the engine where it has the API (documented; not run here)."""
        update = getattr(self.sgl, "update_weight_version", None)
        if update is not None:
            update(str(step))

    def after_update(self) -> None:
        self._call(_post_load_weights, self.timeout_s)

    def resume(self) -> None:
        if self._session:
            self.sgl.end_weight_update()
            self._session = False
        self.sgl.flush_cache()
        if hasattr(self.sgl, "continue_generation"):
            self.sgl.continue_generation()

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def __repr__(self) -> str:
        return f"SGLangInstance({self.spec.name}, {getattr(self, 'engine', '?')!r})"

    # -- internals ------------------------------------------------------------------------------
    def _call(self, fn: Callable[..., Any], timeout_s: float, *args: Any) -> list[Any]:
        self._seq += 1
        seq = self._seq
        msg = {"instance": self._id, "dir": self._dir, "seq": seq, "fn": fn, "args": args}
        payload = torch.frombuffer(bytearray(pickle.dumps(msg)), dtype=torch.uint8)
        own_session = hasattr(self.sgl, "begin_weight_update") and not self._session

        def send():
            if own_session:
                self.sgl.begin_weight_update()
            try:
                return self.sgl.update_weights_from_tensor([(RPC_NAME, payload)], load_format=RPC_LOADER, flush_cache=False)
            finally:
                if own_session:
                    self.sgl.end_weight_update()

        box: dict[str, Any] = {}

        def run():
            try:
                box["ret"] = send()
            except BaseException as e:  # noqa: BLE001
                box["exc"] = e

        t = threading.Thread(target=run, daemon=True, name="weightsync-sglang-call")
        t.start()
        deadline = time.monotonic() + timeout_s
        t.join(timeout_s)
        if t.is_alive():
            raise WorkerTimeout(f"{self!r}: update_weights_from_tensor did not return within {timeout_s}s")
        if "exc" in box:
            raise box["exc"]
        ret = box.get("ret")
        if isinstance(ret, tuple) and ret and ret[0] is False:
            raise InstanceError(f"{self!r}: SGLang refused the call: {ret[1] if len(ret) > 1 else ret}")
        results: list[Any] = [None] * self._world
        errors = {}
        for rank in range(self._world):
            path = os.path.join(self._dir, f"{seq}.{rank}")
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise WorkerTimeout(f"{self!r}: rank {rank} wrote no answer within {timeout_s}s")
                time.sleep(0.01)
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            os.remove(path)
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
        if errors:
            first = min(errors)
            raise rebuild_error(errors[first], first, repr(self))
        return results


def _fused_shared(ctx: WorkerContext):
    """Whether the live DeepSeek model fused its shared expert into the routed ones (None: not DeepSeek)."""
    model = _find_model(ctx)
    n = getattr(model, "num_fused_shared_experts", None)
    return None if n is None else n > 0


def _post_load_weights(ctx: WorkerContext) -> bool:
    model = _find_model(ctx)
    if hasattr(model, "post_load_weights"):
        model.post_load_weights()
        return True
    return False


def _find_model(ctx: WorkerContext) -> torch.nn.Module:
    """The live SGLang model of the call being run (set by :func:`rpc_loader`)."""
    return _CURRENT["model"]


__all__ = ["SGLangInstance", "rpc_loader", "RPC_LOADER"]
