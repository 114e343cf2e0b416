"""Predict a step of a plan: the busiest link, plus what the CPU posts and the step's signals cost.

Two layers. :func:`predict_seconds` is the link model alone: the busiest link's bytes over its bandwidth,
each bucket paying a fixed latency on both ends (links per GPU: NVLink egress/ingress to peers on the
host, NIC egress/ingress to other hosts, HBM for same-GPU copies). :func:`predict_step` adds what the
runs on the H200 showed the link model leaves out (issue 26), as one :class:`CostModel` whose every
number was measured here and says where:

- per transport, how the bytes move and what the receiving worker's CPU posts each step -- the co-located
  copy kernel (a fixed set-up, then one graph of copies at a fraction of the device-copy rate); p2p NCCL
  (a CPU cost per message, posted while earlier buckets move); NIXL READ (a CPU cost per descriptor,
  counted exactly as ``transport/nixl.py`` builds them, :mod:`weightsync.plan.descriptors`; on the
  H200, with the reader's NIXL progress thread off, the copies run while the CPU posts; with it, they
  waited and the two added: :meth:`CostModel.reader_progress_thread`), and the trainers' copy of their
  strided boxes into their pack regions;
- per step, the signals: ``written`` by a doorbell in host shared memory (co-located sync jobs) or
  through the MetaServer (whose CPU per request bounds a large job's round);
- per receiver, the call into the engine a step: a layout-faithful worker answers one pipe call; a real
  vLLM or SGLang engine one call through the call mailbox (weightsync/runtime/mailbox.py; the engines' older
  ``collective_rpc`` trips and pause/flush/continue calls: :meth:`CostModel.engine_rpc_receivers`);
- per codec, the bytes on the wire and the work around them: full; block FP8 (the codec's bytes; the
  trainer's encode before it announces the step, the worker's decode after the READ -- added where the READ
  runs at HBM speed on one GPU, overlapped with the wire elsewhere -- and, co-located, the quantize inside
  the copy graph at the encode's rate); delta at a measured change fraction, with the encode, the
  receiver's proof and the apply at their measured rates.

The constants are one GPU's (and its host's): :class:`CostModel`'s defaults are the H200's, :data:`H100` the
profile of what one H100 measured, each selected by name (:data:`GPUS`, :func:`cost_model`; ``weightsync plan
--gpu``; a bench record's GPU by :func:`gpu_of`).

Used by ``weightsync plan`` for the cases that cannot be run here (thousands of GPUs), and checked
against every recorded run that one or two H200s or one H100 could make (tests/test_simulate.py, BENCHMARKS.md
"Simulator with per-descriptor and signalling costs" and "2026-12-06: the simulator per GPU").
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

from weightsync.errors import ConfigError
from weightsync.plan.descriptors import POST_CHUNK, WorkerCounts
from weightsync.plan.planner import Bucket
from weightsync.plan.topology import Topology

QWEN3_8B_BYTES = 16_381_470_720  # the bytes of the qwen3-8b runs the per-byte rates below divide by


@dataclass(frozen=True)
class LinkModel:
    """Defaults: H200 NVLink measured here (337 GiB/s per direction), 400 Gb/s NICs, device copy ~1900 GiB/s."""

    nvlink_bytes_per_s: float = 337 * 2**30
    nic_bytes_per_s: float = 50e9
    hbm_copy_bytes_per_s: float = 1900 * 2**30
    latency_s: float = 20e-6


def predict_seconds(buckets: Iterable[Bucket], topology: Topology, links: LinkModel = LinkModel()) -> float:
    """The busiest link's time: its bytes over its bandwidth, plus ``latency_s`` per bucket on each end."""
    buckets = list(buckets)
    return _busiest_link(buckets, [b.nbytes for b in buckets], topology, links, links.hbm_copy_bytes_per_s,
                         links.latency_s)


def _busiest_link(buckets: Sequence[Bucket], sizes: Sequence[int], topology: Topology, links: LinkModel,
                  hbm_bytes_per_s: float, per_bucket_s: float, hbm_sizes: Sequence[int] | None = None) -> float:
    """The busiest link's time when bucket ``i`` puts ``sizes[i]`` bytes on it: same-GPU copies on the GPU's
    HBM at ``hbm_bytes_per_s`` (``hbm_sizes[i]`` bytes there where given), the others on the sender's egress
    and the receiver's ingress (NVLink on one host, else the NICs), each bucket paying ``per_bucket_s`` on
    every link it crosses."""
    load: dict[tuple[str, int], float] = defaultdict(float)
    for i, (b, n) in enumerate(zip(buckets, sizes)):
        s = topology.train_gpu(b.src_rank)
        d = topology.infer_gpu(b.dst_instance, b.dst_rank)
        if s == d:
            load["hbm", s] += (n if hbm_sizes is None else hbm_sizes[i]) / hbm_bytes_per_s + per_bucket_s
            continue
        if topology.host(s) == topology.host(d):
            bw, out_link, in_link = links.nvlink_bytes_per_s, "nvl_out", "nvl_in"
        else:
            bw, out_link, in_link = links.nic_bytes_per_s, "nic_out", "nic_in"
        load[out_link, s] += n / bw + per_bucket_s
        load[in_link, d] += n / bw + per_bucket_s
    return max(load.values(), default=0.0)


