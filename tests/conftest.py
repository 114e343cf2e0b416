import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)
# the suite sends its own functions (checks, faults) to real engine workers, which run only weightsync's own and
# those of the modules named here (weightsync.runtime.wire); the engines the tests start inherit it
os.environ.setdefault("WEIGHTSYNC_WORKER_CALLS", "test_*,e2e,helpers,engine_gpu,hf_models,mailbox_worker,"
                      "two_hosts_worker,vllm_harness,vllm_probe")

#: what kind of test each module holds, so a reader (and ``pytest -m KIND``) sees what is what:
#: unit: one process, no server; multiprocess: real process groups, worker processes or an HTTP server;
#: e2e: whole jobs (trainers, MetaServer, instances) or real inference engines; gpu: CUDA GPUs only
#: (a CUDA case inside another module carries the ``gpu`` marker itself). A new module is refused until
#: it is listed here.
KINDS = {
    "unit": ["test_spec", "test_arch", "test_engine_config", "test_roundtrip", "test_planner",
             "test_inference_rules", "test_batch_copy", "test_batch_copy_kernel", "test_sglang_layout", "test_transport_interface",
             "test_cli", "test_simulate", "test_checksum_fast", "test_delta_sender", "test_codec", "test_import_cycles",
             "test_repository",
             "test_fp8_quant", "test_fp8_config", "test_fp8_checkpoint",
             "test_fp8_layout", "test_fp8_codec", "test_lora_layout"],
    "multiprocess": ["test_p2p", "test_colocated", "test_file_transport", "test_fsdp_layout",
                     "test_megatron_layout", "test_engine_live", "test_hf_live", "test_bind", "test_instances",
                     "test_meta", "test_meta_faults", "test_meta_liveness", "test_meta_security", "test_sglang_instance", "test_baselines", "test_doorbell", "test_delta",
                     "test_checkpoint_save", "test_integrity", "test_free_port",
                     "test_reader_reports", "test_reader_faults", "test_hardening_files", "test_step_fences",
                     "test_reaper"],
    "e2e": ["test_runtime", "test_elastic", "test_trainer_group", "test_nixl", "test_delta_nixl", "test_demo", "test_local", "test_bench", "test_ckpt_engine", "test_sglang_probe",
            "test_two_hosts", "test_registration", "test_codec_cast",
            "test_soak", "test_vllm*", "test_lora_vllm", "test_fp8_vllm", "test_fp8_sync", "test_validate", "test_examples"],
    "gpu": ["test_gpu", "test_gpu_checksum", "test_fp8_gpu", "test_gpu_sglang"],
}


