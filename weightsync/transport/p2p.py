"""Point-to-point transport: a rank's planned buckets moved over a process group with isend/irecv.

Each bucket travels as a few messages (see :mod:`weightsync.payload.pack`): a large segment that
lies contiguous in the live tensor is sent from it, or received into it, in place; the rest is
packed into a buffer by the sender and unpacked from one by the receiver. Gloo needs contiguous
tensors (a non-contiguous send fails on the sender and leaves the receiver hanging), so only
contiguous views are ever posted. With ``coalesce`` (NCCL, sync jobs) a bucket's messages go as one
NCCL group: one operation to wait for, NCCL's per-message cost paid once.

Memory is bounded: a rank holds ``window`` buffers, each as large as the most any bucket stages
(at most its largest bucket, which the planner's bucket budget bounds), allocated once and reused
by every later step. At most ``window`` buckets are outstanding per rank; packing bucket k overlaps
the transfer of bucket k-1.

Deadlock freedom. Every rank walks its own buckets in ONE global order, the key
``(bucket.index, src_rank, dst_instance, dst_rank)``, which both ends of a pair compute identically
from the plan, and keeps a FIFO of at most ``window`` outstanding operations: it posts operation k
only after operation k-window has completed. Take the globally earliest transfer T that has not
completed. On T's sender, every operation before T in its order is globally earlier than T, hence
completed; so the sender's FIFO drains down to T and T is posted. The same holds on T's receiver.
So T is posted on both ends, and it completes; by induction every transfer does. This also holds
for backends that execute a rank's operations strictly in posting order (NCCL's single stream),
where ordering each pair separately could wedge two ranks each waiting on the other's later
operation. (A process that both sent and received would have to merge both lists into one FIFO;
in our jobs training processes only send and inference processes only receive.)

On CUDA (NCCL) the FIFO lives on the GPU, not in the CPU: retiring operation k - window makes the
current stream wait for it (``work.wait()`` without a timeout is a stream wait), and the pack into
the freed buffer, queued on that stream after the wait, runs only once the buffer is free; NCCL in
turn orders each posted operation after the current stream's work queued so far. So the CPU posts
the whole step at once and the GPU pipelines pack, transfer and unpack with no host round trip per
bucket. (``work.wait(timeout)`` would block the CPU in a sleep-and-poll loop, milliseconds per
bucket when a 256 MiB bucket crosses NVLink in under one.) The argument above carries over
unchanged: a rank's stream runs its operations in the one global order, each only after operation
k - window completed. At the end the CPU watches the posted operations and an event recorded after
the last unpack, and returns when the event completed.

Frames (a framed codec, :mod:`weightsync.payload.codec`: delta, fp8, cast; :class:`Framing`) take the same path:
the same global order, window and buffers, a bucket's route being its codec's. A framed step first takes each
receiver's proof of its base where the codec needs one (delta: one small message per pair, all before any bucket),
then posts per bucket the encoder's header and its payload, encoded into the bucket's window buffer (a bucket that
goes whole travels as the plan's messages, so it lands in place). A receiver posts the payload with its header where
the codec's frames are sized by the plan (``Codec.sized``: fp8, cast), else it reads the header first (delta: it
sizes what follows); it decodes once the bucket is retired. The argument above holds unchanged: a header and its
payload are one transfer in the order; a framed step's waits are on the CPU (each header is read there).

Failures never hang: on CPU every wait has ``timeout_s``; on CUDA the final watch raises once no
posted operation has completed for ``timeout_s``. A dead peer (gloo sees the connection reset) or a
stalled one raises :class:`TransportError` naming the peer and bucket. After that the group's state
is unknown (operations may still be posted): discard the group.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from datetime import timedelta
from typing import Any, Callable, Mapping

import torch
from torch.distributed import ProcessGroup

from weightsync.errors import StepMismatch, StepNotWritten, TransportError
from weightsync.plan.job import JobRanks
from weightsync.plan.planner import Bucket, Pair
from weightsync.transport.base import (BASE_PROOF, Buffers, GroupWait, Pulled, Receiver, ReceiverContext, Sender,
                                       SenderContext, StepStats)
from weightsync.payload.codec import Codec, Framing, ending  # noqa: F401 - Framing re-exported: callers knew it here
from weightsync.transport.fence import Fence
from weightsync.transport.graphs import CopyGraphs
from weightsync.transport.posted import posted as all_posted
from weightsync.transport.nccl import (  # noqa: F401 - re-exported: the names callers knew here
    DEFAULT_WINDOW,
    abort,
    coalescing,
    describe,
    ensure_buffers,
    first_line,
    on_gpu,
    order_key,
    post,
    retire,
    settle,
)
from weightsync.plan.messages import messages
from weightsync.payload.pack import (DIRECT_MIN_BYTES, Staging, active, pack_pairs, run_landing, stage, unpack_pairs,
                                     unpacked)

TransferStats = StepStats  # the name this module used before the transport interface


class P2PTransport:
    """Sends or receives one rank's buckets over ``group``; keep one per rank and reuse it every step.

    ``codec``: how a receiver's unpacked bytes land (:meth:`~weightsync.payload.codec.Codec.unpacked`: the
    full codec's casts where a target's dtype is not the wire's); None: byte copies only, a cast refused."""

    def __init__(
        self,
        group: ProcessGroup,
        ranks: JobRanks,
        *,
        window: int = DEFAULT_WINDOW,
        timeout_s: float = 60.0,
        buffer_bytes: int | None = None,
        coalesce: bool = False,
        direct_min: int = DIRECT_MIN_BYTES,
        codec: Codec | None = None,
    ):
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        if group.size() != ranks.world_size:
            raise ValueError(f"group has {group.size()} ranks, the job {ranks.world_size}")
        self.group, self.ranks, self.window = group, ranks, window
        self.timeout = timedelta(seconds=timeout_s)
        self.buffer_bytes = buffer_bytes  # a fixed cap; None: as large as the largest bucket seen
        self.direct_min = direct_min  # segments this large travel alone (pack.messages): the same on every rank
        self.codec = codec
        self._buffers: list[torch.Tensor] = []
        self._graphs = CopyGraphs()  # pack / unpack of each bucket, replayed every step on CUDA
        self.coalesce = coalesce
        self._coalescing: bool | None = None  # decided (and the communicator built) in the first step

    def send(self, plans: Mapping[Pair, list[Bucket]], tensors: Mapping[str, torch.Tensor],
             frames: Framing | None = None) -> TransferStats:
        """Ship every bucket of this training rank's ``send_plan`` from its live ``tensors`` (``frames``: as a
        framed codec's frames, :class:`Framing`)."""
        return self._run(plans, tensors, sending=True, frames=frames)

    def recv(self, plans: Mapping[Pair, list[Bucket]], tensors: Mapping[str, torch.Tensor],
             fence: Fence | None = None, frames: Framing | None = None) -> TransferStats:
        """Receive every bucket of this inference rank's ``recv_plan`` into its live ``tensors`` in place;
        through ``fence`` where given (:mod:`weightsync.transport.fence`: on CPU every message then goes
        through the buffers, so an abandoned receive lands nothing); ``frames``: as a framed codec's frames."""
        return self._run(plans, tensors, sending=False, fence=fence, frames=frames)

    # -- the step's announcement ------------------------------------------------------------------
    def exchange_step(self, step: int, plans: Mapping[Pair, list[Bucket]], device: torch.device, sending: bool,
                      wait_s: float, fence: Fence | None = None) -> None:
        """Before a sync step's buckets, both ends of every pair with bytes tell each other the step they move
        (:func:`step_header`) and check the other's, so no byte is posted for a step the other end does not
        mean: :class:`StepMismatch` on both ends at once, naming both steps. ``wait_s`` bounds the wait for the
        other end (a receiver: the trainers may still be training, ``written_timeout_s``; a sender: ``timeout_s``)
        -- :class:`StepNotWritten` after it, nothing posted into a target. A receiver then calls ``fence.begin()``.

        Deadlock freedom: every rank posts its pairs' announcements before any bucket, as one NCCL group where the
        transport coalesces (NCCL then progresses them together), else in the one global order of the pairs --
        ``(src_rank, dst_instance, dst_rank)``, a pair's two messages in one order on both ends -- by the module
        docstring's argument, with them as the earliest transfers."""
        coalesce = self._decide_coalescing(device)
        pairs = list(active(plans))
        peers = [self.ranks.receiver(p) if sending else self.ranks.sender(p) for p in pairs]
        if peers:
            mine = [step_header(step, device) for _ in peers]
            theirs = [torch.empty(len(STEP_HEADER), dtype=torch.int64, device=device) for _ in peers]
            # a pair's two messages in one order on both ends: the trainer's announcement, then the reader's
            ops = [op for m, t, peer in zip(mine, theirs, peers)
                   for op in (((m, peer, STEP_TAG, True), (t, peer, STEP_TAG, False)) if sending else
                              ((t, peer, STEP_TAG, False), (m, peer, STEP_TAG, True)))]
            try:
                works = post(self.group, ops, device, coalesce)
            except RuntimeError as e:
                raise TransportError(f"group rank {self.group.rank()}: telling the other ends step {step} failed: "
                                     f"{first_line(e)}") from e
            self._wait_exchanged(step, works, device, fence, wait_s, sending)
            for pair, t in zip(pairs, theirs):
                magic, got = t.tolist()
                if magic != STEP_HEADER[0]:
                    raise TransportError(f"{describe(pair)}: the step announcement holds {magic:#x}, not weightsync's "
                                         f"{STEP_HEADER[0]:#x} (the two ends built different plans)", pair=pair)
                if got != step:
                    writes, asks = (step, got) if sending else (got, step)
                    raise StepMismatch(
                        f"{describe(pair)}: the training rank writes step {writes} and the reader asks for step {asks}: "
                        "refused before any byte of it moved. Both sides must number steps alike (the trainers' "
                        "write(step) and the reader's update(step), from the same first step)", pair=pair)
        if fence is not None:
            fence.begin()

    def _wait_exchanged(self, step: int, works: list, device: torch.device, fence: Fence | None, wait_s: float,
                        sending: bool) -> None:
        """Wait for the posted announcements, ``wait_s`` at most (and no longer once ``fence`` is closed)."""
        def not_written() -> StepNotWritten:
            other = "inference rank this rank sends to asked for" if sending else "training rank this rank " \
                "receives from announced"
            return StepNotWritten(f"group rank {self.group.rank()}: not every {other} step {step} within {wait_s:g} s, "
                                  "so nothing of it moved")

        if not on_gpu(device):
            try:
                for w in works:
                    retire(w, timedelta(seconds=wait_s), False)
            except TimeoutError as e:
                raise not_written() from e
            except RuntimeError as e:
                if "timed out" in str(e).lower():  # gloo's own word for its wait's deadline
                    raise not_written() from e
                raise TransportError(f"group rank {self.group.rank()}: step {step}'s announcement failed: "
                                     f"{first_line(e)}") from e
            return
        start = time.monotonic()  # NCCL: poll, so a long wait ends when the watcher gives up (the fence closes)
        while not all(w.is_completed() for w in works):
            waited = time.monotonic() - start
            if waited > wait_s:
                raise not_written()
            if fence is not None and fence.closed:
                raise TransportError(f"group rank {self.group.rank()}: step {step}'s announcement: given up")
            time.sleep(20e-6 if waited < 0.01 else 1e-3)

    def _decide_coalescing(self, device: torch.device) -> bool:
        """Whether this transport's messages go as NCCL groups; decided (and the communicator built) in the first
        step, which every rank reaches (see coalescing())."""
        if self._coalescing is None:
            self._coalescing = self.coalesce and coalescing(self.group, device)
        return self._coalescing

    # -- internals: one path for every codec ------------------------------------------------------
    def _run(
        self, plans: Mapping[Pair, list[Bucket]], tensors: Mapping[str, torch.Tensor], sending: bool,
        fence: Fence | None = None, frames: Framing | None = None,
    ) -> TransferStats:
        """Every bucket of this rank's plan, in the one global order, at most ``window`` outstanding (module
        docstring). A bucket's route is its codec's: the full codec's messages of the plan's bytes (in place where
        they lie so, else packed / unpacked through a window buffer, in CUDA graphs), or a framed codec's header and
        payload (:class:`Framing`), encoded into / decoded from the same window buffers."""
        me = self.group.rank()
        mine, peer_of = self.ranks.sender, self.ranks.receiver
        if not sending:
            mine, peer_of = peer_of, mine
        for pair in plans:
            if mine(pair) != me:
                side = "sends" if sending else "receives"
                raise TransportError(
                    f"group rank {me} was given the plan of {describe(pair)}, which group rank {mine(pair)} {side}",
                    pair=pair,
                )
        ops = sorted((b for buckets in plans.values() for b in buckets if b.nbytes > 0), key=order_key)
        device = next(iter(tensors.values())).device if tensors else (self.group.bound_device_id or torch.device("cpu"))
        ordered = on_gpu(device) and frames is None  # a framed step's CPU reads each header (it sizes what follows)
        coalesce = self._decide_coalescing(device)  # every rank gets here in its first step (see coalescing())
        start = time.perf_counter()
        moved = self._begin(frames, plans, tensors, sending, device) if frames is not None else 0
        if not ops:
            if frames is not None:
                frames.side.end(frames.step)
            return TransferStats(0, moved, 0.0)
        # a fenced receive on CPU takes every message into the buffers (landed, under the fence, by the unpack);
        # on CUDA in place (an aborted group's kernels land nothing more)
        direct = sending or fence is None or on_gpu(device)
        # graphs and views stay valid while the tensors and buffers stay put
        self._graphs.begin(tensors, buffers=self._buffers)
        stagings = [self._graphs.memo(b, sending, lambda b=b: stage(b, tensors, sending, self.direct_min, direct))
                    for b in ops]
        need = max(st.nbytes for st in stagings)
        if frames is not None:
            need = max(need, max(max(b.nbytes, frames.side.bound(b)) for b in ops))
        if self._ensure_buffers(need, device):
            self._graphs.begin(tensors, buffers=self._buffers)  # new buffers (first step, or grown)
        inflight: deque[tuple] = deque()
        posted: list[tuple[object, Callable[[Exception], TransportError]]] = []
        into = fence.landing if (fence is not None and on_gpu(device)) else contextlib.nullcontext  # CUDA: posts land
        with ending(frames):  # failed: a sender's kept base, a receiver's targets are not one whole step
            for k, (b, st) in enumerate(zip(ops, stagings)):
                if len(inflight) == self.window:
                    moved += self._finish(*inflight.popleft(), tensors, sending, ordered, fence, frames)
                peer = peer_of(b.pair)
                slot = self._buffers[k % self.window]  # the buffer bucket k - window just freed
                try:
                    if frames is None:
                        if sending and st.staged:
                            self._graphs.run(b, ("pack", slot.data_ptr()),
                                             lambda st=st, o=slot: pack_pairs(st.staged, tensors, o), device)
                        msgs, keep, joined = st.tensors(slot), None, coalesce
                    else:
                        msgs, keep, joined = self._frame(b, st, slot, k, tensors, sending, frames, peer, fence)
                    with into():
                        works = post(self.group, [(t, peer, tag, sending) for t, tag in _tagged(msgs, b.index)],
                                     device, joined)
                except RuntimeError as e:  # a peer already known dead fails at post time
                    raise self._error(b, peer, sending, e) from e
                inflight.append((b, peer, works, st, slot, k, keep))
                posted.extend((w, lambda e, b=b, peer=peer: self._error(b, peer, sending, e)) for w in works)
            while inflight:
                moved += self._finish(*inflight.popleft(), tensors, sending, ordered, fence, frames)
            done_posting = time.perf_counter() - start
            all_posted()  # the rest is the device's
            if ordered:
                settle(posted, self.timeout.total_seconds(), device, self.group)
        full = sum(b.nbytes for b in ops)
        if frames is None:
            return TransferStats(len(ops), full, time.perf_counter() - start, done_posting)
        return TransferStats(len(ops), moved, time.perf_counter() - start, done_posting, full_bytes=full)

    def _frame(self, b: Bucket, st: Staging, slot: torch.Tensor, k: int, tensors: Mapping[str, torch.Tensor],
               sending: bool, frames: Framing, peer: int, fence: Fence | None) -> tuple[list, object, bool]:
        """A framed bucket's messages -- its header (tag ``HEADER_TAG + index``), then its payload, or the plan's
        messages where it goes whole -- what the post must keep alive, and whether they go as one NCCL group.
        A sender encodes into ``slot``. A receiver posts the payload with the header when the codec's frames are
        sized by the plan (:attr:`~weightsync.payload.codec.Codec.sized`), else reads the header first: it sizes
        what follows."""
        codec = frames.codec
        if sending:
            frame = frames.side.encode(b, tensors, slot)
            h = frame.header
            header = torch.tensor(h.words(codec.header_words), dtype=torch.int64, device=slot.device)
            if h.whole:  # the plan's messages, so the receiver lands them in place
                body = [frame.payload[m.offset : m.offset + m.nbytes] for m in messages(b, self.direct_min)]
            else:
                body = [frame.payload[: h.nbytes]] if h.nbytes else []
            return [("header", header)] + body, (header, frame, codec.header_words * 8 + h.nbytes), False
        header = self._headers(codec.header_words, slot.device)[k % self.window]
        if codec.sized:
            return [("header", header), slot[: frames.side.bound(b)]], None, self._coalescing
        self._retire_cpu(b, post(self.group, [(header, peer, HEADER_TAG + b.index, False)], slot.device, False), False)
        h = self._header(b, codec, header, frames)
        if h.whole:
            return st.tensors(slot), h, False  # in place where the plan's messages lie so: posted under the fence
        return ([slot[: h.nbytes]] if h.nbytes else []), h, False

    def _header(self, b: Bucket, codec: Codec, header: torch.Tensor, frames: Framing):
        h = codec.header(header.tolist())
        size = frames.side.size(b, h)
        if size != h.nbytes:
            raise TransportError(f"bucket {b.index} of {describe(b.pair)}: the sender's header says {h.nbytes} "
                                 f"bytes, this receiver's plan {size} (the two ends built different plans)",
                                 pair=b.pair, bucket=b.index)
        return h

    def _finish(
        self, b: Bucket, peer: int, works: list, st: Staging, slot: torch.Tensor, k: int, keep: object,
        tensors: Mapping[str, torch.Tensor], sending: bool, ordered: bool, fence: Fence | None = None,
        frames: Framing | None = None,
    ) -> int:
        """Retire bucket ``b``'s operations and land what arrived; the bytes a framed bucket moved."""
        try:
            for work in works:
                retire(work, self.timeout, ordered)
        except (RuntimeError, TimeoutError) as e:  # gloo: connection reset / closed by peer, or timed out
            raise self._error(b, peer, sending, e) from e
        land = fence.landing() if fence is not None else contextlib.nullcontext()  # an abandoned one: refused
        if frames is None:
            if not sending and st.staged:  # the codec's casts, if any, run after the copies in the same graph
                with land:
                    self._graphs.run(b, ("unpack", slot.data_ptr()),
                                     lambda st=st, i=slot: unpacked(self.codec, unpack_pairs(st.staged, i, tensors)),
                                     slot.device)
            return 0
        codec = frames.codec
        if sending:
            return keep[2]
        h = keep if keep is not None else self._header(b, codec, self._headers(codec.header_words, slot.device)
                                                       [k % self.window], frames)
        with land:
            if h.whole:
                if st.staged:
                    run_landing(unpacked(codec, unpack_pairs(st.staged, slot, tensors)))
                frames.side.decode(b, h, None, tensors, self._scratch)
            else:
                frames.side.decode(b, h, slot[: h.nbytes], tensors, self._scratch)
        return codec.header_words * 8 + h.nbytes

    def _begin(self, frames: Framing, plans: Mapping[Pair, list[Bucket]], tensors: Mapping[str, torch.Tensor],
               sending: bool, device: torch.device) -> int:
        """A framed step's start: when ``frames.proofs``, each receiver's proof of its base first (one small
        message per pair, every one before any bucket: the earliest transfers of the global order), then the
        codec side's ``begin``. Returns the bytes the proofs moved."""
        codec, side, pairs = frames.codec, frames.side, active(plans)
        largest = max((b.nbytes for bs in pairs.values() for b in bs), default=0)
        if not sending:
            self._scratch = torch.empty(largest, dtype=torch.uint8, device=device) \
                if getattr(self, "_scratch", None) is None or self._scratch.numel() < largest else self._scratch
        if not frames.proofs:
            side.begin(frames.step, None) if sending else side.begin()
            return 0
        moved = codec.proof_words * 8 * len(pairs)
        if sending:
            bufs = {pair: torch.empty(codec.proof_words, dtype=torch.int64, device=device) for pair in pairs}
            works = [(pair, post(self.group, [(bufs[pair], self.ranks.receiver(pair), PROOF_TAG, False)], device,
                                 False)) for pair in pairs]
            for pair, ws in works:
                self._retire_cpu(pairs[pair][0], ws, True)
            side.begin(frames.step, {pair: codec.proof(bufs[pair].tolist()) for pair in pairs})
            return moved
        sends = []
        for pair, bs in pairs.items():
            msg = torch.tensor(side.proof(bs, tensors, self._scratch).words(), dtype=torch.int64, device=device)
            peer = self.ranks.sender(pair)
            try:
                sends.append((bs[0], msg, post(self.group, [(msg, peer, PROOF_TAG, True)], device, False)))
            except RuntimeError as e:
                raise self._error(bs[0], peer, False, e) from e
        side.begin()  # from here the targets may mix two steps
        try:
            for b, _, ws in sends:
                self._retire_cpu(b, ws, False)
        except BaseException:
            side.fail()
            raise
        return moved

    def _headers(self, words: int, device: torch.device) -> list[torch.Tensor]:
        """A header buffer per window slot (a receiver's framed steps)."""
        got = getattr(self, "_header_bufs", None)
        if got is None or got[0].numel() != words or got[0].device != device:
            got = self._header_bufs = [torch.empty(words, dtype=torch.int64, device=device)
                                       for _ in range(self.window)]
        return got

    def _error(self, b: Bucket, peer: int, sending: bool, cause: Exception) -> TransportError:
        pair = b.pair
        verb = "sending" if sending else "receiving"
        way = "to" if sending else "from"
        return TransportError(
            f"group rank {self.group.rank()}: {verb} bucket {b.index} ({b.nbytes} bytes) of {describe(pair)} "
            f"{way} group rank {peer} failed (wait timeout {self.timeout.total_seconds():g}s): {first_line(cause)}",
            peer=peer,
            pair=pair,
            bucket=b.index,
        )

    def _ensure_buffers(self, need: int, device: torch.device) -> bool:
        """Buffers for ``need`` bytes; True when they were (re)allocated."""
        have = self._buffers
        self._buffers = ensure_buffers(have, self.window, need, self.buffer_bytes, device)
        return self._buffers is not have

    def _retire_cpu(self, b: Bucket, works: list, sending: bool) -> None:
        """Wait for ``works`` on the CPU, at most the timeout each."""
        peer = self.ranks.receiver(b.pair) if sending else self.ranks.sender(b.pair)
        try:
            for w in works:
                retire(w, self.timeout, False)
        except (RuntimeError, TimeoutError) as e:
            raise self._error(b, peer, sending, e) from e


