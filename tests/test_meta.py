"""MetaServer and MetaClient over real HTTP on loopback: waits, conflicts, garbage, tokens, restarts."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.errors import JobMismatch, PlanError
from weightsync.meta import MetaAborted, MetaClient, MetaError, MetaServer, MetaTimeout
from weightsync.meta.proof import Proof
from weightsync.meta.records import LayoutInfo, Registration, SessionTerms
from weightsync.meta.server import MAX_BODY
from weightsync.meta.view import census, concerning, decode_placement, encode_placement, placement_of, sides_of
from weightsync.plan.topology import ELSEWHERE, Placement
from weightsync.runtime import job as setup

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def server(tmp_path):
    with MetaServer(state_path=str(tmp_path / "state.db")).start() as s:
        yield s


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as ex:
        yield ex


def client(s: MetaServer, job: str = "job1", **kw) -> MetaClient:
    return MetaClient(s.url, job, timeout=kw.pop("timeout", 5.0), **kw)


def later(delay: float, fn, *args, **kw) -> threading.Thread:
    """Run ``fn`` on another thread after ``delay``: the post that should wake a waiter."""
    t = threading.Thread(target=lambda: (time.sleep(delay), fn(*args, **kw)), daemon=True)
    t.start()
    return t


def raw(port: int, data: bytes) -> tuple[int, dict | str]:
    """Send bytes on a socket, return (status, JSON or text body) of the first answer. The bytes go from another
    thread while this one reads: a server that answers early and closes (a body over the limit) may break the
    pipe of a send still under way, and its answer must be read before the reset."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        def send() -> None:
            try:
                sock.sendall(data)
            except OSError:  # refused before the body was all sent: the answer says why
                pass
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        got = b""
        while b"\r\n\r\n" not in got and (chunk := sock.recv(65536)):
            got += chunk
        head, _, body = got.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *([0-9]+)", head).group(1))
        while len(body) < length and (chunk := sock.recv(65536)):
            body += chunk
        sender.join(5)
    status = int(head.split(b" ", 2)[1])
    if b"application/json" in head:
        return status, json.loads(body)
    return status, {"error": body.decode()}  # the HTTP parser's own refusals are plain text


def saved_rows(path) -> list[tuple]:
    """Every row of a MetaServer state database, read as a second process would (WAL included)."""
    import sqlite3

    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return sorted(db.execute("SELECT * FROM rows").fetchall()) + sorted(db.execute("SELECT * FROM written"))
    finally:
        db.close()


