"""SGLangInstance against a STAND-IN for ``sglang.Engine`` (a test aid, not evidence that SGLang works).

SGLang 0.5.23 cannot run here (it pins torch 2.14.1 and CUDA kernels). What these tests run for real:
weightsync's own code on both sides of SGLang's call path -- the payload is serialized with
``multiprocessing.reduction.ForkingPickler`` (what SGLang's ``MultiprocessingSerializer.serialize`` is)
and unpickled in a *spawned process* by an unpickler restricted to globals on SGLang 0.5.23's
``SafeUnpickler.ALLOWED_GLOBALS`` (utils/common.py:3148-3358, docs/sglang.md §1); :func:`rpc_loader`
runs on real torch modules whose parameters follow the sglang layout; results, errors, timeouts,
sessions, pause/flush/continue and the weight version go through ``SGLangInstance`` unchanged. The
stand-in engine only reproduces the engine-side contract that docs/sglang.md cites (a session is
required around ``update_weights_from_tensor``; answers are ``(success, message)``; flush answers
``.success``; the tokenizer manager's coroutines run on ``engine.loop``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import multiprocessing as mp
import os
import pickle
import queue
import re
import shutil
import sys
import threading
import time
import types
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from helpers import preset

from weightsync.engines import make_layout
from weightsync.errors import ConfigError, LayoutMismatch, WeightsMoved
from weightsync.instances import InstanceError, WorkerTimeout
from weightsync.layout.materialize import TORCH_DTYPES, fill_from, scatter
from weightsync.runtime.instance import WorkerContext
from weightsync.spec.model import spec_from_config
from weightsync.testing import random_canonical

S = pytest.importorskip("weightsync.instances.sglang")

# The SafeUnpickler globals a CPU uint8 tensor in a list of (str, tensor) pairs needs, each one on
# SGLang 0.5.23's ALLOWED_GLOBALS (utils/common.py): containers, the storage-sharing rebuilds, the dtype.
SGLANG_ALLOWED = {
    ("builtins", "list"), ("builtins", "tuple"), ("builtins", "str"), ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"), ("torch", "uint8"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"), ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"), ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"), ("multiprocessing.resource_sharer", "DupFd"),
    ("multiprocessing.reduction", "_rebuild_partial"), ("functools", "partial"), ("copyreg", "__newobj__"),
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch._tensor", "_rebuild_from_type_v2"),
}


class RestrictedUnpickler(pickle.Unpickler):
    """Stand-in for SGLang's SafeUnpickler: refuses any global not in SGLANG_ALLOWED (a subset of SGLang's)."""

    def find_class(self, module, name):
        if (module, name) not in SGLANG_ALLOWED:
            raise pickle.UnpicklingError(f"blocked global {module}.{name}")
        return super().find_class(module, name)


def _receive(blob: bytes, q) -> None:
    """In a spawned process (same authkey, as SGLang's schedulers are spawned): SGLang's unpickle, then ours."""
    try:
        named = RestrictedUnpickler(io.BytesIO(blob)).load()
        msg = S.read_payload([(n, t.to("cpu")) for n, t in named])
        # the tensor goes back as a list: a tensor put on the queue would be shared through this process's
        # resource sharer, gone once it exits
        q.put(("ok", msg.instance, msg.seq, msg.args[:2], (str(msg.args[2].dtype), msg.args[2].float().tolist())))
    except BaseException as e:  # noqa: BLE001
        q.put(("err", repr(e)))


def rank_and_count(ctx: WorkerContext, extra=None, *more):
    return ctx.rank, len(ctx.tensors), extra


def fail_on(ctx: WorkerContext, rank, message):
    if ctx.rank == rank:
        raise ValueError(message)
    return ctx.rank


def unpicklable(ctx: WorkerContext):
    return lambda: None


def write_canonical(ctx: WorkerContext, canonical, cfg, engine):
    fill_from(make_layout(spec_from_config(cfg), engine).layout(ctx.rank), ctx.tensors, canonical)
    return ctx.rank


def test_payload_passes_sglang_unpickler_in_a_spawned_process(tmp_path):
    from weightsync.runtime import wire

    d, key = wire.new_key_dir()
    try:
        msg = S.RpcMessage("inst", d, 3, rank_and_count, ("a", (1, 2), torch.arange(3, dtype=torch.bfloat16)))
        buf = io.BytesIO()
        ForkingPickler(buf).dump(S.rpc_payload(msg, key))  # SGLang's MultiprocessingSerializer.serialize
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_receive, args=(buf.getvalue(), q))
        p.start()
        try:
            got = q.get(timeout=120)
        finally:
            p.join(30)
    finally:
        shutil.rmtree(d)
    assert got == ("ok", "inst", 3, ("a", (1, 2)), ("torch.bfloat16", [0.0, 1.0, 2.0]))


def _marker_payload(marker: str) -> bytes:
    """A pickle that creates ``marker`` when unpickled (what anyone reaching /update_weights_from_tensor could send)."""

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    return pickle.dumps(Evil())


def _sglang_delivery(named: list) -> list:
    """What a TP worker gets from SGLang: the list through ForkingPickler and SGLang's unpickler, tensors as is."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return RestrictedUnpickler(io.BytesIO(buf.getvalue())).load()


def test_a_payload_that_would_run_code_is_refused_and_runs_nothing(tmp_path, monkeypatch, caplog):
    """Issue 25: the old read_payload pickle.loads-ed the request; a payload creating a marker file must not run."""
    from weightsync.runtime import wire

    monkeypatch.setattr(S, "_tp_rank", lambda: 0)
    model = Model({"a.weight": torch.randn(3, 2)})
    marker = tmp_path / "pwned"
    evil = _marker_payload(str(marker))
    as_tensor = lambda b: [(S.RPC_NAME, torch.frombuffer(bytearray(b), dtype=torch.uint8))]  # noqa: E731
    # 1. the raw pickle where our message goes (what the old code unpickled first)
    assert S.rpc_loader(model, _sglang_delivery(as_tensor(evil))) is None
    # 2. a well-formed header naming a real weightsync directory, without the key: refused on the MAC
    d, key = wire.new_key_dir()
    try:
        forged = wire.encode(b"x" * 32, "i", d, 1, rank_and_count, ())
        header_len = int.from_bytes(forged[len(wire.MAGIC):len(wire.MAGIC) + 4], "big")
        forged = forged[:len(wire.MAGIC) + 4 + header_len] + evil
        assert S.rpc_loader(model, _sglang_delivery(as_tensor(forged))) is None
        # 3. even signed with the right key, the body's unpickler admits no os.system
        with pytest.raises(wire.WireError, match="refused global"):
            wire.loads_args(evil)
        signed = bytearray(wire.encode(key, "i", d, 2, rank_and_count, ()))
        body_at = len(wire.MAGIC) + 4 + int.from_bytes(signed[len(wire.MAGIC):len(wire.MAGIC) + 4], "big")
        header = json.loads(bytes(signed[len(wire.MAGIC) + 4:body_at]))
        header["mac"] = wire._mac(key, header, evil)
        hb = json.dumps(header).encode()
        resigned = wire.MAGIC + len(hb).to_bytes(4, "big") + hb + evil
        assert S.rpc_loader(model, _sglang_delivery(as_tensor(resigned))) is None
        assert sorted(os.listdir(d)) == ["key"]  # only the key: no answer was written for any of them
    finally:
        shutil.rmtree(d)
    assert not marker.exists()
    text = caplog.text
    assert "bad magic" in text and "bad MAC" in text and "refused global posix.system" in text.replace("os.system", "posix.system")


def test_the_key_is_read_only_from_a_private_weightsync_directory(tmp_path):
    from weightsync.runtime import wire

    with pytest.raises(wire.WireError, match="not a weightsync-sglang"):
        wire.read_key(str(tmp_path))
    loose = tmp_path / "weightsync-sglang-loose"
    loose.mkdir(mode=0o755)
    (loose / "key").write_bytes(b"k" * 32)
    os.chmod(loose, 0o755)
    with pytest.raises(wire.WireError, match="not a private directory"):
        wire.read_key(str(loose))
    d, key = wire.new_key_dir()
    try:
        assert wire.read_key(d) == key and oct(os.stat(d).st_mode & 0o777) == "0o700"
        # arguments: values, weightsync records and tensors round-trip; a lambda or a foreign class does not travel
        from weightsync.engines.config import SGLangConfig

        args = (1, "s", {"k": [1.5, None]}, SGLangConfig(tp=2), torch.float32, torch.device("cpu"), torch.Size([2]),
                torch.ones(2, 3, dtype=torch.float16), rank_and_count)
        back = wire.loads_args(wire.dumps_args(args))
        assert back[:7] == args[:7] and torch.equal(back[7], args[7]) and back[8] is rank_and_count
        with pytest.raises(TypeError, match="module-level function"):
            wire.dumps_args((lambda: 0,))
        with pytest.raises(wire.WireError, match="refused global"):
            wire.loads_args(pickle.dumps((types.SimpleNamespace(a=1),)))
    finally:
        shutil.rmtree(d)


def test_a_function_in_the_tensor_list_would_be_refused_by_sglang():
    """Why the call travels as bytes: a callable next to the tensors is a global SafeUnpickler blocks."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump([("x", torch.zeros(2, dtype=torch.uint8)), ("fn", rank_and_count)])
    with pytest.raises(pickle.UnpicklingError, match="blocked global"):
        RestrictedUnpickler(io.BytesIO(buf.getvalue())).load()


# -- rpc_loader on a real torch module --------------------------------------------------------------


class Model(torch.nn.Module):
    """Parameters under SGLang's dotted names (a stand-in for SGLang's model classes)."""

    def __init__(self, tensors: dict[str, torch.Tensor], **attrs):
        super().__init__()
        self._p = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in tensors.items()}
        self.post_loads = 0
        for k, v in attrs.items():
            setattr(self, k, v)

    def named_parameters(self, *a, **k):
        return iter(self._p.items())

    def parameters(self, *a, **k):
        return iter(self._p.values())

    def post_load_weights(self):
        self.post_loads += 1


def run_loader(model, msg, key, rank=0, monkeypatch=None):
    monkeypatch.setattr(S, "_tp_rank", lambda: rank)
    named = _sglang_delivery(S.rpc_payload(msg, key))
    assert S.rpc_loader(model, named) is None
    from weightsync.runtime import wire

    return wire.read_answer(f"{msg.dir}/{msg.seq}.{rank}")


def test_rpc_loader_answers_values_errors_and_never_raises(monkeypatch):
    from weightsync.runtime import wire

    d, key = wire.new_key_dir()
    model = Model({"a.weight": torch.randn(3, 2), "b.weight": torch.randn(2)})
    try:
        ok = run_loader(model, S.RpcMessage("i1", d, 1, rank_and_count, ("x",)), key, 1, monkeypatch)
        assert ok == S.RpcAnswer(True, (1, 2, "x"))
        bad = run_loader(model, S.RpcMessage("i1", d, 2, fail_on, (1, "boom")), key, 1, monkeypatch)
        assert not bad.ok and bad.error[1] == "ValueError" and bad.error[2] == "boom"
        odd = run_loader(model, S.RpcMessage("i1", d, 3, unpicklable, ()), key, 1, monkeypatch)
        assert not odd.ok and "pickle" in odd.error[2].lower()
        # SGLang replacing a parameter (what AMX packing does) is found, not written into
        model._p["a.weight"] = torch.nn.Parameter(torch.randn(3, 2), requires_grad=False)
        moved = run_loader(model, S.RpcMessage("i1", d, 4, rank_and_count, (0,)), key, 1, monkeypatch)
        assert not moved.ok and moved.error[1] == WeightsMoved.__name__ and "a.weight" in moved.error[2]
        # a stray tensor list (someone else's load through our load_format): logged, no answer, no raise
        assert S.rpc_loader(model, [("model.x", torch.zeros(1))]) is None
        # a replayed (signed) message is not run twice
        os.remove(f"{d}/1.1")
        monkeypatch.setattr(S, "_tp_rank", lambda: 1)
        assert S.rpc_loader(model, _sglang_delivery(S.rpc_payload(S.RpcMessage("i1", d, 1, rank_and_count, ("x",)), key))) is None
        assert not os.path.exists(f"{d}/1.1")
    finally:
        shutil.rmtree(d)


def test_a_bound_module_tree_is_checked_without_named_parameters_and_a_replacement_is_still_found():
    """Every call checks SGLang replaced nothing since weightsync bound the model: on a real module tree through the
    binding (module edges, counts, parameter objects; no named_parameters() walk), and any replacement -- a parameter
    object, a whole submodule, a parameter added -- still raises WeightsMoved naming it."""
    from weightsync.sglang import worker as W

    def tree():
        m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Sequential(torch.nn.Linear(3, 2)))
        for p in m.parameters():
            p.requires_grad_(False)
        return m

    walks = []

    class Counted(torch.nn.Sequential):
        def named_parameters(self, *a, **k):
            walks.append(1)
            return super().named_parameters(*a, **k)

    for change in ("param", "module", "added", "deleted", "dict write"):
        model = tree()
        model.__class__ = Counted
        inst = f"bind-{change}"
        try:
            ctx = W.worker_context(model, inst, 0)
            walks.clear()
            assert W.worker_context(model, inst, 0) is ctx and not walks  # intact: no walk
            if change == "param":
                model[0].weight = torch.nn.Parameter(torch.zeros(3, 4), requires_grad=False)
                want = "0.weight"
            elif change == "module":
                model[1] = torch.nn.Sequential(torch.nn.Linear(3, 2))
                want = "1.0.weight"
            elif change == "added":
                model[1][0].register_parameter("extra", torch.nn.Parameter(torch.zeros(1), requires_grad=False))
                want = "replaced 0 parameters"
            elif change == "deleted":  # no registration hook fires: the per-call parameter check finds it
                del model[1][0].bias
                want = "1.0.bias"
            else:  # a direct _parameters write fires no hook either
                model[0]._parameters["bias"] = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
                want = "0.bias"
            with pytest.raises(WeightsMoved, match=re.escape(want)):
                W.worker_context(model, inst, 0)
        finally:
            W.CONTEXTS.pop((inst, 0), None)


def test_the_whole_tree_is_walked_only_after_a_registration_somewhere(monkeypatch):
    """The per-call check walks the module tree only when a module or parameter was registered in the process since
    the last walk (torch's global registration hooks); a registration in an unrelated module costs one walk, found
    intact, and the next call is cheap again."""
    from weightsync.sglang import worker as W

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    for p in model.parameters():
        p.requires_grad_(False)
    walks = []
    original = W._Binding._tree_intact
    monkeypatch.setattr(W._Binding, "_tree_intact", lambda self: walks.append(1) or original(self))
    try:
        ctx = W.worker_context(model, "walks", 0)
        for _ in range(3):
            assert W.worker_context(model, "walks", 0) is ctx
        assert walks == []
        torch.nn.Linear(2, 2)  # registers two parameters elsewhere
        assert W.worker_context(model, "walks", 0) is ctx and walks == [1]
        assert W.worker_context(model, "walks", 0) is ctx and walks == [1]
    finally:
        W.CONTEXTS.pop(("walks", 0), None)


def test_transform_refusals_name_the_layers():
    class UnquantizedFusedMoEMethod:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class Fp8LinearMethod:
        pass

    root = torch.nn.Module()
    root.ok = torch.nn.Module()
    root.ok.quant_method = UnquantizedFusedMoEMethod()
    root.cutlass = torch.nn.Module()
    root.cutlass.quant_method = UnquantizedFusedMoEMethod(load_up_proj_weight_first=True)
    root.tk = torch.nn.Module()
    root.tk.quant_method = UnquantizedFusedMoEMethod(use_triton_kernels=True)
    root.fp8 = torch.nn.Module()
    root.fp8.quant_method = Fp8LinearMethod()
    root.amx = torch.nn.Module()
    root.amx.use_intel_amx_backend = True
    got = S.transform_refusals(root)
    assert [g.split(":")[0] for g in got] == ["cutlass", "tk", "fp8", "amx"]
    assert "[up; gate]" in got[0] and "transposed" in got[1] and "Fp8LinearMethod" in got[2]
    assert len(S.transform_refusals(root, aiter=True)) == 7


# -- the server args SGLang resolved ------------------------------------------------------------------

BASE = {"model_path": "/m", "custom_weight_loader": [S.RPC_LOADER], "tp_size": 4}


@pytest.mark.parametrize(
    "args,want",
    [
        ({}, "sglang:tp=4"),
        ({"ep_size": 2}, "sglang:tp=4,ep=2"),
        # 0.5.23 resolves --dp-size 2 --enable-dp-attention into attn_dp_size=2, dp_size=1 (fields/parallel.py:192-194)
        ({"attn_dp_size": 2, "dp_size": 1, "enable_dp_attention": True}, "sglang:tp=4,dp=2,dp_attention=1"),
        ({"attn_dp_size": 2, "enable_dp_lm_head": True}, "sglang:tp=4,dp=2,dp_attention=1,dp_lm_head=1"),
        ({"dp_size": 2, "enable_dp_attention": True}, "sglang:tp=4,dp=2,dp_attention=1"),  # unresolved (older) record
        ({"enable_dp_lm_head": True}, "sglang:tp=4"),  # no attention DP: the LM head stays over TP
        ({"moe_dense_tp_size": 4, "speculative_algorithm": None, "weight_cache_mode": "off"}, "sglang:tp=4"),
    ],
)
def test_engine_config_from_resolved_args(args, want):
    assert str(S.engine_config({**BASE, **args})) == want


def test_engine_config_refuses_what_the_layout_does_not_model_all_at_once():
    args = {**BASE, "custom_weight_loader": [], "dp_size": 2, "pp_size": 2, "nnodes": 2, "moe_dp_size": 2,
            "enable_eplb": True, "speculative_algorithm": "EAGLE", "weight_cache_mode": "daemon", "moe_dense_tp_size": 1}
    with pytest.raises(ConfigError) as e:
        S.engine_config(args)
    text = str(e.value)
    for key in ("custom_weight_loader=[", "dp_size=2", "pp_size=2", "nnodes=2", "moe_dp_size=2", "enable_eplb=True",
                "speculative_algorithm='EAGLE'", "weight_cache_mode='daemon'", "moe_dense_tp_size=1"):
        assert key in text, key


def test_resolved_args_prefers_resolved_dict():
    class Args:
        tp_size, dp_size, enable_dp_attention = 4, 2, True

        def resolved_dict(self):
            return {"tp_size": 4, "dp_size": 1, "attn_dp_size": 2, "enable_dp_attention": True}

    assert S.resolved_args(Args())["attn_dp_size"] == 2


# -- SGLangInstance against the stand-in engine ------------------------------------------------------


@dataclass
class PauseGenerationReqInput:
    mode: str = "abort"


@dataclass
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclass
class UpdateWeightVersionReqInput:
    new_version: str
    abort_all_requests: bool = True


@dataclass
class Flush:
    success: bool
    message: str = ""


class TokenizerManager:
    def __init__(self, engine):
        self.engine = engine
        self.model_config = types.SimpleNamespace(dtype=engine.dtype)

    async def pause_generation(self, obj):
        self.engine.log.append(("pause", obj.mode))
        self.is_pause = True

    async def continue_generation(self, obj):
        self.engine.log.append(("continue",))
        self.is_pause = False

    async def generate_request(self, obj, request=None):
        # SGLang 0.5.14 tokenizer_manager.py:TokenizerManager.generate_request waits on is_pause_cond while paused
        while getattr(self, "is_pause", False):
            await asyncio.sleep(0.01)
        yield {"text": f"out:{obj}", "weight_version": self.engine.version}

    async def update_weight_version(self, obj):
        self.engine.log.append(("version", obj.new_version, obj.abort_all_requests))
        self.engine.version = obj.new_version


class StandInEngine:
    """The engine-side contract of sglang.Engine 0.5.23 as docs/sglang.md cites it; each TP rank a Model."""

    def __init__(self, model_path, models, dtype=torch.bfloat16, **args):
        self.server_args = types.SimpleNamespace(resolved_dict=lambda: {
            "model_path": model_path, "custom_weight_loader": [S.RPC_LOADER], "tp_size": len(models), **args})
        self.models, self.dtype, self.log = models, dtype, []
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = TokenizerManager(self)
        self.session = False
        self.flush_ok = True
        self.version = None
        self.gate: threading.Event | None = None

    def begin_weight_update(self):
        self.log.append(("begin",))
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        self.log.append(("end",))
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        assert load_format == S.RPC_LOADER and flush_cache is False
        if not self.session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        blobs = []
        for _ in self.models:  # one payload per TP rank, as engine.py _serialize_tensors_per_rank (a DupFd is single-use)
            blobs.append(io.BytesIO())
            ForkingPickler(blobs[-1]).dump(named_tensors)
        if self.gate is not None:
            self.gate.wait(30)
        for rank, model in enumerate(self.models):
            S._tp_rank = lambda rank=rank: rank  # noqa: B023 -- each "worker" knows its TP rank
            named = RestrictedUnpickler(io.BytesIO(blobs[rank].getvalue())).load()
            S.rpc_loader(model, named)
        return True, "Success"

    def flush_cache(self):
        self.log.append(("flush",))
        return Flush(self.flush_ok, "" if self.flush_ok else "Cache not flushed because there are pending requests.")

    def get_model_info(self):
        return {"weight_version": self.version}

    def generate(self, prompt, wait_s=2.0):
        """entrypoints/engine.py:Engine.generate: the tokenizer manager's generate_request run on engine.loop (a
        bounded wait here, where SGLang's offline call would wait for ever while paused)."""
        gen = self.tokenizer_manager.generate_request(prompt, None)
        return self.loop.run_until_complete(asyncio.wait_for(gen.__anext__(), wait_s))


@pytest.fixture
def fake_sglang(monkeypatch):
    """``import sglang`` and ``sglang.srt.managers.io_struct`` answered by stand-in modules (test aid)."""
    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    for cls in (PauseGenerationReqInput, ContinueGenerationReqInput, UpdateWeightVersionReqInput):
        setattr(io_struct, cls.__name__, cls)
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)
    monkeypatch.setattr(sys.modules["sglang.srt.managers"], "io_struct", io_struct, raising=False)
    monkeypatch.setattr(S, "_tp_rank", S._tp_rank)  # restored after the stand-in engine rebinds it
    yield


