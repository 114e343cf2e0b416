"""File transport: a plan's buckets moved through a directory of safetensors files.

The simple, debuggable fallback to :mod:`weightsync.transport.p2p`, with the same interface
(``send(plans, tensors)`` / ``recv(plans, tensors)`` -> :class:`TransferStats`, failures raise
:class:`TransportError`), so :class:`~weightsync.runtime.writer.WeightWriter` and
:class:`~weightsync.runtime.reader.WeightReader` can use either. It needs no process group: only a
directory both sides see (local disk, tmpfs such as ``/dev/shm``, or a shared mount).

The step. Both ends must name the step being moved, since files of several steps may sit in the
directory at once (an async writer may run ahead of a reader): pass ``step=`` to ``send``/``recv``,
or give the transport a ``step_fn`` (a zero-argument callable returning the current step) that is
consulted when ``step`` is omitted, so a caller can keep the P2P call shape.

One file per (pair, step). For every pair ``(src rank, dst instance, dst rank)`` of its send plan,
the sender writes ``step{step:09d}.t{src}.i{instance}.r{rank}.safetensors`` holding each bucket's
packed uint8 buffer (:func:`weightsync.payload.pack.pack`) under the key ``bucket.{index}``, plus
metadata: format, step, pair, the pair hash (:func:`weightsync.plan.planner.pair_hash`), the bucket
count and total bytes. The file is streamed bucket by bucket through one reusable buffer (memory
is bounded by the largest bucket, not the pair) into a hidden temporary name in the same directory
and then ``os.replace``-d into place, so a reader never sees a partial file: a name that exists is
complete. A file that already has the final name (an earlier run's, left by a crash) is overwritten.

The receiver polls the directory (``poll_s`` sleep) for its pairs' files of the step, consuming
each as it appears, in any order: it checks the metadata -- the step, the pair and the pair hash
must equal its own plan's, and the bucket count and every bucket's size must match -- unpacks every
bucket into the live tensors in place, landing it as the codec says (:func:`weightsync.payload.pack.unpacked`:
byte copies, the full codec's casts where a tensor's dtype is not the wire's) and deletes the
file (each pair's file has exactly one consumer). A file that fails a check is left in place for
inspection and raises :class:`TransportError` naming the pair. If ``timeout_s`` passes with no new
file arriving, it raises a :class:`TransportError` naming the missing pair(s); sooner, with a ``watch``
(a job's receivers have one: :mod:`weightsync.transport.liveness`), once a training rank whose file is
missing is gone or stopped (a ``TrainerLost`` naming it, within seconds). Files of other steps
are ignored (:meth:`FileTransport.sweep` removes old ones).

Caveat: the step is the only thing telling one run's files from another's. Give every run (job) its
own directory, or never reuse step numbers in one directory, or a reader may consume a stale file
of the same step left by a crashed earlier run (its pair hash still has to match).

After a failed ``recv`` the destination tensors may mix two steps (some pairs unpacked, some not),
exactly as after a failed P2P receive.

The directory is this user's alone. Whoever can write it can plant the weights a reader loads or delete the
trainer's, so a directory another user owns, or one group or others can write (0777, sticky or not), is
refused with a :class:`~weightsync.errors.ConfigError` saying what to do; one that does not exist is created
0700 (:func:`~weightsync.transport.private.owned_directory`). Files are created 0600 with ``O_EXCL |
O_NOFOLLOW`` (a file or link planted at a temporary name is refused, not written through), and a file is
read only if it is a regular file of this user that no one else can write (a link is never followed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import struct
import time
import uuid
from typing import Callable, Iterable, Iterator, Mapping

import torch
from safetensors import safe_open

from weightsync.plan.planner import Bucket, Pair, pair_hash
from weightsync.errors import StepNotWritten, TransportError
from weightsync.transport.base import (BASE_PROOF, Buffers, Receiver, ReceiverContext, Sender, SenderContext,
                                       StepStats)
from weightsync.payload.codec import Codec
from weightsync.transport.liveness import TrainerWatch
from weightsync.transport.p2p import TransferStats, describe
from weightsync.payload.pack import pack, run_landing, segments, unpack_pairs, unpacked
from weightsync.transport.private import check_own_file, owned_directory, private_opener

log = logging.getLogger("weightsync.transport.file")

FORMAT = "weightsync.file/1"
_NAME = re.compile(r"^\.?step(\d+)\.t(\d+)\.i(\d+)\.r(\d+)\.safetensors(\.frames)?(\..*\.tmp)?$")  # .frames: a codec's
FRAMES = "weightsync.frames/1"
FRAMES_SUFFIX = ".frames"
ENCODED = "weightsync.encoded/1"  # a pair's file of payloads that need no base (FP8), with their headers

Plans = Mapping[Pair, list[Bucket]]


def file_name(step: int, pair: Pair) -> str:
    """The final name of one pair's file of one step (what a reader waits for)."""
    return f"step{step:09d}.t{pair[0]}.i{pair[1]}.r{pair[2]}.safetensors"


