"""weightsync into a REAL SGLang engine on one GPU (the SGLang GPU kit, 0.5.14): correctness, faults, the bench.

    . .sgkit/go.sh && python benchmarks/sglang_gpu.py colo  --out DIR [--models llama,qwen3,qwen3moe]
    . .sgkit/go.sh && python benchmarks/sglang_gpu.py colo  --out DIR --models deepseek --no-extras   # MLA, bf16
    . .sgkit/go.sh && python benchmarks/sglang_gpu.py colo  --out DIR --models deepseek-fp8 --no-extras  # block FP8
    . .sgkit/go.sh && python benchmarks/sglang_gpu.py bench --out DIR [--model qwen3-8b] [--scenarios colo-1gpu,nixl-1gpu]

``colo``, per model (a small random config of each architecture, bf16, saved with transformers'
``save_pretrained`` at seeds 0, 1, 2): FRESH reference engines on seeds 1 and 2 start in their own processes
(``ref``: every tensor they compute with, as digests, and greedy tokens; decode CUDA graphs on), while this
process starts the engine under test on seed 0 with weightsync's loader. Then:

1. co-located: a trainer process on the same GPU (transformers, ``WeightWriter(colocate=True)``) writes seeds
   1, 2, 1 as steps 1-3; ``WeightReader(SGLangInstance(engine), colocate=True)`` takes each by CUDA IPC into
   SGLang's live parameters; after every step: every written tensor bit-exact to the checkpoint, every tensor
   the engine computes with bit-exact to the fresh engine's (digests), the same greedy tokens (CUDA graphs
   replay the same parameter storage), the weight version the engine reports;
2. separated (first model only): a second job, trainer process -> this engine over NIXL (``transport="nixl"``),
   steps 4-5 (seeds 2, 1), checked the same way;
3. bad input (first model only): a trainer of another model against this engine (refused at set-up; the
   engine still serves the previous step's weights, tokens checked), and in its own process an engine
   started without weightsync's loader and in float16 (``bad``: ``SGLangInstance`` refuses in one line; the
   engine keeps generating);
4. validation through SGLang's own loader (first model only): ``validate_via="sglang-loader"`` against the
   held checkpoint, then with one element flipped (named) and flipped back;
5. a trainer killed with its step announced (first model only; co-located, then NIXL): a staged reader takes the
   step whole or fails within its deadline; the engine serves exactly one of the two steps after.

``deepseek`` / ``deepseek-fp8`` (DeepSeek-V3-shaped: MLA with q_lora_rank, shared + routed experts, a dense first
layer, noaux_tc; bf16 from ``save_pretrained``, block FP8 from ``save_checkpoint(dir, quant="fp8")``): the same
co-located steps; with FP8 the trainer's fp8 codec quantizes each bucket (integrity 0) and the engine's e4m3 weights
and fp32 scales take it in place; "every tensor the engine computes with" includes MLA's derived ``w_kc`` / ``w_vc``
(re-derived by the model's ``post_load_weights`` after every update) and the FP8 KV-cache scales; the record says
which FP8 GEMM and MoE runner the engine chose (``methods``) and each layer's path (``paths``). Ran on 1 x H100 on
2026-12-07 (``--no-extras``, one model per process): both bit-exact to fresh engines after all three steps, tokens
equal (BENCHMARKS.md; docs/sglang.md §7.7), with flashinfer's ``fused_topk_deepseek`` import disabled on the host (a
JIT kernel whose sources the SGLang kit does not carry; SGLang then routes with ``sgl_kernel.moe_fused_gate``).
``qwen3moe-fp8`` (the Qwen3-MoE above in block FP8): ran the same way the same day, bit-exact, tokens equal.

``bench``: ``weightsync.bench.run.run(scenario, model, receiver="sglang")`` then ``receiver="faithful"``,
each with its device-copy ceiling measured in the same run. Every stage records what failed instead of
stopping; exit status 0 only when everything held. JSON: ``DIR/colo.json``, ``DIR/bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

ENGINE = "sglang:tp=1"
SEEDS = (0, 1, 2)
_BASE = dict(hidden_act="silu", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, num_hidden_layers=2, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
             tie_word_embeddings=False, torch_dtype="bfloat16", vocab_size=512, attention_bias=False,
             bos_token_id=1, eos_token_id=2)
#: the kit's prebuilt JIT kernels cover head_dim 64 with 2 KV heads (its smoke models): these configs match them
MODELS = {
    "llama": dict(_BASE, architectures=["LlamaForCausalLM"], model_type="llama", mlp_bias=False),
    "qwen3": dict(_BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
    "qwen2": dict(_BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2", attention_bias=True, head_dim=64),
    "qwen3moe": dict(_BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", decoder_sparse_step=1,
                     moe_intermediate_size=128, mlp_only_layers=[], norm_topk_prob=True, num_experts=8,
                     num_experts_per_tok=2),
}
OTHER = dict(MODELS["llama"], hidden_size=128, intermediate_size=256, num_attention_heads=2)  # the mismatched trainer
#: DeepSeek-V3-shaped (weightsync/spec/presets/tiny-deepseek-v3-fp8.json: MLA with q_lora_rank 128, kv_lora_rank 512 +
#: rope 64, 8 routed + 1 shared expert, a dense first layer, noaux_tc; every linear a whole number of 128 x 128 blocks),
#: vocab 512 as the others. ``deepseek`` is saved in bf16 (save_pretrained), ``deepseek-fp8`` in block FP8
#: (``save_checkpoint(dir, quant="fp8")``): the engine holds e4m3 weights with fp32 scales and derives w_kc/w_vc
#: (bf16) from the dequantized kv_b_proj in post_load_weights (docs/sglang.md §7)
_DSV3 = json.loads((HERE.parent / "weightsync" / "spec" / "presets" / "tiny-deepseek-v3-fp8.json").read_text())
MODELS["deepseek"] = dict(_DSV3, vocab_size=512, bos_token_id=1, eos_token_id=2)
MODELS["deepseek-fp8"] = MODELS["deepseek"]
#: Qwen3-MoE in block FP8 (every linear a whole number of 128 x 128 blocks at these sizes; SGLang builds the router
#: ``mlp.gate`` unquantized, as the FP8 checkpoint holds it)
MODELS["qwen3moe-fp8"] = MODELS["qwen3moe"]
#: models whose checkpoints (and so the engines) are block FP8: their jobs run the fp8 codec (integrity 0)
FP8 = ("deepseek-fp8", "qwen3moe-fp8")


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def weights(spec, seed: int) -> dict:
    """Random canonical weights: norms near 1, the rest N(0, 0.3) (greedy tokens then depend on them)."""
    import torch

    from weightsync.layout.materialize import TORCH_DTYPES

    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in spec.tensors:
        x = torch.randn(t.shape, generator=g, dtype=torch.float32)
        x = 1.0 + 0.1 * x if "norm" in t.name else 0.3 * x
        out[t.name] = x.to(TORCH_DTYPES[t.dtype])
    return out


def save(cfg: dict, seed: int, directory: Path, quant: str | None = None) -> Path:
    """The trainer's checkpoint of a seed: transformers' ``save_pretrained`` of the model holding those weights; with
    ``quant="fp8"`` weightsync's ``save_checkpoint(dir, quant="fp8")`` of them (one HF training rank on CPU): every
    linear weight in 128 x 128 block FP8 beside its ``weight_scale_inv``, ``quantization_config`` in config.json."""
    import torch

    if quant is not None:
        from weightsync.bind.train import HFTrainEngine
        from weightsync.checkpoint import save_checkpoint
        from weightsync.checkpoint.hf import build_hf_model
        from weightsync.layout.materialize import fill_from
        from weightsync.spec.model import spec_from_config

        spec = spec_from_config(cfg)
        bound = HFTrainEngine(build_hf_model(spec, seed=0)).bound
        with torch.no_grad():
            fill_from(bound.layout, bound.tensors, weights(spec, seed))
        save_checkpoint(bound, directory, quant=quant)
        return directory

    from weightsync.engines.hf import HFLayout
    from weightsync.layout.materialize import fill_from
    from weightsync.spec.model import spec_from_config

    try:
        from weightsync.testing import build_hf_model
    except ImportError:  # moved by a later refactor
        from weightsync.checkpoint.hf import build_hf_model

    spec = spec_from_config(cfg)
    model = build_hf_model(spec)
    live = dict(model.named_parameters())
    live.update((n, b) for n, b in model.named_buffers() if n in spec.by_name)  # DeepSeek's e_score_correction_bias
    with torch.no_grad():
        fill_from(HFLayout(spec).layout(0), live, weights(spec, seed))
    model.save_pretrained(str(directory))
    return directory


# -- in their own processes: a fresh engine, a bad engine ---------------------------------------------


def ref_main(path: str, out: str) -> int:
    """A FRESH engine on checkpoint ``path``: digests of every tensor it computes with, greedy tokens."""
    from weightsync.sglang.engine import EngineOptions, generate, start

    rec: dict = {"path": path}
    try:
        cfg = json.loads(Path(path, "config.json").read_text())
        t0 = time.perf_counter()
        own = start(cfg, ENGINE, EngineOptions(), checkpoint=path)
        rec["startup_s"] = time.perf_counter() - t0
        try:
            rec["digests"] = own.digests()
            rec["tokens"] = generate(own.engine)
            rec["cuda_graph"] = not bool(own.engine.server_args.disable_cuda_graph)
        finally:
            own.close()
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    Path(out).write_text(json.dumps(rec))
    return 0 if "error" not in rec else 1


def bad_main(path: str, out: str) -> int:
    """An engine started without weightsync's loader and in float16 on a bf16 checkpoint: SGLangInstance refuses
    in one line; the engine keeps generating."""
    import sglang

    from weightsync.instances.sglang import SGLangInstance
    from weightsync.sglang.engine import EngineOptions, generate, stop

    rec: dict = {}
    try:
        eng = sglang.Engine(**EngineOptions(loader=False).engine_args(path, 1, dummy=False, dtype="float16"))
        try:
            before = generate(eng)
            t0 = time.perf_counter()
            try:
                SGLangInstance(eng, timeout_s=30)
                rec["refused"] = None
            except Exception as e:  # noqa: BLE001
                rec["refused"] = f"{type(e).__name__}: {e}"
            rec["refuse_seconds"] = time.perf_counter() - t0
            rec["serves_after"] = generate(eng) == before
        finally:
            stop(eng)
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    Path(out).write_text(json.dumps(rec))
    return 0


def trainer_main(cfg_path: str, meta: str, job: str, steps: list, colocate: bool, transport: str, timeout: float,
                 port: int, q, die_after_written: int | None = None, integrity: int | None = None) -> None:
    """A training process on cuda:0: transformers weights filled per step with a seed's, written by a WeightWriter.
    ``die_after_written``: SIGKILL itself right after the MetaServer recorded that step written (the fault case:
    its weights announced, the instance not yet holding them)."""
    try:
        import datetime

        import torch
        import torch.distributed as dist

        from weightsync.layout.materialize import fill_from
        from weightsync.local.trainers import build_trainer
        from weightsync.runtime.writer import WeightWriter
        from weightsync.spec import load_spec

        torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout))
        spec = load_spec(cfg_path)
        bound = build_trainer(spec, "hf", 0, 1, same_start=False, device="cuda").bound
        writer = WeightWriter(bound, meta=meta, job=job, timeout_s=timeout, colocate=colocate, transport=transport,
                              **({} if integrity is None else {"integrity": integrity})).connect()
        if die_after_written is not None:
            import os
            import signal

            real = writer.client.written

            def written(step, *a, **k):
                out = real(step, *a, **k)
                if step == die_after_written:
                    q.put(("killed", f"after written({step})"))
                    time.sleep(0.2)  # the queue's feeder thread hands the line over
                    os.kill(os.getpid(), signal.SIGKILL)
                return out

            writer.client.written = written
        for step, seed in steps:
            with torch.no_grad():
                fill_from(bound.layout, bound.tensors, weights(spec, seed))
            writer.write(step)
        writer.close()
        q.put(("ok", ""))
    except BaseException as e:  # noqa: BLE001
        q.put(("err", f"{type(e).__name__}: {e}"))


# -- the driver -----------------------------------------------------------------------------------------


def _spawn_script(stage: str, *args: str, log_path: Path) -> subprocess.Popen:
    f = open(log_path, "w")
    return subprocess.Popen([sys.executable, __file__, stage, *args], stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_json(p: subprocess.Popen, out: Path, log_path: Path, timeout: float) -> dict:
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        return {"error": f"timed out after {timeout}s; log tail: {log_path.read_text()[-2000:]}"}
    if not out.exists():
        return {"error": f"exit {p.returncode}, no result; log tail: {log_path.read_text()[-3000:]}"}
    return json.loads(out.read_text())


class Trainer:
    def __init__(self, cfg_path: Path, meta: str, job: str, steps: list, colocate: bool, transport: str = "p2p",
                 timeout: float = 120.0, die_after_written: int | None = None, integrity: int | None = None):
        import multiprocessing as mp

        from weightsync.transport.group import free_port

        ctx = mp.get_context("spawn")
        self.q = ctx.Queue()
        self.p = ctx.Process(target=trainer_main, args=(str(cfg_path), meta, job, steps, colocate, transport, timeout,
                                                       free_port(), self.q, die_after_written, integrity),
                             daemon=True)
        self.p.start()

    def result(self, timeout: float = 60.0):
        import queue

        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            return ("died" if self.p.exitcode is not None else "silent", str(self.p.exitcode))
        finally:
            self.p.join(5)
            if self.p.is_alive():
                self.p.kill()


def _check(own, spec, cfg: dict, ref: dict, seed: int, step: int) -> dict:
    from weightsync.sglang.verify import computed_digests, differences, loaded_problems

    inst = own.instance
    problems = [p for ps in inst.call(loaded_problems, weights(spec, seed), cfg, inst.engine) for p in ps]
    mine = inst.call(computed_digests)[0]
    diff = differences(mine, ref["digests"][0])
    tokens = own.tokens()
    return {"loaded_exact": not problems, "loaded_problems": problems[:5], "computed_equal": not diff,
            "computed_diff": diff[:10], "tensors_compared": len(mine), "computed_names": sorted(mine), "tokens": tokens,
            "tokens_equal": tokens == ref["tokens"], "served_version": inst.served_version,
            "version_ok": inst.served_version == str(step)}


def _sync_steps(own, spec, cfg, cfg_path: Path, refs: dict, meta, job: str, steps: list, colocate: bool,
                transport: str, result: dict) -> None:
    from weightsync.runtime.reader import WeightReader

    fp8 = {"integrity": 0} if "quant=fp8" in own.instance.engine else {}  # the fp8 codec runs without integrity sums
    trainer = Trainer(cfg_path, meta.url, job, steps, colocate, transport, **fp8)
    reader = None
    try:
        reader = WeightReader(own.instance, meta=meta.url, job=job, instance_id=0, instances=1, timeout_s=120,
                              colocate=colocate, transport=transport, **fp8).connect()
        for step, seed in steps:
            t0 = time.perf_counter()
            reader.update(step)
            seconds = time.perf_counter() - t0
            rec = {"job": job, "transport": "cuda-ipc" if colocate else transport, "step": step, "seed": seed,
                   "update_seconds": seconds, "bytes": sum(s.bytes for s in reader.last_stats)}
            rec["instance_ms"] = {k: v * 1e3 for k, v in own.instance.last_timing.items()}
            rec["quiet"] = own.instance.last_quiet  # pause/flush/continue skipped, the flush inside the call
            # the update's calls went through the call mailbox (no SGLang request; the flush by the scheduler thread)
            rec["mailbox"] = own.instance.last_mailbox
            rec["trips"] = own.instance.trips  # update_weights_from_tensor calls so far (set-up, checks, old path)
            rec.update(_check(own, spec, cfg, refs[seed], seed, step))
            rec["ok"] = rec["loaded_exact"] and rec["computed_equal"] and rec["tokens_equal"] and rec["version_ok"]
            log(f"[{job}] step {step} <- seed {seed}: {seconds * 1e3:.1f} ms (mailbox {rec['mailbox']}), loaded exact "
                f"{rec['loaded_exact']}, {rec['tensors_compared']} computed tensors equal {rec['computed_equal']}, "
                f"tokens equal {rec['tokens_equal']}, version {rec['served_version']}")
            if not rec["ok"]:
                log(f"[{job}] problems: {rec['loaded_problems']} {rec['computed_diff']}")
            result["steps"].append(rec)
    except Exception as e:  # noqa: BLE001
        result["errors"].append(f"{job}: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
        log(f"[{job}] FAILED: {type(e).__name__}: {e}")
    finally:
        if reader is not None:
            try:
                reader.close()
            except Exception as e:  # noqa: BLE001
                result["errors"].append(f"{job}: close: {type(e).__name__}: {e}")
        result.setdefault("trainers", {})[job] = trainer.result()


def _mismatch(own, spec, cfg, refs, held_seed: int, root: Path, meta, result: dict) -> None:
    """A trainer of another model against this engine: refused at set-up; the engine serves its weights still."""
    from weightsync.runtime.reader import WeightReader

    other = root / "other"
    other.mkdir(exist_ok=True)
    (other / "config.json").write_text(json.dumps(OTHER))
    trainer = Trainer(other, meta.url, "mismatch", [(1, 1)], colocate=True, timeout=30.0)
    rec: dict = {}
    t0 = time.perf_counter()
    try:
        WeightReader(own.instance, meta=meta.url, job="mismatch", instance_id=0, instances=1, timeout_s=30,
                     colocate=True).connect()
        rec["refused"] = None
    except Exception as e:  # noqa: BLE001
        rec["refused"] = f"{type(e).__name__}: {e}"
    rec["refuse_seconds"] = time.perf_counter() - t0
    rec["trainer"] = trainer.result(40)
    rec.update({k: v for k, v in _check(own, spec, cfg, refs[held_seed], held_seed, result["steps"][-1]["step"]).items()
                if k in ("computed_equal", "tokens_equal", "loaded_exact")})
    rec["ok"] = bool(rec["refused"]) and rec["computed_equal"] and rec["tokens_equal"]
    log(f"[mismatch] refused in {rec['refuse_seconds']:.1f} s: {str(rec['refused'])[:300]}; engine still holds seed "
        f"{held_seed} exactly: {rec['computed_equal']}, tokens {rec['tokens_equal']}")
    result["mismatch"] = rec


def _killed_trainer(own, spec, cfg, cfg_path: Path, refs: dict, meta, colocate: bool, result: dict) -> None:
    """A trainer SIGKILLed right after its step 2 is recorded written (its weights announced, this engine not yet
    holding them), against a staged reader: ``update(2)`` either takes the step whole or fails with a weightsync
    error within its deadline; either way the engine keeps serving, every tensor it computes with equal to a fresh
    engine's on exactly one of the two steps (never a mix), greedy tokens equal."""
    from weightsync.errors import WeightSyncError
    from weightsync.runtime.reader import WeightReader

    job = "killed-" + ("colo" if colocate else "nixl")
    trainer = Trainer(cfg_path, meta.url, job, [(1, 2), (2, 1)], colocate, "p2p" if colocate else "nixl",
                      timeout=15.0, die_after_written=2)
    rec: dict = {"job": job}
    reader = None
    try:
        reader = WeightReader(own.instance, meta=meta.url, job=job, instance_id=0, instances=1, timeout_s=15,
                              colocate=colocate, transport="p2p" if colocate else "nixl", staged=True).connect()
        reader.update(1)
        rec["step1"] = _check(own, spec, cfg, refs[2], 2, 1)
        t0 = time.perf_counter()
        try:
            reader.update(2)
            rec["update2"] = "held"
        except WeightSyncError as e:
            rec["update2"] = f"{type(e).__name__}: {e}"[:800]
        rec["update2_seconds"] = time.perf_counter() - t0
        rec["trainer"] = trainer.result(10)
        held = 1 if rec["update2"] == "held" else 2  # the seed the engine should hold
        after = _check(own, spec, cfg, refs[held], held, 2 if held == 1 else 1)
        rec["after"] = {k: after[k] for k in ("computed_equal", "tokens_equal", "computed_diff")}
        rec["held_seed"] = held
        rec["ok"] = bool(rec["step1"]["computed_equal"] and after["computed_equal"] and after["tokens_equal"]
                         and rec["update2_seconds"] < 2 * 15 + 5)
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    finally:
        if reader is not None:
            try:
                reader.close()
            except Exception as e:  # noqa: BLE001
                rec["close"] = f"{type(e).__name__}: {e}"[:400]
    log(f"[{job}] {str(rec)[:700]}")
    result.setdefault("killed_trainer", []).append(rec)


