"""BatchedCopy: many (dst, src) views copied from one tile table, bit-exact against plain ``copy_``.

Every case builds its destination tensors poisoned (NaN, or a byte no source holds), copies once
with ``copy_`` into a clone as the reference and once with :class:`BatchedCopy`, and compares the
whole destination tensors byte for byte: the copied views and every byte around them. On CPU the
tables run through the ``memmove`` reference executor; the same cases run on CUDA through the
Triton kernel (``-m gpu`` on the GPU host), where a captured graph is replayed too.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from weightsync.transport.batch_copy import ALIGNS, BatchedCopy

GPU = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU host: make test-gpu)")]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]

Pairs = list[tuple[torch.Tensor, torch.Tensor]]
Case = tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Pairs]]  # poisoned dst bases, bases -> pairs


def _rand(shape, dtype: torch.dtype, device: str, g: torch.Generator) -> torch.Tensor:
    """Random values, never zero and never the poison."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if dtype.is_floating_point:
        t = torch.rand(shape, generator=g, dtype=torch.float32) + 0.5
        t = t * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    else:
        t = torch.randint(1, 100, shape, generator=g, dtype=torch.int64)
    return t.to(dtype).to(device)


def _poisoned(shape, dtype: torch.dtype, device: str) -> torch.Tensor:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    fill = float("nan") if dtype.is_floating_point else (255 if dtype == torch.uint8 else -1)
    return torch.full(shape, fill, dtype=dtype, device=device)