def engine_for(tmp_path, name, engine_text, poison=True, drop=None, **kw):
    cfg = preset(name)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = spec_from_config(cfg)
    layout = make_layout(spec, engine_text)
    attrs = {"num_fused_shared_experts": kw.pop("fused")} if "fused" in kw else {}
    models = []
    for r in range(layout.world_size):
        tensors = {n: torch.full(t.shape, float("nan") if poison else 0.0, dtype=TORCH_DTYPES[t.dtype])
                   for n, t in layout.layout(r).tensors.items() if n != drop}
        models.append(Model(tensors, **attrs))
    return spec, layout, StandInEngine(str(tmp_path), models, **kw)


def test_instance_writes_bit_exact_through_the_whole_update(tmp_path, fake_sglang):
    spec, layout, eng = engine_for(tmp_path, "tiny-qwen3", "sglang:tp=2")
    inst = S.SGLangInstance(eng, timeout_s=30)
    try:
        assert inst.engine == "sglang:tp=2" and inst.world_size == 2
        assert inst.call(rank_and_count, "z") == [(0, len(layout.layout(0).tensors), "z"), (1, len(layout.layout(1).tensors), "z")]
        eng.log.clear()
        canonical = random_canonical(spec, seed=11)
        inst.pause()
        assert inst.call(write_canonical, canonical, preset("tiny-qwen3"), inst.engine) == [0, 1]
        inst.after_update()
        inst.resume()
        inst.set_version(7)
        assert eng.log == [("pause", "retract"), ("begin",), ("end",), ("flush",), ("continue",), ("version", "7", False)]
        assert inst.served_version == "7" and all(m.post_loads == 1 for m in eng.models)
        _exact(layout, eng, canonical)
    finally:
        inst.close()


def test_calls_outside_an_update_open_their_own_session_and_errors_keep_their_type(tmp_path, fake_sglang):
    _, _, eng = engine_for(tmp_path, "tiny-qwen3", "sglang:tp=2")
    inst = S.SGLangInstance(eng, timeout_s=30)
    eng.log.clear()
    with pytest.raises(ValueError, match="boom") as e:
        inst.call(fail_on, 1, "boom")
    assert e.value.rank == 1 and eng.log == [("begin",), ("end",)] and not eng.session
    eng.session = True  # a session someone else left open: SGLang refuses begin, and so do we
    with pytest.raises(InstanceError, match="already open"):
        inst.call(rank_and_count, 0)
    eng.log.clear()
    with pytest.raises(InstanceError, match="already open"):
        inst.pause()
    assert eng.log == [("pause", "retract"), ("begin",), ("continue",)]  # not left paused


