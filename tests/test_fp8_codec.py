"""The fp8 codec (weightsync.codec.fp8) on CPU, both sides in one process: a plan's buckets from an FSDP2 trainer
layout encoded on the training ranks and decoded into poisoned FP8 engine tensors land, bit for bit, what an FP8
checkpoint of the same weights loads into that layout; a copy that cuts a block, a delta or a transport and mode
the codec does not run on with quant=fp8 are refused at set-up by name."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny

from weightsync.errors import ConfigError

DENSE = tiny("tiny-qwen3-h64", hidden_size=256, head_dim=128, num_key_value_heads=2, intermediate_size=512)
MOE = tiny("tiny-qwen3-moe-h64", head_dim=128, moe_intermediate_size=256)


def expected_fp8(layout, canonical: dict, rank: int) -> dict:
    """What an FP8 checkpoint of ``canonical`` (save_checkpoint's recipe: quantize_reference per tensor) loads into
    ``layout``'s rank (fill_from: the reference load) over NaN-poisoned tensors."""
    from weightsync.layout.materialize import TORCH_DTYPES, fill_from
    from weightsync.quant.fp8 import quantize_reference

    quantized = dict(canonical)
    for name, f in layout.fp8.items():
        q = quantize_reference(canonical[name])
        quantized[name], quantized[f.scale.name] = q.weight, q.scale_inv
    mine = layout.layout(rank)
    out = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype]) for n, t in mine.tensors.items()}
    fill_from(mine, out, quantized)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bits (the poison NaN too: a region nobody writes, vocab padding, stays poisoned on both sides)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("spec,train,infer", [(DENSE, "fsdp:dp=2", "vllm:tp=2,quant=fp8"),
                                              (MOE, "hf", "vllm:tp=2,ep=2,quant=fp8"),
                                              (DENSE, "hf", "sglang:tp=2,quant=fp8"),
                                              (DENSE, "megatron:tp=2", "vllm:tp=2,quant=fp8")],
                         ids=["dense-fsdp-vllm", "moe-hf-vllm-ep", "dense-hf-sglang", "dense-megatron-vllm"])
def test_fp8_codec_round_trips_into_the_fp8_layout_bit_exact(spec, train, infer):
    _round_trip(spec, train, infer, bucket_bytes=512 << 10)  # buckets hold whole copies, several each


def test_a_block_aligned_plan_stripes_and_slabs_on_blocks_and_round_trips():
    """Replicated sources striped (stripe_bytes) and copies larger than a bucket cut in slabs: the planner of an FP8
    job (block_aligned, what JobShape.planner passes) cuts them on blocks; an unaligned planner's plan is refused."""
    from weightsync.codec.fp8 import fp8_options
    from weightsync.engines import make_layout
    from weightsync.plan.planner import Planner
    from weightsync.transport.base import TransportOptions

    infer, train = "vllm:tp=2,quant=fp8", "megatron:tp=1,dp=2"
    small = dict(bucket_bytes=48 << 10, stripe_bytes=16 << 10)
    codec = fp8_options(TransportOptions(), infer, DENSE).codec
    loose = Planner(make_layout(DENSE, train), make_layout(DENSE, infer), 1, **small)
    with pytest.raises(ConfigError, match="cuts a 128 x 128 FP8 block"):
        for r in range(2):
            codec.encoder(loose.send_plan(r), torch.device("cpu"))
    planner = _round_trip(DENSE, train, infer, **small, block_aligned=frozenset(n for n, _ in codec.fp8))
    sizes = {b.src_rank for bs in planner.recv_plan(0, 0).values() for b in bs}
    assert sizes == {0, 1}  # striped over both replicas
    assert max(b.nbytes for r in range(2) for bs in planner.send_plan(r).values() for b in bs) <= 48 << 10