def _refill(t: torch.Tensor, g: torch.Generator) -> None:
    """New random values in the whole storage under ``t`` (views and expanded tensors included)."""
    whole = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
    whole.copy_(_rand(whole.shape, t.dtype, str(t.device), g))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (NaN poison included)."""
    return torch.equal(_bytes(a), _bytes(b))


def _check(case: Case, tile_bytes: int | None = None) -> BatchedCopy:
    """Copy with BatchedCopy and with copy_ into clones; the whole destination tensors must match."""
    bases, pairs_of = case
    want = [b.clone() for b in bases]
    for d, s in pairs_of(want):
        d.copy_(s)
    before = [b.clone() for b in bases]
    bc = BatchedCopy(pairs_of(bases), **({} if tile_bytes is None else {"tile_bytes": tile_bytes}))
    bc.run()
    for i, (got, w) in enumerate(zip(bases, want)):
        assert _same(got, w), f"destination {i} differs from copy_"
    assert any(not _same(b, w) for b, w in zip(before, want)), "the case copies nothing"
    return bc


# --- cases: (device, generator) -> (poisoned destination bases, bases -> pairs) ---


def contiguous_1d(dev, g) -> Case:
    a, b = _rand(10_000, torch.float32, dev, g), _rand(4096, torch.bfloat16, dev, g)
    return [_poisoned(12_000, torch.float32, dev), _poisoned(4096, torch.bfloat16, dev)], \
        lambda d: [(d[0][1000:11_000], a), (d[1], b)]


def row_ranges(dev, g) -> Case:
    a, b = _rand((64, 96), torch.bfloat16, dev, g), _rand((200, 50), torch.float32, dev, g)
    return [_poisoned((128, 96), torch.bfloat16, dev), _poisoned((100, 50), torch.float32, dev)], \
        lambda d: [(d[0][10:74], a), (d[1][:60], b[140:])]


def column_halves(dev, g) -> Case:
    m = _rand((256, 768), torch.bfloat16, dev, g)
    c1, c2 = _rand((256, 384), torch.bfloat16, dev, g), _rand((256, 384), torch.bfloat16, dev, g)
    bases = [_poisoned((256, 384), torch.bfloat16, dev), _poisoned((256, 384), torch.bfloat16, dev),
             _poisoned((256, 768), torch.bfloat16, dev)]
    # strided source into contiguous destinations, and contiguous sources into strided halves
    return bases, lambda d: [(d[0], m[:, :384]), (d[1], m[:, 384:]), (d[2][:, :384], c1), (d[2][:, 384:], c2)]


def stacked_experts(dev, g) -> Case:
    w = _rand((4, 96, 64), torch.bfloat16, dev, g)  # [E, 2I, H]: gate and up halves along the middle
    up = _rand((4, 48, 64), torch.bfloat16, dev, g)
    x = _rand((3, 4, 6, 10), torch.float32, dev, g)  # [:, 1:3, :, 2:7] collapses to 3 dims, not 2
    bases = [_poisoned((4, 48, 64), torch.bfloat16, dev), _poisoned((4, 96, 64), torch.bfloat16, dev),
             _poisoned((3, 2, 6, 5), torch.float32, dev)]
    return bases, lambda d: [(d[0], w[:, :48]), (d[1][:, 48:], up), (d[2], x[:, 1:3, :, 2:7])]


def odd_widths(dev, g) -> Case:
    u8 = _rand(1001, torch.uint8, dev, g)
    i16 = _rand(500, torch.int16, dev, g)
    m8 = _rand((37, 41), torch.uint8, dev, g)
    f32 = _rand(300, torch.float32, dev, g)
    f64 = _rand(100, torch.float64, dev, g)
    bases = [_poisoned(1003, torch.uint8, dev), _poisoned(503, torch.int16, dev), _poisoned((37, 17), torch.uint8, dev),
             _poisoned(301, torch.float32, dev), _poisoned(101, torch.float64, dev)]
    return bases, lambda d: [
        (d[0][3:700], u8[1:698]),  # odd addresses and length: width 1
        (d[1][1:301], i16[:300]),  # 2 bytes off: width 2
        (d[2], m8[:, 3:20]),  # odd row stride: width 1
        (d[3][1:], f32),  # 4 bytes off: width 4
        (d[4][1:], f64),  # 8 bytes off: width 8 (not 16)
    ]


def strided_fallback(dev, g) -> Case:
    a, b = _rand((100, 30), torch.bfloat16, dev, g), _rand((40, 30), torch.float32, dev, g)
    c = _rand(77, torch.float32, dev, g)
    bases = [_poisoned((100, 60), torch.bfloat16, dev), _poisoned((30, 40), torch.float32, dev),
             _poisoned(77, torch.float32, dev)]
    # every other column of the destination and a transposed source (innermost strides 2 and 40) fall back to
    # copy_; the last pair is tiles
    return bases, lambda d: [(d[0][:, ::2], a), (d[1], b.t()), (d[2], c)]


def zero_size(dev, g) -> Case:
    a = _rand((10, 5), torch.float32, dev, g)
    return [_poisoned((10, 5), torch.float32, dev)], lambda d: [(d[0][:0], a[:0]), (d[0][:, :0], a[:, :0]), (d[0], a)]


def many_small(dev, g) -> Case:
    """Hundreds of small copies of mixed dtypes and shapes into one byte buffer."""
    dtypes = [torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.float64]
    specs, srcs, off = [], [], 0
    for i in range(300):
        dt = dtypes[i % len(dtypes)]
        kind = int(torch.randint(0, 4, (), generator=g))
        if kind == 0:
            src = _rand((), dt, dev, g)  # a scalar
        elif kind == 1:
            src = _rand(int(torch.randint(1, 200, (), generator=g)), dt, dev, g)
        else:
            rows, cols = (int(x) for x in torch.randint(1, 24, (2,), generator=g))
            full = _rand((rows, cols + 7), dt, dev, g)
            src = full[:, 3 : 3 + cols] if kind == 2 else full[: max(1, rows // 2)]
        specs.append((off, dt, tuple(src.shape)))
        srcs.append(src)
        off += (src.numel() * src.element_size() + 15) // 16 * 16 + 16  # a poisoned gap after each

    def pairs_of(d: list[torch.Tensor]) -> Pairs:
        return [(d[0][o : o + s.numel() * s.element_size()].view(dt).view(shape), s)
                for (o, dt, shape), s in zip(specs, srcs)]

    return [_poisoned(off, torch.uint8, dev)], pairs_of


def expanded_source(dev, g) -> Case:
    row, cube = _rand(64, torch.float32, dev, g), _rand((5, 1, 7), torch.bfloat16, dev, g)
    bases = [_poisoned((10, 64), torch.float32, dev), _poisoned((5, 3, 7), torch.bfloat16, dev)]
    return bases, lambda d: [(d[0], row.expand(10, 64)), (d[1], cube.expand(5, 3, 7))]


CASES = [contiguous_1d, row_ranges, column_halves, stacked_experts, odd_widths, strided_fallback, zero_size,
         many_small, expanded_source]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__)
def test_matches_copy(make, device):
    _check(make(device, torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__)
def test_matches_copy_with_tiny_tiles(make, device):
    # 64-byte tiles: long rows cut into column chunks, short rows grouped a few per tile
    bc = _check(make(device, torch.Generator().manual_seed(2)), tile_bytes=64)
    for t in bc.tables.values():
        assert int((t[:, 2] * t[:, 3]).max()) <= 64 + 15


@pytest.mark.parametrize("device", DEVICES)
def test_facts(device):
    g = torch.Generator().manual_seed(3)
    bc = _check(odd_widths(device, g))
    assert {1, 2, 4, 8} <= set(bc.groups), bc.groups
    assert bc.fallback == 0 and bc.skipped == 0
    bc = _check(strided_fallback(device, g))
    assert bc.fallback == 2 and bc.tiles == 1
    bc = _check(zero_size(device, g))
    assert bc.skipped == 2 and bc.fallback == 0 and bc.tiles == 1
    bc = _check(column_halves(device, g))
    assert set(bc.groups) == {16} and bc.nbytes == 4 * 256 * 384 * 2
    bc = _check(stacked_experts(device, g))
    assert bc.tiles == 1 + 1 + 3  # the four-dim pair collapses to three: a 12-row run per outermost index


def test_chunking_and_grouping():
    g = torch.Generator().manual_seed(4)
    a = _rand(10_000, torch.float32, "cpu", g)  # one 40,000-byte row
    m = _rand((50, 10), torch.float32, "cpu", g)  # 24-byte rows, stride 40
    w = _rand((8, 1000), torch.bfloat16, "cpu", g)  # 1,600-byte rows, stride 2,000

    def case() -> Case:
        return ([_poisoned(10_000, torch.float32, "cpu"), _poisoned((50, 6), torch.float32, "cpu"),
                 _poisoned((8, 800), torch.bfloat16, "cpu")],
                lambda d: [(d[0], a), (d[1], m[:, 2:8]), (d[2], w[:, 100:900])])

    bc = _check(case(), tile_bytes=64)
    rows = torch.cat(list(bc.tables.values()))
    assert int((rows[:, 2] == 1).sum()) >= 625 + 8 * 25  # chunks of the long rows
    assert int(rows[:, 2].max()) == 2  # 24-byte rows two to a 64-byte tile
    assert bc.tiles == 625 + 25 + 8 * 25
    # the default tile: the 40 KB row is one tile, the matrices one tile each
    assert _check(case()).tiles == 3


def test_tables_follow_the_width_rule():
    g = torch.Generator().manual_seed(5)
    for make in CASES:
        bases, pairs_of = make("cpu", g)
        bc = BatchedCopy(pairs_of(bases), tile_bytes=96)
        for a, t in bc.tables.items():
            assert a in ALIGNS
            src, dst, nrows, rb, ss, ds = t.unbind(1)
            bits = src | dst | rb | ss | ds
            assert bool((bits % a == 0).all()), (make.__name__, a)
            if a < 16:
                assert bool((bits % (2 * a) != 0).all()), (make.__name__, a)  # the widest that divides
            assert bool((nrows >= 1).all() and (rb >= 1).all())
            assert bool(((nrows > 1) | ((ss == 0) & (ds == 0))).all())  # one-row tiles carry no strides


def test_bytes_outside_the_views_are_untouched():
    g = torch.Generator().manual_seed(6)
    src = _rand((20, 30), torch.float32, "cpu", g)
    base = _poisoned(1000, torch.float32, "cpu")
    view = base[100:900].view(20, 40)[:, 5:35]
    BatchedCopy([(view, src)], tile_bytes=64).run()
    assert torch.equal(view, src)
    mask = torch.ones(1000, dtype=torch.bool)
    mask[100:900].view(20, 40)[:, 5:35] = False
    assert bool(base[mask].isnan().all()) and int(mask.sum()) == 1000 - 600


@pytest.mark.parametrize("device", DEVICES)
def test_run_reads_the_sources_every_time(device):
    g = torch.Generator().manual_seed(7)
    bases, pairs_of = column_halves(device, g)
    pairs = pairs_of(bases)
    bc = BatchedCopy(pairs)
    for _ in range(2):
        for _, s in pairs:
            _refill(s, g)
        bc.run()
        for d, s in pairs:
            assert torch.equal(d, s)


def test_rejects_bad_pairs():
    with pytest.raises(ValueError, match="size"):
        BatchedCopy([(torch.zeros(3), torch.zeros(4))])
    with pytest.raises(ValueError, match="cpu or cuda"):
        BatchedCopy([(torch.zeros(3, device="meta"), torch.zeros(3, device="meta"))])
    with pytest.raises(ValueError, match="tile_bytes"):
        BatchedCopy([], tile_bytes=0)
    BatchedCopy([]).run()  # nothing to do


def test_refuses_a_cast():
    """A pair of two dtypes is a cast, never a byte copy: refused at construction, naming both sides (the cast is a
    codec's work, run after the copies as ``Landing.work``), even beside pairs it would copy."""
    ok_dst, ok_src = torch.zeros(8), torch.ones(8)
    with pytest.raises(ValueError, match=r"torch.float32 \(4, 6\) -> torch.bfloat16 \(4, 6\) pair is a cast.*"
                                         r"a cast is a codec's work: pass it as Landing.work"):
        BatchedCopy([(ok_dst, ok_src), (torch.zeros(4, 6, dtype=torch.bfloat16), torch.ones(4, 6))])
    with pytest.raises(ValueError, match=r"torch.bfloat16 \(24,\) -> torch.float32 \(4, 6\) pair is a cast"):
        BatchedCopy([(torch.zeros(4, 6), torch.ones(24, dtype=torch.bfloat16))])  # shaped apart too


# --- GPU only ---


@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU host: make test-gpu)")
def test_graph_capture_and_replay(make):
    g = torch.Generator().manual_seed(8)
    bases, pairs_of = make("cuda", g)
    pairs = pairs_of(bases)
    bc = BatchedCopy(pairs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # one eager run on the side stream first, as graph capture wants
        bc.run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bc.run()
    for _ in range(2):
        for _, s in pairs:
            _refill(s, g)
        for b in bases:
            b.copy_(_poisoned(b.shape, b.dtype, "cuda"))
        want = [b.clone() for b in bases]
        for d, s in pairs_of(want):
            d.copy_(s)
        graph.replay()
        torch.cuda.synchronize()
        for i, (got, w) in enumerate(zip(bases, want)):
            assert _same(got, w), f"destination {i} differs after replay"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU host: make test-gpu)")