def test_resume_raises_a_failed_flush_after_continuing_generation(tmp_path, fake_sglang):
    _, _, eng = engine_for(tmp_path, "tiny-qwen3", "sglang:tp=1")
    inst = S.SGLangInstance(eng, timeout_s=30)
    inst.pause()
    eng.flush_ok = False
    eng.log.clear()
    with pytest.raises(InstanceError, match="flush_cache.*pending requests"):
        inst.resume()
    assert eng.log == [("end",), ("flush",), ("continue",)]


def test_a_timed_out_call_makes_the_instance_busy_until_sglang_returns(tmp_path, fake_sglang):
    _, _, eng = engine_for(tmp_path, "tiny-qwen3", "sglang:tp=1")
    inst = S.SGLangInstance(eng, timeout_s=30)
    inst.pause()
    eng.gate = threading.Event()
    with pytest.raises(WorkerTimeout):
        inst.call(rank_and_count, 1, timeout_s=0.3)
    with pytest.raises(InstanceError, match="has not returned"):
        inst.call(rank_and_count, 2)
    inst.resume()  # nothing can be sent yet: the session stays open, generation paused
    assert eng.session
    eng.gate.set()
    inst._inflight.join(10)
    eng.gate = None
    assert inst.call(rank_and_count, 3) == [(0, len(eng.models[0]._p), 3)]
    inst.resume()
    assert not eng.session and eng.log[-1] == ("continue",)


def test_construction_refuses_dtype_layout_and_pause_mode(tmp_path, fake_sglang):
    _, _, eng = engine_for(tmp_path, "tiny-qwen3", "sglang:tp=2", dtype=torch.float16)
    with pytest.raises(ConfigError, match="float16.*dtype='bfloat16'"):
        S.SGLangInstance(eng)
    _, _, eng = engine_for(tmp_path, "tiny-qwen3", "sglang:tp=2", drop="model.layers.1.mlp.gate_up_proj.weight")
    with pytest.raises(LayoutMismatch, match="missing tensor model.layers.1.mlp.gate_up_proj.weight"):
        S.SGLangInstance(eng)
    with pytest.raises(ConfigError, match="in_place"):
        S.SGLangInstance(eng, pause_mode="in_place")


@pytest.mark.parametrize("fused,engine_text", [(0, "sglang:tp=2,fuse_shared=0"), (1, "sglang:tp=2,fuse_shared=1")])
def test_shared_expert_fusion_comes_from_the_live_model(tmp_path, fake_sglang, fused, engine_text):
    _, _, eng = engine_for(tmp_path, "tiny-deepseek-v3", engine_text, fused=fused)
    inst = S.SGLangInstance(eng, timeout_s=30)
    assert inst.engine == engine_text
    inst.pause()
    inst.after_update()
    inst.resume()
    assert all(m.post_loads == 1 for m in eng.models)  # MLA w_kc/w_vc recomputed by the model's own hook


def test_bench_receiver_sglang_takes_one_gpu_one_instance_scenarios_only():
    from weightsync.bench.run import run

    with pytest.raises(ConfigError, match="receiver sglang runs one-GPU one-instance scenarios"):
        run("sep-1to1", "tiny-qwen3", steps=1, device="cpu", receiver="sglang", baselines=())
    with pytest.raises(ConfigError, match="faithful, vllm or sglang"):
        run("colo-1gpu", "tiny-qwen3", steps=1, device="cpu", receiver="tgi", baselines=())


class TokenizerManager0514(TokenizerManager):
    """0.5.14's tokenizer manager: no update_weight_version (its HTTP route sets server_args.weight_version)."""

    update_weight_version = None

    def __init__(self, engine):
        super().__init__(engine)
        self.server_args = types.SimpleNamespace(weight_version="default")


class StandInEngine0514(StandInEngine):
    """The 0.5.14 contract (docs/sglang.md §0.2): no weight-update session, no get_model_info; the model runner
    calls the custom loader at once (model_executor/model_runner.py:ModelRunner.update_weights_from_tensor)."""

    begin_weight_update = end_weight_update = get_model_info = None

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.tokenizer_manager = TokenizerManager0514(self)
        self.session = True  # the parent's update_weights_from_tensor wants a weight-update session; 0.5.14 has none


def test_sglang_0514_api_has_no_session_and_keeps_the_version_in_server_args(tmp_path, fake_sglang):
    spec, layout, base = engine_for(tmp_path, "tiny-qwen3", "sglang:tp=2")
    eng = StandInEngine0514(str(tmp_path), base.models)
    inst = S.SGLangInstance(eng, timeout_s=30)
    try:
        assert inst.api == S.API_PLAIN
        eng.log.clear()
        canonical = random_canonical(spec, seed=5)
        inst.pause()
        assert inst.call(write_canonical, canonical, preset("tiny-qwen3"), inst.engine) == [0, 1]
        inst.after_update()  # the stand-in Model has post_load_weights: one more call, no session around it
        inst.resume()
        inst.set_version(4)
        assert eng.log == [("pause", "retract"), ("flush",), ("continue",)]
        assert inst.served_version == "4" == eng.tokenizer_manager.server_args.weight_version
        assert set(inst.last_timing) >= {"pause", "calls", "flush", "continue"}
        _exact(layout, eng, canonical)
    finally:
        inst.close()


@pytest.mark.parametrize("api", ["0.5.23", "0.5.14"])
def test_a_failed_non_staged_update_withholds_the_engine_until_the_next_good_update(tmp_path, fake_sglang, api):
    """Issue 25: after a failed non-staged update the weights may mix two steps: generation stays paused (no
    continue_generation) and generate is refused, until the next good update's set_version lifts it."""
    from weightsync.runtime.reader import WeightReader

    spec, layout, eng = engine_for(tmp_path, "tiny-qwen3", "sglang:tp=2")
    if api == "0.5.14":
        eng = StandInEngine0514(str(tmp_path), eng.models)
    inst = S.SGLangInstance(eng, timeout_s=30)
    try:
        assert eng.generate("a")["text"] == "out:a"
        eng.log.clear()
        inst.pause()
        with pytest.raises(ValueError, match="torn"):  # rank 1 fails part-way through the step
            inst.call(fail_on, 1, "torn")
        reader = types.SimpleNamespace(instance=inst)
        WeightReader._withhold(reader, "instance x: update(2) failed part-way")  # what WeightReader.update does
        inst.resume()
        assert ("continue",) not in eng.log and inst.withheld
        assert eng.tokenizer_manager.is_pause
        with pytest.raises(InstanceError, match=r"serves nothing: instance x: update\(2\) failed part-way"):
            eng.generate("b")
        # the next good update: generation comes back only at set_version
        canonical = random_canonical(spec, seed=3)
        inst.pause()
        assert inst.call(write_canonical, canonical, preset("tiny-qwen3"), inst.engine) == [0, 1]
        inst.after_update()
        inst.resume()
        assert ("continue",) not in eng.log
        with pytest.raises(InstanceError, match="serves nothing"):
            eng.generate("c")
        inst.set_version(3)
        assert eng.log.count(("continue",)) == 1 and inst.withheld is None and inst.served_version == "3"
        assert "generate_request" not in vars(eng.tokenizer_manager)
        assert eng.generate("d")["text"] == "out:d"
        _exact(layout, eng, canonical)
    finally:
        inst.close()


@pytest.mark.parametrize("timeout_s", [0.5, 1.0])
def test_a_timed_out_call_raises_worker_timeout_naming_the_call_and_its_deadline_within_2t(tmp_path, fake_sglang,
                                                                                         timeout_s):
    import time

    from weightsync.runtime.worker import call_timeout

    _, _, eng = engine_for(tmp_path, "tiny-qwen3", "sglang:tp=1")
    inst = S.SGLangInstance(eng, timeout_s=30)
    eng.gate = threading.Event()
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeout) as e:
            inst.call(rank_and_count, 1, timeout_s=timeout_s)
        took = time.monotonic() - t0
        deadline = call_timeout(timeout_s)
        assert timeout_s < deadline <= 2 * timeout_s and deadline <= took < 2 * timeout_s, (deadline, took)
        assert "rank_and_count" in str(e.value) and f"{deadline:g} s deadline" in str(e.value), str(e.value)
    finally:
        eng.gate.set()
        inst._inflight.join(10)
        inst.close()


# -- fewer round trips a step (issue 22 item 3) -------------------------------------------------------


def test_a_call_carried_in_the_name_crosses_sglangs_unpickler_without_a_descriptor_and_is_authenticated(monkeypatch):
    """The message in the tensor's name beside an empty tensor: ForkingPickler pickles no shared-memory descriptor
    for it (no DupFd, no resource-sharer connection), SGLang's unpickler admits it, the worker authenticates it;
    a changed byte in the name is refused before anything is unpickled."""
    from weightsync.runtime import wire

    d, key = wire.new_key_dir()
    try:
        msg = S.RpcMessage("inst", d, 4, rank_and_count, ("a", torch.arange(3, dtype=torch.bfloat16)))
        named = S.rpc_payload(msg, key, in_name=True)
        buf = io.BytesIO()
        ForkingPickler(buf).dump(named)
        blob = buf.getvalue()
        assert b"DupFd" not in blob and b"rebuild_storage_fd" not in blob and b"rebuild_storage_empty" in blob
        got = S.read_payload(RestrictedUnpickler(io.BytesIO(blob)).load())
        assert (got.instance, got.seq, got.fn, got.args[0]) == ("inst", 4, rank_and_count, "a")
        assert torch.equal(got.args[1], torch.arange(3, dtype=torch.bfloat16))
        name = named[0][0]
        i = len(name) // 2
        forged = name[:i] + ("A" if name[i] != "A" else "B") + name[i + 1:]
        with pytest.raises(wire.WireError):
            S.read_payload([(forged, named[0][1])])
        # rpc_loader: a forged name is logged and not answered; the real one is answered
        model = Model({"a.weight": torch.randn(3, 2)})
        monkeypatch.setattr(S, "_tp_rank", lambda: 0)
        assert S.rpc_loader(model, [(forged, torch.empty(0, dtype=torch.uint8))]) is None
        assert not os.path.exists(f"{d}/4.0")
        assert S.rpc_loader(model, _sglang_delivery(named)) is None
        assert wire.read_answer(f"{d}/4.0") == S.RpcAnswer(True, (0, 1, "a"))
    finally:
        shutil.rmtree(d)


class SchedulerStandIn:
    """0.5.14's ``SchedulerWeightUpdaterManager`` of one TP rank: ``update_weights_from_tensor`` runs the worker's
    custom loader; its ``flush_cache(empty_cache)`` (the scheduler's) flushes only when ``is_fully_idle()``, else
    answers False; ``scheduler.forward_ct`` counts the batches run (``Scheduler.run_batch``)."""

    def __init__(self, engine, rank):
        self.engine, self.rank, self.idle, self.forward_ct = engine, rank, True, 0
        self.scheduler = self
        self.server_args = types.SimpleNamespace(enable_hierarchical_cache=False)

    def is_fully_idle(self):
        return self.idle

    def flush_cache(self, empty_cache=True):
        self.engine.log.append(("scheduler flush", self.rank, self.idle, empty_cache))
        return self.idle

    def update_weights_from_tensor(self, model, named):
        S.rpc_loader(model, named)


class TokenizerManagerQuiet(TokenizerManager0514):
    """0.5.14's tokenizer manager with its request table and its waiting flush (FlushCacheReqInput.timeout_s)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.rid_to_state = {}

    async def flush_cache(self, timeout_s=None):
        self.engine.log.append(("flush waiting", timeout_s))
        return Flush(True)


class StandInEngineQuiet(StandInEngine0514):
    """0.5.14 with the scheduler between the engine and the loader, and the name-carried payload admitted."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.tokenizer_manager = TokenizerManagerQuiet(self)
        self.schedulers = [SchedulerStandIn(self, r) for r in range(len(self.models))]

    def run_batch(self):
        """A batch runs on every rank (generation between updates): KV enters the radix cache."""
        for sch in self.schedulers:
            sch.forward_ct += 1

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        assert load_format == S.RPC_LOADER and flush_cache is False
        self.log.append(("update", len(named_tensors[0][1])))
        for rank, model in enumerate(self.models):
            S._tp_rank = lambda rank=rank: rank  # noqa: B023
            buf = io.BytesIO()
            ForkingPickler(buf).dump(named_tensors)
            self.schedulers[rank].update_weights_from_tensor(model, RestrictedUnpickler(io.BytesIO(buf.getvalue())).load())
        return True, "Success"


