"""Real inference engines in GPU tests: what a build can run, and a process of its own for each engine.

Two rules, from `make test-gpu` with the vLLM kit on the path (issue 22 item 7):

- **An engine starts from a spawned process.** The pytest process runs CUDA tests of its own (and
  ``torch.cuda.is_available()`` in a skip condition already touches the driver), after which vLLM's engine
  core, forked from it, dies with "Cannot re-initialize CUDA in forked subprocess". :func:`run_spawned` runs a
  test's body in a fresh interpreter (``spawn``) leading a session of its own, with vLLM told to spawn too,
  and kills that session afterwards, so an engine process left behind cannot keep its GPU memory or the run.
- **What a build cannot run is skipped by name, with the reason**: :func:`vllm_lacks` looks for the kernel
  library a model needs in the installed vLLM (without importing it) -- the GPU kit leaves out ``_moe_C``, so
  MoE models do not run there -- and says which library is missing.
"""

from __future__ import annotations

import glob
import importlib.util
import multiprocessing as mp
import os
import signal
import traceback
from typing import Any, Callable

#: kernel libraries a model needs beyond vLLM's core ones, by what the model has (vllm/platforms/cuda.py
#: import_kernels: ``_moe_C_stable_libtorch`` holds topk_softmax, moe_align_block_size, grouped_topk, ...)
MOE_KERNELS = "_moe_C"


def vllm_dir() -> str | None:
    """The installed vLLM package's directory, found without importing it (importing vLLM is seconds)."""
    found = importlib.util.find_spec("vllm")
    if found is None or not found.submodule_search_locations:
        return None
    return list(found.submodule_search_locations)[0]


def vllm_lacks(model: str) -> str | None:
    """Why the installed vLLM cannot run ``model`` on a GPU here (the kernel library it needs is not in the
    build), or None when it has what the model needs."""
    from weightsync.spec import load_spec

    where = vllm_dir()
    if where is None:
        return "vllm is not installed here"
    spec = load_spec(model)
    if any(layer.moe for layer in spec.layers) and not glob.glob(os.path.join(where, f"{MOE_KERNELS}*.so")):
        return (f"{model} is a mixture of experts and this vLLM build has no MoE kernels ({where}/{MOE_KERNELS}*.so "
                "is missing; the vLLM GPU kit leaves it out, see its README); it runs with a full vLLM wheel")
    return None


def _child(fn: Callable[..., Any], args: tuple, conn: Any) -> None:
    """The spawned process: lead a session (the driver kills it whole), make vLLM spawn its own processes,
    run ``fn(*args)`` and send back None or the formatted failure."""
    os.setsid()
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    # tests hand vLLM's collective_rpc plain callables (a lambda reading parameters); the engine is a test's own
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    try:
        fn(*args)
        conn.send(None)
    except BaseException as e:  # noqa: BLE001 -- handed to the driver, which raises it in the test
        conn.send(f"{type(e).__name__}: {e}\n{''.join(traceback.format_exception(e))}")
    conn.close()


def run_spawned(fn: Callable[..., Any], *args: Any, timeout_s: float = 420.0) -> None:
    """Run ``fn(*args)`` (a module-level function: it is pickled) in a spawned process leading its own session,
    within ``timeout_s``; raise AssertionError with its traceback if it raised, died or ran out of time. Every
    process of that session (the engine's) is killed before this returns."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(fn, args, child), name=f"engine test {getattr(fn, '__name__', fn)}")
    p.start()
    child.close()
    failure: str | None = None
    try:
        if parent.poll(timeout_s):
            try:
                failure = parent.recv()
            except EOFError:
                failure = "the engine test's process died before reporting"
        else:
            failure = f"the engine test did not finish within {timeout_s:g} s"
        p.join(30.0)
        if failure is None and p.exitcode not in (0, None):
            failure = f"the engine test's process exited with code {p.exitcode}"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # its session: the engine core and workers it started
        except (ProcessLookupError, PermissionError):
            pass
        p.join(10.0)
        parent.close()
    if failure is not None:
        raise AssertionError(failure)


__all__ = ["MOE_KERNELS", "run_spawned", "vllm_dir", "vllm_lacks"]