def test_cuda_sizes_of_a_real_step():
    # [2048, 768] bf16 column halves (1.5 MB, 6 default tiles each), a 40 MB contiguous copy, and
    # many 1.5 MB contiguous ones: every tile in the 16-byte group, one launch
    g = torch.Generator().manual_seed(9)
    mats = [_rand((2048, 768), torch.bfloat16, "cuda", g) for _ in range(4)]
    big = _rand(10 << 20, torch.float32, "cuda", g)
    flat = [_rand(768 << 10, torch.bfloat16, "cuda", g) for _ in range(16)]
    bases = [_poisoned((8, 2048, 384), torch.bfloat16, "cuda"), _poisoned(10 << 20, torch.float32, "cuda"),
             _poisoned((16, 768 << 10), torch.bfloat16, "cuda")]

    def pairs_of(d):
        halves = [(d[0][2 * i + h], m[:, h * 384 : (h + 1) * 384]) for i, m in enumerate(mats) for h in (0, 1)]
        return halves + [(d[1], big)] + [(d[2][i], f) for i, f in enumerate(flat)]

    bc = _check((bases, pairs_of))
    assert set(bc.groups) == {16}, bc.groups


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_pairs_on_another_device_than_the_current_one():
    g = torch.Generator().manual_seed(10)
    with torch.cuda.device(0):
        _check(column_halves("cuda:1", g))


