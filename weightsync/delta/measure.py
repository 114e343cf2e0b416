"""How many bf16 weights change per optimizer step under RL-like training: the measurement delta rests on.

    python -m weightsync.delta.measure [--lrs 1e-7,1e-6,1e-5] [--steps 20] [--json]

Trains a small transformers Qwen3 (random init, HF's initializer) as an RL trainer does: fp32 master
weights, AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), gradient clipping at 1.0, bf16 autocast
for the forward, random tokens; after every step the weights go on the wire as bf16 (``p.to(bf16)``,
round to nearest even, as :mod:`weightsync` sends them from a bf16 engine or rounds fp32 master
weights on the receiver). For each step it counts the bf16 elements whose bits differ from the
previous step's, per tensor kind (attention, mlp, norm, embedding: ``embed_tokens`` and ``lm_head``).

Why few change: Adam moves each weight by about ``lr`` a step, and a bf16 value ``w`` changes only
when the fp32 master crosses a rounding boundary, ``|w| * 2**-8`` wide: at init std 0.02 that is
~8e-5, so ~lr / 8e-5 of the weights change (1e-5: ~10%; 1e-7: ~0.1%), fewer for norms (near 1.0,
spacing 2**-7) and for embedding rows no token of the batch touched.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

log = logging.getLogger("weightsync.delta.measure")

KINDS = ("attention", "mlp", "norm", "embedding")


def kind_of(name: str) -> str:
    """The tensor kind of an HF parameter name (norms first: q_norm/k_norm sit inside self_attn)."""
    if "norm" in name:
        return "norm"
    if "embed_tokens" in name or "lm_head" in name:
        return "embedding"
    if "self_attn" in name:
        return "attention"
    if "mlp" in name:
        return "mlp"
    raise ValueError(f"no kind for {name}")


def wire(t: torch.Tensor) -> torch.Tensor:
    """The bf16 bits a weight travels as (int16 view of the round-to-nearest bf16)."""
    return t.detach().to(torch.bfloat16).view(torch.int16).clone()


def changed(before: torch.Tensor, after: torch.Tensor) -> int:
    """How many elements' bits differ between two int16 bit tensors (``wire`` of two steps)."""
    return int((before != after).sum())


@dataclass(frozen=True)
class StepChange:
    """One optimizer step: changed bf16 elements per kind and in all."""

    step: int
    changed: dict[str, int]
    total_changed: int


@dataclass(frozen=True)
class Run:
    """One learning rate's run."""

    lr: float
    elements: dict[str, int]  # bf16 elements per kind
    steps: list[StepChange] = field(default_factory=list)

    def fractions(self) -> list[float]:
        total = sum(self.elements.values())
        return [s.total_changed / total for s in self.steps]

    def kind_fractions(self, kind: str) -> list[float]:
        return [s.changed[kind] / self.elements[kind] for s in self.steps]


def count_step(step: int, before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> StepChange:
    per = dict.fromkeys(KINDS, 0)
    for name, bits in after.items():
        per[kind_of(name)] += changed(before[name], bits)
    return StepChange(step, per, sum(per.values()))


def small_qwen3(seed: int = 0, hidden: int = 512, layers: int = 4, vocab: int = 4096):
    """A small Qwen3 with HF's own random init (fp32: the master weights)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                         max_position_embeddings=512, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).float()


def train(lr: float, steps: int = 20, seed: int = 0, batch: int = 4, seq: int = 64, **model) -> Run:
    """``steps`` AdamW steps at ``lr``; the bf16 change of every step."""
    net = small_qwen3(seed, **model)
    params = dict(net.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = net.config.vocab_size
    before = {n: wire(p) for n, p in params.items()}
    elements = dict.fromkeys(KINDS, 0)
    for n, p in params.items():
        elements[kind_of(n)] += p.numel()
    run = Run(lr, elements)
    for step in range(1, steps + 1):
        tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        after = {n: wire(p) for n, p in params.items()}
        run.steps.append(count_step(step, before, after))
        before = after
    return run


def summary(run: Run) -> dict:
    f = run.fractions()
    out = {"lr": run.lr, "elements": sum(run.elements.values()), "mean": sum(f) / len(f), "first": f[0],
           "min": min(f), "max": max(f), "per_step": f,
           "kinds": {k: {"elements": run.elements[k], "mean": sum(v) / len(v), "min": min(v), "max": max(v)}
                     for k in KINDS for v in [run.kind_fractions(k)]}}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lrs", default="1e-7,1e-6,1e-5")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = []
    for lr in (float(x) for x in args.lrs.split(",")):
        t0 = time.perf_counter()
        s = summary(train(lr, args.steps, hidden=args.hidden, layers=args.layers))
        s["seconds"] = time.perf_counter() - t0
        results.append(s)
        if not args.json:
            kinds = ", ".join(f"{k} {v['mean']:.3%}" for k, v in s["kinds"].items())
            print(f"lr {lr:g}: {s['mean']:.3%} of {s['elements']:,} bf16 elements change per step (step 1 "
                  f"{s['first']:.3%}, min {s['min']:.3%}, max {s['max']:.3%}); {kinds}")
    if args.json:
        print(json.dumps({"model": {"hidden": args.hidden, "layers": args.layers}, "steps": args.steps,
                          "runs": results}))
    return 0


__all__ = ["KINDS", "Run", "StepChange", "changed", "count_step", "kind_of", "main", "summary", "train", "wire"]

if __name__ == "__main__":
    raise SystemExit(main())
