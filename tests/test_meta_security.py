"""The MetaServer's security model over real HTTP on loopback: per-job tokens (the server's token is the
admin's, read from the environment or a file), doorbell addresses, bounded specs and steps, a refused
participant told to its job (and only then), the token checked before any body, and the refusal's words."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from weightsync.meta import MetaClient, MetaError, MetaServer, MetaTimeout

ADMIN = "adm1n-s3cret"


def http(url: str, method: str, path: str, token: str | None = None, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of one request, errors included."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, raw, ctype = r.status, r.read(), r.headers["Content-Type"]
    except urllib.error.HTTPError as e:
        status, raw, ctype = e.code, e.read(), e.headers["Content-Type"]
    return status, json.loads(raw) if ctype == "application/json" else {"text": raw.decode()}


# --------------------------------------------------------------------------------------------
# 1. Per-job tokens


def test_a_job_token_opens_its_own_job_only():
    """Before: one token opened every job -- a participant of job A read job B, dropped its instance,
    registered as its rank 1, aborted and deleted it (all 200)."""
    from weightsync.meta.auth import job_token

    a, b = job_token(ADMIN, "job-a"), job_token(ADMIN, "job-b")
    assert a != b and ADMIN not in a and a == job_token(ADMIN, "job-a")
    assert job_token("another-admin", "job-a") != a
    with MetaServer(token=ADMIN).start() as s:
        owner = MetaClient(s.url, "job-b", token=b, timeout=5)
        owner.register("train", 0)
        owner.join(0)
        attacks = [("GET", "/v1/jobs/job-b", None), ("POST", "/v1/jobs/job-b/instances/0/leave", {}),
                   ("POST", "/v1/jobs/job-b/participants", {"role": "train", "rank": 1}),
                   ("POST", "/v1/jobs/job-b/abort", {"reason": "x"}), ("DELETE", "/v1/jobs/job-b", None),
                   ("GET", "/v1/jobs/job-b/participants", None)]
        for method, path, body in attacks:
            status, got = http(s.url, method, path, a, body)
            assert status == 403, (method, path, status, got)
            assert "job-a" in got["error"] and "job-b" in got["error"], got
            for wrong in (None, "nope", a[:-1] + ("0" if a[-1] != "0" else "1"), ADMIN + "x"):
                assert http(s.url, method, path, wrong, body)[0] == 401, (method, path, wrong)
        assert http(s.url, "GET", "/metrics", a)[0] == 403  # every job's figures: the admin's only
        assert http(s.url, "GET", "/health")[0] == 200  # never needs a token
        summary = owner.summary()  # nothing of the above changed job B
        assert summary["aborted"] is None and summary["instances"] == [0] and summary["train_ranks"] == [0]
        # its own token opens job A's routes; the admin token opens every job's and /metrics
        assert MetaClient(s.url, "job-a", token=a, timeout=5).register("train", 0)["created"] is True
        admin = MetaClient(s.url, "job-b", token=ADMIN, timeout=5)
        assert admin.summary()["instances"] == [0]
        assert "weightsync_meta_jobs 2" in admin.metrics()
        assert admin.delete_job()["deleted"] is True


def test_job_token_command_prints_the_library_token():
    from weightsync.meta.auth import job_token

    out = subprocess.run([sys.executable, "-m", "weightsync", "job-token", "--token", ADMIN, "--job", "j1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == job_token(ADMIN, "j1")
    bad = subprocess.run([sys.executable, "-m", "weightsync", "job-token", "--token", ADMIN, "--job", "a/b"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "job" in bad.stderr


def test_local_job_hands_participants_the_job_token():
    from weightsync.local.runner import LocalJob
    from weightsync.meta.auth import job_token

    with LocalJob(deadline_s=5, meta_token=ADMIN) as job:
        assert job.job_token("j") == job_token(ADMIN, "j")
    with LocalJob(deadline_s=5) as job:
        assert job.job_token("j") is None  # a server without a token: participants send none


# --------------------------------------------------------------------------------------------
# 2. Doorbell addresses: weightsync's own shared-memory files only


def test_a_doorbell_address_that_is_not_a_bell_is_refused_by_the_server():
    """Before: a participant pointed job B's doorbell at /etc/passwd, and every peer opened and mapped it."""
    import socket

    from weightsync.runtime.doorbell import Doorbell

    host = socket.gethostname()
    with MetaServer().start() as s:
        c = MetaClient(s.url, "j", timeout=5)
        bell = Doorbell()
        try:
            assert c.publish("bell.written.0", bell.address)["changed"] is True  # a real bell is accepted
        finally:
            bell.close()
        for address in (f"{host}:/etc/passwd", f"{host}:/dev/shm/../etc/weightsync-bell-1-{'a' * 32}",
                        f"{host}:/dev/shm/weightsync-bell-1-{'a' * 32}/../../etc/passwd", "/etc/passwd",
                        f"{host}:relative/weightsync-bell-1-{'a' * 32}", f"{host}:/dev/shm/weightsync-bell-x-abc"):
            with pytest.raises(MetaError, match="doorbell") as e:
                c.publish("bell.held.1", address, replace=True)
            assert e.value.status == 400, address
        assert "bell.held.1" not in c.summary()["rendezvous"]