# -- the cost model -------------------------------------------------------------------------------------

TRANSPORTS = ("colocated", "p2p", "nixl")
RECEIVERS = ("faithful", "vllm", "sglang")
CODECS = ("full", "fp8", "delta")


@dataclass(frozen=True)
class DeltaRates:
    """A delta step's work at one change fraction, as bytes of the full step handled per second (one H200,
    qwen3-8b's 16.38 GB in 82 buckets, previous version on the GPU, median of 3 steps):
    ``benchmarks/results/2026-12-01-h200x1-qwen3-8b-delta-sender-call2-phases-inplace.json``."""

    fraction: float
    encode_bytes_per_s: float  # the sender: pack, compare, encode, keep as base (sender_encode_s)
    proof_bytes_per_s: float  # the receiver's checksum of what it holds (receiver_proof_s)
    apply_bytes_per_s: float  # the receiver's payload fetch and apply (receiver_fetch_apply_s)


def _rates(fraction: float, encode_s: float, proof_s: float, apply_s: float) -> DeltaRates:
    return DeltaRates(fraction, QWEN3_8B_BYTES / encode_s, QWEN3_8B_BYTES / proof_s, QWEN3_8B_BYTES / apply_s)


@dataclass(frozen=True)
class CostModel:
    """Every cost the step prediction charges, each measured on the H200 hosts (source beside it): the H200
    profile (``gpu="h200"``). :data:`H100` is the same model with what the H100 runs measured in its place.

    "e3b8935 colo" is ``benchmarks/results/2026-12-01-h200x1-colo-1gpu-e3b8935.json``, "e3b8935
    nixl" ``...-nixl-1gpu-e3b8935.json`` (line 5: the JSON after NIXL's log lines), "real vLLM"
    ``...-real-vllm026-colo-1gpu.json``, "sep-1to1 8B" ``2026-11-30-h200x2-qwen3-8b-sep-1to1.json``,
    "signals" ``2026-11-30-h200x2-signals.txt``, all under ``benchmarks/results/``.
    """

    gpu: str = "h200"  # the profile's name (GPUS): which GPU, and host, these constants were measured on
    links: LinkModel = field(default_factory=LinkModel)
    # co-located: the copy kernel's rate against the device copy, on 8B's 40 MB runs (BENCHMARKS.md
    # 2026-11-30 up to 993772e, "Copy kernel tuned": microbenchmark 0.93)
    colocated_copy_efficiency: float = 0.93
    # co-located: the worker's work before its first copy (address look-ups, the graph launch): e3b8935
    # colo reader.started 0.15 ms
    colocated_setup_s: float = 0.15e-3
    # p2p: CPU per NCCL message posted, overlapped with the transfers: sep-1to1 8B reader.posting 6.51 ms
    # for the worker's 371 messages (weightsync.plan.descriptors counts them)
    nccl_message_s: float = 6.51e-3 / 371
    # nixl: CPU per READ descriptor posted, the copies running meanwhile (a reader without NIXL's progress
    # thread, the transport's default since cdaf17d): nixl_gpu.py --layout qwen3-8b, nothread_per_tensor_
    # 1xfer_post_s 3.156 ms for 399 descriptors, every copy done 8.77 ms after the first post against a 7.66 ms
    # device copy (2026-12-02-h200x1-nixl-layout-qwen3-8b-cc14075.json)
    nixl_descriptor_s: float = 3.156e-3 / 399
    nixl_posting_overlaps: bool = True
    # nixl: before the first copy runs, beyond posting the first transfer's descriptors (the program's look-up,
    # the first transfer() call): reader.started 0.942 ms, less 64 descriptors at nixl_descriptor_s
    # (2026-12-02-h200x1-qwen3-8b-nixl-1gpu-issue26-new-nothread-cc14075.json)
    nixl_setup_s: float = 0.942e-3 - 64 * 3.156e-3 / 399
    # signals: a step's fixed cost outside the workers' call with a doorbell (writer.send, the ring, the
    # reader's bookkeeping, held): e3b8935 colo median_seconds - reader.workers = 9.23 - 8.99 ms
    step_round_s: float = 0.24e-3
    doorbell_s: float = 8.5e-6  # signals: shm-spin median (part of step_round_s)
    metaserver_signal_s: float = 886.6e-6  # signals: http (POST -> long poll returns) median, one way
    # the MetaServer's CPU per request with a large job's steps (BENCHMARKS.md "MetaServer", 1,024 trainers
    # + 128 instances: 0.37 s of server CPU a step, 2,304 requests, 160 us each); a step's round takes at
    # least its requests' CPU, one after another
    metaserver_request_s: float = 160e-6
    # receivers: the reader's call into a layout-faithful worker and back (a pickled call over a pipe plus
    # the worker's bookkeeping): BENCHMARKS.md "What bounds the results now", ~0.5 ms (reader.workers -
    # reader.transport: 0.40 ms e3b8935 colo, 0.51 ms real vLLM's faithful row, 0.58 ms e3b8935 nixl)
    faithful_call_s: float = 0.5e-3
    # a real vLLM 0.26 engine (worker extension), through the call mailbox (no engine-core trip a step): its
    # reader.workers - reader.transport, 9.659 - 8.661 ms in 2026-12-02-h200x1-real-vllm026-mailbox-colo-1gpu-
    # split-4cd83b1.json (the instance's split: 0.35 ms in the worker's handler around the receive, 0.31 the
    # mailbox's round trip, 0.11 two device syncs, 0.23 the reader outside the call; its reader.started 0.15 ms,
    # the faithful row's 0.17: no set-up beyond the faithful receiver's). The 6f817f1 run of the same code
    # before the split: 9.965 - 8.887 = 1.08 ms
    vllm_step_s: float = 9.659e-3 - 8.661e-3
    # a real SGLang 0.5.14 engine through the call mailbox (a quiet update: no SGLang request a step):
    # reader.workers - reader.transport = 10.570 - 8.567 ms in 2026-12-02-h200x1-real-sglang0514-mailbox-colo-
    # 1gpu-685101f.json (0.86 ms the handler around the receive, 0.55 the mailbox's round trip, 0.11 the syncs,
    # 0.59 the writer lock and the pause check on the engine's event loop)
    sglang_step_s: float = 10.570e-3 - 8.567e-3
    # the receivers' calls sent before the trainers' `written` (2026-12-07, weightsync.transport.gate; the runtime's
    # default since 4ea3863): what is left of each after the go, reader.workers - reader.transport of the early
    # rows of 2026-12-07-h100x1-*-31ec0cc.json on one H100 (the mean of each receiver's two rows; not measured on an
    # H200: these stand for it too). The trip, the decode and the co-located set-up (colocated_setup_s) run before
    # the go: in the bench the reader sends step s + 1's call as update(s) returns, long before the trainers' bell.
    # faithful: qwen3-8b-colo-1gpu-faithful 0.131 ms, real-sglang0514-colo-1gpu-faithful-call1 0.270
    faithful_early_s: float = (0.131e-3 + 0.270e-3) / 2
    # vLLM 0.26: qwen3-8b-colo-1gpu-real-vllm026-vllm 0.174 ms, ...-vllm3 0.234
    vllm_early_s: float = (0.174e-3 + 0.234e-3) / 2
    # SGLang 0.5.14: real-sglang0514-colo-1gpu-sglang-call1 0.399 ms, ...-call4 0.453
    sglang_early_s: float = (0.399e-3 + 0.453e-3) / 2
    # codecs: block FP8 keeps 1 byte per element plus an fp32 scale per 128 x 128 block (weightsync.quant.fp8)
    fp8_block: int = 128
    # FP8, the trainer's encode (every distinct bucket's plain copies and quantize kernels into its frames, one
    # CUDA graph), in bytes of the bf16 sources it reads a second: 16.38 GB in writer.send 8.169 ms of the fp8
    # run less the bf16 run's 0.345 ms beside it (what the same writer does a step without the encode: the
    # header, the announce), 2026-12-02-h200x1-qwen3-8b-nixl-1gpu-fp8-vs-bf16-batched-4cd83b1.json; the same
    # work as the co-located FP8 copy graph (quantize into the live weights instead of a frame), whose runs it
    # predicts within 3% (transport 7.9 ms; the quantize kernels alone in a graph: 6.2 ms of it)
    fp8_encode_bytes_per_s: float = QWEN3_8B_BYTES / (8.169e-3 - 0.345e-3)
    # FP8, the worker's decode (each chunk's frames out of the READ scratch into the live weights, one graph
    # replay, the chunk's prepped READ and index re-read), in bytes of the frames (the wire) a second: the same
    # run's reader.transport 17.647 ms less its READ of the 9.437 GB at the bf16 run's rate beside it (16.38 GB
    # in 9.098 ms: 5.241 ms), 12.406 ms. On one GPU the READ runs at HBM speed and the decode added to it (the
    # double buffer hid little); that is what this rate is, overheads included, not the copy kernel's rate
    fp8_decode_bytes_per_s: float = 9_437_399_040 / (17.647e-3 - 9_437_399_040 / QWEN3_8B_BYTES * 9.098e-3)
    delta_rates: tuple[DeltaRates, ...] = (
        _rates(0.001, 53.253e-3, 23.283e-3, 19.886e-3),
        _rates(0.01, 59.539e-3, 25.809e-3, 24.004e-3),
        _rates(0.1, 155.702e-3, 22.850e-3, 73.365e-3),
    )

    @classmethod
    def reader_progress_thread(cls, **changes) -> CostModel:
        """The costs of a NIXL reader WITH NIXL's progress thread (every nixl-1gpu run of 2026-12-01 and 47ada14's):
        every descriptor ~19.5 us that the copies waited on, the two adding (e3b8935 nixl reader.posting
        7.795 ms for 399 descriptors; reader.transport - reader.posting 6.7-9.2 ms against an 8.0 ms floor)."""
        return cls(**{"nixl_descriptor_s": 7.795e-3 / 399, "nixl_posting_overlaps": False, "nixl_setup_s": 0.0,
                      **changes})

    @classmethod
    def engine_rpc_receivers(cls, **changes) -> CostModel:
        """The costs of the real receivers before the call mailbox (every real-engine run of 2026-12-01):
        vLLM 0.26 two ``collective_rpc`` trips through its engine core a step, real vLLM reader.workers -
        reader.transport 3.14 ms + its transport's extra set-up over the faithful row of the same run (9.21 -
        8.73 = 0.48 ms), 2026-12-01-h200x1-real-vllm026-colo-1gpu.json; SGLang 0.5.14 its pause_generation, the
        receive call, flush_cache and continue_generation: reader.workers - reader.transport = 18.48 - 8.54 ms
        in 2026-12-01-h200x1-real-sglang0514-colo-1gpu-sglang.json (the nixl-1gpu run of the same call: 6.83 ms)."""
        return cls(**{"vllm_step_s": 3.14e-3 + 0.48e-3, "sglang_step_s": 9.94e-3, **changes})

    def delta_at(self, fraction: float) -> DeltaRates:
        """The measured rates at ``fraction`` (the nearest measured fraction, by ratio)."""
        import math

        return min(self.delta_rates, key=lambda r: abs(math.log(r.fraction / fraction)))


