"""The project's chaos soak (``weightsync soak``), short: a real MetaServer process (restarted from its store), two
FSDP2 training ranks over gloo and two layout-faithful ``vllm:tp=2`` instances (one staged) over the file
transport, each a process of the local runner; one fault at a time, every kind in turn (``order="cycle"``): a
training rank, a reader, a reader's worker and the MetaServer SIGKILLed; a storm of bad requests at the MetaServer;
the file transport's directory squatted while a reader restarts into it; another user's weight files planted where
the readers look; a training step longer than ``timeout_s``; a training rank SIGSTOPped. Each restarted as a user
would. The readers check every version they report against the step's weights bit for bit, and the version they
still claim after every failed update; each storm, squat, plant and slow step is checked as designed
(:mod:`weightsync.soak.plays`). Nine faults, about a minute and a half once the job is up; the 20-minute soak by
hand is in BENCHMARKS.md.

The parts of those four plays are tested on their own below, each against what it must refuse and what it must
report when the thing it checks is not there: a server without a token, a server slower than its header deadline,
the ownership check off."""

from __future__ import annotations

import os
import secrets
import time

import pytest

from weightsync.errors import ConfigError, TransportError
from weightsync.layout.box import slices
from weightsync.meta.auth import job_token
from weightsync.meta.client import MetaClient
from weightsync.meta.server import ConnectionLimits, MetaServer
from weightsync.soak.config import SoakConfig
from weightsync.soak.driver import run
from weightsync.soak.plays import give_back, plant_files, take_over
from weightsync.soak.storm import SLOW_GRACE_S, Storm
from weightsync.transport.file import FileTransport

pytestmark = pytest.mark.timeout(600)


def test_short_soak_holds_the_invariant_and_recovers_from_every_fault(tmp_path):
    lines: list[str] = []
    cfg = SoakConfig(seconds=240.0, faults=9, seed=7, readers=2, fault_gap_s=1.0, order="cycle", stop_s=(1.0, 3.0),
                     actions=("kill", "storm", "squat", "plant", "slow", "stop"), workdir=str(tmp_path))
    report = run(cfg, out=lines.append)
    said = "\n".join(lines + report.lines())
    assert not report.violations, said
    kinds = [f.kind for f in report.faults]
    # the cycle: a kill of each kind of participant, the four plays, then a stop
    assert kinds == ["kill trainer", "kill reader", "kill worker", "kill meta", "storm meta", "squat files",
                     "plant files", "slow trainer", "stop trainer"], said
    assert not report.mishandled, said  # each play as designed (weightsync.soak.plays)
    assert report.recovered == len(report.faults), said  # every fault recovered from
    assert report.ok, said
    # the job moved and every hold was checked bit for bit; restarts happened as the faults asked
    assert report.holds > 0 and report.exact_holds == report.holds, said
    assert report.restarts["trainer group"] >= 1 and report.restarts["reader"] >= 3 and report.restarts["meta"] >= 1, said
    # a worker's death is reported by weightsync at once (the instance shuts down), not after a timeout
    worker = [f for f in report.faults if f.kind == "kill worker"]
    assert all(f.detect_s is not None and f.detect_s < 5.0 for f in worker), said
    by = {f.kind: f for f in report.faults}
    # the storm and the slow step went unnoticed by every participant; the squat and the plant were refused by name
    storm, slow = by["storm meta"], by["slow trainer"]
    assert storm.detected_at is None and "401" in storm.notes and "403" in storm.notes, said
    assert slow.detected_at is None and slow.until - slow.at > cfg.timeout_s, said
    squat, plant = by["squat files"], by["plant files"]  # (the first failure noticed may be a trainer's drop)
    assert "refusal(s); first: instance" in squat.notes and "file transport's directory" in squat.notes, said
    assert "refused" in plant.notes and "by instance(s) [0, 1]" in plant.notes, said  # each reader, by name


# -- the plays' parts ----------------------------------------------------------------------------------


def _storm(url: str, admin: str, **kw) -> Storm:
    from weightsync.spec import load_spec

    return Storm(url, "soak", admin, job_token(admin, "soak"), dict(load_spec("tiny-qwen3").config), **kw)


def _blow(storm: Storm, at_least_s: float) -> None:
    storm.start()
    t0 = time.monotonic()
    while not storm.slow_done() or time.monotonic() - t0 < at_least_s:
        time.sleep(0.05)
    storm.stop()


