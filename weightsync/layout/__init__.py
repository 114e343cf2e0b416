"""Boxes, pieces and layouts: the vocabulary every engine and the planner share."""

from weightsync.layout.box import Box
from weightsync.layout.layout import (
    EngineLayout,
    Group,
    Layout,
    Mesh,
    Piece,
    Shard,
    TensorLayout,
    check_live,
    layout_digest,
)

__all__ = ["Box", "EngineLayout", "Group", "Layout", "Mesh", "Piece", "Shard", "TensorLayout", "check_live", "layout_digest"]
