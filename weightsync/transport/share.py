"""Open another process's live tensors on the same host: CUDA IPC on GPU, shared memory on CPU.

The co-located transport (:mod:`weightsync.transport.colocated`) reads the trainer's parameters
where they lie instead of having the trainer send them. The trainer calls :func:`export_tensors`
once and publishes the returned description (plain JSON: handles are base64 strings) by any local
means (a file, a pipe, the meta server); an inference worker calls :func:`import_tensors` once and
gets tensors that alias the SAME memory: a later in-place write on either side (an optimizer step,
``p.mul_(0).add_(new)``, a ``copy_``) is seen by the other. Nothing is pickled, and no tensor data
travels; only handles do.

CPU. Each storage is moved into POSIX shared memory IN PLACE with the ``file_system`` strategy's
``storage._share_filename_cpu_()``: torch allocates a ``/dev/shm`` file registered with a
``torch_shm_manager``, copies the bytes in, and swaps the storage's data pointer, so every tensor
object (``nn.Parameter``, optimizer state, views) keeps working and simply lives in shared memory
from then on. (We do not call ``tensor.share_memory_()`` first: under the default
``file_descriptor`` strategy it would copy into an fd-backed segment that ``_share_filename_cpu_``
then copies again.) The call returns ``(manager_handle, storage_handle, nbytes)``; the importer
maps it with ``torch.UntypedStorage._new_shared_filename_cpu`` -- the calls
``torch.multiprocessing.reductions.reduce_storage`` / ``rebuild_storage_filename`` make.

CUDA. ``storage._share_cuda_()`` returns the ``cudaIpcMemHandle`` of the caching allocator's
block holding the storage, the storage's byte offset in it, a reference-counter handle and an IPC
event; the importer opens it with ``torch.UntypedStorage._new_shared_cuda`` (exactly
``reductions.rebuild_cuda_tensor``). The IPC event orders the opening after the producer's pending
work; ordering LATER writes is the caller's job (the trainer synchronizes its stream before it
signals "weights ready", as it does before any weight sync).

Keep-alive rules (as in ``reductions.py``, adapted to a long-lived export rather than one pickle):

- The exporter keeps a strong reference to every exported storage in this module (``_EXPORTED``)
  until :func:`release` is called, so the memory stays valid even if the trainer drops or replaces
  its tensors; the exporting PROCESS must stay alive until every importer has opened the
  description (the shm file / CUDA block is freed with its last holder).
- Once opened, an importer's mapping stays valid on its own (for CUDA the producer's allocator
  keeps the block in its IPC limbo until importers drop it).
- An importer maps each storage once per process: a process-wide weak cache keyed by the handle
  (like ``reductions.shared_cache``) makes a second import of the same storage return the same
  memory.
- CUDA only: each ``_share_cuda_`` call takes ONE reference count on the producer's block, which the
  consumer's mapping gives back when it is freed (that is how the producer knows when it may reuse
  the block). So a CUDA description is for ONE importing process -- the proxy, in co-located mode;
  for another process call :func:`export_tensors` again (cheap: handles only). Opening one CUDA
  description in two processes would give back two counts for one taken and leave the block
  pinned in the producer. Re-importing in the same process is fine (the count is given back once);
  importing a newer export of an already-mapped storage gives back that export's count at once,
  as ``reductions.rebuild_cuda_tensor`` does. CPU descriptions may be opened by any number of
  processes, any number of times.

Storages, not tensors, are shared: tensors that are views of one storage (an FSDP flat buffer and
its parameters, a fused QKV weight and its slices) come back as views of one shared storage, with
their dtype, shape, stride and storage offset, so the aliasing between them is preserved too.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import logging
import os
import re
import tempfile
import threading
from typing import Any, Mapping

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from weightsync.dtypes import dtype_name
from weightsync.errors import WeightsMoved
from weightsync.transport.private import private_opener

FORMAT = "weightsync.share/1"

_EXPORTED: dict[tuple[str, bytes], torch.UntypedStorage] = {}  # exporter side: keep-alive
_OPENED: dict[tuple[str, bytes, int], StorageWeakRef] = {}  # importer side: one mapping per storage
_COUNTED: set[tuple[bytes, int]] = set()  # importer side: CUDA ref-counter slots already accounted for
log = logging.getLogger("weightsync.transport.share")
_LOCK = threading.Lock()


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(bytes(b)).decode("ascii")


def _unb64(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)  # any torch dtype: a live tensor may hold one the table lacks
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a shared-tensor description")
    return dt


SHM_MANAGER_ATTEMPTS = 3


_MANAGER_STARTED_IN: int | None = None  # the pid whose torch_shm_manager _start_manager_clean started
_MANAGER_LOCK = threading.Lock()  # one start at a time: two threads would hide and give back each other's flags


def _start_manager_clean() -> None:
    """Start this process's ``torch_shm_manager`` with none of the process's descriptors but its own.

    libshm starts the daemon on a process's first share by ``fork`` + ``execl`` (torch/lib/libshm/core.cpp
    ``start_manager``), so it inherits every inheritable descriptor of the process -- among them, in a
    process ``multiprocessing`` spawned, the write end of the sentinel pipe its parent's ``Process.join``
    waits on. The daemon lives until the last process that mapped a segment is gone (the engine reading
    the trainer's weights), so a parent joining its exited trainer waited out its whole timeout
    (examples/train_to_vllm.py --colocate: 120 s per run). Here every inheritable descriptor above 2 is
    made non-inheritable while one byte is shared (which starts the daemon), then given back."""
    global _MANAGER_STARTED_IN
    with _MANAGER_LOCK:
        if _MANAGER_STARTED_IN == os.getpid():
            return
        try:
            fds = [int(n) for n in os.listdir("/proc/self/fd") if int(n) > 2]
        except OSError:  # no /proc (macOS): nothing to hide
            fds = []
        hidden = []
        for fd in fds:
            with contextlib.suppress(OSError):  # the listing's own descriptor is closed by now
                if os.get_inheritable(fd):
                    os.set_inheritable(fd, False)
                    hidden.append(fd)
        try:
            _share_with_retries(torch.UntypedStorage(1))
        finally:
            for fd in hidden:
                with contextlib.suppress(OSError):
                    os.set_inheritable(fd, True)
        _MANAGER_STARTED_IN = os.getpid()


def _share_filename(storage: torch.UntypedStorage):
    """``storage._share_filename_cpu_()``, the process's shared memory daemon started first
    (:func:`_start_manager_clean`)."""
    _start_manager_clean()
    return _share_with_retries(storage)


def _share_with_retries(storage: torch.UntypedStorage):
    """``storage._share_filename_cpu_()``, tried again when torch's ``torch_shm_manager`` did not answer
    in time: libshm starts that daemon on a process's first share and waits about a second for it, which a
    loaded host's process start can exceed (seen in CI-like runs at load ~35). A failed call leaves the
    storage where it was (its pointer moves only on success), and the daemon is up by the next try."""
    for attempt in range(1, SHM_MANAGER_ATTEMPTS + 1):
        try:
            return storage._share_filename_cpu_()
        except RuntimeError as e:
            if "Shared memory manager connection has timed out" not in str(e) or attempt == SHM_MANAGER_ATTEMPTS:
                raise
            log.warning("torch's shared memory manager did not answer in time (attempt %d of %d); trying again",
                        attempt, SHM_MANAGER_ATTEMPTS)


def _share_storage(storage: torch.UntypedStorage) -> dict[str, Any]:
    """Make one storage shareable (in place) and describe how to open it."""
    dev = storage.device
    if storage.nbytes() == 0:  # cannot be mapped; rebuilt as a fresh empty storage
        return {"kind": "empty", "device": str(dev)}
    if dev.type == "cpu":
        manager, handle, nbytes = _share_filename(storage)  # moves it to /dev/shm in place
        with _LOCK:
            _EXPORTED[("cpu", bytes(handle))] = storage
        return {"kind": "cpu_shm", "manager": _b64(manager), "handle": _b64(handle), "nbytes": int(nbytes)}
    if dev.type == "cuda":
        (device, handle, nbytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync) = (
            storage._share_cuda_()
        )
        with _LOCK:
            _EXPORTED[("cuda", bytes(handle) + int(offset_bytes).to_bytes(8, "little"))] = storage
        return {
            "kind": "cuda_ipc",
            "device": int(device),
            "handle": _b64(handle),
            "nbytes": int(nbytes),
            "offset_bytes": int(offset_bytes),
            "ref_counter_handle": _b64(ref_handle),
            "ref_counter_offset": int(ref_offset),
            "event_handle": _b64(event_handle),
            "event_sync_required": bool(event_sync),
        }
    raise ValueError(f"cannot share a storage on {dev}: only CPU and CUDA tensors can be exported")


def export_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Describe live ``tensors`` so another process on this host can open the same memory.

    CPU storages move to shared memory in place (tensor objects, parameters and optimizer state
    stay valid). Returns a JSON-serializable dict; pass it to :func:`import_tensors`.
    """
    # group by storage BEFORE sharing anything: sharing a CPU storage moves its data pointer
    owners: list[torch.UntypedStorage] = []
    index: dict[tuple[str, int], int] = {}
    entries: dict[str, dict[str, Any]] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"{name}: only strided (dense) tensors can be shared, got {t.layout}")
        if t.is_conj() or t.is_neg():
            raise ValueError(f"{name}: resolve the conjugate/negative bit before sharing")
        st = t.untyped_storage()
        key = (str(st.device), st.data_ptr())
        if st.nbytes() == 0 or key not in index:  # empty storages are never deduplicated
            index[key] = len(owners)
            owners.append(st)
        entries[name] = {
            "storage": index[key],
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": int(t.storage_offset()),
        }
    storages = [_share_storage(st) for st in owners]
    return {"format": FORMAT, "pid": os.getpid(), "storages": storages, "tensors": entries}


