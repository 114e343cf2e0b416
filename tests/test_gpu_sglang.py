"""weightsync into a REAL SGLang engine on one GPU (`make test-gpu` on the GPU host, with the SGLang GPU kit on the
path: `. .sgkit/go.sh`). Skipped without a CUDA GPU or without SGLang importable (SGLang has no CPU build: CI tests
the adapter's layouts and protocol on CPU, tests/test_sglang_*.py).

Every engine starts in a child process (``benchmarks/sglang_gpu.py``, run with ``subprocess``): this pytest process
never initializes CUDA, so nothing forks after it did. The script's checks after every step: every written
tensor bit-exact to the checkpoint, every tensor the engine computes with bit-exact to a FRESH SGLang engine
loaded from the same ``save_pretrained`` folder, the same greedy tokens (decode CUDA graphs on), the weight
version. ``WEIGHTSYNC_GPU_OUT`` keeps the JSON and logs there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU (SGLang has no CPU build)"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                       reason="SGLang not importable: put the SGLang GPU kit on the path (. .sgkit/go.sh)"),
]


def _colo(models: str, *extra: str, timeout: float = 560) -> dict:
    out = Path(os.environ.get("WEIGHTSYNC_GPU_OUT") or tempfile.mkdtemp(prefix="sglang-gpu-test-")) / models.replace(",", "-")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "log", "w") as log:
        p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sglang_gpu.py"), "colo", "--out", str(out),
                            "--models", models, *extra], stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                           start_new_session=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                               [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    path = out / "colo.json"
    assert path.exists(), f"exit {p.returncode}, no colo.json: {(out / 'log').read_text()[-4000:]}"
    return json.loads(path.read_text())


def _assert_steps(res: dict, jobs: set[str]) -> None:
    assert not res["errors"], res["errors"]
    assert res["cuda_graph"] and res["ref_tokens_differ"], res
    assert {s["job"] for s in res["steps"]} == jobs, res["steps"]
    for s in res["steps"]:
        assert s["loaded_exact"] and s["computed_equal"] and s["tokens_equal"] and s["version_ok"], s
    if res.get("api") == "0.5.14":
        # the call mailbox: every update's calls went straight to the scheduler's mailbox thread (no SGLang request),
        # the KV cache flushed by the scheduler's own thread; the script generates between steps, so a step whose
        # flush was missed would serve the prompts' prefixes from KV of the previous weights (tokens would differ)
        assert res.get("mailbox"), "the call mailbox did not start (the engine's log says why)"
        assert all(s.get("mailbox") for s in res["steps"]), [(s["job"], s["step"], s.get("mailbox")) for s in res["steps"]]


@pytest.fixture(scope="module")
def llama() -> dict:
    return _colo("llama")


@pytest.mark.xdist_group("sglang-llama")  # one worker runs the fixture's engines once (make test-gpu -n N)
def test_llama_colocated_cuda_ipc_then_nixl_then_bad_input(llama):
    """Co-located (CUDA IPC into the live parameters, steps 1-3), then a separated trainer over NIXL (steps 4-5),
    all bit-exact to fresh engines; a trainer of another model is refused at set-up and the engine still serves
    the previous weights; an engine started without weightsync's loader and in float16 is refused in one line."""
    r = llama
    res = r["models"]["llama"]
    _assert_steps(res, {"llama-colo", "llama-nixl"})
    assert res["api"] == "0.5.14" or r["sglang"] != "0.5.14"
    m = res["mismatch"]
    assert m["refused"] and "model spec" in m["refused"] and m["computed_equal"] and m["tokens_equal"], m
    bad = res["bad_engine"]
    assert "custom_weight_loader" in bad["refused"] and "dtype mismatch" in bad["refused"], bad
    assert "\n" not in bad["refused"] and bad["serves_after"], bad


@pytest.mark.xdist_group("sglang-llama")
def test_validate_through_sglangs_own_loader_finds_a_flipped_element(llama):
    """``validate_via="sglang-loader"``: every tensor the engine computes with equals a fresh model SGLang's own
    loader builds from the held checkpoint in the worker; one flipped element is named, and gone once undone."""
    v = llama["models"]["llama"].get("validate")
    assert v and "error" not in v, v
    assert v["via"] == "sglang-loader" and v["ok"] and v["tensors"] >= 16, v
    assert len(v["flipped_found"]) == 1 and v["flipped"].split(": ")[1].startswith(
        v["flipped_found"][0].split(":", 1)[1].removeprefix("param:")), v
    assert v["ok_after_undo"], v


@pytest.mark.xdist_group("sglang-llama")
@pytest.mark.parametrize("job", ["killed-colo", "killed-nixl"])
def test_a_trainer_killed_with_its_step_announced_leaves_the_engine_serving_one_whole_step(llama, job):
    """The trainer SIGKILLs itself right after its step 2 is recorded written; the staged reader's update(2) takes
    the step whole or fails within its deadline, and the engine keeps serving exactly one of the two steps
    (every tensor it computes with equal to a fresh engine's on it, greedy tokens equal)."""
    recs = {r["job"]: r for r in llama["models"]["llama"].get("killed_trainer", [])}
    r = recs.get(job)
    assert r and "error" not in r, r
    assert r["trainer"][0] == "killed", r
    assert r["ok"], r


