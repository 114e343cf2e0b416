"""An SGLang offline engine (``sglang.Engine``) as an inference instance.

Ran against a real SGLang **0.5.14** engine on one H200 (benchmarks/sglang_gpu.py, docs/sglang.md §0);
written first against 0.5.23's source (docs/sglang.md §1-§5) and version-gated where the two differ:
0.5.23 requires a ``begin_weight_update()``/``end_weight_update()`` session around
``update_weights_from_tensor`` and has ``Engine.get_model_info`` / ``TokenizerManager.update_weight_version``;
0.5.14 has none of these (its ``update_weights_from_tensor`` runs at once, and the weight version is
``tokenizer_manager.server_args.weight_version``, which is what 0.5.14's own HTTP route
``http_server.py:update_weight_version`` sets). :func:`api_of` decides by what the engine has.

How a call reaches the workers (docs/sglang.md §1). ``call`` rides on SGLang's *custom weight loader*
hook, the one place that runs our code in every TP worker with the live model (0.5.14:
``model_executor/model_runner.py:ModelRunner.update_weights_from_tensor`` ->
``dynamic_import(load_format)(self.model, named_tensors)`` when ``load_format`` is in
``server_args.custom_weight_loader``). Start the engine with
``custom_weight_loader=[weightsync.instances.sglang.RPC_LOADER]``. ``call`` sends
``update_weights_from_tensor([(RPC_NAME, uint8 tensor)], load_format=RPC_LOADER, flush_cache=False)``;
the tensor holds a :mod:`weightsync.runtime.wire` message: a JSON header signed with an HMAC under a key
in this instance's private directory, and the arguments in a restricted pickle that admits weightsync's
own record types only. A worker refuses a message it cannot authenticate before decoding anything, so
a caller of the engine's ``/update_weights_from_tensor`` cannot run code through our loader.
SGLang does not catch an exception from a custom loader (0.5.14:
``managers/scheduler_components/weight_updater.py:SchedulerWeightUpdaterManager.update_weights_from_tensor``
calls the worker outside any ``try``, and the scheduler process dies), so :func:`rpc_loader` never
raises: each rank writes its result or error to ``<dir>/<seq>.<rank>``, read back in rank order. A call
that times out leaves SGLang busy; later calls are refused until it returns, so a late answer is never
taken for a later call's.

**The call mailbox** (``mailbox=True``, the default; :mod:`weightsync.sglang.mailbox`). A quiet update (nothing in
flight, 0.5.14's API) takes SGLang's model-update writer lock (``tokenizer_manager.model_update_lock``, what
``update_weights_from_tensor`` takes) and sends its calls straight to a weightsync thread in every scheduler
process through FIFOs in the private directory (:mod:`weightsync.runtime.mailbox`): no request through the
tokenizer manager, ZeroMQ and the scheduler loop (~2.4 ms a call on an H200). The scheduler's own thread waits in
its loop while the call runs, and flushes the KV cache only where it ran a batch since the last flush
(``forward_ct``); the lock is released in ``resume``. That module's docstring says why the copy cannot race a
forward pass and how CUDA streams are ordered. One ``update_weights_from_tensor`` at construction starts the
threads. Everything else (calls outside an update, a request in flight, 0.5.23's session, ``mailbox=False``, a
scheduler without 0.5.14's loop) goes through ``update_weights_from_tensor`` as below.

- ``pause``/``resume``/``set_version``: ``sglang.Engine`` has no ``pause_generation`` or
  ``continue_generation``; they are the tokenizer manager's (0.5.14:
  ``managers/tokenizer_manager.py:TokenizerManager.pause_generation`` / ``continue_generation``), run on
  the engine's event loop. ``pause_mode`` is ``"retract"`` (running requests go back to the queue and
  are recomputed with the new weights) or ``"abort"``; ``"in_place"`` keeps KV computed with the old
  weights, so it is refused. ``resume`` flushes the cache (its answer checked) and continues. On 0.5.14
  ``flush_cache`` succeeds only when the scheduler is fully idle (``scheduler.py:Scheduler.flush_cache``
  checks ``is_fully_idle()``, which counts retracted requests in the waiting queue): with requests
  retracted the flush is refused and ``resume`` raises after continuing, naming the cause; use
  ``pause_mode="abort"`` there if requests may be in flight.
- ``withhold``/``set_version`` (issue 25, never serve a mix): after a failed non-staged update (the weights
  may hold two steps) the reader calls ``withhold(reason)``; ``resume`` then leaves ``pause_generation`` in
  force (no ``continue_generation``), and new generate requests are refused with :class:`InstanceError`
  naming the reason: the instance shadows ``tokenizer_manager.generate_request``, which every
  ``Engine.generate``/``async_generate`` calls (0.5.14: ``entrypoints/engine.py:Engine.generate``), and which
  while paused would otherwise wait on ``is_pause_cond`` for ever (``managers/tokenizer_manager.py:
  TokenizerManager.generate_request``). The next good update's ``set_version`` lifts both. Staged readers
  never withhold: the live weights keep the previous step.
- Deadlines: a call's deadline is :func:`weightsync.runtime.worker.call_timeout` of the timeout given (within
  2x it); an overrun raises :class:`WorkerTimeout` naming the call and the deadline.
- Post-load transforms (§2, docs/sglang.md §7): every worker classifies its layers at set-up
  (:mod:`weightsync.sglang.live`: in-place, constant, derived). The model's ``post_load_weights()`` (MLA
  ``w_kc``/``w_vc``, from a bf16 or block-FP8 ``kv_b_proj``) is re-run once by ``after_update`` where the model has
  one, its derived tensors checked unmoved; Llama/Qwen2/Qwen3/Qwen3-MoE have none, and no call is made. A
  checkpoint in 128 x 128 block FP8 (``quantization_config``) makes the layout ``quant=fp8``: ``Fp8LinearMethod`` /
  ``Fp8MoEMethod`` (Triton experts) keep the checkpoint form on Hopper's default kernels and take steps in place.
  Layers whose live form weightsync does not produce (other quantizations, UE8M0-requantized FP8, FP8 experts on
  other runners, AMX-packed CPU weights, ``[up; gate]``, transposed or interleaved experts, AITER-shuffled experts)
  are refused at construction, each named.
- The layout comes from the server args and the live model (shared-expert fusion), its dtype must equal
  the engine's ``model_config.dtype``, and every rank's ``named_parameters()`` is checked against it
  (:class:`~weightsync.errors.LayoutMismatch`).
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch

from weightsync.dtypes import dtype_name
from weightsync.bind import hf_config_dict
from weightsync.engines import make_layout
from weightsync.engines.config import SGLangConfig
from weightsync.errors import ConfigError
from weightsync.instances import InstanceError, WorkerTimeout, error_record, rebuild_error
from weightsync.layout.layout import check_live
from weightsync.runtime.instance import WorkerContext
from weightsync.runtime import wire
from weightsync.sglang.worker import (
    CONTEXTS,
    LAST_SEQ,
    Flushed,
    RpcAnswer,
    find_model,
    flush_due,
    flushed_at,
    running,
    scheduler_owner,
    worker_context,
)
from weightsync.spec.model import spec_from_config

log = logging.getLogger("weightsync.instances.sglang")

RPC_LOADER = "weightsync.instances.sglang.rpc_loader"
RPC_NAME = "__weightsync_rpc__"
PAUSE_MODES = ("retract", "abort")


# -- what crosses the hop ----------------------------------------------------------------------


#: one call, as the control process builds it (:func:`rpc_payload` signs and encodes it, never pickled whole)
#: and as a worker decodes it: the wire's own record
RpcMessage = wire.Call


def rpc_payload(msg: RpcMessage, key: bytes, in_name: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` argument of ``update_weights_from_tensor``: one (str, uint8 CPU tensor) pair holding
    a signed :mod:`weightsync.runtime.wire` message (only a list, a tuple, a str and a plain tensor cross SGLang's
    own unpickler).

    ``in_name``: the message rides in the *name* (``RPC_NAME:`` + base64) beside an EMPTY tensor. SGLang pickles
    the payload with ``ForkingPickler`` (0.5.14 ``utils/common.py:MultiprocessingSerializer.serialize``), which
    shares a CPU tensor's storage through a shared-memory file and a descriptor handed over a
    ``multiprocessing.resource_sharer`` connection, and the worker copies it to the GPU
    (``model_runner.py:_unwrap_tensor``) before we read it back: an empty storage pickles as
    ``torch.multiprocessing.reductions.rebuild_storage_empty`` with neither. Used where the engine's
    ``SafeUnpickler`` admits that rebuild (:func:`name_payload_admitted`)."""
    blob = wire.encode(key, msg.instance, msg.dir, msg.seq, msg.fn, msg.args)
    if in_name:
        return [(RPC_NAME + ":" + base64.b64encode(blob).decode("ascii"), torch.empty(0, dtype=torch.uint8))]
    return [(RPC_NAME, torch.frombuffer(bytearray(blob), dtype=torch.uint8))]