def bucket_key(index: int) -> str:
    return f"bucket.{index}"


def _encoded_header(step: int, pair: Pair, buckets: list[Bucket], live: list[Bucket], sizes: list[int],
                    words: int, codec: str) -> bytes:
    """The safetensors header of a file of encoded payloads (:meth:`FileTransport._write_encoded`)."""
    entries: dict[str, object] = {}
    off = 0
    for b, n in zip(live, sizes):
        entries[bucket_key(b.index)] = {"dtype": "U8", "shape": [n], "data_offsets": [off, off + n]}
        off += n
    n = len(live) * (1 + words) * 8
    entries["headers"] = {"dtype": "I64", "shape": [len(live), 1 + words], "data_offsets": [off, off + n]}
    entries["__metadata__"] = {"format": ENCODED, "codec": codec, "step": str(step), "pair": ",".join(map(str, pair)),
                               "pair_hash": pair_hash(buckets), "buckets": str(len(buckets)), "bytes": str(off)}
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _header(step: int, pair: Pair, buckets: list[Bucket], digest: str) -> bytes:
    """A safetensors header (8-byte length + JSON, space-padded to 8 bytes) for the pair's buckets."""
    entries: dict[str, object] = {}
    off = 0
    for b in buckets:
        entries[bucket_key(b.index)] = {"dtype": "U8", "shape": [b.nbytes], "data_offsets": [off, off + b.nbytes]}
        off += b.nbytes
    entries["__metadata__"] = {
        "format": FORMAT,
        "step": str(step),
        "pair": ",".join(map(str, pair)),
        "pair_hash": digest,
        "buckets": str(len(buckets)),
        "bytes": str(off),
    }
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class FileTransport:
    """Sends or receives one rank's buckets through ``directory``; keep one per rank, reuse every step.

    ``step_fn``: returns the current step when ``send``/``recv`` get no ``step=``. ``timeout_s``: how
    long a receiver waits with no new file arriving before it gives up. ``poll_s``: the receiver's
    sleep between looks at the directory. ``codec``: how a receiver's unpacked buckets land
    (:meth:`~weightsync.payload.codec.Codec.unpacked`: the full codec's casts where a tensor's dtype is not
    the wire's); None: byte copies only, a cast refused.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        step_fn: Callable[[], int] | None = None,
        *,
        timeout_s: float = 60.0,
        poll_s: float = 0.01,
        consume: bool = True,
        watch: TrainerWatch | None = None,
        total_s: float | None = None,
        codec: Codec | None = None,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if poll_s < 0:
            raise ValueError(f"poll_s must not be negative, got {poll_s}")
        #: the real path, once checked: no other user can write it (weightsync.transport.private.owned_directory)
        self.directory = owned_directory(directory, "file transport's directory")
        self.step_fn, self.timeout_s, self.poll_s = step_fn, timeout_s, poll_s
        self.consume = consume  # False: files are shared by every instance and swept by their writer
        #: a receiver's: whether the training ranks whose files it waits for are alive (asked once nothing
        #: arrived for a while): a trainer killed or stopped mid-step ends the wait in seconds, naming it
        self.watch = watch
        #: a receive's whole budget, however steadily files arrive (a job's receivers: ``timeout_s``, so a
        #: worker's call returns before the engine's RPC deadline); None: only ``timeout_s`` without a new file
        self.total_s = total_s
        self.codec = codec
        self._buffer: torch.Tensor | None = None  # the sender's packing buffer, reused every step
        self.landed = False  # a receiver's: whether its last recv consumed any file (wrote into a target)

    # -- the interface shared with P2PTransport -------------------------------------------------
    def send(self, plans: Plans, tensors: Mapping[str, torch.Tensor], *, step: int | None = None) -> TransferStats:
        """Write one file per pair of this training rank's ``send_plan``, packed from its live ``tensors``.

        ``step``: the step being moved (the receivers must ask for the same one); default ``step_fn()``.
        Returns once every file is in place under its final name.
        """
        step = self._step(step)
        self._check_pairs(plans)
        start = time.perf_counter()
        buckets = nbytes = 0
        for pair in sorted(plans):
            bs = plans[pair]
            self._write(step, pair, bs, tensors)
            buckets += sum(1 for b in bs if b.nbytes > 0)
            nbytes += sum(b.nbytes for b in bs)
        return TransferStats(buckets, nbytes, time.perf_counter() - start if plans else 0.0)

    def recv(self, plans: Plans, tensors: Mapping[str, torch.Tensor], *, step: int | None = None,
             consume: Callable[[Pair, str], tuple[int, int]] | None = None, first_s: float = 0.0) -> TransferStats:
        """Wait for, check and unpack every pair file of this inference rank's ``recv_plan`` in place.

        ``step``: the step being moved (as the senders named it); default ``step_fn()``. Each file is
        deleted once unpacked. Raises :class:`TransportError` when ``timeout_s`` passes with no new
        file, or when a file's metadata disagrees with the plan. ``first_s``: how much longer the first file may
        take (the trainers may still be training; with a ``watch`` they are watched all along):
        :class:`~weightsync.errors.StepNotWritten` after it, nothing landed (``landed`` says whether anything did).
        """
        step = self._step(step)
        self._check_pairs(plans)
        self.landed = False
        if not plans:
            return TransferStats(0, 0, 0.0)
        start = time.perf_counter()
        pending = {pair: os.path.join(self.directory, file_name(step, pair)) for pair in sorted(plans)}
        began = last_progress = looked = time.monotonic()
        since = time.time() - 1.0  # (file times are wall times; a second of slack for coarse clocks)
        buckets = nbytes = 0
        while pending:
            if self.landed and self.total_s is not None and time.monotonic() - began > self.total_s:
                missing = sorted(pending)
                raise TransportError(
                    f"step {step}: {len(missing)} pair file(s) still missing ({describe(missing[0])}, "
                    f"{file_name(step, missing[0])}, ...) in {self.directory} {self.total_s:g}s after its first file "
                    "arrived, though files kept arriving: the trainers write slower than the timeout allows (raise "
                    "timeout_s)", peer=missing[0][0], pair=missing[0])
            arrived = [pair for pair, path in pending.items() if os.path.lexists(path)]
            for pair in arrived:
                path = pending.pop(pair)
                _refuse_foreign(step, pair, path)  # before anything counts as landed: a refused file moved no byte
                if not self.landed:  # the step began: the transfer's own bounds count from here
                    self.landed, began = True, time.monotonic()
                b, n = (self._consume(step, pair, plans[pair], path, tensors, self.codec) if consume is None
                        else consume(pair, path))
                buckets, nbytes = buckets + b, nbytes + n
            if arrived:
                last_progress = time.monotonic()
                continue
            idle = time.monotonic() - last_progress
            if self.watch is not None and idle >= self.watch.look_s:
                gone = self.watch.lost({pair[0] for pair in pending}, idle)
                if gone is not None:
                    pair = min(p for p in pending if p[0] == gone.rank)
                    raise gone.error(f"step {step}: waiting for the file of {describe(pair)} ({file_name(step, pair)}) "
                                     f"in {self.directory}", pair=pair)
            if not self.landed and idle > self.timeout_s and time.monotonic() - looked >= 1.0:
                looked = time.monotonic()  # past the transfer's bound, waiting for trainers: have they moved on?
                later = self._later_step(step, since)
                if later is not None:
                    missing = sorted(pending)
                    raise TransportError(
                        f"step {step}: the trainers already wrote step {later} into {self.directory} and no file of "
                        f"step {step} is there for {describe(missing[0])}: they moved on past it (this reader fell "
                        "behind: paused, or dropped by the trainers); nothing of it was received",
                        peer=missing[0][0], pair=missing[0])
            if idle > self.timeout_s + (0.0 if self.landed else first_s):
                missing = sorted(pending)
                names = "; ".join(f"{describe(p)} ({file_name(step, p)})" for p in missing[:4])
                more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
                where = f"step {step}: no file for {names}{more} in {self.directory}"
                if not self.landed:  # nothing of the step came: it was never written, and nothing was touched
                    raise StepNotWritten(
                        f"{where} within {idle:.0f} s (written_timeout_s {first_s:g} s + timeout_s "
                        f"{self.timeout_s:g} s), so nothing of it was received (is a trainer on this step?)",
                        peer=missing[0][0], pair=missing[0])
                raise TransportError(
                    f"{where} after waiting {self.timeout_s:g}s with nothing new arriving (is the sender alive and "
                    "on this step?)", peer=missing[0][0], pair=missing[0])
            time.sleep(self.poll_s)
        return TransferStats(buckets, nbytes, time.perf_counter() - start)

    def _later_step(self, step: int, since: float) -> int | None:
        """The newest step after ``step`` with a (final) file in the directory, for any instance, written after
        ``since`` (wall time: an earlier job's leftovers do not count), or None: how a receive waiting for a step's
        first file learns the trainers are past it (they write steps in order; an instance they dropped gets no file
        of the later steps, the others do)."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return None
        later = None
        for m in map(_NAME.match, names):
            if m is None or m.group(5) or m.group(6) or m.group(0).startswith(".") or int(m.group(1)) <= step:
                continue
            try:
                fresh = os.lstat(os.path.join(self.directory, m.group(0))).st_mtime >= since
            except OSError:  # consumed or swept meanwhile
                continue
            if fresh and (later is None or int(m.group(1)) > later):
                later = int(m.group(1))
        return later

    # -- frames (a framed codec: weightsync.codec) ------------------------------------------------
    def send_frames(self, step: int, plans: Plans, tensors: Mapping[str, torch.Tensor], encoder, codec, *,
                    cap_bytes: int | None = None) -> TransferStats:
        """Write, per pair, the full file as :meth:`send` does and, beside it, a *frames file*
        ``<full name>.frames``: every bucket's payload and header (with the base it was encoded against
        and that base's checksum, which each reader proves itself: the files are written once for every
        instance). The frames file is written first and the full file renamed into place after it, so a
        reader that sees the full file sees the frames file too (when there is one). A pair gets no
        frames file when a bucket has no encoding (no base yet), or when its payloads, held in memory
        until written, would exceed ``cap_bytes`` (default: 4 of the pair's largest bucket)."""
        step = self._step(step)
        self._check_pairs(plans)
        start = time.perf_counter()
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        encoder.begin(step, None)
        written = full = count = 0
        alone = BASE_PROOF not in codec.needs  # every payload stands alone (FP8): it is the pair's one file
        try:
            for pair in sorted(plans):
                if alone:
                    w, f, c = self._write_encoded(step, pair, plans[pair], tensors, encoder, codec, device)
                    written, full, count = written + w, full + f, count + c
                    continue
                w, f, c = self._write_frames(step, pair, plans[pair], tensors, encoder, codec, device, cap_bytes)
                written, full, count = written + w, full + f, count + c
            encoder.end(step)
        except BaseException:
            encoder.fail()
            raise
        return TransferStats(count, written, time.perf_counter() - start, full_bytes=full)

    def _write_frames(self, step: int, pair: Pair, buckets: list[Bucket], tensors: Mapping[str, torch.Tensor],
                      encoder, codec, device: torch.device, cap_bytes: int | None) -> tuple[int, int, int]:
        final = os.path.join(self.directory, file_name(step, pair))
        tmp = os.path.join(self.directory, f".{file_name(step, pair)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        live = [b for b in buckets if b.nbytes > 0]
        cap = cap_bytes if cap_bytes is not None else 4 * max((b.nbytes for b in live), default=0)
        payloads: dict[str, torch.Tensor] | None = {}
        headers: list[list[int]] = []
        held = 0
        full = sum(b.nbytes for b in live)
        with _replacing(tmp, f"step {step}: writing the files of {describe(pair)} to {self.directory}", pair):
            with open(tmp, "wb", opener=private_opener) as f:
                f.write(_header(step, pair, buckets, pair_hash(buckets)))
                for b in live:
                    need = max(b.nbytes, encoder.bound(b))  # the packed bucket, or a larger payload written there
                    frame = encoder.encode(b, tensors, self._packing_buffer(need, device)[:need])
                    f.write((frame.packed if frame.packed.device.type == "cpu" else frame.packed.cpu()).numpy())
                    if payloads is None:
                        continue
                    held += frame.header.nbytes
                    if frame.header.whole or held > cap:
                        if not frame.header.whole:
                            log.info("step %d, %s: the payloads exceed %d bytes; no frames file this step",
                                     step, describe(pair), cap)
                        payloads = None
                        continue
                    payloads[bucket_key(b.index)] = frame.payload[: frame.header.nbytes].cpu().clone()
                    headers.append([b.index, *frame.header.words()])
            if payloads is not None and live:
                self._save_frames(step, pair, buckets, payloads, headers, codec)
            os.replace(tmp, final)  # after the frames file: a reader seeing this sees that
        framed = sum(p.numel() for p in payloads.values()) if payloads is not None else 0
        return full + framed, full, len(live)

    def _write_encoded(self, step: int, pair: Pair, buckets: list[Bucket], tensors: Mapping[str, torch.Tensor],
                       encoder, codec, device: torch.device) -> tuple[int, int, int]:
        """A codec whose payloads need no base (FP8): the pair's file holds each bucket's payload as the codec
        encoded it (its size the encoder's bound, a pure function of the plan) and, after them, every bucket's
        header (``headers``, int64 ``[buckets, 1 + Header.WORDS]``: index, then the words), streamed through
        one buffer as :meth:`send` streams the packed buckets; there is no full file to fall back on (the bytes
        of the plan would not land in the engine's form)."""
        final = os.path.join(self.directory, file_name(step, pair))
        tmp = os.path.join(self.directory, f".{file_name(step, pair)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        live = [b for b in buckets if b.nbytes > 0]
        sizes = [encoder.bound(b) for b in live]
        words = codec.header_words  # the words a payload that needs no base has (kind, count, bytes)
        with _replacing(tmp, f"step {step}: writing the file of {describe(pair)} to {self.directory}", pair):
            with open(tmp, "wb", opener=private_opener) as f:
                f.write(_encoded_header(step, pair, buckets, live, sizes, words, codec.name))
                rows = []
                for b, n in zip(live, sizes):
                    frame = encoder.encode(b, tensors, self._packing_buffer(max(n, b.nbytes), device))
                    if frame.header.nbytes != n or frame.payload is None:
                        raise TransportError(f"step {step}: the {codec.name} codec encoded bucket {b.index} of "
                                             f"{describe(pair)} in {frame.header.nbytes} bytes, not its bound {n}",
                                             pair=pair, bucket=b.index)
                    payload = frame.payload[:n]
                    f.write((payload if payload.device.type == "cpu" else payload.cpu()).numpy())
                    rows.append([b.index, *frame.header.words(words)])
                f.write(torch.tensor(rows, dtype=torch.int64).reshape(len(live), 1 + words).numpy().tobytes())
            os.replace(tmp, final)
        return sum(sizes), sum(b.nbytes for b in live), len(live)

    def _read_encoded(self, step: int, pair: Pair, buckets: list[Bucket], path: str,
                      targets: Mapping[str, torch.Tensor], slot: torch.Tensor, decoder, codec) -> tuple[int, int]:
        """Check and decode a file :meth:`_write_encoded` wrote; bytes read."""
        def bad(why: str) -> TransportError:
            return TransportError(f"step {step}: the file of {describe(pair)} ({path}) {why}", peer=pair[0], pair=pair)

        live = [b for b in buckets if b.nbytes > 0]
        device = next(iter(targets.values())).device if targets else torch.device("cpu")
        _refuse_foreign(step, pair, path)
        try:
            f = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise bad(f"cannot be read as safetensors: {e}") from e
        with f:
            meta = f.metadata() or {}
            for key, want in (("format", ENCODED), ("codec", codec.name), ("step", str(step)),
                              ("pair", ",".join(map(str, pair))), ("pair_hash", pair_hash(buckets))):
                if meta.get(key) != want:
                    raise bad(f"has {key} {meta.get(key)!r}, expected {want!r}"
                              + (" (the two ends built different plans)" if key == "pair_hash" else "")
                              + (" (the sender runs another codec: both ends must agree on the engine's quant)"
                                 if key in ("format", "codec") else ""))
            rows = f.get_tensor("headers").tolist()
            if [r[0] for r in rows] != [b.index for b in live]:
                raise bad(f"holds buckets {[r[0] for r in rows][:4]}..., planned {[b.index for b in live][:4]}...")
            moved = 0
            for b, r in zip(live, rows):
                h = codec.header(r[1:])
                payload = f.get_tensor(bucket_key(b.index))
                if payload.dtype != torch.uint8 or payload.numel() != decoder.size(b, h) or h.nbytes != payload.numel():
                    raise bad(f"bucket {b.index} holds {payload.numel()} bytes, this receiver's plan "
                              f"{decoder.size(b, h)} (header {h})")
                decoder.decode(b, h, payload.to(device) if payload.device != device else payload, targets, slot)
                moved += payload.numel()
        return len(live), moved

    def _save_frames(self, step: int, pair: Pair, buckets: list[Bucket], payloads: dict[str, torch.Tensor],
                     headers: list[list[int]], codec) -> None:
        from safetensors.torch import save

        final = os.path.join(self.directory, file_name(step, pair) + FRAMES_SUFFIX)
        tmp = os.path.join(self.directory, f".{file_name(step, pair)}{FRAMES_SUFFIX}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        meta = {"format": FRAMES, "codec": codec.name, "step": str(step), "pair": ",".join(map(str, pair)),
                "pair_hash": pair_hash(buckets), "headers": json.dumps(headers)}
        try:
            data = save(payloads, metadata=meta)  # held in memory anyway (bounded by cap_bytes); 0600, O_EXCL below
            with open(tmp, "wb", opener=private_opener) as f:
                f.write(data)
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def recv_frames(self, step: int, plans: Plans, targets: Mapping[str, torch.Tensor], decoder, codec) -> TransferStats:
        """Read each pair's frames file when ``decoder`` proves every header's base (:meth:`send_frames`),
        else its full file: the fall-back needs no round trip. Bytes moved are the bytes read."""
        step = self._step(step)
        held = decoder.begin()  # from here the targets may mix two steps
        device = next(iter(targets.values())).device if targets else torch.device("cpu")
        largest = max((b.nbytes for bs in plans.values() for b in bs), default=0)
        if self._buffer is None or self._buffer.numel() < largest or self._buffer.device != device:
            self._buffer = torch.empty(largest, dtype=torch.uint8, device=device)
        slot = self._buffer

        def consume(pair: Pair, path: str) -> tuple[int, int]:
            if BASE_PROOF not in codec.needs:  # payloads that stand alone (FP8): the file holds nothing else
                return self._read_encoded(step, pair, plans[pair], path, targets, slot, decoder, codec)
            live = [b for b in plans[pair] if b.nbytes > 0]
            moved = self._read_frames(step, held, pair, plans[pair], live, targets, slot, decoder, codec)
            if moved is None:
                _, moved = self._consume(step, pair, plans[pair], path, targets, codec)
                decoder.whole(pair, live)
            return len(live), moved

        try:
            stats = self.recv(plans, targets, step=step, consume=consume)
        except BaseException:
            decoder.fail()
            raise
        decoder.end(step)
        full = sum(b.nbytes for bs in plans.values() for b in bs)
        return TransferStats(stats.buckets, stats.bytes, stats.seconds, full_bytes=full)

    def _read_frames(self, step: int, held: int | None, pair: Pair, buckets: list[Bucket], live: list[Bucket],
                     targets: Mapping[str, torch.Tensor], slot: torch.Tensor, decoder, codec) -> int | None:
        """Decode the pair's frames file in place and return its bytes, or None when there is none or
        the decoder does not prove its bases (then the full file is read)."""
        path = os.path.join(self.directory, file_name(step, pair) + FRAMES_SUFFIX)
        if (held is None and BASE_PROOF in codec.needs) or not os.path.lexists(path):
            return None
        _refuse_foreign(step, pair, path)
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if (meta.get("format") != FRAMES or meta.get("codec") != codec.name or meta.get("step") != str(step)
                    or meta.get("pair_hash") != pair_hash(buckets)):
                return None
            got = {h[0]: codec.header(h[1:]) for h in json.loads(meta["headers"])}
            if set(got) != {b.index for b in live}:
                return None
            items = [(b, got[b.index]) for b in live]
            read = decoder.accepts(step, held, items, targets, slot)
            if read is None:
                log.info("step %d, %s: this reader does not hold the frames' base; reading the full file",
                         step, describe(pair))
                return None
            moved = 0
            for i in read:
                b, h = items[i]
                payload = f.get_tensor(bucket_key(b.index))
                decoder.decode(b, h, payload, targets, slot)
                moved += payload.numel()
        return moved

    def sweep(self, before_step: int, pairs: Iterable[Pair] | None = None) -> int:
        """Delete files (final and temporary) of steps earlier than ``before_step``; return how many.

        ``pairs``: only those pairs' files (e.g. a receiver's own plan, which is safe while other
        receivers still lag behind: each pair's file has one consumer); None: every pair's.
        """
        only = None if pairs is None else {tuple(p) for p in pairs}
        removed = 0
        for name in os.listdir(self.directory):
            m = _NAME.match(name)
            if not m or int(m.group(1)) >= before_step:
                continue
            if only is None or (int(m.group(2)), int(m.group(3)), int(m.group(4))) in only:
                try:
                    os.unlink(os.path.join(self.directory, name))
                    removed += 1
                except FileNotFoundError:
                    pass
        return removed

    # -- internals ------------------------------------------------------------------------------
    def _step(self, step: int | None) -> int:
        if step is None:
            if self.step_fn is None:
                raise ValueError("FileTransport needs the step: pass step= or construct it with a step_fn")
            step = self.step_fn()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        return step

    @staticmethod
    def _check_pairs(plans: Plans) -> None:
        for pair, bs in plans.items():
            for b in bs:
                if b.pair != tuple(pair):
                    raise TransportError(f"plan of {describe(pair)} holds bucket {b.index} of another pair", pair=pair)

    def _packing_buffer(self, need: int, device: torch.device) -> torch.Tensor:
        have = self._buffer
        if have is None or have.numel() < need or have.device != device:
            self._buffer = have = torch.empty(need, dtype=torch.uint8, device=device)
        return have

    def _write(self, step: int, pair: Pair, buckets: list[Bucket], tensors: Mapping[str, torch.Tensor]) -> None:
        final = os.path.join(self.directory, file_name(step, pair))
        tmp = os.path.join(self.directory, f".{file_name(step, pair)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        with _replacing(tmp, f"step {step}: writing the file of {describe(pair)} to {final}", pair):
            with open(tmp, "wb", opener=private_opener) as f:
                f.write(_header(step, pair, buckets, pair_hash(buckets)))
                for b in buckets:
                    if b.nbytes == 0:
                        continue
                    buf = pack(b, tensors, out=self._packing_buffer(b.nbytes, device)[: b.nbytes])
                    host = buf if buf.device.type == "cpu" else buf.cpu()
                    f.write(host.numpy())
            os.replace(tmp, final)  # atomic in one directory: the final name appears complete

    def _consume(
        self, step: int, pair: Pair, buckets: list[Bucket], path: str, tensors: Mapping[str, torch.Tensor],
        codec: Codec | None,
    ) -> tuple[int, int]:
        """Check and land the pair's full file (its buckets as ``codec`` lands the plan's bytes)."""
        def bad(why: str, cause: Exception | None = None) -> TransportError:
            err = TransportError(f"step {step}: the file of {describe(pair)} ({path}) {why}", peer=pair[0], pair=pair)
            err.__cause__ = cause
            return err

        _refuse_foreign(step, pair, path)
        try:
            f = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise bad(f"cannot be read as safetensors: {e}", e) from e
        with f:
            meta = f.metadata() or {}
            want_hash = pair_hash(buckets)
            checks = [
                ("format", FORMAT),
                ("step", str(step)),
                ("pair", ",".join(map(str, pair))),
                ("pair_hash", want_hash),
                ("buckets", str(len(buckets))),
            ]
            for key, want in checks:
                got = meta.get(key)
                if got != want:
                    if key == "pair_hash":
                        raise bad(f"was planned differently: pair hash {got} != this receiver's {want} "
                                  "(the two ends built different plans)")
                    raise bad(f"has {key} {got!r}, expected {want!r}")
            keys = set(f.keys())
            expect = {bucket_key(b.index) for b in buckets}
            if keys != expect:
                raise bad(f"holds buckets {sorted(keys - expect)[:4]} not planned / lacks {sorted(expect - keys)[:4]}")
            device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
            count = nbytes = 0
            for b in buckets:
                if b.nbytes == 0:
                    continue
                buf = f.get_tensor(bucket_key(b.index))
                if buf.dtype != torch.uint8 or buf.numel() != b.nbytes:
                    raise bad(f"bucket {b.index} has {buf.numel()} {buf.dtype} elements, planned {b.nbytes} bytes")
                if buf.device != device:
                    buf = buf.to(device)
                run_landing(unpacked(codec, unpack_pairs(segments(b), buf, tensors)))
                count, nbytes = count + 1, nbytes + b.nbytes
        if self.consume:
            os.unlink(path)  # consumed: each pair's file has exactly one reader
        return count, nbytes


# -- the transport interface (weightsync.transport.base) -------------------------------------------


class FileSender(Sender):
    """A training rank writes one file per pair and step into the job's directory.

    Elastic (the job session plans the trainers for one instance slot): a step's files are written once,
    whichever instances exist, and every instance reads them; the rank removes them once every live
    instance holds the step (``held``), and whatever is left of its own at ``close``."""

    def memory(self, ctx: SenderContext) -> Buffers:
        return Buffers(codec=self._encoder(ctx).memory() if self.options.framed else 0)

    def _encoder(self, ctx: SenderContext):
        """The codec's encoder for this rank (framed codecs: :mod:`weightsync.codec`), made once."""
        if getattr(self, "encoder", None) is None:
            self.encoder = self.options.codec.encoder(ctx.plans, next(iter(ctx.tensors.values())).device)
        return self.encoder

    def connect(self, ctx: SenderContext) -> None:
        self.transport = FileTransport(self.options.directory, timeout_s=self.options.timeout_s)
        self.plans, self.tensors = ctx.plans, ctx.tensors
        self.encoder = None
        if self.options.framed:  # a frames file beside each full file
            self._encoder(ctx)

    def send(self, step: int) -> StepStats:
        with torch.no_grad():
            if self.encoder is not None:
                return self.transport.send_frames(step, self.plans, self.tensors, self.encoder, self.options.codec)
            return self.transport.send(self.plans, self.tensors, step=step)

    def held(self, step: int) -> None:
        self.transport.sweep(step + 1, pairs=self.plans)

    def close(self) -> None:
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.sweep(1 << 62, pairs=self.plans)


class FileReceiver(Receiver):
    """An inference worker waits for its pairs' files of the step and unpacks them in place.

    Every instance reads the files written for instance slot 0 (the trainers write each step once) with
    that slot's plan, which lands in exactly the regions its own plan names; it leaves them in place. A
    trainer killed or stopped before its files are whole is noticed by ``ctx.watch`` in seconds."""

    watches_trainers = True  # a file that never comes breaks nothing
    waits_for_step = True  # sync: the step's first file may come written_timeout_s late (the trainers train)

    def connect(self, ctx: ReceiverContext) -> None:
        self.plans = ctx.plans if ctx.instance == 0 else ctx.planner.recv_plan(0, ctx.rank)
        if ctx.watch is not None:
            ctx.watch.connect({pair[0] for pair in self.plans}, self.options.timeout_s)
        self.transport = FileTransport(self.options.directory, timeout_s=self.options.timeout_s, consume=False,
                                       watch=ctx.watch, total_s=self.options.timeout_s, codec=self.options.codec)
        # the frames file when this worker proves its base, else the full file
        self.decoder = self.options.codec.decoder(self.plans) if self.options.framed else None

    def receive(self, step: int, targets: Mapping[str, torch.Tensor]) -> StepStats:
        if self.decoder is not None:
            return self.transport.recv_frames(step, self.plans, targets, self.decoder, self.options.codec)
        return self.transport.recv(self.plans, targets, step=step, first_s=self.options.written_timeout_s)

    def landed(self) -> bool:
        # a framed receive (delta) does not say: it may have
        return self.decoder is not None or self.transport.landed


def _refuse_foreign(step: int, pair: Pair, path: str) -> None:
    """Raise :class:`TransportError` unless ``path`` is a regular file of this user that no one else can write: a
    link or another user's file was not written by this job's trainers (the directory is this user's alone,
    :func:`~weightsync.transport.private.owned_directory`, so one here means something is wrong)."""
    why = check_own_file(path)
    if why is not None:
        raise TransportError(f"step {step}: the file of {describe(pair)} ({path}) {why}: refused, not read (only "
                             "files this user wrote, that no one else can write, are loaded)", peer=pair[0], pair=pair)


@contextlib.contextmanager
def _replacing(tmp: str, what: str, pair: Pair) -> Iterator[None]:
    """Around writing ``tmp`` and renaming it into place: on any failure the partial file is removed, and an
    ``OSError`` becomes a :class:`TransportError` saying ``what`` failed (other errors pass as they are)."""
    try:
        yield
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise TransportError(f"{what} failed: {e}", pair=pair) from e
        raise