def _quiet(tmp_path, monkeypatch, **kw):
    spec, layout, base = engine_for(tmp_path, "tiny-qwen3", "sglang:tp=2")
    monkeypatch.setattr(S, "name_payload_admitted", lambda: True)
    eng = StandInEngineQuiet(str(tmp_path), base.models)
    return spec, layout, eng, S.SGLangInstance(eng, timeout_s=30, **kw)


def _exact(layout, eng, canonical):
    for r, m in enumerate(eng.models):
        want = scatter(layout.layout(r), canonical)
        for n, t in m.named_parameters():
            assert torch.equal(t.isnan(), want[n].isnan()) and torch.equal(t.nan_to_num(), want[n].nan_to_num()), n


def test_a_quiet_update_neither_pauses_nor_continues_and_flushes_inside_its_calls(tmp_path, fake_sglang, monkeypatch):
    """Nothing in flight (the tokenizer manager's rid_to_state empty): no pause_generation, no flush_cache and no
    continue_generation round trips; a call of the update flushes every rank's cache in its own request (the
    scheduler's own flush_cache, found on the loader's call stack) unless no batch ran on that rank since its last
    flush; bit-exact; the payload rides in the name (empty tensor)."""
    spec, layout, eng, inst = _quiet(tmp_path, monkeypatch, empty_cache_on_resume=False)
    try:
        eng.log.clear()
        canonical = random_canonical(spec, seed=5)
        inst.pause()
        assert inst.call(write_canonical, canonical, preset("tiny-qwen3"), inst.engine) == [0, 1]
        inst.after_update()  # post_load_weights: one more call; nothing ran since the flush: no second flush
        inst.resume()
        inst.set_version(2)
        assert inst.last_quiet and inst.served_version == "2"
        assert eng.log == [("update", 0), ("scheduler flush", 0, True, False), ("scheduler flush", 1, True, False),
                           ("update", 0)]
        _exact(layout, eng, canonical)
        # outside an update a call does not flush
        eng.log.clear()
        assert inst.call(rank_and_count) == [(0, len(layout.layout(0).tensors), None),
                                             (1, len(layout.layout(1).tensors), None)]
        assert eng.log == [("update", 0)]
        # the next update with no generation in between: nothing to flush; after a batch ran: flushed again
        eng.log.clear()
        for ran in (False, True):
            if ran:
                eng.run_batch()
            inst.pause()
            inst.call(write_canonical, canonical, preset("tiny-qwen3"), inst.engine)
            inst.resume()
        assert eng.log == [("update", 0), ("update", 0), ("scheduler flush", 0, True, False),
                           ("scheduler flush", 1, True, False)]
    finally:
        inst.close()


def test_a_quiet_update_whose_scheduler_was_not_idle_flushes_after_waiting(tmp_path, fake_sglang, monkeypatch):
    spec, layout, eng, inst = _quiet(tmp_path, monkeypatch)
    try:
        for sch in eng.schedulers:  # the overlap scheduler still holds the last finished request's batch
            sch.idle = False
        eng.log.clear()
        inst.pause()
        inst.call(write_canonical, random_canonical(spec, seed=6), preset("tiny-qwen3"), inst.engine)
        inst.resume()
        assert eng.log == [("update", 0), ("scheduler flush", 0, False, True), ("scheduler flush", 1, False, True),
                           ("flush waiting", 30.0)]
    finally:
        inst.close()


@pytest.mark.parametrize("why", ["a request in flight", "quiet_updates=False"])
def test_an_update_with_a_request_in_flight_pauses_flushes_and_continues(tmp_path, fake_sglang, monkeypatch, why):
    spec, layout, eng, inst = _quiet(tmp_path, monkeypatch, quiet_updates=why != "quiet_updates=False")
    try:
        if why == "a request in flight":
            eng.tokenizer_manager.rid_to_state["r1"] = object()
        eng.log.clear()
        inst.pause()
        inst.call(write_canonical, random_canonical(spec, seed=7), preset("tiny-qwen3"), inst.engine)
        inst.resume()
        assert not inst.last_quiet
        assert eng.log == [("pause", "retract"), ("update", 0), ("flush",), ("continue",)]
    finally:
        inst.close()


def test_a_failed_quiet_update_withholds_until_the_next_good_update(tmp_path, fake_sglang, monkeypatch):
    from weightsync.runtime.reader import WeightReader

    spec, layout, eng, inst = _quiet(tmp_path, monkeypatch)
    try:
        inst.pause()
        with pytest.raises(ValueError, match="torn"):
            inst.call(fail_on, 1, "torn")
        WeightReader._withhold(types.SimpleNamespace(instance=inst), "instance x: update(2) failed part-way")
        eng.log.clear()
        inst.resume()
        assert eng.log == [("flush waiting", 30.0)] and inst.withheld  # the failed call did not flush
        with pytest.raises(InstanceError, match="serves nothing"):
            eng.generate("b")
        canonical = random_canonical(spec, seed=8)
        inst.pause()
        assert inst.last_quiet  # nothing in flight: generate was refused before it reached the engine
        inst.call(write_canonical, canonical, preset("tiny-qwen3"), inst.engine)
        inst.resume()
        with pytest.raises(InstanceError, match="serves nothing"):
            eng.generate("c")
        inst.set_version(3)
        assert eng.generate("d")["text"] == "out:d" and inst.withheld is None
        assert ("pause", "retract") not in eng.log and ("continue",) not in eng.log
        _exact(layout, eng, canonical)
    finally:
        inst.close()


# -- the call mailbox (weightsync.sglang.mailbox): a quiet update's calls without SGLang's request path ----------------


class RWLock:
    """SGLang 0.5.14's ``utils/aio_rwlock.py:RWLock`` (the tokenizer manager's ``model_update_lock``), the same logic:
    readers wait while a writer holds or waits; a writer waits for the readers to leave."""

    def __init__(self):
        self._lock = asyncio.Lock()
        self._cond = asyncio.Condition(self._lock)
        self._readers = 0
        self._writer_active = False
        self._waiting_writers = 0

    async def acquire_reader(self):
        async with self._lock:
            while self._writer_active or self._waiting_writers > 0:
                await self._cond.wait()
            self._readers += 1

    async def release_reader(self):
        async with self._lock:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    async def acquire_writer(self):
        async with self._lock:
            self._waiting_writers += 1
            try:
                while self._writer_active or self._readers > 0:
                    await self._cond.wait()
                self._writer_active = True
            finally:
                self._waiting_writers -= 1

    async def release_writer(self):
        async with self._lock:
            self._writer_active = False
            self._cond.notify_all()

    async def is_locked(self):
        async with self._lock:
            return self._writer_active or self._readers > 0


_RANK = threading.local()  # each stand-in scheduler thread's TP rank (SGLang: its process's)


class LoopScheduler:
    """SGLang 0.5.14's ``Scheduler`` of one TP rank, with its own thread running its event loop
    (``scheduler.py:Scheduler.event_loop_normal``): each iteration receives requests and hands them to
    ``process_input_requests`` (an ``update_weights_from_tensor`` request runs the custom loader there, in this
    thread), then runs a batch if one is queued (``run_batch``: ``forward_ct`` += 1, reading every weight) or idles
    (``on_idle``). ``flush_cache`` flushes only when ``is_fully_idle()``. Its weight updater is
    :class:`SchedulerStandIn`-like: ``self.updater.update_weights_from_tensor`` is the frame the loader finds."""

    def __init__(self, engine, rank, model):
        self.engine, self.rank, self.model = engine, rank, model
        self.forward_ct = 0
        self.server_args = types.SimpleNamespace(enable_hierarchical_cache=False)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # requests (SGLang: its ZeroMQ socket); thread-safe
        self.queued_batches = 0
        self.stale_batch = False  # the overlap scheduler's last batch of a request that already finished
        self.iterations = 0
        self.flush_threads: list[int] = []
        self.flush_at: list[float] = []  # time.monotonic() of each flush
        self.stuck = threading.Event()  # set: the loop hangs (never reaches process_input_requests)
        self.stopped = False
        self.updater = types.SimpleNamespace(scheduler=self, flush_cache=self.flush_cache,
                                             is_fully_idle=self.is_fully_idle)
        self.thread = threading.Thread(target=self.event_loop, daemon=True, name=f"stand-in-scheduler-{rank}")
        self.thread.start()

    def event_loop(self):
        _RANK.rank = self.rank
        while not self.stopped:
            while self.stuck.is_set() and not self.stopped:
                time.sleep(0.01)
            recv = []
            while not self.inbox.empty():
                recv.append(self.inbox.get_nowait())
            self.process_input_requests(recv)
            self.iterations += 1
            if self.queued_batches:
                self.run_batch()
            elif self.stale_batch:
                self.stale_batch = False  # processed now: fully idle from the next iteration on
            else:
                self.on_idle()

    def process_input_requests(self, recv_reqs):
        for req in recv_reqs:
            req()

    def on_idle(self):
        """0.5.14 ``Scheduler.on_idle``: the idle housekeeping (SGLang's is Python checks holding the GIL)."""
        time.sleep(0.0002)  # SGLang spins here; a short sleep spares this shared machine

    def run_batch(self):
        self.queued_batches -= 1
        self.forward_ct += 1
        with torch.no_grad():
            sum(float(p.float().nan_to_num().sum()) for _, p in self.model.named_parameters())

    def is_fully_idle(self):
        return not self.queued_batches and not self.stale_batch

    def flush_cache(self, empty_cache=True):
        idle = self.is_fully_idle()
        self.engine.log.append(("scheduler flush", self.rank, idle, empty_cache))
        self.flush_threads.append(threading.get_ident())
        self.flush_at.append(time.monotonic())
        return idle

    def update_weights_from_tensor(self, named):
        """``SchedulerWeightUpdaterManager.update_weights_from_tensor``: the worker's custom loader, then (here) no
        flush (``flush_cache=False``)."""
        SchedulerWeightUpdater(self).update_weights_from_tensor(self.model, named)


class SchedulerWeightUpdater:
    """``SchedulerWeightUpdaterManager``: holds the scheduler's ``flush_cache``/``is_fully_idle`` and ``scheduler``
    (``scheduler.py:1661``); its ``update_weights_from_tensor`` frame is where the loader finds them."""

    def __init__(self, scheduler):
        self.scheduler, self.flush_cache, self.is_fully_idle = scheduler, scheduler.flush_cache, scheduler.is_fully_idle

    def update_weights_from_tensor(self, model, named):
        S.rpc_loader(model, named)


class TokenizerManagerLocked(TokenizerManagerQuiet):
    """0.5.14's tokenizer manager with its model-update lock (``tokenizer_manager.py:init_weight_update``); a generate
    request holds the reader lock for its whole life and runs one batch on every rank."""

    def __init__(self, engine):
        super().__init__(engine)
        self.model_update_lock = RWLock()

    async def generate_request(self, obj, request=None):
        while getattr(self, "is_pause", False):
            await asyncio.sleep(0.01)
        async with _Reader(self.model_update_lock):
            self.rid_to_state[obj] = object()
            try:
                self.engine.run_batch()
                yield {"text": f"out:{obj}", "weight_version": self.engine.version}
            finally:
                del self.rid_to_state[obj]


class _Reader:
    def __init__(self, lock):
        self.lock = lock

    async def __aenter__(self):
        await self.lock.acquire_reader()

    async def __aexit__(self, *exc):
        await self.lock.release_reader()


