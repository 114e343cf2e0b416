"""The typed records client, server and runtime exchange about a job's participants.

:class:`Registration` is what one participant registers: who it is and where it runs (role, rank,
instance, host, GPU), the model (name, spec digest; its ``config.json`` travels once, beside it, and is
named here by :attr:`Registration.config_digest`), its layout (:class:`LayoutInfo`), and the session
options every participant must agree on, each a typed field (:class:`SessionTerms`: transport, mode,
co-location, bucket budget, integrity cadence, delta). The MetaServer keeps these records typed, the
client parses them once, the runtime cross-checks them field by field (:func:`weightsync.runtime.job.job_shape`).

A bare coordinator participant (a test, a tool) may register its identity alone: ``layout`` and ``terms``
are then None, and a weightsync session refuses to plan with it.

The listing (``GET .../participants``, for tools and tests: set-up downloads a census and a placement
instead, :mod:`weightsync.meta.view`) sends what varies per participant in each row (a list of values,
its ``columns`` named once) and what a whole side shares (model, layout description, options, version)
once per distinct value, as a :class:`Profile` named by its digest: N rows per answer, not N full records
with their model configs (:func:`encode_listing`, :func:`decode_listing`).

:class:`Member` is one instance's membership (joined, left or gone), as the server keeps it and the job
summary shows it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from weightsync.errors import MetaError

ROLES = ("train", "infer")
MAX_ENGINE = 256  # characters of a layout description ("megatron:tp=8,pp=4,...")


class RecordError(ValueError):
    """A record that does not parse; the server answers 400 with this message, the client raises MetaError."""


def _str(d: Mapping[str, Any], key: str, max_len: int, default: str | None = None, what: str = "") -> str:
    v = d.get(key, default)
    if not isinstance(v, str) or len(v) > max_len:
        raise RecordError(f"{what or key} must be a string of at most {max_len} characters, got {_short(v)}")
    return v


def _opt_str(d: Mapping[str, Any], key: str, max_len: int, what: str = "") -> str | None:
    return None if d.get(key) is None else _str(d, key, max_len, what=what)


def _int(d: Mapping[str, Any], key: str, lo: int, hi: int, default: int | None = None, what: str = "") -> int:
    v = d.get(key, default)
    if type(v) is not int or not lo <= v <= hi:  # bool is an int subclass: refused too
        raise RecordError(f"{what or key} must be an integer in [{lo}, {hi}], got {_short(v)}")
    return v


def _bool(d: Mapping[str, Any], key: str, default: bool | None = None, what: str = "") -> bool:
    v = d.get(key, default)
    if type(v) is not bool:
        raise RecordError(f"{what or key} must be true or false, got {_short(v)}")
    return v


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _only(d: Any, allowed: set[str], what: str) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise RecordError(f"{what} must be an object, got {_short(d)}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise RecordError(f"unknown fields {unknown} in {what}; allowed: {sorted(allowed)}")
    return d


def digest_of(value: Any) -> str:
    """A short digest of a JSON value (keys sorted): equal values, equal digests."""
    return hashlib.blake2b(json.dumps(value, sort_keys=True, separators=(",", ":")).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class SessionTerms:
    """The options every participant of a job must agree on, checked at set-up, before any byte moves."""

    transport: str  # the registered transport (p2p, colocated, file, nixl, ...)
    mode: str  # sync or async
    colocate: bool
    bucket_bytes: int
    integrity: int  # the integrity cadence: steps divisible by it are checked; 0: none
    codec: str  # what each bucket's payload holds, as the options ask it (weightsync.codec.registry): full, delta, ...

    #: each field, in words, for a refusal that names what differs
    MEANING = {
        "transport": "the transport",
        "mode": "sync or async mode",
        "colocate": "co-location",
        "bucket_bytes": "the bucket budget",
        "integrity": "the integrity cadence (integrity=N: every participant checks the same steps)",
        "codec": "the codec (codec=NAME, or delta=True, on every writer and reader alike)",
    }

    def to_json(self) -> dict[str, Any]:
        return {"transport": self.transport, "mode": self.mode, "colocate": self.colocate,
                "bucket_bytes": self.bucket_bytes, "integrity": self.integrity, "codec": self.codec}

    @classmethod
    def from_json(cls, d: Any) -> "SessionTerms":
        d = _only(d, {"transport", "mode", "colocate", "bucket_bytes", "integrity", "codec"}, "terms")
        return cls(_str(d, "transport", 64, what="terms.transport"), _str(d, "mode", 16, what="terms.mode"),
                   _bool(d, "colocate", what="terms.colocate"),
                   _int(d, "bucket_bytes", 1, 1 << 62, what="terms.bucket_bytes"),
                   _int(d, "integrity", 0, 1 << 62, what="terms.integrity"), _str(d, "codec", 32, what="terms.codec"))


@dataclass(frozen=True)
class LayoutInfo:
    """A participant's layout: its engine's description (what the job plans from), world size, and
    the digest of this rank's own local tensors (checked against the plan's rebuild of it)."""

    engine: str  # e.g. "megatron:tp=2,pp=2" or "vllm:tp=2"
    world: int
    digest: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "world": self.world, "digest": self.digest}

    @classmethod
    def from_json(cls, d: Any) -> "LayoutInfo":
        d = _only(d, {"engine", "world", "digest"}, "layout")
        return cls(_str(d, "engine", MAX_ENGINE, what="layout.engine"), _int(d, "world", 1, 1 << 20, what="layout.world"),
                   _str(d, "digest", 128, "", what="layout.digest"))


#: the fields each listing row carries; the rest is the row's profile, sent once per distinct value
ROW_FIELDS = ("role", "rank", "instance", "host", "gpu", "address", "layout_digest")


@dataclass(frozen=True)
class Profile:
    """What a side's participants register in common and must agree on (a registration less its row:
    who, where, and its own layout digest); a census or a listing sends each distinct one once."""

    version: str = ""
    model: str = ""
    spec_digest: str = ""
    config_digest: str = ""
    layout: LayoutInfo | None = None  # engine and world; the digest is each rank's own (not shared)
    terms: SessionTerms | None = None
    backend: str | None = None
    peer_copies: bool = True
    instances: int | None = None

    @classmethod
    def of(cls, rec: "Registration") -> "Profile":
        layout = None if rec.layout is None else LayoutInfo(rec.layout.engine, rec.layout.world)
        return cls(rec.version, rec.model, rec.spec_digest, rec.config_digest, layout, rec.terms, rec.backend,
                   rec.peer_copies, rec.instances)

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "model": self.model, "spec_digest": self.spec_digest,
                "config_digest": self.config_digest,
                "layout": None if self.layout is None else {"engine": self.layout.engine, "world": self.layout.world},
                "terms": None if self.terms is None else self.terms.to_json(), "backend": self.backend,
                "peer_copies": self.peer_copies, "instances": self.instances}

    @classmethod
    def from_json(cls, d: Any) -> "Profile":
        d = _only(d, {"version", "model", "spec_digest", "config_digest", "layout", "terms", "backend", "peer_copies",
                      "instances"}, "a profile")
        return cls(
            version=_str(d, "version", 64, ""), model=_str(d, "model", 256, ""),
            spec_digest=_str(d, "spec_digest", 128, ""), config_digest=_str(d, "config_digest", 64, ""),
            layout=None if d.get("layout") is None else LayoutInfo.from_json(d["layout"]),
            terms=None if d.get("terms") is None else SessionTerms.from_json(d["terms"]),
            backend=_opt_str(d, "backend", 32), peer_copies=_bool(d, "peer_copies", True),
            instances=None if d.get("instances") is None else _int(d, "instances", 1, 1 << 20),
        )


@dataclass(frozen=True)
class Registration:
    """One participant's registration (module docstring)."""

    role: str  # train or infer
    rank: int  # within its side (infer: within its instance)
    instance: int | None = None  # infer only
    host: str = ""
    gpu: str | None = None  # its GPU's UUID; None on CPU
    address: str = ""
    version: str = ""  # weightsync's
    model: str = ""  # the model's name, for messages
    spec_digest: str = ""
    config_digest: str = ""  # the digest of its config.json (set by the server from the config sent beside it)
    layout: LayoutInfo | None = None
    terms: SessionTerms | None = None
    backend: str | None = None  # train: its collective backend (nccl, gloo); the readers use the trainers'
    peer_copies: bool = True  # co-located: reads the other GPUs directly (a capability, not an agreement)
    instances: int | None = None  # infer: how many instances the job starts with

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise RecordError(f"role must be one of {list(ROLES)}, got {_short(self.role)}")
        if (self.role == "infer") != (self.instance is not None):
            raise RecordError("instance is required for role infer and only for it")

    @property
    def name(self) -> str:
        """``train:R`` or ``infer:I:R``: how messages and the server name a participant."""
        return f"train:{self.rank}" if self.role == "train" else f"infer:{self.instance}:{self.rank}"

    @property
    def who(self) -> str:
        """The participant in words: "training rank 3", "inference rank 0 of instance 2"."""
        if self.role == "train":
            return f"training rank {self.rank}"
        return f"inference rank {self.rank} of instance {self.instance}"

    # -- JSON ------------------------------------------------------------------------------------
    def row(self) -> dict[str, Any]:
        """What varies per participant (a listing row)."""
        return {"role": self.role, "rank": self.rank, "instance": self.instance, "host": self.host, "gpu": self.gpu,
                "address": self.address, "layout_digest": self.layout.digest if self.layout else ""}

    def profile(self) -> dict[str, Any]:
        """What a whole side of a job shares (:class:`Profile`; sent once per distinct value in a listing)."""
        return Profile.of(self).to_json()

    def to_json(self) -> dict[str, Any]:
        """The whole record (what is posted, without ``config_digest``, and what the server stores)."""
        out = {**self.profile(), **self.row()}
        out["layout"] = None if self.layout is None else self.layout.to_json()
        del out["layout_digest"]
        return out

    @classmethod
    def from_json(cls, d: Any, *, posted: bool = False) -> "Registration":
        """Parse (``posted``: a registration as sent, whose ``config_digest`` the server sets)."""
        allowed = {"role", "rank", "instance", "host", "gpu", "address", "version", "model", "spec_digest", "layout",
                   "terms", "backend", "peer_copies", "instances"} | (set() if posted else {"config_digest"})
        d = _only(d, allowed, "the registration")
        inst = d.get("instance")
        return cls(
            role=_str(d, "role", 8),
            rank=_int(d, "rank", 0, 1 << 20),
            instance=None if inst is None else _int(d, "instance", 0, 1 << 20),
            host=_str(d, "host", 255, ""),
            gpu=_opt_str(d, "gpu", 128),
            address=_str(d, "address", 512, ""),
            version=_str(d, "version", 64, ""),
            model=_str(d, "model", 256, ""),
            spec_digest=_str(d, "spec_digest", 128, ""),
            config_digest="" if posted else _str(d, "config_digest", 64, ""),
            layout=None if d.get("layout") is None else LayoutInfo.from_json(d["layout"]),
            terms=None if d.get("terms") is None else SessionTerms.from_json(d["terms"]),
            backend=_opt_str(d, "backend", 32),
            peer_copies=_bool(d, "peer_copies", True),
            instances=None if d.get("instances") is None else _int(d, "instances", 1, 1 << 20),
        )

    @classmethod
    def from_listing(cls, row: Mapping[str, Any], profile: Mapping[str, Any]) -> "Registration":
        """One listing row with its profile."""
        d = {k: v for k, v in {**profile, **row}.items() if k != "layout_digest"}
        if d.get("layout") is not None:
            d["layout"] = {**d["layout"], "digest": row.get("layout_digest", "")}
        d.pop("profile", None)
        return cls.from_json(d)

    @classmethod
    def legacy(cls, d: Mapping[str, Any]) -> tuple["Registration", dict]:
        """A record of a server before typed registrations (``engine_config`` a flat dict, ``model_config``
        inside): the typed record and its model config, for a restart on an older state."""
        ec = dict(d.get("engine_config") or {})
        layout = LayoutInfo(str(ec["engine"]), int(ec["world"]), str(d.get("layout_digest", ""))) \
            if "engine" in ec and "world" in ec else None
        keys = ("transport", "mode", "colocate", "bucket_bytes", "integrity", "delta")
        terms = SessionTerms(str(ec["transport"]), str(ec["mode"]), bool(ec["colocate"]), int(ec["bucket_bytes"]),
                             int(ec["integrity"]), "delta" if ec["delta"] else "full") if all(k in ec for k in keys) else None
        gpu = ec.get("gpu")
        rec = cls(str(d["role"]), int(d["rank"]), None if d.get("instance") is None else int(d["instance"]),
                  str(d.get("host", "")), None if gpu is None else str(gpu), str(d.get("address", "")),
                  str(d.get("version", "")), str(ec.get("model", "")), str(d.get("spec_digest", "")), "", layout,
                  terms, None if ec.get("backend") is None else str(ec["backend"]), bool(ec.get("peer_copies", True)),
                  None if ec.get("instances") is None else int(ec["instances"]))
        config = dict(d.get("model_config") or {})
        return (replace(rec, config_digest=digest_of(config)) if config else rec), config