def test_a_doorbell_is_opened_only_when_it_is_a_bell_file(tmp_path):
    import os
    import socket

    from weightsync.errors import TransportError
    from weightsync.runtime.doorbell import Doorbell, _directory

    host = socket.gethostname()
    made = []

    def shm(name: str) -> str:
        made.append(os.path.join(_directory(), name))
        return made[-1]

    try:
        link = shm(f"weightsync-bell-{os.getpid()}-{'b' * 32}")
        os.symlink("/etc/passwd", link)
        big = shm(f"weightsync-bell-{os.getpid()}-{'c' * 32}")
        with open(big, "wb") as f:
            f.write(b"\0" * 4096)
        folder = shm(f"weightsync-bell-{os.getpid()}-{'d' * 32}")
        os.mkdir(folder)
        for path, why in (("/etc/passwd", "not a weightsync doorbell"), (link, "symbolic link"),
                          (big, "4096 bytes"), (folder, "not a regular file"),
                          (shm(f"weightsync-bell-{os.getpid()}-{'e' * 32}"), "no such")):
            with pytest.raises(TransportError, match=why):
                Doorbell.open(f"{host}:{path}")
            with pytest.raises(TransportError):
                Doorbell(path)
        real = Doorbell()
        try:
            opened = Doorbell.open(real.address)
            real.ring(5)
            assert opened.step == 5
            assert os.stat(real.path).st_mode & 0o777 == 0o600  # only its owner's processes open it
        finally:
            real.close()
    finally:
        for p in made:
            if os.path.islink(p) or os.path.isfile(p):
                os.unlink(p)
            elif os.path.isdir(p):
                os.rmdir(p)


# --------------------------------------------------------------------------------------------
# 3. A model config's spec is bounded before it is built


def _moe_config(layers: int, experts: int) -> dict:
    from weightsync.spec import load_spec

    cfg = dict(load_spec("tiny-qwen3-moe").config)
    cfg.update(num_hidden_layers=layers, num_experts=experts)
    return cfg


def test_a_registration_describing_a_giant_spec_is_refused_in_milliseconds():
    """Before: 4,096 layers x 65,536 experts passed each cap, was refused with 409 after 5 s, and the server
    went on building the spec (58 s of CPU, 2.85 GB, /health up to 6.6 s)."""
    huge = _moe_config(4096, 65536)
    assert len(json.dumps(huge)) < 2048
    with MetaServer().start() as s:
        c = MetaClient(s.url, "j", timeout=10)
        c.register("train", 0, spec_digest="aaaa", model_config=_moe_config(2, 4))
        t0 = time.monotonic()
        with pytest.raises(MetaError, match="tensors") as e:
            c.register("infer", 0, instance=0, spec_digest="bbbb", model_config=huge)
        took = time.monotonic() - t0
        assert e.value.status == 400 and took < 1.0, (took, str(e.value))
        # 4,096 x (65,536 experts x 3 + 9 others) + 3 outside the layers, counted without building one
        assert "805,343,235 tensors" in str(e.value), str(e.value)
        slowest = 0.0
        for _ in range(10):  # nothing is left building on the server
            t0 = time.monotonic()
            c.health()
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.05)
        assert slowest < 0.5, slowest
        assert c.summary()["aborted"] is None  # the refused registration changed nothing


def test_a_config_is_sized_once_however_many_ranks_register_it():
    from weightsync.meta.mismatch import _sized, check_spec_size
    from weightsync.spec import load_spec

    cfg = dict(load_spec("qwen3-30b-a3b").config)
    check_spec_size(cfg)
    before = _sized.cache_info()
    for _ in range(100):
        check_spec_size(dict(cfg))
    after = _sized.cache_info()
    assert after.hits - before.hits == 100 and after.misses == before.misses


def test_the_spec_size_is_the_built_spec_s_for_every_preset():
    """The bound is computed from the config's arithmetic, exactly what building the spec gives."""
    from weightsync.meta.mismatch import spec_size
    from weightsync.spec import load_spec, preset_names

    for name in preset_names():
        if name in ("deepseek-v3", "kimi-k2"):
            continue  # ~50k tensors each: seconds to build on the CI machine; their size is checked below
        spec = load_spec(name)
        got = spec_size(dict(spec.config))
        assert (got.tensors, got.nbytes) == (len(spec.tensors), spec.nbytes), name
    for name in ("deepseek-v3", "kimi-k2"):  # the largest real models stay well inside the bound
        from weightsync.meta.mismatch import MAX_SPEC_BYTES, MAX_SPEC_TENSORS

        got = spec_size(dict(load_spec(name).config))
        assert got.tensors * 3 < MAX_SPEC_TENSORS and got.nbytes * 8 < MAX_SPEC_BYTES, (name, got)


