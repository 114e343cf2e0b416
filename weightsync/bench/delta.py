"""``weightsync bench --delta``: delta steps (``delta=True``) timed against the same run's full steps.

After the scenario's full steps (:func:`weightsync.bench.run.run`), the same processes run again as a
delta job: the writers and readers with ``delta=True`` (the previous version on the tensors' device,
or with ``delta_host=True`` in host memory, pinned where CUDA is present). Step 0 goes whole (no
reader holds a base yet), step 1 is an untimed delta warm-up, then ``steps`` timed steps at each
change fraction in turn.

What a step changes (:func:`toggle`): for every canonical tensor, exactly ``round(numel * F)`` distinct
elements, one drawn at random in each of that many equal strata of the flat index space, from a
generator seeded by the tensor's name and the step -- the same on every rank, so replicas and shards
change alike -- and each one's lowest bit is flipped (one ulp, as an optimizer step moves a bf16
weight; always a different bit pattern, never a NaN from a finite number). A delta step therefore
must move exactly those elements; the readers replay every step's flips onto the base data at the
end and compare bit for bit (:func:`check_changed`).
"""

from __future__ import annotations

import json
import logging
import secrets
import statistics
import sys
import time
import zlib
from dataclasses import dataclass, field

import torch

from weightsync.bench.events import Phases
from weightsync.bench.scenarios import (Scenario, canonical_region, device_of, init_weights, memory, synchronize,
                                        timed_write)
from weightsync.errors import ConfigError
from weightsync.local.events import Event, Participant, StepStarted
from weightsync.local.runner import Emit, LocalJob
from weightsync.runtime.job import DEFAULT_MEMORY_BUDGET

log = logging.getLogger("weightsync.bench.delta")

# the measured range: lr 1e-7 .. 1e-5 (BENCHMARKS.md, "Delta: change fractions (2026-12-01)")
DEFAULT_FRACTIONS = (0.001, 0.01, 0.1)
PREVIOUS = ("device", "host")  # where the sender keeps its previous version (delta_host=False / True)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class DeltaOptions:
    """What ``--delta`` asks for: the change fractions (in step order), the timed steps at each, and
    where the sender's previous version lives, one delta job per entry."""

    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    steps: int = 5
    previous: tuple[str, ...] = ("device",)

    def schedule(self) -> tuple[float, ...]:
        """The fraction each step changes (index = step): step 0 none (it goes whole), step 1 the
        first fraction (warm-up), then ``steps`` steps of each fraction."""
        return (0.0, self.fractions[0]) + tuple(f for f in self.fractions for _ in range(self.steps))


def check_options(scen: Scenario, scenario: str, opts: DeltaOptions, baselines: tuple[str, ...]) -> None:
    """Refuse what the delta bench cannot run, before any process starts, saying what to do."""
    if scen.colocate:
        raise ConfigError(f"--delta runs separated scenarios (a link to save bytes on); {scenario} is co-located, "
                          "where the workers copy GPU memory and delta=True is refused: pick nixl-1gpu or a sep-* "
                          "scenario")
    if not opts.fractions:
        raise ConfigError("--delta needs at least one --change-fraction")
    bad = [f for f in opts.fractions if not 0.0 < f <= 1.0]
    if bad:
        raise ConfigError(f"--change-fraction must be in (0, 1] (0.01 = 1% of the elements), got {bad}")
    unknown = set(opts.previous) - set(PREVIOUS)
    if unknown or not opts.previous:
        raise ConfigError(f"--delta-previous must name device and/or host, got {sorted(unknown) or 'none'}")
    if opts.steps < 1:
        raise ConfigError(f"--steps must be at least 1 with --delta, got {opts.steps}")
    if baselines and scen.transport == "p2p":
        log.info("--delta: the baselines run in the full job only")


# -- the change each step makes ---------------------------------------------------------------------


def changed_count(numel: int, fraction: float) -> int:
    return min(numel, int(round(numel * fraction)))


def positions(name: str, numel: int, fraction: float, step: int, device) -> torch.Tensor:
    """The flat indices of canonical tensor ``name`` that step ``step`` changes: exactly
    :func:`changed_count` distinct ones, one at random in each of that many equal strata."""
    k = changed_count(numel, fraction)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{name}@{step}".encode()))
    edges = torch.arange(k + 1, dtype=torch.int64, device=device) * numel // k
    widths = edges[1:] - edges[:-1]  # >= 1: k <= numel
    offs = (torch.rand(k, generator=g, device=device, dtype=torch.float64) * widths).long()
    return edges[:-1] + torch.minimum(offs, widths - 1)