def test_a_storm_of_bad_requests_is_refused_and_changes_nothing():
    """Every probe of the storm against a real MetaServer with a token: each answered with its refusal (401, 403,
    400, 413 or closed), the slowloris's connections closed at the header deadline, and the job as it was."""
    admin = secrets.token_hex(16)
    with MetaServer(token=admin, limits=ConnectionLimits(header_s=1.0)).start() as s:
        c = MetaClient(s.url, "soak", token=job_token(admin, "soak"), timeout=10)
        c.register("train", 0)
        c.join(0)
        before = c.summary()
        storm = _storm(s.url, admin, slow=4, header_s=1.0)
        _blow(storm, 1.0)
        assert not storm.problems, storm.problems
        for probe in storm.probes:
            got = storm.counts[probe.name]
            assert sum(got.values()) >= 1 and set(got) <= probe.refused, (probe.name, got)
        assert len(storm.slow_closed_s) == 4 and max(storm.slow_closed_s) < 1.0 + SLOW_GRACE_S, storm.slow_closed_s
        after = c.summary()
        # not aborted, instance 0 still joined, no participant registered by the config bomb
        assert after.get("aborted") is None and after["members"] == before["members"], (before, after)
        assert [p.name for p in c.participants()] == ["train:0"]


def test_a_storm_reports_what_the_server_does_not_refuse():
    """The storm's check can fail: a server without a token answers the requests that carry none (404, 200: not
    refused), and one whose header deadline is longer than the storm expects holds its slowloris connections."""
    with MetaServer().start() as s:  # no token: nothing is refused for its token
        storm = _storm(s.url, secrets.token_hex(16), slow=2, header_s=0.5)  # the server's deadline is 5 s
        _blow(storm, 0.5)
    said = "\n".join(storm.problems)
    assert "no token: answered" in said and "wrong admin token: abort the job: answered" in said, said
    assert "slowloris: the server still held 2 of 2 connections" in said, said


def test_a_squatted_directory_is_refused_and_given_back(tmp_path):
    """take_over makes the directory another user's (as root: owned by nobody, 0777; else 0777): the file transport
    refuses it by name; give_back restores its owner and mode, and the transport takes it again."""
    d = tmp_path / "files"
    FileTransport(d)
    st = os.stat(d)
    was = take_over(str(d))
    try:
        with pytest.raises(ConfigError, match="file transport's directory .* is (owned by uid 65534|writable by)"):
            FileTransport(d)
    finally:
        give_back(str(d), was)
    now = os.stat(d)
    assert (now.st_uid, now.st_gid, now.st_mode) == (st.st_uid, st.st_gid, st.st_mode)
    FileTransport(d)


def test_planted_files_are_refused_by_name_and_would_land_if_read(tmp_path, monkeypatch):
    """plant_files writes, at every name a reader of the soak's job waits for, a well-formed file of the step planned
    as the trainers plan it, holding weights that are not the step's, and another user's: each reader rank refuses
    it by name, nothing landed. With the ownership check off, the same files land whole -- another user's
    weights, not the step's, which is what the check keeps out."""
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import scatter
    from weightsync.plan.job import JobShape
    from weightsync.spec import load_spec
    from weightsync.soak.config import step_weights
    from weightsync.soak.plays import planted_weights
    from weightsync.testing import differences
    from weightsync.transport import file as file_mod

    cfg = SoakConfig(workdir=str(tmp_path))
    d = str(tmp_path / "files")
    FileTransport(d)  # the job's directory, the driver's
    planted = plant_files(cfg, d, str(tmp_path / "planted"), 3)
    assert planted and all(os.stat(p).st_uid != os.geteuid() or os.stat(p).st_mode & 0o022 for p, _ in planted)
    spec = load_spec(cfg.model)
    src, dst = make_layout(spec, cfg.train), make_layout(spec, cfg.infer)
    shape = JobShape(cfg.train, cfg.infer, src.world_size, dst.world_size, 1, False, 64 << 10, transport="file",
                     elastic=True)
    planner = shape.planner(spec, instances=1)
    theirs, ours = planted_weights(cfg, spec, 3), step_weights(cfg, spec, 3)
    for rank in range(dst.world_size):
        layout = dst.layout(rank)
        tensors = {name: t.fill_(float("nan")) for name, t in scatter(layout, theirs).items()}  # shaped, NaN
        receiver = FileTransport(d, timeout_s=2.0, consume=False)
        with pytest.raises(TransportError, match="refused, not read"):
            receiver.recv(planner.recv_plan(0, rank), tensors, step=3)
        assert not receiver.landed and all(t.isnan().all() for t in tensors.values())
        monkeypatch.setattr(file_mod, "check_own_file", lambda path: None)  # the ownership check off
        receiver.recv(planner.recv_plan(0, rank), tensors, step=3)
        monkeypatch.undo()
        assert not differences(layout, tensors, lambda p: theirs[p.canonical][slices(p.canon_box)])
        assert differences(layout, tensors, lambda p: ours[p.canonical][slices(p.canon_box)])  # not the step's
