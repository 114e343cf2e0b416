"""Block FP8 (weightsync.quant.fp8): the torch definition equals the upstream formula, re-typed here block by block
and run as installed (vLLM's per_block_cast_to_fp8), bit for bit; the Triton kernel equals the definition under
Triton's interpreter (tests/test_fp8_gpu.py runs it compiled on a GPU).

The upstream line ``sf = x_amax / 448.0`` divides on CPU and multiplies by fp32(1/448) on CUDA (torch's
``div_true_kernel_cuda``); the definition is the CUDA one, so on CPU it equals the formula with the multiplication
written out, and vLLM's code run on CPU equals the formula with the division. Both are checked, and that the two
really differ on these inputs (so the checks can tell them apart)."""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weightsync.quant.fp8 import (
    BLOCK,
    Quantized,
    dequantize,
    nonfinite_blocks,
    quantize,
    quantize_reference,
    scale_shape,
)

HERE = os.path.dirname(os.path.abspath(__file__))
E4M3 = torch.float8_e4m3fn


def upstream(x: torch.Tensor, scale_step: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The upstream recipe (vLLM's / DeepGEMM's per_block_cast_to_fp8), written independently of the module: block
    by block over plain slices of the 2-d weight ``x``. ``scale_step`` is how ``x_amax / 448.0`` is evaluated:
    ``"mul"`` as torch does on CUDA (times fp32(1/448)), ``"div"`` as on CPU (an IEEE division)."""
    n, k = x.shape
    q = torch.empty(n, k, dtype=E4M3)
    s = torch.empty(math.ceil(n / 128), math.ceil(k / 128), dtype=torch.float32)
    c448 = torch.tensor(448.0, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            amax = torch.max(blk.abs().max(), torch.tensor(1e-4, dtype=torch.float32))  # .clamp(1e-4)
            sf = amax * (torch.tensor(1.0, dtype=torch.float32) / c448) if scale_step == "mul" else amax / c448
            inv = torch.tensor(1.0, dtype=torch.float32) / sf  # 1.0 / sf
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk * inv).to(E4M3)
            s[i, j] = sf
    return q, s


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == E4M3 else t.view(torch.int32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def weights(seed: int) -> list[torch.Tensor]:
    """Random weights of every kind the quantizer meets: edge blocks (N, K not multiples of 128), a zero block,
    a block under the 1e-4 floor, values down in e4m3's subnormals after scaling, bf16 and fp32, wide ranges."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    zero = rnd(300, 260)
    zero[128:256, 0:128] = 0  # one whole block of zeros
    zero[:128, 256:] = 0  # a partial edge block of zeros
    tiny = rnd(256, 200, dtype=torch.float32)
    tiny[:128, :128] *= 1e-7  # amax below the 1e-4 floor: clamped
    spread = rnd(130, 384)
    spread[:, :128] *= torch.logspace(-6, 2, 130).to(torch.bfloat16)[:, None]  # subnormal results
    return [
        rnd(300, 260), rnd(128, 128, dtype=torch.float32), rnd(1, 1), rnd(129, 1), rnd(1, 257, dtype=torch.float32),
        rnd(256, 384, scale=0.02), rnd(200, 130, dtype=torch.float32, scale=1e3), zero, tiny, spread,
    ]


@pytest.mark.parametrize("seed", [1, 2])
def test_the_definition_is_the_upstream_formula_as_cuda_runs_it(seed):
    differs = 0
    for x in weights(seed):
        got = quantize_reference(x)
        q, s = upstream(x, "mul")
        assert same(got.weight, q) and same(got.scale_inv, s), (tuple(x.shape), x.dtype)
        assert got.weight.shape == x.shape and tuple(got.scale_inv.shape) == scale_shape(x.shape)
        qd, sd = upstream(x, "div")
        differs += not (same(q, qd) and same(s, sd))
    assert differs, "the CPU and CUDA forms of the scale agree on every input: the check cannot tell them apart"


def test_zero_and_floor_blocks():
    x = weights(3)[7]  # "zero"
    r = quantize_reference(x)
    floor = torch.tensor(1e-4, dtype=torch.float32) * (torch.tensor(1.0) / torch.tensor(448.0))
    assert same(r.scale_inv[1, 0], floor) and same(r.scale_inv[0, 2], floor)
    assert not bits(r.weight[128:256, :128]).any() and not bits(r.weight[:128, 256:]).any()
    assert bits(r.weight[:128, :128]).any()


def test_stacked_experts_are_quantized_each_on_its_own():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 200, 136, generator=g).to(torch.bfloat16)
    x[1] *= 50  # another expert's range must not leak into its neighbours' blocks
    r = quantize_reference(x)
    assert r.weight.shape == x.shape and r.scale_inv.shape == (3, 2, 2)
    for e in range(3):
        one = quantize_reference(x[e])
        assert same(r.weight[e], one.weight) and same(r.scale_inv[e], one.scale_inv)


