"""The transport interface, the job session's checks and the public surface (unit tests, one process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from weightsync.engines import make_layout
from weightsync.errors import ConfigError, JobMismatch
from weightsync.plan.topology import Placement, Topology
from weightsync.runtime.job import check_own_layout, layout_digest, placement_of
from weightsync.runtime.session import SessionOptions
from weightsync.spec import load_spec
from weightsync.transport.base import (
    TRANSPORTS,
    Receiver,
    Sender,
    TransportOptions,
    make_receiver,
    make_sender,
    receiver_class,
    resolve,
)


@pytest.mark.parametrize("name", sorted(TRANSPORTS))
def test_every_registered_transport_implements_both_sides(name):
    options = TransportOptions(name=name, directory="/tmp/unused")
    sender, receiver = make_sender(options), make_receiver(options)  # abstract methods left out would raise
    assert isinstance(sender, Sender) and isinstance(receiver, Receiver)
    assert sender.modes <= TRANSPORTS[name].modes >= receiver.modes


def test_receivers_that_read_the_trainers_memory_wait_until_the_step_is_written():
    # colocated copies out of the trainers' shared memory, nixl READs their registered memory
    assert {n: receiver_class(n).reads_after_written for n in TRANSPORTS} == {
        "p2p": False, "colocated": True, "file": False, "nixl": True}


@pytest.mark.parametrize("kwargs, selected", [
    (dict(name="p2p", colocate=False, mode="sync", directory=None), "p2p"),
    (dict(name="p2p", colocate=True, mode="sync", directory=None), "colocated"),
    (dict(name="colocated", colocate=True, mode="sync", directory=None), "colocated"),
    (dict(name="p2p", colocate=False, mode="async", directory=None), "p2p"),
    (dict(name="file", colocate=False, mode="sync", directory="/d"), "file"),
])
def test_options_select_a_transport(kwargs, selected):
    assert resolve(**kwargs) == selected


@pytest.mark.parametrize("kwargs, words", [
    (dict(name="rdma", colocate=False, mode="sync", directory=None), "unknown transport 'rdma'"),
    (dict(name="file", colocate=False, mode="sync", directory=None), "needs a directory"),
    (dict(name="file", colocate=True, mode="sync", directory="/d"), "not co-located"),
    (dict(name="p2p", colocate=True, mode="async", directory=None), "async mode runs over the p2p"),
    (dict(name="p2p", colocate=False, mode="eventually", directory=None), "mode must be"),
])
def test_options_that_fit_no_transport_are_refused_naming_what_fits(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        resolve(**kwargs)


def test_session_options_are_validated_before_any_io():
    with pytest.raises(ConfigError, match="timeout_s"):
        SessionOptions(timeout_s=0)
    with pytest.raises(ConfigError, match="async"):
        SessionOptions(colocate=True, mode="async")
    assert SessionOptions(colocate=True).terms().transport == "colocated"


def test_a_layout_the_agreed_engine_string_does_not_rebuild_is_refused():
    spec = load_spec("tiny-qwen3")
    mine = make_layout(spec, "vllm:tp=2").layout(1)
    check_own_layout("vllm:tp=2", spec, 1, layout_digest(mine), "instance 0 rank 1")  # rebuilds: fine
    with pytest.raises(JobMismatch, match=r"instance 0 rank 1: the layout the job plans from 'vllm:tp=1'"):
        check_own_layout("vllm:tp=1", spec, 1 % 1, layout_digest(mine), "instance 0 rank 1")


def _person(role, rank, host, gpu, instance=None):
    from weightsync.meta.records import Registration

    return Registration(role, rank, instance, host=host, gpu=gpu)


def test_placement_comes_from_the_registered_hosts_and_gpus():
    train = [_person("train", 1, "b", "GPU-2"), _person("train", 0, "a", "GPU-9")]
    infer = [_person("infer", 0, "a", "GPU-9", 0), _person("infer", 0, "b", "GPU-1", 1)]
    p = placement_of(train, infer)
    assert p == Placement(train=((0, 0), (1, 1)), infer=((0, 0), (1, 0)))
    topo = Topology.placed(p, infer_world=1, instances=2, colocate=True)
    assert [topo.train_gpu(r) for r in (0, 1)] == [0, 3] and topo.infer_gpu(1, 0) == 2
    assert topo.host(topo.infer_gpu(1, 0)) == topo.host(topo.train_gpu(1)) == 1  # same host, other GPU
    # ranks without a GPU (CPU jobs) on one host: the arithmetic rules place them; on several hosts each
    # is a slot of its own on its host, so the plan knows which pairs cross hosts
    assert placement_of([_person("train", 0, "a", None)], [_person("infer", 0, "a", None, 0)]) is None
    cpu = placement_of([_person("train", 1, "t", None), _person("train", 0, "t", None)],
                       [_person("infer", 0, "i", None, 0)])
    assert cpu == Placement(train=((1, 0), (1, 1)), infer=((0, 0),))


def test_a_plain_install_imports_the_public_surface_without_optional_packages():
    """torch is the only core dependency: the public names import with safetensors, transformers,
    megatron and vllm unavailable, and the MetaServer without torch."""
    code = (
        "import sys\n"
        "for m in ('safetensors', 'transformers', 'megatron', 'vllm', 'sglang'):\n"
        "    sys.modules[m] = None\n"
        "from weightsync import WeightWriter, WeightReader, MetaServer, WeightSyncError, TransportError\n"
        "from weightsync import ConfigError, JobMismatch, WeightsMoved, MetaError, MetaTimeout\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    code = "import sys\nsys.modules['torch'] = None\nfrom weightsync import MetaServer, MetaError\nprint('ok')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_files_a_killed_participant_left_are_removed_by_the_next_one_on_the_host(tmp_path, monkeypatch):
    """Doorbells and share descriptions are named by pid: a participant killed before closing them
    leaves them behind (issue 15), and the next bell or share on the host removes them."""
    import os
    import tempfile

    import torch

    from weightsync.runtime import doorbell
    from weightsync.transport.share import open_shared, share_tensors, unshare

    monkeypatch.setattr(doorbell, "_directory", lambda: str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = _dead_pid()
    stale = [tmp_path / f"weightsync-bell-{dead}-{'ab' * 16}", tmp_path / f"weightsync-job-1-{dead}-train0-for1.json"]
    alive = tmp_path / f"weightsync-bell-{os.getpid()}-{'cd' * 16}"
    for f in [*stale, alive]:
        f.write_bytes(b"x" * 8)
    bell = doorbell.Doorbell()
    assert not stale[0].exists() and alive.exists() and os.path.exists(bell.path)
    t = {"w": torch.randn(4, 3)}
    path = share_tensors(t, "job-1", "train0-for0")
    assert not stale[1].exists() and torch.equal(open_shared(path)["w"], t["w"])
    unshare(path)  # a transport's close
    bell.close()
    assert not os.path.exists(path) and not os.path.exists(bell.path)


# --------------------------------------------------------------------------------------------
# What a transport says when its backend fails

#: what gloo raises (torch 2.13) when the process at the other end of a pair died mid-transfer
GLOO_PEER_GONE = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                  "[127.0.0.1]:16300. This is typically caused by a remote worker crashing. Check the logs of the "
                  "remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f")


def test_a_peer_gone_mid_transfer_is_said_without_gloo_s_words():
    """Before: a staged reader's failure quoted gloo whole: its source file, its advice and "GLHF! 🏖️"
    ("group rank 1: receiving bucket 2 (2048 bytes) of training rank 0 -> instance 0 rank 0 from group rank 0
    failed (wait timeout 10s): [.../pair.cc:553] Connection closed by peer ...")."""
    from weightsync.transport.nccl import first_line

    text = first_line(RuntimeError(GLOO_PEER_GONE))
    assert text == "the peer closed the connection: its process is gone (crashed, killed or exited)", text
    reset = first_line(RuntimeError("[../gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:5: "
                                    "Connection reset by peer"))
    assert "process is gone" in reset, reset


def test_a_gloo_timeout_keeps_its_words_and_loses_its_source_location():
    from weightsync.transport.nccl import first_line

    text = first_line(RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                                   "10000ms for recv operation to complete"))
    assert text == "Timed out waiting 10000ms for recv operation to complete", text
    assert first_line(RuntimeError("")) == "RuntimeError"
    assert first_line(ValueError("first\nsecond")) == "first"
