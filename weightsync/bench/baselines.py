"""The approaches weightsync is measured against, run over the same group, GPUs and weights.

- ``naive`` (OpenRLHF, early verl): per canonical tensor, training rank 0 gathers the full tensor from
  the ranks holding its shards, broadcasts it to every rank of the group, and each inference rank
  slices out its part (its pieces of that tensor).
- ``bucketed`` (slime, current verl): the same, but full tensors are packed into ~512 MB buckets and
  each bucket is broadcast once.

Both need every member of the group to take part in each broadcast (that is how they work). Each
side calls the same function with its role; trainers pass their live tensors, inference workers
theirs. The gather uses point-to-point messages to rank 0 in one fixed order (deadlock-free: rank 0
receives them in exactly the order each sender sends them).

Co-located (trainer and inference workers share the GPUs), the same two hand the full tensors over by
CUDA IPC instead of a broadcast, as slime and verl do: the training rank owning a canonical tensor (the
lowest one holding any of it) gathers it whole into a bucket buffer on its GPU -- shards held by other
training ranks (TP, EP, FSDP) come over a group of the training ranks, as their all-gathers do -- and
every inference worker slices its parts out of it (across NVLink when the buffer lives on another
GPU), then acknowledges. We are generous to them: two
bucket buffers per training GPU are exported once and reused (they open fresh IPC handles for every
bucket), and the ready/ack signals go through one TCPStore (they use HTTP or Ray calls).
"""

from __future__ import annotations

from typing import Mapping


import torch
import torch.distributed as dist

from weightsync.errors import ConfigError
from weightsync.layout.box import slices
from weightsync.layout.layout import EngineLayout
from weightsync.layout.materialize import TORCH_DTYPES, local_view
from weightsync.plan.job import JobRanks

BUCKET_BYTES = 512 << 20
GATHER_TAG = 11


def _broadcast(group, tensor: torch.Tensor, timeout) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait(timeout=timeout)


def _sources(src: EngineLayout, canonical: str, root: int) -> list[tuple[int, object]]:
    """(training rank, its piece) sending each distinct box of ``canonical`` to ``root``: the root
    itself where it holds the box (a replica, or a tied weight's second copy, counts once), else the
    lowest rank holding it."""
    holders: dict[tuple, list[tuple[int, object]]] = {}
    for shard in src.shards(canonical):
        for r in src.group_ranks(shard.group):
            holders.setdefault(shard.piece.canon_box, []).append((r, shard.piece))
    return [next((h for h in hs if h[0] == root), min(hs, key=lambda h: h[0])) for hs in holders.values()]


def _gather_into(group, src: EngineLayout, train_rank: int | None, tensors: Mapping[str, torch.Tensor] | None,
                 canonical: str, full: torch.Tensor, timeout, root: int = 0) -> None:
    """Training rank ``root`` assembles ``full`` from one holder of every box (:func:`_sources`); the
    holders send (call on every training rank; ``full`` matters on the root only, elsewhere just its
    dtype). Group rank r is training rank r."""
    if train_rank is None:
        return
    for holder, p in _sources(src, canonical, root):
        if holder == root and train_rank == root:
            full[slices(p.canon_box)].copy_(local_view(tensors[p.tensor], p))
        elif train_rank == root:
            buf = torch.empty(tuple(n for _, n in p.canon_box), dtype=full.dtype, device=full.device)
            group.recv([buf], holder, GATHER_TAG).wait(timeout=timeout)
            full[slices(p.canon_box)].copy_(buf)
        elif train_rank == holder:
            shard_data = local_view(tensors[p.tensor], p).to(full.dtype).contiguous()
            group.send([shard_data], root, GATHER_TAG).wait(timeout=timeout)


_PIECES: dict[int, tuple[object, dict[str, list]]] = {}


def _pieces_of(dst_layout) -> dict[str, list]:
    """canonical name -> [(local tensor, piece)] of a layout, indexed once (MoE layouts hold ~10^4 pieces)."""
    got = _PIECES.get(id(dst_layout))
    if got is None or got[0] is not dst_layout:
        index: dict[str, list] = {}
        for name, t in dst_layout.tensors.items():
            for p in t.pieces:
                index.setdefault(p.canonical, []).append((name, p))
        got = _PIECES[id(dst_layout)] = (dst_layout, index)
    return got[1]


