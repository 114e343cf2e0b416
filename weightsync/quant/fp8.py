"""Block FP8: a weight quantized per 128 x 128 block to e4m3 with an fp32 inverse scale per block.

This is the format of the block-FP8 checkpoints of DeepSeek-V3, Kimi-K2 and Qwen3-FP8: ``weight``
``float8_e4m3fn [N, K]`` beside ``weight_scale_inv`` ``float32 [ceil(N/128), ceil(K/128)]``, the weight
being ``fp8 * scale_inv`` per block (the name says the scale is the *inverse* of the factor applied when
quantizing). Those checkpoints do not say which code made them (DeepSeek-V3's came out of its FP8
training, which is not public; its ``inference/kernel.py`` quantizes activations only), so the bits are
matched to the block quantizer the engines ship:

**The definition** is vLLM's ``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py``, "taken from
DeepGEMM ``deep_gemm/utils/math.py``"; ``use_ue8m0=False``, ``block_size=[128, 128]``) *as PyTorch runs
it on CUDA*, where vLLM and DeepGEMM run it. Per block of a 2-d weight ``x`` (any leading dims are a
batch of 2-d weights, e.g. stacked experts; a block never crosses one):

1. ``amax = max |x|`` over the block, in fp32 (bf16 -> fp32 is exact). Partial edge blocks (N or K not
   a multiple of 128) are the upstream's zero padding: the missing elements count as 0, which cannot
   raise a maximum of absolute values; nothing outside ``[N, K]`` is written.
2. ``amax = max(amax, fp32(1e-4))`` (``.clamp(1e-4)``): an all-zero block gets
   ``scale_inv = 1e-4 / 448`` and all-zero fp8, not a division by zero.
3. ``scale_inv = amax * fp32(1/448)``: the upstream line is ``x_amax / 448.0``, a division by a Python
   scalar, which torch's CUDA kernel computes as a multiplication by the scalar's fp32 reciprocal
   (``div_true_kernel_cuda``: "compute a * reciprocal(b)"); torch's CPU kernel divides. The two differ in
   the last bit of about half the scales (measured: 53 % of random fp32 values), so the same Python line
   gives a CPU checkpoint other scales than a GPU one. Here the multiplication is written out, and CPU
   and GPU give the same bits.
4. ``inv = 1 / scale_inv``, an IEEE fp32 division rounded to nearest (upstream ``1.0 / sf``, which torch
   evaluates as ``reciprocal(sf) * 1.0``; torch's reciprocal divides on both devices).
5. ``fp8 = e4m3fn(fp32(x) * inv)``: one fp32 multiplication rounded to nearest, then the cast, rounded
   to nearest-even with e4m3's subnormals (torch's ``.to(torch.float8_e4m3fn)``; ``|x * inv| <= 448``
   up to a few ulp, far below 464, above which casts differ: the hardware and torch 2.13 saturate to 448,
   older torch CPU casts gave NaN).

Checked bit for bit: on CPU against the formula re-typed block by block and against the installed vLLM
function run eagerly (with its CPU division: tests/test_fp8_quant.py); on an H200 against the formula run
eagerly by torch on CUDA (tests/test_fp8_gpu.py). vLLM 0.32 wraps the function in ``torch.compile``; what
the compiled form gives was not checked.

A block holding a NaN or an infinity gets a NaN or infinite ``scale_inv`` (what the definition gives:
``amax`` is NaN or inf); its fp8 values are not specified. :func:`nonfinite_blocks` finds such blocks.

:func:`quantize` runs the definition as one Triton kernel on CUDA (one read of the weight, one write of
the fp8 and the scales: a copy's traffic at 3/4 of its bytes for bf16), bit-identical to
:func:`quantize_reference` (the same steps, with ``tl.math.div_rn`` for step 4 because Triton's ``/`` on
fp32 is an approximate division); elsewhere, or with ``WEIGHTSYNC_FP8_KERNEL=0``, the torch definition.
:func:`quantize_many` does a list of weights (see there for one launch for all); :func:`dequantize` gives
back ``fp8 * scale_inv`` per block (for verification).
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from weightsync.lazy_kernel import LazyKernel, readable

log = logging.getLogger("weightsync.quant.fp8")


def _fp32(v: float) -> float:
    """``v`` rounded to the nearest fp32 (as a Python float, exactly that fp32 value)."""
    return struct.unpack("f", struct.pack("f", v))[0]


BLOCK = 128  # the block edge: 128 x 128 (weight_block_size = [128, 128])
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = _fp32(1e-4)  # the upstream ``.clamp(1e-4)`` on an fp32 tensor compares with fp32(1e-4)
INV_FP8_MAX = _fp32(1 / 448)  # torch's CUDA ``x / 448.0`` multiplies by fp32(1/448) (= 1.0f / 448.0f)
INPUT_DTYPES = (torch.bfloat16, torch.float32)  # what a trainer holds (fp16 trainers are refused)
WARPS = 8


@dataclass(frozen=True)
class Quantized:
    """A block-FP8 weight: ``weight`` e4m3 ``[..., N, K]``, ``scale_inv`` fp32 ``[..., ceil(N/128), ceil(K/128)]``."""

    weight: torch.Tensor
    scale_inv: torch.Tensor


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(shape: tuple[int, ...] | torch.Size, block: int = BLOCK) -> tuple[int, ...]:
    """The shape of the ``scale_inv`` of a weight of ``shape``: the last two dims counted in blocks."""
    if len(shape) < 2:
        raise ValueError(f"block FP8 needs a weight of at least 2 dims, got shape {tuple(shape)}")
    *lead, n, k = shape
    return (*lead, cdiv(n, block), cdiv(k, block))


def _check(x: torch.Tensor, what: str) -> None:
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"fp8: {what} is {x.dtype}; block FP8 quantizes bf16 or fp32 weights only")
    scale_shape(x.shape)


# -- the definition ----------------------------------------------------------------------------------


def quantize_reference(x: torch.Tensor, name: str = "weight") -> Quantized:
    """The definition (see the module docstring), in torch, on ``x``'s device; ``x`` is not changed."""
    _check(x, name)
    *lead, n, k = x.shape
    bn, bk = cdiv(n, BLOCK), cdiv(k, BLOCK)
    padded = torch.zeros((*lead, bn * BLOCK, bk * BLOCK), dtype=torch.float32, device=x.device)
    padded[..., :n, :k] = x  # exact: bf16 -> fp32
    blocks = padded.view(*lead, bn, BLOCK, bk, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=AMAX_FLOOR)  # NaN stays NaN
    scale_inv = amax * torch.tensor(INV_FP8_MAX, dtype=torch.float32, device=x.device)
    inv = torch.ones((), dtype=torch.float32, device=x.device) / scale_inv  # IEEE division (tensor / tensor)
    q = (blocks * inv[..., :, None, :, None]).to(torch.float8_e4m3fn)
    return Quantized(q.view(*lead, bn * BLOCK, bk * BLOCK)[..., :n, :k].contiguous(), scale_inv)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8 * scale_inv`` per block, in fp32, then cast to ``dtype`` (what a block-FP8 GEMM's weight stands for)."""
    *lead, n, k = q.weight.shape
    if tuple(q.scale_inv.shape) != scale_shape(q.weight.shape):
        raise ValueError(f"fp8: scale_inv {tuple(q.scale_inv.shape)} does not fit weight {tuple(q.weight.shape)} "
                         f"(expected {scale_shape(q.weight.shape)})")
    s = q.scale_inv.float().repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)[..., :n, :k]
    return (q.weight.float() * s).to(dtype)