#: the H100 runs' files, on one H100 80GB HBM3 (BENCHMARKS.md "2026-12-06: the copy kernel's wide accesses" and
#: "2026-12-06: real SGLang at 0.82-0.88 of the floor"), under
#: benchmarks/results/
H100_RUNS = "2026-12-06-h100x1-"
#: the commits of the H100 runs the profile's device copy is the median of (their files end in them), 2026-12-06
H100_PROFILE_COMMITS = ("f8eb9d9", "cc55ce7", "22c0d7b")

#: One H100 80GB HBM3 (2026-12-06), from its runs' own measurements, each with its file (under benchmarks/results/,
#: less the ``2026-12-06-h100x1-`` prefix). The CPU-side costs are those of the host that ran colo-1gpu, nixl-1gpu
#: and the real vLLM receiver at ``cc55ce7``, the code after issue 23; the host of the ``22c0d7b`` runs ran every
#: CPU phase 2-4x faster (BENCHMARKS.md "2026-12-06: the copy kernel's wide accesses": ``reader.posting`` 0.1
#: against 0.4 ms), so its runs lie below this profile (tests/test_simulate.py ``OTHER_HOST``). The real SGLang
#: receiver's cost is from one call at ``f7c86f7`` (the receiver through the call mailbox with the writer lock taken
#: in place, ``af98eeb``), on another host: around the receiver's call it ran faster than the ``cc55ce7`` one (step
#: round 0.08 against 0.21 ms, co-located set-up 0.10 against 0.15, NIXL posting 3.7 against 4.8 us a descriptor),
#: but the receiver's call itself, the phase this constant stands for, was within the ``cc55ce7`` host's own spread
#: (the faithful worker's 0.50 ms against that host's three 0.48-0.60), so the SGLang row's is taken as measured, as
#: the H200's and vLLM's were. Not measured on an H100, so the H200's values stand: NVLink, the NICs and the
#: per-bucket latency (one GPU has no link to time), p2p's CPU per NCCL message (no two-GPU run), the doorbell and
#: the MetaServer's signals and CPU, the engines' old ``collective_rpc`` trips, FP8's encode and decode rates and
#: delta's rates (no FP8 or delta run).
H100 = CostModel(
    gpu="h100",
    # the device copy: the median of the twelve qwen3-8b bench runs' measured ceiling_bytes_per_s (each run's
    # floor_seconds is its bytes over it; 1.429-1.488 TB/s): qwen3-8b-colo-1gpu-*, qwen3-8b-nixl-1gpu-ab-*,
    # real-vllm026-colo-1gpu-cc55ce7 (both rows), all at H100_PROFILE_COMMITS; the four f7c86f7 runs
    # (1.478-1.491 TB/s) would move the median of all sixteen by 0.07%
    links=LinkModel(hbm_copy_bytes_per_s=1.4805e12),
    # the copy kernel (wide accesses, the default since 6d7bc4a) against a 4 GiB copy_: 400 x 40 MB in a graph,
    # 0.9746 (batch-copy-forms-cc55ce7, A batched-graph-wide; the measure the H200's 0.93 is)
    colocated_copy_efficiency=0.9746,
    # qwen3-8b-colo-1gpu-ab2-cc55ce7 (the middle of the host's three cc55ce7 faithful colo-1gpu runs in each of
    # these three: ab1, ab2, real-vllm026-colo-1gpu-cc55ce7's faithful row): reader.started 0.150 ms; median_seconds
    # - reader.workers 12.210 - 11.997 ms; reader.workers - reader.transport 11.997 - 11.423 ms
    colocated_setup_s=0.150e-3,
    step_round_s=12.210e-3 - 11.997e-3,
    faithful_call_s=11.997e-3 - 11.423e-3,
    # real vLLM 0.26 through the call mailbox: reader.workers - reader.transport 13.197 - 12.012 ms
    # (real-vllm026-colo-1gpu-cc55ce7, its vllm row)
    vllm_step_s=13.197e-3 - 12.012e-3,
    # real SGLang 0.5.14 through the call mailbox, the writer lock taken in place: reader.workers - reader.transport
    # 12.460 - 11.249 ms (real-sglang0514-colo-1gpu-sglang-f7c86f7; the faithful receiver of the same call: 11.791
    # - 11.289 = 0.502 ms, so the SGLang receiver costs 0.709 ms more; taken on the profile's faithful 0.574 ms
    # instead, 1.283 ms, it would predict the four f7c86f7 rows as well, within 3.5%)
    sglang_step_s=12.460e-3 - 11.249e-3,
    # nixl, the reader without NIXL's progress thread (the copies run while it posts): reader.posting 1.928 ms
    # for the 399 descriptors, reader.started 0.656 ms less the first transfer's 64 (qwen3-8b-nixl-1gpu-ab-cc55ce7)
    nixl_descriptor_s=1.928e-3 / 399,
    nixl_setup_s=0.656e-3 - 64 * 1.928e-3 / 399,
)

