"""Encode one bucket as what changed since a base version of it, decode it onto that base in place.

A bucket's wire bytes (:mod:`weightsync.payload.pack`'s buffer layout) are compared as *words*:
the bucket's element size (2 bytes for bf16, 4 for fp32; the gcd when a bucket mixes dtypes), so a
changed element is one changed word and the comparison is of bits (NaN, -0.0 compare as bits do).
An encoded bucket is a :class:`Encoded` record: its ``kind``, the ``count`` of changed words (or
blocks) and one uint8 ``payload`` whose size both ends compute from ``(kind, count, words)``
(:func:`payload_bytes`), so the receiver learns it from a 3-integer header.

Kinds (chosen per bucket by exact size, :func:`choose`; the numbers in docs/delta.md):

- ``SAME``     nothing changed: no payload.
- ``INDICES``  int32 word indices, then the changed words:        ``count * (4 + w)`` bytes
- ``BITMAP``   one bit per word, then the changed words:           ``ceil(n / 8) + count * w``
- ``BLOCKS``   one bit per block of :data:`BLOCK` words, then each changed block whole:
               ``ceil(nb / 8) + count * BLOCK * w`` (wins only when changes cluster)
- ``FULL``     the bucket's bytes as they are: ``n * w``

(index and bitmap parts are padded to 8 bytes so the words after them are viewed in place.)
Indices win below about 3.1% changed words (one bit per word against 4 bytes per change; bf16 at 1%:
3% of the full bytes), the bitmap above (bf16 at 10%: 33%; at 30%: 73%); full wins only when nearly
every word changed.

Every function is a handful of vectorised torch ops per bucket (compare, count, nonzero or bit
packing, gather), so it runs where the tensors are, GPU included; the one host sync per bucket is
the changed count (which sizes the payload). :func:`encode_to` writes a payload whose changes are
known (or only counted: :func:`count_changed` queues the count, ``torch.nonzero_static`` finds them)
without a further sync, over the packed bucket itself if need be (delta/nixl.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

SAME, INDICES, BITMAP, BLOCKS, FULL = 0, 1, 2, 3, 4
KIND_NAMES = {SAME: "same", INDICES: "indices", BITMAP: "bitmap", BLOCKS: "blocks", FULL: "full"}
BLOCK = 32  # words per block of the BLOCKS encoding

WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SHIFTS: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class Encoded:
    """One bucket encoded against a base: ``payload`` holds ``payload_bytes(kind, count, words, w)`` bytes."""

    kind: int
    count: int
    words: int
    word_bytes: int
    payload: torch.Tensor  # uint8, 1-D

    @property
    def nbytes(self) -> int:
        return self.payload.numel()


def word_bytes(itemsizes: Sequence[int], nbytes: int) -> int:
    """The word size a bucket is compared in: the gcd of its element sizes (and of its length)."""
    g = 0
    for s in itemsizes:
        g = math.gcd(g, s)
    g = math.gcd(g or 1, nbytes) if nbytes else (g or 1)
    while g not in WORD_DTYPES:  # 3, 6, 12: never for torch dtypes, but stay safe
        g //= 2 if g % 2 == 0 else g
    return g


def payload_bytes(kind: int, count: int, words: int, w: int) -> int:
    """The payload size of an encoded bucket of ``words`` words of ``w`` bytes (both ends compute it)."""
    if kind == SAME:
        return 0
    if kind == INDICES:
        return _aligned(4 * count) + count * w
    if kind == BITMAP:
        return _aligned((words + 7) // 8) + count * w
    if kind == BLOCKS:
        blocks = (words + BLOCK - 1) // BLOCK
        return _aligned((blocks + 7) // 8) + count * BLOCK * w
    if kind == FULL:
        return words * w
    raise ValueError(f"unknown delta encoding kind {kind}")


def _aligned(n: int) -> int:
    """A payload's index or bitmap part padded to 8 bytes, so the words after it can be viewed in place."""
    return (n + 7) // 8 * 8


