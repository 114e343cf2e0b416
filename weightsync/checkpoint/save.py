"""Saving a trainer's live weights as a Hugging Face checkpoint, every rank writing what it owns.

Every training rank calls :func:`save_checkpoint` (it is collective over the trainers' process
group). The ranks first agree -- same layout, model, plan and directory, live tensors still the
layout's -- and only then move bytes, following :class:`~weightsync.checkpoint.plan.CheckpointPlan`
window by window in one global order: the owner of a window copies its own pieces in place and
receives one message from each other source rank; a source packs its pieces, cast to the canonical
dtype, into one message. Each rank does one window or one message at a time, and every rank meets
its peers in the same order, so blocking point-to-point sends cannot deadlock (the earliest
unfinished operation of the order always has both of its ranks waiting on it).

Memory: a rank allocates at most one window (``<= chunk_bytes``) plus one message (``<= chunk_bytes``)
at a time on the group's device -- ``plan.bound_bytes`` -- and, on CUDA, one window's host copy for
the write. No rank ever holds a whole tensor larger than ``chunk_bytes``, let alone the model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weightsync.checkpoint.format import INDEX_NAME
from weightsync.checkpoint.plan import DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_BYTES, CheckpointPlan, Window, make_plan
from weightsync.dtypes import dtype_name, itemsize, torch_dtype
from weightsync.errors import ConfigError, TransportError, WeightSyncError
from weightsync.layout.box import Box, box_numel, box_shape, slices
from weightsync.layout.layout import check_live
from weightsync.transport.private import private_directory

log = logging.getLogger("weightsync.checkpoint")


@dataclass(frozen=True)
class SaveResult:
    """What one rank did: the files it wrote, the bytes it moved, the most buffer memory it held."""

    directory: str
    rank: int  # the training layout's rank
    files: tuple[str, ...]
    bytes_written: int  # tensor data this rank wrote into its files
    bytes_sent: int  # packed for other owners
    bytes_received: int
    bytes_local: int  # copied from this rank's own tensors into its windows
    messages: int  # sent plus received
    largest_message: int
    peak_buffer_bytes: int  # the most window/message bytes allocated at once
    bound_bytes: int  # what the plan promises peak_buffer_bytes stays under
    total_bytes: int  # the checkpoint's tensor data, over all ranks
    seconds: float
    quant: str = ""  # "fp8": the files were then rewritten in block FP8 (weightsync/checkpoint/fp8.py)
    quant_bytes: int = 0  # the block-FP8 checkpoint's tensor data, over all ranks (0 without quant)


@dataclass(frozen=True)
class _Claim:
    """What each rank checks the others agree on before any byte moves."""

    layout_rank: int
    train: str
    spec: str
    plan: str
    directory: str
    problems: tuple[str, ...]


@dataclass
class _Buffers:
    """Every window and message buffer of a save is allocated here, so the peak is counted, not guessed."""

    device: torch.device
    live: int = 0
    peak: int = 0
    sizes: dict[int, int] = field(default_factory=dict)

    def take(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.sizes[id(t)] = nbytes
        return t

    def give(self, t: torch.Tensor) -> None:
        self.live -= self.sizes.pop(id(t))


def save_checkpoint(train: Any, directory: str | os.PathLike, group: Any = None, *,
                    chunk_bytes: int = DEFAULT_CHUNK_BYTES, shard_bytes: int = DEFAULT_SHARD_BYTES,
                    overwrite: bool = False, quant: str | None = None) -> SaveResult:
    """Write ``train``'s live weights (a :class:`weightsync.bind.Bound` or any ``TrainSide``) to ``directory``
    as a Hugging Face checkpoint: ``model-0000i-of-0000n.safetensors`` files with canonical names,
    shapes and dtypes, ``model.safetensors.index.json`` and ``config.json`` (the spec's model config).

    Collective: every rank of the training layout calls it, over ``group`` (default: the default
    process group; none is needed for a one-rank layout), whose ranks must be exactly the layout's.
    ``directory`` must be the same shared directory on every rank. Each rank writes the files of the
    tensors it owns; memory per rank stays under ``2 * chunk_bytes`` (see the module docstring);
    files hold at most ``shard_bytes`` each (a larger tensor alone). An existing checkpoint in
    ``directory`` is refused unless ``overwrite``. Returns what this rank did.

    ``quant="fp8"``: the checkpoint an FP8-served engine loads -- every linear weight
    (:func:`weightsync.quant.config.fp8_tensors`) as 128 x 128 block FP8 (e4m3 + fp32 ``weight_scale_inv``, the
    recipe of :mod:`weightsync.quant.fp8`) and ``quantization_config`` in ``config.json``; each owner rewrites its
    files after the save, ``chunk_bytes`` at a time. The trainer's FP8 tensors must be bf16 (fp32 masters would be
    quantized from their bf16 rounding here, not from fp32 as a sync would: refused).
    """
    t0 = time.perf_counter()
    engine, rank = train.engine, train.rank
    world = _Group.of(group, engine.world_size, rank)
    directory = os.path.abspath(os.fspath(directory))
    problems = _local_problems(train, directory, overwrite if world.rank == 0 else True)
    fp8 = _fp8_problems(train, quant, problems)
    try:  # a rank that cannot plan says so to the others instead of leaving them waiting
        plan = make_plan(engine, chunk_bytes=chunk_bytes, shard_bytes=shard_bytes)
    except WeightSyncError as e:
        plan = None
        problems.append(f"rank {rank}: {e}")
    claim = _Claim(rank, engine.describe(), engine.spec.digest, plan.digest if plan else "", directory, tuple(problems))
    world.agree(claim)
    assert plan is not None  # agree() raised otherwise
    if world.rank == 0 and overwrite:
        _remove_old(Path(directory))
    world.barrier()
    log.info("saving %s (%s) to %s: %d files, %d windows", engine.spec.name, plan.train, directory,
             len(plan.files), len(plan.windows))
    stats = _run(train, plan, world, Path(directory))
    world.barrier()  # every file is in place
    weight_map, total = plan.weight_map(), plan.total_bytes
    if fp8 is not None:
        weight_map, total = _quantize_files(plan, fp8, Path(directory), rank, chunk_bytes)
        world.barrier()  # every file is in block FP8
    if world.rank == 0:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(Path(directory) / INDEX_NAME, index)
        cfg = hf_config(train.spec)
        if fp8 is not None:
            cfg["quantization_config"] = fp8[0].hf_config()
        _write_json(Path(directory) / "config.json", cfg)
    world.barrier()  # the checkpoint is complete when any rank returns
    mine = tuple(f.name for f in plan.files if f.owner == rank)
    return SaveResult(directory, rank, mine, stats["written"], stats["sent"], stats["received"], stats["local"],
                      stats["messages"], stats["largest"], stats["peak"], plan.bound_bytes, plan.total_bytes,
                      time.perf_counter() - t0, quant or "", total if fp8 is not None else 0)


def _fp8_problems(train: Any, quant: str | None, problems: list[str]) -> Any:
    """``quant``'s FP8 tensors (as ``(BlockFP8, {name: FP8Tensor})``), or None; what refuses it goes to ``problems``."""
    if quant is None:
        return None
    if quant != "fp8":
        problems.append(f"quant={quant!r} is not supported; use quant='fp8' (128 x 128 block FP8) or none")
        return None
    from weightsync.quant.config import check_trainer_dtypes, for_checkpoint, fp8_tensors

    q = for_checkpoint(train.spec)  # the routers listed as ignored: every engine version leaves them bf16
    try:
        fp8 = fp8_tensors(train.spec, q)
        dtypes = {p.canonical: t.dtype for t in train.layout.tensors.values() for p in t.pieces}
        check_trainer_dtypes(dtypes, fp8)
        bad = [f.weight.name for f in fp8 if dtypes.get(f.weight.name, f.source_dtype) != "bfloat16"]
        if bad:
            problems.append(f"rank {train.rank}: quant='fp8' of {bad[0]} held in {dtypes.get(bad[0])}: a checkpoint "
                            "is written in the model dtype first, so fp32 masters would be quantized from their bf16 "
                            "rounding, not as a sync quantizes them; save fp32 masters without quant")
    except WeightSyncError as e:
        problems.append(f"rank {train.rank}: {e}")
        return None
    return q, {f.weight.name: f for f in fp8}


