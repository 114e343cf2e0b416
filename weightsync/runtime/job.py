"""Job set-up shared by writers and readers: registration, cross-checks, the plan and its proof.

Every participant registers what it holds with the MetaServer (a typed
:class:`~weightsync.meta.records.Registration`: model spec digest and config, engine layout string,
layout digest, weightsync version, and every session option: transport, mode, co-location, bucket
budget, integrity cadence, delta), waits for the whole job, and refuses to go on -- before any byte
moves, and aborting the job so that every peer is told at once -- when anything differs. Then each side computes the same
plan from the same inputs and posts its pair hashes; the job starts only when every pair's two ends
agree.
"""

from __future__ import annotations

import socket
import time
from dataclasses import replace
from typing import Any

from weightsync import __version__
from weightsync.engines import make_layout
from weightsync.errors import ConfigError, JobMismatch, PlanError
from weightsync.layout.layout import EngineLayout, Layout, layout_digest
from weightsync.meta.client import MetaAborted, MetaClient, MetaError, MetaTimeout
from weightsync.meta.records import LayoutInfo, Profile, Registration, SessionTerms
from weightsync.meta.view import Census, Cohort, placement_of  # noqa: F401 - placement_of: re-exported
from weightsync.plan.job import JobShape  # noqa: F401 - re-exported: the runtime's callers name it here
from weightsync.plan.planner import Bucket, Pair, pair_hash
from weightsync.spec.model import ModelSpec
from weightsync.transport.base import Buffers

DEFAULT_MEMORY_BUDGET = 2 << 30  # bytes a transport may keep on a GPU beyond the weights


def enforce_memory_budget(client: MetaClient, budget: int | None, buffers: Buffers, who: str) -> int:
    """Refuse, before any byte moves, a transport whose buffers would exceed ``budget``; return their bytes.

    A transport keeps ``slots`` reusable buffers, each at most as large as the ``largest`` bucket it moves
    (only the messages it cannot move in place take room; see :func:`weightsync.payload.pack.stage`):
    that bound, allocated in the first step and kept, is all the GPU memory a step needs beyond the weights (a staged reader's copy of its weights and
    an async writer's snapshot are chosen on top of it). ``None``: no budget. A refusal aborts the
    whole job, so every peer stops at once.
    """
    slots, largest, need = buffers.slots, buffers.largest, buffers.bytes
    if budget is not None and need > budget:
        reason = (
            f"{who}: the transport would keep {slots} buffers of {largest} bytes (its largest bucket)"
            + (f" and what its codec keeps ({buffers.codec} bytes: delta keeps the previous version for delta "
               f"updates, delta_host=True keeps it in host memory instead; over nixl a framed codec's frames of "
               f"every bucket stay registered for the readers, FP8's ~0.6 of the rank's bf16 bytes)"
               if buffers.codec else "")
            + f" = {need} bytes beyond the weights, over the memory budget of {budget} bytes; "
            + (f"raise memory_budget (at least {need})" if buffers.codec >= budget else
               f"plan smaller buckets (bucket_bytes <= {budget // max(slots, 1)}) or raise memory_budget")
        )
        client.abort(reason)
        raise ConfigError(reason)
    return need


def registration(spec: ModelSpec, role: str, rank: int, engine: EngineLayout, layout: Layout, *,
                 instance: int | None = None, terms: SessionTerms | None = None, gpu: str | None = None,
                 backend: str | None = None, peer_copies: bool = True, instances: int | None = None) -> Registration:
    """What one participant registers (:class:`~weightsync.meta.records.Registration`): this host, this
    weightsync, the model, the layout's description and this rank's digest, and the session's options."""
    return Registration(role, rank, instance, host=socket.gethostname(), gpu=gpu, version=__version__,
                        model=spec.name, spec_digest=spec.digest,
                        layout=LayoutInfo(engine.describe(), engine.world_size, layout_digest(layout)), terms=terms,
                        backend=backend, peer_copies=peer_copies, instances=instances)


