"""Typed registrations (weightsync.meta.records): what each participant registers, how the job agrees on
it at set-up, and what a listing costs.

Every session option is a typed field of the registration and is cross-checked at set-up, before any
byte moves; a participant that differs is refused there and the job is aborted, so every peer is told
at once, naming the option and who has which value.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from e2e import run_job
from weightsync.errors import ConfigError, JobMismatch
from weightsync.meta import MetaClient, MetaServer
from weightsync.meta.records import (
    LayoutInfo, Registration, SessionTerms, decode_listing, digest_of, encode_listing, post_body,
)
from weightsync.meta.view import sides_of
from weightsync.runtime.job import job_shape

TERMS = SessionTerms(transport="p2p", mode="sync", colocate=False, bucket_bytes=1 << 20, integrity=1, codec="full")


def _people(train_terms: SessionTerms = TERMS, infer_terms: SessionTerms = TERMS) -> list[Registration]:
    return [Registration("train", r, host="h", version="v", model="m", spec_digest="s",
                         layout=LayoutInfo("fsdp:dp=2", 2, f"t{r}"), terms=train_terms, backend="gloo")
            for r in range(2)] + [Registration("infer", 0, 0, host="h", version="v", model="m", spec_digest="s",
                                               layout=LayoutInfo("vllm:tp=1", 1, "i0"), terms=infer_terms, instances=1)]


def test_a_registration_round_trips_through_json_and_the_listing():
    people = _people()
    for p in people:
        assert Registration.from_json(p.to_json()) == p
        body = post_body(p, {"a": 1})
        assert body["model_config"] == {"a": 1} and "config_digest" not in body
    listed = decode_listing(json.loads(b'{"ready": true, "count": 3, ' + encode_listing(people) + b"}"))
    assert listed.participants == people
    with pytest.raises(ValueError, match="terms.integrity must be an integer"):
        Registration.from_json({**people[0].to_json(), "terms": {**TERMS.to_json(), "integrity": "every"}})
    with pytest.raises(ValueError, match="instance is required for role infer"):
        Registration("infer", 0)


def test_every_session_option_is_agreed_at_set_up_naming_it_and_who_has_which():
    shape = job_shape(*sides_of(_people()), TERMS)
    assert (shape.train, shape.infer, shape.train_world, shape.instances, shape.bucket_bytes) == (
        "fsdp:dp=2", "vllm:tp=1", 2, 1, 1 << 20)
    for field, other in (("integrity", 3), ("transport", "file"), ("mode", "async"), ("codec", "delta"),
                         ("bucket_bytes", 4096), ("colocate", True)):
        theirs = SessionTerms(**{**TERMS.to_json(), field: other})
        with pytest.raises(JobMismatch) as e:
            job_shape(*sides_of(_people(infer_terms=theirs)), TERMS)
        assert SessionTerms.MEANING[field] in str(e.value), str(e.value)
        assert "inference rank 0 of instance 0" in str(e.value) and "training rank 0" in str(e.value)
    # every participant agrees, but not with this one's own options: said, field by field
    with pytest.raises(ConfigError, match="integrity: this participant 7, the job 1"):
        job_shape(*sides_of(_people()), SessionTerms(**{**TERMS.to_json(), "integrity": 7}))
    with pytest.raises(JobMismatch, match="registered no layout or no session options"):
        job_shape(*sides_of(_people() + [Registration("infer", 0, 1)]), TERMS)


def test_the_listing_sends_each_config_and_profile_once():
    """Set-up traffic: the model's config is kept once per distinct value and never listed (its digest
    is); what a side shares is sent once per listing; a listing not ready yet is the count alone."""
    config = json.load(open(__import__("weightsync.spec", fromlist=["x"]).__path__[0] + "/presets/qwen3-8b.json"))
    n = 64
    with MetaServer().start() as s:
        c = MetaClient(s.url, "j", timeout=5)
        for r in range(n):
            c.register(Registration("train", r, host=f"node{r // 8}", gpu=f"GPU-{r:08x}-0000-0000-0000-000000000000",
                                    version="v", model="qwen3-8b", spec_digest="s",
                                    layout=LayoutInfo("megatron:tp=8,pp=8", n, f"{r % 8:016x}"), terms=TERMS,
                                    backend="nccl"), model_config=config)
        got = c.participants()
        assert len(got) == n and {p.config_digest for p in got} == {digest_of(config)}
        raw = urllib.request.urlopen(f"{s.url}/v1/jobs/j/participants").read()
        assert raw.count(b'"megatron:tp=8,pp=8"') == 1 and b"max_position_embeddings" not in raw
        assert len(raw) < 160 * n, len(raw)  # rows only: no config, no repeated options
        gz = urllib.request.urlopen(urllib.request.Request(f"{s.url}/v1/jobs/j/participants",
                                                           headers={"Accept-Encoding": "gzip"}))
        assert gz.headers["Content-Encoding"] == "gzip" and len(gz.read()) < len(raw) // 2
        pending = json.loads(urllib.request.urlopen(f"{s.url}/v1/jobs/j/participants?wait_for={n + 1}").read())
        assert pending == {"ready": False, "count": n}
        assert [p.rank for p in c.wait_participants(1, "train", timeout=1, limit=1)] == [0]


def test_an_integrity_cadence_mismatch_is_refused_at_set_up_and_both_sides_are_told():
    """Before: the reader refused at its first update, the writer waited its whole timeout and then
    reported a timeout that did not name the cause. Now the cadence is agreed with the other options at
    set-up: both sides fail at connect, naming the integrity cadence, within seconds of each other
    (process start-up under load is not counted: it is neither side's wait)."""
    timeout = 60.0
    arrived: dict[str, float] = {}

    def on_event(ev) -> None:
        if type(ev).__name__ == "Failed":
            arrived[ev.participant.role] = time.monotonic()

    result = run_job(dict(model="tiny-qwen3", train="hf", infer="hf", integrity=1, reader_integrity=3, steps=1,
                          timeout=timeout), on_event=on_event)
    sides = {f.participant.role: f for f in result.failures}
    assert set(sides) == {"train", "infer"}, result.failures
    for f in sides.values():
        assert "integrity cadence" in f.message, f.line()
    apart = abs(arrived["train"] - arrived["infer"])
    assert apart < 10.0, f"the two sides failed {apart:.1f} s apart (timeout {timeout:g} s)"


def test_connect_waits_for_the_job_past_timeout_s_while_each_request_keeps_it():
    """An engine starts before its reader registers (17-82 s seen): set-up waits setup_timeout_s for the
    job to arrive, not timeout_s; a job whose other side never comes fails naming the side and the count."""
    import threading

    import torch

    from weightsync.engines import make_layout
    from weightsync.errors import MetaTimeout
    from weightsync.runtime.job import register, registration
    from weightsync.runtime.session import SessionOptions, TrainerSession
    from weightsync.spec import load_spec
    from weightsync.transport.base import MetaLink

    assert SessionOptions(timeout_s=60).setup_wait_s == 600 and SessionOptions(timeout_s=900).setup_wait_s == 900
    spec = load_spec("tiny-qwen3")
    engine = make_layout(spec, "hf")

    class Train:  # what a TrainerSession reads of a bound trainer
        rank, layout = 0, engine.layout(0)

    Train.spec, Train.engine = spec, engine
    Train.tensors = {n: torch.zeros(t.shape) for n, t in Train.layout.tensors.items()}
    with MetaServer().start() as s:
        options = SessionOptions(timeout_s=1.0, setup_timeout_s=8.0)
        session = TrainerSession(MetaClient(s.url, "late", timeout=1.0), MetaLink(s.url, "late"), Train, options)
        session.register()

        def late_reader() -> None:  # its engine took 3 s to start
            time.sleep(3.0)
            rec = registration(spec, "infer", 0, engine, engine.layout(0), instance=0, terms=options.terms(),
                               instances=1)
            register(MetaClient(s.url, "late", timeout=5), rec, spec)

        threading.Thread(target=late_reader, daemon=True).start()
        t0 = time.monotonic()
        train, infer = session.agree()
        assert 2.5 < time.monotonic() - t0 < 8.0 and (train.count, infer.count) == (1, 1)
        assert session.shape.infer == "hf" and infer.cohorts[0].profile.layout.engine == "hf"

        alone = TrainerSession(MetaClient(s.url, "alone", timeout=1.0), MetaLink(s.url, "alone"), Train,
                               SessionOptions(timeout_s=1.0, setup_timeout_s=2.0))
        alone.register()
        t0 = time.monotonic()
        with pytest.raises(MetaTimeout, match="inference participants: 0 of at least 1 registered"):
            alone.agree()
        assert time.monotonic() - t0 < 5.0
