"""FP8 on the wire into a REAL block-FP8 vLLM engine on one GPU (issue 24), then the FP8 bench beside bf16.

    python benchmarks/fp8_vllm_gpu.py --out DIR [--bench qwen3-8b]   # on the GPU host, with the vLLM kit + 2 wheels

``sync``: a tiny Qwen3 (``tiny-qwen3-fp8``: 2 layers, hidden 256, head_dim 128, every linear a whole number of
128 x 128 blocks). Two FP8 checkpoints written by ``save_checkpoint(dir, quant="fp8")`` from bf16 weights of seeds
1 and 2 (``tests/vllm_harness.weights``). Two real vLLM engines on the same GPU (eager; ``--graphs``: CUDA graphs): X fresh on the
seed-1 checkpoint, Y fresh on seed 2; what each computes with (:func:`weightsync.quant.engine_check.computed`:
every parameter's bits -- e4m3 weights, fp32 ``weight_scale_inv``, bf16 norms and embeddings -- and every linear's
output on a fixed bf16 input) and its greedy tokens are the references. A training process (transformers' layout,
bf16 on cuda:0, a ``WeightWriter`` with ``colocate=True``, ``integrity=0``) then writes step 1 = seed 2 and step 2
= seed 1; ``WeightReader(VLLMInstance(X), colocate=True)`` syncs them: the job's engine string comes from X's own
model config (``vllm:tp=1,quant=fp8``), so both sides use the fp8 codec, and the co-located worker quantizes
straight from the trainer's memory (CUDA IPC) into X's live e4m3 weights and scales. After each step X must equal
the fresh engine on that seed in every computed tensor (bit for bit) and in its greedy tokens, and its live tensors
must equal the FP8 checkpoint's (:func:`weightsync.quant.engine_check.loaded_problems`). ``DIR/fp8_sync.json``.

``--bench MODEL``: ``weightsync bench --scenario colo-1gpu --quant fp8`` (bf16 then FP8 in one run, the layout-
faithful receiver, the device-copy ceiling and the quantize kernel's own time measured in the same run);
``DIR/fp8_bench.json``.

Every stage records what failed instead of stopping; exit status 0 only when everything held.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # vllm_harness
sys.path.insert(0, str(HERE.parent))

MODEL = "tiny-qwen3-fp8"
STEPS = [(1, 2), (2, 1)]  # (step, seed): each step changes every weight


def _llm_kw(graphs: bool) -> dict:
    kw = dict(gpu_memory_utilization=0.1, kv_cache_memory_bytes=256 << 20, max_num_seqs=8)
    if graphs:  # torch.compile + CUDA graphs: tens of seconds more per engine start
        return dict(kw, enforce_eager=False, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})
    return dict(kw, enforce_eager=True)


def save_fp8(seed: int, directory: Path) -> Path:
    """``save_checkpoint(dir, quant="fp8")`` of the bf16 weights of ``seed`` (one HF training rank, on CPU)."""
    import torch
    from vllm_harness import weights

    from weightsync.bind.train import HFTrainEngine
    from weightsync.checkpoint import save_checkpoint
    from weightsync.checkpoint.hf import build_hf_model
    from weightsync.layout.materialize import fill_from
    from weightsync.spec import load_spec

    spec = load_spec(MODEL)
    bound = HFTrainEngine(build_hf_model(spec, seed=0)).bound
    with torch.no_grad():
        fill_from(bound.layout, bound.tensors, weights(spec, seed))
    r = save_checkpoint(bound, directory, quant="fp8")
    print(f"[fp8] seed {seed}: FP8 checkpoint {r.quant_bytes} bytes in {directory}", flush=True)
    return directory


def trainer_main(meta: str, job: str, q) -> None:
    """The training process: transformers' layout on cuda:0, bf16, one WeightWriter (co-located, integrity off)."""
    import torch
    from vllm_harness import weights

    from weightsync.layout.materialize import fill_from
    from weightsync.local.trainers import build_trainer
    from weightsync.runtime.writer import WeightWriter
    from weightsync.spec import load_spec

    try:
        import torch.distributed as dist

        from weightsync.transport.group import free_port

        torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        spec = load_spec(MODEL)
        bound = build_trainer(spec, "hf", 0, 1, same_start=False, device="cuda").bound
        writer = WeightWriter(bound, meta=meta, job=job, timeout_s=120, colocate=True, integrity=0).connect()
        for step, seed in STEPS:
            with torch.no_grad():
                fill_from(bound.layout, bound.tensors, weights(spec, seed))
            t0 = time.perf_counter()
            writer.write(step)
            q.put(("wrote", step, time.perf_counter() - t0))
        writer.close()
        q.put(("ok", 0, 0.0))
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        q.put(("err", 0, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))
        raise