def http(s: MetaServer, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, JSON or text body) of one request, errors included."""
    req = urllib.request.Request(s.url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            status, data, ctype = r.status, r.read(), r.headers["Content-Type"]
    except urllib.error.HTTPError as e:
        status, data, ctype = e.code, e.read(), e.headers["Content-Type"]
    return status, json.loads(data) if ctype == "application/json" else data.decode()


# --------------------------------------------------------------------------------------------
# Participants


def test_register_and_wait(server, pool):
    c = client(server)
    waiter = pool.submit(c.wait_participants, 3, None, 5.0)
    time.sleep(0.1)
    assert not waiter.done()
    first = Registration("train", 0, host="h0", gpu="GPU-0", spec_digest="abc", layout=LayoutInfo("megatron:tp=2", 2))
    c.register(first)
    c.register("train", 1, host="h0", spec_digest="abc")
    later(0.1, c.register, "infer", 0, instance=0, address="10.0.0.1:5000", spec_digest="abc")
    got = waiter.result(timeout=5)
    assert [p.name for p in got] == ["infer:0:0", "train:0", "train:1"]
    assert got[1] == first and got[1].layout == LayoutInfo("megatron:tp=2", 2) and got[1].gpu == "GPU-0"
    assert [p.rank for p in c.participants("train")] == [0, 1]
    # Re-registering the same identity is idempotent; a new address replaces the record.
    again = c.register(first)
    assert again == {"name": "train:0", "created": False, "count": 3}
    c.register("train", 1, host="h0", spec_digest="abc", address="new:1")
    assert [p.address for p in c.participants("train")] == ["", "new:1"]
    with pytest.raises(MetaTimeout):
        c.wait_participants(2, role="infer", timeout=0.2)
    # a refused registration aborts the job: whoever waits learns it at once, with the same reason
    waiter = pool.submit(c.wait_participants, 4, None, 5.0)
    time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(MetaAborted, match="model spec zzz but .* has abc") as e:
        c.register("infer", 1, instance=0, spec_digest="zzz")
    assert e.value.status == 409
    with pytest.raises(MetaAborted, match="model spec zzz but .* has abc"):
        waiter.result(timeout=5)
    assert time.monotonic() - t0 < 1.0
    assert len(c.participants()) == 3  # a plain listing still answers: the refused one reads who differs


def test_model_refusal_names_the_first_differing_tensor_to_everyone(server, pool):
    """A registrant whose model differs (here: fewer KV heads, as a config edited to suit another TP
    would have) is refused, and the reason every participant receives -- the refused one's answer and
    the waiting peer's abort alike -- names the first differing tensor, its shape on each side, both
    participants, and what to do."""
    from weightsync.spec.model import spec_from_config

    cfg = json.load(open(os.path.join(os.path.dirname(__file__), "..", "weightsync", "spec", "presets",
                                      "qwen3-0.6b.json")))
    other = dict(cfg, num_key_value_heads=cfg["num_key_value_heads"] // 2)
    a, b = spec_from_config(cfg), spec_from_config(other)
    assert a.digest != b.digest
    c = client(server, "refused")
    c.register(Registration("train", 0, spec_digest=a.digest, model="qwen3-0.6b"), model_config=cfg)
    waiter = pool.submit(c.wait_participants, 2, None, 10.0)
    time.sleep(0.1)
    with pytest.raises(MetaAborted) as refused:
        c.register(Registration("infer", 0, 0, spec_digest=b.digest, model="qwen3-0.6b-kv4"), model_config=other)
    with pytest.raises(MetaAborted) as peer:
        waiter.result(timeout=10)
    k = cfg["head_dim"] * cfg["num_key_value_heads"]
    h = cfg["hidden_size"]
    want = (f"the first tensor that differs is model.layers.0.self_attn.k_proj.weight: shape [{k // 2}, {h}], "
            f"dtype bfloat16 on inference rank 0 of instance 0 (qwen3-0.6b-kv4); shape [{k}, {h}], dtype bfloat16 on "
            f"training rank 0 (qwen3-0.6b): give every trainer and every instance the same model "
            f"(the same config.json)")
    for e in (refused.value, peer.value):
        assert want in str(e), str(e)
        assert (f"inference rank 0 of instance 0 (infer:0:0) has model spec {b.digest} but training rank 0 "
                f"(train:0) has {a.digest}") in str(e)
    assert c.summary()["aborted"] == str(refused.value).split(": ", 1)[1]


# --------------------------------------------------------------------------------------------
# Plan hashes


def test_plan_hash_mismatch_names_both_sides(server):
    c = client(server)
    c.register("train", 0)
    c.register("train", 1)
    c.register("infer", 0, instance=0)
    c.register("infer", 1, instance=0)
    c.post_plan_hashes("train", 0, {(0, 0, 0): "aa", (0, 0, 1): "bb"}, plan_hash="f0")
    check = c.check_plan_hashes()
    assert not check["complete"] and {p["waiting_for"] for p in check["pending"]} == {"infer:0:0", "infer:0:1"}
    c.post_plan_hashes("infer", 0, {(0, 0, 0): "aa", (1, 0, 0): "cc"}, instance=0, plan_hash="f0")
    c.post_plan_hashes("infer", 1, {(0, 0, 1): "b0"}, instance=0, plan_hash="f1")
    c.post_plan_hashes("train", 1, {(1, 0, 0): "cc"}, plan_hash="f0")
    check = c.check_plan_hashes()
    assert check["complete"] and not check["ok"] and not check["plan_hashes_agree"]
    assert check["compared"] == 3
    assert check["mismatches"] == [{"pair": [0, 0, 1], "train": "train:0", "train_hash": "bb",
                                    "infer": "infer:0:1", "infer_hash": "b0"}]
    # A pair the peer never planned is a mismatch with a null hash on the peer's side.
    c.post_plan_hashes("train", 1, {(1, 0, 0): "cc", (1, 0, 1): "dd"}, plan_hash="f0")
    missing = [m for m in c.check_plan_hashes()["mismatches"] if m["pair"] == [1, 0, 1]]
    assert missing == [{"pair": [1, 0, 1], "train": "train:1", "train_hash": "dd",
                        "infer": "infer:0:1", "infer_hash": None}]
    with pytest.raises(MetaError, match="not an end of"):
        c.post_plan_hashes("train", 0, {(1, 0, 0): "aa"})
    with pytest.raises(MetaError, match="not registered") as e:
        c.post_plan_hashes("train", 7, {(7, 0, 0): "aa"})
    assert e.value.status == 409


# --------------------------------------------------------------------------------------------
# Instances and steps


def test_instances_join_leave_version(server, pool):
    c = client(server)
    assert c.join(0)["version"] == 1
    assert c.join(1) == {"instance": 1, "changed": True, "version": 2, "instances": [0, 1]}
    assert c.join(1)["changed"] is False and c.instances()["version"] == 2  # idempotent: no new version
    waiter = pool.submit(c.wait_topology, 2, 5.0)
    later(0.1, c.leave, 0)
    assert waiter.result(timeout=5) == {"ready": True, "version": 3, "instances": [1]}
    assert c.leave(0)["changed"] is False
    t0 = time.monotonic()
    with pytest.raises(MetaTimeout):
        c.wait_topology(3, timeout=0.3)
    assert time.monotonic() - t0 < 1.5


def test_written_long_poll(server, pool):
    c = client(server)
    for r in range(3):
        c.register("train", r)
    c.written(5, 0)
    t0 = time.monotonic()
    with pytest.raises(MetaTimeout, match="not ready after 0.3"):
        c.wait_written(5, timeout=0.3)  # default: every registered training rank
    assert 0.3 <= time.monotonic() - t0 < 1.5
    assert c.wait_written(5, n=1, timeout=0.1) == [0]
    waiter = pool.submit(c.wait_written, 5, None, 5.0)
    c.written(5, 1)
    c.written(5, 1)  # a retried post changes nothing
    later(0.1, c.written, 5, 2)
    assert waiter.result(timeout=5) == [0, 1, 2]
    assert c.summary()["complete_step"] == 5
    with pytest.raises(MetaError, match="not registered"):
        c.written(6, 9)


def test_written_for_a_group_of_ranks(server, pool):
    """A trainer group's representative posts `written` once for its ranks (``ranks``); the one-rank
    form still answers as before, and a list with an unregistered rank changes nothing."""
    c = client(server)
    for r in range(4):
        c.register("train", r)
    waiter = pool.submit(c.wait_written, 3, None, 5.0)
    assert c.written(3, [0, 1, 2]) == {"step": 3, "ranks": 3}
    assert not waiter.done()
    with pytest.raises(MetaError, match=r"train:7 is not registered .*nor 1 more") as e:
        c.written(3, [3, 7, 9])
    assert e.value.status == 409 and c.summary()["written"]["3"] == [0, 1, 2]  # rank 3 not recorded either
    assert c.written(3, [2, 3]) == {"step": 3, "ranks": 4}  # a retry or an overlap changes nothing twice
    assert waiter.result(timeout=5) == [0, 1, 2, 3]
    assert c.written(4, 1) == {"step": 4, "ranks": 1}  # one rank, as old clients post
    assert c.summary()["written"]["4"] == [1]


def test_written_window(server):
    c = client(server)
    c.register("train", 0)
    for s in range(70):
        c.written(s, 0)
    with pytest.raises(MetaError, match="older than the steps kept") as e:
        c.wait_written(0, timeout=0.1)
    assert e.value.status == 410
    assert c.wait_written(69, timeout=0.1) == [0]


def test_held_long_poll(server, pool):
    c = client(server)
    with pytest.raises(MetaError, match="join first"):
        c.held(0, 1)
    c.join(0)
    c.join(1)
    c.register("train", 0)
    for step in (2, 3, 4):  # held needs the step written (a step nobody wrote is refused)
        c.written(step, 0)
    c.held(0, 3)
    t0 = time.monotonic()
    with pytest.raises(MetaTimeout):
        c.wait_held(3, timeout=0.3)  # default: every joined instance; 1 holds nothing yet
    assert time.monotonic() - t0 < 1.5
    assert c.wait_held(3, instances=[0], timeout=0.1) == {0: 3}
    waiter = pool.submit(c.wait_held, 3, None, 5.0)
    later(0.1, c.held, 1, 4)
    assert waiter.result(timeout=5) == {0: 3, 1: 4}
    # Monotonic per instance: going back is refused unless reset; the same step again is fine.
    c.held(1, 4)
    with pytest.raises(MetaError, match="goes back") as e:
        c.held(1, 2)
    assert e.value.status == 409
    assert c.held(1, 2, reset=True) == {"instance": 1, "step": 2, "previous": 4}
    # An instance that leaves no longer holds up the default wait.
    waiter = pool.submit(c.wait_held, 3, None, 5.0)
    later(0.1, c.leave, 1)
    assert waiter.result(timeout=5) == {0: 3}
    assert c.summary()["held"] == {"0": 3, "1": 2}


def test_a_rank_announces_a_step_and_waits_for_it_held_in_one_request(server, pool):
    """A sync step's per-rank signals: ``written`` with ``held`` records the step, then answers as the held
    long-poll does, so each training rank asks the server once a step (1,024 + 128: 1,280 requests a step,
    not 2,304)."""
    c = client(server)
    c.register("train", 0)
    c.register("train", 1)
    c.join(0)
    c.join(1)
    waiters = [pool.submit(c.written_until_held, 1, r, [0, 1], 5.0) for r in (0, 1)]
    assert c.wait_written(1, timeout=5) == [0, 1]  # recorded before the wait: the readers go on
    c.held(0, 1)
    c.held(1, 1)
    assert [w.result(timeout=5) for w in waiters] == [{0: 1, 1: 1}] * 2
    posts = re.search(r'requests_total\{route="POST /v1/jobs/\{job\}/steps/\{S\}/written",status="200"\} (\d+)',
                      c.metrics())
    assert int(posts.group(1)) == 2 and 'route="GET /v1/jobs/{job}/held"' not in c.metrics()
    # a wait past the first slice goes on as wait_held; past the deadline it says who holds what
    with pytest.raises(MetaTimeout, match="not ready after"):
        c.written_until_held(2, 0, [0, 1], timeout=0.3)
    assert c.wait_written(2, n=1, timeout=1) == [0]
    with pytest.raises(MetaError, match="held.instances must be a comma-separated list"):
        c._request("POST", "/v1/jobs/job1/steps/3/written", {"rank": 0, "held": {"instances": [0], "timeout": 1}})
    with pytest.raises(MetaError, match="held.timeout must be a number of seconds"):
        c._request("POST", "/v1/jobs/job1/steps/3/written", {"rank": 0, "held": {"timeout": 1e9}})


def test_the_server_runs_on_uvloop_where_it_is_installed(server, monkeypatch):
    """uvloop (a dependency where it installs) serves every request: ~10 % less server CPU a step at 1,024 + 128 than
    asyncio's loop (BENCHMARKS.md); ``WEIGHTSYNC_META_LOOP=asyncio`` asks for asyncio's, and it serves alike."""
    pytest.importorskip("uvloop")
    assert type(server._loop).__module__.startswith("uvloop"), type(server._loop)
    monkeypatch.setenv("WEIGHTSYNC_META_LOOP", "asyncio")
    with MetaServer().start() as plain:
        assert not type(plain._loop).__module__.startswith("uvloop"), type(plain._loop)
        assert client(plain).register("train", 0)


def test_rendezvous(server, pool):
    c = client(server)
    waiter = pool.submit(c.lookup, "pg-train-infer", 5.0)
    later(0.1, c.publish, "pg-train-infer", "10.0.0.1:29500")
    assert waiter.result(timeout=5) == "10.0.0.1:29500"
    assert c.publish("pg-train-infer", "10.0.0.1:29500")["changed"] is False
    with pytest.raises(MetaError, match="already holds"):
        c.publish("pg-train-infer", "10.0.0.2:29500")
    c.publish("pg-train-infer", "10.0.0.2:29500", replace=True)
    assert c.lookup("pg-train-infer", timeout=0) == "10.0.0.2:29500"
    with pytest.raises(MetaTimeout):
        c.lookup("other", timeout=0.2)


def test_abort_wakes_waiters(server, pool):
    c = client(server)
    c.register("train", 0)
    c.join(0)
    waiters = [pool.submit(c.wait_held, 1, None, 10.0), pool.submit(c.wait_written, 1, None, 10.0),
               pool.submit(c.lookup, "pg", 10.0)]
    other = pool.submit(client(server, "job2").wait_topology, 0, 1.0)  # another job's waiter is not woken
    time.sleep(0.2)
    t0 = time.monotonic()
    c.abort("train rank 3 died")
    for w in waiters:
        with pytest.raises(MetaAborted, match="train rank 3 died"):
            w.result(timeout=5)
    assert time.monotonic() - t0 < 2
    with pytest.raises(MetaTimeout):
        other.result(timeout=5)
    with pytest.raises(MetaAborted):
        c.held(0, 1)
    assert c.summary()["aborted"] == "train rank 3 died"
    c.delete_job()  # the id can be reused afterwards
    assert c.register("train", 0)["created"] is True


# --------------------------------------------------------------------------------------------
# Token


def test_token():
    with MetaServer(token="s3cret").start() as s:
        assert http(s, "GET", "/health") == (200, {"status": "ok", "version": "0.1.0"})
        bad = ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"Authorization": "Bearer s3cret2"})
        for headers in bad:
            status, body = http(s, "GET", "/v1/jobs/j/instances", headers=headers)
            assert status == 401 and "token" in body["error"]
            assert http(s, "GET", "/metrics", headers=headers)[0] == 401
            assert http(s, "POST", "/v1/jobs/j/instances/0/join", b"{}", headers)[0] == 401
        with pytest.raises(MetaError) as e:
            MetaClient(s.url, "j", timeout=2).join(0)
        assert e.value.status == 401
        good = MetaClient(s.url, "j", token="s3cret", timeout=2)
        assert good.join(0)["version"] == 1
        assert "weightsync_meta_jobs 1" in good.metrics()


# --------------------------------------------------------------------------------------------
# Garbage


OVERSIZED = b'{"role": "train", "rank": 0, "pad": "' + b"x" * (MAX_BODY + 10) + b'"}'  # refused before it is read
GARBAGE = [
    # raw bytes on the socket
    ("raw", b"\x00\xff\xfe garbage\r\n\r\n"),
    ("raw", b"GET /v1/jobs/j HTTP/2.0\r\n\r\n"),
    ("raw", b"BREW /v1/jobs/j HTTP/1.1\r\n\r\n"),
    ("raw", b"POST /v1/jobs/j/instances/0/join HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1)),
    ("raw", b"POST /v1/jobs/j/instances/0/join HTTP/1.1\r\nContent-Length: -5\r\n\r\n"),
    ("raw", b"POST /v1/jobs/j/instances/0/join HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"),
    ("raw", b"POST /v1/jobs/j/instances/0/join HTTP/1.1\r\nContent-Length: 10\r\n\r\n{}"),  # short body
    # bad JSON and wrong types
    ("POST", "/v1/jobs/j/participants", b"{not json"),
    ("POST", "/v1/jobs/j/participants", b"[1, 2]"),
    ("POST", "/v1/jobs/j/participants", b"\xff\xfe"),
    ("POST", "/v1/jobs/j/participants", b"[" * 100_000),
    ("POST", "/v1/jobs/j/participants", b'{"role": "train", "rank": NaN}'),
    ("POST", "/v1/jobs/j/participants", b'{"role": "train", "rank": -1}'),
    ("POST", "/v1/jobs/j/participants", b'{"role": "train", "rank": true}'),
    ("POST", "/v1/jobs/j/participants", b'{"role": "train", "rank": 1.5}'),
    ("POST", "/v1/jobs/j/participants", b'{"role": "train", "rank": "1"}'),
    ("POST", "/v1/jobs/j/participants", b'{"role": "boss", "rank": 0}'),
    ("POST", "/v1/jobs/j/participants", b'{"role": "train", "rank": 0, "extra": 1}'),
    ("POST", "/v1/jobs/j/participants", b'{"role": "train", "rank": 0, "instance": 0}'),
    ("POST", "/v1/jobs/j/participants", b'{"role": "infer", "rank": 0}'),
    ("POST", "/v1/jobs/j/participants", b'{"role": "train", "rank": 0, "host": "' + b"h" * 300 + b'"}'),
    ("POST", "/v1/jobs/j/participants", b'{"role": "train", "rank": 0, "layout": {"engine": [1], "world": 1}}'),
    ("POST", "/v1/jobs/j/participants", b'{"role": "train", "rank": 0, "terms": "tp=2"}'),
    ("POST", "/v1/jobs/j/participants", b'{"role": "train", "rank": 0, "engine_config": {"tp": 2}}'),
    ("raw", b"POST /v1/jobs/j/participants HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Content-Length: %d\r\n\r\n%s" % (len(OVERSIZED), OVERSIZED)),
    ("POST", "/v1/jobs/j/instances/0/held", b'{"step": 1.0}'),
    ("POST", "/v1/jobs/j/instances/0/held", b'{"step": 1, "reset": 1}'),
    ("POST", "/v1/jobs/j/steps/1/written", b'{"rank": -3}'),
    ("POST", "/v1/jobs/j/steps/1/written", b'{"rank": 0, "ranks": [0]}'),
    ("POST", "/v1/jobs/j/steps/1/written", b'{"ranks": []}'),
    ("POST", "/v1/jobs/j/steps/1/written", b'{"ranks": [0, 0]}'),
    ("POST", "/v1/jobs/j/steps/1/written", b'{"ranks": [0, true]}'),
    ("POST", "/v1/jobs/j/steps/1/written", b'{"ranks": 0}'),
    ("POST", "/v1/jobs/j/steps/1/written", b'{}'),
    ("POST", "/v1/jobs/j/abort", b'{"why": "x"}'),
    ("POST", "/v1/jobs/j/plan-hashes", b'{"role": "train", "rank": 0, "pairs": [[0, 0, 0, "not hex"]]}'),
    ("POST", "/v1/jobs/j/rendezvous/pg", b'{"address": 5}'),
    # bad ids and routes
    ("POST", "/v1/jobs/bad%2Fid/instances/0/join", b"{}"),
    ("POST", "/v1/jobs/" + "x" * 129 + "/instances/0/join", b"{}"),
    ("POST", "/v1/jobs/j/instances/-1/join", b"{}"),
    ("POST", "/v1/jobs/j/instances/one/join", b"{}"),
    ("POST", "/v1/jobs/j/steps/1.5/written", b'{"rank": 0}'),
    ("POST", "/v1/jobs/j/steps/abc/written", b'{"rank": 0}'),
    ("POST", "/v1/jobs/j/steps/99999999999999999999/written", b'{"rank": 0}'),
    ("POST", "/v1/jobs/j/rendezvous/a%20b", b'{"address": "x"}'),
    ("POST", "/v1/jobs/j/instances/0/explode", b"{}"),
    ("GET", "/v1/jobs/j/held?timeout=nan", None),
    ("GET", "/v1/jobs/j/held?timeout=1e9", None),
    ("GET", "/v1/jobs/j/held?min_step=-1", None),
    ("GET", "/v1/jobs/j/held?instances=0,x", None),
    ("GET", "/v1/jobs/j/held?surprise=1", None),
    ("GET", "/v1/jobs/j/held?timeout=1&timeout=2", None),
    ("GET", "/v1/jobs/j/participants?wait_for=abc", None),
    ("DELETE", "/v1/jobs/j/participants", None),
    ("GET", "/v1/jobs/nosuchjob", None),
]


def test_garbage_is_refused_and_changes_nothing(server, tmp_path, monkeypatch):
    import weightsync.meta.server as meta_server

    monkeypatch.setattr(meta_server, "REQUEST_DEADLINE_S", 0.5)  # the short body's wait
    c = client(server, "j")
    c.register("train", 0)
    c.join(1)
    before, rows_before = c.summary(), saved_rows(tmp_path / "state.db")
    for kind, *req in GARBAGE:
        if kind == "raw":
            status, body = raw(server.port, req[0])
        else:
            path, data = req
            status, body = http(server, kind, path, data)
        assert 400 <= status < 500, (kind, req, status, body)
        assert isinstance(body, dict) and body["error"], (kind, req, body)
    assert c.summary() == before
    assert saved_rows(tmp_path / "state.db") == rows_before
    assert c.health()["status"] == "ok"  # still serving


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids, max_size=3),
    max_leaves=5,
)
FIELDS = st.sampled_from(["role", "rank", "instance", "host", "gpu", "layout", "terms", "model_config", "x"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(FIELDS, JSON_VALUES))
def test_random_bodies_never_break_the_server(server, body):
    status, answer = http(server, "POST", "/v1/jobs/fuzz/participants", json.dumps(body).encode())
    assert status in (200, 400, 409), (body, status, answer)


# --------------------------------------------------------------------------------------------
# Metrics


def test_metrics_format(server):
    c = client(server)
    c.register("train", 0)
    c.join(0)
    c.written(7, 0)
    c.held(0, 7)
    with pytest.raises(MetaError):
        c.held(0, 3)
    http(server, "GET", "/nope")
    text = c.metrics()
    sample = re.compile(r'^[a-z_]+(\{([a-z_]+="[^"\\\n]*",?)+\})? -?[0-9.e+]+$')
    typed = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("counter", "gauge")
            typed.add(name)
        elif not line.startswith("# HELP "):
            assert sample.match(line), line
            assert line.split("{")[0].split(" ")[0] in typed, line
    assert 'weightsync_meta_requests_total{route="POST /v1/jobs/{job}/instances/{i}/held",status="200"} 1' in text
    assert 'weightsync_meta_requests_total{route="POST /v1/jobs/{job}/instances/{i}/held",status="409"} 1' in text
    assert 'weightsync_meta_requests_total{route="unmatched",status="404"} 1' in text
    assert 'weightsync_meta_participants{job="job1",role="train"} 1' in text
    assert 'weightsync_meta_step_held{job="job1",instance="0"} 7' in text
    assert 'weightsync_meta_step_complete{job="job1"} 7' in text
    assert "weightsync_meta_jobs 1" in text


def test_metrics_counts_waiting_long_polls(server, pool):
    c = client(server)
    waiter = pool.submit(c.wait_held, 1, [0], 5.0)
    deadline = time.monotonic() + 5
    while 'weightsync_meta_waiting{route="held"} 1' not in c.metrics():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    c.join(0)
    c.register("train", 0)
    c.written(1, 0)
    c.held(0, 1)
    assert waiter.result(timeout=5) == {0: 1}


# --------------------------------------------------------------------------------------------
# Restarts


def test_restart_mid_job_with_state(tmp_path, pool):
    path = str(tmp_path / "state.db")
    s = MetaServer(state_path=path).start()
    port = s.port
    c = MetaClient(s.url, "job", timeout=10)
    c.register("train", 0, address="a:1")
    c.join(0)
    c.join(1)
    c.written(2, 0)
    c.held(0, 2)
    c.publish("pg", "h:1")
    waiter = pool.submit(c.wait_held, 2, None, 10.0)  # waits for instance 1
    time.sleep(0.2)
    s.stop()  # the waiter's long-poll is answered 503 and it retries against a closed port
    time.sleep(0.3)
    with MetaServer(port=port, state_path=path).start() as s2:
        assert not waiter.done()
        c2 = MetaClient(s2.url, "job", timeout=5)
        summary = c2.summary()
        assert summary["instances"] == [0, 1] and summary["topology_version"] == 2
        assert summary["held"] == {"0": 2} and summary["complete_step"] == 2
        assert c2.participants()[0].address == "a:1" and c2.lookup("pg", timeout=0) == "h:1"
        c2.held(1, 2)
        assert waiter.result(timeout=10) == {0: 2, 1: 2}
        with pytest.raises(MetaError, match="goes back"):
            c2.held(0, 1)  # monotonicity survives the restart


def _spawn(port: int, state: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "weightsync.meta.server", "--port", str(port), "--state", state],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"listening on (http://\S+)", line)
    assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, m.group(1)


def test_subprocess_sigkill_mid_long_poll(tmp_path, pool):
    state = str(tmp_path / "state.db")
    proc, url = _spawn(0, state)
    port = int(url.rsplit(":", 1)[1])
    try:
        c = MetaClient(url, "job", timeout=10)
        c.register("train", 0)
        c.register("infer", 0, instance=0)
        c.join(0)
        c.written(4, 0)
        c.held(0, 4)
        waiter = pool.submit(c.wait_held, 5, None, 15.0)
        written = pool.submit(c.wait_written, 5, None, 15.0)
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=5)
        time.sleep(0.3)  # the waiters now retry against a dead port
        assert not waiter.done() and not written.done()
        proc, url2 = _spawn(port, state)
        assert url2 == url
        c2 = MetaClient(url, "job", timeout=5)
        assert c2.summary()["held"] == {"0": 4}
        c2.written(5, 0)
        c2.held(0, 5)
        assert waiter.result(timeout=15) == {0: 5}
        assert written.result(timeout=15) == [0]
    finally:
        proc.kill()
        proc.wait(timeout=5)
        for f in (proc.stdout, proc.stderr):
            f.close()


def test_broken_state_file_refuses_to_start(tmp_path):
    path = tmp_path / "state.db"
    path.write_text("{half a file")
    with pytest.raises(Exception, match="cannot read MetaServer state"):
        MetaServer(state_path=str(path)).start()


def test_requests_share_one_kept_alive_connection(server):
    c = MetaClient(server.url, "job")
    c.health()
    conn = c._local.conn
    c.register("train", 0, address="a:1")
    c.join(0)
    c.written(1, 0)
    c.held(0, 1)
    assert c._local.conn is conn and conn.sock is not None  # no reconnect between a step's requests
    with pytest.raises(MetaError, match="goes back"):
        c.held(0, 0)  # an error answer keeps the client usable
    assert c.summary()["held"] == {"0": 1}


def test_a_connection_closed_underneath_is_replaced_at_once(monkeypatch):
    import weightsync.meta.server as meta_server

    monkeypatch.setattr(meta_server, "KEEPALIVE_S", 0.2)  # the server drops idle connections fast
    with MetaServer().start() as server:
        c = MetaClient(server.url, "job", timeout=5)
        c.join(0)
        c.register("train", 0)
        for step in (3, 4):  # held needs the step written
            c.written(step, 0)
        time.sleep(0.6)  # the server has closed our kept-alive connection by now
        t0 = time.monotonic()
        c.held(0, 3)
        assert time.monotonic() - t0 < 1.0  # retried on a new connection without a backoff sleep
        c._local.conn.sock.close()  # and a socket closed on our side
        c.held(0, 4)
        assert c.summary()["held"] == {"0": 4}


@pytest.mark.parametrize("method", ["POST", "GET", "DELETE"])
def test_a_request_body_never_becomes_the_next_request(method):
    """A body is always read (a GET's or DELETE's too) or its connection closed (a request refused for its
    token: answered before its body is read): the request hidden in it never runs. Before, a GET's or
    DELETE's body was not read and ran as the next request."""
    with MetaServer(token="t0k").start() as server:
        good = MetaClient(server.url, "victim", token="t0k", timeout=5)
        good.join(0)
        inner = b"DELETE /v1/jobs/victim HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0k\r\n\r\n"
        for auth in (b"Bearer nope", b"Bearer t0k"):
            with socket.create_connection(("127.0.0.1", server.port)) as s:
                path = b"/v1/jobs/j/instances/0/held" if method == "POST" else b"/v1/jobs/other"
                s.sendall(method.encode() + b" " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: " + auth +
                          b"\r\nContent-Length: " + str(len(inner)).encode() + b"\r\n\r\n" + inner)
                s.settimeout(5)
                data = s.recv(65536)
                s.settimeout(0.3)  # no second answer follows (it would be the inner DELETE's)
                closed = False
                try:
                    while chunk := s.recv(65536):
                        data += chunk
                    closed = True
                except socket.timeout:
                    pass
            assert closed == (auth == b"Bearer nope"), (auth, data)  # refused: closed, its body unread
            assert data.count(b"HTTP/1.") == 1, data
            assert int(data.split(b" ", 2)[1]) in (400, 401, 404), data
        assert good.summary()["instances"] == [0]  # the victim job is still there


