"""weightsync's call messages into engine workers, in a form that cannot run code on the receiving side.

Why: the engines hand whatever arrives to weightsync inside every TP worker through entry points that
anyone who can call the engine reaches: SGLang's ``update_weights_from_tensor(..., load_format=RPC_LOADER)``
(HTTP ``/update_weights_from_tensor``), vLLM's ``collective_rpc("weightsync_call", ...)`` (HTTP
``/collective_rpc`` in vLLM's dev mode). A message that is ``pickle.loads``-ed there runs the sender's code
in every worker. So a message here (the same for both engines) is:

    MAGIC | u32 header length | header (JSON) | body (restricted pickle)

- the **header** (JSON: ``instance``, ``dir``, ``seq``, ``fn`` as ``"module:qualname"``, ``records``, ``mac``)
  is parsed first, with ``json`` only;
- ``mac`` is an HMAC-SHA256 of everything else under a 32-byte key that the control process wrote into
  its own private directory (``dir``: created by ``tempfile.mkdtemp``, mode 0700, named
  ``weightsync-sglang-*`` or ``weightsync-vllm-*``). The worker (same host, same user) reads the key
  only from such a directory owned by its own uid and not readable by others, never following a link,
  and refuses the message **before anything is unpickled** when the MAC does not match. A caller of
  the engine's HTTP API cannot read that key, so it cannot get a call accepted;
- the **body** (the call's arguments) is unpickled by :class:`SafeUnpickler`, which resolves no global but
  a few builtin value types and weightsync's own record types (dataclasses, enums and named tuples
  defined under ``weightsync.``); tensors, dtypes, devices and ``torch.Size`` travel as raw bytes and
  names (persistent ids), never through torch's own pickling (``torch.storage._load_from_bytes`` would
  call ``torch.load``); a function argument travels as its name and is resolved like ``fn``;
- ``fn`` is imported by name after the MAC matched and must be a plain function defined in the module
  named (no ``<locals>``, no attribute chains through other objects), and weightsync's own (a module under
  ``weightsync.``), or of a module the engine's environment names in ``$WEIGHTSYNC_WORKER_CALLS``
  (comma-separated module names or ``fnmatch`` patterns: a deployment's own checks, a test suite's helpers).
  Defence in depth should the key ever leak: a signed call then still cannot name ``subprocess.run``;
- a record type in the body is looked up only among the ``weightsync.`` modules the worker has already
  imported (``sys.modules``), never imported by the unpickler: the header's ``records`` (signed like the rest)
  lists the ``weightsync.`` modules whose records the body holds, and those alone are imported first, each a
  plain ``weightsync.name...`` (no ``__main__``), an import that raises or exits answered as a refusal.

SGLang's answers (worker -> control process) are written by the worker into the same private directory and
read back only from a regular file owned by this user (see :func:`read_answer`); vLLM's come back as the
``collective_rpc`` result (:mod:`weightsync.vllm.rpc`).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import hmac
import importlib
import io
import json
import os
import pickle
import re
import secrets
import stat
import struct
import sys
import types
from dataclasses import dataclass, is_dataclass
from enum import Enum
from typing import Any, Callable

from weightsync.transport.private import check_private_directory

import torch

MAGIC = b"WSRPC1\n"
KEY_FILE = "key"
KEY_BYTES = 32
DIR_PREFIX = "weightsync-sglang-"  # SGLangInstance's (the default, as before this module moved here)
VLLM_DIR_PREFIX = "weightsync-vllm-"
#: the directory names a worker reads a key from
DIR_PREFIXES = (DIR_PREFIX, VLLM_DIR_PREFIX)

#: the engine's environment variable naming the modules, besides weightsync's, whose functions a worker runs
CALLS_ENV = "WEIGHTSYNC_WORKER_CALLS"

#: a weightsync module a message may ask a worker to import: lower-case segments, none private (``__main__``)
_WEIGHTSYNC_MODULE = re.compile(r"weightsync(\.[a-z][a-z0-9_]*)*")

#: builtin value types the body may name (each is safe to call with any argument)
_BUILTINS = frozenset({"set", "frozenset", "slice", "complex", "range", "bytearray"})


class WireError(ValueError):
    """A message that is not weightsync's, not from this instance's control process, or not decodable."""


@dataclass(frozen=True)
class Call:
    """One decoded call: run ``fn(ctx, *args)`` on a worker and answer ``<dir>/<seq>.<rank>``."""

    instance: str
    dir: str
    seq: int
    fn: Callable[..., Any]
    args: tuple


# -- the key ------------------------------------------------------------------------------------------


def new_key_dir(prefix: str = DIR_PREFIX) -> tuple[str, bytes]:
    """A private directory holding a fresh key (control process side); ``prefix`` one of :data:`DIR_PREFIXES`."""
    import tempfile

    if prefix not in DIR_PREFIXES:
        raise ValueError(f"key directory prefix {prefix!r} is not one of {DIR_PREFIXES}")
    d = tempfile.mkdtemp(prefix=prefix)  # mode 0700
    key = secrets.token_bytes(KEY_BYTES)
    fd = os.open(os.path.join(d, KEY_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return d, key


def _private_dir(d: str) -> None:
    check_private_directory(d, DIR_PREFIXES, WireError, "answer directory")


def read_key(d: str) -> bytes:
    """The key in answer directory ``d`` (worker side), after checking ``d`` is a private weightsync one."""
    try:
        _private_dir(d)
        fd = os.open(os.path.join(d, KEY_FILE), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise WireError(f"no readable key in {d!r}: {e} (the workers must run on the control process's host, as "
                        "its user: weightsync's signed calls do not span nodes)") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size != KEY_BYTES:
            raise WireError(f"{d}/{KEY_FILE} is not a private {KEY_BYTES}-byte key file of this user")
        return f.read()


# -- the body: arguments as a restricted pickle --------------------------------------------------------


def _name_of(fn: Any) -> str:
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not isinstance(fn, types.FunctionType) or not mod or "<" in qual or "." in qual:
        raise TypeError(f"cannot send {fn!r} to the engine's workers: it must be a module-level function")
    if mod == "__main__":
        raise TypeError(f"cannot send {qual} from __main__ to the engine's workers: define it in an importable module")
    return f"{mod}:{qual}"


@functools.lru_cache(maxsize=256)
def resolve(name: str) -> Callable[..., Any]:
    """The function ``"module:qualname"`` names: a plain function defined in that module (found once per name:
    a step's calls name the same few functions, and an import lookup per call costs ~10 us; a name refused
    raises every time, as the cache keeps only results)."""
    if not isinstance(name, str) or name.count(":") != 1:
        raise WireError(f"function name {name!r} is not 'module:function'")
    mod, qual = name.split(":")
    if not qual.isidentifier() or not all(p.isidentifier() and not p.startswith("_") for p in mod.split(".")):
        raise WireError(f"function name {name!r} is not 'module:function' (of a public module)")
    if not _callable_module(mod):
        raise WireError(f"{name!r} is not weightsync's: a worker runs only weightsync's own functions and those of "
                        f"the modules ${CALLS_ENV} names in the engine's environment (comma-separated module names or "
                        "patterns)")
    fn = getattr(_import(mod), qual, None)
    if not isinstance(fn, types.FunctionType) or fn.__module__ != mod or fn.__qualname__ != qual:
        raise WireError(f"{name!r} is not a function defined in {mod}")
    return fn


def _import(mod: str) -> types.ModuleType:
    """``import mod`` for a message, whatever the import does (raises, or exits): a refusal of the call, never an
    exception out of the worker's answer (``SystemExit`` would pass an ``except Exception``)."""
    try:
        return importlib.import_module(mod)
    except (Exception, SystemExit) as e:
        raise WireError(f"cannot import {mod} in this worker: {type(e).__name__}: {e}") from None


