"""The ``weightsync demo``'s processes: training ranks that train and write, inference instances that update
and check every step bit for bit.

Each training rank takes real optimizer steps, saves the canonical regions it holds after each, and rank 0 puts
them together into the step's full weights (checking that replicas agree); each instance, after each update,
compares every tensor with them (and, for transformers instances, its logits with the trainer's where the trainer
computes them as one transformers model would; ``--engines real``: what a real vLLM engine computes with and its
greedy tokens against a fresh engine started on the step's weights). Both run under
:class:`~weightsync.local.runner.LocalJob`, added by :func:`add_participants`.
"""

from __future__ import annotations

import os
import shutil
import time

import torch

from weightsync.errors import WeightSyncError
from weightsync.local.demo_job import DemoConfig, Joined, Killed, jobs, quant_args, transport_args
from weightsync.local.events import Participant, Ready, StepDone, StepStarted
from weightsync.local.runner import Emit, LocalJob


class VerificationError(WeightSyncError):
    """An instance's tensors (or logits) differ from the trainers' after an update that returned."""


def add_participants(job: LocalJob, cfg: DemoConfig, refdir: str) -> int:
    """Add every training rank and inference instance of ``cfg`` to ``job`` (entered: its MetaServer is up);
    ``refdir`` is where the trainers leave each step's reference weights. Returns the training world size."""
    from weightsync.engines import make_layout
    from weightsync.spec import load_spec
    from weightsync.transport.group import free_port

    spec = load_spec(cfg.model)
    world = make_layout(spec, cfg.train).world_size
    port = free_port()
    # each participant gets the token of its own job(s) only (None where the MetaServer has none), never the admin's
    tokens = {name: job.job_token(name) for name, _ in jobs(cfg)}
    for r in range(world):
        job.add(Participant.trainer(r), trainer_main, r, world, port, job.meta_url, cfg, refdir, tokens)
    gpu = 0 if cfg.colocate else world  # separated: instances on the GPUs after the trainers'
    for name, engine in jobs(cfg):
        per = make_layout(spec, engine).world_size
        for i in range(cfg.instances + (cfg.join_at is not None)):  # the last one joins later (--join-at)
            job.add(Participant.instance(i, name), reader_main, name, engine, i, cfg.instances, job.meta_url, cfg,
                    refdir, gpu, tokens[name])
            gpu = (gpu + per) % world if cfg.colocate else gpu + per
    return world


# -- training processes -----------------------------------------------------------------------------


def trainer_main(emit: Emit, rank: int, world: int, port: int, meta: str, cfg: DemoConfig, refdir: str,
                 tokens: dict[str, str | None] | None = None) -> None:
    """Training rank ``rank``'s process: its own default group, a real trainer and one WeightWriter per job
    (``tokens``: each job's MetaServer token); each step it trains, leaves what it holds in ``refdir`` (rank 0:
    the step's whole weights) and writes."""
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
    tokens = tokens or {}
    writers = [WeightWriter(trainer.bound, meta=meta, job=job, token=tokens.get(job), timeout_s=cfg.timeout_s,
                            colocate=cfg.colocate,
                            **transport_args(cfg, job, refdir), **elastic, **quant_args(engine),
                            delta=cfg.delta).connect()
               for job, engine in jobs(cfg)]
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


