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

from weightsync.engines.common import EXPERT_RE, LAYER_RE, cols, even, pad_to, rows, stacked, vocab_shards, whole
from weightsync.errors import ConfigError
from weightsync.layout.box import full_box
from weightsync.layout.layout import EngineLayout, Group, Mesh, Piece, Shard


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
            m = EXPERT_RE.match(t.name)
            if m:
                layer = int(m[1])
                r = mine.get(layer)
                if r is None:
                    r = mine[layer] = self.experts_on(ep_rank, self.spec.layers[layer].num_experts)
                if int(m[2]) not in r:
                    continue
            yield t.name

    def _shards(self, canonical: str) -> Iterable[Shard]:
        spec = self.spec
        if canonical == "model.embed_tokens.weight":
            return vocab_shards(self.vocab.group, canonical, spec, canonical, self._padded_vocab(self.vocab.size), self.vocab.size)
        if canonical == "lm_head.weight":
            return vocab_shards(self.head.group, canonical, spec, canonical, self._padded_vocab(self.head.size), self.head.size)
        if canonical == "model.norm.weight":
            return [whole(self.replicated.group(), canonical, spec, canonical)]
        m = LAYER_RE.match(canonical)
        if not m:
            raise ConfigError(f"{self.engine}: no rule for canonical tensor {canonical}")
        layer, rest = int(m[1]), m[2]
        p = f"model.layers.{layer}."
        if rest.startswith("self_attn."):
            return self._attention(p, rest[len("self_attn.") :], canonical)
        if rest.startswith("mlp.experts."):
            return self._expert(canonical)
        if rest.startswith("mlp.shared_experts."):
            if self.fuse_shared_expert:
                return self._fused_shared(canonical, layer)
            return self._mlp(p + "mlp.shared_experts.", canonical, self.shared)
        if rest.startswith("mlp.gate."):  # router weight, e_score_correction_bias
            return [whole(self.replicated.group(), canonical, spec, canonical, self._router_dtype(rest))]
        if rest.startswith("mlp."):
            return self._mlp(p + "mlp.", canonical, self.mlp)
        return [whole(self.replicated.group(), canonical, spec, canonical)]  # layer norms

    def _router_dtype(self, rest: str) -> str | None:
        return None  # canonical dtype: the model dtype for the router, fp32 for the correction bias

    # -- attention ------------------------------------------------------------------------------
    def _attention(self, p: str, what: str, canonical: str) -> list[Shard]:
        a, spec, split = self.spec.attention, self.spec, self.attn
        G = split.size
        out: list[Shard] = []
        if what.endswith("_norm.weight") and a.kind == "gqa":  # q_norm / k_norm per head
            return [whole(self.replicated.group(), canonical, spec, canonical)]
        if a.kind == "gqa":
            if what.startswith("o_proj"):
                return self._row_parallel(p + "self_attn.o_proj.weight", canonical, split)
            kind = "bias" if what.endswith("bias") else "weight"
            name = p + f"self_attn.qkv_proj.{kind}"
            hd, H = a.head_dim, spec.hidden_size
            kv_l = max(1, a.num_kv_heads // G)
            reps = max(1, G // a.num_kv_heads)
            for g in range(G):
                q_rows = even(a.num_heads * hd, G, g, "q rows")
                kv_rows = ((g // reps) * kv_l * hd, kv_l * hd)
                blocks = [
                    (p + f"self_attn.q_proj.{kind}", rows(q_rows, spec.tensor(p + f"self_attn.q_proj.{kind}").shape)),
                    (p + f"self_attn.k_proj.{kind}", rows(kv_rows, spec.tensor(p + f"self_attn.k_proj.{kind}").shape)),
                    (p + f"self_attn.v_proj.{kind}", rows(kv_rows, spec.tensor(p + f"self_attn.v_proj.{kind}").shape)),
                ]
                n_rows = q_rows[1] + 2 * kv_rows[1]
                shape = (n_rows, H) if kind == "weight" else (n_rows,)
                out += stacked(split.group(g), name, shape, spec.dtype, blocks, canonical)
            return out
        # MLA
        if what in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight") and a.q_lora_rank:
            name = p + f"self_attn.{self.fused_qkv_a}.weight"
            parts = [p + "self_attn.q_a_proj.weight", p + "self_attn.kv_a_proj_with_mqa.weight"]
            shapes = [spec.tensor(n).shape for n in parts]
            shape = (sum(s[0] for s in shapes), spec.hidden_size)
            blocks = [(n, full_box(s)) for n, s in zip(parts, shapes)]
            return stacked(self.replicated.group(), name, shape, spec.dtype, blocks, canonical)
        if what in ("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight"):
            return self._col_parallel(p + "self_attn." + what, canonical, split)
        if what == "o_proj.weight":
            return self._row_parallel(p + "self_attn.o_proj.weight", canonical, split)
        return [whole(self.replicated.group(), p + "self_attn." + what, spec, canonical)]  # norms, kv_a (no q lora)

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
    def _mlp(self, prefix: str, canonical: str, split: Split) -> list[Shard]:
        spec = self.spec
        if canonical.endswith("down_proj.weight"):
            return self._row_parallel(prefix + "down_proj.weight", canonical, split)
        gate, up = prefix_canon(canonical, "gate_proj"), prefix_canon(canonical, "up_proj")
        I, H = spec.tensor(gate).shape
        out = []
        for g in range(split.size):
            r = even(I, split.size, g, f"{gate} rows")
            blocks = [(gate, rows(r, (I, H))), (up, rows(r, (I, H)))]
            out += stacked(split.group(g), prefix + "gate_up_proj.weight", (2 * r[1], H), spec.dtype, blocks, canonical)
        return out

    def _expert(self, canonical: str) -> list[Shard]:
        m = EXPERT_RE.match(canonical)
        layer, e, proj = int(m[1]), int(m[2]), m[3]
        L = self.spec.layers[layer]
        ep_rank, local, count = self.expert_slot(e, L.num_experts)
        return self._expert_shards(layer, proj, canonical, local, count, dict(ep=ep_rank))

    def _fused_shared(self, canonical: str, layer: int) -> list[Shard]:
        """SGLang's shared-expert fusion: the shared expert is one more expert at the end of each block."""
        proj = canonical.rsplit(".", 2)[-2]
        out = []
        for ep_rank in range(self.moe_ep.size):
            r = self.experts_on(ep_rank, self.spec.layers[layer].num_experts)
            out += self._expert_shards(layer, proj, canonical, len(r), len(r) + 1, dict(ep=ep_rank))
        return out

    def _expert_shards(self, layer: int, proj: str, canonical: str, local: int, count: int, fixed: dict) -> list[Shard]:
        spec, split = self.spec, self.moe_tp
        t = spec.tensor(canonical)
        p = f"model.layers.{layer}.{self.expert_prefix}"
        lead = ((local, 1),)
        ep_fixed = {self.moe_ep.dim: fixed["ep"]} if self.moe_ep.dim else {}
        out = []
        for j in range(split.size):
            group = split.group(j, **ep_fixed)
            if proj == "down_proj":
                box = cols(even(t.shape[1], split.size, j, f"{canonical} columns"), t.shape)
                shape = (count, t.shape[0], box[1][1])
                out.append(Shard(group, Piece(p + "w2_weight", lead + full_box(shape[1:]), canonical, box), shape, t.dtype))
            else:
                I, H = t.shape
                r = even(I, split.size, j, f"{canonical} rows")
                row = 0 if proj == "gate_proj" else r[1]
                shape = (count, 2 * r[1], H)
                piece = Piece(p + "w13_weight", lead + ((row, r[1]), (0, H)), canonical, rows(r, t.shape))
                out.append(Shard(group, piece, shape, t.dtype))
        return out


def prefix_canon(canonical: str, proj: str) -> str:
    """The sibling canonical tensor (gate_proj/up_proj) of an MLP projection."""
    head, _, tail = canonical.rpartition(".")
    head = head.rsplit(".", 1)[0]
    return f"{head}.{proj}.{tail}"