# --------------------------------------------------------------------------------------------
# 4. held only for written steps; no rank pushes a slower rank's steps out of the window


def test_held_is_accepted_only_for_a_step_written():
    """Before: after written 10, held 7 (never written) answered 200."""
    with MetaServer().start() as s:
        c = MetaClient(s.url, "j", timeout=5)
        c.register("train", 0)
        c.join(0)
        c.written(5, 0)
        c.written(10, 0)
        t0 = time.monotonic()
        with pytest.raises(MetaError, match="step 7") as e:
            c.held(0, 7)
        assert e.value.status == 409 and "written" in str(e.value) and time.monotonic() - t0 < 2
        assert c.summary()["held"] == {}
        assert c.held(0, 5)["step"] == 5  # written steps are accepted, in order
        assert c.held(0, 10)["previous"] == 5


def test_one_rank_cannot_push_a_slower_rank_s_step_out_of_the_window():
    """Before: 70 `written` posts each 2^32 ahead moved the window so that the slower rank's next step,
    11, answered 410."""
    from weightsync.meta.validate import STEP_STRIDE, STEPS_KEPT

    with MetaServer().start() as s:
        c = MetaClient(s.url, "j", timeout=5)
        c.register("train", 0)
        c.register("train", 1)
        for step in range(11):
            c.written(step, [0, 1])
        step, refused = 10, None
        for _ in range(70):
            step += STEP_STRIDE
            try:
                c.written(step, 0)
            except MetaError as e:
                refused = e
                break
        assert refused is not None and refused.status == 409, "the window moved past train:1's step 10"
        text = str(refused)
        assert f"step {step}" in text and "train:1" in text and f"{STEPS_KEPT} steps" in text, text
        assert c.written(11, 1)["ranks"] == 1  # before: 410
        assert c.wait_written(11, 1, timeout=1) == [1]
        with pytest.raises(MetaError, match="jumps more than") as e:
            c.written(step + 2 * STEP_STRIDE, 0)  # one post may jump at most STEP_STRIDE past the latest
        assert e.value.status == 409 and str(STEP_STRIDE) in str(e.value)


# --------------------------------------------------------------------------------------------
# 5. File-transport weight files: their owner's only


def test_file_transport_files_are_the_owner_s_only(tmp_path):
    """Before: weight files were 0644 in a 0755 folder: any local user read the weights."""
    import os
    import stat

    from test_file_transport import CASES, Job

    from weightsync.transport.file import FileTransport

    directory = tmp_path / "weights" / "job"
    job = Job(CASES["llama3 fsdp:dp=2 -> sglang:tp=2, 512 B buckets"])
    old = os.umask(0o022)  # the usual umask: what made them world-readable
    try:
        job.send_all(FileTransport(directory), step=1, seed=1)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    names = os.listdir(directory)
    assert names
    for name in names:
        assert stat.S_IMODE(os.stat(directory / name).st_mode) == 0o600, name


def test_co_located_share_description_is_the_owner_s_only():
    """Before: the description of shared weights (shared-memory names, CUDA IPC handles) was written with
    the umask's mode (0644 usually): any local user could read it and open the trainer's weights."""
    import os
    import stat

    import torch

    from weightsync.transport.share import open_shared, share_tensors, unshare

    tensors = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    old = os.umask(0o022)
    try:
        path = share_tensors(tensors, "sec-job", "train0-for0")
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        opened = open_shared(path)
        assert all(torch.equal(opened[n], t) for n, t in tensors.items())
    finally:
        unshare(path)


# --------------------------------------------------------------------------------------------
# 6. A participant refused for its token is told to its job


def test_a_participant_refused_for_its_token_is_named_to_the_waiting_side():
    """Before: the correct side waited its whole timeout and said "not ready ... count 0"."""
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.meta.auth import job_token

    with MetaServer(token=ADMIN).start() as s, ThreadPoolExecutor(1) as pool:
        reader = MetaClient(s.url, "j", token=job_token(ADMIN, "j"), timeout=10)
        reader.register("infer", 0, instance=0)
        waiting = pool.submit(reader.wait_participants, 2, None, 8.0)
        time.sleep(0.3)
        t0 = time.monotonic()
        with pytest.raises(MetaError) as e:
            MetaClient(s.url, "j", token=job_token("not-the-admin", "j"), timeout=5).register("train", 0)
        assert e.value.status == 401
        with pytest.raises(MetaError) as e:
            waiting.result(timeout=10)
        took = time.monotonic() - t0
        text = str(e.value)
        assert took < 3.0 and "train:0" in text and "token" in text and "job-token" in text, (took, text)
        # a wait that starts later is told too, until the refused participant registers with the right token
        with pytest.raises(MetaError, match="train:0"):
            reader.wait_participants(2, timeout=2)
        MetaClient(s.url, "j", token=job_token(ADMIN, "j"), timeout=5).register("train", 0)
        assert len(reader.wait_participants(2, timeout=2)) == 2
        # another job is told nothing
        other = MetaClient(s.url, "k", token=job_token(ADMIN, "k"), timeout=5)
        other.register("infer", 0, instance=0)
        with pytest.raises(MetaTimeout):
            other.wait_participants(2, timeout=0.5)


