import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)

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
