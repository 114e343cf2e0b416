"""The approaches weightsync is measured against, run over the same group, GPUs and weights.

- ``naive`` (OpenRLHF, early verl): per canonical tensor, training rank 0 gathers the full tensor from
  the ranks holding its shards, broadcasts it to every rank of the group, and each inference rank
  slices out its part (its pieces of that tensor).
- ``bucketed`` (slime, current verl): the same, but full tensors are packed into ~512 MB buckets and
  each bucket is broadcast once.

Both need every member of the group to take part in each broadcast (that is how they work). Each
side calls the same function with its role; trainers pass their live tensors, inference workers
theirs. The gather uses point-to-point messages to rank 0 in one fixed order (deadlock-free: rank 0
receives them in exactly the order each sender sends them).
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist

from weightsync.layout.box import slices
from weightsync.layout.layout import EngineLayout
from weightsync.layout.materialize import TORCH_DTYPES, local_view
from weightsync.transport.p2p import JobRanks

BUCKET_BYTES = 512 << 20
GATHER_TAG = 11


def _broadcast(group, tensor: torch.Tensor, timeout) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait(timeout=timeout)


def _gather_into(group, src: EngineLayout, train_rank: int | None, tensors: Mapping[str, torch.Tensor] | None,
                 canonical: str, full: torch.Tensor, timeout) -> None:
    """Training rank 0 assembles ``full`` from the first holder of every shard; the holders send."""
    if train_rank is None:
        return
    for shard in src.shards(canonical):
        holder = min(src.group_ranks(shard.group))
        p = shard.piece
        if holder == 0 and train_rank == 0:
            full[slices(p.canon_box)].copy_(local_view(tensors[p.tensor], p))
        elif train_rank == 0:
            buf = torch.empty(tuple(n for _, n in p.canon_box), dtype=full.dtype, device=full.device)
            group.recv([buf], holder, GATHER_TAG).wait(timeout=timeout)
            full[slices(p.canon_box)].copy_(buf)
        elif train_rank == holder:
            group.send([local_view(tensors[p.tensor], p).to(full.dtype).contiguous()], 0, GATHER_TAG).wait(timeout=timeout)


def _scatter_from(dst_layout, tensors: Mapping[str, torch.Tensor], canonical: str, full: torch.Tensor) -> None:
    """An inference rank slices its pieces of one canonical tensor out of the full tensor."""
    for name, t in dst_layout.tensors.items():
        for p in t.pieces:
            if p.canonical == canonical:
                local_view(tensors[name], p).copy_(full[slices(p.canon_box)])


def sync_step(
    kind: str,
    group,
    ranks: JobRanks,
    src: EngineLayout,
    dst: EngineLayout,
    *,
    train_rank: int | None = None,
    infer: tuple[int, int] | None = None,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device,
    timeout,
) -> None:
    """One weight sync the ``kind`` way; call on every member of ``group`` (training and inference)."""
    spec = src.spec
    dst_layout = dst.layout(infer[1]) if infer is not None else None
    if kind == "naive":
        for t in spec.tensors:
            full = torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=device)
            _gather_into(group, src, train_rank, tensors, t.name, full, timeout)
            _broadcast(group, full, timeout)
            if dst_layout is not None:
                _scatter_from(dst_layout, tensors, t.name, full)
        return
    if kind != "bucketed":
        raise ValueError(f"unknown baseline {kind!r}")
    for bucket in _buckets(spec):
        size = sum(t.nbytes for t in bucket)
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        views, off = [], 0
        for t in bucket:
            views.append(buf[off:off + t.nbytes].view(TORCH_DTYPES[t.dtype]).view(t.shape))
            off += t.nbytes
        for t, v in zip(bucket, views):
            _gather_into(group, src, train_rank, tensors, t.name, v, timeout)
        _broadcast(group, buf, timeout)
        if dst_layout is not None:
            for t, v in zip(bucket, views):
                _scatter_from(dst_layout, tensors, t.name, v)


def _buckets(spec) -> list[list]:
    out, cur, size = [], [], 0
    for t in spec.tensors:
        if cur and size + t.nbytes > BUCKET_BYTES:
            out.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur:
        out.append(cur)
    return out
