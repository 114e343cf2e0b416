"""The point-to-point primitives every group-based transport shares (p2p, co-located, pull, delta).

Posting a bucket's messages (:func:`post`, coalesced into one NCCL group where the backend can:
:func:`coalescing`), retiring them in the one global order (:func:`order_key`, :func:`retire`: a
stream wait on CUDA, a bounded CPU wait on gloo), and the final watch that never hangs
(:func:`settle`, which aborts the group on a stalled peer). The deadlock-freedom argument is
:mod:`weightsync.transport.p2p`'s module docstring.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Callable, Sequence

import torch
from torch.distributed import ProcessGroup

from weightsync.errors import TransportError
from weightsync.plan.planner import Bucket, Pair

DEFAULT_WINDOW = 2  # transfers in flight per rank, each with its buffer (pack k+1 overlaps transfer k)


def order_key(b: Bucket) -> tuple[int, int, int, int]:
    """The one global order every rank walks its buckets in (see the module docstring)."""
    return (b.index, b.src_rank, b.dst_instance, b.dst_rank)


#: gloo's source location ("[.../gloo/transport/tcp/pair.cc:553] ") and its advice after the error
_SOURCE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
_ADVICE = re.compile(r"\s*(?:This is typically caused by|Check the logs of|GLHF).*$")
_PEER_GONE = ("closed by peer", "reset by peer", "socket closed", "unexpectedly closed", "broken pipe")


def first_line(cause: Exception) -> str:
    """What a backend error says, in one line (they run to many), or its type when empty: gloo's source location
    and advice left out, and a connection the peer closed said as such (its process is gone)."""
    text = str(cause).strip()
    if not text:
        return type(cause).__name__
    line = _ADVICE.sub("", _SOURCE.sub("", text.splitlines()[0])).strip()
    if any(words in line.lower() for words in _PEER_GONE):
        return "the peer closed the connection: its process is gone (crashed, killed or exited)"
    return line or type(cause).__name__


def describe(pair: Pair) -> str:
    return f"training rank {pair[0]} -> instance {pair[1]} rank {pair[2]}"


def on_gpu(device: torch.device) -> bool:
    """Whether transfers on ``device`` are ordered by CUDA streams (NCCL) rather than by the CPU (gloo)."""
    return device.type == "cuda"


def coalescing(group: ProcessGroup, device: torch.device) -> bool:
    """Whether ``group`` can post several operations as one NCCL group on ``device``; call once per
    transport and keep the answer.

    Coalesced point-to-point operations run on the whole group's communicator, which NCCL builds in
    a call every member makes: when they can, this builds it with an all-reduce, so every member must
    call it in the same step (sync jobs: every rank runs every step).
    """
    if not on_gpu(device):
        return False
    backend = group._get_backend(device)
    if not getattr(backend, "supports_coalescing", False):
        return False
    group.allreduce([torch.zeros(1, device=device)]).wait()
    return True


def post(group: ProcessGroup, ops: Sequence[tuple[torch.Tensor, int, int, bool]], device: torch.device,
         coalesce: bool) -> list:
    """Post ``(tensor, peer, tag, sending)`` operations; when ``coalesce``, as one NCCL group (one work
    for all of them: NCCL runs them at once and pays its per-operation cost once), on the whole
    group's communicator even for one operation, so a rank's transfers never spread over two."""
    if coalesce:
        group._start_coalescing(device)
    works = [group.send([t], peer, tag) if sending else group.recv([t], peer, tag) for t, peer, tag, sending in ops]
    if coalesce:
        works = [group._end_coalescing(device)]
    return works


def retire(work, timeout: timedelta, ordered: bool) -> None:
    """Order everything queued after this call behind ``work``.

    ``ordered`` (CUDA): the current stream waits for it and the CPU goes on. Otherwise the CPU
    blocks until it completed, at most ``timeout`` (TimeoutError after that).
    """
    if ordered:
        work.wait()
    elif work.wait(timeout=timeout) is False:
        raise TimeoutError("wait timed out")


def settle(posted: Sequence[tuple[object, Callable[[Exception], Exception]]], timeout_s: float,
           device: torch.device, group: ProcessGroup, poll_s: float = 20e-6) -> None:
    """Block the CPU until the current stream's work so far (every unpack) and every posted operation completed.

    ``posted`` lists ``(work, error)`` in posting order, ``error(cause)`` building the exception for
    that operation. Raises the first incomplete operation's error once none has completed for
    ``timeout_s`` (a dead or stalled peer), so a step can be slow but never hangs -- after aborting
    ``group``: its kernels still waiting on the peer exit, so the current stream, which waits on them,
    runs on (else the engine's next kernel on it would hang behind them). The group is unusable then.
    """
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    i, last = 0, time.monotonic()
    while not done.query():
        while i < len(posted) and posted[i][0].is_completed():
            i, last = i + 1, time.monotonic()
        if time.monotonic() - last > timeout_s:
            _, error = posted[min(i, len(posted) - 1)]
            abort(group)
            raise error(TimeoutError(f"no transfer completed for {timeout_s:g}s"))
        time.sleep(poll_s)


def abort(group: ProcessGroup) -> None:
    """Abort ``group``'s communicators (NCCL: pending kernels exit); best effort, the caller is failing."""
    try:
        group.abort()
    except Exception:  # noqa: BLE001 - an older torch, or torn down already: the caller's error matters
        pass


def ensure_buffers(
    buffers: list[torch.Tensor], window: int, need: int, fixed: int | None, device: torch.device
) -> list[torch.Tensor]:
    """``window`` reusable uint8 buffers on ``device``, allocated once (or grown once): the transient memory.

    ``fixed`` caps their size; a bucket larger than that is refused rather than allocated.
    """
    if fixed is not None and need > fixed:
        raise TransportError(
            f"a bucket of {need} bytes exceeds the {fixed}-byte buffers; "
            "plan with a bucket budget no larger than the buffers"
        )
    size = fixed or need
    have = buffers[0] if buffers else None
    if have is not None and len(buffers) == window and have.numel() >= size and have.device == device:
        return buffers
    return [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(window)]
