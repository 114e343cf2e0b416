"""A real inference engine that weightsync starts and owns (:mod:`weightsync.vllm.engine`,
:mod:`weightsync.sglang.engine`): the parts that do not depend on which engine it is.

An owned engine starts on the model's ``config.json`` alone (dummy weights) unless a checkpoint is given; the folder
made for that is the engine's to remove, when it fails to start or once it is closed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Any


def config_dir(model_config: dict[str, Any], directory: str) -> str:
    """A model folder an engine can start on with dummy weights: its ``config.json`` alone."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model_config, f)
    return directory


def discard(workdir: str | None) -> None:
    """Remove the dummy-weights folder an engine was started on (None: it was started on a checkpoint)."""
    if workdir:
        shutil.rmtree(workdir, ignore_errors=True)


class Owned:
    """Base of an owned engine: its instance (set by the subclass), the folder made for dummy weights (None: started
    on a checkpoint), and how long it took to start. ``close`` closes the instance, stops the engine's processes
    (:meth:`shutdown`, the engine's own way) and removes the folder."""

    instance: Any
    workdir: str | None
    startup_s: float

    def shutdown(self) -> None:
        """Shut the engine's processes down now (not at garbage collection)."""
        raise NotImplementedError

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.instance.close()
        self.shutdown()
        discard(self.workdir)


__all__ = ["Owned", "config_dir", "discard"]