def release(desc: Mapping[str, Any]) -> None:
    """Exporter side: drop this module's keep-alive references for ``desc`` (importers keep theirs)."""
    with _LOCK:
        for s in desc["storages"]:
            if s["kind"] == "cpu_shm":
                _EXPORTED.pop(("cpu", _unb64(s["handle"])), None)
            elif s["kind"] == "cuda_ipc":
                _EXPORTED.pop(("cuda", _unb64(s["handle"]) + s["offset_bytes"].to_bytes(8, "little")), None)


def _cached(key) -> torch.UntypedStorage | None:
    ref = _OPENED.get(key)
    if ref is None or ref.expired():
        return None
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata)


#: torch's shared-memory manager must answer an opening within 1 s (``libshm``'s poll), which a loaded
#: host can miss; the opening is simply tried again
SHM_ATTEMPTS = 5


def _open_shm(manager: bytes, handle: bytes, nbytes: int) -> torch.UntypedStorage:
    for attempt in range(1, SHM_ATTEMPTS + 1):
        try:
            return torch.UntypedStorage._new_shared_filename_cpu(manager, handle, nbytes)
        except RuntimeError as e:
            if attempt < SHM_ATTEMPTS and "timed out" in str(e):
                continue
            raise RuntimeError(
                f"cannot open shared storage {handle.decode(errors='replace')} ({nbytes} bytes): {e}; "
                "is the exporting process alive and on this host?"
            ) from e