# --------------------------------------------------------------------------------------------
# Set-up downloads (weightsync.meta.view) and the plan's proof (weightsync.meta.proof): what concerns each
# participant, never a row for every participant; the plans cut placements give are those of the whole

SETUP_TERMS = SessionTerms(transport="p2p", mode="sync", colocate=False, bucket_bytes=1 << 28, integrity=1, codec="full")
ANSWER_BYTES = re.compile(r'weightsync_meta_answer_bytes_total\{route="([^"]+)"\} (\d+)')


def _job_people(trainers: int, instances: int, seed: int = 0) -> list[Registration]:
    """A job as real ones register: 8 ranks to a host, every GPU UUID random (gzip cannot shrink them)."""
    rng = random.Random(seed)

    def gpu() -> str:
        return f"GPU-{uuid.UUID(int=rng.getrandbits(128), version=4)}"

    train = [Registration("train", r, host=f"train-node{r // 8}", gpu=gpu(), version="v", model="qwen3-8b",
                          spec_digest="s" * 16, layout=LayoutInfo(f"megatron:tp=8,pp=4,dp={trainers // 32}", trainers,
                                                                  f"{r:016x}"), terms=SETUP_TERMS, backend="nccl",
                          address=f"10.0.{r // 256}.{r % 256}:29500") for r in range(trainers)]
    infer = [Registration("infer", 0, i, host=f"infer-node{i // 8}", gpu=gpu(), version="v", model="qwen3-8b",
                          spec_digest="s" * 16, layout=LayoutInfo("vllm:tp=1", 1, "0" * 16), terms=SETUP_TERMS,
                          instances=instances) for i in range(instances)]
    return train + infer