def test_dequantize_is_fp8_times_the_block_scale_within_e4m3_precision():
    for x in weights(5):
        r = quantize_reference(x)
        back = dequantize(r)
        scale = r.scale_inv.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[: x.shape[0], : x.shape[1]]
        err = (back - x.float()).abs()
        # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value, and subnormals are spaced 2**-9 * scale
        assert bool((err <= x.float().abs() / 16 + scale * 2.0**-10 + 1e-30).all())
        assert same(back[:128, :128], r.weight[:128, :128].float() * r.scale_inv[0, 0])  # fp8 * scale_inv, per block
    assert dequantize(r, torch.bfloat16).dtype == torch.bfloat16


def test_nonfinite_blocks_get_nonfinite_scales():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(300, 300, generator=g).to(torch.bfloat16)
    x[5, 7] = float("nan")
    x[200, 290] = float("inf")
    r = quantize_reference(x)
    assert nonfinite_blocks(r.scale_inv) == [(0, 0), (1, 2)]
    assert torch.isnan(r.scale_inv[0, 0]) and torch.isinf(r.scale_inv[1, 2])
    clean = quantize_reference(torch.where(torch.isfinite(x), x, torch.zeros_like(x)))
    ok = torch.isfinite(r.scale_inv)
    assert torch.equal(r.scale_inv[ok], clean.scale_inv[ok])
    assert same(r.weight[128:256, :256], clean.weight[128:256, :256])