def _open_storage(s: Mapping[str, Any], cuda_device: int | None) -> torch.UntypedStorage:
    kind = s["kind"]
    if kind == "empty":
        return torch.UntypedStorage(0, device=s["device"])
    if kind == "cpu_shm":
        handle = _unb64(s["handle"])
        key = ("cpu", handle, 0)
        with _LOCK:
            st = _cached(key)
            if st is None:
                st = _open_shm(_unb64(s["manager"]), handle, s["nbytes"])
                _OPENED[key] = StorageWeakRef(st)
        return st
    if kind == "cuda_ipc":
        handle = _unb64(s["handle"])
        key = ("cuda", handle, s["offset_bytes"])
        device = s["device"] if cuda_device is None else cuda_device
        slot = (_unb64(s["ref_counter_handle"]), s["ref_counter_offset"])
        with _LOCK:
            st = _cached(key)
            if st is None and slot in _COUNTED:
                raise RuntimeError(
                    "this CUDA description was opened in this process before and its tensors were freed, "
                    "which gave its reference count back; ask the exporter for a fresh export_tensors()"
                )
            if st is None:
                torch.cuda._lazy_init()
                st = torch.UntypedStorage._new_shared_cuda(
                    device,
                    handle,
                    s["nbytes"],
                    s["offset_bytes"],
                    _unb64(s["ref_counter_handle"]),
                    s["ref_counter_offset"],
                    _unb64(s["event_handle"]),
                    s["event_sync_required"],
                )
                _OPENED[key] = StorageWeakRef(st)  # this mapping gives the count back when freed
            elif slot not in _COUNTED:  # mapped already, by another export: give its count back now
                torch.UntypedStorage._release_ipc_counter(slot[0], slot[1], device=device)
            _COUNTED.add(slot)
        return st
    raise ValueError(f"unknown shared storage kind {kind!r}")