def _pad8(b: torch.Tensor) -> torch.Tensor:
    pad = -b.numel() % 8
    return torch.cat([b, b.new_zeros(pad)]) if pad else b


def choose(changed: int, blocks_changed: int | None, words: int, w: int) -> tuple[int, int]:
    """The smallest encoding for ``changed`` words (``blocks_changed`` blocks, None: not counted)
    of ``words``: ``(kind, count)``."""
    if changed == 0:
        return SAME, 0
    options = [(payload_bytes(FULL, 0, words, w), FULL, 0),
               (payload_bytes(BITMAP, changed, words, w), BITMAP, changed)]
    if words < (1 << 31):  # int32 indices
        options.append((payload_bytes(INDICES, changed, words, w), INDICES, changed))
    if blocks_changed is not None:
        options.append((payload_bytes(BLOCKS, blocks_changed, words, w), BLOCKS, blocks_changed))
    _, kind, count = min(options)
    return kind, count


def as_words(buf: torch.Tensor, w: int) -> torch.Tensor:
    """A uint8 buffer viewed as words of ``w`` bytes (no copy)."""
    return buf.view(WORD_DTYPES[w]) if w > 1 else buf


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return s


_GATHER_BITS = 0x0102040810204080  # times 8 bytes of 0/1: byte i's bit lands at bit 56 + i


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as a little-endian bitmap (uint8, ``ceil(n / 8)`` bytes): 8 bools read as one
    int64 and multiplied into one byte (no carries: every product bit is distinct)."""
    n = mask.numel()
    pad = -n % 8
    m = mask.view(torch.uint8)
    if pad:
        m = torch.cat([m, m.new_zeros(pad)])
    try:
        x = m.view(torch.int64)
    except RuntimeError:  # not 8-byte aligned
        x = m.clone().view(torch.int64)
    return ((x * _GATHER_BITS) >> 56).bitwise_and_(255).to(torch.uint8)


def changed_indices(cur: torch.Tensor, base: torch.Tensor, changed: torch.Tensor) -> torch.Tensor:
    """The ascending indices where ``changed`` (= ``cur != base``) holds, found among the changed
    8-byte words first where the memory allows (``nonzero`` over a quarter of the bf16 words)."""
    r = 8 // cur.element_size()
    if r > 1 and cur.numel() % r == 0:
        try:
            c8, b8 = cur.view(torch.int64), base.view(torch.int64)
        except RuntimeError:
            c8 = None
        if c8 is not None:
            coarse = (c8 != b8).nonzero().view(-1)
            sub = (coarse.unsqueeze(1) * r + torch.arange(r, device=cur.device)).view(-1)
            return sub[changed[sub]]
    return changed.nonzero().view(-1)


def unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """The bool vector of length ``n`` a bitmap packs."""
    return ((bits.unsqueeze(1) >> _shifts(bits.device)) & 1).view(-1)[:n].view(torch.bool)


def encode(cur: torch.Tensor, base: torch.Tensor, *, blocks: bool = True) -> Encoded:
    """``cur`` against ``base``, two word vectors of one length (:func:`as_words`), in the smallest kind."""
    n, w = cur.numel(), cur.element_size()
    if not blocks:
        fine = _changed_fine(cur, base)
        if fine is not None:  # no word-sized mask at all: 8-byte words compared, then the changed ones' words
            kind, count = choose(fine.numel(), None, n, w)
            return _encode_indexed(kind, cur, fine, count)
    changed = cur != base
    k = int(torch.count_nonzero(changed))
    kb = None
    if blocks and 0 < k and n >= BLOCK:
        kb = int(torch.count_nonzero(_block_mask(changed)))
    kind, count = choose(k, kb, n, w)
    return encode_as(kind, cur, changed, count, base)


def changed_words(cur: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The changed word indices of ``cur`` against ``base``, ascending (int64), through the changed
    8-byte words where the memory allows (two host syncs: the sizes), else one ``nonzero``."""
    fine = _changed_fine(cur, base)
    return (cur != base).nonzero().view(-1) if fine is None else fine