def _round_trip(spec, train, infer, **planner_kw):
    from weightsync.codec.fp8 import fp8_options
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES, fill_from
    from weightsync.plan.planner import Planner
    from weightsync.quant.layout import fp8_layout
    from weightsync.testing import random_canonical
    from weightsync.transport.base import TransportOptions

    src, base = make_layout(spec, train), make_layout(spec, infer)
    layout = fp8_layout(base)
    codec = fp8_options(TransportOptions(), infer, spec).codec
    assert codec.name == "fp8" and codec.framed and len(codec.fp8) == len(layout.fp8)
    planner = Planner(src, base, 1, **planner_kw)  # planned over the weights only (the bf16 layout)
    canonical = random_canonical(spec, seed=7)
    sources = {}
    for r in range(src.world_size):
        lay = src.layout(r)
        sources[r] = {n: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype]) for n, t in lay.tensors.items()}
        fill_from(lay, sources[r], canonical)
    for j in range(base.world_size):
        targets = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype])
                   for n, t in layout.layout(j).tensors.items()}  # poisoned
        plans = planner.recv_plan(0, j)
        dec = codec.decoder(plans)
        dec.begin()
        sent = full = 0
        for r in range(src.world_size):
            send = {p: bs for p, bs in planner.send_plan(r).items() if p[1:] == (0, j)}
            enc = codec.encoder(send, torch.device("cpu"))
            enc.begin(1, None)
            for pair, bs in send.items():
                for b in bs:
                    slot = torch.empty(b.nbytes, dtype=torch.uint8)
                    frame = enc.encode(b, sources[r], slot)
                    assert frame.header.nbytes == dec.size(b, frame.header) == frame.payload.numel()
                    payload = frame.payload.clone()
                    dec.decode(b, frame.header, payload, targets, slot)
                    sent, full = sent + frame.header.nbytes, full + b.nbytes
        dec.end(1)
        assert sent < 0.6 * full, (sent, full)  # the FP8 weights at a byte and a bit
        want = expected_fp8(layout, canonical, j)
        assert set(want) == set(targets)
        for n in want:
            assert torch.equal(bits(targets[n]), bits(want[n])), (j, n)
        assert any(n.endswith("_scale_inv") for n in want) and any(t.dtype == torch.bfloat16 for t in want.values())
    return planner


@pytest.mark.parametrize("spec,train,infer,dtype", [(DENSE, "fsdp:dp=2", "vllm:tp=2,quant=fp8", torch.bfloat16),
                                                    (DENSE, "megatron:tp=2", "vllm:quant=fp8", torch.float32),
                                                    (MOE, "hf", "vllm:tp=2,ep=2,quant=fp8", torch.bfloat16)],
                         ids=["fsdp-vllm-tp2", "megatron-fp32-vllm-tp1", "moe-hf-vllm-ep"])
def test_fp8_land_co_located_into_the_fp8_layout_bit_exact(spec, train, infer, dtype):
    """Co-located (FP8Codec.land, what ColocatedTransport runs on the trainers' memory): every bucket's FP8 copies
    quantized straight into boxes of the live e4m3 weights and scales (megatron TP=2 -> TP=1: column halves, strided
    boxes of the engine's tensor), the rest copied (fp32 masters: cast by the full codec's landing, one rounding to
    bf16 as a checkpoint load), into NaN-poisoned targets: bit for bit the FP8 checkpoint of the same weights (the
    fp32 masters hold bf16 values here, so the bf16 checkpoint the FP8 one is made from holds the same numbers)."""
    from weightsync.codec.fp8 import fp8_options
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES, fill_from
    from weightsync.plan.planner import Planner
    from weightsync.quant.layout import fp8_layout
    from weightsync.testing import random_canonical
    from weightsync.transport.base import TransportOptions
    from weightsync.transport.batch_copy import BatchedCopy

    src, base = make_layout(spec, train), make_layout(spec, infer)
    layout = fp8_layout(base)
    codec = fp8_options(TransportOptions(), infer, spec).codec
    planner = Planner(src, base, 1, bucket_bytes=512 << 10,
                      block_aligned=frozenset(n for n, _ in codec.fp8))
    canonical = random_canonical(spec, seed=11)
    master = {n: t.to(dtype) if t.is_floating_point() else t for n, t in canonical.items()}
    sources = {}
    for r in range(src.world_size):
        lay = src.layout(r)
        sources[r] = {n: torch.empty(t.shape, dtype=dtype) for n, t in lay.tensors.items()}
        fill_from(lay, sources[r], master)
    for j in range(base.world_size):
        targets = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype])
                   for n, t in layout.layout(j).tensors.items()}  # poisoned
        items = [(b, sources[b.src_rank], targets) for bs in planner.recv_plan(0, j).values() for b in bs if b.nbytes]
        landing = codec.land(items)
        assert landing.work is not None
        assert all(d.dtype == s.dtype for d, s in landing.copies)  # the transport moves bytes only
        batch = BatchedCopy(landing.copies)
        for seed in (11, 12):  # the same landing replayed (as the transport's graph is) after the weights changed
            step_master = master if seed == 11 else {n: t.to(dtype) if t.is_floating_point() else t
                                                     for n, t in random_canonical(spec, seed=seed).items()}
            for r in range(src.world_size):
                fill_from(src.layout(r), sources[r], step_master)  # in place: the landing holds these tensors
            batch.run()  # as the transport's graph does: its copies, then the codec's work
            landing.work()
            want = expected_fp8(layout, {n: t.to(torch.bfloat16) if t.is_floating_point() else t
                                         for n, t in step_master.items()}, j)
            for n in want:
                assert torch.equal(bits(targets[n]), bits(want[n])), (seed, j, n)
        assert sum(codec.landed_bytes(b) for b, _, _ in items) < 0.6 * sum(b.nbytes for b, _, _ in items) * (
            2 if dtype == torch.float32 else 1)


