"""What a checksum (weightsync.integrity) costs where the data is, and whether devices agree on it.

    python benchmarks/integrity_cost.py [--device cuda] [--gib 2]

Prints JSON: the checksum's rate over bf16 weight-shaped tensors (contiguous, and column halves as a
row-parallel TP shard reads them) beside a plain copy of the same bytes, and whether CPU and the
device give the same number for the same bytes (contiguous and strided).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from weightsync.integrity import checksum, reference, to_ints


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(fn, nbytes: int, device: torch.device, repeat: int = 5) -> float:
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    _sync(device)
    return nbytes * repeat / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gib", type=float, default=2.0)
    args = p.parse_args()
    device = torch.device(args.device)
    shape = (4096, 12288)  # an 8B MLP weight
    n = max(1, int(args.gib * 2**30 // (shape[0] * shape[1] * 2)))
    ts = [torch.randn(shape, device=device).to(torch.bfloat16) for _ in range(n)]
    nbytes = sum(t.numel() * 2 for t in ts)
    out = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "bytes": nbytes, "tensors": n}
    out["checksum_bytes_per_s"] = rate(lambda: to_ints([checksum(t) for t in ts]), nbytes, device)
    halves = [t[:, : shape[1] // 2] for t in ts]
    out["checksum_column_half_bytes_per_s"] = rate(lambda: to_ints([checksum(h) for h in halves]), nbytes // 2, device)
    dst = [torch.empty_like(t) for t in ts]
    out["copy_bytes_per_s"] = rate(lambda: [d.copy_(t) for d, t in zip(dst, ts)], nbytes, device)
    # the same bytes on the CPU and the device give the same number (contiguous, strided, odd sizes)
    small = torch.randn(257, 96, device=device).to(torch.bfloat16)
    views = [small, small[:, 8:72], small.t(), small[1:, 3:50], small.reshape(-1)[5:1000]]
    dev_sums = to_ints([checksum(v, 7) for v in views])
    cpu_sums = to_ints([checksum(v.cpu(), 7) for v in views])
    out["cpu_equals_device"] = dev_sums == cpu_sums
    out["equals_reference"] = dev_sums == [reference(v, 7) for v in views]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