#: ``slow``: left out of ``make test`` (CI's 2-core budget, DEVELOPERS.md) and run by ``make test-all``: each
#: repeats, at a process or engine start's cost, what a faster test of ``make test`` already shows -- the
#: reason is beside it. Matched against the test's node id (file::name[params]).
SLOW = {
    "test_checkpoint_save.py::test_fsdp2_save[tiny-qwen3-fsdp:dp=4]":
        "FSDP2 saving is shown by the dp=2,tp=2 case (DTensor shards over two mesh dims); dp=4 adds ranks only",
    "test_runtime.py::test_end_to_end_bit_exact[tiny-qwen3-fsdp:dp=2-vllm:tp=2x2]":
        "fsdp:dp=2 -> vllm:tp=2 runs as the -fp32 case; two instances as tiny-qwen2-...x2",
    "test_runtime.py::test_end_to_end_bit_exact[tiny-deepseek-v3-hf-sglang:tp=2x1]":
        "the same job runs as the -fp32 case (the harder one: fp32 masters rounded on landing)",
    "test_runtime.py::test_end_to_end_bit_exact[tiny-llama3-fsdp:dp=2-vllm:tp=8x1]":
        "KV-head replication and vocab padding are layout facts, checked in process by test_roundtrip",
    "test_runtime.py::test_end_to_end_bit_exact[tiny-qwen3-megatron:pp=2-vllm:tp=4x1]":
        "Megatron PP over processes runs in the tp=2,pp=2,pp_first=3 case; the layout in test_roundtrip",
    "test_demo.py::test_fsdp2_with_tp_trains_and_syncs":
        "the FSDP2 demo runs in test_fsdp2_deepseek_keeps_its_fp32_router; FSDP2+TP jobs in test_runtime",
    "test_bench.py::test_every_scenario_rehearses_on_cpu[colo-tp2pp2-tp4]":
        "co-located PP+TP rehearses as colo-pp2-tp2; this one only adds ranks",
    "test_checkpoint_save.py::test_fsdp2_save[tiny-qwen3-moe-fsdp:dp=4]":
        "FSDP2 saving runs in the dp=2,tp=2 case; MoE experts are per-expert tensors sharded the same way",
    "test_runtime.py::test_end_to_end_bit_exact[tiny-qwen3-megatron:tp=2-sglang:tp=4,dp=2,dp_attention=1x1]":
        "SGLang DP-attention layouts: test_roundtrip in process, test_instances against live faithful workers",
    "test_runtime.py::test_end_to_end_bit_exact[tiny-qwen3-moe-megatron:ep=2,dp=2-vllm:tp=2,dp=2,ep=4x1]":
        "the EP layout pair runs in test_roundtrip; live Megatron EP ranks in test_checkpoint_save's ep=2 case",
    "test_vllm.py::TestMLA::test_offline_and_plugin_sync[tp1]":
        "the [tp2] case lands kv_b_proj and re-derives W_UK_T / W_UV on each rank from its own shard, the same "
        "code at TP=1 with one rank; landing into a TP=1 engine runs in TestQwen3TP1",
    "test_vllm_moe.py::TestQwen3MoeTP1::":
        "TestQwen3MoeTP2 lands the same experts (staged, re-prepacked, padded at TP=2) through both entry points, "
        "with weightsync.validate; TP=1 landing into a real engine runs in test_vllm.TestQwen3TP1",
    "test_fp8_sync.py::test_fsdp2_to_an_fp8_vllm_layout_over_file_colocated_and_nixl[file]":
        "the file transport's FP8 payload file is written and read by test_fp8_codec; whole FP8 jobs run over "
        "p2p, co-located and nixl",
}


def pytest_configure(config):
    """Start this process's reaper (tests/reaper.py): a crashed xdist worker runs no finaliser, and its engines
    outlived it (a TP=2 vLLM engine, 2.2 GB, 1.5 h later). Every process that runs tests gets one; the xdist
    controller runs none, its workers have theirs. ``WEIGHTSYNC_TEST_REAPER=0`` turns it off (to keep a crashed
    worker's processes for gdb); ``WEIGHTSYNC_TEST_REAPER_LOG=<file>`` logs what it killed."""
    if os.environ.get("WEIGHTSYNC_TEST_REAPER") == "0" or config.getoption("collectonly"):
        return
    if not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") != "no" \
            and getattr(config.option, "tx", None):
        return  # the xdist controller
    import reaper

    reaper.start(log=os.environ.get("WEIGHTSYNC_TEST_REAPER_LOG"))


def _stderr_fd(config) -> int:
    """The descriptor pytest's faulthandler writes to: the process's stderr as it was before output capture,
    which in an xdist worker is the controller's terminal (the worker's stdout goes to /dev/null)."""
    try:
        from _pytest.faulthandler import fault_handler_stderr_fd_key

        return config.stash[fault_handler_stderr_fd_key]
    except (ImportError, KeyError):
        return 2


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """A test past its timeout under xdist leaves every thread's stack on stderr. pytest-timeout's ``thread`` method
    writes its dump through the terminal writer, which in an xdist worker is the worker's stdout, sent to /dev/null
    by execnet: a hung test said only "node down: Not properly terminated" and "worker 'gw0' crashed while running
    <test>" (issue 40, item 10: a call into a dead vLLM engine that never returned, docs/testing.md). So here
    faulthandler's own watchdog -- a C thread, it needs no GIL -- dumps every thread's stack to stderr 2 s before
    pytest-timeout ends the worker. Returns None: pytest-timeout's own timer is set as before."""
    timeout = getattr(settings, "timeout", None)
    if timeout and getattr(settings, "method", None) == "thread" and hasattr(item.config, "workerinput"):
        import faulthandler

        faulthandler.dump_traceback_later(max(timeout - 2, timeout / 2), file=_stderr_fd(item.config))
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item):
    if hasattr(item.config, "workerinput"):
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
    return None


def _slow_key(key: str, nodeid: str) -> bool:
    """A :data:`SLOW` key names a test by its id's end, or a whole class by ``file::Class::``."""
    return nodeid.endswith(key) or (key.endswith("::") and f"/{key}" in f"/{nodeid}")