def test_a_source_box_with_no_matrix_view_is_staged_by_a_copy_every_replay():
    """An FP8 copy's source box strided across its leading dims (two experts' row ranges of a stacked [E, N, K]
    tensor) has no 2-d view: the quantize kernel reads a buffer that a copy of the landing refills each replay,
    never a copy made once when the landing was built (a replay would quantize stale bytes)."""
    from weightsync.codec.fp8 import _matrix

    stacked = torch.randn(4, 8, 6)
    box = stacked[1:3, 2:6, 2:5]  # 2 experts x 4 of their 8 rows x 3 columns: the rows are not one stride apart
    with pytest.raises(RuntimeError):
        box.view(8, 3)
    pairs: list = []
    m = _matrix(box, 8, 3, pairs)
    assert len(pairs) == 1 and m.data_ptr() != box.data_ptr()
    for _ in range(2):
        stacked.copy_(torch.randn(4, 8, 6))
        for dst, src in pairs:
            dst.copy_(src)
        assert torch.equal(m, box.reshape(8, 3))
    viewable = stacked[2]
    assert _matrix(viewable, 8, 6, pairs).data_ptr() == viewable.data_ptr() and len(pairs) == 1


def test_the_full_codec_lands_casts_as_its_work_and_bytes_as_copies():
    """FullCodec.land: copies between views of one dtype go to the transport's copy kernel, the fp32 -> bf16 ones are
    the codec's cast; after both, the targets equal unpack's (pack -> unpack: one rounding)."""
    from weightsync.codec.full import FullCodec
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES, fill_from
    from weightsync.plan.planner import Planner
    from weightsync.testing import random_canonical
    from weightsync.transport.batch_copy import BatchedCopy
    from weightsync.payload.pack import pack, unpack

    src, dst = make_layout(DENSE, "hf"), make_layout(DENSE, "vllm:tp=2")
    canonical = random_canonical(DENSE, seed=3)
    sources = {n: torch.empty(t.shape, dtype=torch.float32) for n, t in src.layout(0).tensors.items()}
    fill_from(src.layout(0), sources, canonical)
    sources["model.norm.weight"] = sources["model.norm.weight"].to(torch.bfloat16)  # one byte copy among casts
    planner = Planner(src, dst, 1, bucket_bytes=256 << 10)
    for j in range(2):
        fresh = lambda: {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype])  # noqa: E731
                         for n, t in dst.layout(j).tensors.items()}
        got, want = fresh(), fresh()
        buckets = [b for bs in planner.recv_plan(0, j).values() for b in bs if b.nbytes]
        landing = FullCodec().land([(b, sources, got) for b in buckets])
        assert landing.work is not None and landing.copies and all(d.dtype == s.dtype for d, s in landing.copies)
        BatchedCopy(landing.copies).run()
        landing.work()
        for b in buckets:
            unpack(b, pack(b, sources), want)
        for n in want:
            assert torch.equal(bits(got[n]), bits(want[n])), (j, n)


