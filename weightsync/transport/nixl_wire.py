"""What the NIXL transport puts on the wire and on the MetaServer: NIXL itself, loaded lazily; a
training rank's descriptor document (small JSON, no pickles); and the byte runs a box covers.

A training rank publishes ONE document per connect (not per topology: it does not depend on which
instances exist): its NIXL agent's metadata (base64 of NIXL's own serialisation), the regions it
registered, and for every tensor its address, shape, strides and dtype, plus the address of a small
header (``seq, step``) a reader checks a step against. The MetaServer keeps rendezvous values of at
most 512 characters, so the document travels zlib-compressed and base64-encoded in chunks, under
``nixl.train.<rank>.<agent>.<k>``, with a head ``nixl.train.<rank>`` = ``<agent> <chunks> <sha256>``
published last (replaced on reconnect); a reader checks the digest of what it assembled.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import os
import sys
import zlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Sequence

from weightsync.errors import ConfigError, TransportError

if TYPE_CHECKING:
    import numpy as np

    from weightsync.meta.client import MetaClient

CHUNK = 500  # characters per rendezvous value (the MetaServer's limit is 512)
HEADER_WORDS = 4  # int64: seq (even when stable), step, 0, 0


def load_nixl() -> ModuleType:
    """NIXL's Python API (``nixl._api``): the ``nixl`` meta package when installed, else the CUDA build
    that matches torch's (``nixl_cu13`` / ``nixl_cu12``), else any installed build."""
    import importlib

    import torch

    cuda = torch.version.cuda.split(".")[0] if torch.version.cuda else None
    names = ["nixl._api"] + ([f"nixl_cu{cuda}._api"] if cuda else []) + ["nixl_cu13._api", "nixl_cu12._api"]
    errors = []
    for name in names:
        try:
            api = importlib.import_module(name)
        except ImportError as e:  # not installed, or the meta package found no build for this CUDA
            errors.append(f"{name}: {e}")
            continue
        _quiet_nixl_logging()
        return api
    raise ConfigError("the nixl transport needs NIXL: pip install 'weightsync[rdma]' (nixl-cu12; on a CUDA 13 "
                      "torch, nixl-cu13). Tried " + "; ".join(errors))


def _quiet_nixl_logging() -> None:
    """NIXL configures its ``nixl`` logger at INFO onto *stdout* (``nixl*/logging.py``), which breaks a
    ``--json`` answer on stdout and is not quiet by default: its handlers go to stderr, at WARNING unless
    the user asked for a level with NIXL's own ``NIXL_LOG_LEVEL``."""
    nixl_logger = logging.getLogger("nixl")
    for handler in nixl_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)


@dataclass(frozen=True)
class RemoteTensor:
    """A training rank's tensor as a reader addresses it."""

    addr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    itemsize: int


@dataclass(frozen=True)
class PackedBox:
    """A source box a training rank copies, every step, into its registered pack region (row-major, one run)."""

    tensor: str
    box: tuple[tuple[int, int], ...]
    addr: int
    nbytes: int


