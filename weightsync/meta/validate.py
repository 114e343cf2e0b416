"""Input rules of the MetaServer: strict types, bounded sizes and depths, unknown fields refused.

Everything here runs before any state changes, so a refused request changes nothing.
"""

from __future__ import annotations

import functools
import json
import math
import posixpath
import re
from typing import Any
from urllib.parse import parse_qsl

MAX_BODY = 1 << 20
MAX_WAIT_S = 300.0
MAX_JOBS = 1024
MAX_PARTICIPANTS = 16384
MAX_PAIRS = 16384
MAX_RENDEZVOUS = 65536  # async pulls claim one name each
MAX_INT = (1 << 63) - 1
MAX_RANK = 1 << 20
MAX_JSON_DEPTH = 32  # a model config nests 3 or 4 levels; ~1000 levels broke every later save
MAX_MODEL_CONFIG = 65536  # bytes of a participant's model_config, as JSON
STEPS_KEPT = 64  # written-step sets kept per job; older steps answer 410
#: a member's heartbeat deadline (``liveness_s``): from half a second (the server looks every 0.25 s) to a day
MIN_LIVENESS_S, MAX_LIVENESS_S = 0.5, 86400.0
STEP_STRIDE = 1 << 32  # a new step is at most this far past the latest one written (the first: below it)

#: rendezvous names under which a participant publishes a doorbell (:mod:`weightsync.runtime.doorbell`):
#: its peers on that host open and map the file the address names, so it must name a bell file
BELL_NAME_PREFIX = "bell."
#: a bell file's name: ``weightsync-bell-<pid>-<uuid4 hex>`` in the host's shared-memory directory
BELL_FILE_RE = re.compile(r"weightsync-bell-([0-9]{1,10})-([0-9a-f]{32})")

ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")
INT_RE = re.compile(r"[0-9]{1,19}")
HEX_RE = re.compile(r"[0-9a-fA-F]{1,128}")
ROLES = ("train", "infer")


