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
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from weightsync.errors import ConfigError

if TYPE_CHECKING:  # annotations only: a transport needs no runtime module to run
    import torch

    from weightsync.meta.client import MetaClient
    from weightsync.plan.planner import Bucket, Pair, Planner
    from weightsync.plan.job import JobShape

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
    #: delta updates: the bytes a full sync would have moved (``bytes`` is what moved)
    full_bytes: int = 0


@dataclass(frozen=True)
class Buffers:
    """The device memory a transport keeps beyond the weights: ``slots`` reusable buffers, each as large
    as the ``largest`` bucket it stages (allocated in the first step and kept)."""

    slots: int = 0
    largest: int = 0
    #: delta updates: the sender's copy of the version it sent last (:mod:`weightsync.delta.state`)
    previous: int = 0

    @property
    def bytes(self) -> int:
        return self.slots * self.largest + self.previous


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
    delta: bool = False  # send only what changed since the version each receiver proves (weightsync.delta)
    delta_host: bool = False  # delta: keep the previous version in (pinned) host memory, not on the device


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
    extra: dict = field(default_factory=dict)


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

    def snapshot(self) -> Mapping[str, torch.Tensor] | None:
        """Async: the staged copy of the weights that pulls are served from (its integrity sums are
        computed over it, :mod:`weightsync.integrity`); None where the sender stages none."""
        return None

    def close(self) -> None:
        pass


class Receiver(ABC):
    """An inference worker's side of a transport (call order in the module docstring)."""

    modes: ClassVar[frozenset[str]] = frozenset({"sync"})
    #: whether receiving reads the trainers' memory, so it may start only once every trainer
    #: announced the step written (co-located); otherwise the transfer itself waits for the senders
    reads_after_written: ClassVar[bool] = False

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
    #: runs delta updates (``delta=True``); a new transport opts in once it does (docs/delta.md)
    delta: bool = False


#: every transport; a new one is one module and one line here
TRANSPORTS: dict[str, TransportEntry] = {
    "p2p": TransportEntry("weightsync.transport.p2p:P2PSender", "weightsync.transport.p2p:P2PReceiver",
                          modes=frozenset({"sync", "async"}), delta=True),
    "colocated": TransportEntry("weightsync.transport.colocated:ColocatedSender",
                                "weightsync.transport.colocated:ColocatedReceiver", colocated=True),
    "file": TransportEntry("weightsync.transport.file:FileSender", "weightsync.transport.file:FileReceiver",
                           needs_directory=True, elastic=True, delta=True),
    "nixl": TransportEntry("weightsync.transport.nixl:NixlSender", "weightsync.transport.nixl:NixlReceiver",
                           modes=frozenset({"sync", "async"}), elastic=True, delta=True),
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
