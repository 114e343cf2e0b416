"""Delta updates through the file transport.

A step's files are written once and read by every instance (the elastic file transport), so the
sender cannot ask each receiver what it holds. Instead it writes, per pair, the full file as always
and, beside it, a *delta file* ``<full name>.delta``: every bucket encoded against the step it wrote
before (:func:`weightsync.delta.codec.encode`), with that base step and each bucket's base checksum
in the metadata. The delta file is written first and the full file renamed into place after it, so
a reader that sees the full file sees the delta file too (when there is one).

A receiver reads the delta file when it proves it holds the base: its version (the step it last
received whole) is the delta's base step, and the checksum of every bucket as its targets hold it
now equals the delta's base checksum; then it applies the deltas in place and reads nothing else.
Otherwise -- a new instance, a failed or skipped update, a rolled-back staged copy, anything that
touched the tensors -- it reads the full file: the fall-back needs no round trip. Bytes moved are the
bytes a receiver read; a writer writes the full bytes plus the deltas every step.

The delta file's payloads are held in memory until it is written: when they would exceed
``cap_bytes`` (default: 4 of the pair's largest bucket) the pair gets no delta file that step.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from weightsync.delta import codec
from weightsync.delta.state import PreviousVersion, gather_pairs, words_of
from weightsync.errors import TransportError
from weightsync.plan.planner import Bucket, Pair, pair_hash
from weightsync.transport.base import StepStats
from weightsync.transport.file import FileTransport, _header, bucket_key, file_name
from weightsync.transport.p2p import describe
from weightsync.transport.pack import copy_pairs, pack, stage, unpack_pairs

log = logging.getLogger("weightsync.delta")

FORMAT = "weightsync.delta/1"
DELTA_SUFFIX = ".delta"


def delta_name(step: int, pair: Pair) -> str:
    return file_name(step, pair) + DELTA_SUFFIX


def _buckets(plans: Mapping[Pair, list[Bucket]]) -> dict[Pair, list[Bucket]]:
    return {p: sorted((b for b in plans[p] if b.nbytes > 0), key=lambda b: b.index) for p in sorted(plans)}


class DeltaFileSender:
    """Writes each pair's full file and its delta file every step (see the module docstring)."""

    def __init__(self, transport: FileTransport, plans: Mapping[Pair, list[Bucket]],
                 tensors: Mapping[str, torch.Tensor], *, host: bool = False, cap_bytes: int | None = None):
        self.t, self.plans, self.tensors = transport, _buckets(plans), tensors
        self._all = {p: list(bs) for p, bs in plans.items()}  # as the full file lists them (empty ones too)
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        self.device = device
        self.previous = PreviousVersion(self.plans, device, host=host)
        self.words = {(p, b.index): words_of(b) for p, bs in self.plans.items() for b in bs}
        self.cap_bytes = cap_bytes
        self._buffer: torch.Tensor | None = None
        self.last_kinds: dict[str, int] = {}

    def send(self, step: int) -> StepStats:
        try:
            return self._send(step)
        except BaseException:
            self.previous.invalidate()
            raise

    def _send(self, step: int) -> StepStats:
        start = time.perf_counter()
        base_step = self.previous.version
        kinds: dict[str, int] = {}
        written = full = 0
        for pair, bs in self.plans.items():
            w, f = self._write_pair(step, base_step, pair, bs, kinds)
            written, full = written + w, full + f
        self.previous.version = step
        self.last_kinds = kinds
        return StepStats(sum(len(bs) for bs in self.plans.values()), written, time.perf_counter() - start,
                         full_bytes=full)

    def _write_pair(self, step: int, base_step: int | None, pair: Pair, bs: list[Bucket],
                    kinds: dict[str, int]) -> tuple[int, int]:
        d = self.t.directory
        final = os.path.join(d, file_name(step, pair))
        tmp = os.path.join(d, f".{file_name(step, pair)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        cap = self.cap_bytes if self.cap_bytes is not None else 4 * max((b.nbytes for b in bs), default=0)
        payloads: dict[str, torch.Tensor] | None = {} if base_step is not None else None
        codes: list[list[int]] = []
        held = 0
        full = sum(b.nbytes for b in bs)
        try:
            with open(tmp, "wb") as f:
                f.write(_header(step, pair, self.t_plans(pair), pair_hash(self.t_plans(pair))))
                for b in bs:
                    buf = pack(b, self.tensors, out=self._packing_buffer(b.nbytes)[: b.nbytes])
                    f.write((buf if buf.device.type == "cpu" else buf.cpu()).numpy())
                    words = self.words[(pair, b.index)]
                    if payloads is not None:
                        base = self.previous.base(b)
                        base_sum = self.previous.checksum_of(b)
                        if base is None or base_sum is None:
                            payloads = None
                        else:
                            if base.device != buf.device:
                                base = base.to(buf.device)
                            enc = codec.encode(codec.as_words(buf, words.word), codec.as_words(base, words.word),
                                               blocks=False)
                            held += enc.nbytes
                            if held > cap:
                                log.info("step %d, %s: the deltas exceed %d bytes; no delta file this step",
                                         step, describe(pair), cap)
                                payloads = None
                            else:
                                payloads[bucket_key(b.index)] = enc.payload.cpu().clone()
                                codes.append([b.index, enc.kind, enc.count, base_sum])
                                name = codec.KIND_NAMES[enc.kind]
                                kinds[name] = kinds.get(name, 0) + 1
                    self.previous.store(b, buf)
            if payloads is not None:
                self._write_delta(step, base_step, pair, bs, payloads, codes)
            os.replace(tmp, final)  # after the delta file: a reader seeing this sees that
        except BaseException as e:
            for path in (tmp,):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            if isinstance(e, OSError):
                raise TransportError(f"step {step}: writing the files of {describe(pair)} to {d} failed: {e}",
                                     pair=pair) from e
            raise
        delta = sum(p.numel() for p in payloads.values()) if payloads is not None else 0
        return full + delta, full

    def t_plans(self, pair: Pair) -> list[Bucket]:
        """The pair's whole plan as the full file lists it (empty buckets included)."""
        return self._all[pair]

    def _write_delta(self, step: int, base_step: int, pair: Pair, bs: list[Bucket],
                     payloads: dict[str, torch.Tensor], codes: list[list[int]]) -> None:
        d = self.t.directory
        final = os.path.join(d, delta_name(step, pair))
        tmp = os.path.join(d, f".{delta_name(step, pair)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        meta = {"format": FORMAT, "step": str(step), "base_step": str(base_step), "pair": ",".join(map(str, pair)),
                "pair_hash": pair_hash(self.t_plans(pair)), "codes": json.dumps(codes)}
        try:
            save_file(payloads, tmp, metadata=meta)
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _packing_buffer(self, need: int) -> torch.Tensor:
        have = self._buffer
        if have is None or have.numel() < need:
            self._buffer = have = torch.empty(need, dtype=torch.uint8, device=self.device)
        return have


class DeltaFileReceiver:
    """Reads a pair's delta file when it proves the delta's base, else the full file."""

    def __init__(self, transport: FileTransport, plans: Mapping[Pair, list[Bucket]]):
        self.t = transport
        self.all = {p: list(bs) for p, bs in plans.items()}
        self.plans = _buckets(plans)
        self.words = {(p, b.index): words_of(b) for p, bs in self.plans.items() for b in bs}
        self.version: int | None = None
        self._slot: torch.Tensor | None = None
        self.last_kinds: dict[str, int] = {}
        self.last_full_pairs: list[Pair] = []

    def receive(self, step: int, targets: Mapping[str, torch.Tensor]) -> StepStats:
        start = time.perf_counter()
        held, self.version = self.version, None  # from here the targets may mix two steps
        device = next(iter(targets.values())).device if targets else torch.device("cpu")
        largest = max((b.nbytes for bs in self.plans.values() for b in bs), default=0)
        if self._slot is None or self._slot.numel() < largest or self._slot.device != device:
            self._slot = torch.empty(largest, dtype=torch.uint8, device=device)
        pending = dict(self.plans)
        kinds: dict[str, int] = {}
        moved = full_bytes = 0
        whole: list[Pair] = []
        last = time.monotonic()
        while pending:
            arrived = [p for p in pending if os.path.exists(os.path.join(self.t.directory, file_name(step, p)))]
            for pair in arrived:
                bs = pending.pop(pair)
                n = self._delta(step, held, pair, bs, targets, kinds)
                if n is None:
                    whole.append(pair)
                    _, n = self.t._consume(step, pair, self.all[pair],
                                           os.path.join(self.t.directory, file_name(step, pair)), targets)
                    kinds["full"] = kinds.get("full", 0) + len(bs)
                moved += n
                full_bytes += sum(b.nbytes for b in bs)
            if arrived:
                last = time.monotonic()
                continue
            if time.monotonic() - last > self.t.timeout_s:
                pair = sorted(pending)[0]
                raise TransportError(f"step {step}: no file for {describe(pair)} ({file_name(step, pair)}) in "
                                     f"{self.t.directory} after waiting {self.t.timeout_s:g}s", peer=pair[0], pair=pair)
            time.sleep(self.t.poll_s)
        self.version = step
        self.last_kinds, self.last_full_pairs = kinds, whole
        return StepStats(sum(len(bs) for bs in self.plans.values()), moved, time.perf_counter() - start,
                         full_bytes=full_bytes)

    def _base(self, b: Bucket, targets: Mapping[str, torch.Tensor]):
        st = stage(b, targets, False)
        if st.staged:
            copy_pairs(gather_pairs(st.staged, targets, self._slot))
        return st, st.tensors(self._slot)

    def _delta(self, step: int, held: int | None, pair: Pair, bs: list[Bucket],
               targets: Mapping[str, torch.Tensor], kinds: dict[str, int]) -> int | None:
        """Apply the pair's delta file in place and return its bytes, or None when this receiver does
        not prove the delta's base (or there is no delta file): then the full file is read."""
        path = os.path.join(self.t.directory, delta_name(step, pair))
        if held is None or not os.path.exists(path):
            return None
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if (meta.get("format") != FORMAT or meta.get("step") != str(step) or meta.get("base_step") != str(held)
                    or meta.get("pair_hash") != pair_hash(self.all[pair])):
                return None
            codes = {c[0]: c[1:] for c in json.loads(meta["codes"])}
            if set(codes) != {b.index for b in bs}:
                return None
            for b in bs:  # the proof: every bucket's bytes as the targets hold them now
                _, parts = self._base(b, targets)
                if codec.checksum(parts) != codes[b.index][2]:
                    log.info("step %d, %s: the targets do not hold base step %d; reading the full file",
                             step, describe(pair), held)
                    return None
            moved = 0
            for b in bs:
                kind, count, _ = codes[b.index]
                payload = f.get_tensor(bucket_key(b.index))
                words = self.words[(pair, b.index)]
                st, parts = self._base(b, targets)
                payload = payload.to(parts[0].device) if parts else payload
                codec.apply([codec.as_words(p, words.word) for p in parts], kind, count, words.word, payload)
                if st.staged:
                    copy_pairs(unpack_pairs(st.staged, self._slot, targets))
                moved += payload.numel()
                name = codec.KIND_NAMES[kind]
                kinds[name] = kinds.get(name, 0) + 1
        return moved
