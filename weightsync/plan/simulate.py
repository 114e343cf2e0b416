"""Predict a plan's transfer time from a link model: the busiest link's bytes over its bandwidth.

Links per GPU: NVLink egress/ingress (peers on the same host), NIC egress/ingress (other hosts) and
HBM (same-GPU copies, read + write). Each bucket also pays a fixed per-message latency on both ends.
Used for the thousand-GPU cases that cannot be run here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from weightsync.plan.planner import Bucket
from weightsync.plan.topology import Topology


@dataclass(frozen=True)
class LinkModel:
    """Defaults: H200 NVLink measured here (337 GiB/s per direction), 400 Gb/s NICs, device copy ~1900 GiB/s."""

    nvlink_bytes_per_s: float = 337 * 2**30
    nic_bytes_per_s: float = 50e9
    hbm_copy_bytes_per_s: float = 1900 * 2**30
    latency_s: float = 20e-6


def predict_seconds(buckets: Iterable[Bucket], topology: Topology, links: LinkModel = LinkModel()) -> float:
    load: dict[tuple[str, int], float] = defaultdict(float)
    for b in buckets:
        s = topology.train_gpu(b.src_rank)
        d = topology.infer_gpu(b.dst_instance, b.dst_rank)
        n = b.nbytes
        if s == d:
            load["hbm", s] += n / links.hbm_copy_bytes_per_s + links.latency_s
            continue
        if topology.host(s) == topology.host(d):
            bw, out_link, in_link = links.nvlink_bytes_per_s, "nvl_out", "nvl_in"
        else:
            bw, out_link, in_link = links.nic_bytes_per_s, "nic_out", "nic_in"
        load[out_link, s] += n / bw + links.latency_s
        load[in_link, d] += n / bw + links.latency_s
    return max(load.values(), default=0.0)
