"""Hugging Face checkpoints from any training layout, written by the training ranks themselves.

:func:`save_checkpoint` (also ``WeightWriter.save_checkpoint``) writes a trainer's live weights as
sharded safetensors files with an index and ``config.json``: canonical names, shapes and dtypes, each
rank writing the tensors it owns, assembled window by window from the pieces the other ranks hold
(:mod:`weightsync.checkpoint.plan`), with memory bounded by ``2 * chunk_bytes`` per rank.
"""

from weightsync.checkpoint.plan import CheckpointPlan, make_plan
from weightsync.checkpoint.save import SaveResult, hf_config, save_checkpoint

__all__ = ["save_checkpoint", "SaveResult", "CheckpointPlan", "make_plan", "hf_config"]