def register(client: MetaClient, record: Registration, spec: ModelSpec) -> None:
    """Register one participant (its model's config.json beside it); a model differing from the job's is
    refused, naming the first tensor that differs on each side (the MetaServer's reason, which aborted the
    job so that every peer learns it too)."""
    try:
        client.register(record, model_config=dict(spec.config))
    except MetaError as e:
        if e.status != 409:
            raise
        for c in client.census().cohorts:
            if c.profile.spec_digest and c.profile.spec_digest != spec.digest:  # the server's words name both
                raise JobMismatch(f"{record.who} refused before any transfer: {e.reason}") from None
        raise


def wait_side(client: MetaClient, role: str, timeout_s: float, count: int | None = None) -> Census:
    """One role's census (:class:`~weightsync.meta.view.Census`: each distinct profile once, counted), once all
    its participants registered (the first says how many there are); ``timeout_s``: how long to wait for
    them to arrive (each request keeps the client's own deadline)."""
    deadline = time.monotonic() + timeout_s
    side = "training" if role == "train" else "inference"
    try:
        if count is None:
            got = client.wait_census(1, role=role, timeout=timeout_s)
            first = got.cohorts[0]  # the first registrant's
            if first.profile.layout is None:
                raise JobMismatch(f"{first.who[0]} registered no layout: it is no weightsync session's participant")
            count = first.profile.layout.world * ((first.profile.instances or 1) if role == "infer" else 1)
            if got.count >= count:  # all there already
                return got
        return client.wait_census(count, role=role, timeout=max(0.1, deadline - time.monotonic()))
    except MetaTimeout:
        got = client.census(role).count
        raise MetaTimeout(f"set-up waited {timeout_s:g} s for the job's {side} participants: {got} of "
                          f"{count if count is not None else 'at least 1'} registered (a reader registers once its "
                          "engine has started); start the missing ones, or give a longer setup_timeout_s") from None


def sides(client: MetaClient, role: str, count: int, timeout_s: float) -> tuple[Census, Census]:
    """Both sides' censuses (training, inference) once the whole job registered, ``count`` of this
    participant's own ``role``: what agreement downloads, never a row per participant."""
    own = wait_side(client, role, timeout_s, count=count)
    other = wait_side(client, "infer" if role == "train" else "train", timeout_s)
    return (own, other) if role == "train" else (other, own)


def placed(client: MetaClient, shape: JobShape, instance: int | None = None) -> JobShape:
    """The shape with the placement of the ranks this participant's plan compares (a training rank's, or
    ``instance``'s; a co-located job's: every rank; an elastic one plans by the arithmetic rules)."""
    if shape.elastic:
        return shape
    return replace(shape, placement=client.placement(instance, whole=shape.colocate))


def _value(p: Profile, field: str) -> Any:
    """A profile's field by name: a session option (``terms``), the layout's, or the profile's own."""
    if field in SessionTerms.MEANING:
        return getattr(p.terms, field)
    if field in ("engine", "world"):
        return getattr(p.layout, field)
    return getattr(p, field)


def check_agreement(cohorts: list[Cohort], field: str, what: str) -> Any:
    """All participants must agree on ``field`` (a session option, ``engine``/``world`` of the layout, or a
    field of the profile); return the common value, else refuse naming who has which."""
    values: dict[Any, list[str]] = {}
    for c in cohorts:
        values.setdefault(_value(c.profile, field), []).extend(c.who)
    if len(values) > 1:
        detail = "; ".join(f"{v!r}: {', '.join(w[:3])}{' ...' if len(w) > 3 else ''}" for v, w in values.items())
        raise JobMismatch(f"participants disagree on {what}: {detail}")
    return next(iter(values))


def check_versions(cohorts: list[Cohort]) -> None:
    versions = {c.profile.version for c in cohorts}
    if len(versions) > 1:
        raise JobMismatch(f"weightsync versions differ across the job: {sorted(versions)}")


