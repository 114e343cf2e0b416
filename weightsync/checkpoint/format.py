"""The safetensors file format, written by hand so a file can be filled window by window.

A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor's dtype,
shape and ``data_offsets`` (into the data section that follows), and the data. Because the header
depends only on names, dtypes and shapes, it is written first and the data section is then filled in
place at known offsets, with no rank ever holding a whole file (``safetensors.torch.save_file`` needs
every tensor in memory at once). Offsets must be contiguous from 0 (the reader refuses gaps), so the
tensors of a file are laid out by decreasing element size: every tensor then starts aligned to its own
element size, and a window of the file can be viewed as typed tensors in place.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from weightsync.dtypes import itemsize
from weightsync.errors import SpecError

#: weightsync dtype names -> safetensors' dtype codes
SAFETENSORS_DTYPES: dict[str, str] = {
    "bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3",
}

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class FileTensor:
    """One tensor of a shard file: ``[begin, end)`` bytes of the file's data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def file_name(index: int, count: int) -> str:
    """``model-00001-of-00004.safetensors``, Hugging Face's shard naming (``index`` from 0)."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def lay_out(tensors: list[tuple[str, str, tuple[int, ...]]]) -> tuple[FileTensor, ...]:
    """Contiguous offsets for ``(name, dtype, shape)`` entries, larger elements first (then by name)."""
    out: list[FileTensor] = []
    at = 0
    for name, dtype, shape in sorted(tensors, key=lambda t: (-itemsize(t[1]), t[0])):
        if dtype not in SAFETENSORS_DTYPES:
            raise SpecError(f"tensor {name}: dtype {dtype} has no safetensors code; "
                            f"supported: {', '.join(SAFETENSORS_DTYPES)}")
        n = itemsize(dtype)
        for d in shape:
            n *= d
        out.append(FileTensor(name, dtype, tuple(shape), at, at + n))
        at += n
    return tuple(out)


def header(tensors: tuple[FileTensor, ...]) -> bytes:
    """The length prefix plus the JSON header (space-padded to a multiple of 8, as safetensors pads it)."""
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    for t in tensors:
        meta[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [t.begin, t.end]}
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


__all__ = ["FileTensor", "SAFETENSORS_DTYPES", "INDEX_NAME", "file_name", "lay_out", "header"]