# --------------------------------------------------------------------------------------------
# 7. The model refusal's words


def test_a_dtype_mismatch_says_dtype_and_names_each_side_s_rank():
    """Before: the refusal never said "dtype", and the trainer's message named both sides "llama"."""
    from weightsync.engines import make_layout
    from weightsync.errors import JobMismatch
    from weightsync.runtime.job import register, registration
    from weightsync.spec import load_spec
    from weightsync.spec.model import spec_from_config

    base = dict(load_spec("tiny-llama3").config)
    bf16 = spec_from_config(base)  # named by model_type: "llama" on both sides
    fp32 = spec_from_config({**base, "torch_dtype": "float32"})
    assert bf16.name == fp32.name == "llama" and bf16.digest != fp32.digest
    with MetaServer().start() as s:
        infer = MetaClient(s.url, "j", timeout=10)
        engine = make_layout(bf16, "vllm")
        register(infer, registration(bf16, "infer", 0, engine, engine.layout(0), instance=0), bf16)
        train = MetaClient(s.url, "j", timeout=10)
        engine = make_layout(fp32, "hf")
        with pytest.raises(JobMismatch) as e:
            register(train, registration(fp32, "train", 0, engine, engine.layout(0)), fp32)
    text = str(e.value)
    assert "dtype" in text and "float32 on training rank 0" in text, text
    assert "bfloat16 on inference rank 0 of instance 0" in text, text
    assert "model.embed_tokens.weight" in text and "torch_dtype" in text, text


def test_a_model_mismatch_names_each_side_s_model_in_one_sentence_without_the_route():
    """Before: the trainer's message named both sides "(llama)" (two configs named by their model_type) and carried
    the HTTP route mid-line ("... differs from inference rank 0 of instance 0's (llama): POST /v1/jobs/j/participants:
    training rank 0 ...")."""
    from weightsync.engines import make_layout
    from weightsync.errors import JobMismatch
    from weightsync.runtime.job import register, registration
    from weightsync.spec import load_spec
    from weightsync.spec.model import spec_from_config

    engine_spec = spec_from_config(dict(load_spec("tiny-llama3").config))  # hidden_size 64
    trainer_spec = spec_from_config(dict(load_spec("tiny-llama3-h64").config))  # hidden_size 128
    assert engine_spec.name == trainer_spec.name == "llama"
    with MetaServer().start() as s:
        engine = make_layout(engine_spec, "vllm")
        register(MetaClient(s.url, "j", timeout=10),
                 registration(engine_spec, "infer", 0, engine, engine.layout(0), instance=0), engine_spec)
        engine = make_layout(trainer_spec, "hf")
        with pytest.raises(JobMismatch) as e:
            register(MetaClient(s.url, "j", timeout=10),
                     registration(trainer_spec, "train", 0, engine, engine.layout(0)), trainer_spec)
    text = str(e.value)
    assert "/v1/" not in text and "POST" not in text, text
    assert text.startswith("training rank 0 refused before any transfer: "), text
    assert "on training rank 0 (llama, hidden_size=128," in text, text
    assert "on inference rank 0 of instance 0 (llama, hidden_size=64," in text, text
    assert "(llama)" not in text, text
    assert "give every trainer and every instance the same model (the same config.json)" in text, text
    assert "\n" not in text, text


# --------------------------------------------------------------------------------------------
# The whole path with job tokens


def test_a_job_runs_end_to_end_on_its_job_token():
    """Trainer and reader processes get the job's token from the launcher (tests/e2e.run_job through
    LocalJob.job_token), never the admin's: every route a participant calls (registration, waits, plan
    hashes, rendezvous, doorbells, written, held) is its job's."""
    from e2e import assert_clean, run_job

    job = dict(model="tiny-qwen3", train="hf", infer="hf", steps=1, timeout=30.0, server_token=ADMIN, job="tokened")
    assert_clean(run_job(job), job)


# --------------------------------------------------------------------------------------------
# 8. Issue 40: one bad request, or one careless operator, against a running server