def nonfinite_blocks(scale_inv: torch.Tensor, limit: int = 8) -> list[tuple[int, ...]]:
    """The block indices (up to ``limit``) whose scale is NaN or infinite: blocks that held a NaN or an infinity."""
    bad = (~torch.isfinite(scale_inv)).nonzero()
    return [tuple(int(i) for i in row) for row in bad[:limit].tolist()] if bad.numel() else []


# -- the kernel ----------------------------------------------------------------------------------------


def _build():
    from weightsync.quant import fp8_triton  # imports Triton: only here, on first use

    return fp8_triton


#: the Triton functions (:mod:`weightsync.quant.fp8_triton`), compiled on first use
_KERNEL = LazyKernel(_build, "WEIGHTSYNC_FP8_KERNEL", log, "fp8", "the torch definition")


def enabled() -> bool:
    """Whether the kernel may be used at all (Triton importable, not turned off by ``WEIGHTSYNC_FP8_KERNEL=0``)."""
    return _KERNEL.enabled()


def applies(x: torch.Tensor) -> bool:
    """Whether the kernel can read ``x``: on CUDA (or anywhere under ``TRITON_INTERPRET=1``, for tests), last dim
    contiguous, and the dims before the last two collapsible into one batch stride."""
    if not (readable(x) and x.dim() >= 2 and x.dtype in INPUT_DTYPES):
        return False
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        return False
    return _batch_stride(x) is not None and enabled()


