"""The checksum of :mod:`weightsync.integrity.digest` as one Triton kernel on CUDA: each word read once.

The torch formulation (row sums and column sums of the int64 word matrix, then two short dot
products) reads every byte twice and runs a dozen small kernels per region: ~210-530 GB/s on an
H200, a tenth to a quarter of a device copy. Here each program of one launch reads a tile of a
region's words once, multiplies each word by its odd weight ``2 * (base + k) + 1`` and sums with
int64 wrap-around; the per-program partial sums are then added per region (one ``index_add_``).
Everything is arithmetic modulo 2**64, so the result is the same bits as the torch path and the CPU.

Many regions (a bucket's parts, a step's copies) go in one launch: a table of one row per region
(address, rows, columns, row stride, start weight and its tiling) and, per program, the region it
works on. A region is any 2-d int64 word view whose rows are contiguous (what
:func:`~weightsync.integrity.digest.words_of` returns); the caller falls back to the torch path for
anything else, for CPU tensors, and where Triton is missing (it is imported lazily, only here).

``WEIGHTSYNC_FAST_CHECKSUM=0`` turns the kernel off (the torch path everywhere: for A/B runs).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.lazy_kernel import LazyKernel, readable

log = logging.getLogger("weightsync.integrity.fastsum")

_MASK = (1 << 64) - 1
BLOCK = 1024  # words one program reads per inner step (8 KiB)
TILE = 1 << 16  # words one program covers at most (512 KiB): a 256 MiB bucket is 512 programs
WARPS = 8
_COLS = 9  # table columns: addr, rows, cols, stride, start, row0, rows_per_prog, cols_per_prog, col_chunks

_EMPTY = (0,) * _COLS


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def _weighted_sums(tab, owner, first, partial, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        reg = tl.load(owner + pid)
        local = pid - tl.load(first + reg)
        row = tab + reg * 9
        ptr = tl.load(row + 0).to(tl.pointer_type(tl.int64))
        rows = tl.load(row + 1)
        cols = tl.load(row + 2)
        stride = tl.load(row + 3)
        start = tl.load(row + 4)
        rpp = tl.load(row + 6)
        cpp = tl.load(row + 7)
        ncc = tl.load(row + 8)
        rg = local // ncc
        cc = local - rg * ncc
        r0 = rg * rpp
        r1 = tl.minimum(rows, r0 + rpp)
        c0 = cc * cpp
        c1 = tl.minimum(cols, c0 + cpp)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for r in range(r0, r1):
            at = ptr + r * stride
            w_row = start + 2 * r * cols
            for c in range(c0, c1, BLOCK):
                offs = c + tl.arange(0, BLOCK).to(tl.int64)
                x = tl.load(at + offs, mask=offs < c1, other=0)
                acc += x * (w_row + 2 * offs)
        tl.store(partial + pid, tl.sum(acc, axis=0))

    @triton.jit
    def _flat(x, n, start, partial, TILE: tl.constexpr, BLOCK: tl.constexpr):
        # one contiguous region: no table, and the pointer's alignment is known (wide loads)
        pid = tl.program_id(0)
        lo = pid.to(tl.int64) * TILE
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for c in range(0, TILE, BLOCK):
            offs = lo + c + tl.arange(0, BLOCK).to(tl.int64)
            v = tl.load(x + offs, mask=offs < n, other=0)
            acc += v * (start + 2 * offs)
        tl.store(partial + pid, tl.sum(acc, axis=0))

    return _weighted_sums, _flat


#: the Triton functions (table, flat), compiled on first use
_KERNEL = LazyKernel(_build, "WEIGHTSYNC_FAST_CHECKSUM", log, "checksum", "the torch reductions")


def enabled() -> bool:
    """Whether the kernel may be used at all (Triton importable, not turned off by the environment)."""
    return _KERNEL.enabled()


def applies(w: torch.Tensor) -> bool:
    """Whether the kernel can read ``w`` (a 2-d int64 word view): rows contiguous, on CUDA (or anywhere
    under Triton's interpreter, for tests)."""
    return (w.dim() == 2 and w.dtype == torch.int64 and readable(w)
            and (w.shape[1] <= 1 or w.stride(1) == 1) and enabled())


@dataclass(frozen=True)
class Region:
    """One region handed to :func:`sums`: its 2-d int64 words and the word position its first word has."""

    words: torch.Tensor
    base: int


def _signed(v: int) -> int:
    v &= _MASK
    return v - (1 << 64) if v >= 1 << 63 else v


def _tiling(rows: int, cols: int) -> tuple[int, int, int, int]:
    """(rows a program, columns a program, column chunks a row group, programs) for a rows x cols region."""
    if cols >= TILE:
        cpp = TILE
        ncc = -(-cols // cpp)
        return 1, cpp, ncc, rows * ncc
    rpp = max(1, TILE // max(cols, 1))
    return rpp, cols, 1, -(-rows // rpp)


def sums(regions: Sequence[Region]) -> torch.Tensor:
    """Each region's checksum (``sum_k word[k] * (2 * (base + k) + 1) mod 2**64``) as an int64 tensor
    of ``len(regions)`` on their device, from one kernel launch; queues the work without synchronising.
    Every region must satisfy :func:`applies` and lie on one device. The launch's table is a function of
    the regions' addresses, shapes, strides and bases only, so it is kept on the device for the next call
    with the same ones (a step's regions, a bucket's parts: the same every step)."""
    if not enabled():
        raise RuntimeError("checksum: the Triton kernel is not available here (see fastsum.enabled)")
    device = regions[0].words.device
    key = (str(device), BLOCK, TILE, *((r.words.data_ptr(), *r.words.shape, *r.words.stride(), r.base) for r in regions))
    got = _TABLES.get(key)
    if got is None:
        got = _table(regions, device)
        if len(_TABLES) >= _KEEP:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = got
    d_tab, d_owner, d_first, nprog = got
    out = torch.zeros(len(regions), dtype=torch.int64, device=device)
    if nprog == 0:
        return out
    partial = torch.empty(nprog, dtype=torch.int64, device=device)
    _KERNEL.kernel[0][(nprog,)](d_tab, d_owner, d_first, partial, BLOCK=BLOCK, num_warps=WARPS)
    return out.index_add_(0, d_owner, partial)


_TABLES: dict = {}  # launch tables by their regions (see sums), oldest first
_KEEP = 256


def _table(regions: Sequence[Region], device: torch.device):
    """One host->device copy of [a row per region, each program's region, each region's first program]."""
    tab, owner, first, nprog = {}, [], [], 0
    for k, r in enumerate(regions):
        w = r.words
        rows, cols = w.shape
        first.append(nprog)
        if rows * cols == 0:
            continue
        if rows > 1 and w.stride(0) == cols:  # contiguous: one long row tiles best
            rows, cols = 1, rows * cols
        rpp, cpp, ncc, n = _tiling(rows, cols)
        stride = w.stride(0) if rows > 1 else cols
        tab[k] = (w.data_ptr(), rows, cols, stride, _signed(2 * r.base + 1), 0, rpp, cpp, ncc)
        owner.append((k, n))
        nprog += n
    if nprog == 0:
        return None, None, None, 0
    flat = [v for k in range(len(regions)) for v in tab.get(k, _EMPTY)]
    for k, n in owner:
        flat += [k] * n
    flat += first
    host = torch.tensor(flat, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()  # a truly asynchronous copy (pageable memory may wait for the stream)
    dev = host.to(device, non_blocking=True)
    ntab = len(regions) * _COLS
    return dev[:ntab], dev[ntab : ntab + nprog], dev[ntab + nprog :], nprog


def checksum(w: torch.Tensor, base: int) -> torch.Tensor:
    """One region's checksum as a 0-d int64 tensor (see :func:`sums`): a contiguous one without a table."""
    rows, cols = w.shape
    if rows * cols and (rows == 1 or w.stride(0) == cols):
        n = rows * cols
        programs = -(-n // TILE)
        partial = torch.empty(programs, dtype=torch.int64, device=w.device)
        _KERNEL.kernel[1][(programs,)](w, n, _signed(2 * base + 1), partial, TILE=TILE, BLOCK=BLOCK, num_warps=WARPS)
        return partial.sum()
    return sums([Region(w, base)])[0]
