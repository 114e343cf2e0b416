"""What a participant downloads at set-up: what concerns it, never a row for every participant.

Agreement (versions, model, layouts, options) needs only what a side's participants registered in
common: a :class:`Census` of a side lists each distinct :class:`~weightsync.meta.records.Profile` once,
with how many registered it and the first few of their names (so a refusal still names who has which),
and how many instances there are. The placement (each rank's host and GPU) is the one per-rank fact a
plan reads, and a plan reads it only where it compares ranks (:meth:`weightsync.plan.topology.Topology.nearest`:
a destination against its candidate sources, on one GPU or one host). :func:`concerning` cuts the job's
placement to those ranks: a training rank gets every inference rank's place and those of the training
ranks on their hosts; an instance its own ranks' and those of the training ranks on its hosts; the rest
are :data:`~weightsync.plan.topology.ELSEWHERE`. A co-located job's transport looks at every rank
(which worker acts for which trainer): it gets the whole placement. A cut is for planning only: a model of
the job's links (:mod:`weightsync.predict.simulate`) would see every ELSEWHERE rank on one host, so it wants
the whole (``MetaClient.placement(whole=True)``).

So a participant's set-up download grows with what it plans against, not with the job, and the
MetaServer's set-up traffic grows linearly in participants (BENCHMARKS.md, 2026-12-07). Both ends still
plan independently and prove it by pair hash: a cut that left out a rank a plan compares would show as
a mismatch before any byte moves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.errors import MetaError
from weightsync.meta.records import Profile, RecordError, Registration
from weightsync.plan.topology import ELSEWHERE, Placement

#: names a cohort carries for messages ("participants disagree on X: v: training rank 0, 1, 2 ...")
NAMES_KEPT = 3


def who_of(name: str) -> str:
    """``train:3`` / ``infer:2:0`` in words, as :attr:`Registration.who` says it."""
    parts = name.split(":")
    if parts[0] == "train":
        return f"training rank {parts[1]}"
    return f"inference rank {parts[2]} of instance {parts[1]}"


@dataclass(frozen=True)
class Cohort:
    """The participants of a census that registered one profile: how many, and the first few by name."""

    profile: Profile
    count: int
    names: tuple[str, ...]  # the first NAMES_KEPT, in name order

    @property
    def who(self) -> list[str]:
        return [who_of(n) for n in self.names] + ([f"{self.count - len(self.names)} more"]
                                                   if self.count > len(self.names) else [])


@dataclass(frozen=True)
class Census:
    """One side of a job (or the whole, ``role`` None) as agreement needs it: each distinct profile once."""

    ready: bool
    count: int
    cohorts: tuple[Cohort, ...] = ()
    instances: int = 0  # distinct instance ids among the participants (inference)
    last_instance: int | None = None  # the highest of them

    def __len__(self) -> int:
        return self.count

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ready": self.ready, "count": self.count}
        if self.ready:
            out["cohorts"] = [{"profile": c.profile.to_json(), "count": c.count, "names": list(c.names)}
                              for c in self.cohorts]
            out["instances"] = [self.instances, self.last_instance]
        return out

    @classmethod
    def from_json(cls, got: Mapping[str, Any]) -> "Census":
        try:
            if not got["ready"]:
                return cls(False, int(got["count"]))
            cohorts = tuple(Cohort(Profile.from_json(c["profile"]), int(c["count"]), tuple(str(n) for n in c["names"]))
                            for c in got["cohorts"])
            n, last = got["instances"]
            return cls(True, int(got["count"]), cohorts, int(n), None if last is None else int(last))
        except (RecordError, KeyError, TypeError, ValueError) as e:
            raise MetaError(f"the MetaServer's census does not parse ({type(e).__name__}: {e}); is the server a "
                            "weightsync of the same version?") from None


def census(records: Iterable[Registration]) -> Census:
    """The census of ``records`` (in name order, as the server keeps them)."""
    cohorts: dict[Profile, list] = {}
    ids: set[int] = set()
    count = 0
    for r in records:
        count += 1
        got = cohorts.get(p := Profile.of(r))
        if got is None:
            cohorts[p] = [1, [r.name]]
        else:
            got[0] += 1
            if len(got[1]) < NAMES_KEPT:
                got[1].append(r.name)
        if r.instance is not None:
            ids.add(r.instance)
    return Census(True, count, tuple(Cohort(p, n, tuple(names)) for p, (n, names) in cohorts.items()), len(ids),
                  max(ids, default=None))


def sides_of(records: Iterable[Registration]) -> tuple[Census, Census]:
    """The (training, inference) censuses of ``records``, as a job's set-up downloads them."""
    people = sorted(records, key=lambda r: r.name)
    return census(r for r in people if r.role == "train"), census(r for r in people if r.role == "infer")


