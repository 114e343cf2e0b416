"""The block-FP8 form of a safetensors checkpoint file: each FP8 tensor as e4m3 plus its ``_scale_inv``.

:func:`weightsync.checkpoint.save.save_checkpoint` with ``quant="fp8"`` first writes the trainer's weights as
usual, then each owner rewrites its own files with :func:`quantize_file`, reading at most ``chunk_bytes`` of a
tensor at a time (whole 128-row block rows: a block's scale needs all of its rows) and quantizing with the torch
definition (:func:`weightsync.quant.fp8.quantize_reference`: the same bits the Triton kernel gives on a GPU). What
the new file holds is a pure function of the old file's tensors (:func:`fp8_entries`), so rank 0 writes the index
without reading anyone's file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from weightsync.checkpoint.format import FileTensor, header, lay_out
from weightsync.quant.config import FP8Tensor
from weightsync.quant.fp8 import BLOCK, quantize_reference

_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "float8_e4m3fn"}


def fp8_entries(tensors: Sequence[tuple[str, str, tuple[int, ...]]],
                fp8: Mapping[str, FP8Tensor]) -> tuple[FileTensor, ...]:
    """A file's ``(name, dtype, shape)`` entries in block FP8: each FP8 tensor as e4m3 followed by its scale."""
    out: list[tuple[str, str, tuple[int, ...]]] = []
    for name, dtype, shape in tensors:
        f = fp8.get(name)
        if f is None:
            out.append((name, dtype, tuple(shape)))
        else:
            out += [(name, f.weight.dtype, tuple(shape)), (f.scale.name, f.scale.dtype, f.scale.shape)]
    return lay_out(out)


def quantize_file(path: str | os.PathLike, fp8: Mapping[str, FP8Tensor], chunk_bytes: int = 64 << 20) -> int:
    """Rewrite the safetensors file ``path`` in block FP8 (``fp8``: the FP8 tensors by name; the others are copied
    as they are), through ``path.tmp`` and a rename; returns the new file's data bytes."""
    from safetensors import safe_open

    path = Path(path)
    with safe_open(str(path), framework="pt") as src:
        names = list(src.keys())
        entries = []
        for n in names:
            s = src.get_slice(n)
            entries.append((n, _ST_DTYPES[s.get_dtype()], tuple(s.get_shape())))
        layout = fp8_entries(entries, fp8)
        at = {t.name: t for t in layout}
        head = header(layout)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)  # the model: its owner's
        try:
            _write(fd, head, 0)
            os.ftruncate(fd, len(head) + (layout[-1].end if layout else 0))
            for name, dtype, shape in entries:
                s = src.get_slice(name)
                rows = shape[0] if shape else 1
                row_bytes = max(1, at[name].end - at[name].begin) // max(1, rows)
                if name in fp8:
                    # ~12 bytes a weight at once: the bf16 read, the definition's fp32 copies, the fp8 result
                    step = max(BLOCK, (chunk_bytes // max(1, 12 * row_bytes)) // BLOCK * BLOCK)
                    sc = at[fp8[name].scale.name]
                    scale_row = sc.end - sc.begin if not shape else (sc.end - sc.begin) // -(-rows // BLOCK)
                    for r0 in range(0, rows, step):
                        q = quantize_reference(s[r0:r0 + step], name)
                        _write(fd, q.weight.view(torch.uint8).numpy(), len(head) + at[name].begin + r0 * shape[1])
                        _write(fd, q.scale_inv.numpy(), len(head) + sc.begin + (r0 // BLOCK) * scale_row)
                else:
                    step = max(1, chunk_bytes // max(1, row_bytes))
                    for r0 in range(0, rows, step):
                        part = s[r0:r0 + step] if shape else s[()]
                        _write(fd, _bytes(part), len(head) + at[name].begin + r0 * row_bytes)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
    os.replace(tmp, path)
    return layout[-1].end if layout else 0


def _bytes(t: torch.Tensor):
    return t.contiguous().view(torch.uint8).numpy() if t.dim() else t.reshape(1).view(torch.uint8).numpy()


def _write(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


__all__ = ["fp8_entries", "quantize_file"]