@pytest.mark.parametrize("device", DEVICES)
def test_views_shaped_apart(device):
    """Pairs of the same elements in the same row-major order but different shapes (a box of a fused
    weight against a separate tensor): a view where one reshapes as a view, else the copy_ fallback."""
    g = torch.Generator().manual_seed(3)
    src = _rand((8, 12), torch.bfloat16, device, g)
    flat = _poisoned(96, torch.bfloat16, device)
    half = _poisoned(32, torch.bfloat16, device)
    wide = _poisoned((4, 10), torch.bfloat16, device)
    pairs = [(flat, src),  # src views as [96]
             (half, src[:4, 4:12]),  # strided [4, 8]: the destination views as [4, 8] instead
             (wide[:, :6], src[:3, :8])]  # neither views as the other: copy_ through a reshape
    batch = BatchedCopy(pairs)
    batch.run()
    assert batch.fallback == 1 and batch.tiles >= 2
    assert torch.equal(flat, src.reshape(-1))
    assert torch.equal(half, src[:4, 4:12].reshape(-1))
    assert torch.equal(wide[:, :6], src[:3, :8].reshape(4, 6))
    assert wide[:, 6:].isnan().all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU host: make test-gpu)")
@pytest.mark.parametrize("programs", [1, 3, 1000])
def test_cuda_capped_programs_loop_over_every_tile(programs):
    """With at most ``programs`` CTAs each loops over its share of the tiles: every byte still lands."""
    g = torch.Generator().manual_seed(9)
    src = _rand((256, 768), torch.bfloat16, "cuda", g)
    dst = _poisoned((256, 768), torch.bfloat16, "cuda")
    batch = BatchedCopy([(dst[:, :384], src[:, 384:]), (dst[:, 384:], src[:, :384])], tile_bytes=4096,
                        programs=programs)
    assert batch.tiles > 3
    batch.run()
    assert torch.equal(dst[:, :384], src[:, 384:]) and torch.equal(dst[:, 384:], src[:, :384])