def _tagged(msgs: list, index: int) -> list[tuple[torch.Tensor, int]]:
    """A bucket's messages with their tags: a frame's header (``("header", t)``) under ``HEADER_TAG + index``, every
    other message under the bucket's index (a pair's messages of one tag match in posting order)."""
    return [(m[1], HEADER_TAG + index) if isinstance(m, tuple) else (m, index) for m in msgs]


PROOF_TAG = (1 << 24) + 1  # frames: a receiver's proof, beside the pull header's tag (1 << 24)
STEP_TAG = (1 << 24) + 2  # a sync step's announcement, both ways (P2PTransport.exchange_step)
STEP_HEADER = (0x77737465, 0)  # (magic "wste", step): what a step's announcement holds


def step_header(step: int, device: torch.device) -> torch.Tensor:
    """A sync step's announcement, one per (sender, receiver) pair: :data:`STEP_HEADER` with ``step``."""
    return torch.tensor([STEP_HEADER[0], step], dtype=torch.int64, device=device)


HEADER_TAG = 1 << 25  # frames: + bucket index


# -- the transport interface (weightsync.transport.base) -------------------------------------------


def largest_bucket(plans: Mapping[Pair, list[Bucket]], side: Any = None) -> int:
    """The most bytes a bucket of ``plans`` puts in a window buffer (``side``: a framed codec's encoder or decoder,
    whose frames may be larger than the plan's bytes: its ``bound``)."""
    return max((max(b.nbytes, side.bound(b)) if side is not None else b.nbytes
                for bs in plans.values() for b in bs), default=0)