def _sent(c: MetaClient) -> int:
    """Answer bytes the server sent so far, every route but /metrics (the server counts them)."""
    return sum(int(n) for route, n in ANSWER_BYTES.findall(c.metrics()) if route != "GET /metrics")


def _downloads(trainers: int, instances: int) -> dict[str, int]:
    """Bytes a training rank and an instance download at set-up (as the runtime's agree step asks, every
    participant registered), and what the whole listing they downloaded before this change costs now."""
    with MetaServer().start() as s:
        c = MetaClient(s.url, "j", timeout=30)
        for p in _job_people(trainers, instances):
            c.register(p)
        out = {}
        for role, count, instance in (("train", trainers, None), ("infer", instances, instances - 1)):
            before = _sent(c)
            train, infer = setup.sides(c, role, count, 30)
            shape = setup.placed(c, setup.job_shape(train, infer, SETUP_TERMS), instance)
            assert shape.placement is not None and (train.count, infer.count) == (trainers, instances)
            out[role] = _sent(c) - before
        before = _sent(c)
        c.wait_participants(trainers, "train", timeout=5)
        c.wait_participants(instances, "infer", timeout=5)
        out["listings"] = _sent(c) - before
        return out


def test_a_participants_set_up_download_grows_only_with_what_its_plan_compares():
    """Before this change every participant downloaded both sides' listings, a row per participant (11.5 KB
    at 256 + 16 participants, 20.5 KB at 512 + 16, gzipped: the random GPU UUIDs are most of a row), so the
    job's set-up traffic grew as N x N. Now a training rank downloads each side's census (each distinct
    profile once) and every inference rank's place; an instance its own ranks' places: doubling the
    trainers changes neither download (1.5-1.7 KB each), while the listings they replaced nearly double."""
    small, large = _downloads(256, 16), _downloads(512, 16)
    assert large["listings"] > 1.6 * small["listings"], (small, large)  # what each participant got before
    for role in ("train", "infer"):
        assert large[role] <= small[role] + 64, (role, small, large)  # a count's digits, not a row a trainer
        assert large[role] < large["listings"] / 10, (role, large)
    # doubling the instances doubles what a training rank's plan compares (each instance's place), no more
    more = _downloads(256, 32)
    assert more["infer"] <= small["infer"] + 64 and more["train"] - small["train"] < 16 * 16, (small, more)