#: the profiles by name (``weightsync plan --gpu``)
GPUS: dict[str, CostModel] = {"h200": CostModel(), "h100": H100}


def cost_model(gpu: str = "h200") -> CostModel:
    """The cost model measured on ``gpu`` (a :data:`GPUS` name)."""
    try:
        return GPUS[gpu.lower()]
    except KeyError:
        raise ConfigError(f"unknown gpu {gpu!r}; known: {', '.join(GPUS)}") from None


_GPU_NAME = re.compile(r"\b(h100|h200)(?:x\d+)?\b", re.IGNORECASE)


def gpu_of(record: Mapping | None = None, name: str = "") -> str:
    """The :data:`GPUS` profile a bench record ran on: its ``gpus`` (the devices' names, e.g. "NVIDIA H100 80GB
    HBM3"), else its results file's name (``...-h100x1-...``, ``...-h200x2-...``). Refuses a GPU without a
    profile, or one that says neither."""
    names = [str(g) for g in (record or {}).get("gpus") or []] or [name]
    found = {m.group(1).lower() for n in names for m in [_GPU_NAME.search(n.replace("-", " "))] if m}
    if len(found) != 1:
        raise ConfigError(f"no one GPU profile for {names!r}; known: {', '.join(GPUS)}")
    return found.pop()


