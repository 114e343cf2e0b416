"""Layout rules shared by the TP-style inference engines (vLLM and SGLang).

Both fuse q/k/v into ``qkv_proj`` ([q; k; v] per rank, KV heads replicated in consecutive rank
blocks when the attention TP size exceeds the KV head count), gate/up into ``gate_up_proj``
([gate; up] per rank), stack experts into ``w13_weight`` [E_local, 2I/moe_tp, H] (gate rows first)
and ``w2_weight`` [E_local, H, I/moe_tp], split row-parallel layers by columns and pad the
vocabulary. They differ in which group shards what (attention TP under DP attention, MoE TP versus
EP, the shared-expert fusion) and in a few names: the subclasses set those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from weightsync.engines.common import cols, even, pad_to, rows, stacked, vocab_shards, whole
from weightsync.errors import ConfigError
from weightsync.layout.box import full_box
from weightsync.layout.layout import EngineLayout, Group, Mesh, Piece, Shard
from weightsync.spec.records import TensorSpec
from weightsync.spec.roles import ATTENTION, GATED_MLP, Kind


@dataclass(frozen=True)
class Split:
    """Shard over dimension ``dim`` of ``mesh`` (replicated over its other dims); ``dim=None`` replicates."""

    mesh: Mesh
    dim: str | None = None

    @property
    def size(self) -> int:
        return self.mesh.sizes[self.dim] if self.dim else 1

    def group(self, index: int = 0, **more: int) -> Group:
        coords = dict(more)
        if self.dim:
            coords[self.dim] = index
        return self.mesh.group(**coords)

    def index(self, rank: int) -> int:
        return self.mesh.coords(rank)[self.dim] if self.dim else 0


class TPInferenceLayout(EngineLayout):
    """Base for vLLM/SGLang layouts; subclasses set the splits, names and expert placement."""

    expert_prefix = "mlp.experts."
    fused_qkv_a = "fused_qkv_a_proj"
    vocab_pad = 64

    # set by subclasses in __init__
    attn: Split
    mlp: Split
    shared: Split
    vocab: Split
    head: Split
    moe_tp: Split
    moe_ep: Split
    replicated: Split
    fuse_shared_expert = False

    # -- expert placement ----------------------------------------------------------------------
    def experts_on(self, ep_rank: int, num_experts: int) -> range:
        """Global experts held by one EP rank (contiguous blocks; the first ranks take any remainder)."""
        ep = self.moe_ep.size
        base, rem = divmod(num_experts, ep)
        start = ep_rank * base + min(ep_rank, rem)
        return range(start, start + base + (1 if ep_rank < rem else 0))

    def expert_slot(self, e: int, num_experts: int) -> tuple[int, int, int]:
        """(EP rank, local index, local expert count incl. a fused shared expert) of global expert ``e``."""
        ep = self.moe_ep.size
        base, rem = divmod(num_experts, ep)
        big = rem * (base + 1)
        p = e // (base + 1) if e < big else rem + (e - big) // base
        r = self.experts_on(p, num_experts)
        return p, e - r.start, len(r) + int(self.fuse_shared_expert)

    # -- checks -----------------------------------------------------------------------------------
    def _validate(self) -> None:
        a, spec = self.spec.attention, self.spec
        G = self.attn.size
        if a.num_heads % G:
            raise ConfigError(f"{self.engine}: num_attention_heads={a.num_heads} is not divisible by attention TP {G}")
        if a.kind == "gqa":
            kv = a.num_kv_heads
            if (G >= kv and G % kv) or (G < kv and kv % G):
                raise ConfigError(f"{self.engine}: num_key_value_heads={kv} and attention TP {G} do not divide one another")
        for s, what in ((self.vocab, "embedding"), (self.head, "lm_head")):
            if self._padded_vocab(s.size) % s.size:
                raise ConfigError(f"{self.engine}: padded vocab {self._padded_vocab(s.size)} not divisible by {what} TP {s.size}")
        for layer in spec.layers:
            if layer.moe:
                if layer.intermediate_size % self.moe_tp.size:
                    raise ConfigError(
                        f"{self.engine}: moe_intermediate_size={layer.intermediate_size} not divisible by MoE TP {self.moe_tp.size}"
                    )
                if layer.num_experts < self.moe_ep.size:
                    raise ConfigError(f"{self.engine}: {layer.num_experts} experts cannot fill EP={self.moe_ep.size}")
                if layer.shared_intermediate_size and not self.fuse_shared_expert and layer.shared_intermediate_size % self.shared.size:
                    raise ConfigError(f"{self.engine}: shared expert width not divisible by TP {self.shared.size}")
            elif layer.intermediate_size % self.mlp.size:
                raise ConfigError(
                    f"{self.engine}: intermediate_size={layer.intermediate_size} (layer {layer.index}) not divisible by TP {self.mlp.size}"
                )

    def _padded_vocab(self, parts: int) -> int:
        return pad_to(self.spec.vocab_size, self.vocab_pad)

    # -- layout -----------------------------------------------------------------------------------
    def canonical_names(self, rank: int) -> Iterable[str]:
        mine: dict[int, range] = {}
        ep_rank = self.moe_ep.index(rank)
        for t in self.spec.tensors:
            layer, e = t.role.layer, t.role.expert
            if e is not None:
                r = mine.get(layer)
                if r is None:
                    r = mine[layer] = self.experts_on(ep_rank, self.spec.layers[layer].num_experts)
                if e not in r:
                    continue
            yield t.name

    def _shards(self, canonical: str) -> Iterable[Shard]:
        spec = self.spec
        t = spec.tensor(canonical)
        role = t.role
        if role.kind == Kind.EMBED:
            return vocab_shards(self.vocab.group, canonical, spec, canonical, self._padded_vocab(self.vocab.size), self.vocab.size)
        if role.kind == Kind.LM_HEAD:
            return vocab_shards(self.head.group, canonical, spec, canonical, self._padded_vocab(self.head.size), self.head.size)
        if role.kind in (Kind.FINAL_NORM, Kind.INPUT_NORM, Kind.POST_ATTN_NORM):
            return [whole(self.replicated.group(), canonical, spec, canonical)]
        p = f"model.layers.{role.layer}."
        if role.kind in ATTENTION:
            return self._attention(p, t)
        if role.routed:
            return self._expert(t)
        if role.kind in GATED_MLP and role.shared:
            if self.fuse_shared_expert:
                return self._fused_shared(t)
            return self._mlp(p + "mlp.shared_experts.", t, self.shared)
        if role.kind in (Kind.ROUTER, Kind.ROUTER_BIAS):
            # canonical dtype: the model dtype for the router, fp32 for the correction bias
            return [whole(self.replicated.group(), canonical, spec, canonical)]
        if role.kind in GATED_MLP:
            return self._mlp(p + "mlp.", t, self.mlp)
        raise ConfigError(f"{self.engine}: no rule for canonical tensor {canonical} ({role})")

    # -- attention ------------------------------------------------------------------------------
    def _attention(self, p: str, t: TensorSpec) -> list[Shard]:
        a, spec, split = self.spec.attention, self.spec, self.attn
        canonical, role = t.name, t.role
        G = split.size
        out: list[Shard] = []
        if role.kind in (Kind.Q_NORM, Kind.K_NORM):  # per head, replicated
            return [whole(self.replicated.group(), canonical, spec, canonical)]
        if role.kind == Kind.O:
            return self._row_parallel(p + "self_attn.o_proj.weight", canonical, split)
        if a.kind == "gqa":
            kind = "bias" if role.bias else "weight"
            name = p + f"self_attn.qkv_proj.{kind}"
            q, k, v = (spec.tensor_of(role.sibling(x)) for x in (Kind.Q, Kind.K, Kind.V))
            hd, H = a.head_dim, spec.hidden_size
            kv_l = max(1, a.num_kv_heads // G)
            reps = max(1, G // a.num_kv_heads)
            for g in range(G):
                q_rows = even(a.num_heads * hd, G, g, "q rows")
                kv_rows = ((g // reps) * kv_l * hd, kv_l * hd)
                blocks = [(q.name, rows(q_rows, q.shape)), (k.name, rows(kv_rows, k.shape)), (v.name, rows(kv_rows, v.shape))]
                n_rows = q_rows[1] + 2 * kv_rows[1]
                shape = (n_rows, H) if kind == "weight" else (n_rows,)
                out += stacked(split.group(g), name, shape, spec.dtype, blocks, canonical)
            return out
        # MLA
        if role.kind in (Kind.Q_A, Kind.KV_A) and a.q_lora_rank:
            name = p + f"self_attn.{self.fused_qkv_a}.weight"
            parts = [spec.tensor_of(role.sibling(Kind.Q_A)), spec.tensor_of(role.sibling(Kind.KV_A))]
            shape = (sum(x.shape[0] for x in parts), spec.hidden_size)
            blocks = [(x.name, full_box(x.shape)) for x in parts]
            return stacked(self.replicated.group(), name, shape, spec.dtype, blocks, canonical)
        if role.kind in (Kind.Q_B, Kind.Q, Kind.KV_B):
            return self._col_parallel(canonical, canonical, split)
        return [whole(self.replicated.group(), canonical, spec, canonical)]  # norms, kv_a (no q lora)

    def _col_parallel(self, name: str, canonical: str, split: Split) -> list[Shard]:
        t = self.spec.tensor(canonical)
        out = []
        for g in range(split.size):
            box = rows(even(t.shape[0], split.size, g, f"{canonical} rows"), t.shape)
            shape = (box[0][1],) + t.shape[1:]
            out.append(Shard(split.group(g), Piece(name, full_box(shape), canonical, box), shape, t.dtype))
        return out

    def _row_parallel(self, name: str, canonical: str, split: Split) -> list[Shard]:
        t = self.spec.tensor(canonical)
        out = []
        for g in range(split.size):
            box = cols(even(t.shape[1], split.size, g, f"{canonical} columns"), t.shape)
            shape = (t.shape[0], box[1][1])
            out.append(Shard(split.group(g), Piece(name, full_box(shape), canonical, box), shape, t.dtype))
        return out

    # -- MLPs -------------------------------------------------------------------------------------
    def _mlp(self, prefix: str, t: TensorSpec, split: Split) -> list[Shard]:
        spec, canonical = self.spec, t.name
        if t.role.kind == Kind.DOWN:
            return self._row_parallel(prefix + "down_proj.weight", canonical, split)
        gate, up = spec.tensor_of(t.role.sibling(Kind.GATE)), spec.tensor_of(t.role.sibling(Kind.UP))
        I, H = gate.shape
        out = []
        for g in range(split.size):
            r = even(I, split.size, g, f"{gate.name} rows")
            blocks = [(gate.name, rows(r, (I, H))), (up.name, rows(r, (I, H)))]
            out += stacked(split.group(g), prefix + "gate_up_proj.weight", (2 * r[1], H), spec.dtype, blocks, canonical)
        return out

    def _expert(self, t: TensorSpec) -> list[Shard]:
        layer, e = t.role.layer, t.role.expert
        L = self.spec.layers[layer]
        ep_rank, local, count = self.expert_slot(e, L.num_experts)
        return self._expert_shards(t, local, count, ep_rank)

    def _fused_shared(self, t: TensorSpec) -> list[Shard]:
        """SGLang's shared-expert fusion: the shared expert is one more expert at the end of each block."""
        out = []
        for ep_rank in range(self.moe_ep.size):
            r = self.experts_on(ep_rank, self.spec.layers[t.role.layer].num_experts)
            out += self._expert_shards(t, len(r), len(r) + 1, ep_rank)
        return out

    def _expert_shards(self, t: TensorSpec, local: int, count: int, ep_rank: int) -> list[Shard]:
        """One expert's (or the fused shared expert's) gate/up/down as slot ``local`` of ``count`` stacked on an EP rank."""
        split, canonical = self.moe_tp, t.name
        p = f"model.layers.{t.role.layer}.{self.expert_prefix}"
        lead = ((local, 1),)
        ep_fixed = {self.moe_ep.dim: ep_rank} if self.moe_ep.dim else {}
        out = []
        for j in range(split.size):
            group = split.group(j, **ep_fixed)
            if t.role.kind == Kind.DOWN:
                box = cols(even(t.shape[1], split.size, j, f"{canonical} columns"), t.shape)
                shape = (count, t.shape[0], box[1][1])
                out.append(Shard(group, Piece(p + "w2_weight", lead + full_box(shape[1:]), canonical, box), shape, t.dtype))
            else:
                I, H = t.shape
                r = even(I, split.size, j, f"{canonical} rows")
                row = 0 if t.role.kind == Kind.GATE else r[1]
                shape = (count, 2 * r[1], H)
                piece = Piece(p + "w13_weight", lead + ((row, r[1]), (0, H)), canonical, rows(r, t.shape))
                out.append(Shard(group, piece, shape, t.dtype))
        return out

