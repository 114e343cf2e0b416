"""``sglang``: the parameters of SGLang workers (rules read from SGLang 0.5.23, see docs/engines.md).

Checked live against a real SGLang 0.5.14 engine at TP=1 (``SGLangInstance`` compares every rank's
``named_parameters()`` with these rules at set-up): Llama, Qwen3 and Qwen3-MoE matched (docs/sglang.md §0).
TP > 1, DP attention, EP and DeepSeek's MLA/shared-expert rules rest on the 0.5.23 CPU probe only.

- Without DP attention: world = tp * dp, dp independent replicas of a TP group.
- With DP attention (``dp_attention=1``, i.e. --enable-dp-attention / --attn-dp-size): world = tp;
  attention TP size A = tp / dp, attn_tp_rank = rank % A (runtime_context.py,
  derive_attention_ranks). Attention and the embedding are sharded over the attention-TP group;
  dense MLPs, lm_head (unless ``dp_lm_head=1``) and unfused shared experts over the full TP group.
  Llama and Qwen2 have no DP-attention code and are refused. (Such per-architecture facts live in
  each architecture's record, ``Architecture.sglang_*`` in weightsync/spec/arch/.)
- MoE: moe_tp = tp / ep, moe_tp_rank = rank % moe_tp, ep_rank = rank // moe_tp; contiguous expert
  blocks; w13 [E_local, 2I/moe_tp, H] gate first (layers/moe/fused_moe_triton/layer.py). For
  DeepSeek-V3 with ep=1 and 256 routed experts the shared expert is fused as one more expert at the
  end of each block (SGLang's default on NVIDIA GPUs, models/deepseek_v2.py
  shared_experts_fusion_disable_reason; ``fuse_shared=0`` mirrors --disable-shared-experts-fusion,
  ``fuse_shared=1`` --enforce-shared-experts-fusion for other expert counts).
  Qwen3-MoE treats every layer as MoE, so configs with mlp_only_layers are refused.
- Vocab padded to a multiple of 64, or of 64 * TP when that does not divide
  (layers/vocab_parallel_embedding.py).
- MLA: ``fused_qkv_a_proj_with_mqa`` = [q_a_proj; kv_a_proj_with_mqa] replicated; w_kc/w_vc are
  derived copies of kv_b_proj (post_load_weights) that an update must recompute.
"""

from __future__ import annotations

from weightsync.engines.common import pad_to
from weightsync.engines.config import SGLangConfig
from weightsync.engines.inference import Split, TPInferenceLayout
from weightsync.errors import ConfigError
from weightsync.layout.layout import Mesh
from weightsync.spec.model import ModelSpec


#: routed-expert counts SGLang fuses the shared expert for by default (models/deepseek_v2.py,
#: shared_experts_fusion_disable_reason: 256 is DeepSeek-V3/R1; 384 only for a Quark-quantized Kimi-K2.5,
#: which no unquantized layout is), with exactly one shared expert and moe_ep_size 1 on NVIDIA GPUs
FUSABLE_EXPERT_COUNTS = (256,)


def fusable_by_default(spec: ModelSpec) -> bool:
    """Whether SGLang 0.5.23 fuses this model's shared expert unless told otherwise (``fuse_shared=-1``)."""
    moe = [layer for layer in spec.layers if layer.moe]
    return bool(moe) and all(layer.num_experts in FUSABLE_EXPERT_COUNTS and layer.shared_experts == 1 for layer in moe)


class SGLangLayout(TPInferenceLayout):
    engine = "sglang"
    keys = SGLangConfig.keys()
    expert_prefix = "mlp.experts."
    fused_qkv_a = "fused_qkv_a_proj_with_mqa"

    def __init__(self, spec: ModelSpec, config: SGLangConfig | None = None, **options: int):
        self.config = c = SGLangConfig.of(config, **options)
        tp, dp, ep, dp_attention, dp_lm_head, fuse_shared = c.tp, c.dp, c.ep, c.dp_attention, c.dp_lm_head, c.fuse_shared
        arch = spec.arch  # what SGLang's model code for this architecture does (weightsync/spec/arch/)
        if dp_attention and not arch.sglang_dp_attention:
            raise ConfigError(f"sglang: {arch.name} has no DP-attention support in SGLang's model code")
        if arch.sglang_all_moe and not all(layer.moe for layer in spec.layers):
            raise ConfigError(f"sglang: SGLang's {arch.name} makes every layer MoE; mlp_only_layers is not supported")
        shared = [layer for layer in spec.layers if layer.shared_intermediate_size]
        if fuse_shared < 0:
            fuse_shared = int(bool(shared) and ep == 1 and arch.sglang_fuse_shared and fusable_by_default(spec))
        if fuse_shared and (not shared or any(layer.shared_experts != 1 for layer in shared)):
            raise ConfigError("sglang: shared-expert fusion needs exactly one shared expert")
        self.tp, self.dp, self.ep = tp, dp, ep
        self.dp_attention, self.dp_lm_head = dp_attention, dp_lm_head
        self.fuse_shared_expert = bool(fuse_shared)
        if dp_attention:
            A = tp // dp
            full = Mesh("tp", [("tp", tp)])
            attn = Mesh("attn", [("atp", A), ("adp", dp)])
            moe = Mesh("moe", [("mtp", tp // ep), ("ep", ep)])
            super().__init__(spec, [full, attn, moe])
            self.attn = self.vocab = Split(attn, "atp")
            self.head = self.vocab if dp_lm_head else Split(full, "tp")
        else:
            dense = Mesh("dense", [("tp", tp), ("dp", dp)])
            moe = Mesh("moe", [("mtp", tp // ep), ("ep", ep), ("dp", dp)])
            super().__init__(spec, [dense, moe])
            full = dense
            self.attn = self.vocab = self.head = Split(dense, "tp")
        self.mlp = self.shared = Split(self.meshes[full.name], "tp")
        self.replicated = Split(self.meshes[full.name])
        self.moe_tp, self.moe_ep = Split(moe, "mtp"), Split(moe, "ep")
        self._validate()
        for layer in spec.layers:
            if layer.moe and layer.num_experts % ep:
                raise ConfigError(f"sglang: {layer.num_experts} experts not divisible by ep={ep}")

    def _padded_vocab(self, parts: int) -> int:
        padded = pad_to(self.spec.vocab_size, self.vocab_pad)
        return padded if padded % parts == 0 else pad_to(self.spec.vocab_size, self.vocab_pad * parts)
