"""The local-job runner: typed events from real processes, the first failure stopping everyone (and
what they started), silent deaths and the deadline reported in one line naming the participant.

The participants here are small functions of this module (no torch): each test costs a few
process start-ups."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from weightsync.local.events import Done, Failed, Participant, Ready, StepDone
from weightsync.local.runner import LocalJob, log_name

T0, T1, I0 = Participant.trainer(0), Participant.trainer(1), Participant.instance(0, "j")


def report_steps(emit, steps: int) -> None:
    emit(Ready(emit.participant))
    for s in range(1, steps + 1):
        emit(StepDone(emit.participant, s, seconds=0.01 * s, bytes=100 * s, exact=True, version=s))


def fail_after(emit, seconds: float) -> None:
    time.sleep(seconds)
    raise ValueError("bucket 3 of training rank 0 has shape (2, 3), the plan says (3, 2)\nsecond line")


def sleep_with_a_child(emit, seconds: float) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    emit(Ready(emit.participant))
    emit(StepDone(emit.participant, 0, 0.0, child.pid, None))  # its pid, for the test to look for
    time.sleep(seconds)


def die_silently(emit) -> None:
    emit.flush()
    os._exit(3)


def print_and_return(emit) -> None:
    print("hello from the participant", flush=True)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")  # a zombie waiting for init is gone too
    except FileNotFoundError:
        return True


def test_events_arrive_typed_and_every_participant_is_done():
    seen = []
    with LocalJob(deadline_s=60) as job:
        assert job.meta_url.startswith("http://127.0.0.1:")
        job.add(T0, report_steps, 2)
        job.add(I0, report_steps, 3)
        result = job.run(on_event=seen.append)
    assert result.ok and result.failure is None
    assert list(result.events) == seen
    assert {e.participant for e in result.of(Done)} == {T0, I0}
    done = [e for e in result.of(StepDone) if e.participant == I0]
    assert [(e.step, e.bytes, e.version) for e in done] == [(1, 100, 1), (2, 200, 2), (3, 300, 3)]
    # a participant's events arrive in the order it sent them, its Done last
    mine = [type(e).__name__ for e in result.events if e.participant == T0]
    assert mine == ["Ready", "StepDone", "StepDone", "Done"]


def test_first_failure_stops_everyone_and_what_they_started():
    start = time.monotonic()
    with LocalJob(deadline_s=120) as job:
        job.add(T0, fail_after, 1.0)
        job.add(I0, sleep_with_a_child, 100.0)
        result = job.run()
    assert time.monotonic() - start < 30  # not the sleeper's 100 s
    f = result.failure
    assert isinstance(f, Failed) and f.participant == T0 and f.kind == "ValueError", result.events
    assert "ValueError: bucket 3" in f.traceback and "fail_after" in f.traceback
    line = f.line()
    assert line == ("training rank 0: ValueError: bucket 3 of training rank 0 has shape (2, 3), the plan says (3, 2); "
                    "second line")
    child = [e.bytes for e in result.of(StepDone) if e.participant == I0]
    if child:  # the sleeper got as far as starting its child: killed with it
        deadline = time.monotonic() + 10
        while not _gone(child[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(child[0])
    assert not result.of(Done) or all(e.participant != I0 for e in result.of(Done))


def test_a_silent_death_is_reported_as_such():
    with LocalJob(deadline_s=60) as job:
        job.add(T0, die_silently)
        job.add(T1, report_steps, 1)
        result = job.run()
    f = result.failure
    assert f is not None and f.participant == T0 and f.kind == "ProcessDied", result.events
    assert "exited with code 3 before reporting" in f.message


def test_the_deadline_names_who_is_still_running():
    with LocalJob(deadline_s=3) as job:
        job.add(T0, report_steps, 1)
        job.add(I0, sleep_with_a_child, 100.0)
        result = job.run()
    f = result.failure
    assert f is not None and f.kind == "Timeout" and f.participant == I0, result.events
    assert "did not finish within 3 s; still running: instance 0 of j" in f.line()


def test_without_stop_on_failure_everyone_finishes():
    with LocalJob(deadline_s=60, stop_on_failure=False) as job:
        job.add(T0, fail_after, 0.0)
        job.add(T1, fail_after, 2.0)
        job.add(I0, report_steps, 1)
        result = job.run()
    assert result.failure is not None and result.failure.participant == T0
    assert [f.participant for f in result.failures] == [T0, T1]
    assert [e.participant for e in result.of(Done)] == [I0]


def test_logs_go_to_a_file_per_participant(tmp_path):
    with LocalJob(deadline_s=60, log_dir=str(tmp_path), stop_on_failure=False) as job:
        job.add(T0, print_and_return)
        job.add(I0, fail_after, 0.0)
        job.run()
    assert (tmp_path / "training-rank-0.log").read_text() == "hello from the participant\n"
    assert "ValueError: bucket 3" in (tmp_path / log_name(I0)).read_text()  # the traceback, not on the terminal
    assert log_name(I0) == "instance-0-of-j.log"


def test_a_failure_line_is_one_line_without_tracebacks():
    message = ("layout mismatch on vllm:tp=2 rank 1:\n  tensor a: live shape (2,), derived (3,)\n"
               "raised on rank 1 of vllm:tp=2; worker traceback:\n"
               "Traceback (most recent call last):\n  File \"x.py\"\n")
    line = Failed(I0, "LayoutMismatch", message).line()
    assert line == ("instance 0 of j: LayoutMismatch: layout mismatch on vllm:tp=2 rank 1: tensor a: live shape (2,), "
                    "derived (3,); raised on rank 1 of vllm:tp=2")
    long = Failed(T1, "X", "y" * 1000).line()
    assert "\n" not in long and len(long) < 450 and long.endswith(" ...")


def test_a_participant_added_twice_is_refused():
    with LocalJob(deadline_s=1) as job:
        job.add(T0, report_steps, 1)
        with pytest.raises(ValueError, match="training rank 0 added twice"):
            job.add(T0, report_steps, 1)
