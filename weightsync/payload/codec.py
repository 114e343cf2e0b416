"""The codec stage: what a bucket's payload holds, between the plan and the transports.

Shaped as ``torch.distributed.checkpoint`` splits the transform (``resolve_data``/``commit_tensor``)
from the byte movement (``StorageWriter``/``StorageReader``): the plan says which bytes go where; a
codec turns one bucket's bytes into a *frame* (a typed :class:`Header` and a uint8 payload) on the
training rank and back into the receiver's tensors; a transport only moves frames
(:mod:`weightsync.transport.base`). This module is the interface between the two, defined once and below both
(with :mod:`weightsync.payload.pack`, the bytes' layout on the wire): the codecs (:mod:`weightsync.codec`) implement
it, the transports call it, and neither imports the other.

Codecs (:mod:`weightsync.codec.registry`): ``full`` (:mod:`.full`: the plan's bytes themselves, moved
zero-copy by each transport's own path where they lie in place), ``delta`` (:mod:`.delta`: what changed
since the version the receiver proves it holds), ``fp8`` (:mod:`.fp8`: block FP8 into an FP8-served
engine). A codec whose payload is not the plan's bytes (a delta; FP8: another dtype and size than
``Copy.dtype`` says) is *framed*: the transports run their frame paths for it. Where a transport cannot
use a bucket's frame, it reads the bucket whole -- unless the codec ``needs_frames`` (FP8: the plan's
bytes are not what it lands), when the step fails instead. Wherever the plan's bytes arrive whole in the
wire dtype (a transport's unpack, a whole read), the codec says how they land (:meth:`Codec.unpacked`:
byte copies for the transport's copy kernel, the casts to the receiver's dtypes as its own work): a
receiver's cast is this stage's on every transport, never a transport's.

A codec declares what it needs of a transport (:data:`NEEDS`); each transport says what it serves per
mode (:attr:`weightsync.transport.base.TransportEntry.serves`), and the session refuses, at set-up and by
name, a combination no transport serves (:func:`weightsync.codec.registry.check`).

Call order on a training rank (:class:`Encoder`, one per rank, made by :meth:`Codec.encoder`)::

    1. Encoder(plans, device)       no I/O
    2. memory() -> int              device bytes it keeps beyond the transport's buffers (the budget counts them)
    3. every step:
       begin(step, proofs)          ``proofs``: each pair's :class:`Proof` where the transport carried the
                                    receivers' proofs to the sender (two-sided), None where each receiver
                                    proves its base against the headers itself (one-sided)
       encode(bucket, sources, slot, kept=) -> Frame      each bucket, in the transport's order
       end(step) -> {key: Header}   the step's final headers (checksums read once for all)
       fail()                       instead of end() when the step did not complete
    4. (nothing to close)

Call order on an inference worker (:class:`Decoder`, one per worker)::

    1. Decoder(plans)               no I/O
    2. every step:
       proof(buckets, targets, slot) -> Proof              two-sided transports, before the step
       begin() -> held              the version it held; none from here until end()
       accepts(step, held, items, targets, slot) -> list | None   one-sided: which payloads to read
                                    (None: the base is not proven, take the bucket whole)
       decode(bucket, header, payload, targets, slot)      each bucket read
       end(step) / fail()

Integrity is this stage's too, on both sides (:mod:`weightsync.integrity.check`, its call orders): what
a checked step's sums cover is the codec's to say -- :meth:`Codec.on_wire` on a training rank (summed by
``SentCheck`` after the transport sent), :meth:`Codec.landed` on a worker (summed by ``LandedCheck`` once
every worker of the instance landed the step, before a staged copy is committed). The sums travel through
the MetaServer, not in :class:`Header`: the full codec moves no header where the transports move the
plan's bytes zero-copy, and a step off the cadence must cost nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from weightsync.payload.pack import Landing, Pairs, copy_pairs

if TYPE_CHECKING:
    import torch

    from weightsync.spec.model import ModelSpec

    from weightsync.plan.planner import Bucket, Pair

# what a transport may serve a codec (its registry entry's ``serves``, :mod:`weightsync.transport.base`)
SENDER_STEP = "a sender step over every bucket's bytes"
BASE_PROOF = "the receiver's proof of its base"
#: the receiver reads the trainers' tensors in place (co-located): a codec that can land them itself there
#: (its ``land``: the full codec's copies and casts, FP8's quantization) needs no sender step
SOURCES = "the sources, read in place by the receiver"

#: what a codec may need of a transport: a sender step over every bucket's bytes (not co-located, whose
#: workers copy the trainers' memory themselves); the receiver's proof of its base (a message back, p2p
#: sync; or headers published beside the payloads for each receiver to check, file and nixl)
NEEDS = frozenset({SENDER_STEP, BASE_PROOF})

WHOLE = -1  # Header.kind: no encoded payload; the bucket travels whole by the transport's own path
NO_VERSION = -1  # a proof of nothing, a header encoded against nothing


@dataclass(frozen=True)
class Header:
    """One bucket's frame header: what its payload holds (``WORDS`` int64 on the wire).

    ``kind``: the codec's encoding (:data:`WHOLE`: none, the bucket goes whole); ``count``: the
    codec's count (delta: changed words); ``nbytes``: payload bytes; ``base``: the step it was encoded
    against (:data:`NO_VERSION`: none); ``base_sum``: that base's checksum in wire form, which a
    receiver must hold to apply it; ``sum``: the checksum of this step's wire bytes (a receiver already
    holding the step proves it with this and reads nothing)."""

    kind: int
    count: int = 0
    nbytes: int = 0
    base: int = NO_VERSION
    base_sum: int = 0
    sum: int = 0

    WORDS: ClassVar[int] = 6
    #: the words a two-sided transport sends (kind, count, nbytes): the proofs before the step already
    #: settled the base, so the rest is for headers published to receivers that prove themselves
    SENT: ClassVar[int] = 3

    def words(self, n: int = WORDS) -> list[int]:
        return [self.kind, self.count, self.nbytes, self.base, _signed(self.base_sum), _signed(self.sum)][:n]

    @classmethod
    def of(cls, words: Sequence[int]) -> Header:
        k, c, n, b, bs, s = ([int(x) for x in words[: cls.WORDS]] + [NO_VERSION, 0, 0])[:6]
        return cls(k, c, n, b, bs & _MASK, s & _MASK)

    @property
    def whole(self) -> bool:
        return self.kind == WHOLE


@dataclass(frozen=True)
class Frame:
    """One encoded bucket: its header and payload (uint8, 1-D; for a :data:`WHOLE` frame the bucket's
    wire bytes where the encoder packed them, None when it packed nothing: the transport moves the
    plan's bytes itself). ``packed``: the bucket's wire bytes this step where the encoder packed them
    (one-sided transports also publish the whole bucket), else None."""

    header: Header
    payload: torch.Tensor | None
    packed: torch.Tensor | None = None


@dataclass(frozen=True)
class Proof:
    """What a receiver holds for one pair: the step it last received whole (:data:`NO_VERSION`: none)
    and the checksum of its buckets' current bytes in wire form."""

    version: int
    checksum: int

    WORDS: ClassVar[int] = 2

    def words(self) -> list[int]:
        return [self.version, _signed(self.checksum)]

    @classmethod
    def of(cls, words: Sequence[int]) -> Proof:
        return cls(int(words[0]), int(words[1]) & _MASK)


@dataclass(frozen=True)
class CodecJob:
    """What a codec is made for (:meth:`Codec.for_job`): the engine's layout string (its ``quant``) and the model once
    the job is agreed (None before: what a participant's options alone make), and whether state the codec keeps
    (delta's previous version) stays in host memory."""

    infer: str | None = None
    spec: ModelSpec | None = None
    host: bool = False


@dataclass
class CodecStats:
    """What one side's codec did in its last step: frames per kind name, and (sender, two-sided; or
    receiver, one-sided) the pairs that went whole."""

    kinds: dict[str, int] = field(default_factory=dict)
    whole_pairs: list = field(default_factory=list)

    def count(self, kind: str, n: int = 1) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + n


class Encoder(ABC):
    """A training rank's side of a codec (call order in the module docstring)."""

    stats: CodecStats

    def memory(self) -> int:
        return 0

    def begin(self, step: int, proofs: Mapping[Pair, Proof] | None) -> None:
        """Start ``step``; ``proofs`` as the module docstring says."""

    @abstractmethod
    def encode(self, bucket: Bucket, sources: Mapping[str, torch.Tensor], slot: torch.Tensor, *,
               kept: bool = False) -> Frame:
        """``bucket``'s frame from the live ``sources``, packing into ``slot`` (uint8, at least the
        bucket's bytes). ``kept``: the slot is this bucket's alone until its next encode (a staged
        region a receiver reads one-sided), so the payload may be written over the packed bytes."""

    def end(self, step: int) -> dict[int, Header]:
        """The step encoded whole: the final headers by :meth:`key`."""
        return {}

    def fail(self) -> None:
        """The step did not complete: hold no base (the next step goes whole)."""

    def key(self, bucket: Bucket) -> int:
        """A bucket's source-bytes key: buckets with one key share one encoding (equal layouts; a one-sided transport
        finds a frame by it). :func:`payload_key` by default; a codec whose payload depends on more says so here."""
        return payload_key(bucket)

    def distinct(self, buckets: Sequence[Bucket]) -> list[Bucket]:
        """One bucket per :meth:`key`, first seen first (what a staged region holds)."""
        seen: dict[int, Bucket] = {}
        for b in buckets:
            seen.setdefault(self.key(b), b)
        return list(seen.values())

    def bound(self, bucket: Bucket) -> int:
        """The most payload bytes :meth:`encode` writes for ``bucket`` (a staged region's slot size)."""
        return bucket.nbytes

    #: whether :meth:`encode` is copies and kernels between fixed addresses with a header the plan fixes: a
    #: transport whose slots stay put (nixl's registered region) may then take :meth:`landing` once per bucket,
    #: replay all of a step's as one (a CUDA graph on a GPU) and ask :meth:`header` every step instead
    batched: ClassVar[bool] = False

    def landing(self, bucket: Bucket, sources: Mapping[str, torch.Tensor], slot: torch.Tensor) -> Landing:
        """A :attr:`batched` encoder's :meth:`encode` of ``bucket`` from ``sources`` into ``slot`` as copies and work
        (:class:`~weightsync.payload.pack.Landing`: they write the bytes ``encode`` writes, allocate nothing and
        never synchronize); valid while ``sources`` and ``slot`` stay where they are."""
        raise NotImplementedError(f"{type(self).__name__} does not encode through a landing")

    def header(self, bucket: Bucket) -> Header:
        """A :attr:`batched` encoder's frame header for ``bucket`` this step (its payload written by the landing),
        counted in :attr:`stats` as :meth:`encode` counts it."""
        raise NotImplementedError(f"{type(self).__name__} does not encode through a landing")


class Decoder(ABC):
    """An inference worker's side of a codec (call order in the module docstring)."""

    stats: CodecStats
    #: the step this worker last received whole, None while it cannot prove one
    version: int | None = None

    def proof(self, buckets: Sequence[Bucket], targets: Mapping[str, torch.Tensor], slot: torch.Tensor) -> Proof:
        return Proof(NO_VERSION, 0)

    def begin(self) -> int | None:
        held, self.version = self.version, None  # from here the targets may mix two steps
        return held

    def accepts(self, step: int | None, held: int | None, items: Sequence[tuple[Bucket, Header]],
                targets: Mapping[str, torch.Tensor], slot: torch.Tensor) -> list[int] | None:
        """One-sided: the positions in ``items`` whose payloads to read and decode, when this worker
        proves the base of every one (empty: it holds ``step`` already); None: take them whole. A codec
        that needs no base (:data:`BASE_PROOF` not in its needs) takes every payload."""
        return list(range(len(items)))

    @abstractmethod
    def decode(self, bucket: Bucket, header: Header, payload: torch.Tensor | None,
               targets: Mapping[str, torch.Tensor], slot: torch.Tensor) -> None:
        """Land ``payload`` in the bucket's regions of ``targets`` (``slot``: scratch of a bucket's
        bytes). A :data:`WHOLE` frame already landed by the transport: counted only."""

    def key(self, bucket: Bucket) -> int:
        """:meth:`Encoder.key` on this side (a published header is found by it)."""
        return payload_key(bucket)

    def size(self, bucket: Bucket, header: Header) -> int:
        """The payload bytes ``header`` implies for ``bucket`` by this worker's own plan (a transport
        allocates them, and refuses a header that says otherwise: the ends planned differently)."""
        return bucket.nbytes if header.whole else header.nbytes

    def bound(self, bucket: Bucket) -> int:
        """The most payload bytes a frame of ``bucket`` holds (:meth:`Encoder.bound` on this side: a transport's
        scratch for payloads is sized by it)."""
        return bucket.nbytes

    #: whether :meth:`decode` is copies (and casts) from the payload into the targets, nothing else: a transport
    #: that reads payloads into fixed scratch may take :meth:`landing` once per (bucket, place), run many
    #: buckets' as one (a CUDA graph on a GPU), and call :meth:`take` every step instead of :meth:`decode`
    batched: ClassVar[bool] = False

    def take(self, bucket: Bucket, header: Header) -> None:
        """A :attr:`batched` decoder's checks of ``header`` against its plan, and its count, every step before the
        bucket's landing runs (raises, naming the bucket, where :meth:`decode` would)."""
        raise NotImplementedError(f"{type(self).__name__} does not decode through a landing")

    def landing(self, bucket: Bucket, header: Header, payload: torch.Tensor,
                targets: Mapping[str, torch.Tensor]) -> Landing:
        """A :attr:`batched` decoder's :meth:`decode` of ``payload`` (a view of scratch that stays put) into
        ``targets`` as copies and work (:class:`~weightsync.payload.pack.Landing`), valid while both stay where
        they are and for every header :meth:`take` accepts for ``bucket``."""
        raise NotImplementedError(f"{type(self).__name__} does not decode through a landing")

    def whole(self, pair: Pair, buckets: Sequence[Bucket]) -> None:
        """One-sided: the transport read ``pair``'s ``buckets`` whole (the base was not proven)."""
        self.stats.count("full", len(buckets))
        self.stats.whole_pairs.append(pair)

    def end(self, step: int) -> None:
        self.version = step

    def fail(self) -> None:
        self.version = None


class Codec(ABC):
    """A codec: its name, what it needs of a transport, and its two sides (picklable: it travels
    inside :class:`weightsync.transport.base.TransportOptions` to worker processes)."""

    name: ClassVar[str]
    needs: ClassVar[frozenset[str]] = frozenset()
    #: whether its payload differs from the plan's bytes (the transports run their frame paths)
    framed: ClassVar[bool] = True
    #: whether a receiver may land its frames only: the plan's bytes read whole are not what it lands (fp8: bf16
    #: bytes into e4m3 weights), so a transport that cannot serve a bucket's frame fails the step where it would
    #: otherwise read the bucket whole (delta: False, a whole bucket is what its decoding lands)
    needs_frames: ClassVar[bool] = False
    #: whether every frame's size is fixed by the plan (:meth:`Decoder.bound` is its size): a two-sided transport may
    #: then post the payload together with its header, before reading it (fp8, cast; not delta, whose header says
    #: how much follows)
    sized: ClassVar[bool] = False
    header_words: ClassVar[int] = Header.SENT  # what a two-sided transport sends per bucket
    proof_words: ClassVar[int] = Proof.WORDS

    @staticmethod
    def header(words: Sequence[int]) -> Header:
        return Header.of(words)

    @staticmethod
    def proof(words: Sequence[int]) -> Proof:
        return Proof.of(words)

    @classmethod
    def for_job(cls, job: CodecJob) -> Codec:
        """This codec for ``job`` (:func:`weightsync.codec.registry.make_job_codec`, once per participant at set-up):
        its options from the engine's layout and the participant's choices (delta: ``host``; fp8: which weights
        are FP8). A layout the codec cannot serve is refused here, by name."""
        return cls()

    @abstractmethod
    def encoder(self, plans: Mapping[Pair, list[Bucket]], device: torch.device) -> Encoder: ...

    def on_wire(self, sources: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The sender's side of integrity (:mod:`weightsync.integrity.check`, ``SentCheck``): the tensors
        whose bytes a receiver holds once a step landed, named as the plan's sources. Full and delta land
        the sources' own bytes (cast to the receiver's dtype, which the sums do too); a codec that lands
        other bytes (FP8: the quantized weights and their scales) returns those."""
        return sources

    def landed(self, targets: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The receiver's side of integrity (``LandedCheck``): the tensors whose planned boxes hold what
        :meth:`on_wire` says was sent, named as the plan's destinations (full and delta: the targets)."""
        return targets

    @abstractmethod
    def decoder(self, plans: Mapping[Pair, list[Bucket]]) -> Decoder: ...

    def unpacked(self, pairs: Pairs) -> Landing:
        """The plan's bytes, arrived whole in the wire dtype (``pairs``: target views, wire views: a transport's
        unpack, a whole bucket's read), as they land (:meth:`weightsync.payload.codec.Codec.unpacked`): the
        full codec's :func:`landing` -- byte copies for the transport, the casts to the targets' dtypes as this
        codec's work. Full and delta land whole buckets so; fp8 never lands one (``needs_frames``)."""
        return landing(pairs)


@dataclass(frozen=True)
class Framing:
    """A framed codec's step through a transport's one data path: the step, this rank's side of the codec (its
    :class:`Encoder` on a training rank, its :class:`Decoder` on a worker), the codec, and whether each receiver's
    proof of its base travels to the sender first (a two-sided transport, a codec that needs :data:`BASE_PROOF`;
    a one-sided one publishes the headers and each receiver proves its base against them itself)."""

    step: int
    side: Encoder | Decoder
    codec: Codec
    proofs: bool = False


@contextlib.contextmanager
def ending(frames: Framing | None) -> Iterator[None]:
    """A framed step's transfer: the codec side's ``end(step)`` once the block returns, its ``fail()`` where the
    block (or ``end``) raises -- a sender's kept base, a receiver's targets, are then not one whole step. With no
    frames (the full codec) the block runs as it is."""
    if frames is None:
        yield
        return
    try:
        yield
        frames.side.end(frames.step)
    except BaseException:
        frames.side.fail()
        raise


def landing(pairs: Pairs) -> Landing:
    """``pairs`` as the full codec lands them (:class:`Landing`): those of one dtype are the transport's byte
    copies, the others this stage's casts, done after them (one rounding each, source dtype -> destination
    dtype, as :func:`weightsync.payload.pack.unpack` and loading a checkpoint convert). Where no pair casts
    (a bf16 trainer into a bf16 engine) there is no work."""
    copies = [p for p in pairs if p[0].dtype == p[1].dtype]
    casts = [p for p in pairs if p[0].dtype != p[1].dtype]
    return Landing(copies, (lambda: copy_pairs(casts)) if casts else None)


def framed(codec: Codec | None) -> bool:
    """Whether ``codec`` (None: the full codec) needs a transport's frame path."""
    return codec is not None and codec.framed


def on_wire(codec: Codec | None, sources: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """:meth:`Codec.on_wire` (None: the full codec, the sources themselves)."""
    return sources if codec is None else codec.on_wire(sources)


def landed(codec: Codec | None, targets: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """:meth:`Codec.landed` (None: the full codec, the targets themselves)."""
    return targets if codec is None else codec.landed(targets)


def payload_key(bucket: Bucket) -> int:
    """A bucket's payload key (:meth:`Encoder.key`, the default): buckets whose copies read the same
    source boxes as the same canonical boxes, in the same order, encode to the same payload (instances of one
    layout share a one-sided transport's slot)."""
    sig = repr(tuple((c.canonical, c.canon_box, c.src_tensor, c.src_box, c.dtype) for c in bucket.copies))
    return int.from_bytes(hashlib.blake2b(sig.encode(), digest_size=8).digest(), "little", signed=True)


_MASK = (1 << 64) - 1


def _signed(v: int) -> int:
    v &= _MASK
    return v - (1 << 64) if v >= (1 << 63) else v
