"""Many fixed device-to-device copies as one kernel launch per alignment class.

A sync step does thousands of small copies (18,000 of ~1.5 MB, a third of them the strided column
half of a matrix). Even replayed from a CUDA graph each ``copy_`` is its own kernel at ~3 us, so the
step is bound by launches, not bytes. :class:`BatchedCopy` turns a fixed list of (dst, src) views,
once, into a table of byte tiles on the device and copies them all with one Triton launch.

The table. A pair of equal dtypes is collapsed: size-1 dims dropped, neighbouring dims merged where
both tensors allow it (``stride[d] == stride[d+1] * size[d+1]`` in dst and in src). When the
innermost dim is element-contiguous on both sides, the pair is 2-D byte runs (rows, row bytes and
each side's row stride), one run per index of any further outer dims. Runs are cut into tiles of
about ``tile_bytes``: long rows into column chunks, short rows grouped several per tile, so a big
copy spreads over every SM and a small one is one tile. A tile is six int64, all in bytes:
``(src_addr, dst_addr, nrows, row_bytes, src_stride, dst_stride)``; a one-row tile has strides 0.

The width rule. A tile's alignment is the largest of 16, 8, 4, 2, 1 dividing its addresses, row
bytes and strides; tiles are grouped by alignment, one table (and one launch) per group. The kernel
moves integers of ``min(alignment, 8)`` bytes (Triton has no 128-bit integer); the 16 group uses
int64 with 16-byte alignment hints, so the compiler may emit 128-bit accesses. Typical bf16/fp32
weights are all in the 16 group: one launch.

No casts. Every pair is of one dtype: a pair whose dtypes differ is refused at construction. Converting
to the receiver's dtype is a codec's work (:meth:`weightsync.payload.codec.Codec.unpacked`, the full
codec's ``landing``), which hands its casts to the transport as ``Landing.work``, run after the copies
(:mod:`weightsync.payload.pack`).

The fallback. Pairs of one dtype that are not plain byte runs -- an innermost stride other than 1 on
either side, a conjugate or negative view, a destination with a repeated (stride-0) dim, views of
different shapes (same elements in the same row-major order) that neither reshapes as a view of -- are
done with ``copy_`` after the kernels. Zero-element pairs are skipped.

Graph capture. :meth:`BatchedCopy.run` allocates nothing, never synchronizes and copies nothing
from the host: it can be captured in a CUDA graph and replayed. Construction does the one H2D copy
of the tables, compiles the kernels with a no-op launch (so no compilation happens mid-capture)
and synchronizes; build it outside any capture.

Addresses are baked in. The tables (and a graph that replays them) hold raw addresses: rebuild when
any tensor moves (reallocation, ``resize_``, a new engine). The instance keeps every pair alive so
the addresses stay valid while it exists. Destinations must not overlap each other or any source;
tiles run in no particular order.

On CPU tensors :meth:`BatchedCopy.run` executes the same tables with ``ctypes.memmove`` per row, a
reference executor, so CPU tests exercise the table building for real.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence

import torch

TILE_BYTES = 256 << 10  # a 1.5 MB copy is 6 tiles, 40 MB 153, 4 GiB 16k: enough to fill 132 SMs
ALIGNS = (16, 8, 4, 2, 1)  # alignment classes, widest first; the kernel's element is min(a, 8) bytes
# measured on H200 (benchmarks/batch_copy_bench.py): 4096 x 16 warps copies 400 x 40 MB at 0.93 of the
# device copy ceiling and 9,000 x 1.5 MiB at 0.96; 2048 x 8 at 0.89 / 0.93; 1024 x 4 at 0.87 / 0.94
BLOCK = 4096  # elements per program per loop step (32 KiB at 8 bytes)
NUM_WARPS = 16
#: long rows: row starts hinted ALIGN-aligned and whole BLOCKs copied unmasked, so 16-aligned tiles move 16 bytes an
#: access (False: the masked loop from 928fb43 until 6d7bc4a, kept for the A/B in
#: benchmarks/batch_copy_bench.py --variants)
WIDE = True
#: streaming cache hints on the long rows' loads and stores (evict-first, .cs): a copy reads and writes each byte once
STREAM = False
_CHUNK_ALIGN = 16  # column chunks of a long row start at multiples of this (keeps the row's alignment)
_FIELDS = 6

Tile = tuple[int, int, int, int, int, int]  # src_addr, dst_addr, nrows, row_bytes, src_stride, dst_stride
Run = tuple[int, int, int, int, int, int]  # the same fields, before cutting into tiles


def _runs(dst: torch.Tensor, src: torch.Tensor) -> list[Run] | None:
    """The pair as 2-D byte runs, or None when it is not a plain byte copy."""
    if (dst.dtype != src.dtype or dst.layout != torch.strided or src.layout != torch.strided
            or dst.is_conj() or src.is_conj() or dst.is_neg() or src.is_neg()):
        return None
    es = dst.element_size()
    dims = [(n, ds, ss) for n, ds, ss in zip(dst.shape, dst.stride(), src.stride()) if n != 1]
    if any(ds == 0 for _, ds, _ in dims):
        return None  # a destination writing one address twice: let copy_ refuse it
    merged: list[tuple[int, int, int]] = []  # innermost first
    for n, ds, ss in reversed(dims):
        if merged:
            m, mds, mss = merged[-1]
            if ds == mds * m and ss == mss * m:
                merged[-1] = (m * n, mds, mss)
                continue
        merged.append((n, ds, ss))
    if not merged:
        merged = [(1, 1, 1)]  # one element
    (n_in, ds_in, ss_in), outer = merged[0], merged[1:][::-1]  # outer: outermost first
    if ds_in != 1 or ss_in != 1:
        return None
    row_bytes = n_in * es
    rows, dst_rs, src_rs = (outer[-1][0], outer[-1][1] * es, outer[-1][2] * es) if outer else (1, 0, 0)
    if rows == 1:
        dst_rs = src_rs = 0
    src0, dst0 = src.data_ptr(), dst.data_ptr()
    out: list[Run] = []
    for index in itertools.product(*(range(n) for n, _, _ in outer[:-1])):
        d_off = sum(i * ds for i, (_, ds, _) in zip(index, outer)) * es
        s_off = sum(i * ss for i, (_, _, ss) in zip(index, outer)) * es
        out.append((src0 + s_off, dst0 + d_off, rows, row_bytes, src_rs, dst_rs))
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tiles(run: Run, tile_bytes: int) -> list[Tile]:
    """Cut a run into tiles of about ``tile_bytes``, as even as the rows allow."""
    src, dst, rows, rb, ss, ds = run
    out: list[Tile] = []
    if rb > tile_bytes:  # long rows: one-row column chunks, evenly sized, starting at multiples of 16
        piece = _cdiv(_cdiv(rb, _cdiv(rb, tile_bytes)), _CHUNK_ALIGN) * _CHUNK_ALIGN
        for r in range(rows):
            for c in range(0, rb, piece):
                out.append((src + r * ss + c, dst + r * ds + c, 1, min(piece, rb - c), 0, 0))
        return out
    per = _cdiv(rows, _cdiv(rows, tile_bytes // rb))
    for r in range(0, rows, per):
        n = min(per, rows - r)
        out.append((src + r * ss, dst + r * ds, n, rb, ss if n > 1 else 0, ds if n > 1 else 0))
    return out


def _alignment(tile: Tile) -> int:
    """The widest of ALIGNS dividing every address, the row bytes and the strides of ``tile``."""
    src, dst, _, rb, ss, ds = tile
    bits = src | dst | rb | ss | ds
    low = bits & -bits
    return next(a for a in ALIGNS if low % a == 0)


class BatchedCopy:
    """A fixed list of (dst, src) copies, executed by one kernel launch per alignment group.

    Build once (outside any CUDA graph capture), call :meth:`run` every step; rebuild when any of
    the tensors moves. ``pairs`` are views of one dtype and as many elements on one device, possibly
    non-contiguous; a pair of two dtypes is refused (a cast is a codec's work: ``Landing.work``).
    """

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], tile_bytes: int = TILE_BYTES,
                 programs: int | None = None) -> None:
        if not 1 <= tile_bytes <= 1 << 30:
            raise ValueError(f"tile_bytes must be in [1, 2**30], got {tile_bytes}")
        self._pairs = [(d, s) for d, s in pairs]  # keeps every address valid while we exist
        devices = {t.device for p in self._pairs for t in p}
        if len(devices) > 1:
            raise ValueError(f"all pairs must be on one device, got {sorted(map(str, devices))}")
        self.device: torch.device | None = devices.pop() if devices else None
        if self.device is not None and self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"BatchedCopy runs on cpu or cuda tensors, not {self.device}")
        self.tile_bytes = tile_bytes
        self.programs = programs  # None: one program per tile; else at most this many, each looping
        self._fallback: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.skipped = 0
        groups: dict[int, list[Tile]] = {a: [] for a in ALIGNS}
        for dst, src in self._pairs:
            if dst.dtype != src.dtype:
                raise ValueError(f"a {src.dtype} {tuple(src.shape)} -> {dst.dtype} {tuple(dst.shape)} pair is a cast, "
                                 "not a byte copy: a cast is a codec's work: pass it as Landing.work (the full "
                                 "codec's landing, weightsync.codec.full.landing, splits such pairs off)")
            if dst.shape != src.shape:  # the same elements in the same row-major order, shaped apart
                if dst.numel() != src.numel():
                    raise ValueError(f"size mismatch: dst {tuple(dst.shape)} vs src {tuple(src.shape)}")
                try:
                    src = src.view(dst.shape)
                except RuntimeError:
                    try:
                        dst = dst.view(src.shape)
                    except RuntimeError:  # neither reshapes as a view: copy_ through a reshape
                        self._fallback.append((dst, src))
                        continue
            if dst.numel() == 0:
                self.skipped += 1
                continue
            runs = _runs(dst, src)
            if runs is None:
                self._fallback.append((dst, src))
                continue
            for run in runs:
                for tile in _tiles(run, tile_bytes):
                    groups[_alignment(tile)].append(tile)
        self._host: dict[int, torch.Tensor] = {
            a: torch.tensor(ts, dtype=torch.int64).reshape(-1, _FIELDS) for a, ts in groups.items() if ts}
        self.nbytes = sum(int((t[:, 2] * t[:, 3]).sum()) for t in self._host.values())
        self._launches: list[tuple[torch.Tensor, int, int, int]] = []  # (table, width, alignment, tiles)
        if self.device is not None and self.device.type == "cuda" and self._host:
            self._upload()

    def _upload(self) -> None:
        """One H2D copy of every table, a no-op launch per group (compiles now, not mid-capture)."""
        kernel = _kernel()
        with torch.cuda.device(self.device):
            table = torch.cat(list(self._host.values())).to(self.device)
            noop = torch.zeros(_FIELDS, dtype=torch.int64, device=self.device)
            start = 0
            for a, host in self._host.items():
                n = host.shape[0]
                self._launches.append((table[start : start + n], min(a, 8), a, n))  # 48-byte rows: 16-aligned
                start += n
                kernel[(1,)](noop, 1, W=min(a, 8), ALIGN=a, BLOCK=BLOCK, WIDE=WIDE, STREAM=STREAM, num_warps=NUM_WARPS)
            torch.cuda.current_stream().synchronize()  # the pageable H2D copy is done before any run
            self._table = table

    def run(self) -> None:
        """Do every copy, on the current stream (CUDA) or right now (CPU). Capturable in a graph."""
        if self.device is None:
            return
        if self.device.type == "cuda":
            if self._launches:
                kernel = _kernel()
                with torch.cuda.device(self.device):
                    for table, w, a, n in self._launches:
                        grid = n if self.programs is None else min(n, self.programs)
                        kernel[(grid,)](table, n, W=w, ALIGN=a, BLOCK=BLOCK, WIDE=WIDE, STREAM=STREAM,
                                        num_warps=NUM_WARPS)
        else:
            for table in self._host.values():
                _memmove_tiles(table)
        for dst, src in self._fallback:
            dst.copy_(src if src.shape == dst.shape else src.reshape(dst.shape))

    @property
    def tiles(self) -> int:
        """Tiles in all tables."""
        return sum(t.shape[0] for t in self._host.values())

    @property
    def fallback(self) -> int:
        """Pairs copied with ``copy_`` (of one dtype: non-unit innermost strides, conjugate views...)."""
        return len(self._fallback)

    @property
    def groups(self) -> dict[int, int]:
        """Tiles per alignment (16, 8, 4, 2, 1) that has any; each is one kernel launch on CUDA."""
        return {a: t.shape[0] for a, t in self._host.items()}

    @property
    def tables(self) -> dict[int, torch.Tensor]:
        """Copies of the host tile tables, [tiles, 6] int64 per alignment (for tests and tools)."""
        return {a: t.clone() for a, t in self._host.items()}

    def __len__(self) -> int:
        return len(self._pairs)


def _memmove_tiles(table: torch.Tensor) -> None:
    """The reference executor: the kernel's work, row by row, with ``memmove``."""
    for src, dst, nrows, rb, ss, ds in table.tolist():
        for r in range(nrows):
            ctypes.memmove(dst + r * ds, src + r * ss, rb)


_KERNEL = None


def _kernel():
    """The Triton kernel, compiled on first use (Triton is imported only here, only for CUDA)."""
    global _KERNEL, tl
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl  # a module global: the jitted body resolves ``tl`` there

    @triton.jit
    def copy_tiles(table, n_tiles, W: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr,
                   WIDE: tl.constexpr, STREAM: tl.constexpr):
        # program p copies tiles p, p + P, p + 2P, ... (P programs: one per tile unless capped); every
        # field is in bytes and a multiple of ALIGN (the table's group)
        for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
            row = table + t * 6  # t < 2**31 / 6: tables are far smaller
            src = tl.multiple_of(tl.load(row), ALIGN)
            dst = tl.multiple_of(tl.load(row + 1), ALIGN)
            nrows = tl.load(row + 2)
            row_bytes = tl.multiple_of(tl.load(row + 3), ALIGN)
            src_stride = tl.multiple_of(tl.load(row + 4), ALIGN)
            dst_stride = tl.multiple_of(tl.load(row + 5), ALIGN)
            if W == 8:
                sp = src.to(tl.pointer_type(tl.int64))
                dp = dst.to(tl.pointer_type(tl.int64))
            elif W == 4:
                sp = src.to(tl.pointer_type(tl.int32))
                dp = dst.to(tl.pointer_type(tl.int32))
            elif W == 2:
                sp = src.to(tl.pointer_type(tl.int16))
                dp = dst.to(tl.pointer_type(tl.int16))
            else:
                sp = src.to(tl.pointer_type(tl.int8))
                dp = dst.to(tl.pointer_type(tl.int8))
            # the hint must sit on the pointers too: axis analysis may not see through int_to_ptr
            sp = tl.multiple_of(sp, ALIGN)
            dp = tl.multiple_of(dp, ALIGN)
            ncols = row_bytes // W  # elements per row; strides in elements
            s_step = src_stride // W
            d_step = dst_stride // W
            cols = tl.arange(0, BLOCK)
            if ncols >= BLOCK:
                # long rows (one-row chunks, wide rows): contiguous BLOCKs along each row, vectorizable
                for r in range(nrows):
                    s_row = sp + r * s_step
                    d_row = dp + r * d_step
                    if WIDE:
                        # every row starts ALIGN-aligned (strides are multiples of ALIGN): say so, or the axis
                        # analysis sees r * stride of unknown divisibility and moves W bytes an access; whole
                        # BLOCKs unmasked (a mask of unknown constancy also narrows the accesses), the rest masked
                        s_row = tl.multiple_of(s_row, ALIGN)
                        d_row = tl.multiple_of(d_row, ALIGN)
                        whole = ncols - ncols % BLOCK
                        for c in range(0, whole, BLOCK):
                            o = c + cols
                            if STREAM:
                                v = tl.load(s_row + o, eviction_policy="evict_first")
                                tl.store(d_row + o, v, cache_modifier=".cs")
                            else:
                                tl.store(d_row + o, tl.load(s_row + o))
                        if whole < ncols:
                            o = whole + cols
                            m = o < ncols
                            tl.store(d_row + o, tl.load(s_row + o, mask=m), mask=m)
                    else:
                        for c in range(0, ncols, BLOCK):
                            o = c + cols
                            m = o < ncols
                            tl.store(d_row + o, tl.load(s_row + o, mask=m), mask=m)
            else:
                # short rows: BLOCK elements of the tile at a time, spanning rows (a tile is < 2**31 bytes)
                n = (nrows * ncols).to(tl.int32)
                nc = ncols.to(tl.int32)
                for i in range(0, n, BLOCK):
                    idx = i + cols
                    r = idx // nc
                    c = (idx - r * nc).to(tl.int64)
                    r = r.to(tl.int64)
                    m = idx < n
                    tl.store(dp + (r * d_step + c), tl.load(sp + (r * s_step + c), mask=m), mask=m)

    _KERNEL = copy_tiles
    return _KERNEL
