"""The job session: the set-up sequence every participant process runs, written once for both sides.

A training rank runs a :class:`TrainerSession` (it speaks for itself); an inference instance's control
process runs an :class:`InstanceSession` (it speaks for every worker of its instance, which plan and
connect through :mod:`weightsync.runtime.worker`). :meth:`JobSession.setup` runs, in order::

    1. register   every participant this process speaks for registers what it holds (model, layout
                  and its digest, host and GPU, options); a model differing from the job's is refused
    2. agree      wait for the whole job; cross-check every registration (versions, layouts, options)
                  into one :class:`JobShape`; check this process's own layouts rebuild from it
    3. plan       this process's plans, their pair hashes, the memory each transport will keep, and (on
                  an integrity cadence, weightsync.integrity.check) each side's integrity part
    4. budget     that memory against the budget: a refusal aborts the job, so every peer stops at once
    5. bells      publish this process's doorbells -- before the proof, so every bell is out once the
                  plan is proven and the peers may open them in step 7 -- and a training rank its liveness
                  beacon, where the readers' waits ask it (weightsync.transport.liveness)
    6. prove      post the pair hashes; wait until every pair's two ends agree
    7. connect    the transports join their groups, share or open memory; open the peers' bells

Nothing moves before step 7, and every refusal before it names the tensor, rank or option. The steps
are methods so a topology change can run them again (``setup`` is re-entrant once ``close`` ran the
old transports down). Writer and reader (:mod:`weightsync.runtime.writer`, ``.reader``) only drive
steps.

Membership. On an *elastic* transport (``TransportEntry.elastic``: file, nixl; its sender's work does
not depend on the instances) instances join, leave and die while the trainers run:

- the trainers plan one instance slot (what they send serves every instance; file: each step's files
  are written once and every instance reads them) and never plan again; at set-up they wait until the
  instances the job started with have joined;
- an instance (initial or not, any id; a gone or left one under its old id) runs the same steps for
  itself alone: register, agree (the trainers' registrations and its own), plan its own receives; it
  posts no pair hashes (no trainer plans for it: what it reads is checked against its plan as it
  arrives, file: the pair hash in every file) and joins the MetaServer's membership only once
  connected, so the topology version grows and the next step the trainers write waits for it;
- ``close`` leaves (state ``left``); a trainer drops an instance that does not report a step held
  within ``instance_timeout_s`` (state ``gone``) and goes on with the live ones.

Non-elastic transports (p2p, colocated) keep a fixed set of instances: an instance id beyond the
count the job started with is refused, naming the elastic transports.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.codec.registry import job_codec_name, make_job_codec, requested
from weightsync.engines import make_layout
from weightsync.errors import ConfigError, WeightSyncError
from weightsync.integrity.cadence import DEFAULT_EVERY as DEFAULT_INTEGRITY
from weightsync.integrity.check import SentCheck
from weightsync.meta.client import MetaClient, MetaError, MetaTimeout
from weightsync.meta.heartbeat import Heartbeat
from weightsync.meta.records import SessionTerms
from weightsync.meta.view import Census
from weightsync.payload.codec import Codec, CodecJob
from weightsync.plan.planner import DEFAULT_BUCKET_BYTES, Bucket, Pair
from weightsync.runtime.device import device_uuid
from weightsync.runtime.doorbell import Doorbell, open_bells
from weightsync.runtime.job import (
    DEFAULT_MEMORY_BUDGET,
    JobShape,
    check_own_layout,
    enforce_memory_budget,
    hashes_of,
    job_shape,
    layout_digest,
    placed,
    register,
    registration,
    sides,
    wait_plan_proven,
)
from weightsync.spec.model import ModelSpec
from weightsync.transport.base import (
    DEFAULT_WRITTEN_TIMEOUT_S,
    TRANSPORTS,
    Buffers,
    MetaLink,
    Sender,
    SenderContext,
    TransportOptions,
    elastic_transports,
    make_sender,
    receiver_class,
    resolve,
)
from weightsync.transport.liveness import Beacon, TrainerWatch, beacon_host, beacon_name

log = logging.getLogger("weightsync.session")


#: how long set-up waits for the job's participants to arrive (register; elastic: join), at least: an
#: inference engine starts before its reader registers (17-82 s seen for vLLM; a trainer's connect waited
#: up to 93 s), so connect waits for the job this long while every request keeps its ``timeout_s``
SETUP_WAIT_S = 600.0


@dataclass(frozen=True)
class SessionOptions:
    """What one participant chose; validated once, here (a bad option is refused before any I/O).

    Two deadlines: ``timeout_s`` bounds every request and every wait of a step (and of set-up once the
    whole job is there); ``setup_timeout_s`` (default: the longer of ``timeout_s`` and
    :data:`SETUP_WAIT_S`) bounds how long ``connect`` waits for the job's other participants to arrive,
    so a trainer started before its engines waits for them, and a job whose peer never comes still
    fails, naming who is missing."""

    colocate: bool = False
    mode: str = "sync"
    transport: str = "p2p"  # as the user named it; ``transport_name`` is the registered one
    directory: str | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    memory_budget: int | None = DEFAULT_MEMORY_BUDGET
    timeout_s: float = 60.0
    peer_copies: bool = True
    host: str = "127.0.0.1"
    backend: str | None = None  # None: nccl for CUDA tensors, gloo otherwise
    integrity: int = DEFAULT_INTEGRITY  # check the steps divisible by N (weightsync.integrity); 0: none
    #: what each bucket's payload holds, by name (weightsync.codec.registry: full, delta, fp8, ...); None: the full
    #: codec, or what ``delta`` asks; an engine declared quant=fp8 takes the fp8 codec in the full codec's place
    codec: str | None = None
    delta: bool = False  # the older spelling of codec="delta": only what changed since the version each receiver proves
    delta_host: bool = False  # the codec keeps its state (delta: the sender's previous version) in host memory
    setup_timeout_s: float | None = None  # how long connect waits for the job to arrive (class docstring)
    #: a reader's wait for a sync step's trainers to announce it, while they are alive (a training step may take
    #: minutes); the transfer that follows has ``timeout_s``
    written_timeout_s: float = DEFAULT_WRITTEN_TIMEOUT_S
    transport_name: str = field(init=False, default="")  # the registered transport these options select

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.written_timeout_s <= 0:
            raise ConfigError(f"written_timeout_s must be positive, got {self.written_timeout_s}")
        if self.setup_timeout_s is not None and self.setup_timeout_s <= 0:
            raise ConfigError(f"setup_timeout_s must be positive, got {self.setup_timeout_s}")
        if self.bucket_bytes <= 0:
            raise ConfigError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        object.__setattr__(self, "transport_name", resolve(self.transport, colocate=self.colocate, mode=self.mode,
                                                           directory=self.directory))
        from weightsync.codec.registry import check

        check(self.codec_name, self.transport_name, self.mode)  # refused by name, before any I/O

    @property
    def setup_wait_s(self) -> float:
        """How long set-up waits for the job's participants to arrive."""
        return self.setup_timeout_s if self.setup_timeout_s is not None else max(self.timeout_s, SETUP_WAIT_S)

    @property
    def elastic(self) -> bool:
        """Whether instances may join, leave and die while the job runs (the transport says)."""
        return TRANSPORTS[self.transport_name].elastic

    @property
    def codec_name(self) -> str:
        """The codec these options ask for (:func:`weightsync.codec.registry.requested`); the job's may differ by
        its engine (:meth:`JobSession.job_options`)."""
        return requested(self.codec, self.delta)

    def transport_options(self, backend: str, codec: Codec | None = None) -> TransportOptions:
        """The transport's options with ``codec`` (None: the codec these options ask for, made before the job is
        known -- what a sender holds until the session makes the job's, :meth:`JobSession.job_options`)."""
        if codec is None:
            codec = make_job_codec(self.codec_name, CodecJob(host=self.delta_host))
        return TransportOptions(self.transport_name, self.mode, backend, self.timeout_s, self.host,
                                self.directory, self.peer_copies, codec=codec,
                                written_timeout_s=self.written_timeout_s)

    def terms(self) -> SessionTerms:
        """The options every participant must agree on, as registered with the MetaServer (each typed; a
        difference, the integrity cadence's included, is refused at set-up on every side at once)."""
        return SessionTerms(transport=self.transport_name, mode=self.mode, colocate=self.colocate,
                            bucket_bytes=self.bucket_bytes, integrity=self.integrity, codec=self.codec_name)


