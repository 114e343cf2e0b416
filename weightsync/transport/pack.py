"""Pack a bucket's source boxes into one flat byte buffer and unpack it into destination views.

The buffer layout is the bucket's copies back to back, each in its wire dtype (the source's), so
both ends derive offsets from the plan alone. Unpacking copies into the live destination tensors
in place, converting dtype where the destination differs (as loading a checkpoint would).
"""

from __future__ import annotations

from typing import Mapping

import torch

from weightsync.layout.box import box_shape, slices
from weightsync.layout.materialize import TORCH_DTYPES
from weightsync.plan.planner import Bucket


def bucket_bytes(bucket: Bucket) -> int:
    return sum(c.nbytes for c in bucket.copies)


def pack(bucket: Bucket, sources: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather the bucket's source boxes into ``out`` (a uint8 buffer, allocated when None)."""
    n = bucket_bytes(bucket)
    if out is None:
        out = torch.empty(n, dtype=torch.uint8, device=next(iter(sources.values())).device)
    off = 0
    for c in bucket.copies:
        size = c.nbytes
        src = sources[c.src_tensor][slices(c.src_box)]
        dst = out[off : off + size].view(TORCH_DTYPES[c.dtype]).view(box_shape(c.canon_box))
        dst.view(src.shape).copy_(src)
        off += size
    return out[:n]


def unpack(bucket: Bucket, buffer: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> None:
    """Scatter a packed buffer into the destination tensors in place."""
    off = 0
    for c in bucket.copies:
        size = c.nbytes
        region = targets[c.dst_tensor][slices(c.dst_box)]
        region.copy_(buffer[off : off + size].view(TORCH_DTYPES[c.dtype]).view(region.shape))
        off += size
