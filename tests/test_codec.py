"""The codec stage (weightsync.codec): the registry refuses what no transport serves, by name; the full
and delta codecs' two sides round-trip a plan's buckets bit-exact into poisoned targets; headers and
proofs survive their int64 wire form."""

from __future__ import annotations

import pytest
import torch
from helpers import same

from weightsync.payload.codec import NEEDS, NO_VERSION, WHOLE, Header, Proof
from weightsync.codec.fp8 import FP8Codec
from weightsync.errors import ConfigError


def test_registry_refuses_a_codec_no_transport_serves_by_name():
    from weightsync.codec.registry import check, serving

    with pytest.raises(ConfigError, match=r"the delta codec needs .* the colocated transport .* co-located"):
        check("delta", "colocated", "sync")
    with pytest.raises(ConfigError, match=r"the delta codec needs .*, which the p2p transport does not serve in "
                                          r"async mode; the delta codec runs over p2p/sync, file/sync, nixl/async"):
        check("delta", "p2p", "async")
    with pytest.raises(ConfigError, match="unknown codec 'zip'; known: full, delta"):
        check("zip", "p2p", "sync")
    for transport, mode in (("p2p", "sync"), ("file", "sync"), ("nixl", "sync"), ("nixl", "async")):
        check("delta", transport, mode)
    for transport in ("p2p", "colocated", "file", "nixl"):
        check("full", transport, "sync")  # the plan's bytes: every transport
    assert serving("delta") == ["p2p/sync", "file/sync", "nixl/async", "nixl/sync"]


def test_the_session_refuses_at_set_up():
    from weightsync.runtime.session import SessionOptions

    with pytest.raises(ConfigError, match="colocated transport"):
        SessionOptions(colocate=True, delta=True)
    opts = SessionOptions(transport="nixl", mode="async", delta=True).transport_options("gloo")
    assert opts.framed and opts.codec.name == "delta"
    assert not SessionOptions().transport_options("gloo").framed  # full: the transports' own paths


def test_one_codec_option_chosen_in_one_place():
    """``codec=NAME`` is the option; ``delta=True`` its older spelling; the engine decides FP8 (an engine declared
    quant=fp8 takes the fp8 codec where the full one was asked); the session makes the job's codec from the
    registry alone (weightsync.codec.registry)."""
    from weightsync.codec.registry import job_codec_name, make_job_codec, requested
    from weightsync.payload.codec import CodecJob
    from helpers import tiny

    from weightsync.runtime.session import SessionOptions

    assert requested(None) == "full" and requested(None, delta=True) == requested("delta") == "delta"
    assert requested("delta", delta=True) == "delta"
    with pytest.raises(ConfigError, match="delta=True asks for the delta codec and codec='full'"):
        requested("full", delta=True)
    with pytest.raises(ConfigError, match="unknown codec 'zip'; known: full, delta, fp8"):
        SessionOptions(codec="zip")
    assert SessionOptions(codec="delta", transport="file", directory="/x").terms().codec == "delta"
    assert SessionOptions(delta=True).terms() == SessionOptions(codec="delta").terms()
    with pytest.raises(ConfigError, match="colocated transport"):
        SessionOptions(colocate=True, codec="delta")
    # the engine decides FP8, once the job names it
    assert job_codec_name("full", "vllm:tp=2", "p2p", "sync") == "full"
    assert job_codec_name("full", "vllm:tp=2,quant=fp8", "p2p", "sync") == "fp8"
    assert job_codec_name("fp8", "vllm:tp=2,quant=fp8", "nixl", "async") == "fp8"
    with pytest.raises(ConfigError, match="delta and FP8 together are not built"):
        job_codec_name("delta", "vllm:tp=2,quant=fp8", "p2p", "sync")
    with pytest.raises(ConfigError, match="vllm:tp=2 is not declared quant=fp8"):
        job_codec_name("fp8", "vllm:tp=2", "p2p", "sync")
    spec = tiny("tiny-qwen3-h64", hidden_size=256, head_dim=128, num_key_value_heads=2, intermediate_size=512)
    fp8 = make_job_codec("fp8", CodecJob("vllm:tp=2,quant=fp8", spec))
    assert fp8.name == "fp8" and fp8.fp8 and all(n.endswith("proj.weight") for n, _ in fp8.fp8)
    assert make_job_codec("delta", CodecJob(host=True)).host and make_job_codec("full", CodecJob()).name == "full"