def _changed_fine(cur: torch.Tensor, base: torch.Tensor) -> torch.Tensor | None:
    """The changed word indices, ascending, found through the changed 8-byte words (a quarter of the
    bf16 words compared as a mask, then only the changed ones' words); None when the memory is not
    8-byte words."""
    r = 8 // cur.element_size()
    if r < 1 or cur.numel() % max(r, 1):
        return None
    try:
        c8, b8 = cur.view(torch.int64), base.view(torch.int64)
    except RuntimeError:
        return None
    coarse = (c8 != b8).nonzero().view(-1)
    if r == 1:
        return coarse
    sub = (coarse.unsqueeze(1) * r + torch.arange(r, device=cur.device)).view(-1)
    return sub[cur[sub] != base[sub]]


def _encode_indexed(kind: int, cur: torch.Tensor, idx: torch.Tensor, count: int) -> Encoded:
    n, w = cur.numel(), cur.element_size()
    if kind == INDICES:
        payload = torch.cat([_pad8(idx.to(torch.int32).view(torch.uint8)), cur[idx].view(torch.uint8)])
        return Encoded(kind, count, n, w, payload)
    if kind == BITMAP:
        mask = torch.zeros(n, dtype=torch.bool, device=cur.device)
        mask[idx] = True
        return Encoded(kind, count, n, w, torch.cat([_pad8(pack_bits(mask)), cur[idx].view(torch.uint8)]))
    return encode_as(kind, cur, None, count)  # SAME or FULL: no mask needed


def encode_as(kind: int, cur: torch.Tensor, changed: torch.Tensor, count: int,
              base: torch.Tensor | None = None) -> Encoded:
    """``cur`` encoded in ``kind`` given its ``changed`` mask (the measurement forces each kind)."""
    n, w = cur.numel(), cur.element_size()
    if kind == SAME:
        payload = cur.new_empty(0, dtype=torch.uint8)
    elif kind == FULL:
        payload = cur.contiguous().view(torch.uint8)
    elif kind == INDICES:
        idx = changed.nonzero().view(-1) if base is None else changed_indices(cur, base, changed)
        payload = torch.cat([_pad8(idx.to(torch.int32).view(torch.uint8)), cur[idx].view(torch.uint8)])
    elif kind == BITMAP:
        payload = torch.cat([_pad8(pack_bits(changed)), cur[changed].view(torch.uint8)])
    elif kind == BLOCKS:
        bmask = _block_mask(changed)
        padded = _padded(cur, BLOCK)
        payload = torch.cat([_pad8(pack_bits(bmask)), padded.view(-1, BLOCK)[bmask].reshape(-1).view(torch.uint8)])
    else:
        raise ValueError(f"unknown delta encoding kind {kind}")
    return Encoded(kind, count, n, w, payload)


def _padded(words: torch.Tensor, block: int) -> torch.Tensor:
    pad = -words.numel() % block
    return torch.cat([words, words.new_zeros(pad)]) if pad else words


def _block_mask(changed: torch.Tensor) -> torch.Tensor:
    return _padded(changed, BLOCK).view(-1, BLOCK).any(1)


# -- encoding without host synchronisation (the count is known) -----------------------------------

