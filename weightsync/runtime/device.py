"""A device's stable identity, shared by the session (what a trainer registers) and the workers (what
each inference worker probes): its own module so neither imports the other for it."""

from __future__ import annotations

import torch


def device_uuid(device: torch.device) -> str | None:
    """A GPU's stable identity (its UUID, whatever ``CUDA_VISIBLE_DEVICES`` this process saw), or None
    for the CPU."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)
