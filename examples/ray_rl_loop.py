"""An RL loop under Ray: trainers and inference engines as Ray actors, weightsync moving the weights.

    python examples/ray_rl_loop.py [--steps 5] [--join-at 3] [--kill-at 4] [--model tiny-qwen3] [--json]

What a framework that places its processes with Ray (verl, OpenRLHF, SkyRL, ...) does, in one file:

- the **driver** starts the MetaServer with an admin token and hands each actor the *job token* only;
- a **trainer** actor (a transformers model; one actor per training rank in a real job) runs a real AdamW step on
  a batch, then ``WeightWriter.write(step)``: it returns once every live engine holds the step;
- **engine** actors (here a transformers model as the inference engine, ``HFInstance``; a vLLM actor holds
  ``VLLMInstance(LLM(...))`` or ``VLLMWeightSync`` instead, nothing else changes) each call
  ``WeightReader.update(step)``;
- before step ``--join-at`` a new engine joins the running job (``instance_id`` beyond ``instances``); during step
  ``--kill-at`` engine 0 is killed (``ray.kill``): the trainer's write drops it after ``instance_timeout_s`` and
  the job goes on with the others. Elastic membership needs an elastic transport: ``nixl`` (RDMA; shared memory on
  one CPU host) where NIXL is installed (``weightsync[rdma]``), else ``file``.

After every step each live engine's weights are compared with the trainer's, byte for byte (a SHA-256 of every
tensor each side computes with), and the engines' greedy tokens with the trainer's. Exit status 0 only when every
check held; ``--json`` prints the record. Runs on CPU in ``make test`` (``tests/test_examples.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import sys
import tempfile
import time

import ray

JOB = "ray-rl"
PROMPT = [[3, 17, 42, 99, 7, 11]]


def digest(tensors) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def greedy(model) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPT), max_new_tokens=6, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT[0]):].tolist()


def _model(name: str, seed: int):
    import torch

    from weightsync.checkpoint.hf import build_hf_model  # a transformers model of the preset's config.json
    from weightsync.spec import load_spec

    torch.set_num_threads(1)
    return build_hf_model(load_spec(name), seed=seed)


@ray.remote(num_cpus=0)
class Trainer:
    """One training rank: a transformers model, AdamW, and its WeightWriter."""

    def __init__(self, meta: str, token: str, model: str, transport: str, directory: str | None,
                 instance_timeout_s: float):
        import torch

        from weightsync import WeightWriter
        from weightsync.bind import HFTrainEngine

        self.model = _model(model, seed=1)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.bound = HFTrainEngine(self.model).bound
        self.writer = WeightWriter(self.bound, meta=meta, job=JOB, token=token, transport=transport,
                                   directory=directory, instance_timeout_s=instance_timeout_s, timeout_s=60.0)

    def connect(self) -> None:
        self.writer.connect()

    def step(self, step: int) -> dict:
        """A real training step on a random batch, then the sync; what the engines must now hold."""
        import torch

        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, self.model.config.vocab_size, (2, 16), generator=g)
        loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        t0 = time.perf_counter()
        self.writer.write(step)
        return {"step": step, "loss": loss.item(), "write_s": time.perf_counter() - t0,
                "digest": digest(self.bound.tensors), "tokens": greedy(self.model)}

    def close(self) -> None:
        self.writer.close()


@ray.remote(num_cpus=0)
class Engine:
    """One inference instance: a transformers model as the engine, started on other weights, and its WeightReader."""

    def __init__(self, meta: str, token: str, model: str, instance_id: int, instances: int, transport: str,
                 directory: str | None):
        from weightsync import WeightReader
        from weightsync.instances.hf import HFInstance

        self.model = _model(model, seed=100 + instance_id)  # not the trainer's weights: each sync must land all
        self.instance = HFInstance(self.model)
        self.reader = WeightReader(self.instance, meta=meta, job=JOB, token=token, instance_id=instance_id,
                                   instances=instances, transport=transport, directory=directory, timeout_s=60.0)

    def connect(self) -> int:
        """Register and join; the first step this engine syncs (``since``)."""
        return self.reader.connect().since

    def update(self, step: int) -> dict:
        t0 = time.perf_counter()
        got = self.reader.update(step)
        return {"step": got, "update_s": time.perf_counter() - t0, "digest": digest(self.instance.bound.tensors),
                "tokens": greedy(self.model)}

    def close(self) -> None:
        self.reader.close()


def transport_here() -> str:
    """``nixl`` where NIXL loads, else ``file`` (both elastic)."""
    from weightsync.errors import ConfigError
    from weightsync.transport.nixl_wire import load_nixl

    try:
        load_nixl()
    except ConfigError:
        return "file"
    return "nixl"


def run(steps: int, join_at: int, kill_at: int, model: str, transport: str, instance_timeout_s: float) -> dict:
    from weightsync import MetaServer
    from weightsync.meta.auth import job_token

    record: dict = {"model": model, "transport": transport, "steps": [], "problems": []}
    admin = secrets.token_hex(16)
    directory = tempfile.mkdtemp(prefix="ray-rl-") if transport == "file" else None
    with MetaServer(token=admin).start() as server:
        token = job_token(admin, JOB)  # the actors get the job's token, never the admin token
        trainer = Trainer.remote(server.url, token, model, transport, directory, instance_timeout_s)
        engines = {i: Engine.remote(server.url, token, model, i, 2, transport, directory) for i in (0, 1)}
        # every participant connects at once: connect() waits for the whole job
        t0 = time.perf_counter()
        ray.get([trainer.connect.remote(), *[e.connect.remote() for e in engines.values()]])
        record["connect_s"] = round(time.perf_counter() - t0, 2)  # the actors' start-up (imports, models) included
        for step in range(1, steps + 1):
            if step == join_at:  # a third engine joins the running job between two steps
                joiner = Engine.remote(server.url, token, model, 2, 2, transport, directory)
                since = ray.get(joiner.connect.remote())
                record["joined"] = {"instance": 2, "before_step": step, "since": since}
                if since != step:
                    record["problems"].append(f"the engine that joined before step {step} syncs from step {since}")
                engines[2] = joiner
            t_step = time.perf_counter()
            wrote = trainer.step.remote(step)
            updates = {i: e.update.remote(step) for i, e in engines.items()}
            if step == kill_at:  # engine 0 dies while the step is under way
                ray.kill(engines.pop(0), no_restart=True)
                updates.pop(0)
                record["killed"] = {"instance": 0, "step": step}
            want = ray.get(wrote)
            got = ray.get(list(updates.values()))
            row = {"step": step, "loss": round(want["loss"], 4), "write_s": round(want["write_s"], 3),
                   "engines": {}, "wall_s": round(time.perf_counter() - t_step, 2)}
            for i, g in zip(updates, got):
                exact = g["step"] == step and g["digest"] == want["digest"]
                same = g["tokens"] == want["tokens"]
                row["engines"][i] = {"exact": exact, "tokens_equal": same, "update_s": round(g["update_s"], 3)}
                if not (exact and same):
                    record["problems"].append(f"step {step}: engine {i} holds other weights than the trainer's "
                                              f"(exact {exact}, tokens equal {same})")
            record["steps"].append(row)
        ray.get([e.close.remote() for e in engines.values()])
        ray.get(trainer.close.remote())
    record["ok"] = not record["problems"]
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--join-at", type=int, default=3, help="a third engine joins before this step")
    p.add_argument("--kill-at", type=int, default=4, help="engine 0 is killed during this step")
    p.add_argument("--model", default="tiny-qwen3", help="a weightsync preset (its config.json)")
    p.add_argument("--transport", choices=["nixl", "file"], help="default: nixl where NIXL loads, else file")
    p.add_argument("--instance-timeout", type=float, default=20.0,
                   help="how long a write waits for an engine that stopped answering before dropping it")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    transport = args.transport or transport_here()
    t0 = time.perf_counter()
    # Ray starts its workers at nice 15 (its worker_niceness); trainers and engines are not background work: beside
    # any busy process at nice 0 they would get a sliver of a core (a 9x slower start measured beside two busy loops)
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             object_store_memory=100 << 20)
    try:
        ray_init_s = time.perf_counter() - t0
        rec = run(args.steps, args.join_at, args.kill_at, args.model, transport, args.instance_timeout)
        rec["ray_init_s"] = round(ray_init_s, 2)
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(rec))
    else:
        for row in rec["steps"]:
            engines = ", ".join(f"engine {i}: {'exact' if e['exact'] else 'DIFFERS'} in {e['update_s']} s"
                                for i, e in row["engines"].items())
            print(f"step {row['step']}: loss {row['loss']}, written in {row['write_s']} s; {engines}")
        print(f"transport {rec['transport']}; joined: {rec.get('joined')}; killed: {rec.get('killed')}")
        print("every step bit-exact on every live engine" if rec["ok"] else "\n".join(rec["problems"]))
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
