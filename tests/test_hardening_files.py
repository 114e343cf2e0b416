"""What another local user can do through the files weightsync writes and reads (issue 40, items 6 and 7).

The file transport: a directory another user made (or one others can write) is refused with a message saying
what to do, every file is created 0600 with ``O_EXCL | O_NOFOLLOW``, and a reader loads only regular files of
this user that no one else can write (a planted link or foreign file is refused, the live tensors untouched).
Where the test runs as root, "another user" is a real one: a child process that drops to ``nobody`` squats the
directory, and files are handed to that uid with ``chown``; otherwise the same refusals are shown with modes.

The job data weightsync keeps on disk (the MetaServer's state database and its ``-wal``/``-shm``, participants'
logs, the soak's folders and logs, checkpoints) is created 0600 / 0700 whatever the umask.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid

import pytest
import torch

from test_file_transport import CASES, Job, _poisoned

from weightsync.errors import ConfigError, TransportError
from weightsync.transport.file import FileTransport, file_name
from weightsync.transport.private import private_opener

NOBODY = 65534
IS_ROOT = os.geteuid() == 0


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture()
def shared_tmp():
    """A folder like ``/tmp`` (1777) that another user can reach: made in the system's temp folder, not pytest's
    (0700, which ``nobody`` cannot enter)."""
    d = tempfile.mkdtemp(prefix="weightsync-shared-")
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- 6. the file transport's directory ---------------------------------------------------------------------------


@pytest.mark.parametrize("loose", [0o777, 0o1777, 0o775, 0o757])
def test_a_directory_others_can_write_is_refused(tmp_path, loose):
    """Before: a 0777 directory was used as it was; whoever could write it planted the weights a reader loaded
    and deleted the trainer's files. A sticky bit does not help (it keeps others from deleting, not planting)."""
    d = tmp_path / "job"
    d.mkdir()
    os.chmod(d, loose)
    with pytest.raises(ConfigError, match=r"writable by .*another user of this host could plant.*chmod go-w") as e:
        FileTransport(d)
    assert str(d) in str(e.value)
    assert os.listdir(d) == []


def test_a_directory_in_a_folder_others_can_write_is_refused(tmp_path):
    """A folder others can write (no sticky bit) lets them rename this user's directory away and put theirs in its
    place; under a sticky one (``/tmp``) they cannot, and the directory is created 0700."""
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with pytest.raises(ConfigError, match="writable by others without the sticky bit"):
        FileTransport(loose / "job")
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    t = FileTransport(sticky / "job")
    assert mode(sticky / "job") == 0o700 and t.directory == os.path.realpath(sticky / "job")


def test_the_transport_uses_the_real_path_it_checked(tmp_path):
    """A link to this user's directory is followed once, at the check: re-pointed later, it redirects nothing."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    os.symlink(real, link)
    job = Job(CASES["llama3 fsdp:dp=2 -> sglang:tp=2, 512 B buckets"])
    t = FileTransport(link)
    assert t.directory == str(real) and mode(real) == 0o700
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.unlink(link)
    os.symlink(other, link)
    job.send_all(t, step=1, seed=1)
    assert os.listdir(other) == [] and os.listdir(real)


def _squat(directory: str) -> None:
    """As user ``nobody``: make ``directory`` 0777, as another user of the host pre-creates a job's folder."""
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    os.mkdir(directory)
    os.chmod(directory, 0o777)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to act as another user (setuid, chown)")