def _quantize_files(plan: CheckpointPlan, fp8: Any, directory: Path, rank: int,
                    chunk_bytes: int) -> tuple[dict[str, str], int]:
    """Rewrite this rank's files in block FP8; the whole checkpoint's weight map and data bytes (every rank computes
    them, from the plan alone)."""
    from weightsync.checkpoint.fp8 import fp8_entries, quantize_file

    _, tensors = fp8
    weight_map: dict[str, str] = {}
    total = 0
    for f in plan.files:
        entries = fp8_entries([(t.name, t.dtype, t.shape) for t in f.tensors], tensors)
        weight_map.update((t.name, f.name) for t in entries)
        total += entries[-1].end if entries else 0
        if f.owner == rank:
            quantize_file(directory / f.name, tensors, chunk_bytes)
    return weight_map, total


def hf_config(spec: Any) -> dict[str, Any]:
    """The spec's model config as ``config.json``, with its architecture and dtype stated."""
    cfg = dict(spec.config)
    cfg["architectures"] = [spec.architecture]
    if "torch_dtype" not in cfg and "dtype" not in cfg:
        cfg["torch_dtype"] = spec.dtype
    return cfg


# -- checks -----------------------------------------------------------------------------------------


def _local_problems(train: Any, directory: str, overwrite: bool) -> list[str]:
    problems = []
    try:
        check_live(train.layout, {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in train.tensors.items()},
                   where=f"{train.engine.describe()} rank {train.rank}")
    except Exception as e:  # LayoutMismatch: a tensor moved or was replaced since binding
        problems.append(f"rank {train.rank}: {e}")
    try:
        private_directory(directory)  # what it creates 0700: the checkpoint is the model
        if not os.access(directory, os.W_OK):
            problems.append(f"rank {train.rank}: directory {directory} is not writable")
    except OSError as e:
        problems.append(f"rank {train.rank}: cannot create directory {directory}: {e}")
    old = _old_files(Path(directory)) if os.path.isdir(directory) else []
    if old and not overwrite:
        problems.append(f"directory {directory} already holds a checkpoint ({', '.join(p.name for p in old[:3])}"
                        f"{', ...' if len(old) > 3 else ''}); pass overwrite=True or choose an empty directory")
    return problems


