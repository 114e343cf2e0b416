"""WeightReader's background ``held`` reports: one the MetaServer refuses raises at the reader's next call,
``pull`` (async) as ``update`` (sync), before anything of that call moves (a real MetaServer)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from weightsync.meta.client import MetaClient, MetaError
from weightsync.meta.server import MetaServer
from weightsync.runtime.reader import WeightReader


class Untouched:
    """The instance: any use of it means the call went on past the failed report."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the reader called instance.{name}() before raising the failed held report")


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_failed_held_report_raises_at_the_next_call(mode):
    with MetaServer(port=0) as server:
        reader = WeightReader.__new__(WeightReader)  # the reporting half and the call's first steps: no workers
        reader.client, reader.instance_id, reader.timeout_s = MetaClient(server.url, "j"), 0, 10.0
        reader.mode, reader.staged, reader.instance = mode, False, Untouched()
        reader.version = None
        reader._announcer, reader._report_error, reader._next_pull = ThreadPoolExecutor(1), None, 0
        reader._report_lock = threading.Lock()
        reader._integrity_agreed = True
        # connected already, no doorbells, integrity off, a fixed-membership job (no incarnation)
        reader.session = SimpleNamespace(connected=True, check_alive=lambda: None, held_bell=None, incarnation=None,
                                         reads_after_written=False, options=SimpleNamespace(integrity=0))
        reader.client.join(0)
        reader.client.register("train", 0)
        reader.client.written(1, 0)
        reader._announce(1)
        reader._announcer.submit(lambda: None).result(timeout=10)  # went out, in the background
        assert reader.client.summary()["held"] == {"0": 1}
        reader.instance_id = 5  # never joined: the MetaServer refuses its report
        reader._announce(1)
        reader._announcer.submit(lambda: None).result(timeout=10)
        call = reader.pull if mode == "async" else lambda: reader.update(2)
        with pytest.raises(MetaError):
            call()
        with pytest.raises(AssertionError, match="before raising"):  # raised once: the next call goes on
            call()
        reader._announcer.shutdown()
