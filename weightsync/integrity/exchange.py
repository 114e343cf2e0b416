"""Moving a training rank's bucket sums to the workers that check them, through the MetaServer.

A training rank posts its sums of a checked step under its own rendezvous name(s), replaced every
checked step: ``integrity.<rank>`` holds ``"<step>/<n>|<text>"`` and, when the text does not fit one
value (512 characters), ``integrity.<rank>.<k>`` hold the rest as ``"<step>/<n>/<k>|<text>"``. The
text lists the rank's pairs as ``<instance>.<rank>=<sums>;`` with every bucket sum as 11 characters of
unpadded base64. A 1,000-rank job posts one value per training rank a checked step (a rank sends few
buckets); the 64 buckets of an 8B model from one rank take three.

A worker reads the names of the training ranks it receives from, waiting until they carry its step.

On a mismatch only, the finer exchange: the worker asks each training rank it found a differing bucket
from (``integrity.ask.<rank>.<step>``, first asker wins, every asker waits for the same answer) and the
rank answers with the sum of every *copy* it sent that step (``integrity.copies.<rank>[.<k>]``, the
same format, each pair's copy sums in plan order), so the worker names the exact copies that differ.
Async pulls read the bucket sums posted with a staged snapshot; a value that already carries a later
step means the snapshot moved on, and the pull is tried again (``stale_ok``).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterable

from weightsync.errors import IntegrityError
from weightsync.integrity.sums import PairSums

VALUE_MAX = 512  # the MetaServer's limit on a rendezvous value
_SUM_CHARS = 11


SUMS, COPIES = "integrity", "integrity.copies"  # the bucket sums, the per-copy answer


def name(rank: int, k: int = 0, kind: str = SUMS) -> str:
    return f"{kind}.{rank}" if k == 0 else f"{kind}.{rank}.{k}"


def ask_name(rank: int, step: int) -> str:
    return f"integrity.ask.{rank}.{step}"


def encode(sums: PairSums) -> str:
    parts = []
    for (_, inst, rank), values in sorted(sums.items()):
        text = "".join(base64.urlsafe_b64encode(v.to_bytes(8, "little")).decode()[:_SUM_CHARS] for v in values)
        parts.append(f"{inst}.{rank}={text};")
    return "".join(parts)


def decode(src: int, text: str) -> PairSums:
    out = {}
    for part in filter(None, text.split(";")):
        who, values = part.split("=")
        inst, rank = (int(x) for x in who.split("."))
        sums = tuple(int.from_bytes(base64.urlsafe_b64decode(values[i : i + _SUM_CHARS] + "="), "little")
                     for i in range(0, len(values), _SUM_CHARS))
        out[(src, inst, rank)] = sums
    return out


def chunks(step: int, text: str) -> list[tuple[str, str]]:
    """``(name suffix index, value)`` for every value one rank posts (header sizes bounded generously)."""
    room = VALUE_MAX - 48
    pieces = [text[i : i + room] for i in range(0, len(text), room)] or [""]
    n = len(pieces)
    return [(str(k), f"{step}/{n}|{p}" if k == 0 else f"{step}/{n}/{k}|{p}") for k, p in enumerate(pieces)]


def publish(client, rank: int, step: int, sums: PairSums, kind: str = SUMS) -> int:
    """Post this rank's sums of ``step`` (the continuation values first, the head last: a reader that
    sees the head at this step finds the rest there too). Returns how many values were posted."""
    values = chunks(step, encode(sums))
    for k, value in reversed(values):
        client.publish(name(rank, int(k), kind), value, replace=True)
    return len(values)


def ask(client, rank: int, step: int, who: str) -> None:
    """Ask training rank ``rank`` for its per-copy sums of ``step`` (another asker may have already)."""
    from weightsync.meta.client import MetaError

    try:
        client.publish(ask_name(rank, step), who[:256])
    except MetaError as e:
        if e.status != 409:  # 409: asked already (the answer serves every asker)
            raise


def _parse(value: str) -> tuple[int, int, str]:
    head, _, text = value.partition("|")
    fields = head.split("/")
    return int(fields[0]), int(fields[1]), text


class MovedOn(Exception):
    """A value already carries a later step than the one asked for (an async snapshot re-staged)."""


def fetch(client, srcs: Iterable[int], step: int, timeout_s: float, kind: str = SUMS,
          stale_ok: bool = False) -> PairSums | None:
    """The sums of ``step`` every listed training rank posted, waiting for them (polling its values
    until they carry ``step``); an IntegrityError names the ranks that did not post it in time.
    ``stale_ok`` (async pulls): None where a rank's values already carry a later step."""
    try:
        return _fetch(client, srcs, step, timeout_s, kind)
    except MovedOn as e:
        if stale_ok:
            return None
        raise IntegrityError(str(e)) from None


def _fetch(client, srcs: Iterable[int], step: int, timeout_s: float, kind: str) -> PairSums:
    deadline = time.monotonic() + timeout_s
    out: PairSums = {}
    pending = sorted(set(srcs))
    delay = 0.0005
    while pending:
        later = []
        for src in pending:
            got, n, text = _parse(client.lookup(name(src, 0, kind), timeout=max(0.05, deadline - time.monotonic())))
            if got > step:
                raise MovedOn(f"training rank {src} posted the checksums of step {got} while this worker "
                              f"checks step {step}: the steps are out of order")
            if got < step:
                later.append(src)
                continue
            texts = [text]
            for k in range(1, n):
                g2, _, t2 = _parse(client.lookup(name(src, k, kind), timeout=max(0.05, deadline - time.monotonic())))
                if g2 != step:  # replaced meanwhile (the head is posted last, read first)
                    raise MovedOn(f"training rank {src}'s checksum value {k} of {n} carries step {g2}, not {step}")
                texts.append(t2)
            out.update(decode(src, "".join(texts)))
        pending = later
        if pending:
            if time.monotonic() > deadline:
                raise IntegrityError(f"training ranks {pending} did not post the checksums of step {step} within "
                                     f"{timeout_s:g} s; the step is not reported held")
            time.sleep(delay)
            delay = min(0.02, delay * 2)
    return out

