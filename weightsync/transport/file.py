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

A framed codec (:mod:`weightsync.payload.codec`: ``frames=``, a :class:`~weightsync.payload.codec.Framing`) takes the
same path -- the same names, atomic writes, checks, waits and sweep -- only what a pair's file holds is its codec's
(:func:`forms`). A codec whose frames need no base (fp8, cast) makes them the pair's one file
(``weightsync.encoded/1``: each bucket's payload, as large as the encoder's bound, then every bucket's header in
an int64 table ``headers``, ``[buckets, 1 + Header.WORDS]``: its index, then the words). A codec whose frames need
a base each reader proves itself (delta: the files are written once for every instance) writes the plan's bytes,
which every reader can land, and, before renaming them into place, its frames beside them
(``<name>.frames``, ``weightsync.frames/1``, laid out as an encoded file); a reader takes those where its decoder
proves every header's base, else the plan's bytes.

The receiver polls the directory (``poll_s`` sleep) for its pairs' files of the step, consuming
each as it appears, in any order: it checks the metadata -- the step, the pair and the pair hash
must equal its own plan's, and the bucket count and every bucket's size must match -- unpacks every
bucket into the live tensors in place, landing it as the codec says (:func:`weightsync.payload.pack.unpacked`:
byte copies, the full codec's casts where a tensor's dtype is not the wire's; a framed file: its decoder) and
deletes the file (each pair's file has exactly one consumer). A file that fails a check is left in place for
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
from typing import BinaryIO, Callable, Iterable, Iterator, Mapping

import torch
from safetensors import safe_open

from weightsync.plan.planner import Bucket, Pair, pair_hash
from weightsync.errors import StepNotWritten, TransportError
from weightsync.transport.base import (BASE_PROOF, Buffers, Receiver, ReceiverContext, Sender, SenderContext,
                                       StepStats)
from weightsync.payload.codec import Codec, Encoder, Framing, Header, ending
from weightsync.transport.liveness import TrainerWatch
from weightsync.transport.p2p import TransferStats, describe
from weightsync.payload.pack import pack, run_landing, segments, unpack_pairs, unpacked
from weightsync.transport.private import check_own_file, owned_directory, private_opener

log = logging.getLogger("weightsync.transport.file")

FORMAT = "weightsync.file/1"  # a pair's file of the plan's bytes (the full codec; a codec with frames beside it)
ENCODED = "weightsync.encoded/1"  # a pair's file of a framed codec's frames that every reader takes (fp8, cast)
FRAMES = "weightsync.frames/1"  # frames beside a pair's file, for the readers that prove their base (delta)
FRAMES_SUFFIX = ".frames"
HEADERS = "headers"  # a framed file's table of frame headers
_NAME = re.compile(r"^\.?step(\d+)\.t(\d+)\.i(\d+)\.r(\d+)\.safetensors(\.frames)?(\..*\.tmp)?$")  # .frames: a codec's

Plans = Mapping[Pair, list[Bucket]]


def file_name(step: int, pair: Pair) -> str:
    """The final name of one pair's file of one step (what a reader waits for)."""
    return f"step{step:09d}.t{pair[0]}.i{pair[1]}.r{pair[2]}.safetensors"


def bucket_key(index: int) -> str:
    return f"bucket.{index}"


def forms(frames: Framing | None) -> tuple[str, str | None]:
    """What a pair's files hold for ``frames``' codec (None: the full codec): the format of the pair's file, and of
    the frames file beside it (None: none). Frames that need a base each reader proves go beside the plan's bytes,
    which every reader can land; any other codec's frames are the pair's one file."""
    if frames is None:
        return FORMAT, None
    if BASE_PROOF in frames.codec.needs:
        return FORMAT, FRAMES
    return ENCODED, None


def _header(fmt: str, step: int, pair: Pair, buckets: list[Bucket], sizes: Mapping[int, int],
            codec: Codec | None = None) -> bytes:
    """A safetensors header (8-byte length + JSON, space-padded to 8 bytes) for a file of ``pair``'s ``buckets``:
    ``sizes[index]`` bytes under each bucket's key (none: 0), in the plan's order, then, for a framed file
    (``codec``), the table of its frames' headers (:data:`HEADERS`: int64, a row per bucket with bytes)."""
    entries: dict[str, object] = {}
    off = 0
    for b in buckets:
        n = sizes.get(b.index, 0)
        entries[bucket_key(b.index)] = {"dtype": "U8", "shape": [n], "data_offsets": [off, off + n]}
        off += n
    meta = {"format": fmt, "step": str(step), "pair": ",".join(map(str, pair)), "pair_hash": pair_hash(buckets),
            "buckets": str(len(buckets)), "bytes": str(off)}
    if codec is not None:
        rows = sum(1 for b in buckets if b.nbytes > 0)
        n = rows * (1 + Header.WORDS) * 8
        entries[HEADERS] = {"dtype": "I64", "shape": [rows, 1 + Header.WORDS], "data_offsets": [off, off + n]}
        meta = {"format": fmt, "codec": codec.name, **meta}
    entries["__metadata__"] = meta
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _mismatch(f, fmt: str, step: int, pair: Pair, buckets: list[Bucket], codec: Codec | None) -> str | None:
    """Why the open safetensors file ``f`` is not ``pair``'s file of ``step`` in ``fmt`` for its ``buckets`` (a
    framed file: of ``codec``), or None."""
    meta = f.metadata() or {}
    want = {"format": fmt, "codec": codec.name if codec is not None else None, "step": str(step),
            "pair": ",".join(map(str, pair)), "pair_hash": pair_hash(buckets), "buckets": str(len(buckets))}
    for key, value in want.items():
        got = meta.get(key)
        if got == value:
            continue
        if key == "pair_hash":
            return (f"was planned differently: pair hash {got} != this receiver's {value} (the two ends built "
                    "different plans)")
        hint = (" (the sender runs another codec: both ends must agree on it, as on the engine's quant)"
                if key in ("format", "codec") else "")
        return f"has {key} {got!r}, expected {value!r}{hint}"
    keys, expect = set(f.keys()), {bucket_key(b.index) for b in buckets} | ({HEADERS} if codec is not None else set())
    if keys != expect:
        return f"holds buckets {sorted(keys - expect)[:4]} not planned / lacks {sorted(expect - keys)[:4]}"
    return None


def _table(rows: list[list[int]]) -> torch.Tensor:
    """The frames' headers as a framed file holds them (:data:`HEADERS`): a bucket's index, then its words."""
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 1 + Header.WORDS)


def _host(t: torch.Tensor):
    """``t``'s bytes on the host, to write."""
    return (t if t.device.type == "cpu" else t.cpu()).numpy()


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
        self._buffer: torch.Tensor | None = None  # a sender's packing buffer, a receiver's scratch: reused every step
        self.landed = False  # a receiver's: whether its last recv consumed any file (wrote into a target)

    # -- the interface shared with P2PTransport -------------------------------------------------
    def send(self, plans: Plans, tensors: Mapping[str, torch.Tensor], *, step: int | None = None,
             frames: Framing | None = None) -> TransferStats:
        """Write one file per pair of this training rank's ``send_plan`` from its live ``tensors`` (``frames``: as a
        framed codec's encoder encodes them, :func:`forms`; the step is its step).

        ``step``: the step being moved (the receivers must ask for the same one); default ``step_fn()``.
        Returns once every file is in place under its final name.
        """
        step = self._step(frames.step if frames is not None else step)
        self._check_pairs(plans)
        start = time.perf_counter()
        live = [b for bs in plans.values() for b in bs if b.nbytes > 0]
        with ending(frames):
            if frames is not None:
                frames.side.begin(step, None)  # one-sided: each reader proves its base against the published headers
            written = sum(self._write(step, pair, plans[pair], tensors, frames) for pair in sorted(plans))
        full = sum(b.nbytes for b in live) if frames is not None else 0
        return TransferStats(len(live), written, time.perf_counter() - start if plans else 0.0, full_bytes=full)

    def recv(self, plans: Plans, tensors: Mapping[str, torch.Tensor], *, step: int | None = None,
             first_s: float = 0.0, frames: Framing | None = None) -> TransferStats:
        """Wait for, check and land every pair file of this inference rank's ``recv_plan`` in place (``frames``: as a
        framed codec's decoder decodes them, :func:`forms`; the step is its step).

        ``step``: the step being moved (as the senders named it); default ``step_fn()``. Each file is
        deleted once landed (``consume``). Raises :class:`TransportError` when ``timeout_s`` passes with no new
        file, or when a file's metadata disagrees with the plan. ``first_s``: how much longer the first file may
        take (the trainers may still be training; with a ``watch`` they are watched all along):
        :class:`~weightsync.errors.StepNotWritten` after it, nothing landed (``landed`` says whether anything did).
        """
        step = self._step(frames.step if frames is not None else step)
        self._check_pairs(plans)
        self.landed = False
        held = frames.side.begin() if frames is not None else None  # from here the targets may mix two steps
        with ending(frames):
            return self._wait(step, plans, tensors, first_s, frames, held)

    def _wait(self, step: int, plans: Plans, tensors: Mapping[str, torch.Tensor], first_s: float,
              frames: Framing | None, held: int | None) -> TransferStats:
        """:meth:`recv`'s wait: each pair's file landed as it appears, in any order, within the bounds it names."""
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
                b, n = self._consume(step, pair, plans[pair], path, tensors, frames, held)
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
        full = sum(b.nbytes for bs in plans.values() for b in bs) if frames is not None else 0
        return TransferStats(buckets, nbytes, time.perf_counter() - start, full_bytes=full)

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


    def _write(self, step: int, pair: Pair, buckets: list[Bucket], tensors: Mapping[str, torch.Tensor],
               frames: Framing | None) -> int:
        """Write the pair's file of ``step`` from the live ``tensors`` (what it holds: :func:`forms`), each bucket
        packed or encoded in turn through one reusable buffer, and before renaming it into place the frames file
        beside it, if any (a reader that sees the file sees that one too); the bytes written. Frames beside the
        file are held in memory until written: a pair gets none when a bucket has no encoding (no base yet) or
        their payloads would exceed 4 of its largest bucket."""
        form, beside = forms(frames)
        side = frames.side if frames is not None else None
        live = [b for b in buckets if b.nbytes > 0]
        sizes = {b.index: side.bound(b) if form == ENCODED else b.nbytes for b in live}
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        rows: list[list[int]] = []  # the frames' headers (index, then the words)
        kept: dict[int, torch.Tensor] | None = {} if beside is not None else None  # the frames beside the file
        cap = 4 * max(sizes.values(), default=0)
        final = os.path.join(self.directory, file_name(step, pair))
        with self._putting(final, f"step {step}: writing the file of {describe(pair)} to {final}", pair) as f:
            f.write(_header(form, step, pair, buckets, sizes, frames.codec if form == ENCODED else None))
            for b in live:
                need = max(b.nbytes, side.bound(b)) if side is not None else b.nbytes  # a payload may be larger
                slot = self._packing_buffer(need, device)[:need]
                if side is None:
                    f.write(_host(pack(b, tensors, out=slot)))
                    continue
                frame = side.encode(b, tensors, slot)
                h = frame.header
                if beside is None:  # the frames are the file
                    if h.nbytes != sizes[b.index] or frame.payload is None:
                        raise TransportError(f"step {step}: the {frames.codec.name} codec encoded bucket {b.index} of "
                                             f"{describe(pair)} in {h.nbytes} bytes, not its bound {sizes[b.index]}",
                                             pair=pair, bucket=b.index)
                    f.write(_host(frame.payload[: h.nbytes]))
                    rows.append([b.index, *h.words()])
                    continue
                f.write(_host(frame.packed))  # the plan's bytes, which every reader can land
                if kept is not None and (h.whole or sum(p.numel() for p in kept.values()) + h.nbytes > cap):
                    if not h.whole:
                        log.info("step %d, %s: the payloads exceed %d bytes; no frames file this step",
                                 step, describe(pair), cap)
                    kept = None
                elif kept is not None:
                    kept[b.index] = frame.payload[: h.nbytes].cpu().clone()
                    rows.append([b.index, *h.words()])
            if form == ENCODED:
                f.write(_host(_table(rows)))
            if kept:
                with self._putting(final + FRAMES_SUFFIX, f"step {step}: writing the frames of {describe(pair)} to "
                                   f"{final}{FRAMES_SUFFIX}", pair) as g:
                    g.write(_header(beside, step, pair, buckets, {i: p.numel() for i, p in kept.items()},
                                    frames.codec))
                    for p in kept.values():
                        g.write(_host(p))
                    g.write(_host(_table(rows)))
            elif beside is not None:  # before the plan's bytes appear: an earlier try's frames of this step go
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(final + FRAMES_SUFFIX)
        return sum(sizes.values()) + sum(p.numel() for p in (kept or {}).values())

    @contextlib.contextmanager
    def _putting(self, final: str, what: str, pair: Pair) -> Iterator[BinaryIO]:
        """A file to write under a hidden temporary name beside ``final`` (0600, ``O_EXCL | O_NOFOLLOW``), renamed into
        place once written (atomic in one directory: the final name appears complete); on any failure the partial file
        is removed, and an ``OSError`` becomes a :class:`TransportError` saying ``what`` failed."""
        name = os.path.basename(final)
        tmp = os.path.join(self.directory, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb", opener=private_opener) as f:
                yield f
            os.replace(tmp, final)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, OSError):
                raise TransportError(f"{what} failed: {e}", pair=pair) from e
            raise

    def _consume(self, step: int, pair: Pair, buckets: list[Bucket], path: str, targets: Mapping[str, torch.Tensor],
                 frames: Framing | None, held: int | None) -> tuple[int, int]:
        """Check and land the pair's file of ``step`` (what it holds: :func:`forms`): the frames file beside it where
        there is one and this worker proves its base, else the file itself. Returns (buckets, bytes read)."""
        form, beside = forms(frames)
        live = [b for b in buckets if b.nbytes > 0]
        moved = None
        if beside is not None and held is not None and os.path.lexists(path + FRAMES_SUFFIX):
            moved = self._read(step, pair, buckets, path + FRAMES_SUFFIX, targets, beside, frames, held)
        if moved is None:
            moved = self._read(step, pair, buckets, path, targets, form, frames, held)
            if beside is not None:
                frames.side.whole(pair, live)
        if self.consume:
            os.unlink(path)  # consumed: each pair's file has exactly one reader
        return len(live), moved

    def _read(self, step: int, pair: Pair, buckets: list[Bucket], path: str, targets: Mapping[str, torch.Tensor],
              fmt: str, frames: Framing | None, held: int | None) -> int | None:
        """Check the file at ``path`` as ``pair``'s file of ``step`` in ``fmt`` and land it -- the plan's bytes as the
        codec lands them, or a framed codec's frames through its decoder -- returning the bytes read. A file that
        fails a check raises, naming the pair; frames beside the plan's bytes (:data:`FRAMES`) that are unusable, or
        whose base this worker does not hold, return None instead (the plan's bytes are read)."""
        def refuse(why: str, cause: Exception | None = None) -> None:
            if fmt == FRAMES:
                log.info("step %d, %s: the frames file %s %s; reading the plan's bytes", step, describe(pair),
                         path, why)
                return None
            raise TransportError(f"step {step}: the file of {describe(pair)} ({path}) {why}", peer=pair[0],
                                 pair=pair) from cause

        _refuse_foreign(step, pair, path)
        try:
            f = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            return refuse(f"cannot be read as safetensors: {e}", e)
        live = [b for b in buckets if b.nbytes > 0]
        device = next(iter(targets.values())).device if targets else torch.device("cpu")
        with f:
            why = _mismatch(f, fmt, step, pair, buckets, frames.codec if fmt != FORMAT else None)
            if why is not None:
                return refuse(why)
            if fmt == FORMAT:
                codec = frames.codec if frames is not None else self.codec
                for b in live:
                    buf = f.get_tensor(bucket_key(b.index))
                    if buf.dtype != torch.uint8 or buf.numel() != b.nbytes:
                        return refuse(f"bucket {b.index} has {buf.numel()} {buf.dtype} elements, planned {b.nbytes} "
                                      "bytes")
                    run_landing(unpacked(codec, unpack_pairs(segments(b), buf.to(device), targets)))
                return sum(b.nbytes for b in live)
            side = frames.side
            rows = f.get_tensor(HEADERS).tolist()
            if [r[0] for r in rows] != [b.index for b in live]:
                return refuse(f"holds buckets {[r[0] for r in rows][:4]}..., planned {[b.index for b in live][:4]}...")
            items = [(b, frames.codec.header(r[1:])) for b, r in zip(live, rows)]
            slot = self._packing_buffer(max((b.nbytes for b in live), default=0), device)  # the decoder's scratch
            read = side.accepts(step, held, items, targets, slot)
            if read is None:
                return refuse("holds frames whose base this worker does not hold")
            moved = 0
            for i in read:
                b, h = items[i]
                payload = f.get_tensor(bucket_key(b.index))
                if payload.dtype != torch.uint8 or payload.numel() != side.size(b, h) or h.nbytes != payload.numel():
                    return refuse(f"bucket {b.index} holds {payload.numel()} bytes, this receiver's plan "
                                  f"{side.size(b, h)} (header {h})")
                side.decode(b, h, payload.to(device), targets, slot)
                moved += payload.numel()
        return moved


# -- the transport interface (weightsync.transport.base) -------------------------------------------


class FileSender(Sender):
    """A training rank writes one file per pair and step into the job's directory.

    Elastic (the job session plans the trainers for one instance slot): a step's files are written once,
    whichever instances exist, and every instance reads them; the rank removes them once every live
    instance holds the step (``held``), and whatever is left of its own at ``close``."""

    def memory(self, ctx: SenderContext) -> Buffers:
        return Buffers(codec=self._encoder(ctx).memory() if self.options.framed else 0)

    def _encoder(self, ctx: SenderContext) -> Encoder:
        """The codec's encoder for this rank (framed codecs: :mod:`weightsync.codec`), made once."""
        if getattr(self, "encoder", None) is None:
            self.encoder = self.options.codec.encoder(ctx.plans, next(iter(ctx.tensors.values())).device)
        return self.encoder

    def connect(self, ctx: SenderContext) -> None:
        self.transport = FileTransport(self.options.directory, timeout_s=self.options.timeout_s)
        self.plans, self.tensors = ctx.plans, ctx.tensors
        self.encoder = self._encoder(ctx) if self.options.framed else None

    def send(self, step: int) -> StepStats:
        frames = Framing(step, self.encoder, self.options.codec) if self.encoder is not None else None
        with torch.no_grad():
            return self.transport.send(self.plans, self.tensors, step=step, frames=frames)

    def held(self, step: int) -> None:
        self.transport.sweep(step + 1, pairs=self.plans)

    def close(self) -> None:
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.sweep(1 << 62, pairs=self.plans)


class FileReceiver(Receiver):
    """An inference worker waits for its pairs' files of the step and lands them in place.

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
        self.decoder = self.options.codec.decoder(self.plans) if self.options.framed else None

    def receive(self, step: int, targets: Mapping[str, torch.Tensor]) -> StepStats:
        frames = Framing(step, self.decoder, self.options.codec) if self.decoder is not None else None
        return self.transport.recv(self.plans, targets, step=step, first_s=self.options.written_timeout_s,
                                   frames=frames)

    def landed(self) -> bool:
        return self.transport.landed


def _refuse_foreign(step: int, pair: Pair, path: str) -> None:
    """Raise :class:`TransportError` unless ``path`` is a regular file of this user that no one else can write: a
    link or another user's file was not written by this job's trainers (the directory is this user's alone,
    :func:`~weightsync.transport.private.owned_directory`, so one here means something is wrong)."""
    why = check_own_file(path)
    if why is not None:
        raise TransportError(f"step {step}: the file of {describe(pair)} ({path}) {why}: refused, not read (only "
                             "files this user wrote, that no one else can write, are loaded)", peer=pair[0], pair=pair)