class JobSession(ABC):
    """One participant process's set-up (the steps in the module docstring)."""

    role: str  # "train" or "infer"
    instance_id: int | None = None  # the instance an inference session speaks for

    def __init__(self, client: MetaClient, link: MetaLink, spec: ModelSpec, options: SessionOptions):
        self.client, self.link, self.spec, self.options = client, link, spec, options
        self.shape: JobShape | None = None
        #: the job's training and inference sides as agreed (each distinct registration once, counted)
        self.sides: tuple[Census, Census] | None = None
        self.connected = False
        #: the job's codec (:meth:`agree`): what the options ask, unless the agreed engine decides
        self.codec_name = options.codec_name

    def check_alive(self) -> None:
        """Raise if the MetaServer no longer counts this participant (an async instance's refused heartbeat)."""

    def setup(self) -> None:
        """Run steps 1-7; return once the job is proven and this process connected."""
        t0 = time.perf_counter()
        self.register()
        self.sides = self.agree()
        buffers = self.plan()
        self.budget(buffers)
        self.publish_bells()
        self.prove()
        self.connect()
        self.connected = True
        log.info("%s set up in %.3f s: %s", self.who, time.perf_counter() - t0, self.shape)

    # -- the steps ------------------------------------------------------------------------------
    @abstractmethod
    def register(self) -> None: ...

    def agree(self) -> tuple[Census, Census]:
        """Both sides' censuses and the placement this process's plans compare (never a row per participant:
        :mod:`weightsync.meta.view`), cross-checked into the job's shape."""
        # the job arrives within setup_wait_s (an engine starts first); each request keeps timeout_s
        train, infer = sides(self.client, self.role, self.expected(), self.options.setup_wait_s)
        try:
            self.shape = job_shape(train, infer, self.options.terms(), self.options.elastic)
            self.check_layouts()
            # the job's codec: as asked, but an engine declared quant=fp8 takes fp8 (refused where it cannot run)
            self.codec_name = job_codec_name(self.options.codec_name, self.shape.infer, self.shape.transport,
                                             self.shape.mode, self.options.integrity)
        except WeightSyncError as e:  # every participant learns of it at once, not at its timeout
            log.error("%s refused the job: %s", self.who, e)
            with contextlib.suppress(MetaError):
                self.client.abort(f"{self.who}: {e}")
            raise
        self.shape = placed(self.client, self.shape, self.instance_id)
        return train, infer

    def job_options(self, backend: str) -> TransportOptions:
        """This participant's transport options with the job's codec, made for the agreed engine (after
        :meth:`agree`: the one place a session makes its codec)."""
        job = CodecJob(self.shape.infer, self.spec, host=self.options.delta_host)
        return self.options.transport_options(backend, make_job_codec(self.codec_name, job))

    @abstractmethod
    def expected(self) -> int:
        """How many participants of this process's own role the job has."""

    @abstractmethod
    def check_layouts(self) -> None:
        """Check this process's layouts rebuild from the agreed shape (:func:`check_own_layout`)."""

    @abstractmethod
    def plan(self) -> list[tuple[str, Buffers]]:
        """Plan; return (who, buffers) for each participant this process speaks for."""

    def budget(self, buffers: list[tuple[str, Buffers]]) -> None:
        for who, b in buffers:
            enforce_memory_budget(self.client, self.options.memory_budget, b, who)

    @abstractmethod
    def publish_bells(self) -> None: ...

    def prove(self) -> None:
        self.post_hashes()
        wait_plan_proven(self.client, self.options.timeout_s, self.participants_expected())

    @abstractmethod
    def post_hashes(self) -> None: ...

    def participants_expected(self) -> int:
        shape = self.shape
        return shape.train_world + shape.instances * shape.infer_world

    @abstractmethod
    def connect(self) -> None: ...

    @property
    @abstractmethod
    def who(self) -> str: ...