def read_payload(named_tensors: list) -> RpcMessage:
    """Authenticate and decode a payload (worker side), either form of :func:`rpc_payload`:
    :class:`~weightsync.runtime.wire.WireError` for anything not signed by this instance's control process,
    raised before any of it is unpickled."""
    pairs = list(named_tensors)
    names = [n for n, _ in pairs if isinstance(n, str)]
    inline = [n for n in names if n.startswith(RPC_NAME + ":")]
    if len(pairs) == 1 and len(inline) == 1:
        try:
            blob = base64.b64decode(inline[0][len(RPC_NAME) + 1:], validate=True)
        except ValueError as e:
            raise wire.WireError(f"{RPC_NAME}: the message in the name is not base64 ({e})") from None
        return wire.decode(blob)
    tensors = dict(pairs)
    if RPC_NAME not in tensors:
        raise InstanceError(f"rpc_loader got tensors {sorted(map(str, tensors))[:4]} without {RPC_NAME!r}: "
                            f"load_format={RPC_LOADER!r} is weightsync's call channel, not a weight loader")
    t = tensors[RPC_NAME]
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise wire.WireError(f"{RPC_NAME} is not a 1-D uint8 tensor")
    return wire.decode(t.detach().cpu().numpy().tobytes())


def name_payload_admitted() -> bool:
    """Whether this SGLang's own serializer carries :func:`rpc_payload`'s ``in_name`` form: serialized and read
    back with ``MultiprocessingSerializer`` (its ``SafeUnpickler``: 0.5.14 admits ``torch.`` globals by prefix;
    an allow-list may not hold ``rebuild_storage_empty``), and no shared-memory descriptor in it."""
    try:
        try:
            from sglang.srt.utils.common import MultiprocessingSerializer
        except ImportError:
            from sglang.srt.utils import MultiprocessingSerializer
        probe = [(RPC_NAME + ":" + base64.b64encode(b"probe").decode("ascii"), torch.empty(0, dtype=torch.uint8))]
        blob = MultiprocessingSerializer.serialize(probe)
        if b"resource_sharer" in blob or b"DupFd" in blob or b"rebuild_storage_fd" in blob:
            return False
        back = MultiprocessingSerializer.deserialize(blob)
        return back[0][0] == probe[0][0] and back[0][1].numel() == 0
    except Exception as e:  # noqa: BLE001 -- any refusal: the tensor form
        log.info("sglang: the name-carried call payload is not admitted here (%s: %s); using the tensor form",
                 type(e).__name__, e)
        return False


# -- worker side (runs inside each SGLang TP worker) ---------------------------------------------


def _tp_rank() -> int:
    """This worker's TP rank (the layout rank; with DP attention too, since tp is the whole world).

    Both 0.5.14 and 0.5.23 have ``runtime_context.get_parallel().tp_rank`` (0.5.14: ``runtime_context.py:
    ParallelContext.tp_rank``); 0.5.23 no longer re-exports ``get_tensor_model_parallel_rank`` from
    ``sglang.srt.distributed`` (parallel_state.py:3489-3558), so that getter is only the fallback.
    """
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:  # SGLang before runtime_context
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    return int(get_parallel().tp_rank)


def _forget(ctx: WorkerContext, directory: str | None = None) -> None:
    """Drop this instance's context on a worker (``close``): its transports and staging memory go with it, and its
    call mailbox's server (``directory``), if it had one."""
    from weightsync.runtime import worker

    try:
        if ctx.state.get("gate") is not None:
            from weightsync.sglang.mailbox import stop_mailbox

            stop_mailbox(ctx, directory)
        if ctx.reader is not None:
            worker.disconnect(ctx)
    finally:
        for key in [k for k, v in CONTEXTS.items() if v is ctx]:
            del CONTEXTS[key]


def rpc_loader(model: torch.nn.Module, named_tensors: list) -> None:
    """SGLang custom weight loader (runs in each TP worker): execute one weightsync call; never raises.

    A payload that is not weightsync's, or not signed by this instance's control process, is logged and
    not answered (there is no trusted place to answer to); nothing of it is unpickled."""
    msg: RpcMessage | None = None
    rank = -1
    try:
        rank = _tp_rank()
        msg = read_payload(named_tensors)
        last = LAST_SEQ.get((msg.instance, rank), 0)
        if msg.seq <= last:  # signed, but already run: a replayed message is not run twice
            raise wire.WireError(f"call {msg.seq} of instance {msg.instance} replayed (last run: {last})")
        LAST_SEQ[msg.instance, rank] = msg.seq
    except BaseException as e:  # noqa: BLE001 -- never raised into SGLang: its scheduler would die
        log.error("weightsync rpc_loader on rank %s refused a payload: %s: %s", rank, type(e).__name__, e)
        return
    try:
        ctx = worker_context(model, msg.instance, rank)
        with running(model), torch.no_grad():
            answer = RpcAnswer(True, msg.fn(ctx, *msg.args))
        blob = pickle.dumps(answer)
    except BaseException as e:  # noqa: BLE001 -- reported to the control process; the engine stays up
        blob = pickle.dumps(RpcAnswer(False, error=error_record(e)))
    path = os.path.join(msg.dir, f"{msg.seq}.{rank}")
    try:
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(path + ".tmp", path)
    except OSError:  # the control process times out naming this rank
        log.exception("weightsync rpc_loader on rank %s could not write its answer to %s", rank, path)