def _validate_by_loader(own, checkpoint: Path, result: dict) -> None:
    """WeightReader.validate's path through SGLang's own loader (``validate_via="sglang-loader"``) against the
    checkpoint the engine holds: every tensor equal; then one element flipped (and flipped back): named."""
    from weightsync.sglang.verify import flip
    from weightsync.validate import validate

    inst = own.instance
    rec: dict = {}
    try:
        inst.validate_via = "sglang-loader"
        t0 = time.perf_counter()
        report = validate(inst, checkpoint)
        rec.update(via=report.via, ok=report.ok, tensors=len(report.checks), seconds=time.perf_counter() - t0,
                   mismatched=[f"{c.rank}:{c.name}" for c in report.mismatched()][:10])
        name = next(n for n, _ in inst.engine_layout.layout(0).tensors.items())
        rec["flipped"], old = inst.call(flip, name)[0]
        try:
            bad = validate(inst, checkpoint)
        finally:
            inst.call(flip, name, old)
        rec["flipped_found"] = [f"{c.rank}:{c.name}" for c in bad.mismatched()]
        rec["ok_after_undo"] = validate(inst, checkpoint).ok
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    finally:
        inst.validate_via = "layout"
    log(f"[validate] via SGLang's loader: {str(rec)[:600]}")
    result["validate"] = rec


