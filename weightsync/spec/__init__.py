"""Model specs: canonical tensors, with their roles, from an HF config.json (architectures in spec/arch/)."""

from weightsync.spec.arch import ARCHITECTURES, Architecture, architecture
from weightsync.spec.model import (
    ModelSpec,
    load_spec,
    preset_names,
    spec_from_config,
)
from weightsync.spec.records import Attention, Layer, TensorSpec
from weightsync.spec.roles import Kind, Role

__all__ = [
    "ARCHITECTURES", "Architecture", "Attention", "Kind", "Layer", "ModelSpec", "Role", "TensorSpec", "architecture",
    "load_spec", "preset_names", "spec_from_config",
]
