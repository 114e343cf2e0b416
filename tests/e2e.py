"""End-to-end harness: real training processes and real inference instances syncing through a MetaServer.

Each training process builds a real engine (transformers, FSDP2 on gloo, or megatron-core on gloo),
binds it, and every step fills its live weights with fresh random canonical data (the same seed on
every rank) before ``write``; each inference instance (a transformers model, or layout-faithful
vLLM/SGLang worker processes) starts poisoned with NaN, and after each ``update`` checks every
tensor bit for bit against the data that step should hold. Faults are injected by name.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback

import torch

from weightsync.engines import make_layout
from weightsync.layout.materialize import fill_from, scatter
from weightsync.spec import load_spec
from weightsync.testing import random_canonical

CTX = mp.get_context("spawn")


def seed_of(step: int) -> int:
    return 100 + step


FP32_SCALE = 1 + 3 / 512  # moves bf16 values off the bf16 grid by ~3/4 ulp: the receiver must round to nearest


def step_canonical(spec, step: int, fp32: bool = False) -> dict:
    """The canonical weights of a step as the trainer holds them (fp32 master weights when ``fp32``)."""
    canonical = random_canonical(spec, seed_of(step))
    if fp32:
        canonical = {n: t.float() * FP32_SCALE for n, t in canonical.items()}
    return canonical


def expected_canonical(spec, step: int, fp32: bool = False) -> dict:
    """What an inference engine loading that step from a checkpoint holds, in canonical dtypes."""
    from weightsync.layout.materialize import TORCH_DTYPES

    return {n: t.to(TORCH_DTYPES[spec.by_name[n].dtype]) for n, t in step_canonical(spec, step, fp32).items()}


# -- trainers ---------------------------------------------------------------------------------------


def build_trainer(spec, train: str, rank: int, world: int):
    """A bound training engine of the given layout on this process (default group already up)."""
    engine = make_layout(spec, train)
    if engine.engine == "hf":
        from weightsync.bind.train import HFTrainEngine
        from weightsync.testing import build_hf_model

        model = build_hf_model(spec, seed=0)
        if os.environ.get("WEIGHTSYNC_E2E_FP32"):
            model = model.float()
        if torch.cuda.is_available() and os.environ.get("WEIGHTSYNC_E2E_DEVICE") == "cuda":
            model = model.to(f"cuda:{rank}")
        return HFTrainEngine(model).bound
    if engine.engine == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from weightsync.bind.train import FSDPTrainEngine
        from weightsync.testing import build_hf_model

        model = build_hf_model(spec, seed=0)
        if os.environ.get("WEIGHTSYNC_E2E_FP32"):
            model = model.float()  # FSDP2 mixed precision keeps fp32 sharded master weights
        tp = engine.config.get("tp", 1)
        if tp > 1:  # torchtitan-style TP first, then FSDP over dp (2-D mesh, tp fastest)
            from test_fsdp_layout import _apply_tp

            mesh2 = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
            _apply_tp(model, mesh2["tp"], spec.tie_word_embeddings)
            mesh = mesh2["dp"]
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return FSDPTrainEngine(model).bound
    if engine.engine == "megatron":
        return _megatron(spec, engine, rank)
    raise ValueError(train)


def _megatron(spec, want, rank: int):
    # CPU shims as in tests/test_megatron_layout.py (no parameter is created or renamed by them)
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module
    from test_megatron_layout import _mcore_config

    from weightsync.bind import MegatronTrainEngine

    ps.initialize_model_parallel(
        tensor_model_parallel_size=want.tp, pipeline_model_parallel_size=want.pp,
        expert_model_parallel_size=want.ep, expert_tensor_parallel_size=want.etp,
    )
    cfg = _mcore_config(spec, want)
    p = ps.get_pipeline_model_parallel_rank()
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm", pp_rank=p)
    m = GPTModel(cfg, block, vocab_size=want.padded_vocab, max_sequence_length=64, pre_process=p == 0,
                 post_process=p == want.pp - 1, share_embeddings_and_output_weights=spec.tie_word_embeddings,
                 position_embedding_type="rope")
    return MegatronTrainEngine([Float16Module(cfg, m)], dict(spec.config)).bound


def _die_after(module, name: str, count: int) -> None:
    """Fault injection: the process exits abruptly inside the ``count``-th call of ``module.name``."""
    real = getattr(module, name)  # AttributeError when the hook point is renamed: the test must fail then
    calls = [0]

    def wrapped(*a, **k):
        calls[0] += 1
        if calls[0] == count:
            os._exit(3)
        return real(*a, **k)

    setattr(module, name, wrapped)


def _move_a_tensor(tensors: dict) -> None:
    """Reallocate the first tensor, keeping the object and its values (``p.data = p.data.clone()``)."""
    t = next(iter(tensors.values()))
    t.data = t.data.clone()


def trainer(rank: int, world: int, port: int, meta: str, job: dict, out) -> None:
    try:
        if job.get("gpu_base") is not None:
            os.environ["WEIGHTSYNC_E2E_DEVICE"] = "cuda"
        if job.get("fp32"):
            os.environ["WEIGHTSYNC_E2E_FP32"] = "1"
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=60))
        spec = load_spec(job["model"])
        bound = build_trainer(spec, job["train"], rank, world)
        from weightsync.runtime.writer import WeightWriter

        writer = WeightWriter(bound, meta=meta, job=job["job"], timeout_s=job["timeout"], token=job.get("token"),
                              bucket_bytes=job.get("bucket_bytes", 256 << 20), mode=job.get("mode", "sync"),
                              memory_budget=job.get("memory_budget", 2 << 30),
                              colocate=job.get("colocate", False), transport=job.get("transport", "p2p"),
                              directory=job.get("directory"), peer_copies=job.get("peer_copies", True))
        out.put(("ready", "train", rank))
        if job.get("mode") == "async":
            for step in range(1, job["steps"] + 1):
                with torch.no_grad():
                    fill_from(bound.layout, bound.tensors, step_canonical(spec, step))
                writer.write(step)  # returns at once: staged
                out.put(("wrote", rank, step))
                if step == 1:  # let instance 0 pull step 1 before moving on, so instances diverge
                    writer.client.wait_held(1, [0], timeout=job["timeout"])
            writer.client.wait_held(job["steps"], range(job["instances"]), timeout=job["timeout"])
            out.put(("done", "train", rank))
            return
        for step in range(1, job["steps"] + 1):
            if job.get("fault") == "train-moves" and rank == 0 and step == job["steps"]:
                _move_a_tensor(bound.tensors)  # as offloading and reloading would
            with torch.no_grad():
                fill_from(bound.layout, bound.tensors, step_canonical(spec, step, job.get("fp32", False)))
            if job.get("fault") == "train-dies-before-write" and rank == 0 and step == job["steps"]:
                # a crash after the optimizer step, before announcing it; first let the queue's feeder
                # thread finish our last message: killed while holding the queue's lock, it would block
                # every other process's messages for good
                out.close()
                out.join_thread()
                os._exit(3)
            if job.get("fault") == "train-dies" and rank == 0 and step == job["steps"]:
                import weightsync.transport.p2p as p2p

                # die while posting the last step's fifth bucket: buckets 0-2 have surely landed by then
                # (window 2); post() runs for every bucket (packing may be a graph replay, or not needed)
                _die_after(p2p, "post", 5)
            if job.get("restart_meta_before") == step:
                out.put(("need-restart", step))
                _wait_file(job["restart_flag"], job["timeout"])
            writer.write(step)
            out.put(("wrote", rank, step))
        out.put(("done", "train", rank))
    except BaseException as e:
        out.put(("error", "train", rank, type(e).__name__, str(e), traceback.format_exc()))


def _wait_file(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.05)


# -- readers ----------------------------------------------------------------------------------------


def check_step(ctx, model: str, engine: str, step: int, fp32: bool = False) -> str:
    """On a worker: '' when every local tensor is bit-exact (padding still NaN), else the first problem."""
    spec = load_spec(model)
    want = scatter(make_layout(spec, engine).layout(ctx.rank), expected_canonical(spec, step, fp32))
    for name, exp in want.items():
        got = ctx.tensors[name].detach().cpu()
        if not (torch.equal(got.isnan(), exp.isnan()) and torch.equal(got.nan_to_num(), exp.nan_to_num())):
            return f"rank {ctx.rank}: {name} differs"
    return ""


def _die_in_worker(ctx) -> None:
    import weightsync.transport.p2p as p2p

    if "sources" in ctx.state:  # co-located: die in the step's first batch of direct copies
        from weightsync.transport.batch_copy import BatchedCopy

        _die_after(BatchedCopy, "run", 1)
    elif ctx.device.type == "cuda":  # die with the step's receives all posted, waiting for them
        _die_after(p2p, "settle", 1)
    else:  # die mid-step, the first bucket received (gloo: the CPU waits bucket by bucket)
        _die_after(p2p, "post", 2)


def _move_in_worker(ctx) -> None:
    _move_a_tensor(ctx.tensors)


def reader(inst: int, meta: str, job: dict, out) -> None:
    instance = None
    try:
        torch.set_num_threads(1)
        spec = load_spec(job.get("infer_model", job["model"]))
        engine = job["infer"]
        if engine == "hf":
            from weightsync.instances.hf import HFInstance
            from weightsync.testing import build_hf_model

            model = build_hf_model(spec, seed=1)
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
            instance = HFInstance(model)
        else:
            from weightsync.instances.faithful import FaithfulInstance

            device = f"cuda:{job['gpu_base'] + inst * make_layout(spec, engine).world_size}" if job.get("gpu_base") is not None else "cpu"
            instance = FaithfulInstance(dict(spec.config), engine, device=device)
        from weightsync.runtime.reader import WeightReader

        r = WeightReader(instance, meta=meta, job=job["job"], instance_id=inst, instances=job["instances"],
                         timeout_s=job["timeout"], token=job.get("token"), bucket_bytes=job.get("bucket_bytes", 256 << 20),
                         memory_budget=job.get("reader_memory_budget", job.get("memory_budget", 2 << 30)),
                         colocate=job.get("colocate", False), peer_copies=job.get("reader_peer_copies", True),
                         transport=job.get("reader_transport", job.get("transport", "p2p")), directory=job.get("directory"),
                         staged=job.get("staged", False), mode=job.get("mode", "sync"), push=job.get("reader_push", True))
        out.put(("ready", "infer", inst))
        if job.get("mode") == "async":
            waits = [1, job["steps"]] if inst == 0 else [job["steps"]]
            for step in waits:
                r.client.wait_written(step, timeout=job["timeout"])
                version = r.pull()
                problems = [p for p in instance.call(check_step, spec.name, engine, version) if p]
                out.put(("pulled", inst, version, problems, r.client.summary()))
            out.put(("done", "infer", inst))
            return
        for step in range(1, job["steps"] + 1):
            if job.get("fault") == "infer-dies" and inst == 0 and step == job["steps"]:
                instance.call(_die_in_worker)
            if job.get("fault") == "infer-moves" and inst == 0 and step == job["steps"]:
                instance.call(_move_in_worker)
            try:
                r.update(step)
            except Exception as e:
                # what the instance holds now: still exactly the previous step? (staged readers promise it)
                intact = not any(instance.call(check_step, spec.name, engine, step - 1)) if step > 1 else None
                out.put(("update-failed", inst, step, type(e).__name__, str(e), r.version, intact))
                raise
            problems = [p for p in instance.call(check_step, spec.name, engine, step, job.get("fp32", False)) if p]
            out.put(("updated", inst, step, r.version, problems))
        out.put(("done", "infer", inst))
    except BaseException as e:
        out.put(("error", "infer", inst, type(e).__name__, str(e), traceback.format_exc()))
    finally:
        if instance is not None:
            instance.close()


# -- driver -----------------------------------------------------------------------------------------


def run_job(job: dict, meta_server=None, on_restart=None) -> list[tuple]:
    """Run trainers and readers for ``job``; return every message they sent, in arrival order."""
    from weightsync.meta.server import MetaServer
    from weightsync.transport.group import free_port

    job = {"job": "e2e", "steps": 2, "instances": 1, "timeout": 30.0, **job}
    spec = load_spec(job["model"])
    world = make_layout(spec, job["train"]).world_size
    own = meta_server is None
    server = meta_server or MetaServer(port=0, token=job.get("server_token")).start()
    out = CTX.Queue()
    port = free_port()
    procs = [CTX.Process(target=trainer, args=(r, world, port, server.url, job, out)) for r in range(world)]
    procs += [CTX.Process(target=reader, args=(i, server.url, job, out)) for i in range(job["instances"])]
    for p in procs:
        p.start()
    messages = []
    deadline = time.monotonic() + job["timeout"] * (job["steps"] + 4)
    try:
        while time.monotonic() < deadline:
            try:
                msg = out.get(timeout=0.5)
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    break
                continue
            messages.append(msg)
            if msg[0] == "need-restart" and on_restart is not None:
                server = on_restart(server)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        if own:
            server.stop()
    return messages