def _dense_config(**over: object) -> dict:
    from weightsync.spec import load_spec

    cfg = dict(load_spec("tiny-qwen3").config)
    cfg.update(over)
    return cfg


def test_a_count_that_is_not_an_integer_is_refused_by_name_at_once():
    """Before: "num_hidden_layers": "3000000" (a string; 1e12, a float, too) skipped the spec-size bound, which
    read ints only, while the spec builder int()ed it: the event loop built the spec for 24 s (570 MB), every
    other job's requests waiting; "hidden_size": 64.0 was accepted."""
    cases = [("hidden_size", 64.0, _dense_config), ("num_hidden_layers", "3000000", _dense_config),
             ("num_hidden_layers", 1e12, _dense_config), ("num_hidden_layers", True, _dense_config),
             ("num_experts", "65536", _moe_config), ("head_dim", "16", _dense_config),
             ("mlp_only_layers", ["1"], _moe_config)]
    with MetaServer().start() as s:
        c = MetaClient(s.url, "j", timeout=10)
        for key, value, config in cases:
            cfg = config(2, 4) if config is _moe_config else config()
            cfg[key] = value
            t0 = time.monotonic()
            with pytest.raises(MetaError) as e:
                c.register("train", 0, model_config=cfg)
            took, text = time.monotonic() - t0, str(e.value)
            assert e.value.status == 400 and took < 1.0, (key, value, took, text)
            assert key in text and repr(value) in text and "integer" in text, (key, value, text)
        # a count nested where the spec builder does not look is bounded too, whatever its type
        nested = _dense_config(text_config={"num_hidden_layers": "3000000"})
        with pytest.raises(MetaError, match="text_config.num_hidden_layers") as e:
            c.register("train", 0, model_config=nested)
        assert e.value.status == 400 and "'3000000'" in str(e.value)
        slowest = 0.0
        for _ in range(5):  # nothing is left building on the server
            t0 = time.monotonic()
            c.health()
            slowest = max(slowest, time.monotonic() - t0)
        assert slowest < 0.5, slowest
        with pytest.raises(MetaError, match="no job j"):  # every refusal changed nothing
            c.summary()
        assert c.register("train", 0, model_config=_dense_config())["created"] is True  # a real config still is


def test_a_spec_that_cannot_be_built_is_a_refusal_not_an_acceptance(monkeypatch):
    """Before: at a 3 GiB memory cap the spec builder's MemoryError was swallowed with every other failure, and
    the registration accepted. A real server over HTTP; the failure is injected where the spec is built."""
    import weightsync.spec.model

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise MemoryError()

    cfg = _dense_config(num_hidden_layers=5, intermediate_size=136)  # a config no other test sizes (no cached size)
    with MetaServer().start() as s:
        c = MetaClient(s.url, "j", timeout=10)
        monkeypatch.setattr(weightsync.spec.model, "spec_from_config", out_of_memory)
        with pytest.raises(MetaError, match="MemoryError") as e:
            c.register("train", 0, model_config=cfg)
        assert e.value.status == 400 and "model_config" in str(e.value)
        with pytest.raises(MetaError, match="no job j"):  # nothing of it was kept
            c.summary()
        monkeypatch.undo()
        assert c.register("train", 0, model_config=cfg)["created"] is True  # refused, not remembered as refused


def test_a_request_without_the_job_s_own_token_changes_nothing_in_the_job():
    """Before: one GET /v1/jobs/j/anything with no token (or another job's token) was recorded as job j's
    refusal: every pending and new wait of j answered 409 for 60 s, and the trainer's written posts failed."""
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.meta.auth import job_token

    mine = job_token(ADMIN, "j")
    strangers = [None, "", "nope", ADMIN + "x", job_token(ADMIN, "k"), job_token("not-the-admin", "k"),
                 "wsjob:j:" + "0" * 63, "wsjob:j:" + "g" * 64, "wsjob:j", mine + "0", "wsjob:j:" + "A" * 64]
    with MetaServer(token=ADMIN).start() as s, ThreadPoolExecutor(1) as pool:
        reader = MetaClient(s.url, "j", token=mine, timeout=10)
        reader.register("infer", 0, instance=0)
        before = reader.summary()
        waiting = pool.submit(reader.wait_participants, 2, None, 8.0)
        time.sleep(0.3)
        for token in strangers:
            for method, path, body in (("GET", "/v1/jobs/j/anything", None), ("GET", "/v1/jobs/j/participants", None),
                                       ("POST", "/v1/jobs/j/participants", {"role": "train", "rank": 0})):
                status, got = http(s.url, method, path, token, body)
                assert status in (401, 403), (token, method, path, status, got)
        time.sleep(0.3)
        assert not waiting.done()  # before: 409 "the MetaServer refused a participant of job j"
        with pytest.raises(MetaTimeout):  # a new wait is not told either
            reader.wait_participants(2, timeout=0.3)
        assert reader.summary() == before
        MetaClient(s.url, "j", token=mine, timeout=5).register("train", 0)
        assert len(waiting.result(timeout=10)) == 2


