"""``hf``: one rank holding a transformers 5.x model as it is built in memory.

transformers 5 keeps MoE experts stacked in memory (``mlp.experts.gate_up_proj`` [E, 2I, H] with
gate rows first, ``mlp.experts.down_proj`` [E, H, I]) while checkpoints keep per-expert tensors
(transformers/models/qwen3_moe/modeling_qwen3_moe.py, Qwen3MoeExperts: ``.chunk(2, dim=-1)`` gives
gate then up). DeepSeek-V3 keeps its router in fp32 (``_keep_in_fp32_modules_strict`` in
modeling_deepseek_v3.py). Tied embeddings appear once, as ``model.embed_tokens.weight``.
"""

from __future__ import annotations

from typing import Iterable

from weightsync.engines.common import whole
from weightsync.engines.config import HFConfig
from weightsync.layout.box import full_box
from weightsync.layout.layout import EngineLayout, Mesh, Piece, Shard
from weightsync.spec.model import ModelSpec
from weightsync.spec.roles import Kind


class HFLayout(EngineLayout):
    """``fp32=1``: the trainer keeps fp32 (master) weights of a bf16 model; they travel as fp32 and the
    receiver rounds them to its dtype, exactly as loading an fp32 checkpoint would."""

    engine = "hf"
    keys = HFConfig.keys()

    def __init__(self, spec: ModelSpec, config: HFConfig | None = None, **options: int):
        self.config = HFConfig.of(config, **options)
        self.mesh = Mesh("hf", [("rank", 1)])
        super().__init__(spec, [self.mesh])
        self._all = self.mesh.group()
        self.fp32 = bool(self.config.fp32)

    def _dtype(self, canonical: str) -> str:
        """The in-memory dtype: fp32 everywhere with ``fp32``, and for what transformers keeps in fp32 (DeepSeek's router)."""
        t = self.spec.tensor(canonical)
        if self.fp32 or t.role.kind in self.spec.arch.hf_fp32:
            return "float32"
        return t.dtype

    def canonical_names(self, rank: int) -> Iterable[str]:
        return (t.name for t in self.spec.tensors)

    def _shards(self, canonical: str) -> Iterable[Shard]:
        spec = self.spec
        t = spec.tensor(canonical)
        role = t.role
        if role.routed:  # stacked: mlp.experts.gate_up_proj [E, 2I, H] (gate rows first), mlp.experts.down_proj [E, H, I]
            layer, e = role.layer, role.expert
            L = spec.layers[layer]
            prefix = f"model.layers.{layer}.mlp.experts."
            if role.kind == Kind.DOWN:
                shape = (L.num_experts,) + t.shape
                yield Shard(self._all, Piece(prefix + "down_proj", ((e, 1),) + full_box(t.shape), canonical, full_box(t.shape)), shape, self._dtype(canonical))
            else:
                I, H = t.shape
                row = 0 if role.kind == Kind.GATE else I
                shape = (L.num_experts, 2 * I, H)
                yield Shard(self._all, Piece(prefix + "gate_up_proj", ((e, 1), (row, I), (0, H)), canonical, full_box(t.shape)), shape, self._dtype(canonical))
            return
        yield whole(self._all, canonical, spec, canonical, self._dtype(canonical))