@dataclass(frozen=True)
class TrainerDoc:
    """What one training rank publishes for its readers (see the module docstring)."""

    rank: int
    agent: str
    metadata: bytes  # NIXL's serialised agent metadata (loaded with add_remote_agent)
    mem: str  # "DRAM" or "VRAM": where the tensors live
    device: int  # the tensors' GPU index in the trainer process (0 for DRAM)
    regions: tuple[tuple[int, int], ...]  # registered (addr, nbytes) the tensors lie in
    tensors: dict[str, RemoteTensor]
    header: int  # address of the DRAM header (HEADER_WORDS int64)
    layout_digest: str
    mode: str
    #: source boxes the trainer packs every step (each one run in a registered pack region): a box it holds
    #: strided -- a column half of a row-parallel weight -- is one descriptor instead of one per row
    packed: tuple[PackedBox, ...] = ()

    def packed_at(self) -> dict[tuple[str, tuple[tuple[int, int], ...]], PackedBox]:
        """The packed boxes by (tensor, box)."""
        return {(p.tensor, p.box): p for p in self.packed}

    def to_json(self) -> str:
        return json.dumps({
            "rank": self.rank, "agent": self.agent, "metadata": base64.b64encode(self.metadata).decode(),
            "mem": self.mem, "device": self.device, "regions": [list(r) for r in self.regions],
            "tensors": {n: [t.addr, list(t.shape), list(t.stride), t.dtype, t.itemsize] for n, t in self.tensors.items()},
            "header": self.header, "layout_digest": self.layout_digest, "mode": self.mode,
            "packed": [[p.tensor, [list(d) for d in p.box], p.addr, p.nbytes] for p in self.packed],
        }, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> TrainerDoc:
        d = json.loads(text)
        return TrainerDoc(
            int(d["rank"]), str(d["agent"]), base64.b64decode(d["metadata"]), str(d["mem"]), int(d["device"]),
            tuple((int(a), int(n)) for a, n in d["regions"]),
            {n: RemoteTensor(int(a), tuple(s), tuple(st), str(dt), int(sz)) for n, (a, s, st, dt, sz) in d["tensors"].items()},
            int(d["header"]), str(d["layout_digest"]), str(d["mode"]),
            tuple(PackedBox(str(n), tuple((int(o), int(e)) for o, e in box), int(a), int(b))
                  for n, box, a, b in d.get("packed", [])),
        )


def doc_key(rank: int) -> str:
    return f"nixl.train.{rank}"


def publish_doc(client: MetaClient, doc: TrainerDoc) -> int:
    """Publish ``doc`` in chunks, head last; return the characters published."""
    text = base64.b64encode(zlib.compress(doc.to_json().encode(), 6)).decode()
    chunks = [text[i : i + CHUNK] for i in range(0, len(text), CHUNK)] or [""]
    key = doc_key(doc.rank)
    for k, chunk in enumerate(chunks):
        client.publish(f"{key}.{doc.agent}.{k}", chunk)
    client.publish(key, f"{doc.agent} {len(chunks)} {hashlib.sha256(text.encode()).hexdigest()}", replace=True)
    return len(text)


def lookup_doc(client: MetaClient, rank: int, timeout_s: float) -> TrainerDoc:
    """Training rank ``rank``'s document, waiting for it; a torn or foreign one is refused."""
    key = doc_key(rank)
    head = client.lookup(key, timeout=timeout_s)
    try:
        agent, count, digest = head.split(" ")
        n = int(count)
    except ValueError:
        raise TransportError(f"training rank {rank} published {key}={head!r}, not a NIXL descriptor head "
                             "(is it running the nixl transport?)", pair=(rank, -1, -1)) from None
    text = "".join(client.lookup(f"{key}.{agent}.{k}", timeout=timeout_s) for k in range(n))
    if hashlib.sha256(text.encode()).hexdigest() != digest:
        raise TransportError(f"training rank {rank}'s NIXL descriptors do not match their digest: "
                             "re-published while read? connect again", pair=(rank, -1, -1))
    doc = TrainerDoc.from_json(zlib.decompress(base64.b64decode(text)).decode())
    if doc.rank != rank:
        raise TransportError(f"{key} holds the descriptors of training rank {doc.rank}, not {rank}")
    return doc


def box_runs(addr: int, shape: Sequence[int], stride: Sequence[int], itemsize: int,
             box: Sequence[tuple[int, int]]) -> np.ndarray:
    """The contiguous byte runs ``(addr, nbytes)`` that ``box`` of a strided tensor covers, in row-major
    element order, adjacent runs merged (an int64 array of shape (N, 2)).

    The trailing dimensions the box covers whole and that lie contiguous fold into one block; the
    dimension before them contributes its extent when its stride continues them; every outer index
    is one run. A box of a contiguous tensor's leading rows is one run; a column half of a matrix
    one run per row."""
    import numpy as np

    n = len(shape)
    if math.prod(e for _, e in box) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    block = 1  # elements of the contiguous trailing block
    d = n - 1
    while d >= 0 and (stride[d] == block or shape[d] == 1) and tuple(box[d]) == (0, shape[d]):
        block *= shape[d]
        d -= 1
    base = 0
    outer = d  # dims [0, outer) are enumerated
    if d >= 0 and (stride[d] == block or box[d][1] == 1):
        base = box[d][0] * stride[d]
        block *= box[d][1]
    else:
        outer = d + 1
    offsets = np.zeros(1, dtype=np.int64) + base
    for j in range(outer):
        o, e = box[j]
        offsets = (offsets[:, None] + (np.arange(o, o + e, dtype=np.int64) * stride[j])[None, :]).reshape(-1)
    starts = addr + offsets * itemsize
    return merge_runs(np.stack([starts, np.full_like(starts, block * itemsize)], axis=1))


def merge_runs(runs: np.ndarray) -> np.ndarray:
    """Join consecutive runs where one ends where the next starts ((N, 2) int64 in, fewer out)."""
    import numpy as np

    if len(runs) <= 1:
        return runs
    breaks = np.nonzero(runs[1:, 0] != runs[:-1, 0] + runs[:-1, 1])[0] + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(runs)]])
    lens = np.add.reduceat(runs[:, 1], starts)
    return np.stack([runs[starts, 0], lens], axis=1)[: len(ends)]


def merge_pairs(local: np.ndarray, remote: np.ndarray, local_regions: Sequence[tuple[int, int]] = (),
                remote_regions: Sequence[tuple[int, int]] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Join consecutive (local, remote) descriptor pairs that continue each other on BOTH sides: one
    descriptor instead of several (NIXL pays its cost per descriptor) -- but never across two registered
    regions (sorted ``(addr, nbytes)``): a descriptor must lie inside one registration, and on a GPU the
    caching allocator puts separately registered tensors back to back."""
    import numpy as np

    if len(local) <= 1:
        return local, remote
    cont = (local[1:, 0] == local[:-1, 0] + local[:-1, 1]) & (remote[1:, 0] == remote[:-1, 0] + remote[:-1, 1])
    for runs, regions in ((local, local_regions), (remote, remote_regions)):
        if len(regions):
            starts = np.asarray([a for a, _ in regions], dtype=np.int64)
            which = np.searchsorted(starts, runs[:, 0], side="right")
            cont &= which[1:] == which[:-1]
    starts = np.concatenate([[0], np.nonzero(~cont)[0] + 1])
    lens = np.add.reduceat(local[:, 1], starts)
    return (np.stack([local[starts, 0], lens], axis=1), np.stack([remote[starts, 0], lens], axis=1))