def test_a_copy_that_cuts_a_block_is_refused_naming_tensor_box_and_block():
    from weightsync.codec.fp8 import fp8_options
    from weightsync.engines import make_layout
    from weightsync.plan.planner import Planner
    from weightsync.transport.base import TransportOptions

    spec = tiny("tiny-qwen3-h64", hidden_size=256, head_dim=128, num_key_value_heads=2, intermediate_size=384)
    infer = "vllm:quant=fp8"  # TP=1: the engine holds whole tensors; FSDP dp=2 cuts 384 rows at 192
    codec = fp8_options(TransportOptions(), infer, spec).codec
    planner = Planner(make_layout(spec, "fsdp:dp=2"), make_layout(spec, infer), 1, bucket_bytes=4 << 20)
    with pytest.raises(ConfigError, match=r"rows 0\.\.192 of model\.layers\.0\.mlp\.(gate|up)_proj\.weight "
                                          r"\[384, 256\] .*cuts a 128 x 128 FP8 block"):
        codec.encoder(planner.send_plan(0), torch.device("cpu"))
    spec = DENSE  # whole blocks per rank, but a bucket budget that slabs a copy off the blocks: refused too
    planner = Planner(make_layout(spec, "fsdp:dp=2"), make_layout(spec, infer), 1, bucket_bytes=48 << 10)
    with pytest.raises(ConfigError, match=r"cuts a 128 x 128 FP8 block.*block_aligned"):
        codec.encoder(planner.send_plan(0), torch.device("cpu"))


def test_quant_fp8_is_refused_where_the_codec_cannot_run():
    from weightsync.codec.registry import check_engine

    check_engine("vllm:tp=2", "delta", "file", "sync", 1000)  # not quantized: nothing to refuse
    check_engine("vllm:tp=2,quant=fp8", "full", "p2p", "sync", 0)
    with pytest.raises(ConfigError, match="quant=fp8 needs the fp8 codec.*delta and FP8 together are not built"):
        check_engine("vllm:tp=2,quant=fp8", "delta", "p2p", "sync", 0)
    check_engine("vllm:tp=2,quant=fp8", "full", "colocated", "sync", 0)
    check_engine("sglang:tp=2,quant=fp8", "full", "file", "sync", 0)
    check_engine("vllm:tp=2,quant=fp8", "full", "nixl", "sync", 0)
    check_engine("vllm:tp=2,quant=fp8", "full", "nixl", "async", 0)
    with pytest.raises(ConfigError, match=r"needs a sender step .* p2p transport does not serve in async mode.*"
                                          r"runs over p2p/sync, colocated/sync, file/sync, nixl/async, nixl/sync"):
        check_engine("vllm:tp=2,quant=fp8", "full", "p2p", "async", 0)
    with pytest.raises(ConfigError, match="set integrity=0"):
        check_engine("vllm:tp=2,quant=fp8", "full", "p2p", "sync", 1000)


def test_an_engine_not_holding_fp8_is_refused_at_the_first_decode():
    from weightsync.codec.fp8 import fp8_options
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES
    from weightsync.plan.planner import Planner
    from weightsync.transport.base import TransportOptions

    infer = "vllm:tp=2,quant=fp8"
    base = make_layout(DENSE, infer)
    codec = fp8_options(TransportOptions(), infer, DENSE).codec
    plans = Planner(make_layout(DENSE, "hf"), base, 1, bucket_bytes=64 << 10).recv_plan(0, 0)
    bf16 = {n: torch.zeros(t.shape, dtype=TORCH_DTYPES[t.dtype]) for n, t in base.layout(0).tensors.items()}
    dec = codec.decoder(plans)
    b = next(b for bs in plans.values() for b in bs if any(c.canonical in dict(codec.fp8) for c in b.copies))
    with pytest.raises(ConfigError, match=r"holds .*proj\.weight as bfloat16 with no .*_scale_inv"):
        dec.decode(b, None, None, bf16, None)


