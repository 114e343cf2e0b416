"""FP8 on the wire into a REAL block-FP8 vLLM engine on one GPU (issue 24), then the FP8 bench beside bf16.

    python benchmarks/fp8_vllm_gpu.py --out DIR [--transports colocated,nixl] [--bench qwen3-8b]
    # on the GPU host, with the vLLM kit + 2 wheels (and NIXL on the path for nixl)

``sync``: a tiny Qwen3 (``tiny-qwen3-fp8``; ``--model tiny-qwen3-moe-fp8``: its MoE twin, 8 experts; 2 layers, hidden 256, head_dim 128, every linear a whole number of
128 x 128 blocks; ``--model benchmarks/configs/tiny-deepseek-v3-hopper.json``: DeepSeek-V3-shaped, MLA with the head dims
vLLM 0.26 prefills on Hopper, ran bit-exact on 1 x H100 on 2026-12-07; ``tiny-qwen3-moe-fp8`` does not start in vLLM
0.26, whose Qwen3-MoE router is an FP8 linear there, docs/fp8.md). Two FP8 checkpoints written by ``save_checkpoint(dir, quant="fp8")`` from bf16 weights of seeds
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

``nixl`` (``--transports``, after co-located on the same two engines): a second job, the same steps, with the
trainer process separate (``WeightWriter(transport="nixl")``, nixl-1gpu's wiring): it quantizes each distinct bucket
into its registered frames region (the Triton kernel on cuda:0) and X's workers READ the payloads alone over UCX
(cuda_ipc) and write the e4m3 bytes and scales into X's live weights; the same checks after each step, X going from
seed 1 (fresh, or the co-located job's last step) to 2 and back. ``DIR/fp8_sync_nixl.json``.

``--bench MODEL``: ``weightsync bench --scenario colo-1gpu --quant fp8`` (bf16 then FP8 in one run, the layout-
faithful receiver, the device-copy ceiling and the quantize kernel's own time measured in the same run);
``DIR/fp8_bench.json``; ``--bench-scenarios colo-1gpu,nixl-1gpu`` adds ``DIR/fp8_bench_nixl-1gpu.json``.

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


def save_fp8(seed: int, directory: Path, model: str = MODEL) -> Path:
    """``save_checkpoint(dir, quant="fp8")`` of the bf16 weights of ``seed`` (one HF training rank, on CPU)."""
    import torch
    from vllm_harness import weights

    from weightsync.bind.train import HFTrainEngine
    from weightsync.checkpoint import save_checkpoint
    from weightsync.checkpoint.hf import build_hf_model
    from weightsync.layout.materialize import fill_from
    from weightsync.spec import load_spec

    spec = load_spec(model)
    bound = HFTrainEngine(build_hf_model(spec, seed=0)).bound
    with torch.no_grad():
        fill_from(bound.layout, bound.tensors, weights(spec, seed))
    r = save_checkpoint(bound, directory, quant="fp8")
    print(f"[fp8] seed {seed}: FP8 checkpoint {r.quant_bytes} bytes in {directory}", flush=True)
    return directory


def trainer_main(meta: str, job: str, q, transport: str = "colocated", model: str = MODEL) -> None:
    """The training process: transformers' layout on cuda:0, bf16, one WeightWriter (co-located or over nixl,
    integrity off)."""
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
        spec = load_spec(model)
        bound = build_trainer(spec, "hf", 0, 1, same_start=False, device="cuda").bound
        writer = WeightWriter(bound, meta=meta, job=job, timeout_s=120, integrity=0,
                              **_transport_kw(transport)).connect()
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


#: each job's transport: the WeightWriter's / WeightReader's arguments and the bench scenario it corresponds to
TRANSPORTS = {"colocated": ({"colocate": True}, "colo-1gpu"), "nixl": ({"transport": "nixl"}, "nixl-1gpu")}


def _transport_kw(transport: str) -> dict:
    return dict(TRANSPORTS[transport][0])


def sync(graphs: bool = False, transports: tuple[str, ...] = ("colocated",), model: str = MODEL) -> list[dict]:
    """One result per transport: a job each, in order, into the same two engines (X synced, Y the reference)."""
    import torch
    from vllm_harness import generate, start_llm, stop_llm

    from weightsync.instances.vllm import VLLMInstance
    from weightsync.meta.server import MetaServer
    from weightsync.quant.engine_check import computed, layer_methods, live_paths

    import vllm

    results = [{"stage": "fp8-sync", "model": model, "vllm": vllm.__version__, "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0), "steps": [], "errors": [], "receiver": "vllm", "quant": "fp8",
                "scenario": TRANSPORTS[t][1], "job_transport": t, "commit": os.environ.get("WEIGHTSYNC_COMMIT")}
               for t in transports]
    root = Path(tempfile.mkdtemp(prefix="fp8-vllm-"))
    llms: dict = {}
    try:
        paths = {s: save_fp8(s, root / f"fp8-seed{s}", model) for s in (1, 2)}
        with MetaServer().start() as meta:
            t0 = time.perf_counter()
            # the worker extension's entry (VLLMInstance); the "weightsync" weight-transfer plug-in is registered
            # by weightsync's entry point, which a snapshot run without installing weightsync does not have
            llms["X"] = start_llm(paths[1], backend=False, **_llm_kw(graphs))
            llms["Y"] = start_llm(paths[2], backend=False, **_llm_kw(graphs))
            startup = time.perf_counter() - t0
            insts = {n: VLLMInstance(llm) for n, llm in llms.items()}
            engine = dict(cuda_graphs=graphs, startup_s=startup, engine_string=insts["X"].engine,
                          layer_methods=insts["X"].call(layer_methods)[0], live_paths=insts["X"].call(live_paths)[0])
            refs = {1: (insts["X"].call(computed)[0], generate(llms["X"])),
                    2: (insts["Y"].call(computed)[0], generate(llms["Y"]))}
            engine.update(reference_tokens_differ=refs[1][1] != refs[2][1], computed_tensors=len(refs[1][0]),
                          fp8_params=sum(1 for k in refs[1][0] if k.endswith(":float8_e4m3fn")))
            print(f"[fp8] engines up in {startup:.1f} s: {engine['engine_string']}; {engine['live_paths']}; "
                  f"kernels {sorted(set(engine['layer_methods'].values()))}", flush=True)
            for transport, result in zip(transports, results):
                result.update(engine)
                try:
                    _job(transport, result, meta.url, insts["X"], llms["X"], refs, model)
                except Exception as err:  # noqa: BLE001 - recorded; the next transport still runs
                    result["errors"].append(f"{type(err).__name__}: {err}\n{traceback.format_exc()[-4000:]}")
    except Exception as err:  # noqa: BLE001 - recorded
        for result in results:
            result["errors"].append(f"{type(err).__name__}: {err}\n{traceback.format_exc()[-4000:]}")
    finally:
        for llm in llms.values():
            stop_llm(llm)
    ok = lambda r: r["computed_equal"] and r["tokens_equal"] and r["checkpoint_equal"]  # noqa: E731
    for result in results:
        result["verified"] = (not result["errors"] and len(result["steps"]) == len(STEPS)
                              and all(map(ok, result["steps"])) and result.get("reference_tokens_differ", False)
                              and not any(m[0] == "err" for m in result.get("trainer", [])))
    return results


def _job(transport: str, result: dict, meta: str, inst, llm, refs: dict, model: str = MODEL) -> None:
    """One job (its own name at the MetaServer): a trainer process writes ``STEPS``, X syncs each over ``transport``
    and is compared with the fresh engine on that seed; what each step showed goes to ``result["steps"]``."""
    from vllm_harness import generate, weights

    from weightsync.quant.engine_check import computed, differences, loaded_problems
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    spec = load_spec(model)
    job = f"fp8-{transport}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=trainer_main, args=(meta, job, q, transport, model), daemon=True)
    proc.start()
    try:
        t0 = time.perf_counter()
        reader = WeightReader(inst, meta=meta, job=job, instance_id=0, instances=1, timeout_s=120, integrity=0,
                              **_transport_kw(transport)).connect()
        result["setup_s"] = time.perf_counter() - t0
        result["transport"] = reader.session.options.transport_name
        for step, seed in STEPS:
            t0 = time.perf_counter()
            reader.update(step)
            rec = {"step": step, "seed": seed, "update_seconds": time.perf_counter() - t0,
                   "transfer_seconds": max(s.seconds for s in reader.last_stats),
                   "bytes": sum(s.bytes for s in reader.last_stats),
                   "full_bytes": sum(s.stats.full_bytes for s in reader.last_stats)}
            mine = inst.call(computed)[0]
            diff = differences(mine, refs[seed][0])
            rec["computed_equal"] = not diff
            rec["differences"] = diff[:10]
            rec["gemms"] = sum(1 for k in mine if k.startswith("gemm:"))
            rec["tokens_equal"] = generate(llm) == refs[seed][1]
            problems = [p for ps in inst.call(loaded_problems, weights(spec, seed)) for p in ps]
            rec["checkpoint_equal"] = not problems
            rec["problems"] = problems[:10]
            result["steps"].append(rec)
            print(f"[fp8] {transport} step {step} <- seed {seed}: {rec['bytes']} bytes (bf16 plan "
                  f"{rec['full_bytes']}) in {rec['update_seconds'] * 1e3:.1f} ms; computed equal "
                  f"{rec['computed_equal']} ({len(mine)} tensors, {rec['gemms']} GEMMs), tokens equal "
                  f"{rec['tokens_equal']}, checkpoint equal {rec['checkpoint_equal']}", flush=True)
        reader.close()
    finally:
        proc.join(60)
        msgs = []
        while not q.empty():
            msgs.append(q.get())
        result["trainer"] = [list(m) for m in msgs]
        if proc.is_alive():
            proc.kill()


def bench(model: str, steps: int, scenario: str = "colo-1gpu") -> dict:
    from weightsync.bench.run import run_quant

    return run_quant(scenario, model, steps=steps, timeout=300.0, device="cuda")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--bench", default="", help="also run the FP8 bench (bf16 beside it) on this model")
    p.add_argument("--bench-scenarios", default="colo-1gpu", help="comma-separated: colo-1gpu, nixl-1gpu")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--skip-sync", action="store_true")
    p.add_argument("--transports", default="colocated",
                   help="comma-separated, in order, each a job into the same engines: colocated, nixl")
    p.add_argument("--graphs", action="store_true", help="engines with torch.compile + CUDA graphs (default eager)")
    p.add_argument("--model", default=MODEL, help="the sync's preset or config.json path (FP8 blocks whole: tiny-qwen3-fp8, "
                                                  "tiny-qwen3-moe-fp8)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ok = True
    transports = tuple(t for t in a.transports.split(",") if t)
    unknown = set(transports) - set(TRANSPORTS)
    if unknown:
        p.error(f"--transports: unknown {sorted(unknown)}; known: {', '.join(TRANSPORTS)}")
    if not a.skip_sync:
        for t, r in zip(transports, sync(a.graphs, transports, a.model)):
            name = ("fp8_sync" + ("" if t == "colocated" else f"_{t}") + ("" if a.model == MODEL else f"_{Path(a.model).name.removesuffix('.json')}")
                    + ".json")
            with open(out / name, "w") as f:
                json.dump(r, f, indent=1, default=str)
            print(f"[fp8] {t} sync verified {r['verified']}; errors {r['errors'][:1]}", flush=True)
            ok = ok and r["verified"]
    for scenario in [s for s in a.bench_scenarios.split(",") if s] if a.bench else []:
        try:
            b = bench(a.bench, a.steps, scenario)
        except Exception as err:  # noqa: BLE001
            b = {"errors": [f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"], "verified": False}
        with open(out / ("fp8_bench.json" if scenario == "colo-1gpu" else f"fp8_bench_{scenario}.json"), "w") as f:
            json.dump(b, f, indent=1, default=str)
        print(f"[fp8] {scenario} bench verified {b.get('verified')}; errors {b.get('errors', [])[:1]}", flush=True)
        ok = ok and bool(b.get("verified"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
