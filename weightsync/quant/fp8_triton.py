"""The Triton kernel of :func:`weightsync.quant.fp8.quantize` (imported only there, on first use: Triton is optional).

One program per 128 x 128 block reads the block once into registers, takes its amax, writes its scale and its
e4m3 bytes: the definition's steps of :mod:`weightsync.quant.fp8`, with ``tl.math.div_rn`` where the definition
divides (Triton's ``/`` on fp32 is an approximate division on CUDA).
"""

import triton
import triton.language as tl


@triton.jit
def _e4m3_bits(y):
    # fp32 -> e4m3fn bits, round to nearest even, saturating as the hardware's cvt.rn.satfinite (and torch 2.13's
    # cast) do: what rounds above 448 (|y| > 464, inf) -> 448, NaN -> 0x7f; below 2**-6 (e4m3's smallest normal)
    # adding 2**14 rounds y to a multiple of 2**-9 (fp32's ulp there) and the low bits count those steps; above,
    # the 3 mantissa bits kept are rounded on the 20 dropped ones
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    odd = (a >> 20) & 1
    normal = ((a + 0x7FFFF + odd) >> 20) - (120 << 3)  # fp32's exponent bias 127 -> e4m3's 7
    sub = (tl.abs(y) + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000  # 0x46800000 = bits of 2.0**14
    r = tl.where(a < (121 << 23), sub, normal)  # 121 << 23 = bits of 2.0**-6
    r = tl.minimum(r, 0x7E)  # 0x7e = 448
    r = tl.where(a > 0x7F800000, 0x7F, r)  # NaN
    return (r | sign).to(tl.uint8)

@triton.jit
def _block(x, q, s, i, j, b, n, k, sxb, sxn, sqb, sqn, ssb, ssn, floor, inv_max, BLOCK: tl.constexpr,
           SOFT_CAST: tl.constexpr):
    # block (i, j) of 2-d weight b: read once, its scale and its e4m3 bytes written
    rows = i * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    cols = j * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = (rows[:, None] < n) & (cols[None, :] < k)
    v = tl.load(x + b * sxb + rows[:, None] * sxn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(v), axis=1), axis=0)
    nan = tl.max(tl.max((v != v).to(tl.int32), axis=1), axis=0)  # Triton's max may drop NaN; the definition keeps it
    sf = tl.maximum(amax, floor) * inv_max
    sf = tl.where(nan > 0, float("nan"), sf)
    inv = tl.math.div_rn(tl.full((BLOCK,), 1.0, tl.float32), tl.full((BLOCK,), 0.0, tl.float32) + sf)
    y = v * inv[None, :]
    if SOFT_CAST:  # the cast in integer arithmetic, written into q's bytes (q is a uint8 view)
        y = _e4m3_bits(y)
    else:  # the hardware's cvt.rn.satfinite
        y = y.to(tl.float8e4nv)
    tl.store(q + b * sqb + rows[:, None] * sqn + cols[None, :], y, mask=mask)
    tl.store(s + b * ssb + i * ssn + j, sf)


@triton.jit
def block_fp8(x, q, s, n, k, sxb, sxn, sqb, sqn, ssb, ssn, floor, inv_max, BLOCK: tl.constexpr,
              SOFT_CAST: tl.constexpr):
    # one weight (or a batch of them): grid (blocks along N, blocks along K, batch)
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    _block(x, q, s, i, j, b, n, k, sxb, sxn, sqb, sqn, ssb, ssn, floor, inv_max, BLOCK, SOFT_CAST)


@triton.jit
def block_fp8_many(tab, owner, first, floor, inv_max, BLOCK: tl.constexpr, SOFT_CAST: tl.constexpr,
                   IN_FP32: tl.constexpr, ALIGNED: tl.constexpr):
    # many weights of one dtype in one launch: a table row per weight (x, q, s addresses, n, k, batch stride,
    # row stride, blocks along N, blocks along K), the weight each program works on, each weight's first program
    pid = tl.program_id(0)
    m = tl.load(owner + pid).to(tl.int64)
    local = (pid - tl.load(first + m)).to(tl.int64)
    row = tab + m * 9
    if IN_FP32:
        x = tl.load(row + 0).to(tl.pointer_type(tl.float32))
    else:
        x = tl.load(row + 0).to(tl.pointer_type(tl.bfloat16))
    if SOFT_CAST:
        q = tl.load(row + 1).to(tl.pointer_type(tl.uint8))
    else:
        q = tl.load(row + 1).to(tl.pointer_type(tl.float8e4nv))
    s = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    n = tl.load(row + 3)
    k = tl.load(row + 4)
    sxb = tl.load(row + 5)
    sxn = tl.load(row + 6)
    bn = tl.load(row + 7)
    bk = tl.load(row + 8)
    if ALIGNED:  # every address 16-byte aligned, k and the strides multiples of 16: what the one-weight kernel's
        # arguments tell Triton by specialization, and what a table's values cannot (vectorized loads and stores)
        x = tl.multiple_of(x, 16)
        q = tl.multiple_of(q, 16)
        k = tl.multiple_of(k, 16)
        sxb = tl.multiple_of(sxb, 16)
        sxn = tl.multiple_of(sxn, 16)
    per = bn * bk
    b = local // per
    r = local - b * per
    i = r // bk
    j = r - i * bk
    _block(x, q, s, i, j, b, n, k, sxb, sxn, n * k, k, per, bk, floor, inv_max, BLOCK, SOFT_CAST)