def toggle(view: torch.Tensor, name: str, shape: tuple[int, ...], box, fraction: float, step: int) -> int:
    """Flip the lowest bit of the elements step ``step`` changes inside ``view``, which holds ``box``
    of canonical tensor ``name`` (``shape``); return how many it flipped."""
    numel = 1
    for n in shape:
        numel *= n
    pos = positions(name, numel, fraction, step, view.device)
    if pos.numel() == 0:
        return 0
    bits = view.view(_INT[view.element_size()])
    if all(o == 0 and n == full for (o, n), full in zip(box, shape)) and bits.is_contiguous():
        flat = bits.view(-1)
        flat.index_put_((pos,), flat[pos] ^ 1)
        return pos.numel()
    coords = torch.unravel_index(pos, shape)
    inside = torch.ones_like(pos, dtype=torch.bool)
    for c, (o, n) in zip(coords, box):
        inside &= (c >= o) & (c < o + n)
    local = tuple(c[inside] - o for c, (o, _) in zip(coords, box))
    bits.index_put_(local, bits[local] ^ 1)
    return int(local[0].numel()) if local else 0


def apply_step(layout, tensors: dict, spec, fraction: float, step: int) -> None:
    """Make step ``step`` on a training rank: :func:`toggle` every piece it holds."""
    from weightsync.layout.materialize import local_view

    with torch.no_grad():
        for name, t in layout.tensors.items():
            for p in t.pieces:
                c = spec.by_name[p.canonical]
                toggle(local_view(tensors[name], p), c.name, c.shape, p.canon_box, fraction, step)


def check_changed(ctx, model: str, engine: str, schedule: tuple[float, ...]) -> bool:
    """On an inference worker: every piece holds the base data with every step's flips replayed, bit for bit."""
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES
    from weightsync.spec import load_spec
    from weightsync.testing import holds

    spec = load_spec(model)

    def expected(p):
        c = spec.by_name[p.canonical]
        want = canonical_region(c.name, c.shape, TORCH_DTYPES[c.dtype], p.canon_box, ctx.device).clone()
        for step, frac in enumerate(schedule):
            if frac:
                toggle(want, c.name, c.shape, p.canon_box, frac, step)
        return want

    return holds(make_layout(spec, engine).layout(ctx.rank), ctx.tensors, expected)


# -- processes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeltaStep(Event):
    """An instance's ``update(step)`` of the delta job returned at wall clock ``end``: the bytes its
    workers moved and how many of them read in full (fell back: no base they could prove)."""

    step: int
    bytes: int
    full_reads: int
    end: float


@dataclass(frozen=True)
class DeltaTrainerMeasured(Event):
    """A training rank's delta totals: device bytes its writer kept beyond the weights once set up (the
    previous version and, over NIXL, the registered delta region), host resident-memory growth over
    set-up and the first step, the budget it ran under, and the peak transient memory of its writes."""

    device_bytes: int
    host_bytes: int
    budget: int
    peak_bytes: int


@dataclass(frozen=True)
class DeltaInstanceMeasured(Event):
    """An instance's delta totals: the last step bit-exact (every step's changes replayed), peak memory."""

    exact: bool
    peak_bytes: int


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return 0


def _local_bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _trainer(emit: Emit, rank: int, scen: Scenario, model: str, opts: DeltaOptions, host: bool, meta: str,
             timeout: float, device: str, together, integrity: dict, token: str | None = None) -> None:
    """One training rank of the delta job (``token``: its MetaServer token): steps change as
    :attr:`DeltaOptions.schedule` says."""
    from weightsync.bind import Bound
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES
    from weightsync.runtime.writer import WeightWriter
    from weightsync.spec import load_spec

    me = emit.participant
    dev = device_of(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:  # a CPU rehearsal beside the workers on shared cores: OpenMP threads would spin against them
        torch.set_num_threads(1)
    spec = load_spec(model)
    engine = make_layout(spec, scen.train)
    layout = engine.layout(rank)
    tensors = {n: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=dev) for n, t in layout.tensors.items()}
    init_weights(layout, tensors, spec)
    # the previous version (a copy of what this rank sends) and NIXL's delta region (as large again) are
    # more than the default budget for any real model: the bench grants them on top, and records it
    budget = DEFAULT_MEMORY_BUDGET + (1 if host else 2) * _local_bytes(tensors)
    synchronize(dev)
    before, rss0 = memory(dev)[0], _rss()
    writer = WeightWriter(Bound(engine, rank, layout, tensors), meta=meta, job="bench-delta", token=token,
                          timeout_s=timeout, transport=scen.transport, delta=True, delta_host=host,
                          memory_budget=budget, **integrity).connect()
    kept = memory(dev)[0] - before
    peak, grown = 0, 0
    for step, frac in enumerate(opts.schedule()):
        if frac:
            apply_step(layout, tensors, spec, frac, step)
        peak = max(peak, timed_write(writer, step, dev, together, timeout, emit))
        if step == 0:
            kept = max(kept, memory(dev)[0] - before)  # buffers allocated at the first step count too
            grown = _rss() - rss0
        if step > 1 and rank == 0:
            emit(Phases(me, "writer", writer.last_timing))
    emit(DeltaTrainerMeasured(me, kept, grown, budget, peak))


