"""The checksum's dispatch (weightsync.integrity.digest / fastsum): whichever path a region takes -- the
torch reductions on CPU, the one-pass Triton kernel on CUDA -- gives the word-by-word definition's bits.

On CPU the kernel itself runs under Triton's interpreter (``TRITON_INTERPRET=1``, a subprocess), with
small tiles so that column splits, row groups and masked tails all occur; tests/test_gpu_checksum.py
runs it compiled on a GPU."""

import os
import subprocess
import sys

import pytest
import torch

from weightsync.delta import codec
from weightsync.integrity.digest import checksum, checksums, reference, to_ints, words

HERE = os.path.dirname(os.path.abspath(__file__))
BASES = [0, 1, 12345, 2**40 + 7, 2**62, 2**63 - 1, 2**64 - 3]


def regions(seed: int) -> list[torch.Tensor]:
    """Random regions of every kind words_of meets: contiguous, strided, transposed, odd offsets, tails."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16).view(torch.bfloat16).to(dtype) \
            if dtype != torch.uint8 else torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    t = rnd(24, 40)
    u = rnd(1500, dtype=torch.uint8)
    f = torch.randn(9, 70, generator=g)
    out = [
        t, t[:, 4:36], t[:, 1:], t[3:17], t.t(), t[::2], rnd(7), rnd(1001), rnd(3, 5, 12),
        u[3:], u[8:1001], u[5:6], f, f[:, 2:], f[1:, :-1], torch.randn((), generator=g),
        (torch.randn(4, 33, generator=g) * 30).to(torch.float8_e4m3fn)[:, 1:],
        torch.randint(0, 2, (5, 13), generator=g, dtype=torch.bool), rnd(0, 8),
        rnd(3, 700)[:, 8:],  # wide strided rows: split into column tiles by the kernel's tiling
    ]
    return out


def test_dispatch_equals_the_word_by_word_reference_on_random_regions():
    for seed in (1, 2):
        rs = regions(seed)
        for i, r in enumerate(rs):
            base = BASES[(i + seed) % len(BASES)]
            assert to_ints([checksum(r, base)]) == [reference(r, base)], (i, r.shape, r.stride(), base)
        bases = [BASES[i % len(BASES)] for i in range(len(rs))]
        assert to_ints(list(checksums(rs, bases))) == [reference(r, b) for r, b in zip(rs, bases)]


def test_codec_checksum_over_parts_equals_the_reference_of_the_joined_bytes():
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (4 * 4096 + 13,), generator=g, dtype=torch.uint8)
    want = reference(x)
    for cuts in ([], [4096], [8, 4104, 12000], [3, 999, 5000]):
        at = [0, *cuts, x.numel()]
        assert codec.checksum([x[a:b] for a, b in zip(at, at[1:])]) == want, cuts


_INTERPRETED = r"""
import sys, torch
sys.path.insert(0, {here!r})
from test_checksum_fast import regions, BASES
from weightsync.integrity import fastsum
from weightsync.integrity.digest import reference, to_ints, words_of
fastsum.TILE, fastsum.BLOCK = 64, 16  # small tiles: column splits, row groups and masked tails all occur
assert fastsum.enabled(), "no Triton kernel under the interpreter"
for seed in (1, 2):
    rs = [r for r in regions(seed) if r.numel()]
    bases = [BASES[(i * 3 + seed) % len(BASES)] for i in range(len(rs))]
    ws = [words_of(r) for r in rs]
    assert all(fastsum.applies(w) for w in ws)
    got = to_ints(list(fastsum.sums([fastsum.Region(w, b) for w, b in zip(ws, bases)])))
    want = [reference(r, b) for r, b in zip(rs, bases)]
    bad = [(i, tuple(r.shape), r.stride()) for i, (r, a, b) in enumerate(zip(rs, got, want)) if a != b]
    assert not bad, bad
    again = to_ints(list(fastsum.sums([fastsum.Region(w, b) for w, b in zip(ws, bases)])))  # the kept table
    assert again == want
    one = to_ints([fastsum.checksum(w, b) for w, b in zip(ws, bases)])  # one region a launch (contiguous: no table)
    assert one == want
print("ok", len(rs))
"""


def test_the_triton_kernel_interpreted_equals_the_reference():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.dirname(HERE))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED.format(here=HERE)], env=env, capture_output=True,
                          text=True, timeout=300)
    if "only 0-dimensional arrays can be converted" in proc.stderr:  # Triton 3.6's interpreter under numpy 2
        pytest.skip("this Triton's interpreter cannot loop over loaded bounds (Triton >= 3.9 can)")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def test_words_counts_the_padded_tail():
    assert [words(torch.zeros(n, dtype=torch.uint8)) for n in (0, 1, 8, 9, 17)] == [0, 1, 1, 2, 3]
