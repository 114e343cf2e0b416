"""The block-FP8 quantizer's rate on one GPU: every linear weight of a qwen3-8b-sized model (36 layers of q, k, v, o,
gate, up, down; 6.95 G parameters, 13.9 GB in bf16) quantized by the Triton kernel, one launch per matrix, against a
device copy of the same bf16 bytes measured in the same run (the ceiling), and against the torch definition; also all
252 in one launch (``quantize_many``).

The kernel reads each bf16 byte once and writes half as many fp8 bytes: 1.5 x the weights' bytes of traffic, where a
copy moves 2 x. At HBM speed the kernel would take 0.75 x the copy's time; ``of_hbm`` is that ideal over the time
measured. Prints one JSON line (also written to --out)."""

from __future__ import annotations

import argparse
import json
import time

import torch

from weightsync.quant import fp8

# qwen3-8b: hidden 4096, 32 q heads and 8 kv heads of 128, intermediate 12288, 36 layers
SHAPES = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (12288, 4096), (12288, 4096), (4096, 12288)]
LAYERS = 36


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, each synchronised, after one warm-up."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    ws = [torch.randn(s, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
          for _ in range(args.layers) for s in SHAPES]
    outs = [fp8.Quantized(torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=dev),
                          torch.empty(fp8.scale_shape(w.shape), dtype=torch.float32, device=dev)) for w in ws]
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    flat2 = torch.empty_like(flat)
    copy_s = timed(lambda: flat2.copy_(flat), args.reps)  # the ceiling: one copy of the same bytes

    def kernel():
        for w, o in zip(ws, outs):
            fp8.quantize(w, out=o)

    kernel_s = timed(kernel, args.reps)
    try:  # one launch for all 252, with Triton's alignment hints (quantize_many's docstring)
        many_s = timed(lambda: fp8.quantize_many(ws, outs, one_launch=True), args.reps)
        many_exact = all(torch.equal(q.weight.view(torch.uint8), fp8.quantize_reference(w).weight.view(torch.uint8))
                         for w, q in zip(ws[: len(SHAPES)], outs))
    except Exception as e:  # report, and keep the other figures
        many_s, many_exact = float("nan"), repr(e)[:300]
    # the MLP matrices alone (100 MB each): the kernel's own rate, launch overheads negligible
    big = [(w, o) for w, o in zip(ws, outs) if w.numel() == 12288 * 4096]
    big_bytes = sum(w.numel() * w.element_size() for w, _ in big)
    big_s = timed(lambda: [fp8.quantize(w, out=o) for w, o in big], args.reps)
    big_copy = flat[: big_bytes // 2]
    big_copy_s = timed(lambda: flat2[: big_bytes // 2].copy_(big_copy), args.reps)
    # the torch definition on the GPU, on one layer (it allocates fp32 copies: the whole model would not be fair)
    one = ws[: len(SHAPES)]
    one_bytes = sum(w.numel() * w.element_size() for w in one)
    ref_s = timed(lambda: [fp8.quantize_reference(w) for w in one], 3) * nbytes / one_bytes
    # bit-exactness on this data, one layer: kernel vs the definition
    exact = all(torch.equal(fp8.quantize(w).weight.view(torch.uint8),
                            fp8.quantize_reference(w).weight.view(torch.uint8)) for w in one)
    res = {
        "what": "block-FP8 quantize, qwen3-8b linear weights (bf16 -> e4m3 + fp32 scale_inv)",
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "soft_cast": fp8.soft_cast(),
        "matrices": len(ws), "bf16_bytes": nbytes,
        "copy_seconds": copy_s, "copy_GBps": nbytes / copy_s / 1e9,
        "kernel_seconds": kernel_s, "kernel_GBps_in": nbytes / kernel_s / 1e9,
        "kernel_GBps_traffic": 1.5 * nbytes / kernel_s / 1e9,
        "of_hbm": 0.75 * copy_s / kernel_s,
        "many_seconds": many_s, "many_bit_exact_one_layer": many_exact, "many_GBps_in": nbytes / many_s / 1e9,
        "many_of_hbm": 0.75 * copy_s / many_s,
        "mlp_matrices": len(big), "mlp_kernel_seconds": big_s, "mlp_copy_seconds": big_copy_s,
        "mlp_of_hbm": 0.75 * big_copy_s / big_s,
        "torch_definition_seconds_est": ref_s, "bit_exact_one_layer": exact,
    }
    line = json.dumps(res)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