# -- the placement ------------------------------------------------------------------------------------


def placement_of(train: Sequence[Registration], infer: Sequence[Registration]) -> Placement | None:
    """Where every rank runs, from what it registered: hosts by name, GPUs by their UUID (stable
    whatever ``CUDA_VISIBLE_DEVICES`` each process saw). A rank without a GPU (CPU) is a slot of its
    own on its host, so a CPU job spanning hosts still plans which pairs cross them. None when some
    rank has no GPU and every rank is on one host (the arithmetic rules of :class:`Topology` apply)."""
    people = [*train, *infer]
    hosts = sorted({p.host for p in people})
    if not all(p.gpu for p in people) and len(hosts) < 2:
        return None

    def slot(p: Registration) -> str:
        return p.gpu or f"cpu:{p.role}:{p.instance}:{p.rank}"

    host_index = {h: i for i, h in enumerate(hosts)}
    on_host: dict[str, set[str]] = {}
    for p in people:
        on_host.setdefault(p.host, set()).add(slot(p))
    slot_index = {h: {s: i for i, s in enumerate(sorted(slots))} for h, slots in on_host.items()}

    def where(p: Registration) -> tuple[int, int]:
        return host_index[p.host], slot_index[p.host][slot(p)]

    return Placement(tuple(where(p) for p in sorted(train, key=lambda p: p.rank)),
                     tuple(where(p) for p in sorted(infer, key=lambda p: (p.instance, p.rank))))


def concerning(whole: Placement, infer_world: int, instance: int | None = None) -> Placement:
    """The part of ``whole`` a participant's plan compares (module docstring): ``instance`` None, a
    training rank's (every inference rank, and the training ranks on their hosts); else that instance's
    (its ranks, and the training ranks on their hosts). The others are ELSEWHERE; the job's GPUs per host
    are kept, so every participant numbers GPUs alike."""
    if instance is None:
        infer = whole.infer
    else:
        mine = range(instance * infer_world, (instance + 1) * infer_world)
        infer = tuple(w if f in mine else ELSEWHERE for f, w in enumerate(whole.infer))
    hosts = {h for h, _ in infer if h >= 0}
    train = tuple(w if w[0] in hosts else ELSEWHERE for w in whole.train)
    return Placement(train, infer, whole.gpus_per_host)


def encode_placement(p: Placement | None) -> dict[str, Any]:
    """A placement as runs ``[first, host, slot, slot, ...]``: ranks first, first+1, ... on ``host`` at those
    GPU slots (one run a host where its ranks are numbered together); ELSEWHERE ranks are left out."""
    if p is None:
        return {"placement": None}

    def runs(where: tuple[tuple[int, int], ...]) -> list[list[int]]:
        out: list[list[int]] = []
        for r, (h, g) in enumerate(where):
            if h < 0:
                continue
            last = out[-1] if out else None
            if last is not None and last[1] == h and last[0] + len(last) - 2 == r:
                last.append(g)
            else:
                out.append([r, h, g])
        return out

    return {"placement": {"per_host": p.gpus_per_host, "sizes": [len(p.train), len(p.infer)],
                          "train": runs(p.train), "infer": runs(p.infer)}}


def decode_placement(got: Mapping[str, Any]) -> Placement | None:
    """The placement :func:`encode_placement` sent (None: the arithmetic rules apply)."""
    try:
        d = got["placement"]
        if d is None:
            return None
        n_train, n_infer = (int(x) for x in d["sizes"])

        def where(runs: list, n: int) -> tuple[tuple[int, int], ...]:
            out = [ELSEWHERE] * n
            for first, h, *slots in runs:
                if not (0 <= first and first + len(slots) <= n and slots and h >= 0 and min(slots) >= 0):
                    raise ValueError(f"run {[first, h, *slots]} outside {n} ranks")
                for k, g in enumerate(slots):
                    out[first + k] = (int(h), int(g))
            return tuple(out)

        return Placement(where(d["train"], n_train), where(d["infer"], n_infer), int(d["per_host"]))
    except (KeyError, TypeError, ValueError) as e:
        raise MetaError(f"the MetaServer's placement does not parse ({type(e).__name__}: {e}); is the server a "
                        "weightsync of the same version?") from None