def _reader(emit: Emit, inst: int, gpu: int, scen: Scenario, model: str, opts: DeltaOptions, meta: str,
            timeout: float, device: str, integrity: dict, token: str | None = None) -> None:
    from weightsync.bench.ceilings import peak_memory, reset_peak
    from weightsync.instances.faithful import FaithfulInstance
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    me = emit.participant
    spec = load_spec(model)
    instance = FaithfulInstance(dict(spec.config), scen.infer, device=f"cuda:{gpu}" if device == "cuda" else "cpu",
                                fill=float("nan"))
    try:
        reader = WeightReader(instance, meta=meta, job="bench-delta", token=token, instance_id=inst,
                              instances=scen.instances, timeout_s=timeout, transport=scen.transport, delta=True,
                              **integrity).connect()
        base = instance.call(reset_peak)
        schedule = opts.schedule()
        for step in range(len(schedule)):
            reader.update(step)
            stats = [s.stats for s in reader.last_stats]
            # a worker that read in full this step (fell back) moved its full bytes
            emit(DeltaStep(me, step, sum(s.bytes for s in stats),
                           sum(1 for s in stats if s.full_bytes and s.bytes >= s.full_bytes), time.time()))
            if step > 1 and inst == 0:
                emit(Phases(me, "reader", reader.last_timing))
        peak = max(p - b for p, b in zip(instance.call(peak_memory), base))
        exact = all(instance.call(check_changed, model, scen.infer, schedule, timeout_s=timeout * 4))
        emit(DeltaInstanceMeasured(me, exact, peak))
    finally:
        instance.close()


# -- driver -----------------------------------------------------------------------------------------


@dataclass
class _Gathered:
    starts: dict[int, float] = field(default_factory=dict)
    ends: dict[int, float] = field(default_factory=dict)
    moved: dict[int, int] = field(default_factory=dict)
    full_reads: dict[int, int] = field(default_factory=dict)  # per step: workers that read in full
    phases: dict[str, list[float]] = field(default_factory=dict)
    trainers: list[DeltaTrainerMeasured] = field(default_factory=list)
    instances: list[DeltaInstanceMeasured] = field(default_factory=list)


def p90(xs: list[float]) -> float:
    """The 90th percentile (inclusive, linear between samples; the largest of fewer than two)."""
    return statistics.quantiles(xs, n=10, method="inclusive")[8] if len(xs) > 1 else max(xs)