def _scatter_from(dst_layout, tensors: Mapping[str, torch.Tensor], canonical: str, full: torch.Tensor) -> None:
    """An inference rank slices its pieces of one canonical tensor out of the full tensor."""
    for name, p in _pieces_of(dst_layout).get(canonical, ()):
        local_view(tensors[name], p).copy_(full[slices(p.canon_box)])


def sync_step(
    kind: str,
    group,
    ranks: JobRanks,
    src: EngineLayout,
    dst: EngineLayout,
    *,
    train_rank: int | None = None,
    infer: tuple[int, int] | None = None,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device,
    timeout,
) -> None:
    """One weight sync the ``kind`` way; call on every member of ``group`` (training and inference)."""
    spec = src.spec
    dst_layout = dst.layout(infer[1]) if infer is not None else None
    if kind == "naive":
        for t in spec.tensors:
            full = torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=device)
            _gather_into(group, src, train_rank, tensors, t.name, full, timeout)
            _broadcast(group, full, timeout)
            if dst_layout is not None:
                _scatter_from(dst_layout, tensors, t.name, full)
        return
    if kind != "bucketed":
        raise ValueError(f"unknown baseline {kind!r}")
    for bucket in _buckets(spec.tensors, BUCKET_BYTES):
        buf = torch.empty(sum(t.nbytes for t in bucket), dtype=torch.uint8, device=device)
        views = _views(buf, bucket)
        for t, v in zip(bucket, views):
            _gather_into(group, src, train_rank, tensors, t.name, v, timeout)
        _broadcast(group, buf, timeout)
        if dst_layout is not None:
            for t, v in zip(bucket, views):
                _scatter_from(dst_layout, tensors, t.name, v)


def _views(buf: torch.Tensor, bucket: list) -> list[torch.Tensor]:
    """The bucket's full tensors, back to back in ``buf``."""
    views, off = [], 0
    for t in bucket:
        views.append(buf[off:off + t.nbytes].view(TORCH_DTYPES[t.dtype]).view(t.shape))
        off += t.nbytes
    return views


def _buckets(tensors, limit: int) -> list[list]:
    """Consecutive canonical tensors cut into buckets of at most ``limit`` bytes (one tensor alone when larger)."""
    out, cur, size = [], [], 0
    for t in tensors:
        if cur and size + t.nbytes > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur:
        out.append(cur)
    return out


# -- co-located: hand-over by CUDA IPC ----------------------------------------------------------------

SLOTS = 2  # bucket buffers per training GPU: the trainer fills one while the workers read the other


def colocated_buckets(kind: str, src: EngineLayout) -> dict[int, list[list]]:
    """Per owning training rank (the lowest holding any of a canonical tensor), its tensors cut the
    ``kind`` way (naive: one per bucket)."""
    if kind not in ("naive", "bucketed"):
        raise ValueError(f"unknown baseline {kind!r}")
    owned: dict[int, list] = {}
    for t in src.spec.tensors:
        owned.setdefault(_owner(src, t.name), []).append(t)
    return {r: _buckets(ts, BUCKET_BYTES if kind == "bucketed" else 0) for r, ts in sorted(owned.items())}


def _owner(src: EngineLayout, canonical: str) -> int:
    return min(r for s in src.shards(canonical) for r in src.group_ranks(s.group))


def needs_training_group(src: EngineLayout) -> bool:
    """Whether some canonical tensor's owner lacks part of it (then the trainers gather over a group)."""
    return any(r != owner for t in src.spec.tensors
               for owner in [_owner(src, t.name)] for r, _ in _sources(src, t.name, owner))


def _key(kind: str, step: int, rank: int, k: int, what: str) -> str:
    return f"{kind}/{step}/{rank}/{k}/{what}"


