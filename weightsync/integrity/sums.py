"""Per-bucket checksums of a plan: what a training rank sent, what an inference worker holds after a step.

Both ends walk the same proven plan (pair hashes agree), so each computes, for every pair and every
bucket of it, the sum of :func:`~weightsync.integrity.digest.checksum` over the bucket's copies --
the sender over each copy's source box, the receiver over its destination box -- with word positions
counted along the pair's copies in plan order (so a piece landing in another copy's place changes the
sum). Both read each region in the *destination's* dtype: where the engine keeps a tensor in another
dtype than the trainer (the receiver converts, as a checkpoint load would), the sender converts its
region the same way first (``Tensor.to`` rounds identically on every device).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from weightsync.integrity.digest import WORD, checksum, checksums, fast, weights, words_of
from weightsync.layout.box import box_numel, slices
from weightsync.plan.planner import Bucket, Pair

#: bucket sums of every pair one side holds: ``{pair: (sum of bucket 0, sum of bucket 1, ...)}``
PairSums = dict[Pair, tuple[int, ...]]


@dataclass(frozen=True)
class Region:
    """One copy's region on one side: which tensor and box, read in which dtype, at which word base."""

    tensor: str
    box: tuple[tuple[int, int], ...]
    dtype: torch.dtype | None  # convert to this first (the destination's), None: as held
    base: int