def _batch_stride(x: torch.Tensor) -> int | None:
    """The one stride between the 2-d weights of ``x``'s leading dims, or None when they are not evenly spaced."""
    lead = x.shape[:-2]
    if not lead or all(d == 1 for d in lead):
        return 0
    try:
        return x.view(-1, *x.shape[-2:]).stride(0)
    except RuntimeError:
        return None


def _strided_ok(t: torch.Tensor) -> bool:
    """Whether the kernel can write ``t``: rows of contiguous elements, the leading dims one batch stride apart."""
    return (t.shape[-1] <= 1 or t.stride(-1) == 1) and _batch_stride(t) is not None


def _check_out(x: torch.Tensor, out: Quantized, name: str) -> None:
    """``out`` must have the shapes and dtypes of ``x``'s block FP8 on its device; it may be a strided view (a box of
    an engine's live FP8 weight and its ``_scale_inv``, written in place by a co-located sync) whose rows are
    contiguous."""
    sshape = scale_shape(x.shape)
    if (tuple(out.weight.shape) != tuple(x.shape) or out.weight.dtype != torch.float8_e4m3fn
            or tuple(out.scale_inv.shape) != sshape or out.scale_inv.dtype != torch.float32
            or not _strided_ok(out.weight) or not _strided_ok(out.scale_inv)
            or out.weight.device != x.device or out.scale_inv.device != x.device):
        raise ValueError(f"fp8: {name}: out must be float8_e4m3fn {tuple(x.shape)} and float32 {sshape} on "
                         f"{x.device} with contiguous rows, got {out.weight.dtype} {tuple(out.weight.shape)} and "
                         f"{out.scale_inv.dtype} {tuple(out.scale_inv.shape)}")