class ColocatedTrainer:
    """A training rank's side: export two bucket buffers once, then every step walk every owner's buckets
    in one order, filling its own (gathering the shards other ranks hold) and sending its shards of the
    others'. ``group`` joins the training ranks (group rank = training rank); needed only when
    :func:`needs_training_group`."""

    def __init__(self, kind: str, src: EngineLayout, rank: int, tensors: Mapping[str, torch.Tensor], store,
                 workers: int, publish, group=None) -> None:
        from weightsync.transport.share import share_tensors

        if group is None and needs_training_group(src):
            raise ConfigError("the co-located baselines gather tensors split over training ranks over a group "
                              "of the training ranks: pass one")
        self.kind, self.src, self.rank, self.tensors, self.store, self.workers = kind, src, rank, tensors, store, workers
        self.group = group
        self.all_buckets = colocated_buckets(kind, src)
        self.buckets = self.all_buckets.get(rank, [])
        size = max((sum(t.nbytes for t in b) for b in self.buckets), default=1)
        self.device = next(iter(tensors.values())).device
        self.slots = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(SLOTS)]
        for j in range(workers):  # a CUDA IPC description serves one importing process
            path = share_tensors({str(i): s for i, s in enumerate(self.slots)}, f"bench-{kind}", f"{rank}-{j}")
            publish(f"bench-colo.{kind}.{rank}.{j}", path)

    def step(self, step: int, timeout) -> None:
        acked = lambda k: [_key(self.kind, step, self.rank, k, f"ack{j}") for j in range(self.workers)]
        for owner, buckets in self.all_buckets.items():  # every trainer in the same order: sends meet receives
            for k, bucket in enumerate(buckets):
                if owner != self.rank:  # my shards of another owner's tensors, if any
                    for t in bucket:
                        dtype_only = torch.empty(0, dtype=TORCH_DTYPES[t.dtype], device=self.device)
                        _gather_into(self.group, self.src, self.rank, self.tensors, t.name, dtype_only, timeout, owner)
                    continue
                if k >= SLOTS:
                    self.store.wait(acked(k - SLOTS), timeout)
                for t, v in zip(bucket, _views(self.slots[k % SLOTS], bucket)):
                    _gather_into(self.group, self.src, self.rank, self.tensors, t.name, v, timeout, owner)
                _sync(self.device)  # another process reads the buffer next
                self.store.set(_key(self.kind, step, self.rank, k, "ready"), "1")
        for k in range(max(0, len(self.buckets) - SLOTS), len(self.buckets)):
            self.store.wait(acked(k), timeout)

    def finish(self, timeout) -> None:
        """Say this rank is through; training rank 0 serves the store, so it waits for every trainer and worker."""
        self.store.set(_done(self.kind, f"train{self.rank}"), "1")
        if self.rank == 0:
            self.store.wait([_done(self.kind, f"train{r}") for r in range(self.src.world_size)]
                            + [_done(self.kind, f"worker{j}") for j in range(self.workers)], timeout)


def _done(kind: str, who: str) -> str:
    return f"{kind}/done/{who}"


class ColocatedWorker:
    """An inference worker's side: open every training rank's buffers once; every step slice each bucket out."""

    def __init__(self, kind: str, src: EngineLayout, dst_layout, worker: int, tensors: Mapping[str, torch.Tensor],
                 store, lookup) -> None:
        from weightsync.transport.share import open_shared

        self.kind, self.dst_layout, self.worker, self.tensors, self.store = kind, dst_layout, worker, tensors, store
        self.buckets = colocated_buckets(kind, src)
        self.slots = {}
        for r in self.buckets:
            opened = open_shared(lookup(f"bench-colo.{kind}.{r}.{worker}"))
            self.slots[r] = [opened[str(i)] for i in range(SLOTS)]

    def step(self, step: int, timeout) -> None:
        for r, buckets in self.buckets.items():  # one training rank after the other, as an engine serves requests
            for k, bucket in enumerate(buckets):
                self.store.wait([_key(self.kind, step, r, k, "ready")], timeout)
                for t, v in zip(bucket, _views(self.slots[r][k % SLOTS], bucket)):
                    _scatter_from(self.dst_layout, self.tensors, t.name, v)
                _sync(next(iter(self.tensors.values())).device)
                self.store.set(_key(self.kind, step, r, k, f"ack{self.worker}"), "1")

    def finish(self) -> None:
        """Say this worker is through (training rank 0 may stop serving the store once everyone did)."""
        self.store.set(_done(self.kind, f"worker{self.worker}"), "1")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