def _old_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir()
                  if p.name == INDEX_NAME or p.name.startswith("model") and ".safetensors" in p.name)


def _remove_old(d: Path) -> None:
    for p in _old_files(d):
        p.unlink()


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with os.fdopen(_create_private(tmp), "w") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def _create_private(path: Path) -> int:
    """A new file at ``path`` for writing, 0600 whatever the umask (the checkpoint is the model: before, 0644 let
    any local user read it); a leftover of a crashed save is removed first, and a link there is never followed."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


# -- the process group ------------------------------------------------------------------------------


@dataclass
class _Group:
    """The trainers' process group as the save uses it: layout ranks mapped to group ranks."""

    pg: Any  # None: a one-rank layout without a process group
    rank: int  # this process's rank in the group
    device: torch.device  # where messages live: CUDA for NCCL, else CPU
    of_layout: dict[int, int] = field(default_factory=dict)  # layout rank -> group rank

    @classmethod
    def of(cls, group: Any, world_size: int, layout_rank: int) -> "_Group":
        import torch.distributed as dist

        if group is None and (world_size == 1 or not (dist.is_available() and dist.is_initialized())):
            if world_size != 1:
                raise ConfigError(f"checkpoint: the training layout has {world_size} ranks but no process group is "
                                  "initialised; call torch.distributed.init_process_group or pass group=")
            return cls(None, 0, torch.device("cpu"), {0: 0})
        pg = group or dist.group.WORLD
        size = dist.get_world_size(pg)
        if size != world_size:
            raise ConfigError(f"checkpoint: the process group has {size} ranks, the training layout {world_size} "
                              f"(layout rank {layout_rank}); pass group= holding exactly the training ranks")
        backend = str(dist.get_backend(pg))
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend and "gloo" not in backend \
            else torch.device("cpu")
        return cls(pg, dist.get_rank(pg), device)

    def agree(self, claim: _Claim) -> None:
        """Gather every rank's claim; raise the same :class:`ConfigError` on every rank if they disagree."""
        if self.pg is None:
            claims = [claim]
        else:
            import torch.distributed as dist

            claims = [None] * dist.get_world_size(self.pg)
            dist.all_gather_object(claims, claim, group=self.pg)
        problems = [p for c in claims for p in c.problems]
        ranks = sorted(c.layout_rank for c in claims)
        if ranks != list(range(len(claims))):
            problems.append(f"the group's ranks hold layout ranks {[c.layout_rank for c in claims]}, not each of "
                            f"0..{len(claims) - 1} once")
        for what in ("train", "spec", "plan", "directory"):
            seen = {getattr(c, what) for c in claims}
            if len(seen) > 1:
                problems.append(f"the ranks disagree on the {what}: " + "; ".join(
                    f"layout rank {c.layout_rank}: {getattr(c, what)}" for c in claims))
        if problems:
            raise ConfigError("checkpoint: nothing was written:\n  " + "\n  ".join(problems))
        self.of_layout = {c.layout_rank: i for i, c in enumerate(claims)}

    def barrier(self) -> None:
        if self.pg is not None:
            import torch.distributed as dist

            dist.barrier(group=self.pg)

    def send(self, t: torch.Tensor, to: int, what: str) -> None:
        import torch.distributed as dist

        try:
            dist.send(t, group=self.pg, group_dst=self.of_layout[to])
        except RuntimeError as e:
            raise TransportError(f"checkpoint: sending {what} to training rank {to} failed: {e}", peer=to) from e

    def recv(self, t: torch.Tensor, frm: int, what: str) -> None:
        import torch.distributed as dist

        try:
            dist.recv(t, group=self.pg, group_src=self.of_layout[frm])
        except RuntimeError as e:
            raise TransportError(f"checkpoint: receiving {what} from training rank {frm} failed: {e}", peer=frm) from e