def _import_records(names: Any) -> None:
    """Import the ``weightsync.`` modules whose record types a signed body holds (its header's ``records``), so
    that the unpickler, which looks only in ``sys.modules``, finds them."""
    if not isinstance(names, list) or len(names) > 256:
        raise WireError("not a weightsync call message (records)")
    for name in names:
        if not isinstance(name, str) or not _WEIGHTSYNC_MODULE.fullmatch(name):
            raise WireError(f"a call's records may name weightsync's public modules only, not {name!r}")
        if name not in sys.modules:
            _import(name)


def _callable_module(mod: str) -> bool:
    """Whether a worker may run functions of module ``mod``: weightsync's, or one ``$WEIGHTSYNC_WORKER_CALLS`` names."""
    if mod == "weightsync" or mod.startswith("weightsync."):
        return True
    return any(fnmatch.fnmatchcase(mod, p.strip()) for p in os.environ.get(CALLS_ENV, "").split(",") if p.strip())


class _Pickler(pickle.Pickler):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.records: set[str] = set()  # the weightsync modules of the types pickled (the header's records)

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return ("tensor", str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
        if isinstance(obj, torch.dtype):
            return ("dtype", str(obj).removeprefix("torch."))
        if isinstance(obj, torch.device):
            return ("device", str(obj))
        if isinstance(obj, torch.Size):
            return ("size", tuple(obj))
        if isinstance(obj, types.FunctionType):
            return ("fn", _name_of(obj))
        mod = getattr(obj if isinstance(obj, type) else type(obj), "__module__", None)
        if isinstance(mod, str) and _WEIGHTSYNC_MODULE.fullmatch(mod):
            self.records.add(mod)
        return None


def _weightsync_record(module: str, name: str) -> Any:
    if not (module == "weightsync" or module.startswith("weightsync.")) or not name.isidentifier():
        return None
    loaded = sys.modules.get(module)  # never imported by name here: an import runs the module's code
    if loaded is None:
        return None
    obj = getattr(loaded, name, None)
    if not isinstance(obj, type) or obj.__module__ != module or obj.__qualname__ != name:
        return None
    if is_dataclass(obj) or issubclass(obj, Enum) or (issubclass(obj, tuple) and hasattr(obj, "_fields")):
        return obj
    return None


def _dtype(name: Any) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dt, torch.dtype):
        raise WireError(f"unknown dtype {name!r}")
    return dt