def _then_flush(ctx: WorkerContext, empty_cache: bool, fn: Callable[..., Any], *args: Any) -> Flushed:
    """Run ``fn(ctx, *args)``, then flush the scheduler's cache in the same request (a quiet update: nothing
    runs in the engine, so the flush finds it idle): one round trip instead of a call and a flush; no flush where
    none is due (:func:`flush_due`)."""
    value = fn(ctx, *args)
    owner = scheduler_owner()
    if owner is None:
        return Flushed(value, None)
    sched = getattr(owner, "scheduler", None)
    count = flush_due(sched)
    if count is False:
        return Flushed(value, True, 0.0, skipped=True)
    t0 = time.perf_counter()
    try:
        try:
            done = owner.flush_cache(empty_cache=empty_cache)
        except TypeError:  # a flush_cache without the argument
            done = owner.flush_cache()
    except Exception as e:  # noqa: BLE001 -- the control process flushes the usual way instead
        log.warning("weightsync: the scheduler's flush_cache after a call failed: %s: %s", type(e).__name__, e)
        return Flushed(value, False, time.perf_counter() - t0)
    if done:
        flushed_at(sched, count)
    return Flushed(value, bool(done), time.perf_counter() - t0)


def transform_refusals(model: torch.nn.Module, aiter: bool = False, fp8: bool = False) -> list[str]:
    """Layers whose live form is a transform of the loaded form weightsync does not reproduce (§2; the paths and
    refusals: :func:`weightsync.sglang.live.classify`). ``fp8``: the job's layout is ``quant=fp8``."""
    from weightsync.sglang.live import classify

    return classify(model, fp8=fp8, aiter=aiter).refusals


@dataclass(frozen=True)
class WorkerProbe:
    """What one worker reports at set-up: its rank, live parameters, shared-expert fusion, refusals."""

    rank: int
    live: dict[str, tuple[tuple[int, ...], str]]  # the parameters a step writes (``constant`` ones left out)
    fused_shared: int | None
    refusals: tuple[str, ...]
    post_load: bool = False  # the model has post_load_weights() (MLA w_kc/w_vc): after_update must re-run it
    paths: tuple[tuple[str, int], ...] = ()  # layers per path (weightsync.sglang.live.PATHS)
    constants: tuple[str, ...] = ()  # parameters the engine holds that no step writes (FP8 KV-cache scales at 1.0)
    derived: tuple[str, ...] = ()  # the derived tensors re-made after each update (``layer.w_kc``, ...)


def _aiter() -> bool:
    try:
        from sglang.srt.layers.quantization import unquant
    except ImportError:
        return False
    return bool(getattr(unquant, "_use_aiter", False))


def _probe(ctx: WorkerContext, fp8: bool = False) -> WorkerProbe:
    """Classify every layer of this worker (:func:`weightsync.sglang.live.classify`), keep the report for
    :func:`_post_load_weights`, and report the live tensors a step writes."""
    from weightsync.sglang.live import classify

    model = find_model(ctx)
    report = classify(model, fp8=fp8, aiter=_aiter())
    ctx.state["sglang_live"] = report
    constants = set(report.constants)
    live = {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in ctx.tensors.items() if n not in constants}
    n = getattr(model, "num_fused_shared_experts", None)
    return WorkerProbe(ctx.rank, live, None if n is None else int(n), tuple(report.refusals),
                       callable(getattr(model, "post_load_weights", None)), tuple(report.counts().items()),
                       tuple(sorted(constants)), tuple(f"{d.layer}.{d.attr}" for d in report.derived))


def _post_load_weights(ctx: WorkerContext) -> bool:
    """SGLang's ``post_load_weights(model)`` (model_loader/loader.py): MLA w_kc/w_vc from kv_b_proj as landed -- once
    per update -- then every derived tensor bound at set-up checked unmoved (:func:`weightsync.sglang.live.refresh`)."""
    from weightsync.sglang.live import refresh

    report = ctx.state.get("sglang_live")
    return refresh(find_model(ctx), report.derived if report is not None else [])


def quantization(model_config: Mapping[str, Any], args: Mapping[str, Any]) -> int:
    """1 where the engine serves its checkpoint's block FP8 (``quantization_config`` quant_method fp8,
    ``weight_block_size [128, 128]``, dynamic activations, nothing ignored: what ``save_checkpoint(dir,
    quant="fp8")`` writes and ``quant=fp8`` means), 0 where it serves an unquantized checkpoint unquantized; a
    ConfigError naming anything else (MXFP4/NVFP4/per-tensor FP8 checkpoints, online quantization).

    0.5.14 reads the checkpoint's ``quantization_config`` itself (``configs/model_config.py``); ``--quantization``
    on an unquantized checkpoint quantizes it at load (``Fp8LinearMethod`` with ``is_checkpoint_fp8_serialized``
    False: per-channel scales of its own, ``weight.t()``), which weightsync does not produce."""
    from weightsync.quant.config import from_hf

    qc = model_config.get("quantization_config")
    method = args.get("quantization")
    if not qc:
        if method:
            raise ConfigError(f"quantization={method!r}: the engine quantizes an unquantized checkpoint itself at load; "
                              "weightsync syncs engines served from a block-FP8 checkpoint (save_checkpoint(dir, "
                              "quant='fp8')) or unquantized")
        return 0
    q = from_hf(qc)
    if method not in (None, "fp8"):
        raise ConfigError(f"quantization={method!r} on a block-FP8 checkpoint: start the engine without --quantization "
                          "(it reads the checkpoint's quantization_config)")
    if not q.plain():
        raise ConfigError(f"the engine's block-FP8 checkpoint leaves modules {list(q.ignored)[:4]} unquantized or "
                          f"uses blocks {list(q.block)}; weightsync's quant=fp8 means every linear layer in 128 x 128 "
                          "block FP8")
    return 1


# -- reading the engine's configuration ---------------------------------------------------------


def resolved_args(server_args: Any) -> dict[str, Any]:
    """The server args SGLang resolved (``ServerArgs.resolved_dict``, server_args.py:316), else the raw fields."""
    resolved = getattr(server_args, "resolved_dict", None)
    if callable(resolved):
        return dict(resolved())
    return dict(vars(server_args))