def test_a_census_names_who_disagrees_without_listing_everyone():
    people = _job_people(64, 8)
    odd = people[70]
    people[70] = Registration(odd.role, odd.rank, odd.instance, host=odd.host, gpu=odd.gpu, version="v",
                              model="qwen3-8b", spec_digest="s" * 16, layout=odd.layout,
                              terms=SessionTerms(**{**SETUP_TERMS.to_json(), "integrity": 5}), instances=8)
    train, infer = sides_of(people)
    assert (train.count, len(train.cohorts), infer.count, len(infer.cohorts)) == (64, 1, 8, 2)
    assert train.cohorts[0].names == ("train:0", "train:1", "train:10")  # name order, the first three
    with pytest.raises(JobMismatch, match=r"integrity cadence.*1: training rank 0, training rank 1, training rank 10 "
                                          r"\.\.\.; 5: inference rank 0 of instance 6"):
        setup.job_shape(train, infer, SETUP_TERMS)
    assert census(people).instances == 8 and census(people).last_instance == 7


def test_a_placement_travels_as_runs_and_a_cut_keeps_what_a_plan_compares():
    people = _job_people(64, 16)
    whole = placement_of([p for p in people if p.role == "train"], [p for p in people if p.role == "infer"])
    got = encode_placement(whole)
    assert len(got["placement"]["train"]) == 8 and decode_placement(got) == Placement(whole.train, whole.infer, 8)
    trainer = concerning(whole, 1)
    assert trainer.infer == whole.infer and set(trainer.train) == {ELSEWHERE}  # no trainer on an instance's host
    mine = concerning(whole, 1, instance=3)
    assert [w != ELSEWHERE for w in mine.infer] == [i == 3 for i in range(16)] and set(mine.train) == {ELSEWHERE}
    assert decode_placement(encode_placement(mine)) == mine and "elsewhere" in mine.describe()
    assert decode_placement(encode_placement(None)) is None