def job_shape(train: Census, infer: Census, terms: SessionTerms, elastic: bool = False) -> JobShape:
    """Cross-check every registration (each side's :class:`~weightsync.meta.view.Census`) and derive the shape
    both sides plan from: the layouts, and every session option (:class:`~weightsync.meta.records.SessionTerms`:
    transport, mode, co-location, bucket budget, integrity cadence, delta) the same on every participant and
    as ``terms`` (this participant's) say. A refusal names the option and who has which value. ``elastic``:
    instances may be missing or come later, see :attr:`JobShape.elastic`. The placement is not here: a
    participant downloads what concerns it once the shape holds (:func:`placed`)."""
    cohorts = [*train.cohorts, *infer.cohorts]
    bare = [w for c in cohorts if c.profile.layout is None or c.profile.terms is None for w in c.who]
    if bare:
        raise JobMismatch(f"{', '.join(bare[:3])}{' ...' if len(bare) > 3 else ''} registered no layout or no "
                          "session options: not a weightsync writer or reader")
    check_versions(cohorts)
    for field, what in SessionTerms.MEANING.items():  # every option, before any is used
        check_agreement(cohorts, field, what)
    agreed = cohorts[0].profile.terms
    if agreed != terms:
        diff = [f"{f}: this participant {getattr(terms, f)!r}, the job {getattr(agreed, f)!r}"
                for f in SessionTerms.MEANING if getattr(terms, f) != getattr(agreed, f)]
        raise ConfigError(f"this participant's options differ from the job's ({'; '.join(diff)})")
    shape = JobShape(
        train=check_agreement(list(train.cohorts), "engine", "the training layout"),
        infer=check_agreement(list(infer.cohorts), "engine", "the inference layout (instances must be alike)"),
        train_world=int(check_agreement(list(train.cohorts), "world", "the training world size")),
        infer_world=int(check_agreement(list(infer.cohorts), "world", "the inference world size")),
        instances=(infer.last_instance + 1) if elastic and infer.last_instance is not None else infer.instances,
        colocate=agreed.colocate,
        transport=agreed.transport,
        mode=agreed.mode,
        bucket_bytes=agreed.bucket_bytes,
        # a capability, not an agreement: one participant without it sends those pieces through the group
        peer_copies=all(c.profile.peer_copies for c in cohorts),
        elastic=elastic,
    )
    if elastic:  # instances come and go: only the trainers must all be there
        if train.count != shape.train_world:
            raise JobMismatch(f"expected {shape.train_world} training participants, got {train.count}")
    elif train.count != shape.train_world or infer.count != shape.instances * shape.infer_world:
        raise JobMismatch(
            f"expected {shape.train_world} training and {shape.instances}x{shape.infer_world} inference participants, "
            f"got {train.count} and {infer.count}"
        )
    return shape


def check_own_layout(shape_engine: str, spec: ModelSpec, rank: int, registered: str, who: str) -> None:
    """The job plans every rank's layout from the engine string it agreed on: refuse, before any byte
    moves, a participant whose own layout that string does not rebuild (an engine option lost on the
    wire would make both ends plan a layout nobody holds)."""
    rebuilt = layout_digest(make_layout(spec, shape_engine).layout(rank))
    if rebuilt != registered:
        raise JobMismatch(
            f"{who}: the layout the job plans from {shape_engine!r} differs from the one it holds (digest "
            f"{rebuilt} against {registered}); the engine's description drops an option it was built with: "
            "report this as a weightsync bug, and meanwhile use the engine's defaults for that option"
        )


def wait_plan_proven(client: MetaClient, timeout_s: float, participants: int) -> None:
    """Wait until all ``participants`` posted their pair hashes and every pair's two ends agree (a long-poll:
    the MetaServer answers once that holds, or a pair disagrees, or the job is aborted)."""
    try:
        check = client.wait_plan_hashes(participants, timeout=timeout_s)
    except MetaTimeout:
        check = client.check_plan_hashes()
        raise PlanError(f"plan hashes not confirmed by every peer within {timeout_s} s: {check['posted']} of "
                        f"{participants} participants posted; {check['pending_count']} pairs wait for their other "
                        f"end, e.g. {check['pending'][:5]}") from None
    if check.get("aborted"):  # a peer refused the job (e.g. its memory budget): fail now, with its reason
        raise MetaAborted(f"the job was aborted while this participant waited for the plan's proof: "
                          f"{check['aborted']}", 409)
    if check["mismatch_count"]:
        raise PlanError(f"plan hashes differ between the two ends of {check['mismatch_count']} pairs: "
                        f"{check['mismatches'][:5]}")
    if not check["plan_hashes_agree"]:
        raise PlanError(f"the participants' job-level plan hashes differ: {check['plan_hash_counts']}")


def hashes_of(plans: dict[Pair, list[Bucket]]) -> dict[Pair, str]:
    return {p: pair_hash(b) for p, b in plans.items()}