def test_transports_serve_only_known_needs():
    from weightsync.transport.base import SOURCES, TRANSPORTS

    for name, entry in TRANSPORTS.items():
        assert set(entry.serves) <= entry.modes, name
        for served in entry.serves.values():
            # a codec's needs, or the sources read in place (co-located: a codec that lands them itself runs there)
            assert served <= NEEDS | {SOURCES}, (name, served)


class NarrowFP8(FP8Codec):
    """A codec built for fewer (transport, mode) pairs than the transports serve it (``runs_on``)."""

    name = "narrow"
    runs_on = frozenset({("p2p", "sync")})
    why_not = {("nixl", "sync"): "not built: its frames are untested there"}


def test_the_registry_accepts_exactly_what_runs_and_refuses_the_rest_by_name(monkeypatch):
    from weightsync.codec.registry import CODECS, check, serving

    assert serving("full") == ["p2p/async", "p2p/sync", "colocated/sync", "file/sync", "nixl/async", "nixl/sync"]
    assert serving("delta") == ["p2p/sync", "file/sync", "nixl/async", "nixl/sync"]
    assert serving("fp8") == ["p2p/sync", "colocated/sync", "file/sync", "nixl/async", "nixl/sync"]
    for t, m in (("p2p", "sync"), ("colocated", "sync"), ("file", "sync"), ("nixl", "sync"), ("nixl", "async")):
        check("fp8", t, m)
    monkeypatch.setitem(CODECS, "narrow", f"{__name__}:NarrowFP8")
    assert serving("narrow") == ["p2p/sync"]
    with pytest.raises(ConfigError, match=r"narrow codec does not run over the nixl transport in sync mode \(not "
                                          r"built: its frames are untested there\); it runs over p2p/sync"):
        check("narrow", "nixl", "sync")
    with pytest.raises(ConfigError, match=r"fp8 codec needs a sender step .*p2p transport does not serve in async"):
        check("fp8", "p2p", "async")
    with pytest.raises(ConfigError, match=r"delta codec needs .*colocated .*delta gains nothing co-located"):
        check("delta", "colocated", "sync")


def test_header_and_proof_words_round_trip():
    big = (1 << 64) - 3  # a checksum above 2^63: signed on the wire, unsigned again after
    h = Header(2, 17, 4096, 5, big, 1 << 63)
    assert Header.of(h.words()) == h
    assert Header.of(h.words(Header.SENT)) == Header(2, 17, 4096)  # what a two-sided transport sends
    assert Header(WHOLE).whole and Header.of(Header(WHOLE).words()).base == NO_VERSION
    assert Proof.of(Proof(3, big).words()) == Proof(3, big)
    t = torch.tensor(h.words(), dtype=torch.int64)  # as the transports carry them
    assert Header.of(t.tolist()) == h


def _job():
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES
    from weightsync.plan.planner import Planner
    from weightsync.spec import load_spec
    from weightsync.testing import random_canonical

    spec = load_spec("tiny-qwen3")
    src, dst = make_layout(spec, "fsdp:dp=2"), make_layout(spec, "vllm:tp=2")
    planner = Planner(src, dst, 1, bucket_bytes=16 << 10)
    canon = random_canonical(spec, seed=3)

    def poisoned(j):
        return {n: torch.full(t.shape, float("nan"), dtype=TORCH_DTYPES[t.dtype]) for n, t in dst.layout(j).tensors.items()}

    return src, dst, planner, canon, poisoned