class StandInEngineLooping(StandInEngine0514):
    """0.5.14 with one looping scheduler thread per TP rank: ``update_weights_from_tensor`` hands the payload to each
    scheduler's loop (as ZeroMQ does) and waits for every rank (the scheduler's TP barrier)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.tokenizer_manager = TokenizerManagerLocked(self)
        self.schedulers = [LoopScheduler(self, r, m) for r, m in enumerate(self.models)]

    def run_batch(self, wait_s=10.0):
        for sch in self.schedulers:
            sch.queued_batches += 1
        deadline = time.monotonic() + wait_s
        while any(s.queued_batches for s in self.schedulers) and time.monotonic() < deadline:
            time.sleep(0.001)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        assert load_format == S.RPC_LOADER and flush_cache is False
        self.log.append(("update", len(named_tensors[0][1])))
        done = []
        for sch in self.schedulers:
            buf = io.BytesIO()
            ForkingPickler(buf).dump(named_tensors)
            named = RestrictedUnpickler(io.BytesIO(buf.getvalue())).load()
            ev = threading.Event()
            sch.inbox.put(lambda sch=sch, named=named, ev=ev: (sch.update_weights_from_tensor(named), ev.set()))
            done.append(ev)
        for ev in done:
            assert ev.wait(30), "a stand-in scheduler did not run the request"
        return True, "Success"

    def shutdown(self):
        for sch in self.schedulers:
            sch.stopped = True
            sch.stuck.clear()
        for sch in self.schedulers:
            sch.thread.join(5)


@pytest.fixture
def looping(tmp_path, fake_sglang, monkeypatch):
    """An instance on the looping stand-in (tp=2), its mailbox up; closed and the scheduler threads ended after."""
    spec, layout, base = engine_for(tmp_path, "tiny-qwen3", "sglang:tp=2")
    monkeypatch.setattr(S, "name_payload_admitted", lambda: True)
    monkeypatch.setattr(S, "_tp_rank", lambda: _RANK.rank)
    made = []

    def make(**kw):
        eng = StandInEngineLooping(str(tmp_path), base.models)
        made.append(eng)
        inst = S.SGLangInstance(eng, timeout_s=kw.pop("timeout_s", 30), **kw)
        made.append(inst)
        return spec, layout, eng, inst

    yield make
    for obj in reversed(made):
        if isinstance(obj, S.SGLangInstance):
            obj.close()
        else:
            obj.shutdown()


_SEEN: dict = {}  # what the worker-side test functions saw (same process: the stand-in's "workers")


def writer_lock_held(ctx):
    """On the mailbox thread: SGLang's model-update writer lock is held and no scheduler thread is running this."""
    from weightsync.sglang.mailbox import current_gate

    gate, rank = current_gate()
    _SEEN.setdefault("lock", []).append(_SEEN["engine"].tokenizer_manager.model_update_lock._writer_active)
    _SEEN.setdefault("threads", []).append(threading.current_thread().name)
    return rank


def steps_aside(ctx):
    """On the mailbox thread: the scheduler thread comes to wait in its gate while this call runs, and its loop does
    not turn meanwhile."""
    from weightsync.sglang.mailbox import current_gate

    gate, rank = current_gate()
    deadline = time.monotonic() + 10
    while gate.parks < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    sch = gate.scheduler
    before = sch.iterations
    time.sleep(0.1)
    return gate.parks, sch.iterations - before


def posts_then_copies(ctx, seconds):
    """On the mailbox thread, shaped like a receive: its transport says the copies are posted, then they run
    (``seconds`` asleep, the GIL released); returns when they ended."""
    from weightsync.transport.posted import posted

    posted()
    time.sleep(seconds)
    return time.monotonic()


def posts_then_raises(ctx):
    from weightsync.transport.posted import posted

    posted()
    raise RuntimeError("the copies failed")


def hang(ctx, key):
    _SEEN[key].wait(30)
    return ctx.rank


def _update(inst, spec, seed, *extra):
    canonical = random_canonical(spec, seed=seed)
    inst.pause()
    out = inst.call(write_canonical, canonical, preset("tiny-qwen3"), inst.engine)
    for fn in extra:
        out = inst.call(fn)
    inst.after_update()
    inst.resume()
    return canonical, out


@pytest.mark.parametrize("in_place", [True, False], ids=["lock-in-place", "lock-through-loop"])
def test_a_mailbox_update_sends_no_sglang_request_holds_the_writer_lock_and_lands_bit_exact(looping, in_place):
    """Set-up: two requests through update_weights_from_tensor (the probe, then serve_mailbox). Each quiet update after
    it: no update_weights_from_tensor at all (no pause/flush/continue either), every call on the mailbox threads with
    SGLang's model-update writer lock held, released after; the first update flushes both ranks' caches from the
    scheduler threads themselves; the weights bit-exact."""
    spec, layout, eng, inst = looping()
    inst.lock_in_place = in_place
    _SEEN.clear()
    _SEEN["engine"] = eng
    assert inst.mailbox and inst.trips == 2 and eng.log.count(("update", 0)) == 2
    eng.log.clear()
    canonical, ranks = _update(inst, spec, 21, writer_lock_held)
    inst.set_version(1)
    assert ranks == [0, 1] and inst.last_quiet and inst.last_mailbox and inst.trips == 2
    assert ("update", 0) not in eng.log and ("pause", "retract") not in eng.log and ("continue",) not in eng.log
    assert sorted(eng.log) == [("scheduler flush", 0, True, True), ("scheduler flush", 1, True, True)]
    assert [s.flush_threads for s in eng.schedulers] == [[s.thread.ident] for s in eng.schedulers]
    assert _SEEN["lock"] == [True, True] and all(n.startswith("weightsync-sglang-mailbox") for n in _SEEN["threads"])
    tm = eng.tokenizer_manager
    assert not eng.loop.run_until_complete(tm.model_update_lock.is_locked())
    assert {"lock", "mailbox", "unlock"} <= set(inst.last_timing) and "calls" not in inst.last_timing
    # the handler's phases (the slowest rank's), inside the handler's time
    phases = [inst.last_timing[f"mailbox_{n}"] for n in ("decode", "context", "run")]
    assert all(0 < t <= inst.last_timing["mailbox_handler"] for t in phases), inst.last_timing
    assert inst.served_version == "1" and inst.last_call is not None
    _exact(layout, eng, canonical)
    # generation between updates still works (the reader lock is free again), and calls outside an update take
    # SGLang's path
    assert eng.generate("g")["text"] == "out:g"
    assert inst.call(rank_and_count, "x")[1][2] == "x" and inst.trips == 3


def test_the_writer_lock_is_taken_in_place_only_where_acquire_writer_would_not_wait():
    """``take_writer_in_place``/``release_writer_in_place`` against 0.5.14's RWLock logic: taken with the loop idle
    and nobody at the lock; refused with a request in flight or a reader in; undecided (None) on a running loop; a
    reader that began waiting meanwhile is released through the loop (it must be woken), and then gets in."""
    loop = asyncio.new_event_loop()
    try:
        tm = types.SimpleNamespace(model_update_lock=RWLock(), rid_to_state={})
        lock = tm.model_update_lock
        assert S.take_writer_in_place(tm, loop) is True and lock._writer_active
        assert S.take_writer_in_place(tm, loop) is False  # held: a second writer would wait
        assert S.release_writer_in_place(lock, loop) and not lock._writer_active
        tm.rid_to_state["r"] = object()
        assert S.take_writer_in_place(tm, loop) is False and not lock._writer_active
        del tm.rid_to_state["r"]
        loop.run_until_complete(lock.acquire_reader())
        assert S.take_writer_in_place(tm, loop) is False
        loop.run_until_complete(lock.release_reader())

        async def inside():
            return S.take_writer_in_place(tm, loop), S.release_writer_in_place(lock, loop)

        assert loop.run_until_complete(inside()) == (None, False)
        assert S.take_writer_in_place(tm, loop) is True
        reader = loop.create_task(lock.acquire_reader())
        loop.run_until_complete(asyncio.sleep(0.01))  # the request reached the lock and waits on its condition
        assert not reader.done() and not S.release_writer_in_place(lock, loop) and lock._writer_active
        loop.run_until_complete(lock.release_writer())
        loop.run_until_complete(asyncio.wait_for(reader, 5))
        assert lock._readers == 1 and not lock._writer_active
    finally:
        loop.close()


def test_the_idle_housekeeping_is_skipped_while_a_call_is_coming_and_restored_after():
    """The gate wraps the scheduler's ``on_idle``: with a call waiting in (or running from) a mailbox the scheduler
    skips that iteration's housekeeping and goes straight on to the gate; otherwise SGLang's own runs; removing the
    last mailbox gives the scheduler its methods back."""
    from weightsync.sglang.mailbox import SchedulerGate

    class Server:
        alive, active, waiting = True, False, False

        def pending(self):
            return self.waiting

        def stop(self):
            self.alive = False

    class Scheduler:
        forward_ct = 0
        runs = 0

        def process_input_requests(self, reqs):
            return None

        def is_fully_idle(self):
            return True

        def flush_cache(self, empty_cache=True):
            return True

        def on_idle(self):
            self.runs += 1

    sched, server = Scheduler(), Server()
    gate = SchedulerGate.of(sched)
    gate.add("/nowhere", server)
    sched.on_idle()
    assert sched.runs == 1 and gate.skipped_idle == 0
    server.waiting = True  # a call's bytes wait in the pipe
    sched.on_idle()
    server.waiting, server.active = False, True  # the call runs
    sched.on_idle()
    assert sched.runs == 1 and gate.skipped_idle == 2
    server.active = False
    sched.on_idle()
    assert sched.runs == 2
    gate.remove(None)
    assert "on_idle" not in vars(sched) and "process_input_requests" not in vars(sched)
    sched.on_idle()
    assert sched.runs == 3


def test_the_flush_runs_only_when_a_batch_ran_since_the_last_one(looping):
    spec, layout, eng, inst = looping(empty_cache_on_resume=False)
    _update(inst, spec, 1)  # the first update flushes (nothing recorded yet)
    eng.log.clear()
    _update(inst, spec, 2)  # no batch since: nothing to flush
    assert eng.log == [] and inst.last_timing["flush_in_calls"] == 0.0
    eng.generate("between")  # one batch on every rank (forward_ct moves)
    eng.log.clear()
    canonical, _ = _update(inst, spec, 3)
    assert sorted(eng.log) == [("scheduler flush", 0, True, False), ("scheduler flush", 1, True, False)]
    assert [len(s.flush_threads) for s in eng.schedulers] == [2, 2]
    assert all(set(s.flush_threads) == {s.thread.ident} for s in eng.schedulers)
    assert ("update", 0) not in eng.log
    _exact(layout, eng, canonical)
    # a stale batch still in the overlap scheduler: the flush waits an iteration for idle, still on the scheduler's
    # own thread
    eng.generate("again")
    for sch in eng.schedulers:
        sch.stale_batch = True
    eng.log.clear()
    _update(inst, spec, 4)
    assert sorted(eng.log) == [("scheduler flush", 0, True, False), ("scheduler flush", 1, True, False)]


def test_the_flush_runs_beside_the_posted_copies_and_the_answer_waits_for_it(looping):
    """A batch ran since the last flush: the call whose transport posts its copies has the scheduler threads flush
    while they run (before the call's work ended), and the call waits for nothing more; a call that raises after
    its posting withdraws an order not yet run."""
    spec, layout, eng, inst = looping(empty_cache_on_resume=False)
    _update(inst, spec, 1)
    eng.generate("between")
    inst.pause()
    try:
        ended = inst.call(posts_then_copies, 0.3)
        timing = dict(inst.last_timing)
        canonical = random_canonical(spec, seed=2)
        inst.call(write_canonical, canonical, preset("tiny-qwen3"), inst.engine)  # nothing more to flush
    finally:
        inst.resume()
    assert [len(s.flush_at) for s in eng.schedulers] == [2, 2]
    assert all(s.flush_at[-1] < end for s, end in zip(eng.schedulers, ended)), ([s.flush_at for s in eng.schedulers],
                                                                               ended)
    assert all(set(s.flush_threads) == {s.thread.ident} for s in eng.schedulers)
    assert timing["flush_waited"] < 0.1 and 0 < timing["flush_in_calls"], timing
    _exact(layout, eng, canonical)
    eng.generate("again")
    gates = [sch.__dict__["_weightsync_gate"] for sch in eng.schedulers]
    for sch in eng.schedulers:
        sch.stuck.set()  # the loops do not come round: an order stays unrun
    inst.pause()
    try:
        with pytest.raises(RuntimeError, match="the copies failed"):
            inst.call(posts_then_raises)
        assert [g._flush for g in gates] == [None, None]  # withdrawn
    finally:
        for sch in eng.schedulers:
            sch.stuck.clear()
        inst.resume()


@pytest.mark.parametrize("posts", [True, False], ids=["checked-beside-the-copies", "checked-after-the-call"])
def test_a_parameter_sglang_replaced_fails_the_mailbox_call_before_its_answer(looping, posts):
    """The per-call binding check runs once the call's copies are posted (or after a call that posts none), never
    later than the answer: a parameter replaced on one rank since the binding fails the call with WeightsMoved
    naming it, and the reader would withhold the engine."""
    spec, layout, eng, inst = looping()
    _update(inst, spec, 1)
    name = next(iter(eng.models[1]._p))
    eng.models[1]._p[name] = torch.nn.Parameter(eng.models[1]._p[name].detach().clone(), requires_grad=False)
    inst.pause()
    try:
        with pytest.raises(WeightsMoved, match=re.escape(name)):
            inst.call(posts_then_copies, 0.05) if posts else inst.call(rank_and_count, "x")
    finally:
        inst.resume()


