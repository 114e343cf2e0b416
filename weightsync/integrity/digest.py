"""The checksum: a position-weighted sum of a tensor region's bytes, as 64-bit words, modulo 2**64.

``checksum(region, base)`` reads the region's bytes in row-major element order (each element's bytes
as they lie in memory) as little 64-bit signed words -- four bf16, two fp32, eight fp8 per word, the
tail padded with zeros -- and sums word ``k`` times the odd weight ``2 * (base + k) + 1``, modulo 2**64:

- a flipped bit changes one word by ``+-2**b`` times an odd weight: never 0 modulo 2**64, always caught;
- two words (or elements in different words) swapped change it by ``2 * (w_i - w_j) * (i - j)``:
  caught unless their bits are equal; a piece missed (stale), shifted or written to the wrong place
  likewise, unless the bits there happen to be the same;
- it depends on the bytes and their row-major order only, not on strides or shape: a trainer's
  strided source box and an engine's contiguous destination box of the same copy give the same
  number; everything is arithmetic modulo 2**64 (two's-complement wrap-around), so any reduction
  order on any device gives the same bits.

It is a few vectorised torch ops where the data is (on the GPU for CUDA tensors): the weights are
linear in the position, so the weighted sum needs only the words' row sums and column sums (two
native int64 reductions over an int64 *view* of the region, no copy) and two dot products of those
short vectors with their weights. A region whose rows are not whole words, or whose memory cannot be
viewed as aligned words, is first copied contiguous (the same bytes, so the same number).

On CUDA, where Triton is installed, the same number comes from one kernel that reads each word once
(:mod:`weightsync.integrity.fastsum`, near memory speed; :func:`checksums` sums many regions in one
launch); CPU tensors, and CUDA without Triton, keep the torch reductions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

WORD = 8  # bytes per word
_MASK = (1 << 64) - 1


def words_of(region: torch.Tensor) -> torch.Tensor:
    """The region's bytes as a 2-d int64 tensor of words in row-major order: a view where the rows are
    whole, aligned words, else a contiguous zero-padded copy."""
    x = region.view(torch.uint8) if region.dtype == torch.bool else region
    if x.dim() == 0:
        x = x.reshape(1)
    if x.dim() >= 2 and x.shape[-1] * x.element_size() % WORD == 0 and x.numel() > 0:
        try:
            return x.reshape(-1, x.shape[-1]).view(torch.int64)
        except RuntimeError:  # not viewable as aligned words (odd offset or strides): copy below
            pass
    flat = x.reshape(-1).view(torch.uint8) if x.is_contiguous() else x.contiguous().reshape(-1).view(torch.uint8)
    pad = (-flat.numel()) % WORD
    if pad or flat.data_ptr() % WORD:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(torch.int64).reshape(1, -1)


def checksum(region: torch.Tensor, base: int = 0) -> torch.Tensor:
    """``sum_k word(region)[k] * (2 * (base + k) + 1) mod 2**64`` as a 0-d int64 tensor on the region's
    device (``k``: the word's row-major position in ``region``; see the module docstring). Queues the
    work without synchronising: read many at once with :func:`to_ints`."""
    w = words_of(region)
    device = w.device
    rows, cols = w.shape
    if rows * cols == 0:
        return torch.zeros((), dtype=torch.int64, device=device)
    if w.is_cuda and fast():
        from weightsync.integrity import fastsum

        if fastsum.applies(w):
            return fastsum.checksum(w, base)
    row_sums = w.sum(1)  # int64, wraps like everything else here
    col_sums = w.sum(0)
    row_w, col_w = weights(rows, cols, base, device)
    return (row_sums * row_w).sum() + (col_sums * col_w).sum()


def fast() -> bool:
    """Whether CUDA regions go through the one-pass Triton kernel (Triton there, not turned off by
    ``WEIGHTSYNC_FAST_CHECKSUM=0``); imports Triton on the first call only."""
    from weightsync.integrity import fastsum

    return fastsum.enabled()


def checksums(regions: Sequence[torch.Tensor], bases: Sequence[int]) -> torch.Tensor:
    """:func:`checksum` of each region at its base, as one int64 tensor on their (one) device: one
    kernel launch for all of them where the Triton kernel applies to every region, else one by one."""
    if not regions:
        return torch.zeros(0, dtype=torch.int64)
    if regions[0].is_cuda and fast():
        from weightsync.integrity import fastsum

        ws = [words_of(r) for r in regions]
        if all(fastsum.applies(w) for w in ws):
            if len(ws) == 1:
                return fastsum.checksum(ws[0], bases[0]).reshape(1)
            return fastsum.sums([fastsum.Region(w, b) for w, b in zip(ws, bases)])
    return torch.stack([checksum(r, b) for r, b in zip(regions, bases)])


def weights(rows: int, cols: int, base: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights of a ``rows x cols`` word matrix's row sums and column sums: word ``(r, c)`` weighs
    ``2 * (base + r * cols + c) + 1 = (2 * cols * r + 2 * base + 1) + 2 * c``."""
    start = (2 * base + 1) & _MASK
    start = start - (1 << 64) if start >= 1 << 63 else start  # as a signed int64
    row_w = torch.arange(rows, dtype=torch.int64, device=device) * (2 * cols) + start
    return row_w, torch.arange(cols, dtype=torch.int64, device=device) * 2


def words(region: torch.Tensor) -> int:
    """How many words :func:`checksum` weights in ``region`` (where the next region's ``base`` starts)."""
    return -(-region.numel() * region.element_size() // WORD)


def to_ints(sums: list[torch.Tensor]) -> list[int]:
    """Many queued checksums as unsigned 64-bit Python ints (one device synchronisation)."""
    if not sums:
        return []
    return [v & _MASK for v in torch.stack([s.reshape(()) for s in sums]).cpu().tolist()]


def reference(region: torch.Tensor, base: int = 0) -> int:
    """The same number computed word by word in Python (for tests: slow, obviously right)."""
    raw = bytes(region.detach().contiguous().reshape(-1).view(torch.uint8).cpu().tolist())
    raw += b"\0" * ((-len(raw)) % WORD)
    total = 0
    for k in range(len(raw) // WORD):
        word = int.from_bytes(raw[k * WORD : (k + 1) * WORD], "little", signed=True)
        total += word * (2 * (base + k) + 1)
    return total & _MASK