@dataclass(frozen=True)
class Deployment:
    """How a planned job moves its bytes: the transport, the receivers, the codec, the signals."""

    transport: str = "p2p"  # "colocated", "p2p" (NCCL) or "nixl" (READ)
    receiver: str = "faithful"  # "faithful" (layout-faithful workers), or a real engine: "vllm", "sglang"
    codec: str = "full"  # "full", "fp8" or "delta"
    changed: float = 0.01  # delta: the fraction of elements changed a step
    # `written` and `held` through host shared memory, else the MetaServer. None: as the runtime does it
    # (:meth:`on`): since d6f900c the readers of a transport that reads after `written` (colocated, nixl) wait
    # on the trainers' doorbells, and the trainers on the instances', when every trainer and every reader is on
    # one host (session.publish_bells / connect; open_bells: any bell on another host and they long-poll the
    # MetaServer); p2p jobs signal through the MetaServer
    doorbells: bool | None = None
    # the readers of a transport that reads after `written` (colocated, nixl) send each step's call before it
    # (WeightReader(early_call=True), the default since 4ea3863): the receivers' *_early_s costs, the co-located
    # set-up off the step; False: as every run before 4ea3863
    early_call: bool = True

    def __post_init__(self) -> None:
        for what, value, known in (("transport", self.transport, TRANSPORTS), ("receiver", self.receiver, RECEIVERS),
                                   ("codec", self.codec, CODECS)):
            if value not in known:
                raise ConfigError(f"unknown {what} {value!r}; known: {', '.join(known)}")
        if self.codec == "delta" and not 0 < self.changed <= 1:
            raise ConfigError(f"delta: the changed fraction must be in (0, 1], got {self.changed}")

    def on(self, topology: Topology) -> Deployment:
        """This deployment on ``topology``: ``doorbells`` decided as the runtime decides it where left None."""
        if self.doorbells is not None:
            return self
        gpus = [topology.train_gpu(r) for r in range(topology.train_world)]
        gpus += [topology.infer_gpu(i, r) for i in range(topology.instances) for r in range(topology.infer_world)]
        one_host = len({topology.host(g) for g in gpus}) <= 1
        return replace(self, doorbells=self.transport in ("colocated", "nixl") and one_host)