def gated_write(ctx, canonical, cfg, engine):
    """On the mailbox thread, shaped like a receive sent before its step was written: set-up, the go
    (``ready()``), then the copies (``write_canonical``), posted; returns when it began and when it went on."""
    from weightsync.transport.gate import ready
    from weightsync.transport.posted import posted

    began = time.time()
    ready()
    went = time.time()
    write_canonical(ctx, canonical, cfg, engine)
    posted()
    return began, went


def test_a_mailbox_call_sent_early_waits_for_its_gate_and_a_gate_that_raises_calls_it_off(looping):
    """``call_when`` (a co-located reader's step, sent before the trainers' `written`: weightsync.transport.gate):
    each scheduler's mailbox thread runs the call at once and copies only after the gate returned, the gate's time
    out of the call's (``mailbox_gated``); the update lands bit-exact and flushes as any. A gate that raises calls
    the step off on every rank before its first copy: the call raises the gate's own error, the weights are those
    of the update before, and the next update goes through the mailbox as ever."""
    spec, layout, eng, inst = looping()
    canonical, _ = _update(inst, spec, 31)
    nxt = random_canonical(spec, seed=32)
    ended = []

    def gate():
        time.sleep(0.3)  # the trainers' write
        ended.append(time.time())

    assert eng.generate("g")["text"] == "out:g"  # a batch ran: the update must flush
    inst.pause()
    eng.log.clear()
    try:
        got = inst.call_when(gate, gated_write, nxt, preset("tiny-qwen3"), inst.engine)
    finally:
        inst.resume()
    assert all(began < ended[0] - 0.1 and went >= ended[0] for began, went in got), (got, ended)
    assert inst.last_timing["mailbox_gated"] >= 0.3 and inst.last_timing["mailbox"] < 0.3, inst.last_timing
    assert sorted(eng.log) == [("scheduler flush", 0, True, True), ("scheduler flush", 1, True, True)]
    _exact(layout, eng, nxt)

    lost = TimeoutError("training rank 0 never announced step 3")

    def never():
        raise lost

    inst.pause()
    try:
        with pytest.raises(TimeoutError) as e:
            inst.call_when(never, gated_write, canonical, preset("tiny-qwen3"), inst.engine)
        assert e.value is lost
    finally:
        inst.resume()
    _exact(layout, eng, nxt)  # nothing of it landed
    again, _ = _update(inst, spec, 33)
    assert inst.last_mailbox
    _exact(layout, eng, again)


def test_the_scheduler_thread_waits_in_its_gate_while_a_call_runs(looping):
    spec, layout, eng, inst = looping()
    inst.pause()
    try:
        got = inst.call(steps_aside)
    finally:
        inst.resume()
    assert [p >= 1 for p, _ in got] == [True, True] and [turned for _, turned in got] == [0, 0], got
    assert eng.generate("after")["text"] == "out:after"  # the loops turn again


@pytest.mark.parametrize("why", ["a request in flight", "a reader holds the lock", "mailbox=False"])
def test_the_old_path_when_a_request_is_in_flight_or_the_mailbox_is_off(looping, why):
    spec, layout, eng, inst = looping(mailbox=why != "mailbox=False")
    assert inst.mailbox == (why != "mailbox=False")
    tm = eng.tokenizer_manager
    if why == "a request in flight":
        tm.rid_to_state["r1"] = object()
    elif why == "a reader holds the lock":  # a request between its reader lock and rid_to_state: quiet, no lock
        eng.loop.run_until_complete(tm.model_update_lock.acquire_reader())
    eng.log.clear()
    canonical, _ = _update(inst, spec, 5)
    assert not inst.last_mailbox and ("update", 0) in eng.log
    if why == "a request in flight":
        assert eng.log[0] == ("pause", "retract") and eng.log[-1] == ("continue",)
    else:
        assert inst.last_quiet and ("pause", "retract") not in eng.log
    assert eng.loop.run_until_complete(tm.model_update_lock.is_locked()) == (why == "a reader holds the lock")
    _exact(layout, eng, canonical)


def test_the_old_path_on_the_session_api():
    """0.5.23's weight-update session: no mailbox is started (the session is SGLang's own way to keep requests out)."""
    inst = S.SGLangInstance.__new__(S.SGLangInstance)
    inst.api, inst.quiet_updates, inst._mailbox = S.API_SESSION, True, None
    inst.sgl = types.SimpleNamespace(tokenizer_manager=types.SimpleNamespace(model_update_lock=RWLock(), rid_to_state={}))
    inst._open_mailbox(1.0)
    assert not inst.mailbox


def test_a_scheduler_whose_mailbox_thread_ended_fails_the_update_at_once_and_the_engine_serves_again(looping):
    from weightsync.errors import WorkerDied

    spec, layout, eng, inst = looping()
    gate = eng.schedulers[1].__dict__["_weightsync_gate"]
    (server,) = gate.servers.values()
    server.stop()
    server.thread.join(5)
    t0 = time.monotonic()
    inst.pause()
    try:
        with pytest.raises(WorkerDied, match="rank 1"):
            inst.call(write_canonical, random_canonical(spec, seed=6), preset("tiny-qwen3"), inst.engine)
    finally:
        inst.resume()
    assert time.monotonic() - t0 < 5
    tm = eng.tokenizer_manager
    assert not eng.loop.run_until_complete(tm.model_update_lock.is_locked())  # released: the engine is not blocked
    with pytest.raises(InstanceError, match="unusable"):
        inst.call(rank_and_count)


def test_a_call_past_its_deadline_raises_worker_timeout_and_nothing_more_is_sent(looping):
    from weightsync.runtime.worker import call_timeout

    spec, layout, eng, inst = looping()
    _SEEN["release"] = threading.Event()
    inst.pause()
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerTimeout, match="hang.*deadline"):
            inst.call(hang, "release", timeout_s=0.5)
        took = time.monotonic() - t0
    finally:
        inst.resume()
        _SEEN["release"].set()
    assert call_timeout(0.5) <= took < 2 * 0.5 + 1.0
    with pytest.raises(InstanceError, match="unusable"):
        inst.pause() or inst.call(rank_and_count)


def test_a_stuck_scheduler_loop_fails_the_flush_within_the_deadline(looping):
    """A batch ran (a flush is due) and rank 1's scheduler loop hangs: rank 1's call answers an error naming it
    within the deadline, the update withholds the engine, and the writer lock is released."""
    from weightsync.runtime.reader import WeightReader

    spec, layout, eng, inst = looping()
    eng.generate("kv")
    eng.schedulers[1].stuck.set()
    time.sleep(0.05)
    inst.pause()
    t0 = time.monotonic()
    try:
        with pytest.raises(InstanceError, match="rank 1: SGLang's scheduler thread did not come round to flush"):
            inst.call(write_canonical, random_canonical(spec, seed=7), preset("tiny-qwen3"), inst.engine,
                      timeout_s=1.0)
        took = time.monotonic() - t0
        WeightReader._withhold(types.SimpleNamespace(instance=inst), "instance x: update(7) failed part-way")
    finally:
        inst.resume()
    assert took < 1.5 + 0.5, took
    eng.schedulers[1].stuck.clear()
    tm = eng.tokenizer_manager
    assert not eng.loop.run_until_complete(tm.model_update_lock.is_locked())
    with pytest.raises(InstanceError, match="serves nothing"):
        eng.generate("b")
    # the next good update flushes rank 1 (a batch ran since its last flush; rank 0 flushed in the failed update and
    # ran nothing since) and serves again
    eng.log.clear()
    canonical, _ = _update(inst, spec, 8)
    inst.set_version(8)
    assert inst.last_mailbox and eng.log == [("scheduler flush", 1, True, True)]
    assert eng.generate("c")["text"] == "out:c"
    _exact(layout, eng, canonical)


def test_a_forged_a_replayed_or_a_misdirected_message_is_refused_and_runs_nothing(looping, tmp_path):
    from weightsync.runtime import wire

    spec, layout, eng, inst = looping()
    box = inst._mailbox
    marker = tmp_path / "ran"

    def answers(blob):
        return [pickle.loads(a) for a in box.call([blob, blob], 10)]

    forged = wire.encode(b"x" * 32, inst._id, inst._dir, 10_000, touch, (str(marker),))
    other_dir, other_key = wire.new_key_dir()
    try:
        misdirected = wire.encode(other_key, inst._id, other_dir, 10_001, touch, (str(marker),))
        replayed = wire.encode(inst._key, inst._id, inst._dir, 1, touch, (str(marker),))
        for blob, why in ((forged, "bad MAC"), (misdirected, "arrived in the mailbox of"), (replayed, "replayed"),
                          (b"not a message", "bad magic")):
            got = answers(blob)
            assert [a.ok for a in got] == [False, False] and all(why in a.error[2] for a in got), (why, got)
    finally:
        shutil.rmtree(other_dir)
    assert not marker.exists()
    # a genuine call still goes through
    good = wire.encode(inst._key, inst._id, inst._dir, 10_002, touch, (str(marker),))
    assert [a.value for a in answers(good)] == [0, 1] and marker.exists()


def touch(ctx, path):
    open(path, "a").close()
    return ctx.rank


# -- weightsync demo --engines real --infer sglang:tp=N: refused before anything starts (the demo itself runs on the
# GPU host: tests/test_gpu_sglang.py::test_demo_real_sglang_*) -----------------------------------------------------


def _real_demo(**kw):
    from weightsync.local.demo_job import DemoConfig

    return DemoConfig(**{"train": "hf", "infer": ("sglang:tp=1",), "engines": "real", **kw})


def test_real_sglang_on_cpu_is_refused_in_one_line():
    from weightsync.local.demo_job import check

    with pytest.raises(ConfigError) as e:
        check(_real_demo())
    assert "SGLang has no CPU build" in str(e.value) and "--device cuda" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is importable here")
def test_real_sglang_without_sglang_names_the_kit():
    from weightsync.local.demo_job import check

    with pytest.raises(ConfigError, match="needs SGLang on a CUDA GPU host.*sglang-gpu-kit"):
        check(_real_demo(device="cuda", colocate=True))


@pytest.mark.parametrize("extra", [{"delta": True}, {"transport": "file", "kill_at": 1}])
def test_real_sglang_refuses_what_its_demo_does_not_run(extra):
    from weightsync.local.demo_job import check

    with pytest.raises(ConfigError, match="not in the real SGLang demo"):
        check(_real_demo(device="cuda", **extra))


def test_only_separated_real_sglang_over_nixl_shares_the_trainers_gpus():
    from weightsync.local.demo_job import shares_gpus

    assert not shares_gpus(_real_demo(device="cuda", colocate=True))
    assert not shares_gpus(_real_demo(device="cuda"))  # p2p: NCCL between two processes needs two GPUs
    assert not shares_gpus(_real_demo(device="cuda", transport="nixl", engines="faithful"))
    assert not shares_gpus(_real_demo(device="cuda", transport="nixl", infer=("vllm:tp=1",)))
    import torch

    if torch.cuda.device_count() < 2:  # one trainer GPU + one engine GPU do not fit here
        assert shares_gpus(_real_demo(device="cuda", transport="nixl"))


# -- WeightReader.validate through SGLang's own loader (opt-in, weightsync.sglang.validate) --------------------------


class ModelRunnerStandIn:
    """0.5.14's ``ModelRunner``: its ``update_weights_from_tensor`` calls the custom loader with the live model."""

    def __init__(self, model):
        self.model, self.model_config, self.load_config, self.gpu_id, self.device = model, object(), object(), 0, "cpu"

    def update_weights_from_tensor(self, named):
        S.rpc_loader(self.model, named)