def _slow(nodeid: str) -> str | None:
    return next((why for key, why in SLOW.items() if _slow_key(key, nodeid)), None)


def _kind(module: str) -> str | None:
    for kind, names in KINDS.items():
        if any(module == n or (n.endswith("*") and module.startswith(n[:-1])) for n in names):
            return kind
    return None


def _keep_xdist_groups(config, items) -> None:
    """Keep ``xdist_group`` groups on one worker under ``--dist loadgroup``. pytest-xdist 3.8 marks a grouped
    test by appending ``@group`` to ``item._nodeid``, which pytest 9.2 no longer reads (a node's id is
    ``item._id``): the suffix never landed, every group was spread over the workers, and each worker started
    its own vLLM engines for the same class (seen: TestQwen3TP1's engines set up on gw0 and gw1). Do here what
    xdist means to do; a no-op where xdist's own suffix took, or outside a loadgroup worker."""
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # an older pytest: xdist's own suffix works there
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        kind = _kind(module)
        if kind is None:
            raise pytest.UsageError(f"{module}: say what kind of test it is in KINDS (tests/conftest.py)")
        item.add_marker(kind)
        if _slow(item.nodeid) is not None:
            item.add_marker("slow")
    missing = [key for key in SLOW if not any(_slow_key(key, i.nodeid) for i in items)]
    if missing and len(items) > 500:  # the whole suite collected: a renamed test must not leave SLOW silently
        raise pytest.UsageError(f"tests/conftest.py SLOW names tests that do not exist: {missing}")
    _keep_xdist_groups(config, items)


@pytest.fixture(autouse=True)
def _default_dtype_restored():
    """A test that changes torch's default dtype (vLLM's model loading sets it in-process) must not leak
    it into the tests that run after it on the same xdist worker."""
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


TINY = ["tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """One real safetensors checkpoint per tiny architecture, saved by transformers, with random weights."""
    from hf_models import read_checkpoint, save_checkpoint

    from weightsync.spec import load_spec
    from weightsync.testing import random_canonical

    out = {}
    for name in TINY:
        spec = load_spec(name)
        d = save_checkpoint(spec, random_canonical(spec, seed=hash(name) % 1000), tmp_path_factory.mktemp(name))
        out[name] = (spec, read_checkpoint(d))
    return out


@pytest.fixture(autouse=True)
def _collect_after(request):
    """Collect the garbage each test left right after it. Without this, a worker twice aborted inside the garbage
    collector during a later, unrelated test (a CI run: test_validate; here at -n 3: test_simulate), the collector
    destroying something an earlier test left in a reference cycle; the culprit is not found yet. With a collection
    after each test, four full runs (-n 2 once, -n 3 three times) had no crash; of five without it, two crashed
    (docs/testing.md). ``WEIGHTSYNC_TEST_GC=<file>`` also appends each test's node id to ``<file>.<worker>`` before
    its collection, so a crash there names the test whose garbage it was.

    What survives a collection is frozen (``gc.freeze``) after a test that imported modules or began another class or
    module: a worker that has imported vLLM, transformers and megatron-core holds ~470,000 objects, nearly all the
    modules' own, and a full collection over them took 0.4-0.6 s -- after every one of ~1,250 tests. Frozen, later
    collections go over what tests made since (microseconds for a unit test). The first test of another class or
    module unfreezes everything before its collection: the class- and module-scoped fixtures frozen with the
    modules (engines, servers, shared memory) were torn down by then, and their reference cycles are collected."""
    import gc

    yield
    scope = (request.node.module.__name__ if request.node.module else "", request.node.cls)
    if scope != _FROZEN_AT[1]:
        gc.unfreeze()  # another class or module: what the last one's fixtures held is garbage now
    path = os.environ.get("WEIGHTSYNC_TEST_GC")
    if not path:
        gc.collect()
    else:
        import time

        with open(f"{path}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}", "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} collect after {request.node.nodeid}\n")
            f.flush()
            gc.collect()
            f.write("  collected\n")
    if len(sys.modules) != _FROZEN_AT[0] or scope != _FROZEN_AT[1]:
        gc.freeze()
        _FROZEN_AT[:] = [len(sys.modules), scope]


_FROZEN_AT: list = [0, None]  # len(sys.modules) and the (module, class) of the last freeze (_collect_after)
