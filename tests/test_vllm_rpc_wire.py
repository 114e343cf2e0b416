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


class _Model:
    """A stand-in model: it holds the stand-in :class:`~weightsync.vllm.side.VLLMWorker` where ``worker_of`` keeps
    one."""

    def __init__(self, worker):
        self.__dict__["_weightsync_worker"] = worker

    def get_model(self):
        return self


class _Worker(WeightSyncExtension):
    """The real extension methods on a stand-in vLLM worker (no model runner: its model holds a stand-in context)."""

    def __init__(self):
        self.ctx = _Ctx()
        self.model_runner, self.vllm_config, self.device = _Model(self.ctx), None, "cpu"


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


# -- every way into a worker is signed (issue 40, item 9) --------------------------------------------------------

#: the extension's methods that took no signature before, each called as vLLM's ``/collective_rpc`` would
UNSIGNED = [("weightsync_setup", ()), ("weightsync_close", ()), ("weightsync_shutdown_transfer", ()),
            ("weightsync_refresh", ()), ("weightsync_digests", ()), ("weightsync_mailbox", ("/tmp",)),
            ("weightsync_validate", ("/tmp",))]


class _TransferEngine:
    def __init__(self):
        self.shut = 0

    def shutdown(self):
        self.shut += 1


def test_no_worker_method_runs_without_a_signature():
    """Before: seven extension methods ran for anyone reaching ``collective_rpc`` (dev mode: HTTP), e.g. closing a
    worker or shutting its transfer engine down. Called by name exactly as vLLM does (its own ``run_method``), each
    is now no method at all; the extension's only methods take a signed message."""
    run_method = pytest.importorskip("vllm.v1.serial_utils").run_method
    w = _Worker()
    w.weight_transfer_engine = _TransferEngine()
    for name, args in UNSIGNED:
        with pytest.raises(NotImplementedError, match="not implemented"):
            run_method(w, name, args, {})
    assert w.weight_transfer_engine.shut == 0 and w.ctx.ran == []
    mine = {n for n, v in vars(WeightSyncExtension).items() if callable(v)}
    assert mine == {"weightsync_call", "weightsync_json"}, mine
    # and the two that remain refuse what is not signed (nothing decoded, nothing run)
    with pytest.raises(wire.WireError, match="not a weightsync call message"):
        result(run_method(w, "weightsync_call", (b"close",), {}), 0, "test")
    assert "not base64" in run_method(w, "weightsync_json", ("close me",), {})["error"]
    assert "not a weightsync call message" in run_method(w, "weightsync_json", ("Y2xvc2U=",), {})["error"]


def test_what_the_methods_did_runs_as_signed_calls(channel):
    """Set-up, close and the transfer engine's shutdown are host calls (run on the vLLM worker object), sent signed."""
    from weightsync.vllm.side import host_close, host_setup, host_shutdown_transfer

    w = _Worker()
    w.ctx.report = "the live report"
    w.weight_transfer_engine = _TransferEngine()
    assert result(w.weightsync_call(pack_call(channel, 1, host_setup, ())), 0, "test") == "the live report"
    assert result(w.weightsync_call(pack_call(channel, 2, host_shutdown_transfer, ())), 0, "test") is None
    assert w.weight_transfer_engine.shut == 1
    assert result(w.weightsync_call(pack_call(channel, 3, host_close, ())), 0, "test") is None
    assert "_weightsync_worker" not in w.model_runner.__dict__  # forgotten: the next call builds a new one
    forged = wire.encode(b"k" * 32, channel.instance, channel.dir, 4, host_shutdown_transfer, ())
    with pytest.raises(wire.WireError, match="bad MAC"):
        result(w.weightsync_call(forged), 0, "test")
    assert w.weight_transfer_engine.shut == 1


def digest_of_rank(ctx, salt):
    """A JSON-safe worker call (as ``weightsync.vllm.verify.computed_digests`` is)."""
    return {"rank": ctx["rank"], "salt": salt}


def test_json_calls_for_http_are_signed_once_and_answer_json():
    """``weightsync_json``: the signed call for vLLM's HTTP ``/collective_rpc`` (base64 in, JSON out); the body
    comes from ``json_request`` (a one-time key directory of this user, removed after)."""
    import base64

    from weightsync.vllm.rpc import json_request

    w = _Worker()
    with json_request(digest_of_rank, "x") as body:
        assert body["method"] == "weightsync_json" and json.loads(json.dumps(body)) == body
        key_dir = json.loads(wire_header_of(base64.b64decode(body["args"][0])))["dir"]
        assert os.path.isdir(key_dir)
        assert getattr(w, body["method"])(*body["args"]) == {"rank": 0, "salt": "x"}
        replay = getattr(w, body["method"])(*body["args"])
    assert "replayed" in replay["error"], replay
    assert not os.path.exists(key_dir)
    with json_request(digest_of_rank, "y") as body:
        pass
    assert "no readable key" in w.weightsync_json(*body["args"])["error"]  # the key is gone with the block
    assert w.ctx.ran == [digest_of_rank]


# -- the signed call admits only weightsync's functions and loaded record types (issue 40, item 8) ---------------