def import_tensors(desc: Mapping[str, Any], cuda_device: int | None = None) -> dict[str, torch.Tensor]:
    """Open the tensors :func:`export_tensors` described; they alias the exporter's memory.

    ``cuda_device``: the GPU whose CUDA context maps the memory, and which the tensors report as
    theirs; by default the exporter's index. Pass this process's own GPU to reach memory on another
    GPU of the host without creating a context there (~500 MiB on it): the driver maps it with lazy
    peer access (NVLink), and kernels on ``cuda_device`` read and write it in place. Such tensors
    are views of another GPU's memory: use them as sources or destinations of copies run on
    ``cuda_device``, nothing else.
    """
    if desc.get("format") != FORMAT:
        raise ValueError(f"not a shared-tensor description of format {FORMAT}: {desc.get('format')!r}")
    storages = [_open_storage(s, cuda_device) for s in desc["storages"]]
    out = {}
    for name, e in desc["tensors"].items():
        st = storages[e["storage"]]
        dtype = _dtype(e["dtype"])
        t = torch.empty(0, dtype=dtype, device=st.device)
        t.set_(st, e["offset"], e["shape"], e["stride"])
        out[name] = t
    return out


_SHARED = re.compile(r"^weightsync-.+-(\d+)-(?:train|infer)\d+-for\d+\.json(?:\.tmp)?$")


def share_tensors(tensors: Mapping[str, torch.Tensor], job: str, name: str) -> str:
    """Export live tensors (:func:`export_tensors`) and write their description to a local file.

    Co-located peers are on this host by definition, so a file is the simplest way to hand over a
    description too large for a MetaServer field; its path goes through the MetaServer. The file is
    removed by :func:`unshare` (a transport's ``close``) or when this process exits; files a killed
    process left are removed by the next share on the host (they are named by pid). The file is created
    0600 whatever the umask: it names the shared memory (and CUDA IPC handles) that open the weights.
    """
    directory = tempfile.gettempdir()
    remove_files_of_dead_processes(directory, _SHARED)
    path = os.path.join(directory, f"weightsync-{job}-{os.getpid()}-{name}.json")
    tmp = path + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of this pid's own earlier share: private_opener creates, never reuses
    with open(tmp, "w", opener=private_opener) as f:
        json.dump(export_tensors(tensors), f)
    os.replace(tmp, path)
    _shared_files.add(path)
    return path


def unshare(path: str) -> None:
    """Remove a description :func:`share_tensors` wrote (its peers opened it at set-up)."""
    _shared_files.discard(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


_shared_files: set[str] = set()
atexit.register(lambda: [unshare(p) for p in list(_shared_files)])


def remove_files_of_dead_processes(directory: str, pattern: re.Pattern[str]) -> int:
    """Remove the files in ``directory`` whose name ``pattern`` matches with a pid (group 1) that no
    longer runs on this host: what a killed participant left behind. Returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = pattern.match(name)
        if m is None or _alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def open_shared(path: str, cuda_device: int | None = None) -> dict[str, torch.Tensor]:
    """Open the tensors :func:`share_tensors` wrote the description of (see :func:`import_tensors`)."""
    with open(path) as f:
        return import_tensors(json.load(f), cuda_device=cuda_device)


def addresses(tensors: Mapping[str, torch.Tensor]) -> tuple[int, ...]:
    """Where each tensor's data lies, in the map's order: what :func:`check_in_place` compares."""
    return tuple(map(torch.Tensor.data_ptr, tensors.values()))


def check_in_place(tensors: Mapping[str, torch.Tensor], shared_at: tuple[int, ...], who: str, readers: str) -> None:
    """Raise :class:`WeightsMoved` when a tensor of ``tensors`` no longer lies where it was shared
    (``shared_at``, from :func:`addresses` right after sharing): ``readers`` reach it by its address,
    so after a reallocation -- ``p.data = ...``, offloading and reloading -- they would copy the old
    memory, which the export keeps alive, silently. One address lookup per tensor (~0.25 us each on the
    GPU host: 1.6 ms for a 30B Megatron stage's 6,300)."""
    now = addresses(tensors)
    if now == shared_at:
        return
    if len(now) != len(shared_at):
        raise WeightsMoved(f"{who}: {len(now)} tensors now, {len(shared_at)} when they were shared with {readers}")
    name, t, was = next((n, t, a) for (n, t), a, b in zip(tensors.items(), shared_at, now) if a != b)
    raise WeightsMoved(
        f"{who}: tensor {name!r} {tuple(t.shape)} {t.dtype} moved since it was shared with {readers} "
        f"(its data was at {was:#x}, now at {t.data_ptr():#x}). They reach it at the old address, so the "
        f"weights must stay in place: update them in place (optimizer steps, copy_), not by assigning "
        f"new tensors or .data, nor by offloading them and reloading into new memory.")
