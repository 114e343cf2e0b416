"""Doorbells: a step rung in one process is seen by another on the host; the MetaServer stays the record."""

import multiprocessing as mp
import os
import time

import pytest

from weightsync.meta.client import MetaAborted, MetaClient, MetaTimeout
from weightsync.meta.server import MetaServer
from weightsync.runtime.doorbell import CHECK_S, Doorbell, open_bells, wait_rung


def _ring_later(path: str, steps: list[int], delay: float) -> None:
    bell = Doorbell(path)
    for s in steps:
        time.sleep(delay)
        bell.ring(s)


def _never(timeout: float) -> None:
    raise MetaTimeout("not ready")


def test_a_step_rung_in_another_process_ends_the_wait():
    bell = Doorbell()
    p = mp.get_context("spawn").Process(target=_ring_later, args=(bell.path, [1, 2], 0.2))
    p.start()
    try:
        wait_rung([bell], 2, timeout_s=30.0, poll=_never)
        assert bell.step == 2
    finally:
        p.join(30)
        bell.close()
    assert not os.path.exists(bell.path)  # the owner removes it


def test_a_fresh_bell_holds_no_step_not_even_0():
    bell = Doorbell()
    try:
        assert Doorbell(bell.path).step == -1
        with pytest.raises(MetaTimeout):
            wait_rung([bell], 0, timeout_s=0.1, poll=_never)
        bell.ring(0)
        wait_rung([Doorbell(bell.path)], 0, timeout_s=0.1, poll=_never)
    finally:
        bell.close()


def test_bells_of_another_host_are_not_opened():
    with MetaServer(port=0) as server:
        c = MetaClient(server.url, "j")
        here = Doorbell()
        try:
            c.publish("bell.a", here.address)
            c.publish("bell.b", "some-other-host:" + here.path)
            assert [b.path for b in open_bells(c, ["bell.a"], 5.0)] == [here.path]
            assert open_bells(c, ["bell.a", "bell.b"], 5.0) is None  # then the waiter long-polls the MetaServer
        finally:
            here.close()


def test_the_metaserver_ends_a_wait_the_bells_do_not():
    """A bell that never rings (a stale one, say) costs at most CHECK_S once the MetaServer has the step;
    an aborted job ends the wait at once; at the deadline the MetaServer's timeout names who is missing."""
    with MetaServer(port=0) as server:
        c = MetaClient(server.url, "j")
        c.register("train", 0)
        c.register("train", 1)
        silent = Doorbell()
        try:
            def poll(t):
                return c.wait_written(1, timeout=t)

            with pytest.raises(MetaTimeout, match='"ranks": \\[1\\]'):
                c.written(1, 1)
                wait_rung([silent], 1, timeout_s=0.3, poll=poll)
            with pytest.raises(MetaTimeout):  # no bells (a peer on another host): the MetaServer's wait alone
                wait_rung(None, 1, timeout_s=0.3, poll=poll)
            c.written(1, 0)
            wait_rung(None, 1, timeout_s=5.0, poll=poll)
            t0 = time.monotonic()
            wait_rung([silent], 1, timeout_s=30.0, poll=poll)
            assert time.monotonic() - t0 < CHECK_S + 5.0
            c.abort("the trainer failed")
            with pytest.raises(MetaAborted, match="the trainer failed"):
                wait_rung([silent], 2, timeout_s=30.0, poll=lambda t: c.wait_written(2, timeout=t))
        finally:
            silent.close()


def test_a_wait_that_ends_at_its_deadline_says_how_long_it_waited():
    """Before: "MetaTimeout: GET .../steps/1/written {...}: not ready after 0.0 s" after the whole wait (the
    MetaServer is asked once more at the deadline, with no time left; a trainer's written-then-held asks for the
    rest of its wait likewise)."""
    import re

    with MetaServer(port=0) as server:
        c = MetaClient(server.url, "j")
        c.register("train", 0)
        c.register("infer", 0, instance=0)
        silent = Doorbell()
        try:
            with pytest.raises(MetaTimeout) as e:
                wait_rung([silent], 1, timeout_s=1.0, poll=lambda t: c.wait_written(1, timeout=t))
        finally:
            silent.close()
        said = float(re.search(r"not ready after ([0-9.]+) s", str(e.value)).group(1))
        assert said >= 1.0, str(e.value)
        with pytest.raises(MetaTimeout) as e:  # the rank's written, then held: the held never comes
            c.written_until_held(1, 0, [0], timeout=0.5)
        said = float(re.search(r"not ready after ([0-9.]+) s", str(e.value)).group(1))
        assert said == 0.5, str(e.value)