@dataclass(frozen=True)
class StepPrediction:
    """One step, split into what the model charges (seconds); ``seconds`` is the step."""

    seconds: float
    data_s: float  # the busiest link with the bytes on the wire
    post_s: float  # the busiest worker's CPU posting (descriptors, messages, set-up)
    codec_s: float  # delta: encode + proof + apply; fp8: encode + the decode's part not hidden by the wire
    signal_s: float  # written/held and the step's fixed round
    receiver_s: float  # the trips into the engine
    wire_bytes: int  # every bucket's bytes on the wire, summed
    descriptors: int  # nixl: the busiest worker's descriptors a step (data + header reads)
    messages: int  # p2p: the busiest worker's messages a step
    pack_s: float = 0.0  # nixl: the busiest trainer's copy of its strided boxes into its pack region, a step
    move_s: float = 0.0  # the transport's part: posting, set-up and data as they combine (pack_s included)
    gpu: str = "h200"  # the profile the costs came from (CostModel.gpu)
    nic: NicFloor | None = None  # the bytes that must cross one GPU's NIC, and the time no transport beats


@dataclass(frozen=True)
class NicFloor:
    """The line-rate floor of a step: the most wire bytes one GPU must take in (``ingress_bytes``) or send out
    (``egress_bytes``) through a NIC -- from or to GPUs of other hosts -- over the NIC's rate. Nothing that moves
    these bytes (no transport, no schedule) can make that GPU's part of the step shorter; only fewer bytes can
    (FP8, delta) or more NIC bandwidth per GPU. 0 where every copy stays on a host (NVLink, or the same GPU)."""

    ingress_bytes: int
    egress_bytes: int
    nic_bytes_per_s: float

    @property
    def seconds(self) -> float:
        return max(self.ingress_bytes, self.egress_bytes) / self.nic_bytes_per_s


def nic_floor(buckets: Sequence[Bucket], sizes: Sequence[int], topology: Topology, links: LinkModel) -> NicFloor:
    """Per GPU, the wire bytes (``sizes[i]`` for bucket ``i``) that cross hosts; the busiest GPU's, each way."""
    into: dict[int, int] = defaultdict(int)
    out: dict[int, int] = defaultdict(int)
    for b, n in zip(buckets, sizes):
        s, d = topology.train_gpu(b.src_rank), topology.infer_gpu(b.dst_instance, b.dst_rank)
        if s != d and topology.host(s) != topology.host(d):
            out[s] += n
            into[d] += n
    return NicFloor(max(into.values(), default=0), max(out.values(), default=0), links.nic_bytes_per_s)


_FP8 = re.compile(r"(^|\.)[a-z0-9_]*proj(_with_mqa)?\.weight$")


def fp8_target(canonical: str, shape: Sequence[int]) -> bool:
    """Whether a block-FP8 checkpoint (DeepSeek-V3, Kimi-K2, Qwen3-FP8) holds this tensor in FP8: the
    linear projections; embeddings, lm_head, norms, routers and biases stay as they are."""
    return len(shape) == 2 and bool(_FP8.search(canonical))