@pytest.mark.parametrize("colocate", [False, True])
def test_plans_from_cut_placements_are_the_plans_of_the_whole(colocate):
    """Each end plans from the part of the placement that concerns it: every pair's hash is the one the
    whole placement gives, on hosts where trainers and instances meet (the nearest sender is picked there)
    and where they do not."""
    from weightsync.engines import make_layout
    from weightsync.plan.job import JobShape
    from weightsync.plan.planner import pair_hash
    from weightsync.spec import load_spec

    spec = load_spec("tiny-qwen3")
    src, dst = make_layout(spec, "megatron:tp=2,pp=1,dp=4"), make_layout(spec, "vllm:tp=2")
    hosts = ["a", "a", "b", "b", "c", "c", "d", "d"]  # trainers: two to a host; instance 0 on b, 1 on c, 2 on e or d
    train = [Registration("train", r, host=hosts[r], gpu=f"GPU-t{r}") for r in range(8)]
    infer = [Registration("infer", r, i, host=("bcd" if colocate else "bce")[i],  # co-located: on trainers' GPUs
                          gpu=f"GPU-t{2 + 2 * i + r}" if colocate else f"GPU-i{i}{r}")
             for i in range(3) for r in range(2)]
    whole = placement_of(train, infer)

    def shape(placement: Placement) -> JobShape:
        return JobShape(src.describe(), dst.describe(), 8, 2, 3, colocate, 1 << 16, placement=placement)

    full = shape(whole).planner(spec, src, dst)
    cut = shape(whole if colocate else concerning(whole, 2)).planner(spec, src, dst)
    for r in range(8):
        a, b = full.send_plan(r), cut.send_plan(r)
        assert {p: pair_hash(x) for p, x in a.items()} == {p: pair_hash(x) for p, x in b.items()}
    for i in range(3):
        mine = shape(whole if colocate else concerning(whole, 2, instance=i)).planner(spec, src, dst)
        for r in range(2):
            a, b = full.recv_plan(i, r), mine.recv_plan(i, r)
            assert {p: pair_hash(x) for p, x in a.items()} == {p: pair_hash(x) for p, x in b.items()}
    # where trainers and an instance share a host, the instance receives from them alone (the placement counts)
    assert {p[0] for r in range(2) for p in full.recv_plan(0, r)} == {2, 3}
    assert {p[0] for r in range(2) for p in full.recv_plan(2, r)} == ({6, 7} if colocate else set(range(8)))