def framing(options: Any, step: int, side: Any) -> Framing | None:
    """A framed codec's step for :meth:`P2PTransport.send` / ``recv`` (None: the full codec's)."""
    if side is None:
        return None
    return Framing(step, side, options.codec, proofs=BASE_PROOF in options.codec.needs)


def job_group(client, ranks: JobRanks, me: int, options, device: torch.device, host: str | None = None) -> ProcessGroup:
    """The train+inference group, built beside the trainers' own: training rank 0 hosts the rendezvous
    (``host`` given) and publishes it, every other member looks it up."""
    from weightsync.transport.group import free_port, new_group

    if host is not None:
        port = free_port(host)
        client.publish("group", f"{host}:{port}")
    else:
        host, port_s = client.lookup("group", timeout=options.timeout_s).rsplit(":", 1)
        port = int(port_s)
    return new_group(host, port, me, ranks.world_size, options.backend, options.timeout_s,
                     device=device if device.type == "cuda" else None, name="weightsync")


class P2PSender(Sender):
    """A training rank sends its buckets over the train+inference group; async, it stages a snapshot and
    serves pulls (:mod:`weightsync.transport.pull`)."""

    modes = frozenset({"sync", "async"})

    def memory(self, ctx: SenderContext) -> Buffers:
        if not self.options.framed:
            return Buffers(DEFAULT_WINDOW, largest_bucket(ctx.plans))
        encoder = self._encoder(ctx)  # its frames go through the same window buffers
        return Buffers(DEFAULT_WINDOW, largest_bucket(ctx.plans, encoder), encoder.memory())

    def _encoder(self, ctx: SenderContext):
        """The codec's encoder for this rank (framed codecs: :mod:`weightsync.codec`), made once."""
        if getattr(self, "encoder", None) is None:
            self.encoder = self.options.codec.encoder(ctx.plans, next(iter(ctx.tensors.values())).device)
        return self.encoder

    def connect(self, ctx: SenderContext) -> None:
        shape = ctx.shape
        ranks = JobRanks(shape.train_world, shape.infer_world, shape.instances)
        device = next(iter(ctx.tensors.values())).device
        group = job_group(ctx.client, ranks, ranks.train(ctx.rank), self.options, device,
                          host=self.options.host if ctx.rank == 0 else None)
        # sync jobs run every rank every step, so each bucket's messages can go as one NCCL group
        self.transport = P2PTransport(group, ranks, timeout_s=self.options.timeout_s,
                                      coalesce=self.options.mode == "sync")
        self.plans, self.tensors = ctx.plans, ctx.tensors
        self.server = None
        if self.options.mode == "async":
            from weightsync.transport.pull import PullServer

            self.server = PullServer(ctx.client, self.transport, ctx.plans, ctx.tensors, self.options.timeout_s)
        self.encoder = None
        if self.options.framed:  # sync only (weightsync.codec.registry.check)
            self._encoder(ctx)

    def send(self, step: int) -> StepStats | None:
        if self.server is not None:
            self.server.stage(step)
            return None
        with torch.no_grad():
            # the step first, both ways: no byte moves for a step the receivers did not ask for
            self.transport.exchange_step(step, self.plans, next(iter(self.tensors.values())).device, True,
                                         self.options.timeout_s)
            return self.transport.send(self.plans, self.tensors, framing(self.options, step, self.encoder))

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.close()
        _close(getattr(self, "transport", None))
        self.transport = None  # the group dies with its last reference


