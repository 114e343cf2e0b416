"""``megatron``: a Megatron-core GPTModel (0.16) as an RL trainer holds it, one rank at a time.

Every rule below was read from megatron-core 0.16.1 (paths relative to ``megatron/core``) and, for the
local spec, checked against real models built on CPU (tests/test_megatron_layout.py):

* Ranks (``parallel_state.py``, ``RankGenerator`` with the default order ``"tp-cp-ep-dp-pp"``, cp=1):
  the dense generator is (tp, dp, pp) fastest first; the expert generator is (etp, ep, edp, pp) with
  ``edp = tp*dp / (ep*etp)`` over the same ranks. Like every parallel size of ``weightsync plan``,
  ``etp`` defaults to 1 here (megatron-core's own default, ``expert_tensor_parallel_size=None``, is tp:
  pass ``etp=tp`` to mirror it).
* Layers per stage (``transformer/transformer_block.py`` ``get_num_layers_to_build`` and
  ``transformer/transformer_layer.py`` ``get_transformer_layer_offset``): even split, or uneven with
  ``num_layers_in_first/last_pipeline_stage`` (middle stages split the rest evenly); with virtual
  pipeline each stage's count is split over its ``vpp`` chunks, chunk ``c`` of pp rank ``p`` being
  virtual stage ``c*pp + p``. Validation as in ``TransformerConfig.__post_init__``.
* Names: the local spec (``models/gpt/gpt_layer_specs.py`` ``get_gpt_layer_local_spec``) or the TE
  spec (``get_gpt_layer_with_transformer_engine_spec``: input norm fused into
  ``linear_qkv.layer_norm_weight``, dense pre-MLP norm into ``mlp.linear_fc1.layer_norm_weight``,
  MoE layers keep ``pre_mlp_layernorm``; MLA keeps ``input_layernorm`` and fuses q/kv norms into
  ``linear_q_up_proj`` / ``linear_kv_up_proj``). With vpp>1 a rank holds one model per chunk and
  names are prefixed ``"{chunk}."``; layer numbers restart at 0 in each chunk.
* QKV (``transformer/attention.py`` ``SelfAttention.get_query_key_value_tensors``): per query group
  [its q heads; its k head; its v head], query groups split contiguously over TP.
* Gated MLP fc1 (``transformer/mlp.py`` ``apply_swiglu_sharded_factory``): per TP rank
  [gate shard; up shard]. fc2 / linear_proj are row-parallel: split by columns.
* MoE (``transformer/moe/``): ``mlp.router.weight`` [E, H] in params dtype, replicated;
  ``mlp.router.expert_bias`` an fp32 buffer (``router.py`` ``_maintain_float32_expert_bias``);
  EP rank r holds global experts [r*E/ep, (r+1)*E/ep) (``experts.py``), sequential
  ``local_experts.{k}.linear_fc{1,2}.weight`` or TE grouped ``linear_fc{1,2}.weight{k}``
  (``extensions/transformer_engine.py`` TEGroupedLinear), split over expert TP like a dense MLP.
  Shared experts (``moe/shared_experts.py``) are a dense MLP over tp.
* MLA (``transformer/multi_latent_attention.py``): q_up / q_proj / kv_up split by rows (heads) over
  tp, linear_proj by columns; q_down / kv_down are ``ColumnParallelLinear(gather_output=False)``
  with the local spec (row split over tp) but ``TELinear(parallel_mode='duplicated')`` with TE.
* Vocab: ``embedding.word_embeddings`` / ``output_layer`` are vocab-parallel over the vocab padded to
  a multiple of ``make_vocab_size_divisible_by * tp`` (Megatron training ``_vocab_size_with_padding``).
  Tied embeddings: no ``output_layer.weight`` when pp==1; with pp>1 the last stage holds a second
  copy (``models/common/language_module/language_module.py`` ``setup_embeddings_and_output_layer``).
* Dtypes: the trainer's model is wrapped in ``Float16Module`` (``transformer/module.py``), so every
  parameter is in the model dtype; only the router's expert_bias stays fp32.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from weightsync.engines.common import cols, even, pad_to, rows, stacked, vocab_shards, whole
from weightsync.engines.config import MegatronConfig
from weightsync.errors import ConfigError
from weightsync.layout.box import full_box
from weightsync.layout.layout import EngineLayout, Group, Mesh, Piece, Shard
from weightsync.spec.model import ModelSpec
from weightsync.spec.records import TensorSpec
from weightsync.spec.roles import ATTENTION, GATED_MLP, Kind, Role


class MegatronLayout(EngineLayout):
    engine = "megatron"
    keys = MegatronConfig.keys()

    def __init__(self, spec: ModelSpec, config: MegatronConfig | None = None, **options: int):
        self.config = c = MegatronConfig.of(config, **options)
        tp, pp, dp, ep, etp = c.tp, c.pp, c.dp, c.ep, c.etp
        self.tp, self.pp, self.vpp, self.dp, self.ep, self.etp = tp, pp, c.vpp, dp, ep, etp
        self.pp_first, self.pp_last, self.te, self.grouped = c.pp_first, c.pp_last, bool(c.te), bool(c.grouped)
        self.vocab_multiple = c.vocab_multiple
        self.edp = tp * dp // (ep * etp)
        self._check_model(spec)
        # parallel_state.py RankGenerator, order "tp-cp-ep-dp-pp" (cp=1), fastest first.
        self.dense = Mesh("dense", [("tp", tp), ("dp", dp), ("pp", pp)])
        self.expert = Mesh("expert", [("etp", etp), ("ep", ep), ("edp", self.edp), ("pp", pp)])
        super().__init__(spec, [self.dense, self.expert])
        self._place_layers(spec.num_layers)
        self.padded_vocab = pad_to(spec.vocab_size, c.vocab_multiple * tp)
        if self.padded_vocab // tp * (tp - 1) >= spec.vocab_size:
            # A local tensor holding only padding has no piece, so a layout cannot list it.
            raise ConfigError(
                f"megatron: vocab {spec.vocab_size} padded to {self.padded_vocab} leaves the last tp rank's "
                f"embedding/output_layer shard all padding; use a smaller vocab_multiple (now {c.vocab_multiple}) or tp"
            )

    # -- validation ---------------------------------------------------------------------------
    def _check_model(self, spec: ModelSpec) -> None:
        a, tp = spec.attention, self.tp

        def div(n: int, parts: int, what: str, why: str) -> None:
            if n % parts:
                raise ConfigError(f"megatron: {what}={n} is not divisible by {why}")

        div(a.num_heads, tp, "num_attention_heads", f"tp={tp}")
        if a.kind == "gqa":
            div(a.num_kv_heads, tp, "num_query_groups (num_key_value_heads)", f"tp={tp}")
        elif not self.te:  # local spec: q_down / kv_down are ColumnParallelLinear (row split over tp)
            if a.q_lora_rank:
                div(a.q_lora_rank, tp, "q_lora_rank", f"tp={tp} (local spec splits linear_q_down_proj)")
            div(a.kv_lora_rank + a.qk_rope_head_dim, tp, "kv_lora_rank+qk_rope_head_dim",
                f"tp={tp} (local spec splits linear_kv_down_proj)")
        for layer in spec.layers:
            if not layer.moe:
                div(layer.intermediate_size, tp, f"layer {layer.index} intermediate_size", f"tp={tp}")
                continue
            div(layer.num_experts, self.ep, f"layer {layer.index} num_experts", f"ep={self.ep}")
            div(layer.intermediate_size, self.etp, f"layer {layer.index} moe_intermediate_size", f"etp={self.etp}")
            if layer.shared_intermediate_size:
                div(layer.shared_intermediate_size, tp, f"layer {layer.index} shared expert size", f"tp={tp}")

    def _place_layers(self, L: int) -> None:
        """Per (pp rank, chunk): (first global layer, count), exactly as megatron-core 0.16 computes it."""
        pp, vpp = self.pp, self.vpp
        first = self.pp_first or None
        last = self.pp_last or None
        self.stages: dict[tuple[int, int], tuple[int, int]] = {}
        if first is None and last is None:
            # get_num_layers_to_build / get_transformer_layer_offset, even branch
            if L % pp:
                raise ConfigError(f"megatron: num_layers={L} is not divisible by pp={pp}")
            per_rank = L // pp
            if per_rank % vpp:
                raise ConfigError(f"megatron: layers per pp rank ({per_rank}) not divisible by vpp={vpp}")
            per_chunk, total = per_rank // vpp, L // vpp
            for p in range(pp):
                for c in range(vpp):
                    self.stages[p, c] = (c * total + p * per_chunk, per_chunk)
        else:
            # TransformerConfig.__post_init__ "Uneven PP" validation
            mid_layers, mid_stages = L, pp
            for n, what in ((first, "pp_first"), (last, "pp_last")):
                if n is None:
                    continue
                if n % vpp:
                    raise ConfigError(f"megatron: {what}={n} is not divisible by vpp={vpp}")
                mid_layers -= n
                mid_stages -= 1
            if mid_layers < 0 or bool(mid_layers) != bool(mid_stages):
                raise ConfigError(
                    f"megatron: num_layers={L} with pp_first={self.pp_first}, pp_last={self.pp_last} leaves "
                    f"{mid_layers} layers for {mid_stages} middle stages"
                )
            if mid_stages and mid_layers % mid_stages:
                raise ConfigError(f"megatron: {mid_layers} middle layers not divisible by {mid_stages} middle stages")
            if mid_stages and (mid_layers // mid_stages) % vpp:
                raise ConfigError(
                    f"megatron: {mid_layers // mid_stages} layers per middle stage not divisible by vpp={vpp}"
                )
            if vpp > 1 and not mid_stages:
                # get_transformer_layer_offset computes `x // middle_pipeline_stages` for pp_rank>0
                raise ConfigError("megatron: vpp>1 with no middle pipeline stage divides by zero in megatron-core 0.16")
            mid_per = mid_layers // mid_stages if mid_stages else 0
            f0, l0 = first or 0, last or 0
            for p in range(pp):
                n = mid_per
                if p == 0 and first is not None:
                    n = first
                if p == pp - 1 and last is not None:
                    n = last
                mid_rank = p if first is None else p - 1
                for c in range(vpp):
                    if vpp == 1:
                        off = 0 if p == 0 else mid_rank * mid_per + f0
                    else:
                        fc, lc, mc = f0 // vpp, l0 // vpp, mid_layers // vpp
                        total = fc + mc + lc
                        off = c * total if p == 0 else c * total + fc + mid_rank * (mc // mid_stages)
                    self.stages[p, c] = (off, n // vpp)
        owner: list[tuple[int, int, int] | None] = [None] * L
        for (p, c), (off, n) in sorted(self.stages.items()):
            for j in range(n):
                if off + j >= L or owner[off + j] is not None:
                    raise ConfigError(f"megatron: pipeline split places layer {off + j} twice or past the end")
                owner[off + j] = (p, c, j)
        if any(o is None for o in owner):
            missing = [i for i, o in enumerate(owner) if o is None]
            raise ConfigError(f"megatron: pipeline split leaves layers {missing} unplaced")
        self.owner: list[tuple[int, int, int]] = owner  # type: ignore[assignment]

    # -- names --------------------------------------------------------------------------------
    def _chunk(self, c: int) -> str:
        return f"{c}." if self.vpp > 1 else ""

    def _layer_prefix(self, layer: int) -> tuple[int, str]:
        p, c, j = self.owner[layer]
        return p, f"{self._chunk(c)}decoder.layers.{j}."

    def canonical_names(self, rank: int) -> Iterator[str]:
        spec = self.spec
        p = self.dense.coords(rank)["pp"]
        embed = spec.tensor_of(Role(Kind.EMBED)).name
        if p == 0:
            yield embed
        ep_rank = self.expert.coords(rank)["ep"]
        for c in range(self.vpp):
            off, n = self.stages[p, c]
            for i in range(off, off + n):
                per = spec.layers[i].num_experts // self.ep
                mine = range(ep_rank * per, (ep_rank + 1) * per)
                yield from (t.name for t in spec.layer_tensors(i) if t.role.expert is None or t.role.expert in mine)
        if p == self.pp - 1:
            yield spec.tensor_of(Role(Kind.FINAL_NORM)).name
            head = spec.by_role.get(Role(Kind.LM_HEAD))
            if head is not None:
                yield head.name
            elif self.pp > 1:  # tied: the last stage holds its own copy of the embedding as output_layer
                yield embed

    # -- shards -------------------------------------------------------------------------------
    def _shards(self, canonical: str) -> Iterable[Shard]:
        spec = self.spec
        t = spec.tensor(canonical)  # unknown names raise SpecError
        kind = t.role.kind
        if kind == Kind.EMBED:
            yield from self._vocab(canonical, 0, "embedding.word_embeddings.weight")
            if spec.tie_word_embeddings and self.pp > 1:
                yield from self._vocab(canonical, self.pp - 1, "output_layer.weight")
            return
        if kind == Kind.LM_HEAD:
            yield from self._vocab(canonical, self.pp - 1, "output_layer.weight")
            return
        if kind == Kind.FINAL_NORM:
            name = self._chunk(self.vpp - 1) + "decoder.final_layernorm.weight"
            yield whole(self.dense.group(pp=self.pp - 1), name, spec, canonical)
            return
        if t.role.layer is None:
            raise ConfigError(f"megatron: no rule for canonical tensor {canonical!r} ({t.role})")
        stage, pre = self._layer_prefix(t.role.layer)
        yield from self._layer_shards(t, stage, pre)

    def _vocab(self, canonical: str, stage: int, tensor: str) -> list[Shard]:
        chunk = 0 if stage == 0 and tensor.startswith("embedding") else self.vpp - 1
        name = self._chunk(chunk) + tensor
        groups = lambda t: self.dense.group(tp=t, pp=stage)  # noqa: E731
        return vocab_shards(groups, name, self.spec, canonical, self.padded_vocab, self.tp)

    def _replicated(self, stage: int, tensor: str, canonical: str, dtype: str | None = None) -> Shard:
        return whole(self.dense.group(pp=stage), tensor, self.spec, canonical, dtype)

    def _row_split(self, groups, tensor: str, canonical: str, parts: int) -> Iterator[Shard]:
        t = self.spec.tensor(canonical)
        for r in range(parts):
            box = rows(even(t.shape[0], parts, r, f"{canonical} rows"), t.shape)
            shape = (box[0][1],) + t.shape[1:]
            yield Shard(groups(r), Piece(tensor, full_box(shape), canonical, box), shape, t.dtype)

    def _col_split(self, groups, tensor: str, canonical: str, parts: int) -> Iterator[Shard]:
        t = self.spec.tensor(canonical)
        for r in range(parts):
            box = cols(even(t.shape[1], parts, r, f"{canonical} columns"), t.shape)
            shape = (t.shape[0], box[1][1])
            yield Shard(groups(r), Piece(tensor, full_box(shape), canonical, box), shape, t.dtype)

    def _gated_fc1(self, groups, tensor: str, t: TensorSpec, parts: int) -> Iterator[Shard]:
        """linear_fc1 = [gate shard; up shard] per TP rank (mlp.py apply_swiglu_sharded_factory)."""
        gate, up = (self.spec.tensor_of(t.role.sibling(k)).name for k in (Kind.GATE, Kind.UP))
        I, H = t.shape
        for r in range(parts):
            blk = even(I, parts, r, f"{t.name} rows")
            blocks = [(gate, rows(blk, (I, H))), (up, rows(blk, (I, H)))]
            yield from stacked(groups(r), tensor, (2 * blk[1], H), t.dtype, blocks, t.name)

    def _mlp(self, t: TensorSpec, groups, tensor: str, parts: int) -> Iterator[Shard]:
        """A gated MLP's gate/up/down canonical tensor onto linear_fc1/linear_fc2 (``tensor`` has a {fc} slot)."""
        if t.role.kind == Kind.DOWN:
            yield from self._col_split(groups, tensor.format(fc="linear_fc2"), t.name, parts)
        else:
            yield from self._gated_fc1(groups, tensor.format(fc="linear_fc1"), t, parts)

    def _layer_shards(self, t: TensorSpec, stage: int, pre: str) -> Iterator[Shard]:
        a, tp = self.spec.attention, self.tp
        canonical, role = t.name, t.role
        kind, layer = role.kind, self.spec.layers[role.layer]

        def tp_group(r: int) -> Group:
            return self.dense.group(tp=r, pp=stage)

        attn = pre + "self_attention."
        if kind == Kind.INPUT_NORM:
            fused = self.te and a.kind == "gqa"
            name = attn + "linear_qkv.layer_norm_weight" if fused else pre + "input_layernorm.weight"
            yield self._replicated(stage, name, canonical)
        elif kind == Kind.POST_ATTN_NORM:
            fused = self.te and not layer.moe
            name = pre + ("mlp.linear_fc1.layer_norm_weight" if fused else "pre_mlp_layernorm.weight")
            yield self._replicated(stage, name, canonical)
        elif kind == Kind.O:
            yield from self._col_split(tp_group, attn + "linear_proj.weight", canonical, tp)
        elif a.kind == "gqa" and kind in (Kind.Q, Kind.K, Kind.V):
            yield from self._qkv(t, tp_group, attn)
        elif kind in (Kind.Q_NORM, Kind.K_NORM):
            name = attn + ("q_layernorm.weight" if kind == Kind.Q_NORM else "k_layernorm.weight")
            yield self._replicated(stage, name, canonical)
        elif a.kind == "mla" and kind in ATTENTION:
            yield from self._mla(t, stage, tp_group, attn)
        elif role.routed:
            yield from self._experts(t, stage, pre)
        elif role.shared and kind in GATED_MLP:
            yield from self._mlp(t, tp_group, pre + "mlp.shared_experts.{fc}.weight", tp)
        elif kind == Kind.ROUTER:
            yield self._replicated(stage, pre + "mlp.router.weight", canonical)
        elif kind == Kind.ROUTER_BIAS:
            yield self._replicated(stage, pre + "mlp.router.expert_bias", canonical, "float32")
        elif role.dense_mlp:
            yield from self._mlp(t, tp_group, pre + "mlp.{fc}.weight", tp)
        else:
            raise ConfigError(f"megatron: no rule for canonical tensor {canonical!r} ({role})")

    def _qkv(self, t: TensorSpec, tp_group, attn: str) -> Iterator[Shard]:
        """linear_qkv rows per TP rank: for each local query group, its q heads, k head, v head."""
        a, tp, spec = self.spec.attention, self.tp, self.spec
        hd, ng = a.head_dim, a.num_kv_heads
        qpg = a.num_heads // ng
        local_groups = ng // tp
        tail = t.shape[1:]
        q, k, v = (spec.tensor_of(t.role.sibling(x)).name for x in (Kind.Q, Kind.K, Kind.V))
        name = attn + ("linear_qkv.bias" if t.role.bias else "linear_qkv.weight")
        shape = (local_groups * (qpg + 2) * hd,) + tail
        for r in range(tp):
            blocks = []
            for g in range(r * local_groups, (r + 1) * local_groups):
                blocks.append((q, rows((g * qpg * hd, qpg * hd), (0,) + tail)))
                blocks.append((k, rows((g * hd, hd), (0,) + tail)))
                blocks.append((v, rows((g * hd, hd), (0,) + tail)))
            yield from stacked(tp_group(r), name, shape, t.dtype, blocks, t.name)

    def _mla(self, t: TensorSpec, stage: int, tp_group, attn: str) -> Iterator[Shard]:
        tp, canonical, kind = self.tp, t.name, t.role.kind
        if kind in (Kind.Q_A, Kind.KV_A):
            name = attn + ("linear_q_down_proj.weight" if kind == Kind.Q_A else "linear_kv_down_proj.weight")
            if self.te:  # TELinear(parallel_mode="duplicated")
                yield self._replicated(stage, name, canonical)
            else:  # ColumnParallelLinear(gather_output=False)
                yield from self._row_split(tp_group, name, canonical, tp)
        elif kind in (Kind.Q_A_NORM, Kind.KV_A_NORM):
            if self.te:
                up = "linear_q_up_proj" if kind == Kind.Q_A_NORM else "linear_kv_up_proj"
                yield self._replicated(stage, attn + f"{up}.layer_norm_weight", canonical)
            else:
                name = attn + ("q_layernorm.weight" if kind == Kind.Q_A_NORM else "kv_layernorm.weight")
                yield self._replicated(stage, name, canonical)
        elif kind in (Kind.Q_B, Kind.Q, Kind.KV_B):
            name = {Kind.Q_B: "linear_q_up_proj", Kind.Q: "linear_q_proj", Kind.KV_B: "linear_kv_up_proj"}[kind]
            yield from self._row_split(tp_group, attn + name + ".weight", canonical, tp)
        else:
            raise ConfigError(f"megatron: no MLA rule for canonical tensor {canonical!r} ({t.role})")

    def _experts(self, t: TensorSpec, stage: int, pre: str) -> Iterator[Shard]:
        e = t.role.expert
        per = self.spec.layers[t.role.layer].num_experts // self.ep
        r, k = divmod(e, per)
        if self.grouped:  # TEGroupedMLP: linear_fc1.weight{k}
            tensor = pre + "mlp.experts.{fc}.weight" + str(k)
        else:  # SequentialMLP
            tensor = pre + f"mlp.experts.local_experts.{k}." + "{fc}.weight"

        def group(j: int) -> Group:
            return self.expert.group(etp=j, ep=r, pp=stage)

        yield from self._mlp(t, group, tensor, self.etp)
