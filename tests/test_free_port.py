"""free_port() holds its port for the rendezvous: no other bind(0) on the host is handed it, the store binds it.

The flake this guards against (a fresh-clone ``make test``, test_baselines): free_port() used to bind port 0
and close the socket; until the spawned rank 0 bound its TCPStore there, seconds later, the kernel could give
the same port to another test's free_port() or to one of gloo's listeners, and two groups met in one store
(gloo: ``Connection closed by peer`` at connectFullMesh; its messages print ports byte-swapped, hence
"ports below the ephemeral range"). Real sockets, real TCPStores and gloo groups, in threads: seconds.
"""

from __future__ import annotations

import errno
import socket
import threading
import time

import pytest
import torch

from weightsync.errors import ConfigError
from weightsync.transport.group import free_port, new_group


def _old_free_port() -> int:
    """What free_port() did before: bind port 0, close, return the number (control)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bind_many(n: int) -> list[socket.socket]:
    """``n`` listeners on port 0, as gloo's devices make them (SO_REUSEADDR, loopback), all open at once."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        out.append(s)
    return out


def _collisions(ports: list[int], n: int) -> int:
    socks = _bind_many(n)
    try:
        return len(set(ports) & {s.getsockname()[1] for s in socks})
    finally:
        for s in socks:
            s.close()


def test_no_bind_to_port_zero_is_handed_a_held_port():
    """50 held ports, then 2000 listeners on port 0: none lands on a held port. The control (the old
    bind-and-close) collides: 100 such ports among 2000 listeners meet ~14 times on average (the
    kernel draws bind(0) ports at random from ~7000 odd ones), none with a chance of ~1e-6."""
    held = [free_port() for _ in range(50)]
    assert len(set(held)) == 50
    assert _collisions(held, 2000) == 0
    assert _collisions([_old_free_port() for _ in range(100)], 2000) > 0


def test_a_held_port_takes_a_store_and_a_gloo_group_but_no_plain_listener():
    port = free_port()
    with socket.socket() as s, pytest.raises(OSError) as e:  # a listener without SO_REUSEADDR: refused
        s.bind(("127.0.0.1", port))
    assert e.value.errno == errno.EADDRINUSE
    out: dict[int, torch.Tensor] = {}
    data = torch.randn(1000, generator=torch.Generator().manual_seed(5))

    def member(rank: int) -> None:
        g = new_group("127.0.0.1", port, rank, 2, "gloo", 20, name="held")
        if rank == 0:
            g.send([data.clone()], 1, 0).wait()
        else:
            got = torch.full((1000,), float("nan"))
            g.recv([got], 0, 0).wait()
            out[rank] = got
        g.barrier().wait()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert torch.equal(out[1], data)


def test_rank_0_on_a_port_another_process_listens_on_says_so():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"rank 0 cannot serve the rendezvous on port {port}.*free_port\(\)"):
            new_group("127.0.0.1", port, 0, 2, "gloo", 5, name="taken")


def test_two_jobs_set_up_groups_concurrently_many_times():
    """Two jobs, each 20 times: take a port, wait a while (their processes would be starting), then set a
    2-rank gloo group up on it (rank 0 serving the store); meanwhile a third party keeps binding port 0 (gloo listeners,
    other tests). Every store binds, every group moves its bytes. (With the old bind-and-close free_port this
    failed about one run in three here, rank 0's store finding its port taken; the test above is the
    deterministic proof.)"""
    stop = threading.Event()
    failures: list[str] = []

    def noise() -> None:
        held: list[socket.socket] = []
        while not stop.is_set():
            held += _bind_many(20)
            while len(held) > 400:
                held.pop(0).close()
            time.sleep(0.002)
        for s in held:
            s.close()

    def job(j: int) -> None:
        for i in range(20):
            port = free_port()
            time.sleep(0.05)
            try:
                got = {}
                x = torch.full((64,), float(j * 100 + i))

                def member(rank: int) -> None:
                    try:
                        g = new_group("127.0.0.1", port, rank, 2, "gloo", 20, name=f"job{j}.{i}")
                        if rank == 0:
                            g.send([x.clone()], 1, 0).wait()
                        else:
                            y = torch.full((64,), float("nan"))
                            g.recv([y], 0, 0).wait()
                            got[rank] = y
                    except Exception as e:  # noqa: BLE001
                        failures.append(f"job {j} round {i} rank {rank} port {port}: {e}")

                ts = [threading.Thread(target=member, args=(r,)) for r in range(2)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join(30)
                if not torch.equal(got.get(1, torch.empty(0)), x):
                    failures.append(f"job {j} round {i}: group on port {port} moved the wrong bytes")
            except Exception as e:  # noqa: BLE001
                failures.append(f"job {j} round {i} port {port}: {e}")

    n = threading.Thread(target=noise)
    n.start()
    try:
        jobs = [threading.Thread(target=job, args=(j,)) for j in range(2)]
        for t in jobs:
            t.start()
        for t in jobs:
            t.join(120)
    finally:
        stop.set()
        n.join()
    assert not failures, failures


def test_rank_0_closing_its_group_stops_every_members_beat_before_its_store_goes():
    """``close_group`` on group rank 0 (the store's host) tells the other members' beacons to stop and waits them out,
    so none beats against the store once rank 0's process exits (torch's store client would print a C++ warning with
    a stack on each member at the end of every job). A member's own close stops its own beacon."""
    from weightsync.transport import group as grp

    port = free_port()
    groups: dict[int, object] = {}

    def member(rank: int) -> None:
        groups[rank] = new_group("127.0.0.1", port, rank, 2, "gloo", 20, name="closing")

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    beacons = {r: grp._BEACONS[g] for r, g in groups.items()}
    assert all(b.is_alive() for b in beacons.values())
    t0 = time.monotonic()
    grp.close_group(groups[0])
    assert time.monotonic() - t0 < 1.0
    beacons[1].join(2.0)  # rank 1 read the close at its next beat
    assert not beacons[1].is_alive() and not beacons[0].is_alive()
    assert groups[1] in grp._BEACONS  # rank 1 has not closed yet: its own close stops nothing more, and raises nothing
    grp.close_group(groups[1])
    grp.close_group(groups[1])
    assert groups[1] not in grp._BEACONS