def colo(out: Path, models: list[str], first_extras: bool = True) -> dict:
    from weightsync.meta.server import MetaServer
    from weightsync.sglang.engine import EngineOptions, start
    from weightsync.spec.model import spec_from_config

    import sglang
    import torch

    result: dict = {"stage": "colo", "sglang": sglang.__version__, "torch": torch.__version__, "models": {}}
    root = Path(tempfile.mkdtemp(prefix="sglang-gpu-"))
    with MetaServer().start() as meta:
        for k, name in enumerate(models):
            cfg = MODELS[name]
            spec = spec_from_config(cfg)
            res: dict = {"model": name, "architecture": cfg["architectures"][0], "steps": [], "errors": []}
            result["models"][name] = res
            d = root / name
            try:
                paths = {s: save(cfg, s, d / f"seed{s}", "fp8" if name in FP8 else None) for s in SEEDS}
                cfg_path = paths[0]
                procs = {}
                for s in (1, 2):
                    procs[s] = _spawn_script("ref", str(paths[s]), str(d / f"ref{s}.json"), log_path=d / f"ref{s}.log")
                bad = None
                if k == 0 and first_extras:
                    bad = _spawn_script("bad", str(paths[1]), str(d / "bad.json"), log_path=d / "bad.log")
                t0 = time.perf_counter()
                own = start(cfg, ENGINE, EngineOptions(), checkpoint=str(paths[0]))
                res["startup_s"] = time.perf_counter() - t0
                res["cuda_graph"] = not bool(own.engine.server_args.disable_cuda_graph)
                res["api"] = own.instance.api
                res["engine"] = own.instance.engine
                res["mailbox"] = own.instance.mailbox  # the call mailbox started (0.5.14: expected)
                res["paths"] = own.instance.paths  # per rank: layers in-place / constant / derived (sglang/live.py)
                from weightsync.sglang.verify import methods

                res["methods"] = own.instance.call(methods)[0]  # quant methods, FP8 GEMM and MoE runner chosen
                log(f"[{name}] engine up in {res['startup_s']:.1f} s (decode CUDA graphs {res['cuda_graph']}, "
                    f"API {res['api']}, layout {res['engine']}, paths {res['paths']}, kernels "
                    f"{sorted(set(res['methods'].values()))})")
                try:
                    refs = {s: _wait_json(procs[s], d / f"ref{s}.json", d / f"ref{s}.log", 400) for s in (1, 2)}
                    for s, r in refs.items():
                        if "error" in r:
                            raise RuntimeError(f"reference engine seed {s}: {r['error']}")
                        log(f"[{name}] fresh engine seed {s}: up in {r['startup_s']:.1f} s, {len(r['digests'][0])} "
                            f"tensors, tokens {r['tokens']}")
                    res["ref_tokens"] = {s: refs[s]["tokens"] for s in refs}
                    res["ref_tokens_differ"] = refs[1]["tokens"] != refs[2]["tokens"]
                    _sync_steps(own, spec, cfg, cfg_path, refs, meta, f"{name}-colo", [(1, 1), (2, 2), (3, 1)],
                                True, "p2p", res)
                    if k == 0 and first_extras:
                        _sync_steps(own, spec, cfg, cfg_path, refs, meta, f"{name}-nixl", [(4, 2), (5, 1)], False,
                                    "nixl", res)
                        _mismatch(own, spec, cfg, refs, res["steps"][-1]["seed"], d, meta, res)
                        _validate_by_loader(own, paths[res["steps"][-1]["seed"]], res)
                        for colocate in (True, False):
                            _killed_trainer(own, spec, cfg, cfg_path, refs, meta, colocate, res)
                finally:
                    own.close()
                if bad is not None:
                    res["bad_engine"] = _wait_json(bad, d / "bad.json", d / "bad.log", 300)
                    log(f"[{name}] engine without the loader, float16: {res['bad_engine']}")
            except Exception as e:  # noqa: BLE001
                res["errors"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
                log(f"[{name}] FAILED: {type(e).__name__}: {e}")
            res["verified"] = (not res["errors"] and len(res["steps"]) >= 3 and all(r["ok"] for r in res["steps"])
                               and res.get("ref_tokens_differ", False))
            with open(out / "colo.json", "w") as f:  # after each model: a later hang keeps what ran
                json.dump(result, f, indent=1, default=str)
    result["verified"] = all(r["verified"] for r in result["models"].values())
    return result


def bench(out: Path, model: str, scenarios: list[str], steps: int,
          receivers: tuple[str, ...] = ("sglang", "faithful")) -> dict:
    """``receivers``: each ``sglang`` or ``faithful``, with ``:late`` for a reader that sends each step's call only
    after the trainers' `written` (``--call-after-written``; the default sends it before: weightsync.transport.gate)."""
    from weightsync.bench.run import run

    result: dict = {"stage": "bench", "model": model, "runs": []}
    for scenario in scenarios:
        for arm in receivers:
            receiver, _, late = arm.partition(":")
            t0 = time.perf_counter()
            try:
                r = run(scenario, model, steps=steps, timeout=300.0, baselines=(), device="cuda", receiver=receiver,
                        early_call=late != "late")
            except Exception as err:  # noqa: BLE001
                r = {"scenario": scenario, "receiver": receiver,
                     "errors": [f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"]}
            r["wall_seconds"] = time.perf_counter() - t0
            if receiver == "sglang":  # instance 0's SGLangInstance.last_timing per timed step ("instance.*" phases)
                phases = r.get("phase_median_seconds") or {}
                r["sglang_mailbox"] = "instance.mailbox" in phases  # every timed step's calls through the mailbox
                r["sglang_instance_ms"] = {k.removeprefix("instance."): v * 1e3 for k, v in phases.items()
                                           if k.startswith("instance.")}
            result["runs"].append(r)
            med = r.get("median_seconds")
            log(f"[bench] {scenario} {arm}: median {med * 1e3 if med else float('nan'):.2f} ms, efficiency "
                f"{r.get('efficiency')}, verified {r.get('verified')}, mailbox {r.get('sglang_mailbox', '-')} "
                f"{r.get('sglang_instance_ms', '')}, errors {str(r.get('errors'))[:1500]}")
            with open(out / "bench.json", "w") as f:
                json.dump(result, f, indent=1, default=str)
    result["verified"] = all(not r.get("errors") and r.get("verified") for r in result["runs"])
    return result


def _pings(inst, n: int = 20) -> list[tuple[float, float]]:
    """``n`` bare calls of the workers' ``ping``: per call the ms there (sent -> the worker's clock) and back."""
    from weightsync.sglang.verify import ping

    out = []
    for _ in range(n):
        t0 = time.time()
        (t1,) = inst.call(ping)
        t2 = time.time()
        out.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3))
    return out


def overhead(out: Path, steps: int = 24) -> dict:
    """Where an update's time goes in SGLang's call path (tiny Llama, co-located trainer), four arms in one run: per
    step the reader's phases and ``SGLangInstance.last_timing``, in turn ``quiet_updates=False`` (pause, call,
    flush, continue: four round trips), quiet through SGLang's request path (``use_mailbox=False``: the call alone,
    flushing in its own request, ``flush_in_calls``) and quiet through the call mailbox (no request; the flush by the
    scheduler's thread), its writer lock taken in place and, last arm, through the engine's loop; a greedy generate
    after every step, so every update has KV to flush; then bare calls (a ping there and back) with the message in a
    tensor, in the name and through the mailbox (at the default GIL switch interval and at 0.2 ms),
    ``Engine.flush_cache()``, and ``torch.cuda.empty_cache()`` inside the scheduler."""
    import statistics

    from weightsync.meta.server import MetaServer
    from weightsync.runtime.reader import WeightReader
    from weightsync.sglang.engine import EngineOptions, generate, start
    from weightsync.sglang.verify import empty_cache_seconds, switch_interval

    res: dict = {"stage": "overhead", "steps": [], "errors": []}
    root = Path(tempfile.mkdtemp(prefix="sglang-overhead-"))
    cfg = MODELS["llama"]
    path = save(cfg, 0, root / "seed0")
    own = start(cfg, ENGINE, EngineOptions(), checkpoint=str(path))
    inst = own.instance
    res["name_payload"] = inst._in_name
    try:
        with MetaServer().start() as meta:
            plan = [(k, 1 + k % 2) for k in range(1, steps + 1)]
            arms = ("paused", "quiet", "mailbox", "mailbox-loop")  # mailbox-loop: the writer lock through the loop
            trainer = Trainer(path, meta.url, "overhead", plan, colocate=True)
            reader = WeightReader(inst, meta=meta.url, job="overhead", instance_id=0, instances=1, timeout_s=120,
                                  colocate=True).connect()
            for step, _ in plan:
                arm = arms[step % len(arms)]
                inst.quiet_updates = arm != "paused"
                inst.use_mailbox = arm.startswith("mailbox")
                inst.lock_in_place = arm == "mailbox"
                t0 = time.perf_counter()
                reader.update(step)
                rec = {"step": step, "arm": arm, "quiet": inst.last_quiet, "mailbox": inst.last_mailbox,
                       "update_ms": (time.perf_counter() - t0) * 1e3,
                       "reader_ms": {k: v * 1e3 for k, v in reader.last_timing.items()},
                       "instance_ms": {k: v * 1e3 for k, v in inst.last_timing.items()}}
                res["steps"].append(rec)
                log(f"[overhead] {rec}")
                generate(own.engine)  # as an RL loop does: KV in the cache, so the next update must flush it
            reader.close()
            res["trainer"] = trainer.result()
        timed = res["steps"][len(arms):]  # the first steps open handles and compile (one step of each arm)
        for arm in arms:
            w = [r["reader_ms"]["workers"] for r in timed if r["arm"] == arm]
            res[f"workers_ms_median_{arm}"] = statistics.median(w) if w else None
        res["mailbox_used"] = [r["step"] for r in res["steps"] if r["mailbox"]]
        inst.use_mailbox = inst.quiet_updates = inst.lock_in_place = True  # the arms' last step may have set them off
        for in_name in (False, True):
            inst._in_name = in_name and res["name_payload"]
            res[f"ping_ms_there_back_{'name' if inst._in_name else 'tensor'}"] = _pings(inst)
        inst._in_name = res["name_payload"]
        inst.pause()  # a quiet update holding the writer lock: the same bare call through the call mailbox
        try:
            if inst.last_mailbox:
                res["ping_ms_there_back_mailbox"] = _pings(inst)
                # the GIL hypothesis: the mailbox thread waits for the GIL behind the scheduler's spinning loop
                before = inst.call(switch_interval, 0.0002)[0]  # TP=1 here
                res["ping_ms_there_back_mailbox_switch_0.2ms"] = _pings(inst)
                inst.call(switch_interval, before)
                res["switch_interval_s_before"] = before
        finally:
            inst.resume()
        flushes = []
        for _ in range(10):
            t0 = time.perf_counter()
            own.engine.flush_cache()
            flushes.append((time.perf_counter() - t0) * 1e3)
        res["flush_ms"] = flushes
        res["empty_cache_ms"] = [inst.call(empty_cache_seconds)[0] * 1e3 for _ in range(5)]
        for arm in ("mailbox", "mailbox-loop"):
            lock = [r["instance_ms"].get("lock", 0) + r["instance_ms"].get("unlock", 0) for r in timed if r["arm"] == arm]
            res[f"lock_unlock_ms_median_{arm}"] = statistics.median(lock) if lock else None
        log(f"[overhead] workers ms paused {res['workers_ms_median_paused']} quiet {res['workers_ms_median_quiet']} "
            f"mailbox {res['workers_ms_median_mailbox']} mailbox-loop {res['workers_ms_median_mailbox-loop']} "
            f"(lock+unlock ms in place {res['lock_unlock_ms_median_mailbox']}, through the loop "
            f"{res['lock_unlock_ms_median_mailbox-loop']}; steps through the mailbox: {res['mailbox_used']}); "
            f"flush ms {flushes}; empty_cache ms {res['empty_cache_ms']}; ping medians ms (there, back) "
            f"{ {k: tuple(round(statistics.median(x), 3) for x in zip(*v)) for k, v in res.items() if k.startswith('ping')} }")
    except Exception as e:  # noqa: BLE001
        res["errors"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
        log(f"[overhead] FAILED {e}")
    finally:
        own.close()
    res["verified"] = not res["errors"]
    return res


def warm(model: str) -> int:
    """Start and stop an engine of preset ``model`` on dummy weights: SGLang's JIT kernels for its shapes (nvcc,
    10-30 s each) and Triton's land in the caches, so a measured run started after it does not compile."""
    from weightsync.sglang.engine import EngineOptions, generate, start
    from weightsync.spec import load_spec

    t0 = time.perf_counter()
    own = start(dict(load_spec(model).config), ENGINE, EngineOptions())
    try:
        log(f"[warm] {model} up in {time.perf_counter() - t0:.1f} s; tokens {generate(own.engine)[0]}")
    finally:
        own.close()
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "warm":
        return warm(sys.argv[2])
    if len(sys.argv) > 1 and sys.argv[1] in ("ref", "bad"):
        import logging

        logging.basicConfig(level=logging.WARNING)
        return (ref_main if sys.argv[1] == "ref" else bad_main)(sys.argv[2], sys.argv[3])
    p = argparse.ArgumentParser()
    p.add_argument("stage", choices=["colo", "bench", "overhead"])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--models", default="llama,qwen3", help="colo: of " + ",".join(MODELS))
    p.add_argument("--no-extras", action="store_true", help="colo: skip the NIXL job and the bad-input checks")
    p.add_argument("--model", default="qwen3-8b", help="bench: the preset")
    p.add_argument("--scenarios", default="colo-1gpu,nixl-1gpu")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--receivers", default="sglang,faithful",
                   help="bench: sglang, faithful, each with :late for the call after the trainers' written")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("sglang").setLevel(logging.WARNING)
    if a.stage == "colo":
        r = colo(out, a.models.split(","), not a.no_extras)
    elif a.stage == "overhead":
        r = overhead(out)
    else:
        r = bench(out, a.model, a.scenarios.split(","), a.steps, tuple(a.receivers.split(",")))
    with open(out / f"{a.stage}.json", "w") as f:
        json.dump(r, f, indent=1, default=str)
    log(f"[{a.stage}] verified {r['verified']}")
    return 0 if r["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