class P2PReceiver(Receiver):
    """An inference worker receives its buckets over the train+inference group, in place."""

    modes = frozenset({"sync", "async"})
    waits_for_step = True  # sync: the step's announcement (P2PTransport.exchange_step), written_timeout_s

    def memory(self, ctx: ReceiverContext) -> Buffers:
        if not self.options.framed:
            return Buffers(DEFAULT_WINDOW, largest_bucket(ctx.plans))
        # a framed codec's payloads through the same window buffers, and a bucket's scratch for its decoder
        return Buffers(DEFAULT_WINDOW, largest_bucket(ctx.plans, self._decoder(ctx)), largest_bucket(ctx.plans))

    def _decoder(self, ctx: ReceiverContext):
        """The codec's decoder for this worker (framed codecs), made once."""
        if getattr(self, "decoder", None) is None:
            self.decoder = self.options.codec.decoder(ctx.plans)
        return self.decoder

    def connect(self, ctx: ReceiverContext) -> None:
        shape = ctx.shape
        ranks = JobRanks(shape.train_world, shape.infer_world, shape.instances)
        client = ctx.link.client(self.options.timeout_s)
        group = job_group(client, ranks, ranks.infer(ctx.instance, ctx.rank), self.options, ctx.device)
        self.transport = P2PTransport(group, ranks, timeout_s=self.options.timeout_s,
                                      coalesce=self.options.mode == "sync", codec=self.options.codec)
        self.plans = ctx.plans
        self.decoder = None
        if self.options.framed:
            self._decoder(ctx)
        self.fence: Fence | None = None  # the current transfer's (group_wait)

    def receive(self, step: int, targets: Mapping[str, torch.Tensor]) -> StepStats:
        fence = self.fence
        device = next(iter(targets.values())).device if targets else torch.device("cpu")
        # every sender's announcement of the step first, as long as the trainers train (written_timeout_s)
        self.transport.exchange_step(step, self.plans, device, False, self.options.written_timeout_s, fence)
        return self.transport.recv(self.plans, targets, fence=fence, frames=framing(self.options, step, self.decoder))

    def landed(self) -> bool:
        # the last receive's fence: False only where it posted nothing into a target (its step never began)
        return self.fence is None or self.fence.landed

    def pull(self, targets: Mapping[str, torch.Tensor]) -> Pulled:
        from weightsync.transport.pull import receive_pull

        steps, stats = receive_pull(self.transport, self.plans, targets, self.fence)
        return Pulled(frozenset(steps), stats)

    def group_wait(self) -> GroupWait | None:
        # the training ranks it receives from; in the job's group a training rank's group rank is its own. Each
        # transfer gets a fence of its own (weightsync.transport.fence), and may wait written_timeout_s for its step
        if getattr(self, "transport", None) is None:
            return None
        sync = self.options.mode == "sync"  # (an async pull has its own header: weightsync.transport.pull)
        self.fence = Fence()
        return GroupWait(self.transport.group, tuple(sorted({pair[0] for pair in self.plans})),
                         lambda g: f"training rank {g}", fence=self.fence,
                         first_s=self.options.written_timeout_s if sync else 0.0)

    def close(self) -> None:
        _close(getattr(self, "transport", None))
        self.transport = None


def _close(transport: P2PTransport | None) -> None:
    """The transport's group closed on this member (:func:`~weightsync.transport.group.close_group`)."""
    from weightsync.transport.group import close_group

    if transport is not None:
        close_group(transport.group)
