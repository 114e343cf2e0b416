"""One participant of a two-hosts job (tests/test_two_hosts.py), run inside a network namespace.

    python tests/two_hosts_worker.py '<json>'

The JSON names the ``role`` (``train`` or ``infer``), the MetaServer (``meta``, ``token``), the job and
its options; the participant writes what it saw (a JSON document) to ``out`` once its steps are done.

A training rank holds the layout-faithful tensors of its rank (``scatter`` of random canonical data,
re-filled in place every step as an optimizer would) behind a real :class:`WeightWriter`; the
inference instance is a :class:`FaithfulInstance` (one worker process per rank, NaN-poisoned) behind
a real :class:`WeightReader`, and checks every tensor bit for bit after each update. Both report
where the job placed them (hosts as registered, the planner's topology, which pairs cross hosts)
and whether any same-host shortcut (doorbells) was taken.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from e2e import check_step, step_canonical  # noqa: E402


def _pairs(shape, spec, instance: int) -> list[dict]:
    """Every bucket the job plans for ``instance``: its two ends' hosts in the job's topology."""
    planner = shape.planner(spec)
    top = planner.topology
    out = []
    for rank in range(planner.dst.world_size):
        for (src, inst, dst), buckets in planner.recv_plan(instance, rank).items():
            out.append({"src": src, "dst": dst, "nbytes": sum(b.nbytes for b in buckets),
                        "src_host": top.host(top.train_gpu(src)), "dst_host": top.host(top.infer_gpu(inst, dst))})
    return out


def _predicted(shape, spec, instance: int) -> dict:
    """The simulator's time for ``instance``'s plan with the NIC at its default speed and at a tenth of
    it: a plan whose every pair crosses hosts takes ten times as long on the slower NIC."""
    from dataclasses import replace

    from weightsync.predict.simulate import LinkModel, predict_seconds

    planner = shape.planner(spec)
    buckets = [b for rank in range(planner.dst.world_size) for bs in planner.recv_plan(instance, rank).values()
               for b in bs]
    fast = LinkModel(latency_s=0.0)
    slow = replace(fast, nic_bytes_per_s=fast.nic_bytes_per_s / 10)
    return {"nic": predict_seconds(buckets, planner.topology, fast),
            "nic_tenth": predict_seconds(buckets, planner.topology, slow)}


def _where(shape) -> dict:
    p = shape.placement
    placed = None if p is None else {"train": [list(x) for x in p.train], "infer": [list(x) for x in p.infer]}
    return {"placement": placed,
            "elastic": shape.elastic, "transport": shape.transport}


def train(a: dict) -> dict:
    from weightsync.bind import Bound
    from weightsync.engines import make_layout
    from weightsync.layout.materialize import fill_from, scatter
    from weightsync.runtime.writer import WeightWriter
    from weightsync.spec import load_spec

    spec = load_spec(a["model"])
    engine = make_layout(spec, a["train"])
    rank = a["rank"]
    layout = engine.layout(rank)
    bound = Bound(engine, rank, layout, scatter(layout, step_canonical(spec, 0)))
    writer = WeightWriter(bound, meta=a["meta"], job=a["job"], token=a["token"], transport=a["transport"],
                          host=a["host"], bucket_bytes=a["bucket_bytes"], timeout_s=a["timeout"]).connect()
    s = writer.session
    wrote = []
    for step in range(1, a["steps"] + 1):
        with torch.no_grad():
            fill_from(layout, bound.tensors, step_canonical(spec, step))  # in place, as an optimizer step
        writer.write(step)
        wrote.append(step)
    report = {"hostname": socket.gethostname(), "wrote": wrote, "shape": _where(s.shape),
              "held_bells": s.held_bells is not None, "written_bell": s.written_bell is not None,
              "sent_bytes": writer.bytes_per_step}
    if rank == 0:  # what the MetaServer holds (the driver, outside both namespaces, cannot reach it)
        c = writer.client
        # every rank's `written` of the last step recorded (the other trainer may still be recording its own: a
        # summary read before would show complete_step one behind, seen once in a full run at load 6)
        c.wait_written(a["steps"], timeout=a["timeout"])
        report["participants"] = [{k: getattr(p, k) for k in ("role", "rank", "instance", "host")} for p in c.participants()]
        report["summary"] = c.summary()
        report["group"] = _lookup(c, "group")
        report["bell_held_0"] = _lookup(c, "bell.held.0")
    writer.close()
    return report


def _lookup(client, name: str) -> str | None:
    from weightsync.meta.client import MetaTimeout

    try:
        return client.lookup(name, timeout=0.5)
    except MetaTimeout:
        return None


def infer(a: dict) -> dict:
    from weightsync.instances.faithful import FaithfulInstance
    from weightsync.runtime.reader import WeightReader
    from weightsync.spec import load_spec

    spec = load_spec(a["model"])
    instance = FaithfulInstance(dict(spec.config), a["infer"], fill=float("nan"), timeout_s=a["timeout"])
    try:
        poisoned = [p for p in instance.call(check_step, spec.name, a["infer"], 1) if p]
        reader = WeightReader(instance, meta=a["meta"], job=a["job"], token=a["token"], instance_id=0, instances=1,
                              transport=a["transport"], bucket_bytes=a["bucket_bytes"],
                              timeout_s=a["timeout"]).connect()
        s = reader.session
        steps = []
        for step in range(1, a["steps"] + 1):
            version = reader.update(step)
            problems = [p for p in instance.call(check_step, spec.name, a["infer"], step) if p]
            steps.append({"step": step, "version": version, "problems": problems})
        report = {"hostname": socket.gethostname(), "steps": steps, "poisoned_problems": len(poisoned),
                  "shape": _where(s.shape), "pairs": _pairs(s.shape, spec, 0),
                  "predicted": _predicted(s.shape, spec, 0),
                  "written_bells": s.written_bells is not None}
        reader.close()
        return report
    finally:
        instance.close()


def main() -> int:
    a = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    try:
        report = {"ok": True, **(train(a) if a["role"] == "train" else infer(a))}
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which fails the test with it
        report = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    report["seconds"] = time.perf_counter() - t0
    with open(a["out"] + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(a["out"] + ".tmp", a["out"])
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
