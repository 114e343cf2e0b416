"""The worker side of tests/test_vllm_mailbox.py's part 1: a spawned process serving a mailbox with :func:`echo`.

In a module of its own that imports no torch, so that each spawned worker starts in a fraction of a second (the
test module imports torch and vLLM's harness: ~3 s a process, two processes a test).
"""

from __future__ import annotations

import time

from weightsync.runtime.mailbox import MailboxAddress, serve


def echo(payload: bytes) -> bytes:
    if payload.startswith(b"sleep:"):
        time.sleep(float(payload[6:]))
        return b"slept"
    if payload.startswith(b"posted:"):  # a transfer: posted, then the device's part (a sleep)
        from weightsync.transport.posted import posted

        posted()
        posted()  # a second one in the same call says nothing more
        time.sleep(float(payload[7:]))
        return b"done"
    if payload.startswith(b"gated:"):  # a receive sent early: set-up, the go, the copies; what it saw, to a file
        from weightsync.transport.gate import StepCancelled, ready

        began = time.time()
        try:
            waited = ready()
            outcome = f"went {began:.6f} {time.time():.6f} {waited:.6f} {ready():.6f}"
        except StepCancelled as e:
            outcome = f"cancelled {e}"
        with open(payload[6:].decode(), "w") as f:
            f.write(outcome)
        return b"received"
    if payload.startswith(b"raise"):
        raise ValueError("the handler raised")
    if payload.startswith(b"big:"):
        n = int(payload[4:])
        return bytes(range(256)) * (n // 256)
    return b"rank-answer:" + payload[::-1]


def worker_main(directory: str, rank: int, ready) -> None:
    serve(MailboxAddress(directory), rank, echo)
    ready.set()
    time.sleep(300)  # killed by the test (an Event a killed waiter held would hang the setter)