@dataclass(frozen=True)
class SumPlan:
    """The regions each bucket's checksum covers on one side, derived once from the plan."""

    buckets: dict[Pair, tuple[tuple[Bucket, tuple[Region, ...]], ...]]
    #: per device: the weights of every region's row and column sums, laid out once (see bucket_sums)
    prepared: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def pairs(self) -> list[Pair]:
        return sorted(self.buckets)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def sum_plan(plans: Mapping[Pair, list[Bucket]], tensors: Mapping[str, torch.Tensor], sending: bool,
             dst_dtypes: Mapping[tuple[Pair, str], torch.dtype] | None = None) -> SumPlan:
    """Which region of ``tensors`` each copy's checksum reads. ``sending``: source boxes, each read in
    the destination tensor's dtype (``dst_dtypes[(pair, dst_tensor)]``, where it differs); receiving:
    destination boxes as held."""
    out = {}
    for pair in sorted(plans):
        base, per_bucket = 0, []
        for b in sorted(plans[pair], key=lambda b: b.index):
            regions = []
            for c in b.copies:
                if sending:
                    held = tensors[c.src_tensor].dtype
                    want = (dst_dtypes or {}).get((pair, c.dst_tensor), held)
                    regions.append(Region(c.src_tensor, c.src_box, None if want == held else want, base))
                    size = _itemsize(want)
                else:
                    regions.append(Region(c.dst_tensor, c.dst_box, None, base))
                    size = tensors[c.dst_tensor].element_size()
                base += -(-box_numel(c.canon_box) * size // WORD)
            per_bucket.append((b, tuple(regions)))
        out[pair] = tuple(per_bucket)
    return SumPlan(out)


def region_sum(r: Region, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    view = tensors[r.tensor][slices(r.box)]
    return checksum(view if r.dtype is None else view.to(r.dtype), r.base)


def _read(r: Region, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    view = tensors[r.tensor][slices(r.box)]
    return words_of(view if r.dtype is None else view.to(r.dtype))


@dataclass(frozen=True)
class _Layout:
    """Where each region's row sums and column sums go in one step's buffer, their weights, which region
    each entry of the buffer adds to, and which bucket each region adds to."""

    entries: tuple[tuple[Region, int, int, int, int], ...]  # region, region number, offset, rows, cols
    weights: torch.Tensor
    region_of: torch.Tensor
    bucket_of: torch.Tensor  # per region
    buckets: int


def _layout(plan: SumPlan, tensors: Mapping[str, torch.Tensor], device: torch.device) -> _Layout:
    entries, ws, ids, owners, at, k = [], [], [], [], 0, 0
    for pair in plan.pairs:
        for _, regions in plan.buckets[pair]:
            for r in regions:
                rows, cols = _read(r, tensors).shape
                row_w, col_w = weights(rows, cols, r.base, device)
                entries.append((r, len(entries), at, rows, cols))
                ws += [row_w, col_w]
                ids.append(torch.full((rows + cols,), len(entries) - 1, dtype=torch.int64, device=device))
                owners.append(k)
                at += rows + cols
            k += 1
    cat = (lambda xs: torch.cat(xs)) if ws else (lambda xs: torch.zeros(0, dtype=torch.int64, device=device))
    return _Layout(tuple(entries), cat(ws), cat(ids), torch.tensor(owners, dtype=torch.int64, device=device), k)


@dataclass(frozen=True)
class StepSums:
    """One side's sums of one step: every bucket's, and every copy's (a bucket's sum is the sum of its
    copies' sums modulo 2**64, so both come from the same reductions)."""

    buckets: PairSums
    #: ``{pair: ((copy sums of bucket 0, in plan order), (... of bucket 1), ...)}``
    copies: dict[Pair, tuple[tuple[int, ...], ...]]


def step_sums(plan: SumPlan, tensors: Mapping[str, torch.Tensor]) -> StepSums:
    """Every copy's and every bucket's checksum: per region two reductions into one buffer, one weighted
    sum per region (``index_add``), those summed per bucket, and one device synchronisation for the
    whole step. The weights are laid out once per device; the regions are read from ``tensors`` afresh
    every step (a tensor may have moved)."""
    if not plan.buckets:
        return StepSums({}, {})
    device = next(iter(tensors.values())).device
    with torch.no_grad():
        lay = plan.prepared.get(device)
        if lay is None:
            lay = plan.prepared[device] = _layout(plan, tensors, device)
        if lay.entries and device.type == "cuda" and fast():  # every region in one Triton launch, each word read once
            per = checksums([_read(r, tensors) for r, *_ in lay.entries], [r.base for r, *_ in lay.entries])
        else:
            per = _torch_sums(lay, tensors, device)
        buckets = torch.zeros(lay.buckets, dtype=torch.int64, device=device).index_add_(0, lay.bucket_of, per)
        ints = [v & ((1 << 64) - 1) for v in torch.cat([buckets, per]).cpu().tolist()]
    out, copies, at, rat = {}, {}, 0, lay.buckets
    for pair in plan.pairs:
        n = len(plan.buckets[pair])
        out[pair] = tuple(ints[at : at + n])
        at += n
        per_bucket = []
        for _, rs in plan.buckets[pair]:
            per_bucket.append(tuple(ints[rat : rat + len(rs)]))
            rat += len(rs)
        copies[pair] = tuple(per_bucket)
    return StepSums(out, copies)


def _torch_sums(lay: _Layout, tensors: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """Every region's checksum from two reductions a region into one buffer and one weighted sum."""
    buf = torch.empty(lay.weights.numel(), dtype=torch.int64, device=device)
    odd = []  # regions whose words came out in another shape than planned (restrided): summed alone
    for r, k, at, rows, cols in lay.entries:
        w = _read(r, tensors)
        if tuple(w.shape) == (rows, cols):
            torch.sum(w, 1, out=buf[at : at + rows])
            torch.sum(w, 0, out=buf[at + rows : at + rows + cols])
        else:
            buf[at : at + rows + cols].zero_()
            odd.append((k, region_sum(r, tensors)))
    regions = len(lay.entries)
    per = torch.zeros(regions, dtype=torch.int64, device=device).index_add_(0, lay.region_of, buf * lay.weights)
    for k, s in odd:
        per[k] += s
    return per


def bucket_sums(plan: SumPlan, tensors: Mapping[str, torch.Tensor]) -> PairSums:
    """Every bucket's checksum (:func:`step_sums`)."""
    return step_sums(plan, tensors).buckets


def destination_dtypes(planner, plans: Mapping[Pair, list[Bucket]]) -> dict[tuple[Pair, str], torch.dtype]:
    """The dtype of every destination tensor a training rank's plan writes (from the engine layout)."""
    from weightsync.dtypes import torch_dtype

    layouts: dict[int, object] = {}
    out = {}
    for pair, buckets in plans.items():
        dst_rank = pair[2]
        if dst_rank not in layouts:
            layouts[dst_rank] = planner.dst.layout(dst_rank)
        tensors = layouts[dst_rank].tensors
        for b in buckets:
            for c in b.copies:
                out[(pair, c.dst_tensor)] = torch_dtype(tensors[c.dst_tensor].dtype)
    return out
