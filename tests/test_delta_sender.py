"""The nixl delta sender's in-place encode: the same bytes as the per-bucket path with a packing buffer.

``codec.encode_to`` (the changes or their count known beforehand, nothing read back) must write
exactly the payload ``codec.encode_as`` builds, into poisoned memory and into the packed bucket's own
memory; and ``DeltaNixlSender`` with the previous version beside the tensors (packs into the region,
patches the base in place, reads the checksums once) must stamp the same index and region payloads,
and keep the same base and checksums, as the host-memory path (pack, encode, copy into the base)
over steps of none, sparse, dense and every element changed. CPU, and CUDA where present
(benchmarks/delta_sender_gpu.sh runs it on the H200).
"""

from __future__ import annotations

import pytest
import torch

from weightsync.delta import codec

DTYPES = [torch.bfloat16, torch.float32]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # the GPU run: nonzero_static on CUDA


def _pair(n: int, dtype: torch.dtype, frac: float, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g).to(dtype)
    cur = base.clone()
    m = torch.rand(n, generator=g) < frac
    cur[m] = (torch.randn(int(m.sum()), generator=g) * 3).to(dtype)
    w = base.element_size()
    return (codec.as_words(cur.view(torch.uint8), w).to(device), codec.as_words(base.view(torch.uint8), w).to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("frac", [0.0, 0.001, 0.05, 0.3, 1.0])
def test_encode_to_writes_encode_as_bytes(dtype, frac, device):
    n = 4099
    cur, base = _pair(n, dtype, frac, seed=int(frac * 1000) + n, device=device)
    w = cur.element_size()
    changed = cur != base
    k = int(codec.count_changed(cur, base))
    assert k == int(changed.sum())
    kinds = [codec.SAME] if k == 0 else [codec.INDICES, codec.BITMAP, codec.FULL]
    for kind in kinds:
        want = codec.encode_as(kind, cur, changed, k, base).payload
        size = codec.payload_bytes(kind, k, n, w)
        out = torch.randint(0, 256, (size + 16,), dtype=torch.uint8, device=device)  # poisoned, and longer than the payload
        tail = out[size:].clone()
        patch = codec.encode_to(kind, k, cur, base, out)
        assert torch.equal(out[:size], want), codec.KIND_NAMES[kind]
        assert torch.equal(out[size:], tail)  # nothing written past the payload
        given = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
        codec.encode_to(kind, k, cur, base, given, idx=codec.changed_words(cur, base))  # the changes known
        assert torch.equal(given, want), codec.KIND_NAMES[kind]
        if kind in (codec.INDICES, codec.BITMAP):
            fixed = base.clone()
            fixed.index_copy_(0, *patch)
            assert torch.equal(fixed, cur)
        else:
            assert patch is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("frac", [0.0, 0.002, 0.02, 0.2, 1.0])
def test_encode_to_over_the_packed_bytes_themselves(dtype, frac, device):
    """The sender's case: the payload is written over the bucket it encodes (the chosen kind is never
    larger than the bucket), and patching the base with the returned changes makes it the bucket."""
    n = 8192
    cur, base = _pair(n, dtype, frac, seed=7 + int(frac * 100), device=device)
    w = cur.element_size()
    k = int(codec.count_changed(cur, base))
    kind, count = codec.choose(k, None, n, w)
    want = codec.encode_as(kind, cur, cur != base, count, base).payload
    expect_base = cur.clone()
    buf = cur.clone().view(torch.uint8)  # the region slot holding the packed bucket
    held = base.clone()
    patch = codec.encode_to(kind, count, codec.as_words(buf, w), held, buf, idx=codec.changed_words(cur, base))
    assert torch.equal(buf[: want.numel()], want)
    if patch is not None:
        held.index_copy_(0, *patch)
    elif kind == codec.FULL:
        held.copy_(codec.as_words(buf, w))
    assert torch.equal(held, expect_base)


def _plans():
    from weightsync.engines import make_layout
    from weightsync.plan.planner import Planner
    from weightsync.plan.topology import Topology
    from weightsync.spec import load_spec

    spec = load_spec("tiny-qwen3")
    src, dst = make_layout(spec, "hf"), make_layout(spec, "vllm:tp=1")
    return spec, src, Planner(src, dst, 1, Topology.colocated(1, 1, 1)).send_plan(0)


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_sender_matches_the_serial_path(device):
    """The delta encoder over a kept slot (nixl's registered region): with the base on the device it
    writes the payload over the packed bytes and patches the base; with it in host memory it encodes
    beside them. Both give the same headers and payloads, and a receiver holding last step applies them."""
    from weightsync.bench.delta import apply_step
    from weightsync.bench.scenarios import init_weights
    from weightsync.payload.codec import WHOLE
    from weightsync.codec.delta import KIND_NAMES, DeltaCodec
    from weightsync.codec.delta_state import words_of
    from weightsync.layout.materialize import TORCH_DTYPES
    from weightsync.payload.pack import pack

    spec, src, plans = _plans()
    lay = src.layout(0)
    dev = torch.device(device)
    tens = {n: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=dev) for n, t in lay.tensors.items()}
    init_weights(lay, tens, spec)
    fast, slow = DeltaCodec().encoder(plans, dev), DeltaCodec(host=True).encoder(plans, dev)
    live = [b for p in sorted(plans) for b in sorted(plans[p], key=lambda b: b.index) if b.nbytes]
    buckets = fast.distinct(live)
    regions = {id(e): {b.index: torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8, device=dev) for b in buckets}
               for e in (fast, slow)}  # poisoned
    before = {b.index: pack(b, tens).clone() for b in buckets}
    seen: dict[str, int] = {}
    for step, frac in enumerate([None, 0.003, 0.05, 0.0, 0.4, 1.0, 0.01]):
        if frac is not None:
            apply_step(lay, tens, spec, frac, step)
        heads = {}
        for e in (fast, slow):
            e.begin(step, None)
            for b in buckets:
                e.encode(b, tens, regions[id(e)][b.index], kept=True)
            heads[id(e)] = e.end(step)
        assert heads[id(fast)] == heads[id(slow)], (step, frac)
        assert fast.stats.kinds == slow.stats.kinds
        for b in buckets:
            now = pack(b, tens)
            h = heads[id(fast)][fast.key(b)]
            assert torch.equal(fast.previous.base(b), now) and torch.equal(slow.previous.base(b).to(dev), now)
            assert fast.previous.checksum_of(b) == slow.previous.checksum_of(b) == codec.checksum([now]) == h.sum
            if h.kind == WHOLE:
                continue
            seen[KIND_NAMES[h.kind]] = seen.get(KIND_NAMES[h.kind], 0) + 1
            got = regions[id(fast)][b.index][: h.nbytes]
            assert torch.equal(got, regions[id(slow)][b.index][: h.nbytes]), (step, b.index)
            assert h.base == step - 1 and h.base_sum == codec.checksum([before[b.index]])
            w = words_of(b).word
            held = before[b.index].clone()  # a receiver holding last step applies the payload
            codec.apply([codec.as_words(held, w)], h.kind, h.count, w, got.clone())
            assert torch.equal(held, now)
        before = {b.index: pack(b, tens).clone() for b in buckets}
    assert {"same", "indices", "bitmap", "full"} <= set(seen), seen
