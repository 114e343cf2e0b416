"""vLLM's ``weightsync_call`` runs only calls signed by the instance's control process (no vLLM needed).

``collective_rpc("weightsync_call", args=(payload,))`` is also vLLM's HTTP ``/collective_rpc`` in dev mode, so
whoever can reach it hands bytes to every worker: a raw pickle, a forged or replayed message must be refused
with nothing of it decoded or run. The worker method is the real one; only the worker it runs on is a stand-in.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch

from weightsync.runtime import wire
from weightsync.vllm.extension import WeightSyncExtension
from weightsync.vllm.rpc import CallChannel, pack_call, result


class _Opens:
    """Unpickling this creates ``path`` (``builtins.open``): a payload that runs code when ``pickle.loads``-ed."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def add_to_ctx(ctx, x, t):
    """A worker call: returns values computed from the context and the arguments."""
    return (ctx["rank"], x + 1, t * 2)


class _Ctx:
    def __init__(self):
        self.ran: list = []

    def run(self, fn, args):
        self.ran.append(fn)
        return fn({"rank": 0}, *args)


class _Worker(WeightSyncExtension):
    """The real extension methods on a stand-in worker (no model runner): ``_weightsync_worker`` is the only part replaced."""

    def __init__(self):
        self.ctx = _Ctx()

    def _weightsync_worker(self):
        return self.ctx


def _resigned(key: bytes, signed: bytes, body: bytes) -> bytes:
    """``signed`` with its body replaced by ``body`` and the MAC recomputed under ``key``."""
    n = int.from_bytes(signed[len(wire.MAGIC):len(wire.MAGIC) + 4], "big")
    header = json.loads(signed[len(wire.MAGIC) + 4:len(wire.MAGIC) + 4 + n])
    header["mac"] = wire._mac(key, header, body)
    hb = json.dumps(header).encode()
    return wire.MAGIC + len(hb).to_bytes(4, "big") + hb + body


@pytest.fixture()
def channel():
    d, key = wire.new_key_dir(wire.VLLM_DIR_PREFIX)
    yield CallChannel("inst", d, key)
    shutil.rmtree(d, ignore_errors=True)


def test_a_payload_that_would_run_code_is_refused_and_runs_nothing(tmp_path, channel):
    marker = str(tmp_path / "ran")
    evil = pickle.dumps((_Opens(marker), (_Opens(marker),)))
    w = _Worker()
    # 1. a raw pickle, as the old protocol took it
    with pytest.raises(wire.WireError, match="not a weightsync call message"):
        result(w.weightsync_call(evil), 0, "test")
    # 2. a forged message: the right directory, a key the sender guessed
    forged = _resigned(b"x" * 32, pack_call(channel, 1, add_to_ctx, (1, torch.ones(1))), evil)
    with pytest.raises(wire.WireError, match="bad MAC"):
        result(w.weightsync_call(forged), 0, "test")
    # 3. even a correctly signed body is decoded only by the restricted unpickler
    signed = _resigned(channel.key, pack_call(channel, 2, add_to_ctx, (1, torch.ones(1))), pickle.dumps((_Opens(marker),)))
    with pytest.raises(wire.WireError, match="refused global"):
        result(w.weightsync_call(signed), 0, "test")
    assert not os.path.exists(marker), "a refused payload ran code in the worker"
    assert w.ctx.ran == []


def test_a_signed_call_runs_once_and_answers_its_value(channel):
    w = _Worker()
    t = torch.randn(3, dtype=torch.bfloat16)
    msg = pack_call(channel, 1, add_to_ctx, (41, t))
    rank, x, t2 = result(w.weightsync_call(msg), 0, "test")
    assert (rank, x) == (0, 42) and torch.equal(t2, t * 2)
    with pytest.raises(wire.WireError, match="replayed"):  # the same signed bytes again
        result(w.weightsync_call(msg), 0, "test")
    assert w.ctx.ran == [add_to_ctx]
    assert result(w.weightsync_call(pack_call(channel, 2, add_to_ctx, (0, t))), 0, "test")[1] == 1


def test_a_worker_that_cannot_read_the_key_refuses_in_one_line(channel):
    msg = pack_call(channel, 1, add_to_ctx, (1, torch.ones(1)))
    shutil.rmtree(channel.dir)  # as on another node, or another user: no key at that path
    with pytest.raises(wire.WireError, match="no readable key") as e:
        result(_Worker().weightsync_call(msg), 0, "test")
    assert "host" in str(e.value).splitlines()[0]


def test_pack_call_refuses_what_the_worker_could_not_resolve(channel):
    with pytest.raises(TypeError, match="module-level function"):
        pack_call(channel, 1, lambda ctx: 0, ())