def test_refusals():
    with pytest.raises(TypeError, match="torch.float16; block FP8 quantizes bf16 or fp32 weights only"):
        quantize(torch.zeros(4, 4, dtype=torch.float16), name="model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize(torch.zeros(4))
    x = torch.ones(130, 130)
    with pytest.raises(ValueError, match=r"out must be float8_e4m3fn \(130, 130\) and float32 \(2, 2\) .*contiguous rows"):
        quantize(x, out=Quantized(torch.empty(130, 130, dtype=E4M3), torch.empty(1, 2)))
    with pytest.raises(ValueError, match=r"contiguous rows"):  # columns strided: the kernel writes rows
        quantize(x, out=Quantized(torch.empty(130, 260, dtype=E4M3)[:, ::2], torch.empty(2, 2)))


def test_quantize_into_a_box_of_a_larger_tensor_on_cpu_is_the_definition():
    """A co-located FP8 sync quantizes into a box of the engine's live weight and of its scales (rows contiguous,
    strided between them): the box gets the definition's bits, nothing around it is written."""
    x = torch.randn(260, 300).to(torch.bfloat16)
    big_w, big_s = torch.full((400, 520), 5.0).to(E4M3), torch.full((4, 5), -1.0)
    box = Quantized(big_w[128:388, 128:428], big_s[1:4, 1:4])
    want = quantize_reference(x)
    assert quantize(x, out=box) is box and same(box.weight, want.weight) and same(box.scale_inv, want.scale_inv)
    assert (big_w[:128].float() == 5.0).all() and (big_w[:, :128].float() == 5.0).all()
    assert (big_s[0] == -1).all() and (big_s[:, 0] == -1).all() and (big_s[:, 4] == -1).all()


def test_quantize_into_out_on_cpu_is_the_definition():
    x = weights(7)[0]
    out = Quantized(torch.full(x.shape, 7.0).to(E4M3), torch.full(scale_shape(x.shape), -1.0))  # poisoned
    got = quantize(x, out=out)
    want = quantize_reference(x)
    assert got is out and same(out.weight, want.weight) and same(out.scale_inv, want.scale_inv)


# -- the upstream code as installed ------------------------------------------------------------------


def _installed_upstream():
    """vLLM's ``per_block_cast_to_fp8`` from the installed vllm/utils/deep_gemm.py, run eagerly, without importing
    vLLM (whose import takes minutes on a loaded 2-core machine): the function's own source less its
    ``torch.compile`` decorator, with the two platform look-ups it makes answered as on CUDA/CPU (e4m3fn, finfo's
    max)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    path = Path(spec.submodule_search_locations[0]) / "utils" / "deep_gemm.py"
    tree = ast.parse(path.read_text())
    wanted = {"per_block_cast_to_fp8", "_align", "_ceil_to_ue8m0", "DEFAULT_BLOCK_SIZE"}
    body = [n for n in tree.body if getattr(n, "name", None) in wanted
            or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) in wanted for t in n.targets))]
    assert any(getattr(n, "name", None) == "per_block_cast_to_fp8" for n in body), f"{path}: no per_block_cast_to_fp8"
    for n in body:  # vLLM 0.32 wraps it in torch.compile(dynamic=True): the eager body is DeepGEMM's formula
        if isinstance(n, ast.FunctionDef):
            n.decorator_list = []

    class Platform:
        @staticmethod
        def fp8_dtype():
            return E4M3

    ns = {"torch": torch, "current_platform": Platform, "cdiv": lambda a, b: -(-a // b),
          "get_fp8_min_max": lambda: (torch.finfo(E4M3).min, torch.finfo(E4M3).max)}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)
    return ns["per_block_cast_to_fp8"]


def test_the_installed_vllm_code_on_cpu_is_the_formula_with_a_division():
    fn = _installed_upstream()
    for x in weights(8):
        q, s = fn(x)
        want_q, want_s = upstream(x, "div")
        assert same(q, want_q) and same(s, want_s), (tuple(x.shape), x.dtype)


# -- the kernel, under Triton's interpreter --------------------------------------------------------

_INTERPRETED = r"""
import sys, torch
sys.path.insert(0, {here!r})
import triton, triton.language as tl
from test_fp8_quant import weights, same
from weightsync.quant import fp8
from weightsync.quant.fp8_triton import _e4m3_bits
assert fp8.enabled(), "no Triton kernel under the interpreter"
assert fp8.soft_cast()

# 1. the integer cast equals torch's, on every e4m3 value, every midpoint and its neighbours, and random values
@triton.jit
def cast(x, y, n, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.store(y + o, _e4m3_bits(tl.load(x + o, mask=o < n, other=0.0)), mask=o < n)

grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
grid = grid[torch.isfinite(grid)].unique()
mid = (grid[1:] + grid[:-1]) / 2
near = torch.cat([mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1), grid, -mid, -grid])
vals = torch.cat([near, torch.randn(20000) * 100, torch.randn(5000) * 0.01, torch.tensor([0.0, -0.0, 463.9, 464.0,
                  479.9, 480.0, 1e6, float("inf"), -float("inf"), float("nan"), 2.0**-10, 2.0**-9 * 1.5, 2.0**-7])])
out = torch.empty(vals.numel(), dtype=torch.uint8)
cast[(1,)](vals, out, vals.numel(), B=triton.next_power_of_2(vals.numel()))
want = vals.to(torch.float8_e4m3fn).view(torch.uint8)
fine = vals.abs() < 464  # above, torch's CPU cast saturated or gave NaN, depending on its version
bad = (out != want) & fine
assert not bad.any(), [(vals[i].item(), int(out[i]), int(want[i])) for i in bad.nonzero().flatten()[:8]]
assert ((out[torch.isnan(vals)] & 0x7F) == 0x7F).all()  # NaN stays NaN
big = (vals.abs() >= 464) & ~torch.isnan(vals)  # saturated, as the hardware's cvt.rn.satfinite does
assert big.sum() >= 5 and ((out[big] & 0x7F) == 0x7E).all()
assert torch.equal(out[big] >> 7, (vals[big] < 0).to(torch.uint8))

# 2. the kernel equals the definition: contiguous, strided rows, stacked experts, edge/zero/floor blocks, into out
cases = weights(11)
wide = torch.randn(200, 400).to(torch.bfloat16)
cases += [wide[:, 13:290], torch.randn(3, 130, 129).to(torch.bfloat16), torch.randn(2, 5, 128, 64)[:, 1]]
for x in cases:
    assert fp8.applies(x), tuple(x.shape)
    got, want = fp8.quantize(x), fp8.quantize_reference(x)
    assert same(got.weight, want.weight) and same(got.scale_inv, want.scale_inv), (tuple(x.shape), x.stride(), x.dtype)
aligned = [torch.randn(256, 384).to(torch.bfloat16), torch.randn(2, 130, 256).to(torch.bfloat16), torch.randn(300, 144)]
def empty(x):
    return fp8.Quantized(torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(fp8.scale_shape(x.shape)))
assert all(fp8._aligned(x, empty(x)) for x in aligned) and not all(fp8._aligned(x, empty(x)) for x in cases)
for group in (cases, aligned):  # all of them in one launch per dtype (aligned: with Triton's alignment hints)
    outs = fp8.quantize_many(group, one_launch=True)
    for x, got in zip(group, outs):
        want = fp8.quantize_reference(x)
        assert same(got.weight, want.weight) and same(got.scale_inv, want.scale_inv), ("many", tuple(x.shape), x.dtype)
assert fp8.quantize_many(aligned, outs, one_launch=True) == outs  # the kept table
x = cases[0]
out = fp8.Quantized(torch.full(x.shape, 3.0).to(torch.float8_e4m3fn), torch.full(fp8.scale_shape(x.shape), -1.0))
assert fp8.quantize(x, out=out) is out and same(out.weight, fp8.quantize_reference(x).weight)

# 2b. into boxes of larger tensors (a co-located FP8 sync writes the engine's live weight and scales in place):
# rows contiguous, strided between them; nothing outside the boxes written
x = torch.randn(260, 300).to(torch.bfloat16)
big_w, big_s = torch.full((3, 400, 520), 5.0).to(torch.float8_e4m3fn), torch.full((3, 4, 5), -1.0)
box = fp8.Quantized(big_w[1, 128:388, 128:428], big_s[1, 1:4, 1:4])
want = fp8.quantize_reference(x)
assert fp8.quantize(x, out=box) is box and same(box.weight, want.weight) and same(box.scale_inv, want.scale_inv)
assert (big_w[0].float() == 5.0).all() and (big_w[1, :128].float() == 5.0).all() and (big_s[2] == -1).all()
assert (big_s[1, 0] == -1).all() and (big_s[1, :, 0] == -1).all()

# 3. non-finite blocks: the same non-finite scales as the definition (Triton's max alone would drop a NaN)
y = torch.randn(300, 300).to(torch.bfloat16)
y[5, 7], y[200, 290], y[130, 3] = float("nan"), float("inf"), float("nan")
got, want = fp8.quantize(y), fp8.quantize_reference(y)
assert fp8.nonfinite_blocks(got.scale_inv) == fp8.nonfinite_blocks(want.scale_inv) == [(0, 0), (1, 0), (1, 2)]
ok = torch.isfinite(want.scale_inv)
assert torch.equal(got.scale_inv[ok], want.scale_inv[ok]) and torch.isnan(got.scale_inv[0, 0])
assert same(got.weight[:128, 128:], want.weight[:128, 128:])
print("ok", len(cases))
"""


def test_the_triton_kernel_interpreted_equals_the_definition():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.dirname(HERE))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED.format(here=HERE)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]