def post_body(rec: Registration, model_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """A registration as posted: the record and, beside it, the model's config.json (sent once; the
    server keeps one copy per distinct config and lists only its digest)."""
    body = rec.to_json()
    del body["config_digest"]
    if rec.instance is None:
        del body["instance"]
    if model_config:
        body["model_config"] = dict(model_config)
    return body


# -- the listing ------------------------------------------------------------------------------------


@dataclass
class Listing:
    """A participants listing as the server encodes it (the profiles once, then one row each)."""

    ready: bool
    count: int
    participants: list[Registration] = field(default_factory=list)


def encode_listing(records: Iterable[Registration]) -> bytes:
    """The ``"profiles"`` and ``"participants"`` members of a listing answer (JSON text, without braces)."""
    profiles: dict[str, dict[str, Any]] = {}
    by_value: dict[str, str] = {}
    rows = []
    for r in records:
        p = r.profile()
        key = json.dumps(p, sort_keys=True, separators=(",", ":"))
        d = by_value.get(key)
        if d is None:
            d = by_value[key] = hashlib.blake2b(key.encode(), digest_size=6).hexdigest()
            profiles[d] = p
        row = r.row()
        rows.append([*(row[k] for k in ROW_FIELDS), d])
    return (b'"columns": ' + json.dumps([*ROW_FIELDS, "profile"]).encode() + b', "profiles": '
            + json.dumps(profiles, separators=(",", ":")).encode() + b', "participants": '
            + json.dumps(rows, separators=(",", ":")).encode())


def decode_listing(got: Mapping[str, Any]) -> Listing:
    """A listing answer as typed records (a malformed one raises MetaError, naming what is wrong)."""
    try:
        profiles, columns = got.get("profiles") or {}, got.get("columns") or []
        people = []
        for values in got.get("participants") or []:
            row = dict(zip(columns, values, strict=True))
            people.append(Registration.from_listing(row, profiles[row.pop("profile")]))
        return Listing(bool(got["ready"]), int(got["count"]), people)
    except (RecordError, KeyError, TypeError, ValueError) as e:
        raise MetaError(f"the MetaServer's participants listing does not parse ({type(e).__name__}: {e}); is the "
                        "server a weightsync of the same version?") from None


# -- membership --------------------------------------------------------------------------------------


MEMBER_STATES = ("joined", "left", "gone")


@dataclass(frozen=True)
class Member:
    """One instance's membership, as the server keeps it and the job summary's ``members`` shows it.
    ``incarnation``: the joining reader's own id, so a stale process under the same instance id (one that
    was dropped, then rejoined by another) can neither report steps held nor leave for it. ``liveness_s``:
    the member is marked gone once nothing was heard from it for that long (an async reader's heartbeat:
    no step waits for it, so nothing else notices it died)."""

    instance: int
    state: str  # joined, left or gone
    since: int  # the first step it must hold (no step written before it joined is waited for)
    version: int  # the topology version of its last change
    held: int | None = None  # the latest step it reported held
    reason: str | None = None  # why it left or was dropped
    incarnation: str | None = None  # the joined reader's own id (elastic readers carry one)
    #: the MetaServer marks it gone once it has not heard from it for this long (async readers' heartbeat)
    liveness_s: float | None = None

    @property
    def joined(self) -> bool:
        return self.state == "joined"

    def to_json(self) -> dict[str, Any]:
        """The record as the server stores it and the summary shows it (``held`` is kept beside it)."""
        rec: dict[str, Any] = {"state": self.state, "since": self.since, "version": self.version}
        if self.reason:
            rec["reason"] = self.reason
        if self.incarnation:
            rec["incarnation"] = self.incarnation
        if self.liveness_s is not None:
            rec["liveness_s"] = self.liveness_s
        return rec

    def owes(self, step: int) -> bool:
        """Whether ``step`` waits for this member and it has not reported it held yet."""
        return self.joined and self.since <= step and (self.held is None or self.held < step)

    @classmethod
    def from_json(cls, instance: int | str, d: Mapping[str, Any]) -> "Member":
        try:
            return cls(int(instance), str(d["state"]), int(d["since"]), int(d["version"]),
                       held=None if d.get("held") is None else int(d["held"]), reason=d.get("reason"),
                       incarnation=d.get("incarnation"),
                       liveness_s=None if d.get("liveness_s") is None else float(d["liveness_s"]))
        except (KeyError, TypeError, ValueError) as e:
            raise MetaError(f"the MetaServer's record of instance {instance} is not a membership record "
                            f"({type(e).__name__}: {e}): {json.dumps(d)[:200]}") from None