def test_validate_via_sglangs_loader_compares_every_tensor_with_a_fresh_load_and_names_a_flipped_one(
        tmp_path, fake_sglang, monkeypatch):
    """The plumbing of ``validate_via="sglang-loader"`` (a test aid: SGLang's loader itself runs on the GPU host only):
    ``WeightReader.validate`` dispatches to ``check_sglang`` in every worker, which finds the model runner on the
    loader's call stack and compares every parameter with the model its loader builds from the checkpoint -- here a
    stand-in loader that places the checkpoint by the layout."""
    import weightsync.sglang.validate as V
    from hf_models import save_checkpoint

    from weightsync.validate import validate

    spec, layout, eng, inst = _quiet(tmp_path, monkeypatch, validate_via="sglang-loader")
    for sch, m in zip(eng.schedulers, eng.models):  # the scheduler calls the runner, which calls our loader
        runner = ModelRunnerStandIn(m)
        sch.update_weights_from_tensor = lambda model, named, runner=runner: runner.update_weights_from_tensor(named)
    canonical = random_canonical(spec, seed=9)
    ckpt = save_checkpoint(spec, canonical, tmp_path / "ckpt")

    def fresh_by_layout(runner, checkpoint):
        assert isinstance(runner, ModelRunnerStandIn) and checkpoint == str(ckpt)
        rank = eng.models.index(runner.model)
        tensors = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype])
                   for n, t in layout.layout(rank).tensors.items()}
        fill_from(layout.layout(rank), tensors, canonical)
        return Model(tensors)

    monkeypatch.setattr(V, "load_fresh", fresh_by_layout)
    try:
        inst.pause()
        inst.call(write_canonical, canonical, preset("tiny-qwen3"), inst.engine)
        inst.resume()
        report = validate(inst, ckpt)
        assert report.via == "sglang-loader" and report.ok
        assert len(report.checks) == sum(len(layout.layout(r).tensors) for r in range(2))
        name = next(iter(eng.models[1]._p))
        eng.models[1]._p[name].data.view(-1)[0] += 1
        bad = validate(inst, ckpt)
        assert not bad.ok and [(c.rank, c.name) for c in bad.mismatched()] == [(1, f"param:{name}")]
        # the default stays the layout, labelled
        assert S.SGLangInstance(eng, timeout_s=30).validate_via == "layout"
    finally:
        inst.close()


def test_the_switch_interval_call_sets_and_restores_the_workers_gil_interval(looping):
    """``verify.switch_interval`` (the overhead bench's GIL experiment) travels as a signed call and returns the
    interval it replaced (the stand-in's two schedulers share this process: the second rank sees the first's)."""
    import sys

    from weightsync.sglang.verify import switch_interval

    spec, layout, eng, inst = looping()
    before = sys.getswitchinterval()
    try:
        got = inst.call(switch_interval, 0.001)
        assert len(got) == 2 and before in got and set(got) <= {before, 0.001}, got
        assert sys.getswitchinterval() == 0.001
        assert set(inst.call(switch_interval, None)) == {0.001}
    finally:
        sys.setswitchinterval(before)


# -- SGLang 0.5.14's block-FP8 and MLA forms (docs/sglang.md §7) ------------------------------------------------------
#
# weightsync's classification, landing and re-derivation against STAND-INS of SGLang's model tree
# (tests/sglang_standin.py: the module/parameter structure and the attributes weightsync reads, cited to 0.5.14's
# source; test aids, not evidence that SGLang behaves so). The real engine runs on the GPU host
# (benchmarks/sglang_gpu.py colo --models deepseek,deepseek-fp8; tests/test_gpu_sglang.py). Where SGLang 0.5.14's
# source is at hand (WEIGHTSYNC_SGLANG_SRC naming the unpacked sglang==0.5.14 wheel, WEIGHTSYNC_SGLANG_DEPS a
# `pip install --target` folder with orjson, transformers==5.8.1, tokenizers==0.22.2 and huggingface-hub<2: what it
# imports with), test_against_sglang_0514s_own_functions runs SGLang's own pure-torch functions on CPU in a child
# process (tests/sglang_0514.py) with the module flags an H100 gives them (CUDA, not FNUZ, DeepGEMM's JIT on,
# DEEPGEMM_SCALE_UE8M0 off): its Fp8LinearMethod / Fp8MoEMethod / Fp8KVCacheMethod objects as weightsync classifies
# them and what their process_weights_after_loading leaves, and its DeepseekV2WeightLoaderMixin.post_load_weights (bf16
# and block-FP8 kv_b_proj) against the stand-in's copy and after weightsync's re-derivation.

from pathlib import Path  # noqa: E402
import subprocess  # noqa: E402

from helpers import tiny  # noqa: E402
from sglang_standin import flashinfer_gemm_w8a8_block_fp8_linear_with_fallback, fresh, load, standin  # noqa: E402

from weightsync.sglang.live import CONSTANT, DERIVED, IN_PLACE, classify  # noqa: E402
from weightsync.sglang.verify import checkpoint_form, computed, held_layout, loaded_problems  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = "tiny-deepseek-v3-fp8"
FP8_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _engine(fp8: bool) -> str:
    return "sglang:quant=fp8" if fp8 else "sglang"


def _setup(fp8: bool, seed: int = 0):
    """A stand-in worker (TP=1) of the DeepSeek-V3-shaped preset loaded from the checkpoint of ``seed``."""
    cfg = dict(preset(MODEL))
    held = held_layout(cfg, _engine(fp8))
    ck = checkpoint_form(random_canonical(spec_from_config(cfg), seed=seed), held)
    return cfg, held, ck, fresh(cfg, held.layout(0), ck, fp8)


def _everything(root) -> dict[str, torch.Tensor]:
    return computed(types.SimpleNamespace(state={"model": root}))


# -- what each layer takes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_deepseek_worker_takes_every_layer_in_place_its_kv_scales_constant_and_mla_derived(fp8):
    cfg, held, _, root = _setup(fp8)
    report = classify(root, fp8=fp8)
    assert report.refusals == []
    layers = 2
    assert report.counts() == {IN_PLACE: 25, **({CONSTANT: 2 * layers} if fp8 else {}), DERIVED: layers}
    assert report.path_of("model.layers.1.self_attn.kv_b_proj") == IN_PLACE
    assert report.path_of("model.layers.0.self_attn") == DERIVED
    assert {(d.layer, d.attr) for d in report.derived} == {(f"model.layers.{i}.self_attn", a) for i in range(layers)
                                                          for a in ("w_kc", "w_vc")}
    # what a step writes is exactly the layout as the engine holds it: the constant KV scales are no layout tensor
    written = {n for p in report.layers if p.path == IN_PLACE for n in p.tensors}
    assert written == set(held.layout(0).tensors)
    assert set(report.constants) == ({f"model.layers.{i}.self_attn.{a}.{s}" for i in range(layers)
                                      for a in ("attn_mqa", "attn_mha") for s in ("k_scale", "v_scale")} if fp8 else set())
    kernel = [p.detail for p in report.layers if p.layer.endswith("o_proj")][0]
    assert ("cutlass_w8a8_block_fp8_linear_with_fallback" in kernel) == fp8


def _refusal(root, fp8=True) -> str:
    (one,) = classify(root, fp8=fp8).refusals
    return one


def test_every_fp8_form_weightsync_does_not_land_is_refused_by_name():
    cfg, held, ck, _ = _setup(True)
    layout = held.layout(0)

    def worker(change):
        root = load(standin(cfg, layout, True), layout, ck)
        mods = dict(root.named_modules())
        change(mods)
        return root

    o = "model.layers.1.self_attn.o_proj"
    ex = "model.layers.1.mlp.experts"
    cases = [
        (lambda m: setattr(m[o].quant_method, "block_quant", False), f"{o}: .*per-tensor/channel FP8.*weight.t\\(\\)"),
        (lambda m: setattr(m[o].weight_scale_inv, "format_ue8m0", True), f"{o}: .*UE8M0.*Blackwell"),
        (lambda m: setattr(m[o].quant_method, "use_marlin", True), f"{o}: .*Marlin"),
        (lambda m: setattr(m[o].quant_method, "use_mxfp8", True), f"{o}: .*MXFP8"),
        (lambda m: setattr(m[o].quant_method, "is_checkpoint_fp8_serialized", False), f"{o}: .*quantized online"),
        (lambda m: setattr(m[o].quant_method, "w8a8_block_fp8_linear",
                           flashinfer_gemm_w8a8_block_fp8_linear_with_fallback),
         f"{o}: .*flashinfer_gemm_w8a8_block_fp8_linear_with_fallback: a GEMM whose post-load form"),
        (lambda m: setattr(m[ex].quant_method.runner.runner_backend, "value", "flashinfer_trtllm"),
         f"{ex}: fused MoE with Fp8MoEMethod on flashinfer_trtllm: that runner re-lays"),
        (lambda m: setattr(m[ex].quant_method.runner.runner_backend, "value", "deep_gemm"), f"{ex}: .*on deep_gemm"),
        (lambda m: setattr(m[ex].quant_method, "block_quant", False), f"{ex}: .*per-tensor FP8"),
        (lambda m: setattr(m[ex].quant_method, "is_fp4_expert", True), f"{ex}: .*MXFP4 experts"),
        (lambda m: setattr(m[ex], "quant_method", type("Mxfp4FlashinferCutlassMoEMethod", (), {})()),
         f"{ex}: quant method Mxfp4FlashinferCutlassMoEMethod"),
        (lambda m: setattr(m[o], "quant_method", type("ModelOptFp4LinearMethod", (), {})()),
         f"{o}: quant method ModelOptFp4LinearMethod"),
        (lambda m: setattr(m["model.layers.0.self_attn.attn_mqa"], "k_scale_float", 0.5),
         "model.layers.0.self_attn.attn_mqa: .*KV-cache scales"),
        (lambda m: setattr(m["model.layers.0.self_attn"], "w_kc", None),
         "model.layers.0.self_attn: .*MLA attention.*no w_kc / w_vc"),
    ]
    import re

    for change, want in cases:
        got = _refusal(worker(change))
        assert re.search(want, got), (want, got)
    # an FP8 engine under a layout that is not quant=fp8: every FP8 layer named
    root = worker(lambda m: None)
    fp8_layers = [n for n, m in root.named_modules() if type(getattr(m, "quant_method", None)).__name__ in
                  ("Fp8LinearMethod", "Fp8MoEMethod")]
    refusals = classify(root, fp8=False).refusals
    assert [r.split(":")[0] for r in refusals] == fp8_layers and len(fp8_layers) == 13
    assert all("not quant=fp8" in r for r in refusals)


def test_quantization_reads_the_checkpoint_and_refuses_all_but_block_fp8_by_name():
    from weightsync.instances.sglang import quantization

    assert quantization({}, {}) == 0 and quantization({"quantization_config": FP8_QC}, {}) == 1
    assert quantization({"quantization_config": FP8_QC}, {"quantization": "fp8"}) == 1
    for qc, args, want in (
        ({}, {"quantization": "fp8"}, "quantizes an unquantized checkpoint itself"),
        ({"quant_method": "mxfp4"}, {}, "mxfp4|MXFP4"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, {}, "NVFP4"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, {}, "per-tensor FP8"),
        (dict(FP8_QC, ignored_layers=["model.layers.0.mlp.down_proj"]), {}, "unquantized"),
        (FP8_QC, {"quantization": "w8a8_fp8"}, "without --quantization"),
    ):
        with pytest.raises(ConfigError, match=want):
            quantization({"quantization_config": qc} if qc else {}, args)


# -- the derived tensors after a step ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_landing_a_step_and_re_deriving_once_gives_a_fresh_engines_every_tensor_in_the_same_storage(fp8):
    """The checkpoint form of step B landed into a worker loaded from A, then weightsync's refresh (the model's own
    post_load_weights, once): every parameter and every derived w_kc / w_vc equal a fresh engine's on B, bit for
    bit; nothing moved. Without the refresh the derived tensors are A's, silently."""
    from weightsync.layout.materialize import fill_from
    from weightsync.sglang.live import refresh

    cfg, held, _, live = _setup(fp8, seed=1)
    layout = held.layout(0)
    report = classify(live, fp8=fp8)
    ptrs = {n: t.data_ptr() for n, t in live.named_parameters()}
    ck_b = checkpoint_form(random_canonical(spec_from_config(cfg), seed=2), held)
    want = _everything(fresh(cfg, layout, ck_b, fp8))
    with torch.no_grad():
        fill_from(layout, dict(live.named_parameters()), ck_b)
    stale = _everything(live)
    assert sorted(n for n in want if not same(stale[n], want[n])) == sorted(
        f"derived:model.layers.{i}.self_attn.{a}" for i in range(2) for a in ("w_kc", "w_vc"))
    assert refresh(live, report.derived) and live.post_loads == 2
    got = _everything(live)
    assert got.keys() == want.keys() and [n for n in want if not same(got[n], want[n])] == []
    assert ptrs == {n: t.data_ptr() for n, t in live.named_parameters()}
    assert [d for d in report.derived if getattr(dict(live.named_modules())[d.layer], d.attr).data_ptr() != d.ptr] == []
    if fp8:
        assert got["derived:model.layers.0.self_attn.w_kc"].dtype == torch.bfloat16  # dequantized, as SGLang does