def test_a_refused_registration_is_named_from_its_first_bytes_only():
    """A token of the job's own format not made from the server's token is still told to the job, naming the
    participant, from at most the first 8 KiB of its body: a registration with a 20 KB config is named too."""
    from weightsync.meta.auth import job_token
    from weightsync.meta.server import REFUSED_PREFIX

    big = _dense_config(notes="x" * 20000)
    assert len(json.dumps(big)) > 2 * REFUSED_PREFIX
    with MetaServer(token=ADMIN).start() as s:
        reader = MetaClient(s.url, "j", token=job_token(ADMIN, "j"), timeout=10)
        reader.register("train", 0)
        with pytest.raises(MetaError) as e:
            MetaClient(s.url, "j", token=job_token("not-the-admin", "j"), timeout=5).register(
                "infer", 1, instance=3, model_config=big)
        assert e.value.status == 401
        with pytest.raises(MetaError, match="infer:3:1"):
            reader.wait_participants(2, timeout=2)


def _raw_request(url: str, head: bytes, timeout: float = 3.0) -> bytes:
    """Send the request head only (a body announced, never sent); what comes back until the server closes."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(url)
    got = b""
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as sock:
        sock.sendall(head)
        while True:
            chunk = sock.recv(65536)  # socket.timeout (the test fails) if the server waits for the body
            if not chunk:
                return got
            got += chunk


def test_the_token_is_checked_before_any_body_is_read():
    """Before: the server read each body, up to 1 MiB, before it looked at the token: 1,200 unauthenticated
    bodies took it to 1.66 GB. Now a request the token refuses is answered once its headers are in, 401 (or
    403) with Connection: close, and the body is never awaited."""
    from weightsync.meta.auth import job_token

    with MetaServer(token=ADMIN).start() as s:
        for auth in (b"", b"Authorization: Bearer nope\r\n",
                     b"Authorization: Bearer " + job_token(ADMIN, "k").encode() + b"\r\n"):
            head = (b"POST /v1/jobs/j/participants HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1048576\r\n" + auth + b"\r\n")
            t0 = time.monotonic()
            got = _raw_request(s.url, head)
            took = time.monotonic() - t0
            status_line, _, rest = got.partition(b"\r\n")
            headers = rest.split(b"\r\n\r\n", 1)[0].lower()
            assert status_line.split()[1] in (b"401", b"403"), got[:300]
            assert b"connection: close" in headers and took < 2.0, (took, got[:300])
        # a request with the right token still sends its body and is answered on it
        status, got = http(s.url, "POST", "/v1/jobs/j/participants", job_token(ADMIN, "j"), {"role": "train", "rank": 0})
        assert status == 200 and got["created"] is True


def _meta_server(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    import re

    proc = subprocess.Popen([sys.executable, "-m", "weightsync", "meta-server", "--port", "0", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"listening on (http://\S+)", line)
    if not m:
        proc.kill()
        raise AssertionError((line, proc.communicate(timeout=10)))
    return proc, m.group(1)


def test_the_admin_token_comes_from_a_file_or_the_environment_not_the_command_line(tmp_path):
    """Before: README and docs/security.md showed `--token $TOKEN`, readable by any local user in
    /proc/PID/cmdline and ps; there was no --token-file. --token still works, with a warning."""
    import os

    from weightsync.meta.auth import job_token

    token_file = tmp_path / "admin.token"
    token_file.write_text(ADMIN + "\n")
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSYNC_META_TOKEN"}
    for how, args, extra_env in (("file", ["--token-file", str(token_file)], {}),
                                 ("environment", [], {"WEIGHTSYNC_META_TOKEN": ADMIN}),
                                 ("command line", ["--token", ADMIN], {})):
        proc, url = _meta_server(*args, env={**env, **extra_env})
        try:
            cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read()
            assert (ADMIN.encode() in cmdline) == (how == "command line"), how
            assert http(url, "GET", "/metrics", ADMIN)[0] == 200, how
            assert http(url, "GET", "/metrics")[0] == 401, how
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=10)
        warned = "--token" in err and "WEIGHTSYNC_META_TOKEN" in err and "--token-file" in err
        assert warned == (how == "command line"), (how, err)
    out = subprocess.run([sys.executable, "-m", "weightsync", "job-token", "--token-file", str(token_file),
                          "--job", "j1"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.strip() == job_token(ADMIN, "j1"), out
    assert "warning" not in out.stderr.lower(), out.stderr
    (tmp_path / "empty").write_text("\n")
    for bad_file in (tmp_path / "empty", tmp_path / "missing"):
        out = subprocess.run([sys.executable, "-m", "weightsync", "meta-server", "--port", "0", "--token-file",
                              str(bad_file)], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 2 and str(bad_file) in out.stderr and "listening" not in out.stdout, out


# --------------------------------------------------------------------------------------------
# Connections: a slowloris, the open-file limit, unauthenticated connections closed first


class _Slowloris:
    """``n`` connections from ``source`` that each send one byte of a request head a second and never finish
    it; one the server closes is opened again ``reopen_s`` later. Keeps when each connection opened and,
    once the server closed it, how long it lived."""

    HEAD = b"GET /v1/jobs/j HTTP/1.1\r\nHost: x\r\nX-Slow: "

    def __init__(self, url: str, n: int, source: str = "127.0.0.1", reopen_s: float = 1.0):
        from urllib.parse import urlsplit

        u = urlsplit(url)
        self.addr, self.n, self.source, self.reopen_s = (u.hostname, u.port), n, source, reopen_s
        self.opened: list[float] = []  # time.monotonic() of each connect
        self.lived: dict[int, float] = {}  # index in opened -> seconds, for each the server closed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slowloris", daemon=True)

    def __enter__(self) -> "_Slowloris":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def still_open_longest(self) -> float:
        """The age of the oldest connection the server has not closed (0 if none)."""
        now = time.monotonic()
        return max((now - t for k, t in enumerate(self.opened) if k not in self.lived), default=0.0)

    def _run(self) -> None:
        import asyncio

        async def main() -> None:
            await asyncio.gather(*(one() for _ in range(self.n)))

        async def one() -> None:
            while not self._stop.is_set():
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(*self.addr, local_addr=(self.source, 0)), 2.0)
                except (OSError, asyncio.TimeoutError):
                    await asyncio.sleep(self.reopen_s)
                    continue
                k, sent, closed = len(self.opened), 0, False
                self.opened.append(time.monotonic())
                try:
                    while not self._stop.is_set():
                        writer.write(self.HEAD[sent:sent + 1] or b"a")  # the header line never ends
                        sent += 1
                        try:
                            await asyncio.wait_for(reader.read(1), 1.0)
                        except asyncio.TimeoutError:
                            continue
                        closed = True  # the server closed it (or answered, which ends it too)
                        break
                except OSError:
                    closed = True
                finally:
                    writer.close()
                if closed:
                    self.lived[k] = time.monotonic() - self.opened[k]
                await asyncio.sleep(self.reopen_s)

        asyncio.run(main())


def test_a_slowloris_does_not_shut_out_a_client_with_the_job_s_token(tmp_path):
    """Before: no connection cap, the soft open-file limit left where it was (1,024 is common) and 30 s to send
    a request's headers: ~4,000 re-opened trickling connections pinned the server, and a client with its job's
    token got no answer in 45 s. Here the server starts with a soft limit of 256 (hard 1,024) and 300
    connections each trickle a header byte a second, opened again once closed: the server raises its limit to
    the hard one, a client with the job's token is answered throughout on a new connection each time, and
    every trickling connection is closed within seconds (headers are due within 5 s)."""
    import os
    import re
    import resource

    from weightsync.meta.auth import job_token

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard_for_server = 1024 if hard == resource.RLIM_INFINITY else min(hard, 1024)
    if hard_for_server < 512:
        pytest.skip(f"this process's hard open-file limit ({hard}) is too low for the case")
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSYNC_META_TOKEN"}
    env["WEIGHTSYNC_META_TOKEN"] = ADMIN
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "weightsync", "meta-server", "--port", "0"], env=env,
                                stdout=subprocess.PIPE, stderr=log_file, text=True,
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard_for_server)))
    try:
        m = re.search(r"listening on (http://\S+)", proc.stdout.readline())
        assert m, log_path.read_text()
        url = m.group(1)
        limits = open(f"/proc/{proc.pid}/limits").read()
        files = re.search(r"Max open files\s+(\d+)\s+(\d+)", limits)
        assert files and int(files.group(1)) == hard_for_server, limits  # before: 256
        token = job_token(ADMIN, "j")
        MetaClient(url, "j", token=token, timeout=10).register("train", 0)
        took: list[float] = []
        with _Slowloris(url, 300) as attack:
            start = time.monotonic()
            while time.monotonic() - start < 14.0:
                t0 = time.monotonic()
                summary = MetaClient(url, "j", token=token, timeout=5).summary()  # a new connection each time
                took.append(time.monotonic() - t0)
                assert summary["train_ranks"] == [0]
                if len(attack.opened) >= 300 and len(attack.lived) >= 300:
                    break
                time.sleep(0.2)
            assert len(attack.opened) >= 300, len(attack.opened)  # the attack was on: every connection got in
            assert len(attack.lived) >= 300, (len(attack.lived), len(attack.opened))  # before: none in 14 s
            assert max(attack.lived.values()) < 9.0 and attack.still_open_longest() < 9.0, \
                (max(attack.lived.values()), attack.still_open_longest())
            assert max(took) < 3.0, took  # before: no answer at all (MetaUnavailable after 5 s)
            assert len(took) >= 10, took
        got = http(url, "GET", "/metrics", ADMIN)[1]["text"]
        closed = re.search(r'weightsync_meta_connections_closed_total\{reason="header_deadline"\} (\d+)', got)
        assert closed and int(closed.group(1)) >= 300, got[-1500:]
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def _metric(text: str, name: str, labels: str = "") -> int:
    import re

    m = re.search(rf"^{name}{re.escape(labels)} (\d+)$", text, re.M)
    assert m, (name, labels, text[-1500:])
    return int(m.group(1))


def test_unauthenticated_connections_are_closed_first_and_authenticated_ones_kept():
    """Before: nothing bounded what one address held, and a full server refused everyone alike. With room for
    100 connections and 40 unauthenticated ones per address, 2 x 150 trickling connections from 127.0.0.1 and
    127.0.0.2 close each other, oldest first, while 20 long-polls and 10 idle kept-alive connections that
    presented the job's token are never closed, and a new client with the token is answered at once."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlsplit

    from weightsync.meta.auth import job_token
    from weightsync.meta.limits import ConnectionLimits

    token = job_token(ADMIN, "j")
    auth_header = {"Authorization": f"Bearer {token}"}
    limits = ConnectionLimits(per_peer=40, max_connections=100, header_s=30.0)  # room, not the deadline, closes
    with MetaServer(token=ADMIN, limits=limits).start() as s, ThreadPoolExecutor(20) as pool:
        u = urlsplit(s.url)
        MetaClient(s.url, "j", token=token, timeout=5).register("train", 0)

        def get(conn: http.client.HTTPConnection, path: str) -> tuple[int, dict]:
            conn.request("GET", path, headers=auth_header)
            r = conn.getresponse()
            return r.status, json.loads(r.read())

        kept = [http.client.HTTPConnection(u.hostname, u.port, timeout=10) for _ in range(10)]
        for conn in kept:  # authenticated, then idle through the attack
            assert get(conn, "/v1/jobs/j")[0] == 200

        def long_poll() -> tuple[int, dict]:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=20)
            try:
                return get(conn, "/v1/jobs/j/participants?wait_for=2&timeout=15")
            finally:
                conn.close()

        polls = [pool.submit(long_poll) for _ in range(20)]
        admin = MetaClient(s.url, "j", token=ADMIN, timeout=5)
        deadline = time.monotonic() + 10
        while _metric(admin.metrics(), "weightsync_meta_connections", '{authenticated="true"}') < 30:
            assert time.monotonic() < deadline, admin.metrics()[-800:]
            time.sleep(0.05)
        most_unauthenticated = most_open = 0
        took: list[float] = []
        with _Slowloris(s.url, 150, "127.0.0.1", reopen_s=0.3), _Slowloris(s.url, 150, "127.0.0.2", reopen_s=0.3):
            start = time.monotonic()
            while time.monotonic() - start < 3.0:
                t0 = time.monotonic()
                assert MetaClient(s.url, "j", token=token, timeout=5).summary()["train_ranks"] == [0]
                took.append(time.monotonic() - t0)
                text = admin.metrics()
                unauthenticated = _metric(text, "weightsync_meta_connections", '{authenticated="false"}')
                most_unauthenticated = max(most_unauthenticated, unauthenticated)
                most_open = max(most_open, unauthenticated + _metric(text, "weightsync_meta_connections",
                                                                      '{authenticated="true"}'))
                time.sleep(0.1)
            assert not any(p.done() for p in polls), [p.result() for p in polls if p.done()]
            MetaClient(s.url, "j", token=token, timeout=5).register("train", 1)
            for p in polls:  # each long-poll was answered on the connection it was sent on
                status, got = p.result(timeout=10)
                assert status == 200 and got["ready"] is True, (status, got)
        for conn in kept:  # the same kept-alive connections: a closed one raises here
            assert get(conn, "/v1/jobs/j")[0] == 200
            assert conn.sock is not None
            conn.close()
        text = admin.metrics()
        closed = {r: _metric(text, "weightsync_meta_connections_closed_total", f'{{reason="{r}"}}')
                  for r in ("peer_cap", "budget_unauthenticated", "budget_idle", "refused_full", "header_deadline")}
        assert closed["peer_cap"] > 0 and closed["budget_unauthenticated"] > 0, closed
        assert closed["budget_idle"] == closed["refused_full"] == closed["header_deadline"] == 0, closed
        assert most_unauthenticated <= 80 and most_open <= 100, (most_unauthenticated, most_open)
        assert max(took) < 2.0, took
