"""``vllm``: the parameters of vLLM workers (rules read from vLLM 0.33.0, see docs/engines.md).

- World = tp * dp; rank = dp_rank * tp + tp_rank (vllm/distributed/parallel_state.py,
  initialize_model_parallel). Attention, dense MLPs, shared experts, embeddings, lm_head and norms
  are sharded over TP and replicated on every DP rank.
- MoE (vllm/model_executor/layers/fused_moe/config.py, FusedMoEParallelConfig.make): experts are
  spread over all tp*dp ranks: without expert parallelism every rank holds every expert with the
  intermediate size split tp*dp ways; with ``ep`` (enable_expert_parallel) each rank holds whole
  experts, a contiguous block, the first ``E % ep`` ranks one more (expert_map_manager.py,
  determine_expert_map, "linear" placement). Parameters live under ``mlp.experts.routed_experts.``.
- Vocab padded to a multiple of 64 and split evenly (vocab_parallel_embedding.py, pad_vocab_size).
- MLA (models/deepseek_v2.py): ``fused_qkv_a_proj`` = [q_a_proj; kv_a_proj_with_mqa] replicated;
  q_b_proj/q_proj/kv_b_proj split by heads, o_proj by columns. ``W_UK_T``/``W_UV`` are created after
  loading as views of kv_b_proj and are not part of the layout (see ``derived_tensors``).
- e_score_correction_bias is fp32; the router weight is in the model dtype.
"""

from __future__ import annotations

from weightsync.engines.config import VLLMConfig
from weightsync.engines.inference import Split, TPInferenceLayout
from weightsync.errors import ConfigError
from weightsync.layout.layout import Mesh
from weightsync.spec.model import ModelSpec


class VLLMLayout(TPInferenceLayout):
    engine = "vllm"
    keys = VLLMConfig.keys()
    expert_prefix = "mlp.experts.routed_experts."
    fused_qkv_a = "fused_qkv_a_proj"
    # parameters vLLM derives after loading (views of kv_b_proj for bf16): not written by a sync
    derived_tensors = (".mla_attn.mla_attn.W_UK_T", ".mla_attn.mla_attn.W_UV")

    def __init__(self, spec: ModelSpec, config: VLLMConfig | None = None, **options: int):
        self.config = c = VLLMConfig.of(config, **options)
        tp, dp, ep = c.tp, c.dp, c.ep
        world = tp * dp
        if ep > 1 and not spec.is_moe:
            raise ConfigError(f"vllm: ep={ep} given but {spec.name} has no experts")
        self.tp, self.dp, self.ep = tp, dp, ep
        dense = Mesh("dense", [("tp", tp), ("dp", dp)])
        moe = Mesh("moe", [("mtp", 1 if ep > 1 else world), ("ep", ep)])
        super().__init__(spec, [dense, moe])
        self.attn = self.mlp = self.shared = self.vocab = self.head = Split(dense, "tp")
        self.replicated = Split(dense)
        self.moe_tp, self.moe_ep = Split(moe, "mtp"), Split(moe, "ep")
        self._validate()
