"""Model specs: canonical tensors from an HF config.json."""

from weightsync.spec.model import (
    Attention,
    Layer,
    ModelSpec,
    TensorSpec,
    load_spec,
    preset_names,
    spec_from_config,
)

__all__ = ["Attention", "Layer", "ModelSpec", "TensorSpec", "load_spec", "preset_names", "spec_from_config"]
