"""Per-step integrity: checksums of what was sent and what landed, compared before a step is held.

- :func:`checksum` (``weightsync.integrity.digest``): the checksum of one tensor region, on its device.
- :mod:`.sums`: a plan's per-bucket and per-copy sums on either side; :mod:`.exchange`: posting them
  through the MetaServer; :mod:`.check`: the writer's and the worker's parts and the comparison;
  :mod:`.answer`: a training rank's per-copy sums of a failed step, posted when a worker asks;
  :mod:`.locate`: naming the differing copies and one flipped bit's element;
  :mod:`.cadence`: which steps are checked (``integrity=N``).

See docs/integrity.md. Imports torch only when a torch-using name is asked for.
"""

from __future__ import annotations

from weightsync.integrity.cadence import DEFAULT_EVERY, due, every

__all__ = ["DEFAULT_EVERY", "checksum", "due", "every", "reference", "to_ints", "words"]


def __getattr__(name: str):
    if name in ("checksum", "reference", "to_ints", "words"):
        import importlib

        return getattr(importlib.import_module("weightsync.integrity.digest"), name)
    raise AttributeError(f"module 'weightsync.integrity' has no attribute {name!r}")