@pytest.fixture(scope="module")
def others() -> dict:
    return _colo("qwen3,qwen2,qwen3moe", "--no-extras")


@pytest.mark.xdist_group("sglang-others")  # one worker runs the module fixture's engines once (make test-gpu -n N)
@pytest.mark.parametrize("model", ["qwen3", "qwen2", "qwen3moe"])
def test_other_architectures_colocated_bit_exact(others, model):
    res = others["models"][model]
    fresh_failed = [e for e in res["errors"] if e.startswith("RuntimeError: reference engine")]
    if model == "qwen3moe" and fresh_failed:  # a FRESH SGLang engine (no weightsync) cannot run it from the kit
        pytest.skip(f"the SGLang GPU kit cannot run Qwen3-MoE: {fresh_failed[0][:600]}")
    _assert_steps(res, {f"{model}-colo"})


@pytest.mark.parametrize("model", ["deepseek", "deepseek-fp8"])
def test_deepseek_v3_shaped_mla_in_bf16_and_block_fp8_colocated_bit_exact(model):
    """DeepSeek-V3-shaped (MLA with q_lora_rank, shared + routed experts, a dense first layer, noaux_tc), bf16 from
    ``save_pretrained`` and block FP8 from ``save_checkpoint(dir, quant="fp8")``: three co-located steps, after each
    every tensor the engine computes with -- FP8 weights and scales, MLA's derived ``w_kc``/``w_vc`` (re-derived by
    ``post_load_weights``), the KV-cache scales -- equal to a FRESH engine's on that step's checkpoint, greedy tokens
    equal. On Hopper's default kernels no layer is refused (docs/sglang.md §7). Written 2026-12-07; not yet run."""
    res = _colo(model, "--no-extras")["models"][model]
    _assert_steps(res, {f"{model}-colo"})
    fp8 = model.endswith("fp8")
    assert res["engine"].endswith("quant=fp8") == fp8, res["engine"]
    (paths,) = res["paths"]
    assert paths.get("derived") == 2 and (paths.get("constant", 0) > 0) == fp8, paths  # 2 MLA layers; FP8 KV scales
    kinds = set(res["methods"].values())
    if fp8:  # the GEMM SGLang picked on this host (DeepGEMM where sgl-deep-gemm imports, else CUTLASS) and Triton experts
        assert any(k.startswith("Fp8LinearMethod/") for k in kinds) and "Fp8MoEMethod/triton" in kinds, kinds
    derived = [n for n in res["steps"][0].get("computed_names", []) if n.startswith("derived:")]
    assert not res["steps"][0].get("computed_names") or len(derived) == 4, derived


#: the demo's model: a tiny Qwen3 whose shapes the kit's prebuilt JIT kernels cover (head_dim 64, 2 KV heads)
DEMO_MODEL = dict(json.loads((ROOT / "weightsync" / "spec" / "presets" / "tiny-qwen3-h64.json").read_text()),
                  num_key_value_heads=2)


#: the packages weightsync.transport.nixl_wire.load_nixl loads NIXL from (looked up, not imported: no CUDA here)
NIXL_BUILDS = ("nixl", "nixl_cu13", "nixl_cu12")


@pytest.mark.parametrize("how", ["--colocate", "--transport=nixl"])
def test_demo_real_sglang_each_step_bit_exact_to_a_fresh_engine(tmp_path, how):
    """``weightsync demo --engines real --device cuda --infer sglang:tp=1`` with a trainer process on the same GPU:
    co-located (CUDA IPC) or separated over NIXL (the engine shares the trainer's GPU); every step the engine's
    tensors are bit-exact to the trainer's, everything it computes with equals a FRESH SGLang engine's on the
    step's checkpoint (digests), and its greedy tokens equal that engine's."""
    if how.startswith("--transport=nixl") and not any(importlib.util.find_spec(n) for n in NIXL_BUILDS):
        pytest.skip(f"NIXL is not importable here (none of {NIXL_BUILDS}; the GPU host carries it in .nixlwhl)")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(DEMO_MODEL))
    out = Path(os.environ.get("WEIGHTSYNC_GPU_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"demo{how.replace('=', '-')}.log"
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, "-m", "weightsync", "demo", "--engines", "real", "--device", "cuda",
                            "--infer", "sglang:tp=1", "--train", "hf", "--model", str(cfg), "--steps", "2", "--json",
                            how], stdout=subprocess.PIPE, stderr=f, timeout=560, start_new_session=True, text=True,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"exit {p.returncode}, no JSON: {p.stdout[-2000:]} {log.read_text()[-4000:]}"
    res = json.loads(lines[-1])
    (out / f"demo{how.replace('=', '-')}.json").write_text(json.dumps(res, indent=1))
    assert not res["errors"] and res["verified"], res
    assert [s["step"] for s in res["steps"]] == [1, 2]
    for s in res["steps"]:
        (i,) = s["instances"]
        assert i["exact"] and i["tokens_equal"] is True and i["version"] == s["step"], s
