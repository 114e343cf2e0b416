"""Roles: what a canonical tensor *is* in its model, as a record engines match on instead of its name.

An architecture module names its canonical tensors as its checkpoint does and gives each a
:class:`Role` (layer, kind, expert). Engine layouts decide placement from the role alone
(``Role(kind=Kind.Q, layer=3)`` is layer 3's query projection, whatever the checkpoint calls it), and
find a tensor's siblings (the ``up`` beside a ``gate``) with :meth:`ModelSpec.by_role`, so no engine
parses a tensor name and a new architecture that reuses these kinds needs no engine change.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class Kind(StrEnum):
    """The kinds of canonical tensor engines know placement rules for."""

    EMBED = "embed"  # token embedding [vocab, hidden]
    LM_HEAD = "lm_head"  # output projection [vocab, hidden] (absent when tied to the embedding)
    FINAL_NORM = "final_norm"  # the norm after the last layer
    INPUT_NORM = "input_norm"  # a layer's pre-attention norm
    POST_ATTN_NORM = "post_attn_norm"  # a layer's pre-MLP norm
    # attention (GQA: q, k, v, o, q_norm, k_norm; MLA: q or q_a/q_a_norm/q_b, kv_a/kv_a_norm/kv_b, o)
    Q = "q"
    K = "k"
    V = "v"
    O = "o"  # noqa: E741
    Q_NORM = "q_norm"  # per-head norm of q (Qwen3)
    K_NORM = "k_norm"
    Q_A = "q_a"  # MLA query down-projection (q_lora_rank)
    Q_A_NORM = "q_a_norm"
    Q_B = "q_b"  # MLA query up-projection
    KV_A = "kv_a"  # MLA joint kv down-projection with the rope key (kv_a_proj_with_mqa)
    KV_A_NORM = "kv_a_norm"
    KV_B = "kv_b"  # MLA kv up-projection
    # gated MLPs: dense, a routed expert (``expert`` set) or the shared experts (``shared``)
    GATE = "gate"
    UP = "up"
    DOWN = "down"
    ROUTER = "router"  # MoE gate weight [experts, hidden]
    ROUTER_BIAS = "router_bias"  # DeepSeek-V3's e_score_correction_bias [experts]


ATTENTION = frozenset({Kind.Q, Kind.K, Kind.V, Kind.O, Kind.Q_NORM, Kind.K_NORM, Kind.Q_A, Kind.Q_A_NORM, Kind.Q_B,
                       Kind.KV_A, Kind.KV_A_NORM, Kind.KV_B})
MLA = frozenset({Kind.Q_A, Kind.Q_A_NORM, Kind.Q_B, Kind.KV_A, Kind.KV_A_NORM, Kind.KV_B})
GATED_MLP = frozenset({Kind.GATE, Kind.UP, Kind.DOWN})


@dataclass(frozen=True, slots=True)
class Role:
    """One canonical tensor's place in the model: unique within a spec."""

    kind: Kind
    layer: int | None = None  # decoder layer; None for the embedding, final norm and lm_head
    expert: int | None = None  # routed expert index (MoE gate/up/down)
    shared: bool = False  # a shared expert's gate/up/down (DeepSeek)
    bias: bool = False  # the bias vector of the projection, not its weight (Qwen2's q/k/v)

    def sibling(self, kind: Kind) -> Role:
        """The same place with another kind: the ``up`` of a ``gate``, the ``k`` of a ``q``."""
        return replace(self, kind=kind)

    @property
    def routed(self) -> bool:
        return self.expert is not None

    @property
    def dense_mlp(self) -> bool:
        """A gate/up/down of a layer's dense MLP (not an expert's)."""
        return self.kind in GATED_MLP and self.expert is None and not self.shared

    def __str__(self) -> str:
        where = [] if self.layer is None else [f"layer {self.layer}"]
        if self.expert is not None:
            where.append(f"expert {self.expert}")
        if self.shared:
            where.append("shared expert")
        what = f"{self.kind.value}{' bias' if self.bias else ''}"
        return " ".join(where + [what])


__all__ = ["ATTENTION", "GATED_MLP", "MLA", "Kind", "Role"]
