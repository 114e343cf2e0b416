"""weightsync: move model weights from RL trainers to inference engines, resharding in place."""

__version__ = "0.1.0"
