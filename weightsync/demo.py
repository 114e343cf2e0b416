"""``weightsync demo``: real training processes, real inference instances, real weight syncs.

An embedded MetaServer; training processes holding a tiny model (FSDP2 over ``dp`` ranks, or one
plain transformers rank) that take real optimizer steps, so the weights change; and inference
instances -- by default one real transformers model and one vLLM-layout TP=2 instance (worker
processes holding exactly a vLLM worker's tensors). Each step: train, write, update, then verify
every inference tensor bit for bit against the trainer's full weights (saved by training rank 0)
and, for transformers instances, that their logits equal the trainer's.

Instances of different layouts are separate weight-sync jobs (one plan per layout); the trainer
runs one WeightWriter per job.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import tempfile
import time
from dataclasses import dataclass, field

import torch

from weightsync.errors import ConfigError

DEFAULT_INFER = ("hf", "vllm:tp=2")


@dataclass
class DemoConfig:
    model: str = "tiny-qwen3"
    train: str = "fsdp:dp=2"
    infer: list[str] = field(default_factory=lambda: list(DEFAULT_INFER))
    instances: int = 1  # per inference layout
    colocate: bool = False
    steps: int = 3
    device: str = "cpu"
    timeout_s: float = 60.0


def _jobs(cfg: DemoConfig) -> list[tuple[str, str]]:
    """(job id, inference layout) per distinct inference layout."""
    return [(f"demo-{k}-{e.split(':')[0]}", e) for k, e in enumerate(cfg.infer)]


# -- training processes -----------------------------------------------------------------------------


def _trainer(rank: int, world: int, port: int, meta: str, cfg: DemoConfig, refdir: str, out: mp.Queue) -> None:
    try:
        _train_loop(rank, world, port, meta, cfg, refdir, out)
    except BaseException as e:  # report, then exit non-zero
        out.put(("error", f"training rank {rank}", f"{type(e).__name__}: {e}"))
        raise


def _train_loop(rank: int, world: int, port: int, meta: str, cfg: DemoConfig, refdir: str, out: mp.Queue) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from weightsync.runtime.writer import WeightWriter
    from weightsync.spec import load_spec
    from weightsync.testing import build_hf_model

    torch.set_num_threads(1)
    engine_name = cfg.train.split(":")[0]
    spec = load_spec(cfg.model)
    cuda = cfg.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)  # training rank r on GPU r
    # the trainer's own default group, as a real trainer has; weightsync builds its group beside it
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    model = build_hf_model(spec, seed=0)
    if cuda:
        model = model.to(f"cuda:{rank}")
    if engine_name == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from weightsync.bind.train import FSDPTrainEngine

        mesh = init_device_mesh(cfg.device, (world,), mesh_dim_names=("dp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        bound = FSDPTrainEngine(model).bound
    else:
        from weightsync.bind.train import HFTrainEngine

        bound = HFTrainEngine(model).bound
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    writers = [WeightWriter(bound, meta=meta, job=job, timeout_s=cfg.timeout_s, colocate=cfg.colocate)
               for job, _ in _jobs(cfg)]
    dev = next(model.parameters()).device
    probe = torch.arange(16, device=dev).remainder(spec.vocab_size).view(1, 16)
    for step in range(1, cfg.steps + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=g).to(dev)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                    for n, p in model.state_dict().items()}
            logits = model(input_ids=probe).logits.detach().cpu()
        if rank == 0:
            save_file(_canonical_of(spec, full), f"{refdir}/step{step}.safetensors")
            torch.save(logits, f"{refdir}/logits{step}.pt")
        dist.barrier()
        # wall clock, sent before any byte moves: the driver compares it with the readers' end times
        out.put(("train", rank, step, time.time(), loss.item()))
        for w in writers:
            w.write(step)
    dist.destroy_process_group()


def _canonical_of(spec, full: dict) -> dict:
    """The trainer's full weights as canonical (checkpoint) tensors, through the hf layout's pieces."""
    from weightsync.engines.hf import HFLayout
    from weightsync.layout.materialize import local_view

    out = {}
    for p in HFLayout(spec).layout(0).pieces():
        out[p.canonical] = local_view(full[p.tensor], p).contiguous()
    return out


# -- inference instances ----------------------------------------------------------------------------


def _reader(job: str, engine: str, inst: int, instances: int, meta: str, cfg: DemoConfig, refdir: str,
            out: mp.Queue, gpu: int = 0) -> None:
    try:
        _read_loop(job, engine, inst, instances, meta, cfg, refdir, out, gpu)
    except BaseException as e:
        out.put(("error", f"instance {inst} of {job}", f"{type(e).__name__}: {e}"))
        raise


def _read_loop(job: str, engine: str, inst: int, instances: int, meta: str, cfg: DemoConfig, refdir: str,
               out: mp.Queue, gpu: int) -> None:
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec
    from weightsync.testing import build_hf_model

    torch.set_num_threads(1)
    spec = load_spec(cfg.model)
    hf_model = None
    if engine == "hf":
        from weightsync.instances.hf import HFInstance

        hf_model = build_hf_model(spec, seed=99)
        if cfg.device == "cuda":
            hf_model = hf_model.to(f"cuda:{gpu}")
        with torch.no_grad():
            for p in hf_model.parameters():
                p.fill_(float("nan"))  # poisoned: a missed byte shows
        instance = HFInstance(hf_model)
    else:
        from weightsync.instances.faithful import FaithfulInstance

        device = f"cuda:{gpu}" if cfg.device == "cuda" else "cpu"
        instance = FaithfulInstance(dict(spec.config), engine, device=device)
    try:
        reader = WeightReader(instance, meta=meta, job=job, instance_id=inst, instances=instances,
                              timeout_s=cfg.timeout_s, colocate=cfg.colocate)
        probe = torch.arange(16).remainder(spec.vocab_size).view(1, 16)
        if hf_model is not None:
            probe = probe.to(next(hf_model.parameters()).device)
        for step in range(1, cfg.steps + 1):
            t0 = time.perf_counter()
            reader.update(step)
            seconds, end = time.perf_counter() - t0, time.time()
            got = sum(s["bytes"] for s in reader.last_stats)
            exact = all(instance.call(_verify, f"{refdir}/step{step}.safetensors", engine, dict(spec.config),
                                      timeout_s=cfg.timeout_s))
            logits_equal = None
            if hf_model is not None:
                with torch.no_grad():
                    logits = hf_model(input_ids=probe).logits
                logits_equal = torch.equal(logits.cpu(), torch.load(f"{refdir}/logits{step}.pt"))
            out.put(("infer", job, inst, step, seconds, end, got, exact, logits_equal, reader.version))
    finally:
        instance.close()


def _verify(ctx, ref_path: str, engine: str, model_config: dict) -> bool:
    """On a worker: every local tensor equals the trainer's weights placed through this rank's layout."""
    from safetensors.torch import load_file

    from weightsync.engines import make_layout
    from weightsync.layout.box import slices
    from weightsync.spec import spec_from_config
    from weightsync.testing import holds

    ref = load_file(ref_path)
    layout = make_layout(spec_from_config(model_config), engine).layout(ctx.rank)
    return holds(layout, ctx.tensors, lambda p: ref[p.canonical][slices(p.canon_box)])


# -- the driver -------------------------------------------------------------------------------------


def run(cfg: DemoConfig, print_fn=print) -> dict:
    from weightsync.engines import make_layout
    from weightsync.meta.server import MetaServer
    from weightsync.spec import load_spec
    from weightsync.transport.group import free_port

    if cfg.steps < 1 or cfg.instances < 1:
        raise ConfigError("demo: --steps and --instances must be at least 1")
    spec = load_spec(cfg.model)
    train = make_layout(spec, cfg.train)
    if train.engine not in ("fsdp", "hf") or (train.engine == "fsdp" and train.config.get("tp", 1) > 1):
        raise ConfigError(f"demo: training engine {cfg.train!r} is not in the demo yet; use fsdp:dp=N or hf")
    for e in cfg.infer:
        world = make_layout(spec, e).world_size * cfg.instances  # refuse bad layouts before starting anything
        if cfg.colocate and world < train.world_size:
            raise ConfigError(f"demo: co-located {cfg.instances} x {e} covers {world} GPUs, fewer than the "
                              f"{train.world_size} training ranks; every training GPU needs an inference worker")
    world = train.world_size
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    results: dict[int, dict] = {s: {"step": s, "seconds": 0.0, "bytes": 0, "verified": True, "instances": []}
                                for s in range(1, cfg.steps + 1)}
    with tempfile.TemporaryDirectory() as refdir, MetaServer(port=0) as meta:
        port = free_port()
        procs = [ctx.Process(target=_trainer, args=(r, world, port, meta.url, cfg, refdir, out), daemon=True)
                 for r in range(world)]
        gpu = 0 if cfg.colocate else world  # separated: instances on the GPUs after the trainers'
        for job, engine in _jobs(cfg):
            per = make_layout(spec, engine).world_size
            for i in range(cfg.instances):
                # not daemonic: a reader starts its instance's worker processes
                procs.append(ctx.Process(target=_reader, args=(job, engine, i, cfg.instances, meta.url, cfg, refdir,
                                                               out, gpu)))
                gpu = (gpu + per) % world if cfg.colocate else gpu + per
        if cfg.device == "cuda" and not cfg.colocate and gpu > torch.cuda.device_count():
            raise ConfigError(f"demo: this set-up needs {gpu} GPUs, {torch.cuda.device_count()} visible")
        for p in procs:
            p.start()
        expected = cfg.steps * len(cfg.infer) * cfg.instances
        seen, errors = 0, []
        deadline = time.monotonic() + cfg.timeout_s * (cfg.steps + 3)
        while seen < expected and not errors and time.monotonic() < deadline:
            try:
                msg = out.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    errors.append("a demo process died")
                continue
            if msg[0] == "error":
                errors.append(f"{msg[1]}: {msg[2]}")
            elif msg[0] == "infer":
                _, job, inst, step, seconds, end, got, exact, logits_equal, version = msg
                r = results[step]
                r["end"] = max(r.get("end", 0.0), end)
                r["bytes"] += got
                ok = bool(exact) and logits_equal is not False and version == step
                r["verified"] = r["verified"] and ok
                r["instances"].append({"job": job, "instance": inst, "seconds": seconds, "bytes": got,
                                       "exact": exact, "logits_equal": logits_equal, "version": version})
                seen += 1
            elif msg[0] == "train":
                r = results[msg[2]]
                r["start"] = min(r.get("start", msg[3]), msg[3])
                r["starts"] = r.get("starts", 0) + 1
                r["loss"] = msg[4]
            else:
                continue
            r = results[msg[3] if msg[0] == "infer" else msg[2]]
            if len(r["instances"]) == len(cfg.infer) * cfg.instances and r.get("starts") == world:
                r["seconds"] = r["end"] - r["start"]  # from the first write call to the last update return
                print_fn(_line(r))
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if seen < expected and not errors:
        errors.append(f"timed out: {seen} of {expected} instance updates reported")
    steps = [{k: v for k, v in results[s].items() if k not in ("start", "end", "starts")} for s in sorted(results)]
    verified = not errors and all(s["verified"] and len(s["instances"]) == len(cfg.infer) * cfg.instances
                                  for s in steps)
    return {"model": cfg.model, "train": cfg.train, "infer": cfg.infer, "instances": cfg.instances,
            "steps": steps, "verified": verified, "errors": errors}


def _line(r: dict) -> str:
    gbps = r["bytes"] / r["seconds"] / 1e9 if r["seconds"] else 0.0
    parts = []
    for i in r["instances"]:
        what = "bit-exact" if i["exact"] else "MISMATCH"
        if i["logits_equal"] is not None:
            what += ", logits equal" if i["logits_equal"] else ", LOGITS DIFFER"
        parts.append(f"{i['job'].split('-', 2)[-1]}#{i['instance']}: {what}")
    return (f"step {r['step']}: {r['seconds']:.3f} s, {r['bytes'] / 1e6:.3f} MB, {gbps:.3f} GB/s, "
            f"loss {r.get('loss', float('nan')):.4f}; " + "; ".join(parts))


def main_from_args(args) -> int:
    cfg = DemoConfig(model=args.model, train=args.train, infer=[args.infer] if args.infer else list(DEFAULT_INFER),
                     instances=args.instances, colocate=args.colocate, steps=args.steps, device=args.device,
                     timeout_s=args.timeout)
    if not args.json:
        print(f"weightsync demo: {cfg.model}, {cfg.train} -> "
              + ", ".join(f"{cfg.instances} x {e}" for e in cfg.infer) + f", {cfg.steps} steps on {cfg.device}")
    result = run(cfg, print_fn=(lambda s: None) if args.json else print)
    if args.json:
        print(json.dumps(result))
    else:
        for e in result["errors"]:
            print(f"error: {e}")
        print("verified: every inference tensor bit-exact at every step" if result["verified"] else "NOT verified")
    return 0 if result["verified"] else 1


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-qwen3")
    p.add_argument("--train", default="fsdp:dp=2", help="fsdp:dp=N or hf")
    p.add_argument("--infer", default=None, help="one inference layout (default: an hf instance and a vllm:tp=2 one)")
    p.add_argument("--instances", type=int, default=1, help="instances per inference layout")
    p.add_argument("--colocate", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any wait may take")
    p.add_argument("--json", action="store_true")

