"""Reading an HF checkpoint (safetensors) for validation.

:class:`Checkpoint` opens every ``*.safetensors`` file of a directory (through the index when there is
one) and reads any box of a canonical tensor without loading the rest (``safe_open(...).get_slice``),
so a layout-faithful worker reads exactly the regions it holds. Writing canonical tensors as one is
:func:`weightsync.checkpoint.hf.save_hf_checkpoint`.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import torch

from weightsync.errors import ConfigError
from weightsync.layout.box import Box

INDEX = "model.safetensors.index.json"


def checkpoint_files(directory: str | os.PathLike) -> list[str]:
    """The safetensors files of an HF checkpoint directory (the index's, else every ``*.safetensors``)."""
    d = Path(directory)
    if not d.is_dir():
        raise ConfigError(f"validate: checkpoint {str(d)!r} is not a directory; pass the directory an HF "
                          "checkpoint was saved to (save_pretrained, WeightWriter.save_checkpoint)")
    index = d / INDEX
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in files if not (d / f).exists()]
        if missing:
            raise ConfigError(f"validate: {index} names {missing[:3]} ({len(missing)} files), not in {d}")
        return [str(d / f) for f in files]
    files = sorted(glob.glob(str(d / "*.safetensors")))
    if not files:
        raise ConfigError(f"validate: no *.safetensors files in {d}: validation reads safetensors checkpoints")
    return files


class Checkpoint:
    """The tensors of a checkpoint directory by name, read lazily (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike):
        from safetensors import safe_open

        self.directory = str(directory)
        self._files = {}
        self._where: dict[str, str] = {}
        for f in checkpoint_files(directory):
            h = safe_open(f, framework="pt")
            self._files[f] = h
            for name in h.keys():
                self._where.setdefault(name, f)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[self._where[name]].get_slice(name).get_shape())

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        """Tensor ``name``, or only its region ``box`` ((offset, length) per dimension)."""
        if name not in self._where:
            raise ConfigError(f"validate: the checkpoint in {self.directory} has no tensor {name!r}; it is not a "
                              "checkpoint of this model (or it was saved without that tensor)")
        h = self._files[self._where[name]]
        if box is None:
            return h.get_tensor(name)
        return h.get_slice(name)[tuple(slice(o, o + n) for o, n in box)]


__all__ = ["Checkpoint", "checkpoint_files"]