def test_a_directory_another_user_made_is_refused(shared_tmp):
    """The probe's case, with a real second user: ``nobody`` pre-creates the job's directory (0777) under a shared
    /tmp-like folder; a trainer and a reader naming it are refused. Also refused: one of theirs that is 0700 (they
    can still write it) -- and, for a path that did not exist, what the transport creates is this user's, 0700."""
    job_dir = os.path.join(shared_tmp, "job")
    p = subprocess.run([sys.executable, "-c", f"import test_hardening_files as t; t._squat({job_dir!r})"],
                       cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert os.stat(job_dir).st_uid == NOBODY and mode(job_dir) == 0o777
    with pytest.raises(ConfigError, match=f"owned by uid {NOBODY}"):
        FileTransport(job_dir)
    theirs = os.path.join(shared_tmp, "theirs")
    os.mkdir(theirs, 0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"owned by uid {NOBODY}"):
        FileTransport(theirs)
    mine = os.path.join(shared_tmp, "mine")
    FileTransport(mine)
    assert os.stat(mine).st_uid == os.geteuid() and mode(mine) == 0o700


# -- 6. the files a reader loads --------------------------------------------------------------------------------


def _sent(tmp_path):
    """Step 1 written by every trainer of a small job into ``tmp_path/job``; the job and one reader's plan."""
    job = Job(CASES["llama3 fsdp:dp=2 -> sglang:tp=2, 512 B buckets"])
    directory = tmp_path / "job"
    job.send_all(FileTransport(directory), step=1, seed=1)
    plans = job.planner.recv_plan(0, 0)
    return job, directory, plans


def _replace_with(path, how: str, aside) -> None:
    """Put at ``path`` a file that is not the trainer's own but holds the same, valid, bytes (a squatter's plant)."""
    shutil.copyfile(path, aside)
    os.unlink(path)
    if how == "link":
        os.symlink(aside, path)
        return
    shutil.copyfile(aside, path)
    if how == "group-writable":
        os.chmod(path, 0o664)
    elif how == "world-writable":
        os.chmod(path, 0o646)
    elif how == "another user's":
        os.chown(path, NOBODY, NOBODY)


HOWS = ["link", "group-writable", "world-writable",
        pytest.param("another user's", marks=pytest.mark.skipif(not IS_ROOT, reason="chown needs root"))]


@pytest.mark.parametrize("how", HOWS)
def test_a_reader_refuses_a_file_that_is_not_the_trainers_own(tmp_path, how):
    """Before: a reader loaded whatever file had the pair's name -- a link (followed), a file others could write,
    another user's. Each is refused now, naming why, with nothing of it landed -- and the receiver says so
    (``landed`` False: a live reader that refused it withholds nothing; it was True, set when the file appeared)."""
    job, directory, plans = _sent(tmp_path)
    pair = sorted(plans)[0]
    path = directory / file_name(1, pair)
    _replace_with(path, how, tmp_path / "planted.safetensors")
    live = _poisoned(job.dst.layout(0))
    why = {"link": "symbolic link", "group-writable": "writable by group", "world-writable": "writable by others",
           "another user's": f"owned by uid {NOBODY}"}[how]
    receiver = FileTransport(directory, consume=False, timeout_s=2)
    with pytest.raises(TransportError, match=f"{why}.*refused, not read"):
        receiver.recv({pair: plans[pair]}, live, step=1)
    assert all(t.isnan().all() for t in live.values()), "bytes of a refused file landed"
    assert not receiver.landed, "a refused file counted as landed"
    assert os.path.lexists(path)  # left for inspection


def test_a_file_or_link_planted_at_a_temporary_name_is_refused_not_followed(tmp_path, monkeypatch):
    """Before: the writer opened its temporary file with ``O_TRUNC`` and no ``O_NOFOLLOW``: a link planted at the
    name sent the weights into (and truncated) whatever it pointed at. ``O_EXCL | O_NOFOLLOW`` now: refused."""
    job = Job(CASES["llama3 fsdp:dp=2 -> sglang:tp=2, 512 B buckets"])
    directory = tmp_path / "job"
    t = FileTransport(directory)
    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's own bytes")
    fixed = uuid.UUID(int=0xDEADBEEF)
    monkeypatch.setattr(uuid, "uuid4", lambda: fixed)
    pair = sorted(job.planner.send_plan(0))[0]
    tmp = directory / f".{file_name(1, pair)}.{os.getpid()}.{fixed.hex[:8]}.tmp"
    os.symlink(victim, tmp)
    with pytest.raises(TransportError, match="File exists"):
        job.send_all(t, step=1, seed=1)
    assert victim.read_bytes() == b"the victim's own bytes"
    assert not os.path.lexists(directory / file_name(1, pair))
    # the opener itself, on a plain planted file
    planted = tmp_path / "planted"
    planted.write_bytes(b"x")
    with pytest.raises(FileExistsError):
        open(planted, "wb", opener=private_opener)
    assert planted.read_bytes() == b"x"


def test_a_link_planted_at_a_frames_file_s_temporary_name_is_refused(tmp_path, monkeypatch):
    """Before: the frames file (a framed codec's payloads) was written by ``safetensors.save_file``, which follows a
    link at its temporary name and truncates what it points at. Now created 0600 with ``O_EXCL | O_NOFOLLOW``."""
    from weightsync.codec.delta import DeltaCodec
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import scatter
    from weightsync.plan.planner import Planner
    from weightsync.spec import load_spec
    from weightsync.testing import random_canonical
    from weightsync.payload.codec import Framing
    from weightsync.transport.file import FRAMES_SUFFIX

    spec = load_spec("tiny-qwen3")
    src, dst = make_layout(spec, "hf"), make_layout(spec, "vllm:tp=2")
    planner = Planner(src, dst, 1, bucket_bytes=24 << 10)
    codec = DeltaCodec()
    plans = planner.send_plan(0)
    tensors = scatter(src.layout(0), random_canonical(spec, 1))
    encoder = codec.encoder(plans, torch.device("cpu"))
    directory = tmp_path / "job"
    fixed = uuid.UUID(int=0xFEEDBEEF)
    monkeypatch.setattr(uuid, "uuid4", lambda: fixed)

    def step(n: int) -> None:
        with torch.no_grad():
            next(iter(tensors.values())).view(-1)[0] += 1  # a small change: the step's deltas are small
        FileTransport(directory).send(plans, tensors, frames=Framing(n, encoder, codec))

    with umask(0o022):
        step(0)  # no base yet: full files only
        step(1)
    frames = [n for n in os.listdir(directory) if n.endswith(FRAMES_SUFFIX)]
    assert frames, os.listdir(directory)
    assert {n: mode(directory / n) for n in os.listdir(directory)} == {n: 0o600 for n in os.listdir(directory)}
    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's own bytes")
    pair = sorted(plans)[0]
    os.symlink(victim, directory / f".{file_name(2, pair)}{FRAMES_SUFFIX}.{os.getpid()}.{fixed.hex[:8]}.tmp")
    with pytest.raises(TransportError, match="File exists"):
        step(2)
    assert victim.read_bytes() == b"the victim's own bytes"


# -- 7. job data on disk: the state database, logs, the soak's folders, checkpoints -----------------------------


def test_the_state_database_is_created_0600(tmp_path):
    """Before: the MetaServer's SQLite state (every job's participants, hosts, plans) and its -wal / -shm were 0644
    under the usual umask. An older server's 0644 database is narrowed when opened."""
    from weightsync.meta.store import Put, Store

    path = tmp_path / "meta.sqlite"
    with umask(0o022):
        s = Store(str(path))
        try:
            s.apply([Put("job", "participant", "t0", '"x"')])
            made = {n: mode(tmp_path / n) for n in os.listdir(tmp_path)}
        finally:
            s.close()
    assert {"meta.sqlite", "meta.sqlite-wal", "meta.sqlite-shm"} <= set(made), made
    assert set(made.values()) == {0o600}, made
    os.chmod(path, 0o644)  # as an older server left it
    s = Store(str(path))
    try:
        assert s.load()["job"].rows == [("participant", "t0", "x")]
    finally:
        s.close()
    assert mode(path) == 0o600


def test_the_soak_keeps_its_folders_logs_and_state_to_its_user(tmp_path):
    """Before: the soak's ``files/`` and ``logs/`` were 0755 and the MetaServer's log 0644. A real MetaServer
    process (the soak's own, as it runs one) writes its log and state database: both 0600."""
    from weightsync.soak.config import SoakConfig
    from weightsync.soak.driver import Soak

    with umask(0o022):
        soak = Soak(SoakConfig(seconds=1.0, workdir=str(tmp_path)))
        soak.meta.start()
        try:
            assert mode(tmp_path / "files") == 0o700 and mode(tmp_path / "logs") == 0o700
            assert mode(tmp_path / "logs" / "meta-server.log") == 0o600
            assert mode(tmp_path / "meta.sqlite") == 0o600
        finally:
            soak.meta.stop()


def say_hello(emit) -> None:
    """A participant that writes a line to its log."""
    print("hello from a participant", flush=True)


def test_participant_logs_are_created_0600(tmp_path):
    """Before: each participant's log (its job, hosts, ports, errors) was created 0644."""
    from weightsync.local.events import Participant
    from weightsync.local.runner import LocalJob, log_name

    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    with umask(0o022), LocalJob(deadline_s=120, log_dir=str(logs)) as job:
        job.add(Participant.trainer(0), say_hello)
        result = job.run()
    assert result.failure is None, result.failure
    path = logs / log_name(Participant.trainer(0))
    assert "hello from a participant" in path.read_text() and mode(path) == 0o600


def test_checkpoints_are_created_0600_in_a_0700_directory(tmp_path):
    """Before: ``save_checkpoint`` made its directory 0755 and every file 0644: the model, readable by any user."""
    from test_checkpoint_save import CHUNK, check_loaded, hf_trainer

    from weightsync.checkpoint import save_checkpoint

    spec, _, bound = hf_trainer("tiny-qwen3", seed=13)
    out = tmp_path / "ckpt"
    with umask(0o022):
        save_checkpoint(bound, out, chunk_bytes=CHUNK)
    assert mode(out) == 0o700
    files = os.listdir(out)
    assert any(n.endswith(".safetensors") for n in files) and "config.json" in files
    assert {n: mode(out / n) for n in files} == {n: 0o600 for n in files}
    check_loaded(out, spec, 13)
