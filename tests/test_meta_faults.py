"""The MetaServer faults of issue 15, each over real HTTP (and real processes where the fault needs one):
deep JSON, failed saves, step bookkeeping, deadlines against a hung server, slow clients, token rules,
kill -9 mid-write, the CLI without torch."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from weightsync.errors import WeightSyncError
from weightsync.meta import MetaAborted, MetaClient, MetaError, MetaServer, MetaTimeout, MetaUnavailable
from weightsync.meta.client import DEADLINE_MARGIN_S
from weightsync.meta.records import digest_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spawn(*args: str, env: dict | None = None, preexec=None) -> tuple[subprocess.Popen, str]:
    """``python -m weightsync meta-server ARGS`` in its own process; (process, url)."""
    proc = subprocess.Popen([sys.executable, "-m", "weightsync", "meta-server", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    line = proc.stdout.readline()
    m = re.search(r"listening on (http://\S+)", line)
    if not m:
        proc.kill()
        raise AssertionError((line, proc.communicate(timeout=5)))
    return proc, m.group(1)


def finish(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    proc.communicate(timeout=10)


def post(url: str, path: str, body: bytes) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# --------------------------------------------------------------------------------------------
# Bounded inputs


def test_deeply_nested_model_config_is_refused_and_saves_go_on(tmp_path):
    """Before: depth ~980 was stored, then every save raised RecursionError and every mutation answered 500."""
    with MetaServer(state_path=str(tmp_path / "s.db")).start() as s:
        deep = b'{"a": ' * 980 + b"1" + b"}" * 980  # json.dumps itself cannot write this
        body = b'{"role": "train", "rank": 0, "model_config": {"rope": ' + deep + b"}}"
        status, answer = post(s.url, "/v1/jobs/j/participants", body)
        assert status == 400 and "deeper than" in answer["error"], answer
        for text in (b'{"role": "train", "rank": 0, "model_config": {"x": 1e999}}',  # inf: not JSON to send back
                     b'{"role": "train", "rank": 0, "host": ' + b"[" * 40 + b"]" * 40 + b"}"):
            assert post(s.url, "/v1/jobs/j/participants", text)[0] == 400
        c = MetaClient(s.url, "j", timeout=5)
        ok = {"rope_scaling": {"type": "yarn", "factor": 4.0}, "layers": [[1, 2], [3]]}
        assert c.register("train", 0, model_config=ok)["created"] is True
        c.join(0)
        assert c.summary()["instances"] == [0] and c.participants()[0].config_digest == digest_of(ok)


# --------------------------------------------------------------------------------------------
# Failed saves


def _limit_file_size(limit: int):
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


def test_a_failed_save_is_never_acknowledged_and_wakes_nobody(tmp_path):
    """A real failing write (the process's file size limit: EFBIG, as a full disk gives ENOSPC): the
    request answers 500, its identical retry answers 500 again (before: 200 "created": false, never
    saved), a waiter is not woken, and after a restart exactly the acknowledged registrations are there."""
    state = str(tmp_path / "s.db")
    proc, url = spawn("--port", "0", "--state", state, preexec=_limit_file_size(400_000))
    acknowledged, refused = [], None
    try:
        c = MetaClient(url, "j", timeout=5)
        big = {f"k{i}": "v" * 50 for i in range(1000)}  # ~60 KB a registration
        with ThreadPoolExecutor(1) as pool:
            waiter = pool.submit(c.wait_participants, 100, None, 4.0)
            for rank in range(40):
                try:
                    c.register("train", rank, model_config=dict(big, rank=rank))  # one config each: kept each
                    acknowledged.append(rank)
                except MetaError as e:
                    assert e.status == 500 and "not saved" in str(e), e
                    refused = rank
                    break
            assert refused is not None and acknowledged, "the size limit never bit"
            for _ in range(2):  # the retry is not acknowledged either
                with pytest.raises(MetaError, match="not saved") as e:
                    c.register("train", refused, model_config=big)
                assert e.value.status == 500
            assert [p.rank for p in c.participants()] == acknowledged  # memory holds what is saved
            with pytest.raises(MetaTimeout):
                waiter.result(timeout=10)
    finally:
        finish(proc)
    proc, url = spawn("--port", "0", "--state", state)
    try:
        assert [p.rank for p in MetaClient(url, "j", timeout=5).participants()] == acknowledged
    finally:
        finish(proc)


# --------------------------------------------------------------------------------------------
# Steps


def test_held_only_for_a_written_step(monkeypatch):
    import weightsync.meta.state as state

    monkeypatch.setattr(state, "HELD_WAITS_FOR_WRITTEN_S", 0.5)
    with MetaServer().start() as s, ThreadPoolExecutor(2) as pool:
        c = MetaClient(s.url, "j", timeout=5)
        c.register("train", 0)
        c.join(0)
        t0 = time.monotonic()
        with pytest.raises(MetaError, match="no training rank of job j has written it") as e:
            c.held(0, 1)  # before: accepted, and a writer's wait_held(1) returned on this lie
        assert e.value.status == 409 and 0.4 < time.monotonic() - t0 < 2
        lie = pool.submit(c.wait_held, 1, None, 0.5)
        with pytest.raises(MetaTimeout):
            lie.result(timeout=5)
        # the receive and the trainers' `written` post race: a `held` a moment early waits for it
        early = pool.submit(c.held, 0, 1)
        time.sleep(0.1)
        assert not early.done()
        c.written(1, 0)
        assert early.result(timeout=5) == {"instance": 0, "step": 1, "previous": None}
        assert c.wait_held(1, timeout=1) == {0: 1}


def test_steps_cannot_jump_and_a_dropped_step_is_never_answered_2xx():
    from weightsync.meta.validate import STEP_STRIDE, STEPS_KEPT

    with MetaServer().start() as s:
        c = MetaClient(s.url, "j", timeout=5)
        c.register("train", 0)
        c.register("train", 1)
        for huge in ((1 << 63) - 1, STEP_STRIDE):
            with pytest.raises(MetaError, match="jumps more than") as e:
                c.written(huge, 0)  # before: evicted the whole window
            assert e.value.status == 409
        for step in range(100, 100 + STEPS_KEPT):
            c.written(step, 0)
        with pytest.raises(MetaError, match="would be dropped at once") as e:
            c.written(50, 0)  # before: 200, and the record dropped at once
        assert e.value.status == 410
        with pytest.raises(MetaTimeout):
            c.wait_written(50, timeout=0)  # never written, and never will be
        c.written(100 + STEPS_KEPT, 0)  # a new step moves the window: step 100 goes
        with pytest.raises(MetaError, match="older than the steps kept") as e:
            c.written(100, 1)
        assert e.value.status == 410
        c.written(101, 1)
        assert c.wait_written(101, timeout=1) == [0, 1]
        c.written(102, 1)  # else the stride below would push out train:1's latest step (test_meta_security)
        assert c.written(100 + STEPS_KEPT + STEP_STRIDE, 0)["ranks"] == 1  # a big but bounded stride is fine


# --------------------------------------------------------------------------------------------
# Deadlines


def test_every_call_returns_within_its_timeout_when_the_server_hangs(tmp_path):
    """SIGSTOP: the kernel still accepts connections, nothing answers. Before: timeout=3 returned after
    20 s (reused connection), 10 s (fresh) and 13 s (wait_held)."""
    proc, url = spawn("--port", "0", "--state", str(tmp_path / "s.db"))
    try:
        warm = MetaClient(url, "j", timeout=1.5)
        warm.join(0)  # this thread's connection is kept alive, then reused while the server hangs
        proc.send_signal(signal.SIGSTOP)
        calls = [("reused", lambda: warm.join(1)), ("fresh", lambda: MetaClient(url, "j", timeout=1.5).join(1)),
                 ("wait_held", lambda: MetaClient(url, "j", timeout=30).wait_held(1, timeout=1.5)),
                 ("wait_participants", lambda: warm.wait_participants(5, timeout=1.5))]
        for name, call in calls:
            t0 = time.monotonic()
            with pytest.raises(MetaUnavailable):
                call()
            took = time.monotonic() - t0
            assert 1.4 < took < 1.5 + DEADLINE_MARGIN_S + 0.3, (name, took)
    finally:
        finish(proc)


def test_slow_clients_are_cut_off(monkeypatch):
    """Headers trickled a byte at a time, or a body that never ends, hold nothing past the deadlines
    (before: a thread each, for as long as the client liked)."""
    import weightsync.meta.server as meta_server

    monkeypatch.setattr(meta_server, "KEEPALIVE_S", 0.6)
    monkeypatch.setattr(meta_server, "REQUEST_DEADLINE_S", 0.6)
    with MetaServer().start() as s:
        with socket.create_connection(("127.0.0.1", s.port), timeout=5) as sock:
            t0, closed = time.monotonic(), False
            for b in b"GET /v1/jobs/j HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                try:
                    sock.send(bytes([b]))
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                if closed or _closed(sock):
                    break
                time.sleep(0.1)
            assert _closed(sock) or closed, "a client trickling its headers was never cut off"
            assert time.monotonic() - t0 < 2.0
        with socket.create_connection(("127.0.0.1", s.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/jobs/j/instances/0/join HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            t0 = time.monotonic()
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 2.0, answer
        assert MetaClient(s.url, "j", timeout=5).health()["status"] == "ok"


def _readable(sock: socket.socket) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])


def _closed(sock: socket.socket) -> bool:
    if not _readable(sock):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, ConnectionResetError):
        return True


# --------------------------------------------------------------------------------------------
# Tokens


def test_token_rules(tmp_path):
    with pytest.raises(WeightSyncError, match="without a token"):
        MetaServer(host="0.0.0.0")  # before: a warning, then served anyone
    with pytest.raises(WeightSyncError, match="token is empty"):
        MetaServer(token="")  # before: "without a token", then required "Bearer "
    with pytest.raises(ValueError, match="token is empty"):
        MetaClient("http://127.0.0.1:1", "j", token="")
    for args in (["--host", "0.0.0.0"], ["--token", ""]):
        out = subprocess.run([sys.executable, "-m", "weightsync", "meta-server", "--port", "0", *args], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "token" in out.stderr and "listening" not in out.stdout, out
    with MetaServer(host="127.0.0.2").start() as s:  # loopback, any address of it: no token needed
        assert MetaClient(s.url, "j", timeout=5).health()["status"] == "ok"


# --------------------------------------------------------------------------------------------
# Crashes, restarts, the command line


def test_kill_9_mid_writes_keeps_every_acknowledged_write(tmp_path):
    """64 ranks post as fast as they can while the server is killed: every answered post is in the
    state after the restart, nothing else is left beside it, and the format-1 temp files are reclaimed."""
    state = tmp_path / "s.db"
    (tmp_path / ".meta-state.abc123").write_text("{")  # what the format-1 server left after a kill
    proc, url = spawn("--port", "0", "--state", str(state))
    acked: set[tuple[int, int]] = set()
    lock = threading.Lock()
    try:
        setup = MetaClient(url, "j", timeout=5)
        for r in range(64):
            setup.register("train", r)
        assert not (tmp_path / ".meta-state.abc123").exists()

        def rank(r: int) -> None:
            c = MetaClient(url, "j", timeout=0.5)
            for step in range(1000):
                try:
                    c.written(step, r)
                except MetaError:
                    return
                with lock:
                    acked.add((step, r))

        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(rank, r) for r in range(64)]
            time.sleep(0.8)
            proc.send_signal(signal.SIGKILL)
            for f in futures:
                f.result(timeout=30)
    finally:
        finish(proc)
    assert len(acked) > 64
    proc, url = spawn("--port", "0", "--state", str(state))
    try:
        written = MetaClient(url, "j", timeout=5).summary()["written"]
        saved = {(int(s), r) for s, rs in written.items() for r in rs}
        floor = min(int(s) for s in written)
        assert {a for a in acked if a[0] >= floor} <= saved
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        finish(proc)
    assert sorted(os.listdir(tmp_path)) == ["s.db"]  # a clean stop leaves no -wal, -shm or temp file


def test_cli_runs_without_torch(tmp_path):
    """``weightsync meta-server`` on a host without torch: an importable ``torch`` that raises proves it."""
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('the MetaServer imported torch')\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{REPO}")
    proc, url = spawn("--port", "0", "--state", str(tmp_path / "s.db"), env=env)
    try:
        c = MetaClient(url, "j", timeout=5)
        c.join(0)
        assert c.summary()["instances"] == [0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        finish(proc)


def test_a_format_1_state_file_is_imported(tmp_path):
    path = tmp_path / "state.json"
    job = {"participants": {"train:0": {"role": "train", "rank": 0, "instance": None, "host": "", "gpu": None,
                                        "layout_digest": "", "address": "a:1", "version": "", "spec_digest": "",
                                        "engine_config": {}, "model_config": {}}},
           "plan_hashes": {}, "instances": [0], "topology_version": 1, "written": {"3": [0]}, "written_floor": 0,
           "held": {"0": 3}, "rendezvous": {"pg": "h:1"}, "aborted": None}
    path.write_text(json.dumps({"format": 1, "jobs": {"j": job}}))
    with MetaServer(state_path=str(path)).start() as s:
        c = MetaClient(s.url, "j", timeout=5)
        summary = c.summary()
        assert summary["held"] == {"0": 3} and summary["complete_step"] == 3 and c.lookup("pg", timeout=0) == "h:1"
        with pytest.raises(MetaError, match="goes back"):
            c.held(0, 2)
    assert (tmp_path / "state.json.v1.json").exists()
    with MetaServer(state_path=str(path)).start() as s:  # now a database: opened as one
        assert MetaClient(s.url, "j", timeout=5).participants()[0].address == "a:1"


def test_aborted_job_wakes_a_thousand_waiters_at_once():
    """Long-polls are futures on the loop: 1,000 waiting threads' polls all end on one abort."""
    with MetaServer().start() as s:
        c = MetaClient(s.url, "j", timeout=10)
        c.join(0)
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                MetaClient(s.url, "j", timeout=10).wait_held(1)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=wait) for _ in range(200)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while 'weightsync_meta_waiting{route="held"} 200' not in c.metrics():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        c.abort("trainer 7 died")
        for t in threads:
            t.join(timeout=10)
        assert time.monotonic() - t0 < 3
        assert len(errors) == 200 and all(isinstance(e, MetaAborted) for e in errors)