def _scan(posted: dict[str, dict]) -> dict:
    """The comparison as the MetaServer made it before it was kept as posts came: every pair, every check."""
    mismatches, pending, compared, seen = [], [], 0, set()
    for name, ph in sorted(posted.items()):
        for key, h in sorted(ph["pairs"].items()):
            if key in seen:
                continue
            seen.add(key)
            s, i, r = map(int, key.split(","))
            train, infer = f"train:{s}", f"infer:{i}:{r}"
            peer = infer if name == train else train
            if peer not in posted:
                pending.append((s, i, r))
                continue
            compared += 1
            hashes = {name: h, peer: posted[peer]["pairs"].get(key)}
            if hashes[train] != hashes[infer]:
                mismatches.append((s, i, r))
    return {"compared": compared, "mismatches": sorted(mismatches), "pending": sorted(pending)}


def test_the_proof_kept_as_posts_come_is_the_scan_of_every_pair():
    rng = random.Random(7)
    names = [f"train:{s}" for s in range(4)] + [f"infer:{i}:{r}" for i in range(2) for r in range(2)]
    posted: dict[str, dict] = {}
    proof = Proof()
    for _ in range(400):
        name = rng.choice(names)
        if rng.random() < 0.15:
            proof.post(posted, name, None)  # re-registered: plans again
        else:
            ends = ([(int(name.split(":")[1]), i, r) for i in range(2) for r in range(2)] if name.startswith("train")
                    else [(s, *map(int, name.split(":")[1:])) for s in range(4)])
            pairs = {f"{s},{i},{r}": rng.choice("ab") for s, i, r in ends if rng.random() < 0.9}
            proof.post(posted, name, {"plan_hash": rng.choice([None, "f0"]), "pairs": pairs})
        want, got = _scan(posted), proof.answer(posted)
        assert (got["compared"], got["mismatch_count"], got["pending_count"]) == (
            want["compared"], len(want["mismatches"]), len(want["pending"]))
        assert [tuple(m["pair"]) for m in got["mismatches"]] == want["mismatches"][:20]
        assert [tuple(m["pair"]) for m in got["pending"]] == want["pending"][:20]
        again = Proof.of(dict(posted))  # a restart rebuilds the same comparison
        assert again.answer(posted) == got


def test_waiting_for_the_proof_is_one_long_poll_answered_when_it_holds():
    with MetaServer().start() as s:
        c = MetaClient(s.url, "j", timeout=5)
        for name in (("train", 0), ("train", 1)):
            c.register(*name)
        c.register("infer", 0, instance=0)
        c.post_plan_hashes("train", 0, {(0, 0, 0): "aa"})
        c.post_plan_hashes("infer", 0, {(0, 0, 0): "aa", (1, 0, 0): "bb"}, instance=0)
        with pytest.raises(PlanError, match=r"2 of 3 participants posted; 1 pairs wait"):
            setup.wait_plan_proven(c, 0.5, 3)
        c.post_plan_hashes("train", 1, {(1, 0, 0): "bb"})
        setup.wait_plan_proven(c, 5, 3)
        c.post_plan_hashes("train", 1, {(1, 0, 0): "cc"})  # planned again, differently: refused at once
        with pytest.raises(PlanError, match=r"differ between the two ends of 1 pairs.*'train_hash': 'cc'"):
            setup.wait_plan_proven(c, 5, 3)
        c.abort("a peer's memory budget")
        with pytest.raises(MetaAborted, match="memory budget"):
            setup.wait_plan_proven(c, 5, 3)
