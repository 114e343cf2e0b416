"""Block FP8 on CUDA (weightsync.quant.fp8): the Triton kernel, compiled, gives the definition's bits -- the torch
definition on the CPU and on the GPU, and the upstream formula (DeepGEMM's / vLLM's per_block_cast_to_fp8) run
eagerly by torch on the GPU -- with the hardware's e4m3 conversion and with the integer one."""

from __future__ import annotations

import random

import pytest
import torch

from weightsync.quant import fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")
E4M3 = torch.float8_e4m3fn


def upstream_eager(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's ``per_block_cast_to_fp8`` (as vLLM 0.32 ships it, less its torch.compile decorator), re-typed
    from the upstream source: torch on x's device decides how each line rounds."""
    m, n = x.shape
    x_padded = torch.zeros((-(-m // 128) * 128, -(-n // 128) * 128), dtype=x.dtype, device=x.device)
    x_padded[:m, :n] = x
    x_view = x_padded.view(-1, 128, x_padded.size(1) // 128, 128)
    x_amax = x_view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = x_amax / 448.0
    x_scaled = (x_view * (1.0 / sf)).to(E4M3)
    return x_scaled.view_as(x_padded)[:m, :n].contiguous(), sf.view(x_view.size(0), x_view.size(2))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == E4M3 else t.view(torch.int32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a).cpu(), bits(b).cpu())


def cases() -> list[torch.Tensor]:
    rng, g = random.Random(3), torch.Generator(device="cuda").manual_seed(3)
    out = []
    for _ in range(10):
        n, k = rng.randint(1, 700), rng.randint(1, 700)
        dt = rng.choice([torch.bfloat16, torch.float32])
        x = (torch.randn(n, k, generator=g, device="cuda") * 10 ** rng.uniform(-3, 3)).to(dt)
        out.append(x)
    big = torch.randn(4096, 4224, generator=g, device="cuda").to(torch.bfloat16)  # 32 x 33 blocks
    big[128:256, 256:384] = 0  # a zero block
    big[:128, :128] *= 1e-6  # under the 1e-4 floor
    big[256:384] *= torch.logspace(-8, 2, 4224, device="cuda").to(torch.bfloat16)  # e4m3 subnormals after scaling
    wide = torch.randn(300, 1000, generator=g, device="cuda").to(torch.bfloat16)
    experts = torch.randn(4, 768, 2048, generator=g, device="cuda").to(torch.bfloat16)  # Qwen3-30B-A3B's gate
    experts[2] *= 100
    return out + [big, wide[:, 7:777], experts, experts[:, :640], torch.randn(2, 3, 129, 130, device="cuda")[:, 1]]


@pytest.fixture(params=["hardware", "integer"])
def cast(request, monkeypatch):
    if request.param == "integer":
        monkeypatch.setenv("WEIGHTSYNC_FP8_SOFT_CAST", "1")
    return request.param


def test_kernel_equals_the_definition_on_cpu_and_gpu(cast):
    assert fp8.enabled(), "Triton's kernel must build on the GPU host"
    assert fp8.soft_cast() == (cast == "integer")
    for x in cases():
        assert fp8.applies(x), (tuple(x.shape), x.stride())
        got = fp8.quantize(x)
        on_gpu = fp8.quantize_reference(x)
        on_cpu = fp8.quantize_reference(x.cpu())
        for name, want in (("definition on the GPU", on_gpu), ("definition on the CPU", on_cpu)):
            assert same(got.weight, want.weight) and same(got.scale_inv, want.scale_inv), (name, tuple(x.shape),
                                                                                           x.stride(), x.dtype)


@pytest.mark.parametrize("aligned", [False, True])
def test_many_weights_in_one_launch(cast, aligned):
    xs = cases()
    if aligned:  # every address, K and stride a multiple of 16: the launch gives Triton alignment hints
        xs = [x for x in xs if x.shape[-1] % 16 == 0 and x.stride(-2) % 16 == 0 and x.data_ptr() % 16 == 0]
        xs += [torch.randn(4096, 1024, device="cuda").to(torch.bfloat16), torch.randn(2, 384, 512, device="cuda")]
    outs = [fp8.Quantized(torch.full(x.shape, 5.0, device="cuda").to(E4M3),
                          torch.full(fp8.scale_shape(x.shape), -1.0, device="cuda")) for x in xs]  # poisoned
    assert not aligned or all(fp8._aligned(x, o) for x, o in zip(xs, outs))
    for _ in range(2):  # the second call reuses the kept launch table
        got = fp8.quantize_many(xs, outs, one_launch=True)
        for x, q in zip(xs, got):
            want = fp8.quantize_reference(x.cpu())
            assert same(q.weight, want.weight) and same(q.scale_inv, want.scale_inv), (tuple(x.shape), x.dtype)


def test_the_upstream_formula_run_eagerly_on_the_gpu_is_the_definition():
    for x in cases():
        if x.dim() != 2:
            continue
        q, s = upstream_eager(x)
        got = fp8.quantize(x)
        assert same(got.weight, q) and same(got.scale_inv, s), (tuple(x.shape), x.dtype)


def test_into_out_and_nonfinite_blocks():
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(1000, 900, generator=g, device="cuda").to(torch.bfloat16)
    out = fp8.Quantized(torch.full(x.shape, 5.0, device="cuda").to(E4M3),
                        torch.full(fp8.scale_shape(x.shape), -1.0, device="cuda"))
    assert fp8.quantize(x, out=out) is out and same(out.weight, fp8.quantize_reference(x.cpu()).weight)
    x[5, 7], x[300, 899], x[999, 0] = float("nan"), float("inf"), -float("inf")
    got, want = fp8.quantize(x), fp8.quantize_reference(x.cpu())
    assert fp8.nonfinite_blocks(got.scale_inv) == fp8.nonfinite_blocks(want.scale_inv) == [(0, 0), (2, 7), (7, 0)]
    ok = torch.isfinite(want.scale_inv)
    assert torch.equal(got.scale_inv.cpu()[ok], want.scale_inv[ok]) and torch.isnan(got.scale_inv[0, 0])