# -- moving and writing -----------------------------------------------------------------------------


def _rel(box: Box, outer: Box) -> tuple[slice, ...]:
    return slices(tuple((o - oo, n) for (o, n), (oo, _) in zip(box, outer)))


def _source_view(tensors: dict[str, torch.Tensor], part: Any) -> torch.Tensor:
    return tensors[part.src_tensor][slices(part.src_box)].view(box_shape(part.canon_box))


def _slab_views(buf: torch.Tensor, w: Window) -> list[torch.Tensor]:
    out = []
    for s in w.slabs:
        nb = box_numel(s.box) * itemsize(s.dtype)
        out.append(buf[s.offset:s.offset + nb].view(torch_dtype(s.dtype)).view(box_shape(s.box)))
    return out


def _run(train: Any, plan: CheckpointPlan, world: _Group, directory: Path) -> dict[str, int]:
    me = train.rank
    tensors = train.tensors
    bufs = _Buffers(world.device)
    stats = dict(written=0, sent=0, received=0, local=0, messages=0, largest=0, peak=0)
    fds: dict[int, int] = {}
    for i, f in enumerate(plan.files):
        if f.owner == me:
            fd = fds[i] = _create_private(directory / (f.name + ".tmp"))
            _pwrite(fd, f.header, 0)
            os.ftruncate(fd, len(f.header) + f.data_bytes)
    try:
        with torch.no_grad():
            for w in plan.windows:
                f = plan.files[w.file]
                if w.owner == me:
                    buf = bufs.take(w.nbytes)
                    views = _slab_views(buf, w)
                    for src in w.sources:
                        if src.rank == me:
                            for p in src.parts:
                                views[p.slab][_rel(p.canon_box, w.slabs[p.slab].box)].copy_(_source_view(tensors, p))
                            stats["local"] += src.nbytes
                            continue
                        msg = bufs.take(src.nbytes)
                        world.recv(msg, src.rank, f"{src.nbytes} bytes of {f.name}")
                        at = 0
                        for p in src.parts:
                            s = w.slabs[p.slab]
                            piece = msg[at:at + p.nbytes].view(torch_dtype(s.dtype)).view(box_shape(p.canon_box))
                            views[p.slab][_rel(p.canon_box, s.box)].copy_(piece)
                            at += p.nbytes
                        bufs.give(msg)
                        stats["received"] += src.nbytes
                        stats["messages"] += 1
                        stats["largest"] = max(stats["largest"], src.nbytes)
                    host = buf if buf.device.type == "cpu" else buf.cpu()
                    _pwrite(fds[w.file], host.numpy(), len(f.header) + w.start)
                    stats["written"] += w.nbytes
                    del views, host
                    bufs.give(buf)
                    continue
                for src in w.sources:
                    if src.rank != me:
                        continue
                    msg = bufs.take(src.nbytes)
                    at = 0
                    for p in src.parts:
                        s = w.slabs[p.slab]
                        msg[at:at + p.nbytes].view(torch_dtype(s.dtype)).view(box_shape(p.canon_box)).copy_(
                            _source_view(tensors, p))
                        at += p.nbytes
                    world.send(msg, w.owner, f"{src.nbytes} bytes of {f.name}")
                    bufs.give(msg)
                    stats["sent"] += src.nbytes
                    stats["messages"] += 1
                    stats["largest"] = max(stats["largest"], src.nbytes)
        for i, fd in fds.items():
            os.fsync(fd)
    except BaseException:
        for i in fds:
            with contextlib.suppress(OSError):
                os.unlink(directory / (plan.files[i].name + ".tmp"))
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    for i in fds:
        name = plan.files[i].name
        os.replace(directory / (name + ".tmp"), directory / name)
    stats["peak"] = bufs.peak
    return stats


def _pwrite(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


__all__ = ["save_checkpoint", "SaveResult", "hf_config"]
