"""The project's chaos soak (``weightsync soak``), short: a real MetaServer process (restarted from its store), two
FSDP2 training ranks over gloo and two layout-faithful ``vllm:tp=2`` instances (one staged) over the file
transport, each a process of the local runner; one fault at a time, every kind of participant in turn
(``order="cycle"``: a training rank, a reader, a reader's worker and the MetaServer SIGKILLed, then SIGSTOPped),
each restarted as a user would. The readers check every version they report against the step's weights bit
for bit, and the version they still claim after every failed update. Five faults (each kind of participant
killed, then a training rank stopped), about a minute once the job is up; the 20-minute soak by hand is in
BENCHMARKS.md."""

from __future__ import annotations

import pytest

from weightsync.soak.config import SoakConfig
from weightsync.soak.driver import run

pytestmark = pytest.mark.timeout(600)


def test_short_soak_holds_the_invariant_and_recovers_from_every_fault(tmp_path):
    lines: list[str] = []
    cfg = SoakConfig(seconds=240.0, faults=5, seed=7, readers=2, fault_gap_s=1.0, order="cycle", stop_s=(1.0, 3.0),
                     workdir=str(tmp_path))
    report = run(cfg, out=lines.append)
    said = "\n".join(lines + report.lines())
    assert not report.violations, said
    kinds = {f.kind for f in report.faults}
    # the cycle: a kill of each kind of participant, then a stop
    assert {"kill trainer", "kill reader", "kill worker", "kill meta", "stop trainer"} == kinds, said
    assert report.recovered == len(report.faults), said  # every fault recovered from
    assert report.ok, said
    # the job moved and every hold was checked bit for bit; restarts happened as the faults asked
    assert report.holds > 0 and report.exact_holds == report.holds, said
    assert report.restarts["trainer group"] >= 1 and report.restarts["reader"] >= 2 and report.restarts["meta"] >= 1, said
    # a worker's death is reported by weightsync at once (the instance shuts down), not after a timeout
    worker = [f for f in report.faults if f.kind == "kill worker"]
    assert all(f.detect_s is not None and f.detect_s < 5.0 for f in worker), said