def engine_config(args: Mapping[str, Any]) -> SGLangConfig:
    """The ``sglang`` layout config of resolved server args; anything the layout does not model is refused.

    ``fuse_shared`` is left at auto: the instance takes it from the live model.
    """
    problems = []

    def refuse(key: str, why: str) -> None:
        problems.append(f"{key}={args.get(key)!r}: {why}")

    if RPC_LOADER not in (args.get("custom_weight_loader") or []):
        problems.append(f"start the SGLang engine with custom_weight_loader=[{RPC_LOADER!r}] (weightsync runs its calls through it)")
    tp = int(args.get("tp_size", 1))
    attn_dp = int(args.get("attn_dp_size", 1) or 1)
    replicas = int(args.get("dp_size", 1) or 1)
    if "attn_dp_size" not in args and args.get("enable_dp_attention"):  # before 0.5.23's resolution
        attn_dp, replicas = replicas, 1
    if replicas != 1:
        refuse("dp_size", "independent replicas: update_weights_from_tensor asserts dp_size == 1; use one SGLangInstance per engine")
    for key, default, why in (
        ("pp_size", 1, "the sglang layout has no pipeline parallelism"),
        ("nnodes", 1, "answers come back through files on one host"),
        ("attn_cp_size", 1, "attention context parallelism shrinks the attention TP group"),
        ("dcp_size", 1, "decode context parallelism is not modelled"),
        ("moe_dp_size", 1, "MoE data parallelism changes the MoE TP size (tp / ep / moe_dp)"),
        ("ep_num_redundant_experts", 0, "redundant experts are extra physical copies"),
        ("init_expert_location", "trivial", "experts would not sit in contiguous blocks"),
        ("weight_cache_mode", "off", "SGLang raises on every weight update with the weight cache on"),
        ("speculative_algorithm", None, "draft models also receive the update and are not synced"),
        ("rl_on_policy_target", None, "fp32 norms and embeddings are not modelled"),
        ("cpu_offload_gb", 0, "offloaded weights are moved between devices"),
    ):
        value = args.get(key)
        if value is not None and value != default:
            refuse(key, why)
    for key, why in (
        ("enable_eplb", "EPLB moves experts between ranks"),
        ("enable_dense_mlp_attn_tp", "dense MLPs over attention TP are not modelled"),
        ("enable_shared_experts_attn_tp", "shared experts over attention TP are not modelled"),
    ):
        if args.get(key):
            refuse(key, why)
    if args.get("shared_experts_tp_size") is not None:
        refuse("shared_experts_tp_size", "a shared-expert TP size is not modelled")
    if args.get("moe_dense_tp_size") not in (None, tp):
        refuse("moe_dense_tp_size", f"dense MLP layers of MoE models sharded other than over tp={tp} are not modelled")
    if (args.get("offload_group_size", -1) or -1) > 0:
        refuse("offload_group_size", "offloaded layers are moved between devices")
    if problems:
        raise ConfigError("sglang engine not supported by SGLangInstance: " + "; ".join(problems))
    dp_attention = int(attn_dp > 1)
    return SGLangConfig(tp=tp, dp=attn_dp if dp_attention else 1, ep=int(args.get("ep_size", 1) or 1),
                        dp_attention=dp_attention, dp_lm_head=int(bool(dp_attention and args.get("enable_dp_lm_head"))))


def _success(answer: Any, what: str) -> None:
    """Raise unless an SGLang answer says success: a (success, message) tuple or an object with ``.success``."""
    if isinstance(answer, tuple) and answer and isinstance(answer[0], bool):
        ok, message = answer[0], (answer[1] if len(answer) > 1 else "")
    elif hasattr(answer, "success"):
        ok, message = bool(answer.success), getattr(answer, "message", "")
    else:
        return
    if not ok:
        raise InstanceError(f"SGLang refused {what}: {message or answer!r}")


# -- the control process -------------------------------------------------------------------------

#: which weight-update API an engine has (see :func:`api_of`)
API_SESSION = "0.5.23"  # begin_weight_update()/end_weight_update() around update_weights_from_tensor
API_PLAIN = "0.5.14"  # update_weights_from_tensor alone; weight version in tokenizer_manager.server_args


def api_of(engine: Any) -> str:
    """:data:`API_SESSION` where the engine has 0.5.23's weight-update session, else :data:`API_PLAIN` (0.5.14)."""
    return API_SESSION if callable(getattr(engine, "begin_weight_update", None)) else API_PLAIN


_RWLOCK_FIELDS = ("_lock", "_cond", "_readers", "_writer_active", "_waiting_writers")


def _lock_in_reach(lock: Any, loop: Any) -> bool:
    """The lock is 0.5.14's ``RWLock`` and no coroutine of its loop runs now: its state may be read and set here."""
    return not loop.is_running() and all(hasattr(lock, f) for f in _RWLOCK_FIELDS)


def take_writer_in_place(tm: Any, loop: Any) -> bool | None:
    """Take the tokenizer manager's model-update writer lock without running the engine's event loop, where that is
    exactly what ``acquire_writer()`` would do: True (taken), False (a request holds, waits for or is in flight
    past the lock: not taken), None (cannot tell here: take it through the loop).

    Why: two ``loop.run_until_complete`` trips (take, release) cost ~0.5 ms a step on the GPU host (BENCHMARKS,
    685101f on 2026-12-02: 0.59 ms with the pause check), each running every ready task of the loop. SGLang 0.5.14's
    ``utils/aio_rwlock.py:RWLock`` is asyncio state of the engine's loop: ``acquire_writer`` with its inner
    ``asyncio.Lock`` free, no writer active or waiting and no reader takes it without suspending (``_writer_active =
    True`` is the whole effect). With the loop not running no coroutine of it runs meanwhile: the offline
    ``Engine`` drives its loop only inside its own calls (``run_until_complete``), from the one thread that uses it,
    which here is the reader's. A running loop, or an ``RWLock`` without 0.5.14's fields: None."""
    lock = tm.model_update_lock
    if not _lock_in_reach(lock, loop):
        return None
    if tm.rid_to_state or lock._lock.locked() or lock._writer_active or lock._readers or lock._waiting_writers:
        return False
    lock._writer_active = True
    return True


def release_writer_in_place(lock: Any, loop: Any) -> bool:
    """Release a writer lock taken by :func:`take_writer_in_place` without the loop, where nobody waits on it (no
    waiter to notify: ``release_writer()`` would only clear ``_writer_active``); False: release it through the
    loop (a request began waiting meanwhile, or the loop runs)."""
    if not _lock_in_reach(lock, loop) or lock._lock.locked():
        return False
    waiters = getattr(lock._cond, "_waiters", None)  # asyncio.Condition's waiting coroutines (a deque, CPython 3.10+)
    if waiters is None or len(waiters):
        return False
    lock._writer_active = False
    return True