def test_a_post_load_weights_that_re_assigns_the_derived_tensors_is_named():
    from weightsync.sglang.live import refresh

    _, _, _, live = _setup(True)
    report = classify(live, fp8=True)
    attn = live.model.layers[1].self_attn
    attn.w_kc = attn.w_kc.clone()  # a re-assignment (what bind_or_assign avoids): the old storage is what graphs hold
    with pytest.raises(WeightsMoved, match=r"model.layers.1.self_attn.w_kc"):
        refresh(live, report.derived)


def test_loaded_problems_compare_the_fp8_checkpoint_form_scales_included():
    cfg, held, _, root = _setup(True, seed=4)
    ctx = types.SimpleNamespace(rank=0, tensors=dict(root.named_parameters()), state={"model": root})
    canonical = random_canonical(spec_from_config(cfg), seed=4)
    assert loaded_problems(ctx, canonical, cfg, "sglang:quant=fp8") == []
    with torch.no_grad():
        root.model.layers[1].self_attn.kv_b_proj.weight_scale_inv[0, 0] *= 2
    (p,) = loaded_problems(ctx, canonical, cfg, "sglang:quant=fp8")
    assert "kv_b_proj.weight_scale_inv <- model.layers.1.self_attn.kv_b_proj.weight_scale_inv" in p


# -- SGLangInstance over a stand-in engine ----------------------------------------------------------------------------


def _fake_sglang() -> None:
    """``import sglang`` and ``sglang.srt.managers.io_struct`` answered by stand-in modules (test aid)."""
    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    for cls in (PauseGenerationReqInput, ContinueGenerationReqInput, UpdateWeightVersionReqInput):
        setattr(io_struct, cls.__name__, cls)
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["sglang.srt.managers.io_struct"] = io_struct
    sys.modules["sglang.srt.managers"].io_struct = io_struct


def stand_in_engine(directory: str, cfg: dict, fp8: bool, seed: int = 0, **args):
    """A stand-in 0.5.14 engine (tests/test_sglang_instance.py) serving one stand-in DeepSeek worker loaded from the
    checkpoint of ``seed``; its model folder holds the config (with ``quantization_config`` for FP8)."""
    Path(directory, "config.json").write_text(json.dumps(dict(cfg, **({"quantization_config": FP8_QC} if fp8 else {}))))
    held = held_layout(cfg, _engine(fp8))
    ck = checkpoint_form(random_canonical(spec_from_config(cfg), seed=seed), held)
    return StandInEngine0514(directory, [fresh(cfg, held.layout(0), ck, fp8)], **args), held


def write_checkpoint(ctx, checkpoint, cfg, engine):
    from weightsync.layout.materialize import fill_from

    fill_from(held_layout(cfg, engine).layout(ctx.rank), ctx.tensors, checkpoint)
    return ctx.rank


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_sglang_instance_takes_a_deepseek_engine_and_re_derives_once_per_update(tmp_path, fake_sglang, fp8):
    import weightsync.instances.sglang as S

    cfg = preset(MODEL)
    eng, held = stand_in_engine(str(tmp_path), cfg, fp8)
    inst = S.SGLangInstance(eng, timeout_s=30)
    try:
        assert inst.engine == ("sglang:fuse_shared=0,quant=fp8" if fp8 else "sglang:fuse_shared=0")
        assert inst.paths == [{IN_PLACE: 25, **({CONSTANT: 4} if fp8 else {}), DERIVED: 2}]
        (root,) = eng.models
        ptrs = {n: t.data_ptr() for n, t in root.named_parameters()}
        for seed in (5, 6):
            canonical = random_canonical(spec_from_config(cfg), seed=seed)
            ck = checkpoint_form(canonical, held)
            before = root.post_loads
            inst.pause()
            inst.call(write_checkpoint, ck, cfg, inst.engine)
            inst.after_update()
            inst.resume()
            assert root.post_loads == before + 1  # once per landing
            want = _everything(fresh(cfg, held.layout(0), ck, fp8))
            got = _everything(root)
            assert [n for n in want if not same(got[n], want[n])] == []
            assert inst.call(loaded_problems, canonical, cfg, inst.engine) == [[]]
        assert ptrs == {n: t.data_ptr() for n, t in root.named_parameters()}
    finally:
        inst.close()


def test_sglang_instance_refuses_an_mxfp4_checkpoint_and_an_fp8_form_it_does_not_land_before_any_byte(tmp_path,
                                                                                                       fake_sglang):
    import weightsync.instances.sglang as S

    cfg = preset(MODEL)
    eng, _ = stand_in_engine(str(tmp_path), cfg, True)
    Path(tmp_path, "config.json").write_text(json.dumps(dict(cfg, quantization_config={"quant_method": "mxfp4"})))
    with pytest.raises(ConfigError, match=r"nothing was sent to it.*MXFP4") as e:
        S.SGLangInstance(eng, timeout_s=30)
    assert "\n" not in str(e.value) and eng.models[0].post_loads == 1  # the fresh load's only
    eng, _ = stand_in_engine(str(tmp_path), cfg, True)
    o = dict(eng.models[0].named_modules())["model.layers.1.mlp.shared_experts.down_proj"]
    o.weight_scale_inv.format_ue8m0 = True
    before = _everything(eng.models[0])
    with pytest.raises(ConfigError, match=r"1 layers hold a form weightsync cannot write in place.*\n  model.layers.1.mlp."
                                          r"shared_experts.down_proj: .*UE8M0"):
        S.SGLangInstance(eng, timeout_s=30)
    after = _everything(eng.models[0])
    assert all(same(before[n], after[n]) for n in before) and eng.models[0].post_loads == 1


def test_a_tp2_ep2_fp8_deepseek_layout_matches_the_stand_in_workers(tmp_path, fake_sglang):
    """Two ranks, experts split in two: each rank's FP8 parameters (fused q_a/kv_a, kv_b by heads, w13/w2 blocks and
    their scales) are the layout's, and a landed checkpoint re-derives w_kc / w_vc per rank as a fresh load does."""
    import weightsync.instances.sglang as S

    cfg = dict(tiny(MODEL, intermediate_size=512, moe_intermediate_size=256).config)
    engine = "sglang:tp=2,ep=2,quant=fp8"
    held = held_layout(cfg, engine)
    Path(tmp_path, "config.json").write_text(json.dumps(dict(cfg, quantization_config=FP8_QC)))
    ck = checkpoint_form(random_canonical(spec_from_config(cfg), seed=0), held)
    eng = StandInEngine0514(str(tmp_path), [fresh(cfg, held.layout(r), ck, True) for r in range(2)], ep_size=2)
    inst = S.SGLangInstance(eng, timeout_s=30)
    try:
        assert inst.engine == "sglang:tp=2,ep=2,fuse_shared=0,quant=fp8" and len(inst.paths) == 2
        ck2 = checkpoint_form(random_canonical(spec_from_config(cfg), seed=9), held)
        inst.pause()
        inst.call(write_checkpoint, ck2, cfg, engine)
        inst.after_update()
        inst.resume()
        for r, root in enumerate(eng.models):
            want, got = _everything(fresh(cfg, held.layout(r), ck2, True)), _everything(root)
            assert [n for n in want if not same(got[n], want[n])] == [], r
    finally:
        inst.close()


# -- a whole job: a trainer process, the fp8 codec, a stand-in engine -------------------------------------------------


def reader_sglang(emit, inst: int, meta: str, job: dict) -> None:
    """An instance process: SGLangInstance over a stand-in 0.5.14 engine holding a stand-in DeepSeek worker (TP=1),
    a real WeightReader; after each step every parameter and derived tensor is compared with a fresh stand-in engine
    on that step's checkpoint form, and every parameter's storage with what it was."""
    import tempfile

    from e2e import step_canonical

    from weightsync.local.events import Ready, StepDone
    from weightsync.runtime.reader import WeightReader

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    _fake_sglang()
    import weightsync.instances.sglang as S

    cfg, fp8 = preset(job["model"]), job["fp8"]
    eng, held = stand_in_engine(tempfile.mkdtemp(), cfg, fp8, seed=77)
    instance = S.SGLangInstance(eng, timeout_s=job["timeout"])
    (root,) = eng.models
    ptrs = {n: t.data_ptr() for n, t in root.named_parameters()}
    try:
        r = WeightReader(instance, meta=meta, job=job["job"], instance_id=inst, instances=1, timeout_s=job["timeout"],
                         token=job["token"], bucket_bytes=job["bucket_bytes"], integrity=0).connect()
        emit(Ready(emit.participant))
        for step in range(1, job["steps"] + 1):
            before = root.post_loads
            r.update(step)
            want = _everything(fresh(cfg, held.layout(0), checkpoint_form(step_canonical(spec_from_config(cfg), step),
                                                                          held), fp8))
            got = _everything(root)
            problems = tuple(f"{n} differs" for n in want if not same(got[n], want[n]))
            problems += tuple(f"{n} moved" for n, t in root.named_parameters() if t.data_ptr() != ptrs[n])
            if root.post_loads != before + 1:
                problems += (f"post_load_weights ran {root.post_loads - before} times",)
            emit(StepDone(emit.participant, step, 0.0, 0, not problems, version=r.version, problems=problems))
        r.close()
    finally:
        instance.close()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_trainer_process_syncs_a_deepseek_into_the_stand_in_engine_bit_exact_to_a_fresh_one(fp8):
    """A real transformers training process (DeepSeek-V3-shaped, bf16) and a real WeightReader over p2p into the
    stand-in engine; with quant=fp8 the trainer's fp8 codec quantizes each bucket and the worker lands the e4m3 bytes
    and scales. Every step: everything the stand-in computes with equals a fresh stand-in on the step's checkpoint."""
    from e2e import trainer

    from weightsync.local.events import Participant, StepDone
    from weightsync.local.runner import LocalJob
    from weightsync.transport.group import free_port

    job = {"job": f"sglang-dsv3-{'fp8' if fp8 else 'bf16'}", "steps": 2, "timeout": 90.0, "bucket_bytes": 1 << 20,
           "integrity": 0, "model": MODEL, "train": "hf", "fp8": fp8}
    with LocalJob(deadline_s=job["timeout"] * 4, stop_on_failure=False, exit_grace_s=5.0) as local:
        job["token"] = local.job_token(job["job"])
        local.add(Participant.trainer(0), trainer, 0, 1, free_port(), local.meta_url, job)
        local.add(Participant.instance(0), reader_sglang, 0, local.meta_url, job)
        result = local.run()
    assert not result.failures, "\n".join(f"{f.line()}\n{f.traceback}" for f in result.failures)
    done = result.of(StepDone)
    assert [d.step for d in done] == [1, 2], result.events
    for d in done:
        assert d.problems == () and d.version == d.step, d


# -- against SGLang 0.5.14's own functions (skipped without its source) -----------------------------------------------

SRC = os.environ.get("WEIGHTSYNC_SGLANG_SRC")
DEPS = os.environ.get("WEIGHTSYNC_SGLANG_DEPS", "")


@pytest.mark.skipif(not SRC, reason="WEIGHTSYNC_SGLANG_SRC (SGLang 0.5.14's unpacked wheel) not set")
def test_against_sglang_0514s_own_functions(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in [DEPS, SRC, str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")] if p))
    p = subprocess.run([sys.executable, str(HERE / "sglang_0514.py"), "real", str(tmp_path / "real.json")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    r = json.loads((tmp_path / "real.json").read_text())
    assert r["sglang"] == "0.5.14", r
    for gemm in ("deepgemm_w8a8_block_fp8_linear_with_fallback", "cutlass_w8a8_block_fp8_linear_with_fallback"):
        g = r[gemm]
        assert g["refusals"] == [] and g["kept"] and g["moe_runner"] == "triton", g
        assert g["paths"] == {"lin": IN_PLACE, "moe": IN_PLACE, "attn": CONSTANT}, g
        assert g["constants"] == ["attn.k_scale", "attn.v_scale"], g
    for kind in ("bf16", "fp8"):
        m = r[f"mla_{kind}"]
        assert m["standin_copy_equal"] and m["resynced_equal"] and m["refusals"] == [], m
        assert m["w_kc_dtype"] == "torch.bfloat16" and m["w_scale"] == 1.0, m
        assert len(m["derived"]) == 4, m
    assert r["block_quant_dequant_equal"]


