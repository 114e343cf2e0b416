"""tests/reaper.py: what a test process started dies with it, even when the test process is SIGKILLed."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import reaper

HERE = Path(__file__).resolve().parent

# A stand-in for a test process: it starts its reaper as tests/conftest.py does, then what engines are made of:
# a plain child, one in a session of its own (the launchers' start_new_session), and a child forked without
# exec (multiprocessing's fork: no tag in its environment) with a forked child of its own (an engine's workers).
TEST_PROCESS = r"""
import os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import reaper
reaper.start(state=sys.argv[2])
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
plain = subprocess.Popen(sleep)
own_session = subprocess.Popen(sleep, start_new_session=True)
r, w = os.pipe()
forked = os.fork()
if forked == 0:
    if os.fork() == 0:
        time.sleep(600)
        os._exit(0)
    os.close(r)
    os.write(w, b"x")
    time.sleep(600)
    os._exit(0)
os.close(w)
os.read(r, 1)
print(plain.pid, own_session.pid, forked, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    st = reaper._stat(pid)
    return st is not None and st[4] != "Z"  # an orphan killed is a zombie until init reaps it


def _children_of(pid: int) -> set[int]:
    return {p for p in reaper._pids() if (st := reaper._stat(p)) is not None and st[0] == pid}


def test_a_killed_test_process_leaves_nothing_running(tmp_path):
    """SIGKILL a test process: within seconds every process it started is gone, the one in its own session
    and the fork-only ones too; a process that only shares its process group (``tee`` in ``pytest | tee``)
    is left alone."""
    state = tmp_path / "kept"
    proc = subprocess.Popen([sys.executable, "-c", TEST_PROCESS, str(HERE), str(state)], stdout=subprocess.PIPE,
                            text=True, process_group=0)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], process_group=proc.pid)
    left: set[int] = set()
    try:
        left = {int(p) for p in proc.stdout.readline().split()}
        assert len(left) == 3, "the test process did not start its children"
        deadline = time.monotonic() + 60
        while True:  # its forked grandchild too, and the watchdog saw them all
            left |= {c for p in left for c in _children_of(p)}
            kept = set(map(int, state.read_text().split())) if state.exists() else set()
            if len(left) >= 4 and left <= kept:
                break
            assert time.monotonic() < deadline, f"the watchdog keeps {kept}, not all of {left}"
            time.sleep(0.05)
        assert all(_alive(p) for p in left)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in left) and time.monotonic() < deadline:
            time.sleep(0.05)
        survivors = {p: open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:80] for p in left if _alive(p)}
        assert not survivors, f"left running after their test process was killed: {survivors}"
        assert bystander.poll() is None, "a process only sharing the test process's group was killed"
    finally:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for p in (proc, bystander):
            p.kill()
            p.wait()


def test_this_test_process_has_a_reaper():
    """tests/conftest.py starts a watchdog in every process that runs tests (each xdist worker)."""
    if os.environ.get("WEIGHTSYNC_TEST_REAPER") == "0":
        pytest.skip("WEIGHTSYNC_TEST_REAPER=0 turned the reaper off")
    pid = reaper.watchdog()
    assert pid is not None and reaper._stat(pid)[0] == os.getpid()
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert b"reaper.py" in f.read()