def run_delta(scenario: str, scen: Scenario, model: str, opts: DeltaOptions, host: bool, timeout: float,
              device: str, integrity: dict, full: dict) -> dict:
    """One delta job (previous version on the device, or ``host``); rows per fraction against ``full``
    (the same run's full-step result: its median, bytes and ceiling)."""
    from weightsync.engines import make_layout
    from weightsync.spec import load_spec

    spec = load_spec(model)
    train, infer = make_layout(spec, scen.train), make_layout(spec, scen.infer)
    schedule = opts.schedule()
    g = _Gathered()
    out: dict = {"previous": "host" if host else "device", "delta_host": host, "errors": []}
    # the MetaServer runs with an admin token that stays here; the participants get the job's token only
    with LocalJob(deadline_s=timeout * (len(schedule) + 6), exit_grace_s=30.0,
                  meta_token=secrets.token_hex(16)) as job:
        token = job.job_token("bench-delta")

        def on_event(ev: Event) -> None:
            if isinstance(ev, StepStarted):
                g.starts[ev.step] = min(g.starts.get(ev.step, ev.at), ev.at)
            elif isinstance(ev, DeltaStep):
                g.ends[ev.step] = max(g.ends.get(ev.step, 0.0), ev.end)
                g.moved[ev.step] = g.moved.get(ev.step, 0) + ev.bytes
                g.full_reads[ev.step] = g.full_reads.get(ev.step, 0) + ev.full_reads
            elif isinstance(ev, Phases):
                for name, sec in ev.seconds.items():
                    g.phases.setdefault(f"{ev.side}.{name}", []).append(sec)
            elif isinstance(ev, DeltaTrainerMeasured):
                g.trainers.append(ev)
            elif isinstance(ev, DeltaInstanceMeasured):
                g.instances.append(ev)

        together = job.ctx.Barrier(train.world_size)
        for r in range(train.world_size):
            job.add(Participant.trainer(r), _trainer, r, scen, model, opts, host, job.meta_url, timeout, device,
                    together, integrity, token)
        for i in range(scen.instances):
            gpu = 0 if scen.one_gpu else train.world_size + i * infer.world_size
            job.add(Participant.instance(i), _reader, i, gpu, scen, model, opts, job.meta_url, timeout, device,
                    integrity, token)
        outcome = job.run(on_event=on_event)
    if outcome.failure is not None:
        f = outcome.failure
        out["errors"].append(f"{f.line()}\n{f.traceback}" if f.traceback else f.line())
    done = [s for s in range(len(schedule)) if s in g.starts and s in g.ends]
    if out["errors"] or len(done) < len(schedule) or len(g.instances) < scen.instances:
        out["errors"].append(f"only {len(done)} of {len(schedule)} steps completed")
        out["verified"] = False
        return out
    full_bytes, full_median = full["bytes_moved"], full["median_seconds"]
    ceiling = full.get("ceiling_bytes_per_s")
    rows = []
    for j, frac in enumerate(opts.fractions):
        steps = range(2 + j * opts.steps, 2 + (j + 1) * opts.steps)
        secs = [g.ends[s] - g.starts[s] for s in steps]
        moved = [g.moved[s] for s in steps]
        median = statistics.median(secs)
        changed = sum(changed_count(_numel(c.shape), frac) for c in spec.by_name.values())
        floor = statistics.median(moved) / ceiling if ceiling else None
        rows.append({
            "fraction": frac,
            "changed_elements": changed,  # per step, over the model's canonical tensors
            "changed_fraction": changed / sum(_numel(c.shape) for c in spec.by_name.values()),
            "bytes_moved": int(statistics.median(moved)),
            "bytes_per_step": moved,
            "bytes_ratio_to_full": statistics.median(moved) / full_bytes,
            "median_seconds": median,
            "p90_seconds": p90(secs),
            "min_seconds": min(secs),
            "step_seconds": secs,
            "seconds_ratio_to_full": median / full_median,
            "speedup_vs_full": full_median / median,
            "floor_seconds": floor,  # these bytes over the full run's ceiling
            "efficiency": floor / median if floor is not None else None,
            "full_reads": sum(g.full_reads[s] for s in steps),  # workers that fell back (should be 0)
            # phases are reported for steps 2.. (the timed ones): entry s - 2 is step s
            "phase_median_seconds": {k: statistics.median(v[s - 2] for s in steps) for k, v in sorted(g.phases.items())
                                     if len(v) >= (j + 1) * opts.steps},
        })
    out.update(
        first_step_bytes=g.moved[0],  # step 0: no reader holds a base, so it goes whole
        first_step_seconds=g.ends[0] - g.starts[0],
        rows=rows,
        verified=all(m.exact for m in g.instances),
        memory_budget_bytes=max(m.budget for m in g.trainers),
        sender_device_bytes=max(m.device_bytes for m in g.trainers),  # the previous version (unless host) + region
        sender_host_growth_bytes=max(m.host_bytes for m in g.trainers),
        peak_transient_bytes=max([m.peak_bytes for m in g.trainers] + [m.peak_bytes for m in g.instances]),
    )
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def run_all(scenario: str, scen: Scenario, model: str, opts: DeltaOptions, timeout: float, device: str,
            integrity: dict, full: dict) -> dict:
    """Every delta job ``opts`` asks for, after the full steps (``full``); a JSON-ready record."""
    runs = []
    for where in opts.previous:
        r = run_delta(scenario, scen, model, opts, where == "host", timeout, device, integrity, full)
        runs.append(r)
        print(json.dumps({"scenario": scenario, "partial": f"delta, previous on {where}",
                          "rows": [{k: row[k] for k in ("fraction", "bytes_moved", "median_seconds")}
                                   for row in r.get("rows", [])], "errors": r["errors"]}), file=sys.stderr, flush=True)
    return {
        "fractions": list(opts.fractions),
        "steps_per_fraction": opts.steps,
        "change": "per step, per canonical tensor: round(numel * fraction) distinct elements (one at random in each "
                  "of that many equal strata, seeded by name and step, the same on every rank), lowest bit flipped",
        "full": {"bytes_moved": full["bytes_moved"], "median_seconds": full["median_seconds"],
                 "ceiling_bytes_per_s": full.get("ceiling_bytes_per_s"), "floor_seconds": full.get("floor_seconds")},
        "runs": runs,
        "verified": all(r.get("verified") for r in runs) and all(not r["errors"] for r in runs),
    }


__all__ = ["DEFAULT_FRACTIONS", "PREVIOUS", "DeltaOptions", "check_options", "changed_count", "positions", "toggle",
           "apply_step", "check_changed", "run_all", "run_delta", "p90"]