class SGLangInstance:
    """``sglang.Engine`` as an :class:`~weightsync.runtime.instance.InferenceInstance` (see the module docstring)."""

    def __init__(self, engine: Any, *, timeout_s: float = 600.0, pause_mode: str = "retract",
                 empty_cache_on_resume: bool = True, quiet_updates: bool = True, validate_via: str = "layout",
                 mailbox: bool = True):
        import sglang  # noqa: F401 -- fail here, clearly, where SGLang is missing

        if pause_mode not in PAUSE_MODES:
            raise ConfigError(
                f"sglang: pause_mode={pause_mode!r}; use one of {PAUSE_MODES} ('in_place' keeps KV computed with "
                f"the old weights, and SGLang refuses to flush the cache while requests run in place)"
            )
        self.sgl = engine
        self.timeout_s = timeout_s
        self.pause_mode = pause_mode
        #: ``continue_generation(torch_empty_cache=...)`` (0.5.14 ``ContinueGenerationReqInput``; SGLang's default
        #: True returns the allocator's cached blocks to the driver before generation resumes)
        self.empty_cache_on_resume = empty_cache_on_resume
        #: what ``WeightReader.validate`` compares with: ``"layout"`` (the checkpoint placed by weightsync's layout,
        #: labelled so) or ``"sglang-loader"`` (a fresh model loaded by SGLang's own loader in each worker,
        #: :mod:`weightsync.sglang.validate`; opt-in until it has run on the GPU host)
        if validate_via not in ("layout", "sglang-loader"):
            raise ConfigError(f"sglang: validate_via={validate_via!r}; use 'layout' or 'sglang-loader'")
        self.validate_via = validate_via
        #: an update that finds nothing running in the engine neither pauses nor continues it, and each of its
        #: calls flushes the cache in its own request (:meth:`pause`); False: always pause, flush, continue
        self.quiet_updates = quiet_updates
        #: seconds spent in each part of the last update (pause, calls, after_update, end_session, flush, continue)
        self.last_timing: dict[str, float] = {}
        #: whether the last update ran quiet (:meth:`pause`), and whether its calls went through the call mailbox
        self.last_quiet = False
        self.last_mailbox = False
        #: calls made through ``update_weights_from_tensor`` (SGLang's request path): set-up, calls outside an update,
        #: updates that are not quiet; none a quiet update's with the mailbox up
        self.trips = 0
        #: the last mailbox call's :class:`~weightsync.runtime.mailbox.CallTiming`
        self.last_call = None
        #: quiet updates go through the call mailbox where it is up (False: through ``update_weights_from_tensor``,
        #: e.g. to compare the two in one engine)
        self.use_mailbox = mailbox
        #: a mailbox update takes and releases the writer lock in place when the engine's loop is idle
        #: (:func:`take_writer_in_place`; False: always through the loop, e.g. to compare the two in one engine)
        self.lock_in_place = True
        self.api = api_of(engine)
        self.version = getattr(sglang, "__version__", "?")
        args = resolved_args(engine.server_args)
        from transformers import AutoConfig

        cfg = hf_config_dict(AutoConfig.from_pretrained(args["model_path"], trust_remote_code=bool(args.get("trust_remote_code"))))
        self.model_config: dict = cfg
        self.spec = spec_from_config(cfg)
        problems = []  # everything refused, in one line, before anything is sent to the engine
        try:
            config = engine_config(args)
        except ConfigError as e:
            problems.append(str(e).removeprefix("sglang engine not supported by SGLangInstance: "))
        try:
            quant = quantization(cfg, args)
        except ConfigError as e:
            problems.append(str(e))
        else:
            if not problems:
                config = replace(config, quant=quant)
        engine_dtype = self._engine_dtype()
        if engine_dtype is not None and engine_dtype != self.spec.dtype:
            problems.append(f"dtype mismatch: the engine computes in {engine_dtype} (model_config.dtype; dtype="
                            f"{args.get('dtype', 'auto')!r}), the checkpoint config says {self.spec.dtype}: start the "
                            f"engine with dtype={self.spec.dtype!r}")
        if problems:
            raise ConfigError("sglang engine not supported by SGLangInstance (nothing was sent to it): "
                              + "; ".join(problems))
        self._id = uuid.uuid4().hex
        self._dir, self._key = wire.new_key_dir()
        self._seq = 0
        self._session = False
        self._paused = False
        self._withheld: str | None = None  # why a failed non-staged update left the weights torn (withhold)
        self._post_load = False
        self._inflight: threading.Thread | None = None
        self._world = config.tp
        self._quiet = False  # inside a quiet update (pause() found nothing running): calls flush after themselves
        self._flushed = False  # the last call of this quiet update flushed the cache on every rank
        # the call message rides in the tensor's name where this SGLang's serializer admits an empty tensor
        self._in_name = name_payload_admitted()
        self._mailbox = None  # the call mailbox (weightsync.runtime.mailbox), once up
        self._locked = False  # this update holds SGLang's model-update writer lock (a mailbox update)
        self._mail_failed = False  # a call of this mailbox update failed
        self._broken: str | None = None  # a mailbox call timed out or a scheduler process died: nothing more is sent
        try:
            self._check(config, timeout_s)
            if mailbox:
                self._open_mailbox(timeout_s)
        except BaseException:
            if self._mailbox is not None:
                self._mailbox.close("set-up failed")
            self._drop_dir()
            raise

    def _check(self, config: SGLangConfig, timeout_s: float) -> None:
        """Probe every rank: refuse untransformable layers, take the fusion, check the live tensors."""
        probes: list[WorkerProbe] = self._call(_probe, timeout_s, bool(config.quant))
        refusals = sorted({r for p in probes for r in p.refusals})
        if refusals:
            raise ConfigError(f"sglang: {len(refusals)} layers hold a form weightsync cannot write in place "
                              f"(set-up refused, nothing written):\n  " + "\n  ".join(refusals[:20]))
        #: per rank, how many layers take each path (weightsync.sglang.live: in-place, constant, derived)
        self.paths = [dict(p.paths) for p in probes]
        fused = {p.fused_shared for p in probes}
        if len(fused) != 1:
            raise InstanceError(f"sglang: ranks disagree on shared-expert fusion: {sorted(map(str, fused))}")
        (n_fused,) = fused
        if n_fused is not None:
            config = replace(config, fuse_shared=int(n_fused > 0))
        self._post_load = any(p.post_load for p in probes)
        self.engine = str(config)
        self.engine_layout = make_layout(self.spec, config)
        held = self.engine_layout
        if config.quant:  # block FP8: e4m3 weights beside their fp32 _scale_inv, as the engine loaded them
            from weightsync.quant.layout import fp8_layout

            held = fp8_layout(self.engine_layout)
        for p in probes:
            check_live(held.layout(p.rank), p.live, where=f"{self.engine} rank {p.rank} ({self.spec.name})")

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def mailbox(self) -> bool:
        """Whether quiet updates send their calls through the call mailbox (else through ``update_weights_from_tensor``)."""
        return self._mailbox is not None

    def _open_mailbox(self, timeout_s: float) -> None:
        """One call through ``update_weights_from_tensor`` starts every scheduler's mailbox thread
        (:func:`weightsync.sglang.mailbox.serve_mailbox`). Only where a quiet update can use it: 0.5.14's API (no
        session), ``quiet_updates``, and a tokenizer manager with the model-update lock and the request table; a
        refusal (another SGLang's scheduler) is logged and leaves every call on SGLang's request path."""
        from weightsync.runtime.mailbox import Mailbox, MailboxError
        from weightsync.sglang.mailbox import serve_mailbox

        tm = self.sgl.tokenizer_manager
        lock = getattr(tm, "model_update_lock", None)
        why = None
        if self.api != API_PLAIN:
            why = "SGLang's weight-update session API (0.5.23) is used as is"
        elif not self.quiet_updates:
            why = "quiet_updates=False"
        elif not (callable(getattr(lock, "acquire_writer", None)) and callable(getattr(lock, "release_writer", None))
                  and isinstance(getattr(tm, "rid_to_state", None), dict)):
            why = "the tokenizer manager has no model_update_lock.acquire_writer/release_writer or rid_to_state"
        if why is not None:
            log.info("%r: no call mailbox (%s); calls go through update_weights_from_tensor", self, why)
            return
        box = None
        try:
            box = Mailbox(self._dir, self._world)
            self._call(serve_mailbox, timeout_s, self._dir, self._id, float(timeout_s))
            box.connect()
        except (MailboxError, OSError, InstanceError, wire.WireError) as e:
            if box is not None:
                box.close("set-up failed")
            log.warning("%r: the call mailbox did not start (%s: %s); calls go through update_weights_from_tensor "
                        "(SGLang's request path, ~2.4 ms a call)", self, type(e).__name__, e)
            return
        self._mailbox = box

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        return self._call(fn, timeout_s or self.timeout_s, *args)

    def call_when(self, gate: Callable[[], None], fn: Callable[..., Any], *args: Any,
                  timeout_s: float | None = None) -> list[Any]:
        """In a mailbox update: :meth:`call` sent at once, its copies waiting for ``gate()`` (a step's call before
        the trainers' `written`: :mod:`weightsync.transport.gate`); otherwise ``gate()``, then the call."""
        if not self._locked or self._broken is not None:
            gate()
            return self.call(fn, *args, timeout_s=timeout_s)
        return self._mail(fn, timeout_s or self.timeout_s, *args, gate=gate)

    def pause(self) -> None:
        """Stop generating (``pause_generation(mode=pause_mode)``); on 0.5.23 also open the weight-update session.

        Quiet update (``quiet_updates``, 0.5.14's API): when the tokenizer manager holds no request
        (``rid_to_state`` empty: an offline ``Engine`` serves only what went through it, and its
        ``run_until_complete`` calls do not overlap), nothing runs in the scheduler, so nothing is paused and
        nothing continued; each call of the update takes SGLang's model-update writer lock (0.5.14
        ``tokenizer_control_mixin.py:update_weights_from_tensor`` does when not paused: a generate request holds
        the reader lock for its whole life, ``tokenizer_manager.py:generate_request``) and flushes the cache in
        its own request (:func:`_then_flush`). Saves the pause, flush and continue round trips a step.

        With the call mailbox up (``mailbox=True``) a quiet update instead takes the writer lock here and holds it
        until :meth:`resume`, and its calls go to the schedulers' mailbox threads (:meth:`_mail`): no SGLang request
        at all (module docstring, :mod:`weightsync.sglang.mailbox`)."""
        self._not_busy()
        t0 = time.perf_counter()
        self.last_timing = {}
        self._quiet = self._flushed = self._mail_failed = False
        if self.quiet_updates and self.api == API_PLAIN and not self._paused and self._idle():
            self._quiet = True
            if self.use_mailbox and self._mailbox is not None and self._broken is None and not self._locked:
                self._locked = self._lock_writer()
        elif not self._paused:
            self._tokenizer(lambda tm, io: tm.pause_generation(io.PauseGenerationReqInput(mode=self.pause_mode)))
            self._paused = True
        self.last_quiet = self._quiet
        self.last_mailbox = self._locked
        self.last_timing["pause"] = time.perf_counter() - t0
        if self.api == API_SESSION and not self._session:
            try:
                _success(self.sgl.begin_weight_update(), "begin_weight_update")
            except BaseException:
                self._continue()  # the reader resumes only after a successful pause: do not leave it paused
                raise
            self._session = True

    def _idle(self) -> bool:
        """The tokenizer manager holds no request in flight (0.5.14 ``TokenizerManager.rid_to_state``)."""
        states = getattr(self.sgl.tokenizer_manager, "rid_to_state", None)
        return isinstance(states, dict) and not states

    def _lock_writer(self) -> bool:
        """Take SGLang's model-update writer lock for a mailbox update, where no request holds or waits for it.

        0.5.14: ``tokenizer_manager.model_update_lock`` (``utils/aio_rwlock.py:RWLock``, an asyncio lock of the
        engine's loop); ``update_weights_from_tensor`` takes its writer side when generation is not paused
        (``managers/tokenizer_control_mixin.py``), and ``generate_request`` holds the reader side for a request's
        whole life. Taken only when nobody holds it (``is_locked()``) and ``rid_to_state`` is empty, checked again once
        held (a request registered meanwhile: released, and the update goes through SGLang's request path)."""
        tm = self.sgl.tokenizer_manager
        lock = tm.model_update_lock
        if int(getattr(getattr(tm, "server_args", None), "tokenizer_worker_num", 1) or 1) > 1:
            return False  # other tokenizer workers' requests are not in this rid_to_state

        async def take() -> bool:
            if tm.rid_to_state or await lock.is_locked():
                return False
            await lock.acquire_writer()
            if tm.rid_to_state:
                await lock.release_writer()
                return False
            return True

        t0 = time.perf_counter()
        taken = take_writer_in_place(tm, self.sgl.loop) if self.lock_in_place else None
        if taken is None:
            taken = self.sgl.loop.run_until_complete(take())
        self.last_timing["lock"] = time.perf_counter() - t0
        return taken

    def _unlock_writer(self) -> None:
        if self._locked:
            self._locked = False
            lock = self.sgl.tokenizer_manager.model_update_lock
            if not (self.lock_in_place and release_writer_in_place(lock, self.sgl.loop)):
                self.sgl.loop.run_until_complete(lock.release_writer())

    def after_update(self) -> None:
        """Re-run the model's ``post_load_weights()`` once where it has one (MLA ``w_kc``/``w_vc`` from ``kv_b_proj``
        as landed, its derived tensors checked unmoved: :func:`weightsync.sglang.live.refresh`); nothing otherwise."""
        if self._post_load:
            t0 = time.perf_counter()
            self._call(_post_load_weights, self.timeout_s)
            self.last_timing["after_update"] = time.perf_counter() - t0

    def resume(self) -> None:
        """Close the session (0.5.23), flush the cache, continue generating; the first failure is raised after all.
        Withheld (:meth:`withhold`), generation stays paused until :meth:`set_version` lifts it.

        While a timed-out call still runs inside SGLang nothing can be sent: generation stays paused, and a
        later ``resume()`` (after the call returned) finishes.
        """
        if self._busy():
            log.warning("%r: a timed-out call still runs in SGLang; generation stays paused until resume() is called "
                        "again after it returns", self)
            return
        errors: list[BaseException] = []
        quiet, self._quiet = self._quiet, False
        flush = self._flush
        if quiet:  # the update's last call flushed in its own request, or the scheduler was not yet idle then
            flush = _nothing if self._flushed else self._flush_when_idle
        if self._locked and self._mail_failed:
            # a failed mailbox update: the reader withholds the engine (it serves nothing) until the next good update,
            # whose calls flush (forward_ct moved since the last flush); a scheduler that did not come round to flush,
            # or a dead one, would not answer SGLang's flush request either
            flush = _nothing
        # a mailbox update flushes (if it must) before the writer lock lets any request in
        for name, step in (("end_session", self._end_session), ("flush", flush), ("unlock", self._unlock_writer),
                           ("continue", self._continue)):
            t0 = time.perf_counter()
            try:
                step()
            except BaseException as e:  # noqa: BLE001 -- every step runs; the first error is raised
                errors.append(e)
            self.last_timing[name] = time.perf_counter() - t0
        if errors:
            raise errors[0]

    def withhold(self, reason: str) -> None:
        """A non-staged update failed part-way: serve nothing until the next good update (:meth:`set_version`).

        ``pause_generation`` stays in force (``resume`` does not continue) and new generate requests raise
        :class:`InstanceError` naming ``reason`` (``tokenizer_manager.generate_request`` shadowed on the instance:
        while paused, SGLang would make them wait for ever)."""
        self._withheld = reason
        tm = self.sgl.tokenizer_manager
        me = repr(self)

        def refuse(*_args: Any, **_kw: Any) -> Any:
            raise InstanceError(f"{me} serves nothing: {reason}, so its weights may mix two steps; generation "
                                f"resumes after the next good update (reader.update())")

        refuse.weightsync_withheld = True  # type: ignore[attr-defined]
        tm.generate_request = refuse

    @property
    def withheld(self) -> str | None:
        """Why the instance serves nothing (a failed non-staged update), or None."""
        return self._withheld

    def set_version(self, step: int) -> None:
        """Report the weight version: 0.5.23 ``TokenizerManager.update_weight_version``; 0.5.14 has no such call and
        its own HTTP route (``http_server.py:update_weight_version``) sets ``tokenizer_manager.server_args.
        weight_version``, which is what this does there. A good update: a withheld instance serves again."""
        self._not_busy()
        if self._withheld is not None:
            self._withheld = None
            tm = self.sgl.tokenizer_manager
            if getattr(vars(tm).get("generate_request"), "weightsync_withheld", False):
                del tm.generate_request
            self._continue()
        tm = self.sgl.tokenizer_manager
        if callable(getattr(tm, "update_weight_version", None)):
            self._tokenizer(lambda tm, io: tm.update_weight_version(
                io.UpdateWeightVersionReqInput(new_version=str(step), abort_all_requests=False)))
        else:
            tm.server_args.weight_version = str(step)

    @property
    def served_version(self) -> str | None:
        """The weight version the engine reports (0.5.23 ``get_model_info()``; 0.5.14 the tokenizer manager's
        ``server_args.weight_version``, what its ``/model_info`` route answers)."""
        info = getattr(self.sgl, "get_model_info", None)
        if callable(info):
            return info().get("weight_version")
        return getattr(self.sgl.tokenizer_manager.server_args, "weight_version", None)

    def close(self) -> None:
        """Drop the workers' contexts (their transports and staging memory) and mailbox threads, then the answer
        directory."""
        try:
            self._unlock_writer()
        except Exception as e:  # noqa: BLE001 -- closing: say it, go on
            log.warning("%r: SGLang's model-update lock was not released: %s", self, e)
        if not self._busy() and self._broken is None and os.path.isdir(self._dir):
            try:
                self._call(_forget, min(self.timeout_s, 60.0), self._dir)
            except Exception as e:  # noqa: BLE001 -- closing: say it, go on
                log.warning("%r: the workers did not drop their weightsync state: %s", self, e)
        if self._mailbox is not None:
            self._mailbox.close()
        self._drop_dir()

    def __repr__(self) -> str:
        return f"SGLangInstance({self.spec.name}, {getattr(self, 'engine', '?')!r})"

    # -- internals ------------------------------------------------------------------------------
    def _drop_dir(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def _engine_dtype(self) -> str | None:
        mc = getattr(getattr(self.sgl, "tokenizer_manager", None), "model_config", None)
        dtype = getattr(mc, "dtype", None)
        return None if dtype is None else dtype_name(dtype)

    def _tokenizer(self, make: Callable[[Any, Any], Any]) -> Any:
        """Run a tokenizer-manager coroutine on the engine's loop (what ``Engine``'s own methods do)."""
        from sglang.srt.managers import io_struct

        return self.sgl.loop.run_until_complete(make(self.sgl.tokenizer_manager, io_struct))

    def _end_session(self) -> None:
        if self._session:
            self._session = False
            _success(self.sgl.end_weight_update(), "end_weight_update")

    def _flush(self) -> None:
        _success(self.sgl.flush_cache(), "flush_cache (KV computed with the old weights stays cached; SGLang 0.5.14 "
                                         "flushes only when no request is queued: pause_mode='abort' drops them)")

    def _flush_when_idle(self) -> None:
        """A quiet update whose in-request flush found the scheduler not yet idle (with the overlap scheduler, the
        last batch of a request that just finished is still the scheduler's ``last_batch`` for one iteration,
        0.5.14 ``scheduler.py:Scheduler.is_fully_idle``): a flush that waits for idle (``FlushCacheReqInput.
        timeout_s``, ``scheduler_components/flush_wrapper.py:SchedulerFlushWrapper``) where SGLang has one."""
        import inspect

        flush = getattr(self.sgl.tokenizer_manager, "flush_cache", None)
        if flush is None or "timeout_s" not in inspect.signature(flush).parameters:
            return self._flush()
        wait = min(self.timeout_s, 30.0)
        _success(self._tokenizer(lambda tm, io: tm.flush_cache(timeout_s=wait)),
                 f"flush_cache (waited up to {wait:g} s for the scheduler to be idle after a quiet update)")

    def _continue(self) -> None:
        if self._paused and self._withheld is None:  # withheld: paused until set_version lifts it
            self._paused = False
            self._tokenizer(lambda tm, io: tm.continue_generation(self._continue_request(io)))

    def _continue_request(self, io: Any) -> Any:
        import dataclasses

        cls = io.ContinueGenerationReqInput
        if any(f.name == "torch_empty_cache" for f in dataclasses.fields(cls)):
            return cls(torch_empty_cache=self.empty_cache_on_resume)
        return cls()

    def _busy(self) -> bool:
        return self._inflight is not None and self._inflight.is_alive()

    def _not_busy(self) -> None:
        if self._busy():
            raise InstanceError(f"{self!r}: an earlier call has not returned from SGLang yet (it timed out); "
                                f"the engine runs one weight update at a time")

    def _call(self, fn: Callable[..., Any], timeout_s: float, *args: Any) -> list[Any]:
        from weightsync.runtime.worker import call_timeout

        if self._broken is not None:
            raise InstanceError(f"{self!r} is unusable: {self._broken}: restart the engine")
        if self._locked:
            return self._mail(fn, timeout_s, *args)
        self._not_busy()
        what = getattr(fn, "__name__", repr(fn))
        timeout_s = call_timeout(timeout_s)  # the deadline: within 2x what the user set
        started = time.perf_counter()
        self.trips += 1
        self._seq += 1
        seq = self._seq
        quiet = self._quiet
        if quiet:  # a quiet update: the call flushes the cache in its own request (pause())
            fn, args = _then_flush, (self.empty_cache_on_resume, fn, *args)
            self._flushed = False
        payload = rpc_payload(RpcMessage(self._id, self._dir, seq, fn, args), self._key, self._in_name)
        own_session = self.api == API_SESSION and not self._session

        def send():
            if own_session:
                _success(self.sgl.begin_weight_update(), "begin_weight_update")
            try:
                return self.sgl.update_weights_from_tensor(payload, load_format=RPC_LOADER, flush_cache=False)
            finally:
                if own_session:
                    _success(self.sgl.end_weight_update(), "end_weight_update")

        box: dict[str, Any] = {}

        def run():
            try:
                box["ret"] = send()
            except BaseException as e:  # noqa: BLE001
                box["exc"] = e

        t = threading.Thread(target=run, daemon=True, name="weightsync-sglang-call")
        self._inflight = t
        t.start()
        deadline = time.monotonic() + timeout_s
        t.join(timeout_s)
        if t.is_alive():
            raise WorkerTimeout(f"{self!r}: weightsync's call {what} (update_weights_from_tensor) did not return "
                                f"within its {timeout_s:g} s deadline; SGLang still runs it, and the instance refuses "
                                f"calls until it returns (is a TP worker stuck? raise timeout_s if it is just slow)")
        if "exc" in box:
            raise box["exc"]
        _success(box.get("ret"), f"weightsync's call {what}")
        results: list[Any] = [None] * self._world
        errors = {}
        # every rank writes its answer before SGLang's call returns (the scheduler's TP barrier follows the
        # loader): one still missing shortly after is a payload the worker refused (it logs why)
        late = min(deadline, time.monotonic() + 5.0)
        for rank in range(self._world):
            path = os.path.join(self._dir, f"{seq}.{rank}")
            while not os.path.exists(path):
                if time.monotonic() > late:
                    raise InstanceError(f"{self!r}: rank {rank} wrote no answer to call {seq}: it refused the payload "
                                        f"(the engine's log says why: 'weightsync rpc_loader on rank {rank} refused')")
                time.sleep(0.001)
            answer: RpcAnswer = wire.read_answer(path)
            os.remove(path)
            if answer.ok:
                results[rank] = answer.value
            else:
                errors[rank] = answer.error
        self.last_timing["calls"] = self.last_timing.get("calls", 0.0) + time.perf_counter() - started
        if errors:
            first = min(errors)
            raise rebuild_error(errors[first], first, repr(self))
        return self._unflushed(results) if quiet else results

    def _unflushed(self, results: list[Any]) -> list[Any]:
        """A quiet update's answers (:class:`Flushed`): whether every rank flushed, the flush's time, the values."""
        self._flushed = all(isinstance(r, Flushed) and r.flushed for r in results)
        for name, of in (("flush_in_calls", lambda r: r.seconds), ("flush_waited", lambda r: r.waited)):
            self.last_timing[name] = self.last_timing.get(name, 0.0) + max(
                (of(r) for r in results if isinstance(r, Flushed)), default=0.0)
        return [r.value if isinstance(r, Flushed) else r for r in results]

    def _mail(self, fn: Callable[..., Any], timeout_s: float, *args: Any,
              gate: Callable[[], None] | None = None) -> list[Any]:
        try:
            return self._mail_once(fn, timeout_s, *args, gate=gate)
        except BaseException:
            self._mail_failed = True  # resume() then leaves the flush to the next good update
            raise

    def _mail_once(self, fn: Callable[..., Any], timeout_s: float, *args: Any,
                   gate: Callable[[], None] | None = None) -> list[Any]:
        """A call of a mailbox update: straight to every scheduler's mailbox thread (no SGLang request), which runs
        ``fn`` and has the scheduler's own thread flush the cache where a batch ran since the last flush
        (:func:`weightsync.sglang.mailbox.then_flush`). The same answers and errors as :meth:`_call`; a worker that
        died (its pipe closed) raises :class:`WorkerDied` at once, a call past its deadline :class:`WorkerTimeout`,
        and either leaves the instance unusable (the call may still run in the scheduler process)."""
        from weightsync.errors import WorkerDied
        from weightsync.runtime.mailbox import MailboxDied, MailboxError, MailboxTimeout
        from weightsync.runtime.worker import call_timeout
        from weightsync.sglang.mailbox import then_flush

        what = f"weightsync's call {getattr(fn, '__name__', repr(fn))} (through the call mailbox)"
        deadline = call_timeout(timeout_s)
        started = time.perf_counter()
        self._seq += 1
        self._flushed = False
        blob = wire.encode(self._key, self._id, self._dir, self._seq, then_flush,
                           (self.empty_cache_on_resume, deadline / 2, fn, *args))
        try:
            raw = self._mailbox.call([blob] * self._world, deadline, what, gate=gate)
        except MailboxTimeout as e:
            self._broken = f"{what} did not answer within its {deadline:g} s deadline (a scheduler may still run it)"
            raise WorkerTimeout(f"{self!r}: {what} did not return within its {deadline:g} s deadline ({e}); the "
                                "scheduler process may still run it, so this instance sends nothing more: restart the "
                                "engine (is a TP worker stuck? raise timeout_s if it is just slow)") from e
        except MailboxDied as e:
            self._broken = f"{what} failed: rank {e.rank}'s scheduler process died or its mailbox thread ended"
            raise WorkerDied(f"{self!r}: {what} failed: {e}: restart the engine") from e
        except MailboxError as e:
            self._broken = f"{what} failed in a scheduler's mailbox: {e}"
            raise WorkerDied(f"{self!r}: {what} failed outside weightsync's call: {e}: restart the engine") from e
        self.last_call = last = self._mailbox.last
        answers: list[RpcAnswer] = [pickle.loads(a) for a in raw]  # from our private FIFOs, written by our workers
        timing = self.last_timing
        timing["mailbox"] = timing.get("mailbox", 0.0) + time.perf_counter() - started - last.gated
        if gate is not None:
            timing["mailbox_gated"] = timing.get("mailbox_gated", 0.0) + last.gated
        timing["mailbox_handler"] = timing.get("mailbox_handler", 0.0) + last.handler  # decode, run, flush, encode
        timing["mailbox_synced"] = timing.get("mailbox_synced", 0.0) + last.synced  # the two device syncs
        for name in {n for a in answers for n, _ in a.spent}:  # the handler's phases, the slowest rank's
            key = f"mailbox_{name}"
            timing[key] = timing.get(key, 0.0) + max(dict(a.spent).get(name, 0.0) for a in answers)
        errors = {rank: a.error for rank, a in enumerate(answers) if not a.ok}
        if errors:
            first = min(errors)
            raise rebuild_error(errors[first], first, repr(self))
        return self._unflushed([a.value for a in answers])


def _nothing() -> None:
    return None


__all__ = ["SGLangInstance", "rpc_loader", "RPC_LOADER", "RPC_NAME", "RpcMessage", "RpcAnswer", "WorkerProbe", "Flushed",
           "name_payload_admitted",
           "engine_config", "resolved_args", "transform_refusals", "quantization", "rpc_payload", "read_payload", "api_of",
           "API_SESSION", "API_PLAIN"]