class TrainerSession(JobSession):
    """A training rank's set-up: one participant, its own sender."""

    role = "train"

    def __init__(self, client: MetaClient, link: MetaLink, train: Any, options: SessionOptions):
        super().__init__(client, link, train.spec, options)
        self.train = train
        device = next(iter(train.tensors.values())).device
        self.backend = options.backend or ("nccl" if device.type == "cuda" else "gloo")
        self.sender: Sender = make_sender(options.transport_options(self.backend))
        self.plans: Mapping[Pair, list[Bucket]] = {}
        #: the integrity part (weightsync.integrity.check.SentCheck), made at plan; None for integrity=0
        self.integrity = None
        self.written_bell: Doorbell | None = None
        self.held_bells: list[Doorbell] | None = None
        self.beacon: Beacon | None = None

    @property
    def who(self) -> str:
        return f"training rank {self.train.rank}"

    def register(self) -> None:
        t = self.train
        register(self.client, registration(t.spec, "train", t.rank, t.engine, t.layout, terms=self.options.terms(),
                                           gpu=device_uuid(next(iter(t.tensors.values())).device),
                                           backend=self.backend, peer_copies=self.options.peer_copies), t.spec)

    def expected(self) -> int:
        return self.train.engine.world_size

    def check_layouts(self) -> None:
        t = self.train
        check_own_layout(self.shape.train, t.spec, t.rank, layout_digest(t.layout), self.who)

    def plan(self) -> list[tuple[str, Buffers]]:
        # elastic: one instance slot, whatever instances come and go (module docstring)
        planner = self.shape.planner(self.spec, src=self.train.engine, instances=1 if self.shape.elastic else None)
        self.sender = make_sender(self.job_options(self.backend))  # made before the job was known, unconnected: anew
        self.plans = planner.send_plan(self.train.rank)
        self.context = SenderContext(self.link, self.client, self.shape, self.train.rank, planner, self.plans,
                                     self.train.tensors)
        # what the codec puts on the wire, summed on the cadence (async: write() stages the snapshot from
        # these tensors inside the same call, so their sums are the snapshot's)
        self.integrity = SentCheck.for_session(self.client, self.train.rank, self.plans, self.train.tensors,
                                               self.sender.options.codec, planner, self.options.integrity,
                                               sync=self.options.mode == "sync")
        return [(self.who, self.sender.memory(self.context))]

    def publish_bells(self) -> None:
        receiver = receiver_class(self.options.transport_name)
        # readers that copy out of our memory (co-located, nixl) wait for our `written` on this bell rather
        # than on the MetaServer, where they run on this host (open_bells: others long-poll as before)
        if self.options.mode == "sync" and receiver.reads_after_written:
            self.written_bell = Doorbell()
            self.client.publish(f"bell.written.{self.train.rank}", self.written_bell.address, replace=True)
        # whoever waits on this rank through nothing that breaks when it dies (a file, a one-sided read, the
        # `written` announcement) asks this beacon whether it is alive
        if watched_trainers(self.options):
            self.beacon = Beacon(beacon_host(self.options.host, self.link.url))
            self.client.publish(beacon_name(self.train.rank), self.beacon.address, replace=True)

    def post_hashes(self) -> None:
        self.client.post_plan_hashes("train", self.train.rank, hashes_of(self.plans))

    def prove(self) -> None:
        if not self.shape.elastic:
            return super().prove()
        # elastic: no instance plans against our hashes (they are posted for the record); the job starts
        # once the instances it started with have joined, so its first step reaches them all
        self.post_hashes()
        wait_joined(self.client, self.initial_instances(), self.options.setup_wait_s)

    def initial_instances(self) -> int:
        """How many instances the job starts with (what the first inference registrant said)."""
        infer = self.sides[1].cohorts
        return min(c.profile.instances or 1 for c in infer) if infer else 1

    def connect(self) -> None:
        # sync: the instances' `held` bells, when every reader is on this host (elastic: instances
        # come and go, so the MetaServer's membership says whom a step waits for)
        if self.options.mode == "sync" and not self.shape.elastic:
            names = [f"bell.held.{i}" for i in range(self.shape.instances)]
            self.held_bells = open_bells(self.client, names, self.options.timeout_s)
        self.sender.connect(self.context)

    def close(self) -> None:
        if self.integrity is not None:
            self.integrity.close()
        self.sender.close()
        if self.written_bell is not None:
            self.written_bell.close()
        if self.beacon is not None:
            self.beacon.close()


