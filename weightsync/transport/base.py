"""The transport interface: one abstract class per side, typed contexts in, one stats type out.

Modelled on ``torch.distributed.checkpoint``'s ``StorageWriter``/``StorageReader``: the job session
(:mod:`weightsync.runtime.session`) plans and proves; a transport only moves what the plan says.
Writer, reader and worker code call these methods and never ask which transport they hold, so a new
transport is one module implementing :class:`Sender` and :class:`Receiver` plus one line in
:data:`TRANSPORTS` (imported lazily: a p2p user never imports safetensors, a CPU user never CUDA IPC).

Call order on a training rank (:class:`Sender`)::

    1. Sender(options)          no I/O
    2. memory(ctx) -> Buffers   device memory it will keep beyond the weights; the session checks them
                                against the memory budget before anything is built
    3. connect(ctx)             once the plan is proven: join groups, share or register memory,
                                publish what the peers need (run again after a topology change)
    4. every step:
       send(step)               returns once this rank's part of ``step`` may be announced written
                                (async: once it is staged; the live weights do not change meanwhile, so
                                what is summed of them after ``send`` is what pulls are served,
                                :mod:`weightsync.integrity.check`)
       check(step)              after the step's bell rang, before it is recorded written: raise to
                                refuse recording it (co-located: the weights moved since shared)
       held(step)               sync: once every live instance holds it (file: remove its files)
    5. close()

Call order on an inference worker (:class:`Receiver`)::

    1. Receiver(options)        no I/O
    2. memory(ctx) -> Buffers   as above (a receiver may plan what else it moves here: a co-located
                                worker also sends for the training rank it proxies)
    3. connect(ctx)             once the plan is proven
    4. every step: receive(step, targets) -> StepStats   (sync), or pull(targets) -> Pulled (async)
    5. close()

``targets`` are where the step lands: the engine's live tensors, or a staged copy of them; a receiver
writes exactly the planned boxes of them and nothing else.

What each bucket's payload holds is the codec stage's (:mod:`weightsync.codec`), given in
``TransportOptions.codec``: the full codec (or None) is the plan's bytes, which each transport moves its own
way; a framed codec's encoder and decoder are made by the transport at ``memory``/``connect`` and its frames
moved by the transport's frame path. Where the plan's bytes arrive whole, the codec says how they land
(:meth:`~weightsync.payload.codec.Codec.unpacked`: a cast to the receiver's dtype is the codec's work; with no codec,
byte copies only). A transport imports no codec: the interface it uses, :class:`weightsync.payload.codec.Codec`, lies
below both.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from weightsync.errors import ConfigError
# what a transport may serve a codec, defined with the codec interface (:mod:`weightsync.payload.codec`)
from weightsync.payload.codec import BASE_PROOF, SENDER_STEP, SOURCES

#: how long a reader waits for a sync step's trainers to announce it while they are alive (a training step may take
#: minutes): generous, and apart from ``timeout_s``, which bounds the transfer once the step began
DEFAULT_WRITTEN_TIMEOUT_S = 3600.0

if TYPE_CHECKING:  # annotations only: a transport needs no runtime module to run
    import torch

    from weightsync.meta.client import MetaClient
    from weightsync.plan.planner import Bucket, Pair, Planner
    from weightsync.plan.job import JobShape
    from weightsync.transport.fence import Fence
    from weightsync.transport.liveness import TrainerWatch
    from weightsync.payload.codec import Codec

    Plans = Mapping[Pair, list[Bucket]]


@dataclass(frozen=True)
class StepStats:
    """What one side of one rank moved in one step, whatever the transport."""

    buckets: int
    bytes: int
    seconds: float
    #: seconds until the CPU had posted everything (on GPU the streams work on after that)
    posted: float = 0.0
    #: seconds until the first copy was posted (co-located: the step's set-up on the CPU)
    started: float = 0.0
    #: bytes this worker wrote into other workers' tensors (co-located push)
    pushed_bytes: int = 0
    #: the bytes the full codec would have moved, where the codec moved others (``bytes``: what moved)
    full_bytes: int = 0


@dataclass(frozen=True)
class Buffers:
    """The device memory a transport keeps beyond the weights: ``slots`` reusable buffers, each as large
    as the ``largest`` bucket it stages (allocated in the first step and kept)."""

    slots: int = 0
    largest: int = 0
    #: what the codec keeps beyond them (delta: the sender's previous version, a staged region, a
    #: receiver's scratch; :mod:`weightsync.codec`)
    codec: int = 0

    @property
    def bytes(self) -> int:
        return self.slots * self.largest + self.codec


@dataclass(frozen=True)
class Pulled:
    """An async pull: the steps the training ranks served (one, unless they moved on mid-pull)."""

    steps: frozenset[int]
    stats: StepStats


@dataclass(frozen=True)
class MetaLink:
    """How a worker process reaches the MetaServer (plain values: it crosses process boundaries)."""

    url: str
    job: str
    token: str | None = None

    def client(self, timeout_s: float) -> MetaClient:
        from weightsync.meta.client import MetaClient

        return MetaClient(self.url, self.job, token=self.token, timeout=timeout_s)


@dataclass(frozen=True)
class TransportOptions:
    """What a participant chose for its transport (the job agrees on ``name`` and ``mode``)."""

    name: str = "p2p"
    mode: str = "sync"
    backend: str = "gloo"  # process groups: "nccl" on GPU, "gloo" on CPU
    timeout_s: float = 60.0
    host: str = "127.0.0.1"  # where a group this rank hosts listens
    directory: str | None = None  # the file transport's directory
    peer_copies: bool = True  # co-located: read other GPUs' memory directly (CUDA peer access)
    #: what each bucket's payload holds (:mod:`weightsync.codec`); None: the plan's bytes themselves, landed as
    #: byte copies only (a target of another dtype than the wire's is refused: the cast is the full codec's, which
    #: the job session always passes)
    codec: Codec | None = None
    #: a reader's wait for a sync step's trainers to announce it, while they are alive (a training step may take
    #: minutes): not a transfer timeout
    written_timeout_s: float = DEFAULT_WRITTEN_TIMEOUT_S

    @property
    def framed(self) -> bool:
        """Whether the codec's payloads differ from the plan's bytes (the transport's frame path runs)."""
        return self.codec is not None and self.codec.framed


@dataclass
class SenderContext:
    """A training rank at set-up: its plan and live tensors (``connect`` may be called again with a new one)."""

    link: MetaLink
    client: MetaClient
    shape: JobShape
    rank: int
    planner: Planner
    plans: Plans
    tensors: Mapping[str, torch.Tensor]


@dataclass
class ReceiverContext:
    """An inference worker at set-up: its plan, live tensors and device (``link`` is set at connect)."""

    link: MetaLink | None
    shape: JobShape
    instance: int
    rank: int
    planner: Planner
    plans: Plans
    tensors: Mapping[str, torch.Tensor]
    device: torch.device
    #: co-located: this instance's workers write their own GPU's pieces into each other (off for a
    #: staged instance, or an engine whose tensors cannot be exported)
    push: bool = False
    #: whether the training ranks it waits on are alive (set at connect for a receiver that
    #: ``watches_trainers``; :mod:`weightsync.transport.liveness`); None: its waits end at ``timeout_s`` only
    watch: TrainerWatch | None = None


@dataclass(frozen=True)
class GroupWait:
    """Where a receiver's transfers wait on peers inside a group built by
    :func:`weightsync.transport.group.new_group`, which the worker watches there (their beats): the group, the
    group ranks it waits on, and how an error names one (p2p: a training rank; co-located: another inference
    worker, the group holding no trainer)."""

    group: Any
    peers: tuple[int, ...]
    describe: Callable[[int], str]
    #: the transfer's fence (:mod:`weightsync.transport.fence`): closed when the watcher gives up, so nothing lands
    #: after; None: the transfer has none
    fence: Fence | None = None
    #: how long the transfer may wait for its step to begin (the trainers may still be training: a sync step's
    #: ``written_timeout_s``) before its own deadline, ``timeout_s``, counts from the fence's ``begin``
    first_s: float = 0.0


class Sender(ABC):
    """A training rank's side of a transport (call order in the module docstring)."""

    #: the modes this transport runs ("sync": every step to every instance; "async": instances pull)
    modes: ClassVar[frozenset[str]] = frozenset({"sync"})

    def __init__(self, options: TransportOptions):
        self.options = options

    def memory(self, ctx: SenderContext) -> Buffers:
        """The device memory this transport will keep beyond the weights (none by default)."""
        return Buffers()

    @abstractmethod
    def connect(self, ctx: SenderContext) -> None: ...

    @abstractmethod
    def send(self, step: int) -> StepStats | None:
        """Move (or make available) this rank's part of ``step``; None when nothing moved yet (async)."""

    def check(self, step: int) -> None:
        """Refuse to record ``step`` as written (raise) when what the receivers read is not the step."""

    def held(self, step: int) -> None:
        """Sync: every live instance holds ``step`` (called after the wait): release what was kept for it."""

    def close(self) -> None:
        pass


class Receiver(ABC):
    """An inference worker's side of a transport (call order in the module docstring)."""

    modes: ClassVar[frozenset[str]] = frozenset({"sync"})
    #: whether receiving reads the trainers' memory, so it may start only once every trainer
    #: announced the step written (co-located); otherwise the transfer itself waits for the senders
    reads_after_written: ClassVar[bool] = False
    #: whether its waits depend on the trainers through nothing that breaks when one dies or stops (a file
    #: that never comes, a one-sided read): they then ask ``ctx.watch`` (:mod:`weightsync.transport.liveness`)
    #: and end in seconds, naming the rank. (p2p waits in a group with the trainers and watches their beats
    #: there; co-located workers copy memory that outlives its trainer, and their reader watches the trainers
    #: while it waits for ``written``.)
    watches_trainers: ClassVar[bool] = False
    #: whether ``receive`` itself waits for the trainers to announce the step (sync p2p: up to ``written_timeout_s``)
    #: before its transfer: the worker call's deadline then counts that wait too
    waits_for_step: ClassVar[bool] = False
    #: whether ``receive`` does its set-up, then calls :func:`weightsync.transport.gate.ready` before its first copy
    #: (a step's call sent before the step is written waits there); otherwise the worker waits before ``receive``
    sets_up_before_ready: ClassVar[bool] = False

    def __init__(self, options: TransportOptions):
        self.options = options

    def memory(self, ctx: ReceiverContext) -> Buffers:
        return Buffers()

    @abstractmethod
    def connect(self, ctx: ReceiverContext) -> None: ...

    @abstractmethod
    def receive(self, step: int, targets: Mapping[str, torch.Tensor]) -> StepStats: ...

    def pull(self, targets: Mapping[str, torch.Tensor]) -> Pulled:
        raise ConfigError(f"the {self.options.name} transport has no async mode")

    def group_wait(self) -> GroupWait | None:
        """The group the next transfer waits in and the peers it waits on there (after ``connect``; called once
        before each transfer); None: none."""
        return None

    def landed(self) -> bool:
        """Whether the last transfer (failed, say) may have written into a target: False only where it surely did
        not (its step never began), so a failed update that moved no byte need not withhold the engine."""
        return True

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class TransportEntry:
    """Where a transport's two sides live, imported only when a job uses it."""

    sender: str  # "module:Class"
    receiver: str
    modes: frozenset[str] = frozenset({"sync"})
    colocated: bool = False  # runs only co-located (True) or only separated (False)
    needs_directory: bool = False
    #: a sender's per-step work does not depend on which instances exist, so instances may join, leave
    #: or die while the trainers run (:mod:`weightsync.runtime.session`, "membership")
    elastic: bool = False
    #: per mode, what it serves a codec (:data:`weightsync.payload.codec.NEEDS`): the session refuses a
    #: codec whose needs it lacks (:func:`weightsync.codec.registry.check`)
    serves: Mapping[str, frozenset[str]] = field(default_factory=dict)


_BOTH = frozenset({SENDER_STEP, BASE_PROOF})

#: every transport; a new one is one module and one line here
TRANSPORTS: dict[str, TransportEntry] = {
    # p2p: proofs travel back before a sync step; an async pull serves the staged snapshot's plain bytes
    "p2p": TransportEntry("weightsync.transport.p2p:P2PSender", "weightsync.transport.p2p:P2PReceiver",
                          modes=frozenset({"sync", "async"}), serves={"sync": _BOTH}),
    # co-located: the workers copy the trainers' memory themselves (no sender step)
    "colocated": TransportEntry("weightsync.transport.colocated:ColocatedSender",
                                "weightsync.transport.colocated:ColocatedReceiver", colocated=True,
                                serves={"sync": frozenset({SOURCES})}),
    # file: frames are written beside the full file with their headers, each reader proves its base
    "file": TransportEntry("weightsync.transport.file:FileSender", "weightsync.transport.file:FileReceiver",
                           needs_directory=True, elastic=True, serves={"sync": _BOTH}),
    # nixl: frames are encoded into a registered region with an index of headers, read one-sided
    "nixl": TransportEntry("weightsync.transport.nixl:NixlSender", "weightsync.transport.nixl:NixlReceiver",
                           modes=frozenset({"sync", "async"}), elastic=True, serves={"sync": _BOTH, "async": _BOTH}),
}


def resolve(name: str, *, colocate: bool, mode: str, directory: str | None) -> str:
    """The registered transport a participant's options select, or a ConfigError saying what fits.

    ``colocate=True`` with the default ``"p2p"`` selects ``"colocated"`` (the users' spelling since the
    first release: same GPUs, the workers copy the shared weights)."""
    if mode not in ("sync", "async"):
        raise ConfigError(f"mode must be 'sync' or 'async', got {mode!r}")
    if colocate and name == "p2p":
        name = "colocated"
    entry = TRANSPORTS.get(name)
    if entry is None:
        raise ConfigError(f"unknown transport {name!r}; known: {', '.join(TRANSPORTS)}")
    if entry.colocated != colocate:
        raise ConfigError(f"the {name} transport runs {'only' if entry.colocated else 'not'} co-located; "
                          f"{'set colocate=True' if entry.colocated else 'use colocate=False'} or another transport")
    if mode not in entry.modes:
        raise ConfigError(f"{mode} mode runs over the {' or '.join(n for n, e in TRANSPORTS.items() if mode in e.modes)} "
                          f"transport, not {name}")
    if entry.needs_directory and not directory:
        raise ConfigError(f"the {name} transport needs a directory")
    return name


def _load(path: str) -> type:
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def elastic_transports() -> list[str]:
    """The transports whose instances may join, leave and die while the job runs."""
    return [n for n, e in TRANSPORTS.items() if e.elastic]


def receiver_class(name: str) -> type[Receiver]:
    return _load(TRANSPORTS[name].receiver)


def make_sender(options: TransportOptions) -> Sender:
    return _load(TRANSPORTS[options.name].sender)(options)


def make_receiver(options: TransportOptions) -> Receiver:
    return receiver_class(options.name)(options)