def sync(out: Path, graphs: bool = False) -> dict:
    import torch
    from vllm_harness import generate, start_llm, stop_llm, weights

    from weightsync.instances.vllm import VLLMInstance
    from weightsync.meta.server import MetaServer
    from weightsync.quant.engine_check import computed, differences, layer_methods, live_paths, loaded_problems
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    import vllm

    result: dict = {"stage": "fp8-sync", "model": MODEL, "vllm": vllm.__version__, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0), "steps": [], "errors": [], "receiver": "vllm",
                    "quant": "fp8", "scenario": "colo-1gpu", "commit": os.environ.get("WEIGHTSYNC_COMMIT")}
    spec = load_spec(MODEL)
    root = Path(tempfile.mkdtemp(prefix="fp8-vllm-"))
    paths = {s: save_fp8(s, root / f"fp8-seed{s}") for s in (1, 2)}
    llms: dict = {}
    try:
        with MetaServer().start() as meta:
            t0 = time.perf_counter()
            # the worker extension's entry (VLLMInstance); the "weightsync" weight-transfer plug-in is registered
            # by weightsync's entry point, which a snapshot run without installing weightsync does not have
            llms["X"] = start_llm(paths[1], backend=False, **_llm_kw(graphs))
            llms["Y"] = start_llm(paths[2], backend=False, **_llm_kw(graphs))
            result["cuda_graphs"] = graphs
            result["startup_s"] = time.perf_counter() - t0
            insts = {n: VLLMInstance(llm) for n, llm in llms.items()}
            result["engine_string"] = insts["X"].engine
            result["layer_methods"] = insts["X"].call(layer_methods)[0]
            result["live_paths"] = insts["X"].call(live_paths)[0]
            refs = {1: (insts["X"].call(computed)[0], generate(llms["X"])),
                    2: (insts["Y"].call(computed)[0], generate(llms["Y"]))}
            result["reference_tokens_differ"] = refs[1][1] != refs[2][1]
            result["computed_tensors"] = len(refs[1][0])
            result["fp8_params"] = sum(1 for k in refs[1][0] if k.endswith(":float8_e4m3fn"))
            print(f"[fp8] engines up in {result['startup_s']:.1f} s: {result['engine_string']}; "
                  f"{result['live_paths']}; kernels {sorted(set(result['layer_methods'].values()))}", flush=True)
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            proc = ctx.Process(target=trainer_main, args=(meta.url, "fp8-colo", q), daemon=True)
            proc.start()
            try:
                reader = WeightReader(insts["X"], meta=meta.url, job="fp8-colo", instance_id=0, instances=1,
                                      timeout_s=120, colocate=True, integrity=0).connect()
                result["transport"] = reader.session.options.transport_name
                for step, seed in STEPS:
                    t0 = time.perf_counter()
                    reader.update(step)
                    rec = {"step": step, "seed": seed, "update_seconds": time.perf_counter() - t0,
                           "transfer_seconds": max(s.seconds for s in reader.last_stats),
                           "bytes": sum(s.bytes for s in reader.last_stats),
                           "full_bytes": sum(s.stats.full_bytes for s in reader.last_stats)}
                    mine = insts["X"].call(computed)[0]
                    diff = differences(mine, refs[seed][0])
                    rec["computed_equal"] = not diff
                    rec["differences"] = diff[:10]
                    rec["gemms"] = sum(1 for k in mine if k.startswith("gemm:"))
                    rec["tokens_equal"] = generate(llms["X"]) == refs[seed][1]
                    problems = [p for ps in insts["X"].call(loaded_problems, weights(spec, seed)) for p in ps]
                    rec["checkpoint_equal"] = not problems
                    rec["problems"] = problems[:10]
                    result["steps"].append(rec)
                    print(f"[fp8] step {step} <- seed {seed}: {rec['bytes']} bytes (bf16 plan {rec['full_bytes']}) "
                          f"in {rec['update_seconds'] * 1e3:.1f} ms; computed equal {rec['computed_equal']} "
                          f"({len(mine)} tensors, {rec['gemms']} GEMMs), tokens equal {rec['tokens_equal']}, "
                          f"checkpoint equal {rec['checkpoint_equal']}", flush=True)
                reader.close()
            finally:
                proc.join(60)
                msgs = []
                while not q.empty():
                    msgs.append(q.get())
                result["trainer"] = [list(m) for m in msgs]
                if proc.is_alive():
                    proc.kill()
    except Exception as err:  # noqa: BLE001 - recorded
        result["errors"].append(f"{type(err).__name__}: {err}\n{traceback.format_exc()[-4000:]}")
    finally:
        for llm in llms.values():
            stop_llm(llm)
    ok = lambda r: r["computed_equal"] and r["tokens_equal"] and r["checkpoint_equal"]  # noqa: E731
    result["verified"] = (not result["errors"] and len(result["steps"]) == len(STEPS) and all(map(ok, result["steps"]))
                          and result.get("reference_tokens_differ", False)
                          and not any(m[0] == "err" for m in result.get("trainer", [])))
    return result


def bench(model: str, steps: int) -> dict:
    from weightsync.bench.run import run_quant

    return run_quant("colo-1gpu", model, steps=steps, timeout=300.0, device="cuda")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--bench", default="", help="also run the colo-1gpu FP8 bench (bf16 beside it) on this model")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--skip-sync", action="store_true")
    p.add_argument("--graphs", action="store_true", help="engines with torch.compile + CUDA graphs (default eager)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ok = True
    if not a.skip_sync:
        r = sync(out, a.graphs)
        with open(out / "fp8_sync.json", "w") as f:
            json.dump(r, f, indent=1, default=str)
        print(f"[fp8] sync verified {r['verified']}; errors {r['errors'][:1]}", flush=True)
        ok = ok and r["verified"]
    if a.bench:
        try:
            b = bench(a.bench, a.steps)
        except Exception as err:  # noqa: BLE001
            b = {"errors": [f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"], "verified": False}
        with open(out / "fp8_bench.json", "w") as f:
            json.dump(b, f, indent=1, default=str)
        print(f"[fp8] bench verified {b.get('verified')}; errors {b.get('errors', [])[:1]}", flush=True)
        ok = ok and bool(b.get("verified"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