class HTTPError(Exception):
    """Ends a request with ``status`` and a JSON error; raised before any state changes."""

    def __init__(self, status: int, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.extra = status, extra


class Aborted(HTTPError):
    def __init__(self, job: str, reason: str):
        super().__init__(409, f"job {job} aborted: {reason}", aborted=reason)


def bad(message: str) -> HTTPError:
    return HTTPError(400, message)


def short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def fields(body: dict, required: set[str], optional: set[str] = frozenset()) -> None:
    unknown = sorted(set(body) - required - optional)
    if unknown:
        raise bad(f"unknown fields {unknown}; allowed: {sorted(required | optional)}")
    missing = sorted(required - set(body))
    if missing:
        raise bad(f"missing fields {missing}")


def integer(v: Any, what: str, lo: int = 0, hi: int = MAX_INT) -> int:
    if type(v) is not int or not lo <= v <= hi:  # bool is an int subclass: refused too
        raise bad(f"{what} must be an integer in [{lo}, {hi}], got {short(v)}")
    return v


def string(v: Any, what: str, max_len: int, pattern: re.Pattern | None = None) -> str:
    if not isinstance(v, str) or len(v) > max_len or (pattern is not None and not pattern.fullmatch(v)):
        rule = f"matching {pattern.pattern}" if pattern is not None else f"of at most {max_len} characters"
        raise bad(f"{what} must be a string {rule}, got {short(v)}")
    return v


def seconds(v: Any, what: str, lo: float, hi: float) -> float:
    """A duration in seconds: a JSON number (not a bool) in [lo, hi]."""
    if type(v) not in (int, float) or not lo <= v <= hi:
        raise bad(f"{what} must be a number of seconds in [{lo:g}, {hi:g}], got {short(v)}")
    return float(v)


def boolean(v: Any, what: str) -> bool:
    if type(v) is not bool:
        raise bad(f"{what} must be true or false, got {short(v)}")
    return v


def json_depth(v: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion (a deep value must not raise here)."""
    deepest, stack = 0, [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            deepest = max(deepest, d)
            if d > MAX_JSON_DEPTH:
                return d
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return deepest


def model_config(v: Any) -> dict:
    """The HF config.json of the participant's model: lets a peer name the first differing tensor. Its
    shape and its counts are checked here (milliseconds, nothing built); the size of the spec it describes
    is checked off the event loop by the caller (:func:`weightsync.meta.mismatch.check_spec_size_async`)."""
    if not isinstance(v, dict):
        raise bad(f"model_config must be an object, got {short(v)}")
    if json_depth(v) > MAX_JSON_DEPTH:
        raise bad(f"model_config nests deeper than {MAX_JSON_DEPTH} levels")
    if len(json.dumps(v)) > MAX_MODEL_CONFIG:
        raise bad(f"model_config is over {MAX_MODEL_CONFIG} bytes as JSON")
    from weightsync.meta.mismatch import check_counts  # lazily: it imports the spec module on first use

    try:  # every count an integer, and none beyond any model's, before any spec is built from it
        check_counts(v)
    except ValueError as e:
        raise bad(str(e)) from None
    return v


def bell_address(address: str) -> str:
    """A doorbell's address, ``host:/absolute/dir/weightsync-bell-PID-HEX``: a normalized absolute path
    (no ``..``, no doubled slashes) to a file named as weightsync names its bells; anything else (a
    participant pointing its peers at ``/etc/passwd``) is refused. Where it is opened, the doorbell code
    checks again that it is a regular 8-byte file in the shared-memory directory, not a link."""
    host, sep, path = address.partition(":")
    directory, _, name = path.rpartition("/")
    if (not sep or not host or "/" in host or not path.startswith("/") or posixpath.normpath(path) != path
            or "\0" in path or not BELL_FILE_RE.fullmatch(name) or not directory):
        raise bad(f"a doorbell's address must be host:/dir/weightsync-bell-PID-HEX (a bell file weightsync made), "
                  f"got {short(address)}")
    return address


def identity(body: dict) -> tuple[str, int, int | None]:
    """(role, rank, instance) -> validated; instance is required for infer and forbidden for train."""
    role = body.get("role")
    if role not in ROLES:
        raise bad(f"role must be one of {list(ROLES)}, got {short(role)}")
    rank = integer(body.get("rank"), "rank", 0, MAX_RANK)
    inst = body.get("instance")
    if role == "infer":
        inst = integer(inst, "instance", 0, MAX_RANK)
    elif inst is not None:
        raise bad("instance is only for role infer")
    return role, rank, inst


def participant_name(role: str, rank: int, instance: int | None) -> str:
    """``train:R`` or ``infer:I:R``: how messages name a participant."""
    return f"train:{rank}" if role == "train" else f"infer:{instance}:{rank}"


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _finite(s: str) -> float:
    x = float(s)
    if not math.isfinite(x):
        raise ValueError(f"number {s[:20]} is out of range")
    return x


def parse_body(data: bytes) -> dict:
    """A request body: empty or a JSON object of bounded depth (NaN, Infinity and 1e999 refused)."""
    if not data.strip():
        return {}
    try:
        body = json.loads(data.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"body is not valid JSON: {str(e)[:120]}") from None
    if not isinstance(body, dict):
        raise bad("body must be a JSON object")
    # a body with fewer opening brackets than the bound cannot nest past it: the walk only for the others
    if data.count(b"{") + data.count(b"[") > MAX_JSON_DEPTH + 1 and json_depth(body) > MAX_JSON_DEPTH + 1:
        raise bad(f"body nests deeper than {MAX_JSON_DEPTH + 1} levels")
    return body


def path_params(params: dict[str, str]) -> dict[str, Any]:
    """Path ids: names match ID_RE, instances and steps are non-negative integers (no percent-decoding)."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        if k in ("i", "S"):
            what = "instance" if k == "i" else "step"
            if not INT_RE.fullmatch(v) or int(v) > MAX_INT:
                raise bad(f"{what} in the path must be a non-negative integer, got {short(v)}")
            out[k] = int(v)
        elif not ID_RE.fullmatch(v):
            raise bad(f"{k} in the path must match {ID_RE.pattern}, got {short(v)}")
        else:
            out[k] = v
    return out


class Query:
    """Query parameters: each at most once, only the names a route accepts."""

    def __init__(self, query: str, allowed: set[str]):
        pairs = _pairs(query)
        if pairs is None:
            raise bad("malformed query string")
        self.values: dict[str, str] = {}
        for k, v in pairs:
            if k not in allowed:
                raise bad(f"unknown query parameter {short(k)}; allowed: {sorted(allowed)}")
            if k in self.values:
                raise bad(f"query parameter {k} given twice")
            self.values[k] = v

    def int(self, name: str, default: int | None, lo: int = 0, hi: int = MAX_INT) -> int | None:
        s = self.values.get(name)
        if s is None:
            return default
        if not INT_RE.fullmatch(s) or not lo <= int(s) <= hi:
            raise bad(f"{name} must be an integer in [{lo}, {hi}], got {short(s)}")
        return int(s)

    def timeout(self) -> float:
        s = self.values.get("timeout", "0")
        try:
            t = float(s)
        except ValueError:
            t = math.nan
        if not 0 <= t <= MAX_WAIT_S:  # also refuses nan and inf
            raise bad(f"timeout must be a number of seconds in [0, {MAX_WAIT_S:g}], got {short(s)}")
        return t

    def int_list(self, name: str) -> list[int] | None:
        s = self.values.get(name)
        return None if s is None else instance_list(s, name)


def instance_list(s: Any, what: str) -> list[int]:
    """A comma-separated list of instance numbers (``"0,1,2"``), sorted and without repeats."""
    got = _int_list(s) if isinstance(s, str) else None
    if got is None:
        raise bad(f"{what} must be a comma-separated list of instance numbers, got {short(s)}")
    return list(got)


@functools.lru_cache(maxsize=256)
def _pairs(query: str) -> tuple[tuple[str, str], ...] | None:
    """A query string's pairs (None: malformed); cached, as a step's 1,000+ waiters send the same one."""
    try:
        return tuple(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError:
        return None


@functools.lru_cache(maxsize=256)
def _int_list(s: str) -> tuple[int, ...] | None:
    """A parsed instance list; cached, as every trainer of a job sends the same one each step."""
    parts = s.split(",") if s else []
    if len(parts) > MAX_PARTICIPANTS or not all(INT_RE.fullmatch(p) and int(p) <= MAX_RANK for p in parts):
        return None
    return tuple(sorted({int(p) for p in parts}))