class SafeUnpickler(pickle.Unpickler):
    """Admits builtin value types and weightsync's record types only; tensors and the rest by persistent id."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _BUILTINS:
            return super().find_class(module, name)
        if (module, name) == ("collections", "OrderedDict"):
            return super().find_class(module, name)
        obj = _weightsync_record(module, name)
        if obj is None:
            raise WireError(f"refused global {module}.{name} in a weightsync call message (only weightsync's own "
                            "record types, of modules this worker has imported, and builtin values may travel)")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or not pid:
            raise WireError(f"bad persistent id {pid!r}")
        kind = pid[0]
        if kind == "tensor" and len(pid) == 4:
            _, dtype, shape, raw = pid
            dt = _dtype(dtype)
            if not isinstance(raw, bytes) or not all(isinstance(n, int) and n >= 0 for n in shape):
                raise WireError("bad tensor record")
            numel = 1
            for n in shape:
                numel *= n
            if numel * torch.empty((), dtype=dt).element_size() != len(raw):
                raise WireError(f"tensor record: {len(raw)} bytes for shape {shape} {dtype}")
            if not raw:
                return torch.empty(shape, dtype=dt)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)
        if kind == "dtype" and len(pid) == 2:
            return _dtype(pid[1])
        if kind == "device" and len(pid) == 2 and isinstance(pid[1], str):
            return torch.device(pid[1])
        if kind == "size" and len(pid) == 2 and isinstance(pid[1], tuple):
            return torch.Size(pid[1])
        if kind == "fn" and len(pid) == 2:
            return resolve(pid[1])
        raise WireError(f"bad persistent id kind {kind!r}")


def dumps_args(args: tuple) -> bytes:
    return _dumps(args)[0]


def _dumps(args: tuple) -> tuple[bytes, list[str]]:
    """The body, and the weightsync modules whose record types it holds."""
    buf = io.BytesIO()
    pickler = _Pickler(buf, protocol=5)
    try:
        pickler.dump(tuple(args))
    except Exception as e:
        raise TypeError(f"cannot send these arguments to the engine's workers: {e}") from e
    return buf.getvalue(), sorted(pickler.records)


def loads_args(body: bytes) -> tuple:
    try:
        args = SafeUnpickler(io.BytesIO(body)).load()
    except WireError:
        raise
    except Exception as e:
        raise WireError(f"undecodable call arguments: {type(e).__name__}: {e}") from e
    if not isinstance(args, tuple):
        raise WireError("call arguments are not a tuple")
    return args


# -- whole messages ------------------------------------------------------------------------------------


def _mac(key: bytes, header: dict, body: bytes) -> str:
    signed = json.dumps({k: header[k] for k in sorted(header) if k != "mac"}, sort_keys=True).encode()
    return hmac.new(key, struct.pack(">I", len(signed)) + signed + body, hashlib.sha256).hexdigest()


def encode(key: bytes, instance: str, directory: str, seq: int, fn: Callable[..., Any], args: tuple) -> bytes:
    """A signed message (control process side)."""
    header: dict[str, Any] = {"instance": instance, "dir": directory, "seq": int(seq), "fn": _name_of(fn)}
    body, header["records"] = _dumps(args)
    header["mac"] = _mac(key, header, body)
    hb = json.dumps(header).encode()
    return MAGIC + struct.pack(">I", len(hb)) + hb + body


def decode(blob: bytes, keys: dict[str, bytes] | None = None) -> Call:
    """Check and decode a message (worker side). Raises :class:`WireError` before unpickling anything when the
    message is not weightsync's or its MAC does not match the key in its directory. ``keys``: keys already read,
    by directory (a mailbox serves one instance's directory for its life: its key is read and checked once, not
    every call); a directory not in it is read, checked and added."""
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 4:
        raise WireError("not a weightsync call message (bad magic)")
    (n,) = struct.unpack(">I", blob[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    if n > 1 << 20 or start + n > len(blob):
        raise WireError("not a weightsync call message (bad header length)")
    try:
        header = json.loads(blob[start:start + n])
    except ValueError as e:
        raise WireError(f"not a weightsync call message (header: {e})") from e
    body = blob[start + n:]
    want = {"instance": str, "dir": str, "seq": int, "fn": str, "records": list, "mac": str}
    if not isinstance(header, dict) or set(header) != set(want) or not all(isinstance(header[k], t) for k, t in want.items()):
        raise WireError("not a weightsync call message (header fields)")
    key = keys.get(header["dir"]) if keys is not None else None
    if key is None:
        key = read_key(header["dir"])
        if keys is not None:
            keys[header["dir"]] = key
    if not hmac.compare_digest(_mac(key, header, body), header["mac"]):
        raise WireError(f"call message for {header['dir']!r} has a bad MAC: not sent by this instance's control "
                        "process; refused before decoding")
    _import_records(header["records"])
    return Call(header["instance"], header["dir"], header["seq"], resolve(header["fn"]), loads_args(body))


def read_answer(path: str) -> Any:
    """An answer file written by a worker into the private directory (a regular file of this user, no link)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise WireError(f"answer {path} is not a regular file of this user")
        return pickle.load(f)  # written by SGLang's own worker process (same user) into our 0700 directory


__all__ = ["MAGIC", "CALLS_ENV", "DIR_PREFIX", "VLLM_DIR_PREFIX", "DIR_PREFIXES", "Call", "WireError", "SafeUnpickler",
           "new_key_dir", "read_key", "encode", "decode", "resolve", "dumps_args", "loads_args", "read_answer"]