class InstanceSession(JobSession):
    """An inference instance's set-up, in its control process: every worker registers, plans and
    connects (the workers' halves run on them, :mod:`weightsync.runtime.worker`)."""

    role = "infer"

    def __init__(self, client: MetaClient, link: MetaLink, instance: Any, instance_id: int, instances: int,
                 options: SessionOptions, push: bool, staged: bool, instance_timeout_s: float | None = None):
        from weightsync.spec.model import spec_from_config

        super().__init__(client, link, spec_from_config(instance.model_config), options)
        self.instance, self.instance_id, self.instances = instance, instance_id, instances
        self.push, self.staged = push, staged
        self.engine = make_layout(self.spec, instance.engine)
        self.hashes: list[dict[Pair, str]] = []
        self.held_bell: Doorbell | None = None
        self.written_bells: list[Doorbell] | None = None
        #: sync, co-located or nixl: whether the training ranks are alive, asked while waiting for their `written`
        self.trainers: TrainerWatch | None = None
        self.backend = "gloo"
        #: elastic: the first step this instance must hold (none written before it joined is waited for)
        self.since = 0
        #: elastic: this reader's own id at the MetaServer: its joins, reports and leave carry it, so a
        #: stale process under the same instance id (dropped, then rejoined by another) counts no more
        self.incarnation: str | None = uuid.uuid4().hex if options.elastic else None
        #: async: no step waits for this instance, so it proves it is alive (weightsync.meta.heartbeat) within
        #: this many seconds (``instance_timeout_s``, default its timeout), else the MetaServer marks it gone;
        #: None in sync mode, where a step notices
        self.liveness_s = check_liveness(instance_timeout_s, options)
        self.heartbeat: Heartbeat | None = None

    @property
    def who(self) -> str:
        return f"instance {self.instance_id}"

    def register(self) -> None:
        from weightsync.runtime import worker

        opts = self.options
        # co-located: can each worker read the other GPUs (CUDA peer access)? One that cannot makes the job
        # send those pieces through the workers' group instead
        probes = self.instance.call(worker.probe, opts.colocate and opts.peer_copies, timeout_s=opts.timeout_s)
        if not opts.elastic:  # elastic: joins once connected (``connect``)
            self.client.join(self.instance_id, liveness_s=self.liveness_s)
            self._beat()
        for rank, p in enumerate(probes):
            register(self.client, registration(
                self.spec, "infer", rank, self.engine, self.engine.layout(rank), instance=self.instance_id,
                terms=opts.terms(), gpu=p.gpu, instances=self.instances,
                peer_copies=p.reaches_peers if opts.colocate and opts.peer_copies else opts.peer_copies), self.spec)

    @property
    def reads_after_written(self) -> bool:
        """Whether the workers copy out of the trainers' memory, so a step may start only once announced."""
        return receiver_class(self.options.transport_name).reads_after_written

    @property
    def step_wait_s(self) -> float:
        """How long a step's receive may wait for the trainers to announce it inside the worker call (sync p2p and file:
        ``written_timeout_s``; elsewhere the reader waits before or beside the call), beyond the transfer's own."""
        waits = self.options.mode == "sync" and receiver_class(self.options.transport_name).waits_for_step
        return self.options.written_timeout_s if waits else 0.0

    def expected(self) -> int:
        return self.instances * self.engine.world_size

    def check_layouts(self) -> None:
        for rank in range(self.engine.world_size):
            check_own_layout(self.shape.infer, self.spec, rank, layout_digest(self.engine.layout(rank)),
                             f"{self.who} rank {rank}")

    def plan(self) -> list[tuple[str, Buffers]]:
        from weightsync.runtime import worker

        self.backend = self.sides[0].cohorts[0].profile.backend or "gloo"
        # co-located workers write into each other's weights (``push``: their live tensors are exported
        # to each other by CUDA IPC; off when the engine's cannot be), unless each commits its own copy
        planned = self.instance.call(worker.plan, self.shape, dict(self.instance.model_config), self.instance_id,
                                     self.push and not self.staged,
                                     self.job_options(self.backend), self.options.integrity,
                                     timeout_s=self.options.timeout_s)
        self.hashes = [p.hashes for p in planned]
        return [(f"{self.who} rank {r}", p.buffers) for r, p in enumerate(planned)]

    def publish_bells(self) -> None:
        # sync: the trainers on this host wait for our `held` on this bell rather than on the MetaServer
        # (elastic: they ask the MetaServer, which knows who is a member)
        if self.options.mode == "sync" and not self.options.elastic:
            self.held_bell = Doorbell()
            self.client.publish(f"bell.held.{self.instance_id}", self.held_bell.address, replace=True)

    def post_hashes(self) -> None:
        for rank, pairs in enumerate(self.hashes):
            self.client.post_plan_hashes("infer", rank, pairs, instance=self.instance_id)

    def prove(self) -> None:
        if not self.shape.elastic:  # elastic: no trainer planned for us (module docstring)
            super().prove()

    def connect(self) -> None:
        from weightsync.runtime import worker

        opts = self.options
        # co-located or nixl: the trainers' `written` bells, when every trainer is on this host, and their liveness
        if opts.mode == "sync" and self.reads_after_written:
            names = [f"bell.written.{t}" for t in range(self.shape.train_world)]
            self.written_bells = open_bells(self.client, names, opts.timeout_s)
            self.trainers = TrainerWatch(self.link, self.who)
            self.trainers.connect(range(self.shape.train_world), opts.timeout_s)
        self.instance.call(worker.connect, self.link, timeout_s=worker.call_timeout(opts.timeout_s))
        if opts.elastic:  # a member from now on: the next step the trainers write waits for us
            got = self.client.join(self.instance_id, incarnation=self.incarnation, liveness_s=self.liveness_s)
            self._beat()
            self.since = self.client.members()[self.instance_id].since
            log.info("%s joined at topology version %s (members %s), holding steps from %d on", self.who,
                     got["version"], got["instances"], self.since)

    def _beat(self) -> None:
        """Async, once joined: start the heartbeat (a joined member that stops it is marked gone)."""
        if self.liveness_s is not None and self.heartbeat is None:
            self.heartbeat = Heartbeat(self.client, self.instance_id, self.liveness_s, self.incarnation,
                                       owner=self).start()

    def check_alive(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.check()

    def close(self) -> None:
        from weightsync.runtime import worker

        if self.held_bell is not None:
            self.held_bell.close()
        if self.trainers is not None:
            self.trainers.close()
        beating, self.heartbeat = self.heartbeat, None
        if beating is not None:
            beating.stop()
        try:
            # out from the next step the trainers write; async: left, rather than gone once its heartbeat stops
            if (self.options.elastic and self.connected) or beating is not None:
                with contextlib.suppress(MetaError):
                    self.client.leave(self.instance_id, reason="closed", incarnation=self.incarnation)
        finally:
            self.instance.call(worker.disconnect, timeout_s=self.options.timeout_s)


class SessionDriven:
    """What writer and reader share: a session set up once, on :meth:`connect` or their first step."""

    session: JobSession

    def connect(self):
        """Set the job up (once): register, agree, plan, budget, bells, prove, connect. Call it on every
        participant at once (each waits for the whole job), or let the first write/update/pull do it. Every
        call raises once the MetaServer dropped this instance for silence (async: its heartbeat refused)."""
        if not self.session.connected:
            self.session.setup()
        self.session.check_alive()
        return self

    @property
    def shape(self) -> JobShape:
        return self.connect().session.shape


def watched_trainers(options: SessionOptions) -> bool:
    """Whether the job's readers ask the training ranks' liveness (:mod:`weightsync.transport.liveness`): its
    workers' waits do (``watches_trainers``: file, nixl), or its readers wait for `written` (sync co-located or
    nixl). p2p workers watch the trainers' beats in the group they share."""
    receiver = receiver_class(options.transport_name)
    return receiver.watches_trainers or (options.mode == "sync" and receiver.reads_after_written)


def check_instance_id(instance_id: int, instances: int, options: SessionOptions) -> None:
    """Refuse, before any I/O, an instance id the job cannot take: beyond the instances a fixed-membership
    job starts with, a join only elastic transports allow."""
    if instance_id < 0 or instances < 1:
        raise ConfigError(f"instance_id must be >= 0 and instances >= 1, got {instance_id} and {instances}")
    if instance_id >= instances and not options.elastic:
        raise ConfigError(
            f"instance {instance_id} cannot join a job of {instances} instance(s) over the {options.transport_name} "
            f"transport: its set of instances is fixed when the job starts; instances may join, leave and die "
            f"only over an elastic transport ({', '.join(elastic_transports())}), or start the job with "
            f"instances={instance_id + 1}"
        )


def check_liveness(instance_timeout_s: float | None, options: SessionOptions) -> float | None:
    """An async instance's heartbeat deadline (``instance_timeout_s``, default ``timeout_s``); None in sync mode."""
    from weightsync.meta.validate import MAX_LIVENESS_S, MIN_LIVENESS_S

    if options.mode != "async":
        return None
    if instance_timeout_s is None:  # the reader's timeout, within what the MetaServer keeps
        return float(min(max(options.timeout_s, MIN_LIVENESS_S), MAX_LIVENESS_S))
    liveness = instance_timeout_s
    if not MIN_LIVENESS_S <= liveness <= MAX_LIVENESS_S:
        raise ConfigError(f"instance_timeout_s (async: how long the MetaServer waits for an instance's heartbeat "
                          f"before marking it gone; default timeout_s) must be within [{MIN_LIVENESS_S:g}, "
                          f"{MAX_LIVENESS_S:g}] s, got {liveness:g}")
    return float(liveness)


def wait_joined(client: MetaClient, count: int, timeout_s: float) -> list[int]:
    """Wait until at least ``count`` instances are members of the job; return them."""
    deadline = time.monotonic() + timeout_s
    got = client.instances()
    while len(got["instances"]) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise MetaTimeout(f"only instances {got['instances']} joined the job within {timeout_s:g} s; "
                              f"it starts with {count}")
        try:
            got = client.wait_topology(got["version"], timeout=left)
        except MetaTimeout:
            got = client.instances()
    return got["instances"]