def soft_cast() -> bool:
    """Whether the kernel casts to e4m3 in integer arithmetic instead of the hardware's conversion: under Triton's
    interpreter, whose float8 cast drops the carry when rounding reaches the next power of two (Triton 3.9:
    31.6 -> 16 instead of 32), and where ``WEIGHTSYNC_FP8_SOFT_CAST=1`` asks for it (to test it on a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("WEIGHTSYNC_FP8_SOFT_CAST") == "1"


def quantize(x: torch.Tensor, out: Quantized | None = None, name: str = "weight") -> Quantized:
    """``x`` in block FP8 (the definition of :func:`quantize_reference`), by the Triton kernel where it
    :func:`applies`, else by the torch definition; into ``out`` (of the right shapes and dtypes, rows
    contiguous: a box of a live FP8 weight and its ``_scale_inv`` is written in place) when given. Queues the work on CUDA without synchronising."""
    _check(x, name)
    sshape = scale_shape(x.shape)
    if out is not None:
        _check_out(x, out, name)
    if not applies(x):
        got = quantize_reference(x, name)
        if out is None:
            return got
        out.weight.copy_(got.weight)
        out.scale_inv.copy_(got.scale_inv)
        return out
    if out is None:
        out = Quantized(torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
                        torch.empty(sshape, dtype=torch.float32, device=x.device))
    *lead, n, k = x.shape
    batch = 1
    for d in lead:
        batch *= d
    if batch * n * k == 0:
        return out
    bn, bk = cdiv(n, BLOCK), cdiv(k, BLOCK)
    sxb = _batch_stride(x)
    soft = soft_cast()
    q = out.weight.view(torch.uint8) if soft else out.weight
    w, sc = out.weight, out.scale_inv
    _KERNEL.kernel.block_fp8[(bn, bk, batch)](x, q, sc, n, k, sxb, x.stride(-2), _batch_stride(w), w.stride(-2),
                                              _batch_stride(sc), sc.stride(-2), AMAX_FLOOR, INV_FP8_MAX, BLOCK=BLOCK,
                                              SOFT_CAST=soft, num_warps=WARPS)
    return out


def quantize_many(xs: Sequence[torch.Tensor], outs: Sequence[Quantized] | None = None,
                  names: Sequence[str] | None = None, one_launch: bool | None = None) -> list[Quantized]:
    """Each of ``xs`` in block FP8, as :func:`quantize` gives it (``outs`` as its ``out``).

    By default one launch per weight. ``one_launch`` (default: ``WEIGHTSYNC_FP8_ONE_LAUNCH=1``) puts all of them
    in one launch per input dtype where the kernel :func:`applies` to all on one device: on the H200 a launch per
    weight made qwen3-8b's 252 matrices launch-bound (10.2 ms for 13.9 GB, 0.48 of HBM, while its 100 MB MLP
    matrices alone ran at 0.81), but the first one-launch kernel was 7 x slower (72 ms): sizes and addresses read
    from a table carry no alignment, so Triton cannot vectorize. Where every address is 16-byte aligned and every
    K and stride a multiple of 16 (real weights), the launch now tells Triton so (``tl.multiple_of``); that
    version is bit-identical under the interpreter but was not run on a GPU yet (``benchmarks/fp8_quant_gpu.sh``
    measures it). The launch table is a function of the tensors' addresses, shapes and strides only, so it is kept
    on the device for the next call with the same ones (a step's weights: the same every step)."""
    names = list(names) if names is not None else [f"weight {i}" for i in range(len(xs))]
    if outs is None:
        outs = [Quantized(torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
                          torch.empty(scale_shape(x.shape), dtype=torch.float32, device=x.device)) for x in xs]
    if len(outs) != len(xs):
        raise ValueError(f"fp8: {len(xs)} weights but {len(outs)} outs")
    if not _one_launch(xs, outs, one_launch):
        return [quantize(x, o, n) for x, o, n in zip(xs, outs, names)]
    for x, o, n in zip(xs, outs, names):
        _check(x, n)
        _check_out(x, o, n)
    for launch in _many_launches(xs, outs):
        launch()
    return list(outs)


def prepare(xs: Sequence[torch.Tensor], outs: Sequence[Quantized], names: Sequence[str] | None = None,
            one_launch: bool | None = None) -> Callable[[], None]:
    """:func:`quantize_many` for weights and outputs that stay where they are (a step's sources into a transport's
    fixed buffers or an engine's live weights), checked once: the returned function queues the same kernels (one
    launch a weight, or one launch per input dtype as ``one_launch`` / ``WEIGHTSYNC_FP8_ONE_LAUNCH`` say), allocates
    nothing, copies nothing from the host and never synchronises, so a CUDA graph may capture it. It holds its
    one-launch tables itself: a graph replays the tables' addresses, which :data:`_TABLES` alone may drop."""
    names = list(names) if names is not None else [f"weight {i}" for i in range(len(xs))]
    if len(outs) != len(xs):
        raise ValueError(f"fp8: {len(xs)} weights but {len(outs)} outs")
    for x, o, n in zip(xs, outs, names):
        _check(x, n)
        _check_out(x, o, n)
    if _one_launch(xs, outs, one_launch):
        launches = _many_launches(xs, outs)
    else:
        jobs = [(x, o, n) for x, o, n in zip(xs, outs, names)]

        def each() -> None:
            for x, o, n in jobs:
                quantize(x, o, n)

        launches = [each]

    def run() -> None:
        for launch in launches:
            launch()

    return run


def _one_launch(xs: Sequence[torch.Tensor], outs: Sequence[Quantized], one_launch: bool | None) -> bool:
    """Whether ``xs`` go in one launch per dtype: asked (or ``WEIGHTSYNC_FP8_ONE_LAUNCH=1``), one device, the kernel
    :func:`applies` to every one, the outputs contiguous."""
    if one_launch is None:
        one_launch = os.environ.get("WEIGHTSYNC_FP8_ONE_LAUNCH") == "1"
    return bool(one_launch and xs and len({x.device for x in xs}) == 1 and all(applies(x) for x in xs)
                and all(o.weight.is_contiguous() and o.scale_inv.is_contiguous() for o in outs))


def _many_launches(xs: Sequence[torch.Tensor], outs: Sequence[Quantized]) -> list[Callable[[], None]]:
    """One launch of the one-launch kernel per input dtype, each holding its table (checked by the caller)."""
    soft = soft_cast()
    launches = []
    for dtype in INPUT_DTYPES:
        idx = [i for i, x in enumerate(xs) if x.dtype == dtype and x.numel()]
        if not idx:
            continue
        group, group_outs = [xs[i] for i in idx], [outs[i] for i in idx]
        d_tab, d_owner, d_first, nprog = _many_table(group, group_outs, soft)
        aligned = all(_aligned(x, o) for x, o in zip(group, group_outs))

        def launch(d_tab=d_tab, d_owner=d_owner, d_first=d_first, nprog=nprog, dtype=dtype, aligned=aligned) -> None:
            _KERNEL.kernel.block_fp8_many[(nprog,)](d_tab, d_owner, d_first, AMAX_FLOOR, INV_FP8_MAX, BLOCK=BLOCK,
                                                    SOFT_CAST=soft, IN_FP32=dtype == torch.float32, ALIGNED=aligned,
                                                    num_warps=WARPS)

        launches.append(launch)
    return launches


def _aligned(x: torch.Tensor, o: Quantized) -> bool:
    """What the one-launch kernel may promise Triton about ``x`` and its output (see :func:`quantize_many`)."""
    return (x.data_ptr() % 16 == 0 and o.weight.data_ptr() % 16 == 0 and x.shape[-1] % 16 == 0
            and x.stride(-2) % 16 == 0 and (_batch_stride(x) or 0) % 16 == 0)


_TABLES: dict = {}  # launch tables of quantize_many by their tensors, oldest first
_KEEP = 64


def _many_table(xs: Sequence[torch.Tensor], outs: Sequence[Quantized], soft: bool):
    key = (soft, *((x.data_ptr(), *x.shape, *x.stride(), o.weight.data_ptr(), o.scale_inv.data_ptr())
                   for x, o in zip(xs, outs)))
    got = _TABLES.get(key)
    if got is not None:
        return got
    tab, owner, first, nprog = [], [], [], 0
    for m, (x, o) in enumerate(zip(xs, outs)):
        *lead, n, k = x.shape
        batch = 1
        for d in lead:
            batch *= d
        bn, bk = cdiv(n, BLOCK), cdiv(k, BLOCK)
        tab += [x.data_ptr(), o.weight.data_ptr(), o.scale_inv.data_ptr(), n, k, _batch_stride(x), x.stride(-2), bn, bk]
        first.append(nprog)
        count = batch * bn * bk
        owner.append((m, count))
        nprog += count
    flat = tab + first
    host = torch.tensor(flat, dtype=torch.int64)
    own = torch.repeat_interleave(torch.tensor([m for m, _ in owner], dtype=torch.int32),
                                  torch.tensor([c for _, c in owner], dtype=torch.int64))
    device = xs[0].device
    if device.type == "cuda":
        host, own = host.pin_memory(), own.pin_memory()
    dev = host.to(device, non_blocking=True)
    got = (dev[: len(tab)], own.to(device, non_blocking=True), dev[len(tab):], nprog)
    if len(_TABLES) >= _KEEP:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = got
    return got


__all__ = [
    "AMAX_FLOOR", "BLOCK", "FP8_MAX", "INV_FP8_MAX", "Quantized", "applies", "dequantize", "enabled",
    "nonfinite_blocks", "prepare", "quantize", "quantize_many", "quantize_reference", "scale_shape",
]
