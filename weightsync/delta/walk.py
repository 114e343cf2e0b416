"""An RL trainer's weights over steps, as a delta sees them: Adam on fp32 master weights, bf16 on the wire.

At RL learning rates Adam moves each fp32 master weight by about ``lr`` a step, far less than one
bf16 step of a weight near 1 (2^-8 relative), so most bf16 elements do not change from one step to
the next; which ones do is decided by rounding. :class:`AdamWalk` replays that deterministically
(gradients are seeded noise, so every process of a test or the demo computes the same weights),
for the demo's ``--lr`` trainer, the tests and the bench. It is a stand-in for the gradients, not for
the optimizer: the change fractions of real training are measured by :mod:`weightsync.delta.measure`.
"""

from __future__ import annotations

from typing import Mapping

import torch


class AdamWalk:
    """fp32 master weights taking Adam steps on seeded random gradients; :meth:`step` returns the
    weights in their own dtypes (what the trainer sends)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], lr: float, seed: int = 0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        self.lr, self.seed, self.betas, self.eps = lr, seed, betas, eps
        self.dtypes = {n: t.dtype for n, t in weights.items()}
        self.master = {n: t.detach().to(torch.float32).clone() for n, t in weights.items()}
        self.m = {n: torch.zeros_like(t) for n, t in self.master.items()}
        self.v = {n: torch.zeros_like(t) for n, t in self.master.items()}
        self.steps = 0

    def step(self) -> dict[str, torch.Tensor]:
        self.steps += 1
        b1, b2 = self.betas
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.steps)
        for n in sorted(self.master):
            p, m, v = self.master[n], self.m[n], self.v[n]
            grad = torch.randn(p.shape, generator=g)
            m.mul_(b1).add_(grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            mhat = m / (1 - b1 ** self.steps)
            vhat = v / (1 - b2 ** self.steps)
            p.addcdiv_(mhat, vhat.sqrt_().add_(self.eps), value=-self.lr)
        return self.weights()

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.to(self.dtypes[n]) for n, p in self.master.items()}


def changed_fraction(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The fraction of elements whose bits differ between two versions of the same weights."""
    changed = total = 0
    for n, x in a.items():
        y = b[n]
        changed += int(torch.count_nonzero(x.view(torch.uint8).view(-1, x.element_size()).ne(
            y.view(torch.uint8).view(-1, y.element_size())).any(1))) if x.numel() else 0
        total += x.numel()
    return changed / max(total, 1)