def test_full_codec_round_trips_bit_exact():
    from weightsync.codec.full import FullCodec
    from weightsync.layout.materialize import scatter

    src, dst, planner, canon, poisoned = _job()
    codec = FullCodec()
    assert not codec.framed and codec.needs == frozenset()
    for j in range(dst.world_size):
        targets = poisoned(j)
        for r in range(src.world_size):
            sources = scatter(src.layout(r), canon)
            plans = {p: bs for p, bs in planner.send_plan(r).items() if p[2] == j}
            enc, dec = codec.encoder(plans, torch.device("cpu")), codec.decoder(plans)
            for bs in plans.values():
                for b in bs:
                    slot = torch.empty(b.nbytes, dtype=torch.uint8)
                    frame = enc.encode(b, sources, slot)
                    assert frame.header.whole and frame.header.nbytes == b.nbytes
                    dec.decode(b, frame.header, frame.payload, targets, slot)
        want = scatter(dst.layout(j), canon)
        assert all(same(targets[n], want[n]) for n in want)


def test_delta_codec_one_sided_proves_its_base_and_applies_only_the_change():
    """A receiver holding the base decodes only the changed words, bit-exact; one whose targets were
    touched does not prove the base (it takes the bucket whole)."""
    from weightsync.codec.delta import DeltaCodec
    from weightsync.layout.materialize import scatter

    src, dst, planner, canon, poisoned = _job()
    codec = DeltaCodec()
    r, j = 0, 0
    plans = {p: bs for p, bs in planner.send_plan(r).items() if p[2] == j}
    sources = scatter(src.layout(r), canon)
    enc, dec = codec.encoder(plans, torch.device("cpu")), codec.decoder(plans)
    buckets = [b for bs in plans.values() for b in bs if b.nbytes]
    largest = max(b.nbytes for b in buckets)
    slot, scratch = torch.empty(largest, dtype=torch.uint8), torch.empty(largest, dtype=torch.uint8)
    targets = poisoned(j)
    from weightsync.payload.pack import pack, unpack

    for step in (0, 1):
        if step:
            g = torch.Generator().manual_seed(step)
            for t in sources.values():
                flat = t.view(-1)
                idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=g)
                flat[idx] = flat[idx] + 1
        enc.begin(step, None)
        frames = []
        for b in buckets:  # the slot is reused: keep what each frame holds
            f = enc.encode(b, sources, slot)
            frames.append((b, f.header, f.payload.clone(), f.packed.clone()))
        enc.end(step)
        held = dec.begin()
        read = dec.accepts(step, held, [(b, h) for b, h, _, _ in frames], targets, scratch)
        if step == 0:
            assert read is None and all(h.whole for _, h, _, _ in frames)  # no base yet: whole
            for b, h, _, packed in frames:
                unpack(b, packed, targets)
            dec.whole(next(iter(plans)), buckets)
        else:
            assert read == list(range(len(frames)))
            assert all(not h.whole and h.base == 0 and h.nbytes < b.nbytes / 4 for b, h, _, _ in frames)
            for i in read:
                b, h, payload, _ = frames[i]
                assert dec.size(b, h) == h.nbytes
                dec.decode(b, h, payload, targets, scratch)
        dec.end(step)
        for b, _, _, packed in frames:  # the targets hold this step's wire bytes of every bucket, bit-exact
            assert torch.equal(pack(b, sources), packed)
            assert torch.equal(_landed(b, targets), packed)
    # touched behind the decoder's back: the base is no longer proven
    enc.begin(2, None)
    frames = [(b, enc.encode(b, sources, slot).header) for b in buckets]
    enc.end(2)
    t = next(iter(targets.values()))
    t.view(-1)[0] = t.view(-1)[0] + 1
    assert dec.accepts(2, dec.begin(), frames, targets, scratch) is None


def _landed(b, targets) -> torch.Tensor:
    """The bucket's wire bytes as ``targets`` hold them (what a receiver proves)."""
    from weightsync.codec.delta_state import gather_pairs
    from weightsync.payload.pack import copy_pairs, segments

    out = torch.empty(b.nbytes, dtype=torch.uint8)
    copy_pairs(gather_pairs(segments(b), targets, out))
    return out
