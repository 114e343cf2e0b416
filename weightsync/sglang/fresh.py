"""A FRESH SGLang engine on a checkpoint, in a process of its own: what it computes with, and its greedy tokens.

The reference a synced SGLang engine is compared with (never transformers: bf16 kernels differ on near-ties,
docs/sglang.md §0): ``python -m weightsync.sglang.fresh CHECKPOINT ENGINE OUT.json [GPU]`` starts an engine with
the same options as :func:`weightsync.sglang.engine.start` on ``CHECKPOINT`` (an HF folder), writes the digests
of every tensor each worker computes with (:func:`weightsync.sglang.verify.computed_digests`) and the greedy
tokens of :data:`weightsync.sglang.engine.PROMPTS`, and stops. :func:`reference` runs it as a child leading its
own session (SGLang's scheduler and detokenizer are processes of their own; the whole session is killed after),
so a caller that already runs an engine never holds two in one process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from weightsync.errors import WeightSyncError


class ReferenceFailed(WeightSyncError):
    """The fresh reference engine did not start or did not answer."""


@dataclass(frozen=True)
class FreshReference:
    """What a fresh engine on a checkpoint computes with (per worker: tensor name -> digest) and decodes."""

    digests: list[dict[str, str]]
    tokens: list[list[int]]
    startup_s: float


def reference(checkpoint: str, engine: str = "sglang:tp=1", *, gpu: int = 0, timeout_s: float = 600.0) -> FreshReference:
    """Start a fresh engine on ``checkpoint`` in a child process (GPU ``gpu`` on), return what it computes with."""
    with tempfile.TemporaryDirectory(prefix="weightsync-sglang-fresh-") as d:
        out, log = Path(d) / "ref.json", Path(d) / "log"
        with open(log, "w") as f:
            p = subprocess.Popen([sys.executable, "-m", "weightsync.sglang.fresh", checkpoint, engine, str(out), str(gpu)],
                                 stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its session: the scheduler and detokenizer too
            except (ProcessLookupError, PermissionError):
                pass
            p.wait(30)
        if not out.exists():
            raise ReferenceFailed(f"the fresh SGLang engine on {checkpoint} gave no answer within {timeout_s:g} s "
                                  f"(exit {p.returncode}); its log ends: {log.read_text()[-1500:]}")
        rec = json.loads(out.read_text())
    if "error" in rec:
        raise ReferenceFailed(f"the fresh SGLang engine on {checkpoint} failed: {rec['error'][-1500:]}")
    return FreshReference(rec["digests"], rec["tokens"], rec["startup_s"])


def main(argv: list[str]) -> int:
    from weightsync.sglang.engine import EngineOptions, generate, start

    checkpoint, engine, out = argv[:3]
    gpu = int(argv[3]) if len(argv) > 3 else 0
    rec: dict = {}
    try:
        cfg = json.loads(Path(checkpoint, "config.json").read_text())
        t0 = time.perf_counter()
        own = start(cfg, engine, EngineOptions(extra={"base_gpu_id": gpu} if gpu else {}), checkpoint=checkpoint)
        rec["startup_s"] = time.perf_counter() - t0
        try:
            rec["digests"] = own.digests()
            rec["tokens"] = generate(own.engine)
        finally:
            own.close()
    except Exception as e:  # noqa: BLE001 -- reported to the parent
        import traceback

        rec["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    Path(out).write_text(json.dumps(rec))
    return 0 if "error" not in rec else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["FreshReference", "ReferenceFailed", "reference"]
