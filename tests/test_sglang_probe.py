"""The CPU probe behind docs/sglang.md §2 and §5: SGLang 0.5.23's own model classes, built on CPU.

Skipped unless ``WEIGHTSYNC_SGLANG_SRC`` names a directory holding SGLang 0.5.23's ``sglang`` package
(``pip download sglang==0.5.23 --no-deps`` and unzip the wheel; it cannot be *installed* here: it pins
torch 2.14.1 and CUDA kernels). SGLang is imported unchanged from there with this venv's torch; only
``IPython``, ``torchvision`` and ``gguf`` are stub modules (multimodal and GGUF code imports them), and
``WEIGHTSYNC_SGLANG_DEPS`` may name a ``pip install --target`` directory for pure-Python packages this venv
lacks (``orjson``). Each TP rank is a process in a gloo group set up as SGLang's bootstrap does
(``init_distributed_environment``, ``publish(ServerArgs)``, ``initialize_model_parallel``,
``initialize_dp_attention``); no forward runs.

- ``load``: SGLang's ``model.load_weights`` + ``postprocess_weights`` of the probe checkpoint; the
  parameters are recorded as tests/data/sglang-0.5.23-params.json stores them (``record`` regenerates it:
  ``python tests/test_sglang_probe.py record OUT.json``).
- ``inplace``: a model loaded with checkpoint A, then weightsync's own path: ``restore_weights_before_loading``
  (begin_weight_update), weightsync's real ``rpc_loader`` running ``_probe``, a write through the sglang
  layout and ``_post_load_weights`` (each call through SGLang's ``MultiprocessingSerializer`` and
  ``SafeUnpickler``), ``postprocess_weights`` (end_weight_update); compared with a fresh model loaded from B.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SRC = os.environ.get("WEIGHTSYNC_SGLANG_SRC")
DEPS = os.environ.get("WEIGHTSYNC_SGLANG_DEPS", "")
STUBS = ("IPython", "torchvision", "gguf")
# (preset, weightsync engine, SGLang ServerArgs overrides): what tests/data/sglang-0.5.23-params.json holds
CONFIGS = [
    ("tiny-qwen3", "sglang:tp=4", {}),
    ("tiny-qwen3", "sglang:tp=4,dp=2,dp_attention=1", {"attn_dp_size": 2}),
    ("tiny-qwen2", "sglang:tp=2", {}),
    ("tiny-llama3", "sglang:tp=2", {}),
    ("tiny-qwen3-moe", "sglang:tp=2", {}),
    ("tiny-qwen3-moe", "sglang:tp=2,ep=2", {"ep_size": 2}),
    ("tiny-qwen3-moe", "sglang:tp=4,dp=2,dp_attention=1", {"dp_size": 2, "enable_dp_attention": True}),
    ("tiny-deepseek-v3", "sglang:tp=2", {}),
    ("tiny-deepseek-v3", "sglang:tp=2,fuse_shared=1", {"enforce_shared_experts_fusion": True}),
    ("tiny-deepseek-v3", "sglang:tp=2,ep=2", {"ep_size": 2}),
    ("tiny-deepseek-v3", "sglang:tp=4,dp=2,dp_attention=1,dp_lm_head=1", {"attn_dp_size": 2, "enable_dp_lm_head": True}),
]


def record_key(model: str, engine: str, overrides: dict) -> str:
    return " ".join([model, engine] + [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


# -- inside a rank process ------------------------------------------------------------------------


def _import_sglang() -> None:
    """Stub the three modules SGLang's text-model import path does not need; keep transformers' view of torchvision."""
    import importlib.abc
    import importlib.machinery
    import types
    from unittest import mock

    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached False before the stub exists
    import transformers.models.auto.image_processing_auto  # noqa: F401

    class Stub(types.ModuleType):
        def __getattr__(self, item):
            if item.startswith("__"):
                raise AttributeError(item)
            value = mock.MagicMock(name=f"{self.__name__}.{item}")
            setattr(self, item, value)
            return value

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in STUBS:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            m = Stub(spec.name)
            m.__path__ = []
            return m

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Finder())


def _checkpoint(spec, seed: int = 0) -> dict:
    import zlib

    import torch

    from weightsync.layout.materialize import TORCH_DTYPES

    out = {}
    for t in spec.tensors:
        g = torch.Generator().manual_seed(zlib.crc32(t.name.encode()) + seed)
        out[t.name] = torch.randn(t.shape, generator=g).to(TORCH_DTYPES[t.dtype])
    return out


def _hash(t) -> str:
    import hashlib

    import torch

    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def rank_main(mode: str, cfg_dir: str, tp: int, rank: int, port: int, engine: str, overrides: dict, out: str) -> None:
    _import_sglang()
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.model_loader.loader import DefaultModelLoader, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, get_server_args, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    from weightsync.engines import make_layout
    from weightsync.layout.materialize import scatter
    from weightsync.spec.model import spec_from_config

    init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    reset_context()  # as sglang/test/test_utils.py publish_build_topology
    publish(ServerArgs(model_path=cfg_dir, tp_size=tp, pp_size=1, device="cpu", **overrides), role="test",
            ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    initialize_dp_attention(server_args=get_server_args())  # as distributed/bootstrap.py:343
    mc = ModelConfig(cfg_dir)
    cpu = torch.device("cpu")
    cfg = json.loads(Path(cfg_dir, "config.json").read_text())
    spec = spec_from_config(cfg)
    import weightsync.instances.sglang as S

    tp_rank = S._tp_rank()
    layout = make_layout(spec, engine).layout(tp_rank)

    def fresh(ck):
        with set_default_torch_dtype(mc.dtype), cpu:
            m = _initialize_model(mc, LoadConfig())
        with torch.no_grad():
            for _, t in m.named_parameters():
                if t.is_floating_point():
                    t.fill_(float("nan"))
        m.load_weights(iter(ck.items()))
        DefaultModelLoader.postprocess_weights(m, cpu)
        return m

    def state(m):
        s = {n: t.detach().clone() for n, t in m.named_parameters()}
        for n, mod in m.named_modules():
            for k in ("w_kc", "w_vc"):
                if isinstance(getattr(mod, k, None), torch.Tensor):
                    s[f"{n}.{k}"] = getattr(mod, k).detach().clone()
        return s

    if mode == "load":
        model = fresh(_checkpoint(spec))
        want = scatter(layout, _checkpoint(spec))
        params = {}
        for n, t in model.named_parameters():
            covered = ~torch.isnan(want[n].float()) if n in want else None
            params[n] = [list(t.shape), str(t.dtype).removeprefix("torch."), None if covered is None else _hash(t[covered])]
        Path(out).write_text(json.dumps({"rank": tp_rank, "params": params}))
        return

    from sglang.srt.model_executor.model_runner_components.weight_updater import _unwrap_tensor
    from sglang.srt.utils.common import MultiprocessingSerializer

    from weightsync.runtime import wire

    answers, key = wire.new_key_dir()  # the signed call channel (docs/sglang.md §0.1)
    seq = [0]

    def rpc(model, fn, *args):
        """weightsync's call as SGLang delivers it (weight_updater.py:343-376)."""
        seq[0] += 1
        payload = S.rpc_payload(S.RpcMessage(f"probe-{id(model)}", answers, seq[0], fn, args), key)
        named = MultiprocessingSerializer.deserialize(MultiprocessingSerializer.serialize(payload))
        S.rpc_loader(model, [(n, _unwrap_tensor(t, tp_rank=tp_rank, device="cpu")) for n, t in named])
        return wire.read_answer(f"{answers}/{seq[0]}.{tp_rank}")

    a, b = _checkpoint(spec, 1), _checkpoint(spec, 2)
    want = state(fresh(b))
    res = {"rank": tp_rank}
    for post in (True, False):
        m = fresh(a)
        DefaultModelLoader.restore_weights_before_loading(m, cpu)
        probe = rpc(m, S._probe)
        assert probe.ok, probe.error
        res["probe"] = {"refusals": list(probe.value.refusals), "fused_shared": probe.value.fused_shared}
        wrote = rpc(m, _write, b, cfg, engine)
        assert wrote.ok, wrote.error
        if post:
            assert rpc(m, S._post_load_weights).ok
        DefaultModelLoader.postprocess_weights(m, cpu)
        got = state(m)
        res["post_load" if post else "no_post_load"] = sorted(n for n in want if not torch.equal(got[n], want[n]))
    failed = rpc(m, _fail)
    res["error"] = [failed.ok, failed.error[1]]
    Path(out).write_text(json.dumps(res))