def reader_main(emit: Emit, job: str, engine: str, inst: int, instances: int, meta: str, cfg: DemoConfig,
                refdir: str, gpu: int = 0, token: str | None = None) -> None:
    """Instance ``inst`` of ``job``'s process (its workers beside it; ``token``: the job's MetaServer token): every
    step it updates, then checks what it holds against the trainers' weights in ``refdir``; a joiner
    (``inst >= instances``) joins the running job."""
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
    elif cfg.engines == "real" and engine.startswith("sglang"):
        from weightsync.local.instances import LocalInstance
        from weightsync.sglang.engine import EngineOptions as SGLangOptions
        from weightsync.sglang.engine import start as start_sglang

        gpu %= torch.cuda.device_count()  # shares_gpus: on the trainer's GPU
        owned = start_sglang(dict(spec.config), engine, SGLangOptions(extra={"base_gpu_id": gpu} if gpu else {}),
                             timeout_s=cfg.timeout_s)
        local = LocalInstance(owned.instance)
    else:
        local = build_instance(spec, engine, device=f"cuda:{gpu}" if cfg.device == "cuda" else "cpu", seed=99)
    joiner = inst >= instances  # --join-at: joins the running job once the step before is held
    try:
        reader = WeightReader(local.instance, meta=meta, job=job, token=token, instance_id=inst, instances=instances,
                              timeout_s=cfg.timeout_s, colocate=cfg.colocate, **transport_args(cfg, job, refdir),
                              **quant_args(engine), delta=cfg.delta)
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
            if cfg.corrupt and step == first and inst == 0 and job == jobs(cfg)[0][0]:
                local.instance.call(_corrupt, engine, dict(spec.config), timeout_s=cfg.timeout_s)
                local.instance.after_update()  # a real engine re-packs: it now computes with the flipped element
            report = reader.validate(f"{refdir}/ckpt{step}") if cfg.validate or cfg.corrupt else None
            problems = [p for ps in local.instance.call(_verify, f"{refdir}/step{step}.safetensors", engine,
                                                        dict(spec.config), timeout_s=cfg.timeout_s) for p in ps]
            tokens_equal = None
            if owned is not None and engine.startswith("sglang"):
                differ, tokens_equal = _against_fresh_sglang(owned, spec, engine, gpu, f"{refdir}/step{step}.safetensors",
                                                             f"{refdir}/hf-{job}-{inst}", cfg.timeout_s)
                problems += differ
            elif owned is not None:  # what the engine computes with and decodes, against a fresh engine's
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

    from weightsync.checkpoint.hf import save_hf_checkpoint
    from weightsync.vllm.engine import EngineOptions, start

    save_hf_checkpoint(spec, load_file(ref_path), ckpt_dir)
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


def _against_fresh_sglang(owned, spec, engine: str, gpu: int, ref_path: str, ckpt_dir: str,
                          timeout_s: float) -> tuple[list[str], bool]:
    """--engines real, SGLang: a FRESH SGLang engine on the step's weights saved as an HF checkpoint, started in a
    process of its own (:mod:`weightsync.sglang.fresh`); the tensors ``owned`` computes with that differ from the
    fresh engine's (by digest), and whether their greedy tokens are equal."""
    from safetensors.torch import load_file

    from weightsync.checkpoint.hf import save_hf_checkpoint
    from weightsync.sglang.fresh import reference

    save_hf_checkpoint(spec, load_file(ref_path), ckpt_dir)
    try:
        fresh = reference(ckpt_dir, engine, gpu=gpu, timeout_s=max(timeout_s, 300.0))
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    got = owned.digests()
    differ = [f"rank {r}: {name} (computed) differs from a fresh SGLang engine's"
              for r, (g, w) in enumerate(zip(got, fresh.digests)) for name in sorted(set(g) | set(w))
              if g.get(name) != w.get(name)]
    return differ, owned.tokens() == fresh.tokens


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
    engine_layout = make_layout(spec_from_config(model_config), engine)
    if getattr(engine_layout.config, "quant", 0):
        return _verify_fp8(ctx, ref, engine_layout)
    layout = engine_layout.layout(ctx.rank)
    differ = differences(layout, ctx.tensors, lambda p: ref[p.canonical][slices(p.canon_box)])
    return [f"rank {ctx.rank}: {d}" for d in differ]


def _verify_fp8(ctx, ref: dict, engine_layout) -> list[str]:
    """An FP8-served worker: every tensor's bits against the FP8 checkpoint of the trainers' weights (each FP8
    weight by the reference quantizer, as ``save_checkpoint(dir, quant="fp8")`` writes it) loaded into the layout."""
    from weightsync.layout.materialize import canonical_view, local_view
    from weightsync.quant.fp8 import quantize_reference
    from weightsync.quant.layout import fp8_layout

    layout = fp8_layout(engine_layout)
    for name, f in layout.fp8.items():
        q = quantize_reference(ref[name])
        ref[name], ref[f.scale.name] = q.weight, q.scale_inv
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    out = []
    for name, t in layout.layout(ctx.rank).tensors.items():
        live = ctx.tensors.get(name)
        if live is None or live.dtype != torch.float8_e4m3fn and t.dtype == "float8_e4m3fn":
            out.append(f"rank {ctx.rank}: {name} is not held in float8_e4m3fn")
            continue
        for p in t.pieces:
            got, want = local_view(live, p), canonical_view(ref[p.canonical], p).to(live.dtype)
            if not torch.equal(got.contiguous().view(bits[got.element_size()]),
                               want.contiguous().view(bits[want.element_size()])):
                out.append(f"rank {ctx.rank}: {name} piece {p.canonical} {list(p.canon_box)}")
    return out


__all__ = ["VerificationError", "reader_main", "trainer_main"]
