import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)

#: what kind of test each module holds, so a reader (and ``pytest -m KIND``) sees what is what:
#: unit: one process, no server; multiprocess: real process groups, worker processes or an HTTP server;
#: e2e: whole jobs (trainers, MetaServer, instances) or real inference engines; gpu: CUDA GPUs only
#: (a CUDA case inside another module carries the ``gpu`` marker itself). A new module is refused until
#: it is listed here.
KINDS = {
    "unit": ["test_spec", "test_arch", "test_engine_config", "test_roundtrip", "test_planner",
             "test_inference_rules", "test_batch_copy", "test_sglang_layout", "test_transport_interface",
             "test_cli", "test_simulate", "test_checksum_fast", "test_delta_sender", "test_codec", "test_import_cycles",
             "test_fp8_quant", "test_fp8_config", "test_fp8_checkpoint",
             "test_fp8_layout", "test_fp8_codec"],
    "multiprocess": ["test_p2p", "test_colocated", "test_file_transport", "test_fsdp_layout",
                     "test_megatron_layout", "test_engine_live", "test_hf_live", "test_bind", "test_instances",
                     "test_meta", "test_meta_faults", "test_meta_liveness", "test_meta_security", "test_sglang_instance", "test_baselines", "test_doorbell", "test_delta",
                     "test_checkpoint_save", "test_integrity", "test_free_port",
                     "test_reader_reports", "test_reader_faults"],
    "e2e": ["test_runtime", "test_elastic", "test_trainer_group", "test_nixl", "test_delta_nixl", "test_demo", "test_local", "test_bench", "test_ckpt_engine", "test_sglang_probe",
            "test_two_hosts", "test_registration",
            "test_soak", "test_vllm*", "test_fp8_vllm", "test_fp8_sync", "test_validate"],
    "gpu": ["test_gpu", "test_gpu_checksum", "test_fp8_gpu", "test_gpu_sglang"],
}


def _kind(module: str) -> str | None:
    for kind, names in KINDS.items():
        if any(module == n or (n.endswith("*") and module.startswith(n[:-1])) for n in names):
            return kind
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        kind = _kind(module)
        if kind is None:
            raise pytest.UsageError(f"{module}: say what kind of test it is in KINDS (tests/conftest.py)")
        item.add_marker(kind)


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