def count_changed(cur: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """How many words of ``cur`` differ from ``base``, as a 0-d int64 tensor where they are: queued,
    not read, so a sender counts every bucket of a step before its one host sync."""
    return torch.count_nonzero(cur != base)


def _nonzero(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The ascending indices of ``mask``'s ``count`` set elements, without a host sync where torch has
    ``nonzero_static`` (CUDA from torch 2.6); ``nonzero`` (which syncs for its size) otherwise."""
    fn = getattr(torch, "nonzero_static", None)
    if fn is not None:
        try:
            return fn(mask, size=count).view(-1)
        except (NotImplementedError, RuntimeError):  # a device without it
            pass
    return mask.nonzero().view(-1)


def encode_to(kind: int, count: int, cur: torch.Tensor, base: torch.Tensor, out: torch.Tensor,
              idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Write ``cur``'s payload against ``base`` in ``kind`` (``count`` changed words, counted before:
    :func:`count_changed` or :func:`changed_words`, then :func:`choose`) into ``out`` (uint8, at least
    :func:`payload_bytes`), queuing no host sync. ``idx``: the changed word indices where the caller
    has them (no word-sized compare then), else found with ``nonzero_static``. The same bytes as
    :func:`encode_as`, padding zeroed. ``out`` may be ``cur``'s own memory: everything read from
    ``cur`` is read before ``out`` is written (stream order). Returns the changed word indices and
    their new words (so the caller can patch ``base`` into ``cur``), None for SAME and FULL (FULL
    leaves ``cur``'s bytes in ``out``)."""
    n, w = cur.numel(), cur.element_size()
    if kind == SAME:
        return None
    if kind == FULL:
        dst = as_words(out[: n * w], w)
        if dst.data_ptr() != cur.data_ptr():
            dst.copy_(cur)
        return None
    if kind not in (INDICES, BITMAP):
        raise ValueError(f"encode_to writes indices, bitmap, full or same, not {KIND_NAMES.get(kind, kind)}")
    mask = None
    if idx is None:
        mask = cur != base
        idx = _nonzero(mask, count)
    vals = cur.index_select(0, idx)
    if kind == INDICES:
        head = _aligned(4 * count)
        bits = None
    else:
        if mask is None:
            mask = torch.zeros(n, dtype=torch.bool, device=cur.device)
            mask[idx] = True
        bits = pack_bits(mask)
        head = _aligned(bits.numel())
    del mask
    if kind == INDICES:
        out[: 4 * count].view(torch.int32).copy_(idx)
        out[4 * count : head].zero_()
    else:
        out[: bits.numel()].copy_(bits)
        out[bits.numel() : head].zero_()
    if count:
        out[head : head + count * w].view(WORD_DTYPES[w]).copy_(vals)
    return idx, vals


def changes(kind: int, count: int, words: int, w: int,
            payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The changed word indices (int64, ascending) and their new words a payload holds; None for SAME.
    FULL gives every index."""
    if payload.numel() != payload_bytes(kind, count, words, w):
        raise ValueError(f"a {KIND_NAMES.get(kind, kind)} payload of {count} over {words} words of {w} bytes "
                         f"has {payload_bytes(kind, count, words, w)} bytes, got {payload.numel()}")
    wd = WORD_DTYPES[w]
    if kind == SAME:
        return None
    if kind == FULL:
        return torch.arange(words, device=payload.device), payload.view(wd)
    if kind == INDICES:
        idx = payload[: 4 * count].view(torch.int32).to(torch.int64)
        return idx, payload[_aligned(4 * count) :].view(wd)
    if kind == BITMAP:
        nbits = (words + 7) // 8
        return unpack_bits(payload[:nbits], words).nonzero().view(-1), payload[_aligned(nbits) :].view(wd)
    if kind == BLOCKS:
        blocks = (words + BLOCK - 1) // BLOCK
        nbits = (blocks + 7) // 8
        ids = unpack_bits(payload[:nbits], blocks).nonzero().view(-1)
        idx = (ids.unsqueeze(1) * BLOCK + torch.arange(BLOCK, device=payload.device)).view(-1)
        vals = payload[_aligned(nbits) :].view(wd)
        keep = idx < words  # the last block's padding
        return (idx, vals) if bool(keep.all()) else (idx[keep], vals[keep])
    raise ValueError(f"unknown delta encoding kind {kind}")


def apply(parts: Sequence[torch.Tensor], kind: int, count: int, w: int, payload: torch.Tensor) -> None:
    """Write a payload's changes in place into the base it was encoded against, held as ``parts``:
    word vectors that, back to back, are the bucket (one part when it lies in one stretch)."""
    words = sum(p.numel() for p in parts)
    if kind == BITMAP and len(parts) == 1:  # the common case: no index vector at all
        nbits = (words + 7) // 8
        if payload.numel() != payload_bytes(kind, count, words, w):
            changes(kind, count, words, w, payload)  # raises, naming the sizes
        parts[0].masked_scatter_(unpack_bits(payload[:nbits], words), payload[_aligned(nbits) :].view(WORD_DTYPES[w]))
        return
    got = changes(kind, count, words, w, payload)
    if got is None:
        return
    idx, vals = got
    if len(parts) == 1:
        parts[0].index_copy_(0, idx, vals)
        return
    bounds, at = [], 0
    for p in parts[:-1]:
        at += p.numel()
        bounds.append(at)
    cuts = torch.searchsorted(idx, torch.tensor(bounds, device=idx.device)).tolist()
    lo, start = 0, 0
    for p, hi in zip(parts, cuts + [idx.numel()]):
        if hi > lo:
            p.index_copy_(0, idx[lo:hi] - start, vals[lo:hi])
        lo, start = hi, start + p.numel()


# -- checksums ------------------------------------------------------------------------------------

_MASK = (1 << 64) - 1
_ROW = 1 << 20  # bytes a row when a part is hashed as a matrix (wide rows: fast column sums on CPU)


def checksum(parts: Sequence[torch.Tensor], w: int = 1) -> int:
    """The checksum of the uint8 buffers ``parts`` read back to back as one stretch of bytes:
    :func:`weightsync.integrity.digest.checksum` (a position-weighted sum of 64-bit words, the one
    the per-step integrity checks use), chained over the parts with each part's word offset, so a
    sender's one buffer and a receiver's in-place views agree. Parts that do not end on a word
    boundary are joined into one copy first. (``w``, the bucket's word size, is not needed.)"""
    from weightsync.integrity.digest import to_ints

    return to_ints([checksum_queued(parts)])[0]


def checksum_queued(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`checksum` as a 0-d int64 tensor on the parts' device, queued and not read (no host sync:
    a sender reads a whole step's sums at once); two's complement of the unsigned sum."""
    from weightsync.integrity.digest import checksum as digest, checksums, fast, words

    parts = [p.reshape(-1) for p in parts if p.numel()]
    if not parts:
        return torch.zeros((), dtype=torch.int64)
    if any(p.numel() % 8 for p in parts[:-1]):
        parts = [torch.cat(parts)]
    if parts[0].is_cuda and fast():  # one Triton launch over all parts, each word read once
        bases = [0]
        for p in parts[:-1]:
            bases.append(bases[-1] + words(p))
        return checksums(parts, bases).sum()
    sums, base = [], 0
    for p in parts:
        for x in _rows(p):  # wide rows: the digest's two reductions run at memory speed on CPU
            sums.append(digest(x, base))
            base += words(x)
    return torch.stack(sums).sum()


def _rows(p: torch.Tensor) -> list[torch.Tensor]:
    """``p`` (1-D uint8) as matrices of whole 8-byte words: a prefix of 1 MiB rows, then the rest in
    the widest rows that divide it (a last part may end mid-word: its last piece stays 1-D)."""
    out, at, n = [], 0, p.numel()
    row = _ROW
    while at < n:
        while row > 8 and (n - at) < row:
            row //= 2
        take = (n - at) // row * row if row >= 8 and (n - at) >= row else n - at
        piece = p[at : at + take]
        out.append(piece.view(-1, row) if take >= row >= 8 and take % row == 0 else piece)
        at += take
    return out