def _signed_naming(channel: CallChannel, seq: int, fn_name: str, body: bytes, records: list | None = None) -> bytes:
    """A message correctly signed under the channel's key that names ``fn_name`` and ``records`` (as a leaked key
    would allow)."""
    records = [] if records is None else records
    header = {"instance": channel.instance, "dir": channel.dir, "seq": seq, "fn": fn_name, "records": records}
    header["mac"] = wire._mac(channel.key, header, body)
    hb = json.dumps(header).encode()
    return wire.MAGIC + len(hb).to_bytes(4, "big") + hb + body


def test_a_signed_call_cannot_name_a_function_outside_weightsync(channel, tmp_path, monkeypatch):
    """Before: ``resolve`` took any module's function, so a signed message could run ``subprocess.run``."""
    monkeypatch.delenv(wire.CALLS_ENV, raising=False)
    wire.resolve.cache_clear()
    marker = tmp_path / "ran"
    w = _Worker()
    msg = _signed_naming(channel, 1, "subprocess:run", wire.dumps_args((["touch", str(marker)],)))
    with pytest.raises(wire.WireError, match="is not weightsync's"):
        result(w.weightsync_call(msg), 0, "test")
    assert w.ctx.ran == [] and not marker.exists()
    for name in ("shutil:rmtree", "os.path:join", "pickle:loads"):
        with pytest.raises(wire.WireError, match="is not weightsync's"):
            wire.resolve(name)
    # nor as an argument (a function travels by name and is resolved the same way)
    import shutil as shutil_mod

    with pytest.raises(wire.WireError, match="is not weightsync's"):
        wire.loads_args(wire.dumps_args((shutil_mod.rmtree,)))
    # a deployment names its own modules in the engine's environment
    assert wire.resolve("weightsync.vllm.verify:computed_digests").__name__ == "computed_digests"
    monkeypatch.setenv(wire.CALLS_ENV, "json, mypkg.*")
    try:
        assert wire.resolve("json:dumps") is json.dumps
        with pytest.raises(wire.WireError, match="is not weightsync's"):
            wire.resolve("subprocess:run")
    finally:
        wire.resolve.cache_clear()


def test_a_record_type_is_never_imported_by_name(monkeypatch):
    """Before: the body's globals under ``weightsync.`` were imported by name; ``weightsync.__main__`` ran
    ``sys.exit`` at import, ending the worker's call with ``SystemExit`` (past ``answer``'s ``except Exception``).
    Now a record type is looked up only among the modules already imported."""
    import sys

    monkeypatch.delitem(sys.modules, "weightsync.__main__", raising=False)
    body = b"\x80\x02cweightsync.__main__\nmain\n)R."  # protocol 2: GLOBAL weightsync.__main__.main, called with ()
    with pytest.raises(wire.WireError, match="refused global weightsync.__main__.main"):
        wire.loads_args(body)
    assert "weightsync.__main__" not in sys.modules
    # a loaded record type still travels
    from weightsync.vllm.rpc import CallChannel as Loaded

    assert wire.loads_args(wire.dumps_args((Loaded("i", "/d", b"k"),))) == (Loaded("i", "/d", b"k"),)


def test_importing_weightsync_main_runs_nothing():
    """``weightsync/__main__.py`` is guarded: importing it by name (as a worker once could) does not run the CLI."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import weightsync.__main__; print('imported')"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "imported", (out.returncode, out.stdout, out.stderr[-500:])


def test_a_record_s_module_is_imported_only_as_the_signed_header_lists_it(channel, tmp_path):
    """A worker that has not imported a record type's module (a fresh vLLM worker and ``FullCodec``) imports it
    because the signed header's ``records`` names it, never because the body does; a header naming anything but
    weightsync's public modules is refused."""
    import subprocess
    import sys

    from weightsync.codec.full import FullCodec
    from weightsync.vllm.verify import computed_digests

    msg = pack_call(channel, 1, computed_digests, (FullCodec(),))
    assert json.loads(wire_header_of(msg))["records"] == ["weightsync.codec.full"]
    (tmp_path / "msg").write_bytes(msg)
    code = ("import sys\nfrom weightsync.runtime import wire\nassert 'weightsync.codec.full' not in sys.modules\n"
            f"call = wire.decode(open({str(tmp_path / 'msg')!r}, 'rb').read())\n"
            "print(type(call.args[0]).__module__, type(call.args[0]).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["weightsync.codec.full", "FullCodec"], out.stderr[-2000:]
    body = wire.dumps_args(())
    for bad in (["weightsync.__main__"], ["os"], ["weightsync.codec.full", "subprocess"], "weightsync.codec"):
        with pytest.raises(wire.WireError, match="records|header fields"):
            wire.decode(_signed_naming(channel, 2, "weightsync.vllm.verify:computed_digests", body, bad))


def wire_header_of(blob: bytes) -> bytes:
    n = int.from_bytes(blob[len(wire.MAGIC):len(wire.MAGIC) + 4], "big")
    return blob[len(wire.MAGIC) + 4:len(wire.MAGIC) + 4 + n]