def wire_bytes(b: Bucket, deployment: Deployment, cost: CostModel, spec=None) -> int:
    """A bucket's bytes on the wire under ``deployment.codec``."""
    if deployment.codec == "full":
        return b.nbytes
    if deployment.codec == "fp8":  # 1 byte an element + 4 bytes a block for FP8 targets, the rest as is
        if spec is None:
            raise ConfigError("the fp8 estimate needs the model spec (which tensors are projections)")
        block = cost.fp8_block * cost.fp8_block
        n = 0
        for c in b.copies:
            shape = spec.by_name[c.canonical].shape
            n += c.numel + -(-4 * c.numel // block) if fp8_target(c.canonical, shape) else c.nbytes
        return n
    from weightsync.delta import codec  # lazily: it imports torch

    # as weightsync.bench.delta_codec.encoded_bytes: the codec's choice and exact size for that many changed
    # 2-byte words at random, plus the 24-byte header
    words = b.nbytes // 2
    kind, count = codec.choose(int(round(words * deployment.changed)), None, words, 2)
    return codec.payload_bytes(kind, count, words, 2) + 24


def predict_step(
    buckets: Sequence[Bucket],
    topology: Topology,
    counts: Sequence[WorkerCounts],
    deployment: Deployment,
    cost: CostModel = CostModel(),
    spec=None,
) -> StepPrediction:
    """One step of a job whose receivers hold ``buckets`` (``counts``: each receiving worker's posts)."""
    links = cost.links
    d = deployment.on(topology)
    sizes = [wire_bytes(b, d, cost, spec) for b in buckets]
    recv: dict[tuple[int, int], int] = defaultdict(int)  # full bytes each worker holds (proof, apply)
    for b in buckets:
        recv[b.dst_instance, b.dst_rank] += b.nbytes
    hbm = links.hbm_copy_bytes_per_s * (cost.colocated_copy_efficiency if d.transport == "colocated" else 1.0)
    per_bucket = links.latency_s if d.transport == "p2p" else 0.0  # NCCL: a group per bucket
    hbm_sizes = None
    if d.transport == "colocated" and d.codec == "fp8":
        # the copy graph quantizes as it lands (FP8Codec.land): a same-GPU piece reads its bf16 sources and
        # writes e4m3 and scales, the trainer's encode's work, at its rate (cross-GPU pieces: the FP8 bytes on
        # NVLink, the quantize not counted)
        hbm, hbm_sizes = cost.fp8_encode_bytes_per_s, [b.nbytes for b in buckets]
    data_s = _busiest_link(buckets, sizes, topology, links, hbm, per_bucket, hbm_sizes)

    if d.codec in ("delta", "fp8"):  # framed codecs over nixl READ one payload a bucket (delta: a changed one),
        # and each peer's index before and after (transport/nixl.py FrameReads._read_indexes, _apply, _unchanged
        # since 0b6aaae; before it delta/nixl.py's DeltaNixlReceiver): the index is read again after each
        # scratch-full batch, not counted; fp8's payloads of a chunk are one merged READ a peer, so at most this
        descriptors = max((c.buckets + 2 * c.peers for c in counts), default=0)
    else:  # the program's reads, plus one header read a peer
        descriptors = max((c.nixl_descriptors + c.peers for c in counts), default=0)
    msgs = max((c.messages for c in counts), default=0)
    pack_s = 0.0
    if d.transport == "nixl":
        post_s = descriptors * cost.nixl_descriptor_s
        if cost.nixl_posting_overlaps:  # copies start once the first transfer is posted; the rest posts meanwhile
            first = min(descriptors, POST_CHUNK) * cost.nixl_descriptor_s
            move_s = cost.nixl_setup_s + max(post_s, first + data_s)
        else:
            move_s = cost.nixl_setup_s + post_s + data_s
        # the trainers pack their strided boxes before they announce the step (transport/nixl.py pack_layout):
        # each packs what one instance reads from it (instances alike read the same boxes), at the device
        # copy's rate; the busiest trainer's copy adds to the step
        packed: dict[tuple[int, int], int] = defaultdict(int)  # (training rank, instance) -> bytes
        for c in counts:
            for r, n in c.packed_bytes:
                packed[r, c.instance] += n
        most: dict[int, int] = defaultdict(int)
        for (r, _), n in packed.items():
            most[r] = max(most[r], n)
        pack_s = max(most.values(), default=0) / links.hbm_copy_bytes_per_s
        move_s += pack_s
    elif d.transport == "p2p":
        post_s = msgs * cost.nccl_message_s
        move_s = max(post_s, data_s)  # the CPU posts the whole step at once; the GPU pipelines
    else:
        post_s = cost.colocated_setup_s
        move_s = post_s + data_s
    early = d.early_call and d.transport in ("colocated", "nixl")
    if early and d.transport == "colocated":  # the set-up runs before the go (ColocatedTransport.run: ready())
        move_s = data_s

    codec_s = 0.0
    if d.codec == "fp8" and buckets and d.transport != "colocated":
        codec_s = _fp8_codec_s(buckets, sizes, topology, data_s, cost)
    if d.codec == "delta" and buckets:
        from weightsync.plan.messages import signature

        r = cost.delta_at(d.changed)
        # the sender encodes each distinct bucket once, by the key its encoder stores the previous version under
        # (codec.delta.DeltaEncoder: buckets of one signature, instances of one layout, share one encoding); the
        # receiver proves what it holds, then applies; the worker starts after the step is announced, so they add
        encode = _distinct_bytes(buckets, signature)
        codec_s = (encode / r.encode_bytes_per_s
                   + max(recv.values()) / r.proof_bytes_per_s + max(recv.values()) / r.apply_bytes_per_s)

    if d.doorbells:
        signal_s = cost.step_round_s
    else:  # the MetaServer: every trainer posts written and waits held, every instance the reverse
        requests = 2 * (topology.train_world + topology.instances)
        signal_s = cost.step_round_s - cost.doorbell_s + max(cost.metaserver_signal_s, requests * cost.metaserver_request_s)
    if early:
        receiver_s = {"faithful": cost.faithful_early_s, "vllm": cost.vllm_early_s, "sglang": cost.sglang_early_s}[d.receiver]
    else:
        receiver_s = {"faithful": cost.faithful_call_s, "vllm": cost.vllm_step_s, "sglang": cost.sglang_step_s}[d.receiver]
    seconds = signal_s + receiver_s + move_s + codec_s
    return StepPrediction(seconds, data_s, post_s, codec_s, signal_s, receiver_s, sum(sizes), descriptors, msgs,
                          pack_s, move_s, cost.gpu, nic_floor(buckets, sizes, topology, links))


def _source_key(b: Bucket) -> tuple:
    """What the fp8 encoder keys a bucket's frame by (payload.codec.payload_key): buckets that read the same source
    boxes as the same canonical boxes share one frame, encoded once (instances of one layout)."""
    return tuple((c.canonical, c.canon_box, c.src_tensor, c.src_box) for c in b.copies)


def _distinct_bytes(buckets: Sequence[Bucket], key) -> int:
    """The busiest training rank's bytes over its distinct buckets by ``key`` (what its encoder encodes a step)."""
    distinct: dict[int, dict] = defaultdict(dict)
    for b in buckets:
        distinct[b.src_rank][key(b)] = b.nbytes
    return max((sum(v.values()) for v in distinct.values()), default=0)


def _fp8_codec_s(buckets: Sequence[Bucket], sizes: Sequence[int], topology: Topology, data_s: float,
                 cost: CostModel) -> float:
    """What FP8 adds to a step whose codec runs off the copy path (nixl, p2p): the trainer's encode and the
    worker's decode, at the rates measured on one H200 (CostModel.fp8_*).

    A model, simple on purpose: the busiest trainer encodes its distinct buckets' bf16 sources before it
    announces the step, so the encode adds. The busiest worker decodes its frames chunk by chunk while the
    next chunk's READ is in flight: where every read of the worker's is a same-GPU copy (the READ itself at
    HBM speed, all that one GPU could measure) the two took turns, so the decode adds; where the wire is
    slower than HBM (NVLink, a NIC) the decode hides under the READ and only what it takes beyond the data
    time shows, plus the last chunk's decode (a chunk is at most the largest frame), which nothing follows.
    """
    wire: dict[tuple[int, int], int] = defaultdict(int)
    largest: dict[tuple[int, int], int] = defaultdict(int)
    on_gpu: dict[tuple[int, int], bool] = defaultdict(lambda: True)
    for b, n in zip(buckets, sizes):
        w = (b.dst_instance, b.dst_rank)
        wire[w] += n
        largest[w] = max(largest[w], n)
        on_gpu[w] &= topology.train_gpu(b.src_rank) == topology.infer_gpu(*w)
    encode_s = _distinct_bytes(buckets, _source_key) / cost.fp8_encode_bytes_per_s
    rate = cost.fp8_decode_bytes_per_s
    decode_s = max(wire[w] / rate if on_gpu[w] else max(0.0, wire[w] / rate - data_s) + largest[w] / rate
                   for w in wire)
    return encode_s + decode_s
