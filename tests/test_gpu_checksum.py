"""The one-pass Triton checksum on CUDA (weightsync.integrity.fastsum) gives the torch path's bits and the
CPU's, on random regions of every kind (strided, odd offsets, tails, odd sizes, bases up to 2**64)."""

import random

import pytest
import torch

from weightsync.delta import codec
from weightsync.integrity import fastsum
from weightsync.integrity.digest import checksum, checksums, reference, to_ints

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")


@pytest.fixture
def torch_path(monkeypatch):
    """Run a function with the Triton kernel turned off (the torch reductions on the device)."""

    def run(fn):
        monkeypatch.setenv("WEIGHTSYNC_FAST_CHECKSUM", "0")
        try:
            return fn()
        finally:
            monkeypatch.delenv("WEIGHTSYNC_FAST_CHECKSUM")

    return run


def _regions(rng: random.Random, g: torch.Generator) -> list[torch.Tensor]:
    dev = "cuda"
    out = []
    for _ in range(12):
        rows, cols = rng.randint(1, 300), rng.randint(1, 3000)
        t = torch.randint(-(2**15), 2**15, (rows, cols), generator=g, device=dev, dtype=torch.int16).view(torch.bfloat16)
        a, b = sorted(rng.sample(range(cols + 1), 2))
        out += [t, t[:, a:b], t[rng.randint(0, rows - 1):], t.t()]
    for n in (1, 7, 8, 9, 4095, 65537, 1 << 20, 3 * (1 << 20) + 5):
        u = torch.randint(0, 256, (n + 11,), generator=g, device=dev, dtype=torch.uint8)
        out += [u[:n], u[rng.randint(1, 10):][:n]]  # aligned, and at an odd offset
    f = torch.randn(257, 70000, generator=g, device=dev)  # wide rows: split into column tiles
    out += [f, f[:, 3:], f[1:, : 65536 + 9], (f[:64, :999] * 30).to(torch.float8_e4m3fn)[:, 1:]]
    return out


def test_fast_path_equals_the_torch_path_and_the_cpu_bit_for_bit(torch_path):
    assert fastsum.enabled(), "Triton's kernel must build on the GPU host"
    rng, g = random.Random(11), torch.Generator(device="cuda").manual_seed(11)
    rs = _regions(rng, g)
    bases = [rng.choice([0, rng.randrange(1 << 40), rng.randrange(1 << 63, 1 << 64), (1 << 63) - 1]) for _ in rs]
    fast = to_ints([checksum(r, b) for r, b in zip(rs, bases)])
    slow = torch_path(lambda: to_ints([checksum(r, b) for r, b in zip(rs, bases)]))
    cpu = to_ints([checksum(r.cpu(), b) for r, b in zip(rs, bases)])
    assert fast == slow == cpu
    assert to_ints(list(checksums(rs, bases))) == fast  # all regions in one launch
    for r, b, v in zip(rs, bases, fast):
        if r.numel() * r.element_size() < 20000:
            assert v == reference(r, b)


def test_fast_path_sees_one_flipped_bit_anywhere():
    g = torch.Generator(device="cuda").manual_seed(3)
    t = torch.randint(0, 256, (1 << 22,), generator=g, device="cuda", dtype=torch.uint8)
    clean = to_ints([checksum(t, 5)])[0]
    for at in (0, 1, 4095, 1 << 21, (1 << 22) - 1):
        for bit in (0, 7):
            t[at] ^= 1 << bit
            assert to_ints([checksum(t, 5)])[0] != clean, (at, bit)
            t[at] ^= 1 << bit
    assert to_ints([checksum(t, 5)])[0] == clean


def test_codec_checksum_on_cuda_parts_equals_the_cpu(torch_path):
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randint(0, 256, ((1 << 22) + 13,), generator=g, device="cuda", dtype=torch.uint8)
    want = codec.checksum([x.cpu()])
    for cuts in ([], [4096], [8, 4104, 1 << 21], [3, 999, 50001]):
        at = [0, *cuts, x.numel()]
        parts = [x[a:b] for a, b in zip(at, at[1:])]
        assert codec.checksum(parts) == want == torch_path(lambda: codec.checksum(parts)), cuts