def test_plan_stats_count_the_fp8_bytes_the_codec_sends():
    """``weightsync plan --infer ...,quant=fp8``: the FP8 bytes are the engine's FP8 layout's bytes (e4m3 + scales,
    the rest as is) and what the codec's frames carry, alignment aside."""
    from weightsync.engines import make_layout
    from weightsync.plan.planner import Planner
    from weightsync.predict.simulate import Deployment
    from weightsync.predict.stats import format_stats, job_stats
    from weightsync.quant.layout import fp8_layout

    infer = "vllm:tp=2,quant=fp8"
    planner = Planner(make_layout(DENSE, "fsdp:dp=2"), make_layout(DENSE, infer), 1, bucket_bytes=512 << 10)
    s = job_stats(planner, Deployment("p2p", codec="fp8"))
    layout = fp8_layout(planner.dst)
    held = sum(layout.layout(r).bytes_held(layout.spec) for r in range(layout.world_size))
    assert s.fp8_bytes_sent == held, (s.fp8_bytes_sent, held)
    assert 0.5 < s.fp8_bytes_sent / s.bytes_sent < 0.6
    assert "fp8 bytes sent" in format_stats(s)
    assert job_stats(Planner(make_layout(DENSE, "fsdp:dp=2"), make_layout(DENSE, "vllm:tp=2"), 1)).fp8_bytes_sent == 0


def test_the_file_transport_writes_fp8_payloads_as_the_pairs_one_file(tmp_path):
    """FileTransport with the fp8 codec (needs no base): each pair's one file holds the encoded payloads and their
    headers (weightsync.encoded/1); read back into NaN-poisoned FP8 targets it is the FP8 checkpoint bit for bit; a
    reader of the full codec meeting it refuses it by its format; a reader whose plan differs refuses it by the pair
    hash."""
    from weightsync.codec.fp8 import fp8_options
    from weightsync.engines import make_layout
    from weightsync.errors import TransportError
    from weightsync.layout.materialize import TORCH_DTYPES, fill_from
    from weightsync.payload.codec import Framing
    from weightsync.plan.planner import Planner
    from weightsync.quant.layout import fp8_layout
    from weightsync.testing import random_canonical
    from weightsync.transport.base import TransportOptions
    from weightsync.transport.file import FileTransport

    infer = "vllm:tp=2,quant=fp8"
    src, base = make_layout(DENSE, "hf"), make_layout(DENSE, infer)
    layout = fp8_layout(base)
    codec = fp8_options(TransportOptions(), infer, DENSE).codec
    planner = Planner(src, base, 1, bucket_bytes=256 << 10)
    canonical = random_canonical(DENSE, seed=5)
    sources = {n: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype]) for n, t in src.layout(0).tensors.items()}
    fill_from(src.layout(0), sources, canonical)
    send = planner.send_plan(0)
    stats = FileTransport(tmp_path).send(send, sources, frames=Framing(3, codec.encoder(send, torch.device("cpu")), codec))
    assert stats.bytes < 0.6 * stats.full_bytes
    for j in range(2):
        plans = planner.recv_plan(0, j)
        targets = {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype])
                   for n, t in layout.layout(j).tensors.items()}
        reader = FileTransport(tmp_path, consume=False, timeout_s=5)
        reader.recv(plans, targets, frames=Framing(3, codec.decoder(plans), codec))
        want = expected_fp8(layout, canonical, j)
        for n in want:
            assert torch.equal(bits(targets[n]), bits(want[n])), (j, n)
    with pytest.raises(TransportError, match=r"has format 'weightsync.encoded/1', expected 'weightsync.file/1'"):
        FileTransport(tmp_path, consume=False, timeout_s=5).recv(planner.recv_plan(0, 0), targets, step=3)
    other = Planner(src, base, 1, bucket_bytes=64 << 10).recv_plan(0, 0)
    with pytest.raises(TransportError, match="two ends built different plans"):
        FileTransport(tmp_path, consume=False, timeout_s=5).recv(other, targets, frames=Framing(3, codec.decoder(other), codec))