def test_copy_graphs_forget_what_moved():
    """CopyGraphs keeps a bucket's views (memos) while the weights stay put, even when the transport's
    buffers are reallocated -- only the copies, which hold buffer addresses, are rebuilt then -- and
    drops both when a weight tensor moved."""
    from weightsync.transport.graphs import CopyGraphs

    weights = {"w": torch.arange(8.0)}
    buffers = [torch.zeros(8)]
    graphs, owner, built = CopyGraphs(), object(), []

    def build():
        built.append(1)
        return weights["w"][2:4]

    def copies():  # weight -> buffer
        built.append(2)
        return [(buffers[0][:8], weights["w"])]

    def step():
        graphs.begin(weights, buffers=buffers)
        view = graphs.memo(owner, "view", build)
        graphs.run(owner, "copy", copies, torch.device("cpu"))
        return view

    step()
    step()
    assert built == [1, 2]  # built once, reused
    buffers[0] = torch.zeros(8)  # buffers reallocated: the copies are rebuilt, the views kept
    step()
    assert built == [1, 2, 2] and torch.equal(buffers[0], weights["w"])
    weights["w"] = torch.arange(8.0) + 1  # the weights moved: both rebuilt
    assert torch.equal(step(), weights["w"][2:4])
    assert built == [1, 2, 2, 1, 2] and torch.equal(buffers[0], weights["w"])


def test_copy_graphs_know_opened_maps_by_identity():
    """Maps opened from another process (``opened``) cannot move under their opener, so CopyGraphs looks
    up no address in them: the copies stay while the same map is passed, and are rebuilt for a new one
    (the owner shared its tensors anew and they were opened again)."""
    from weightsync.transport.graphs import CopyGraphs

    mine, theirs = {"w": torch.zeros(4)}, {"w": torch.arange(4.0)}
    graphs, owner, built = CopyGraphs(), object(), []

    def step(opened):
        graphs.begin(mine, opened=[opened])
        graphs.run(owner, "copy", lambda: built.append(1) or [(mine["w"], opened["w"])], torch.device("cpu"))

    step(theirs)
    step(theirs)
    assert built == [1] and torch.equal(mine["w"], theirs["w"])
    again = {"w": torch.arange(4.0) + 10}  # opened anew: a new map
    step(again)
    assert built == [1, 1] and torch.equal(mine["w"], again["w"])
    mine["w"] = torch.zeros(4)  # my own tensor moved: looked up, rebuilt
    step(again)
    assert built == [1, 1, 1] and torch.equal(mine["w"], again["w"])
