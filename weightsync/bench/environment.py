"""Where and with what a benchmark result was measured, recorded with every result (the scenario benches of
:mod:`weightsync.bench.run`, the adapter bench of :mod:`weightsync.bench.lora`)."""

from __future__ import annotations

import torch


def environment() -> dict:
    """Where and with what a result was measured (recorded with every result)."""
    import datetime
    import os
    import subprocess

    from weightsync import __version__

    commit = os.environ.get("WEIGHTSYNC_COMMIT")  # a copied tree's .git can be stale: let the caller say
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    timeout=5).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "weightsync": __version__,
        "commit": commit,
    }