def _write(ctx, canonical, cfg, engine):
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import fill_from
    from weightsync.spec.model import spec_from_config

    fill_from(make_layout(spec_from_config(cfg), engine).layout(ctx.rank), ctx.tensors, canonical)


def _fail(ctx):
    raise ValueError(f"boom on rank {ctx.rank}")


# -- the driver ------------------------------------------------------------------------------------


def run_ranks(mode: str, model: str, engine: str, overrides: dict, port: int) -> list[dict]:
    from weightsync.engines import make_layout
    from weightsync.spec import load_spec

    tp = make_layout(load_spec(model), engine).world_size
    with tempfile.TemporaryDirectory() as d:
        cfg = json.loads((ROOT / "weightsync" / "spec" / "presets" / f"{model}.json").read_text())
        if cfg["architectures"][0] == "DeepseekV3ForCausalLM":  # SGLang's CPU rope asserts rope_scaling; no tensor changes
            cfg["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", "factor": 1.0, "beta_fast": 32, "beta_slow": 1,
                                   "original_max_position_embeddings": cfg["max_position_embeddings"],
                                   "mscale": 1.0, "mscale_all_dim": 1.0}
        Path(d, "config.json").write_text(json.dumps(cfg))
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (SRC, DEPS, str(ROOT), str(HERE)) if p))
        outs = [str(Path(d, f"{r}.json")) for r in range(tp)]
        procs = [subprocess.Popen([sys.executable, __file__, "rank", mode, d, str(tp), str(r), str(port), engine,
                                   json.dumps(overrides), outs[r]], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(tp)]
        for p in procs:
            log, _ = p.communicate(timeout=1200)
            if p.returncode:
                raise RuntimeError(f"{model} {engine}: a rank failed:\n{log[-3000:]}")
        return [json.loads(Path(o).read_text()) for o in outs]


needs_sglang = pytest.mark.skipif(not SRC, reason="set WEIGHTSYNC_SGLANG_SRC to an unpacked sglang 0.5.23 wheel")


@needs_sglang
@pytest.mark.parametrize("model,engine,overrides", [CONFIGS[0], CONFIGS[7]], ids=["qwen3-tp4", "dsv3-tp2"])
def test_probe_reproduces_the_record(model, engine, overrides):
    from helpers import free_port

    record = json.loads((HERE / "data" / "sglang-0.5.23-params.json").read_text())["configs"]
    for r in run_ranks("load", model, engine, overrides, free_port()):
        assert r["params"] == record[record_key(model, engine, overrides)][str(r["rank"])]


@needs_sglang
@pytest.mark.parametrize("model,engine,overrides", [CONFIGS[7], CONFIGS[8], CONFIGS[5]], ids=["dsv3", "dsv3-fused", "moe-ep2"])
def test_in_place_update_through_rpc_loader_equals_a_fresh_load(model, engine, overrides):
    from helpers import free_port

    for r in run_ranks("inplace", model, engine, overrides, free_port()):
        assert r["probe"]["refusals"] == [] and r["post_load"] == [] and r["error"] == [False, "ValueError"]
        if model == "tiny-deepseek-v3":  # MLA w_kc/w_vc are copies: stale without post_load_weights, silently
            assert r["no_post_load"] and all(n.endswith((".w_kc", ".w_vc")) for n in r["no_post_load"])
            assert r["probe"]["fused_shared"] == int("fuse_shared=1" in engine)


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        sys.path.insert(0, str(ROOT))
        mode, cfg_dir, tp, rank, port, engine, overrides, out = sys.argv[2:10]
        rank_main(mode, cfg_dir, int(tp), int(rank), int(port), engine, json.loads(overrides), out)
    elif sys.argv[1] == "record":  # python tests/test_sglang_probe.py record OUT.json (with WEIGHTSYNC_SGLANG_SRC set)
        sys.path.insert(0, str(ROOT))
        sys.path.insert(0, str(HERE))
        from helpers import free_port

        about = json.loads((HERE / "data" / "sglang-0.5.23-params.json").read_text())["about"]
        configs = {}
        for model, engine, overrides in CONFIGS:
            ranks = run_ranks("load", model, engine, overrides, free_port())
            configs[record_key(model, engine, overrides)] = {str(r["rank"]): r["params"] for r in ranks}
            print(record_key(model, engine, overrides), "recorded", flush=True)
        Path(sys.argv[2]).write_text(json.dumps({"about": about, "configs": configs}, separators=(",", ":"), sort_keys=True) + "\n")
