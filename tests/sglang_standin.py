"""A STAND-IN for one SGLang 0.5.14 TP worker's model, FP8 and MLA included (a test aid, not evidence that SGLang
works): a module tree whose parameters are those of weightsync's ``sglang`` layout as the engine holds it (names,
shapes, dtypes; ``quant=fp8``: e4m3 weights beside fp32 ``weight_scale_inv``), with the attributes weightsync reads
where SGLang 0.5.14 has them (docs/sglang.md §7, each with its file:line):

- ``quant_method`` objects named as SGLang's classes: ``Fp8LinearMethod`` (``block_quant``, ``quant_config.
  weight_block_size``, ``is_checkpoint_fp8_serialized``, ``use_marlin``, ``use_mxfp8``, ``w8a8_block_fp8_linear``: a
  function named as the GEMM SGLang picks; ``layers/quantization/fp8.py:321-367``), ``Fp8MoEMethod`` (a ``runner``
  whose ``runner_backend.value`` is ``"triton"``, ``:858-903, 1787-1815``), ``Fp8KVCacheMethod`` on each
  ``RadixAttention`` (``k_scale`` / ``v_scale`` parameters at 1.0, ``k_scale_float`` / ``v_scale_float``;
  ``kv_cache.py:32-85``), the unquantized methods;
- the scale parameters' ``format_ue8m0`` flag (False on Hopper; ``fp8.py:478, 1091-1092``);
- MLA attention (``self_attn``): ``kv_b_proj``, ``qk_nope_head_dim``, ``v_head_dim``, ``w_kc`` / ``w_vc`` (None until
  the first ``post_load_weights``), ``w_scale = 1.0`` (``models/deepseek_v2.py:1676-1682``);
- the root's ``post_load_weights``: a copy of 0.5.14's ``DeepseekV2WeightLoaderMixin.post_load_weights`` as it runs
  on CUDA for a bf16 or block-FP8 [128, 128] ``kv_b_proj`` (``models/deepseek_common/deepseek_weight_loader.py:
  411-624``: ``block_quant_dequant`` to bf16, split per head, ``bind_or_assign`` copies), counting its runs. Where
  SGLang 0.5.14's source is at hand, ``tests/test_sglang_fp8.py`` checks this copy against SGLang's own function.

Built by :func:`standin`; :func:`fresh` is a stand-in "fresh engine" on a checkpoint: its tensors set from the
checkpoint form, then ``post_load_weights`` once, as SGLang's load does (``model_loader/loader.py:799-820``).
"""

from __future__ import annotations

import types
from typing import Any, Mapping

import torch

from weightsync.layout.materialize import TORCH_DTYPES, fill_from, zero_uncovered


def bind_or_assign(target, source):
    """0.5.14 ``utils/common.py:3000-3005``."""
    if target is not None:
        target.copy_(source)
        return target
    return source


def block_quant_dequant(x_q_block, x_s, block_size, dtype):
    """0.5.14 ``layers/quantization/fp8_utils.py:1245-1265``."""
    block_n, block_k = block_size[0], block_size[1]
    *_, n, k = x_q_block.shape
    x_scale_repeat = x_s.repeat_interleave(block_n, dim=-2).repeat_interleave(block_k, dim=-1)
    x_scale_repeat = x_scale_repeat[..., :n, :k]
    return (x_q_block.to(torch.float32) * x_scale_repeat).to(dtype)


def cutlass_w8a8_block_fp8_linear_with_fallback(*a, **k):  # named as SGLang's CUTLASS block GEMM (never called)
    raise AssertionError("a stand-in GEMM")


def deepgemm_w8a8_block_fp8_linear_with_fallback(*a, **k):  # named as SGLang's DeepGEMM block GEMM
    raise AssertionError("a stand-in GEMM")


def flashinfer_gemm_w8a8_block_fp8_linear_with_fallback(*a, **k):  # Blackwell's FlashInfer GEMM (not examined)
    raise AssertionError("a stand-in GEMM")


class UnquantizedLinearMethod:
    pass


class UnquantizedEmbeddingMethod:
    pass


class UnquantizedFusedMoEMethod:
    pass


class Fp8Config:
    def __init__(self, block=(128, 128), serialized=True):
        self.weight_block_size = list(block)
        self.is_checkpoint_fp8_serialized = serialized
        self.activation_scheme = "dynamic"

    def get_name(self):
        return "fp8"


class Fp8LinearMethod:
    def __init__(self, cfg: Fp8Config, gemm=cutlass_w8a8_block_fp8_linear_with_fallback):
        self.quant_config = cfg
        self.block_quant = cfg.weight_block_size is not None
        self.is_checkpoint_fp8_serialized = cfg.is_checkpoint_fp8_serialized
        self.use_marlin = self.use_mxfp8 = False
        self.w8a8_block_fp8_linear = gemm


class Backend:
    def __init__(self, value):
        self.value = value


class Fp8MoEMethod:
    def __init__(self, cfg: Fp8Config, backend="triton"):
        self.quant_config = cfg
        self.block_quant = cfg.weight_block_size is not None
        self.use_mxfp8 = self.is_fp4_expert = self.with_bias = False
        self.runner = types.SimpleNamespace(runner_backend=Backend(backend))


class Fp8KVCacheMethod:
    def __init__(self, cfg: Fp8Config):
        self.quant_config = cfg


class Root(torch.nn.Module):
    """The model (``DeepseekV3ForCausalLM`` / ``LlamaForCausalLM`` ...): ``model``, ``lm_head``, and for MLA models
    ``post_load_weights`` (module docstring)."""

    def __init__(self, config: Mapping[str, Any], fp8: bool):
        super().__init__()
        self.config = types.SimpleNamespace(**config)
        self.quant_config = Fp8Config() if fp8 else None
        self.post_loads = 0
        self.num_fused_shared_experts = 0

    def post_load_weights(self, is_nextn: bool = False, weight_names=None) -> None:
        """0.5.14 ``deepseek_weight_loader.py:411-624`` for bf16 and block-FP8 [128, 128] ``kv_b_proj`` on CUDA."""
        self.post_loads += 1
        if not hasattr(self.config, "kv_lora_rank"):
            return
        for layer_id in range(self.model.start_layer, self.model.end_layer):
            self_attn = self.model.layers[layer_id].self_attn
            w = self_attn.kv_b_proj.weight
            if w.dtype == torch.float8_e4m3fn:
                block = self.quant_config.weight_block_size
                assert block == [128, 128]
                w = block_quant_dequant(w, self_attn.kv_b_proj.weight_scale_inv, block, torch.bfloat16)
            w_kc, w_vc = w.unflatten(0, (-1, self_attn.qk_nope_head_dim + self_attn.v_head_dim)).split(
                [self_attn.qk_nope_head_dim, self_attn.v_head_dim], dim=1)
            self_attn.w_kc = bind_or_assign(self_attn.w_kc, w_kc.transpose(1, 2).contiguous().transpose(1, 2))
            w_vc = w_vc.contiguous().transpose(1, 2)
            self_attn.w_vc = bind_or_assign(self_attn.w_vc, w_vc)


def _child(parent: torch.nn.Module, name: str, make=torch.nn.Module) -> torch.nn.Module:
    if name not in parent._modules:
        parent.add_module(name, make())
    return parent._modules[name]


def standin(model_config: Mapping[str, Any], layout: Any, fp8: bool, fill: float = float("nan"),
            gemm=cutlass_w8a8_block_fp8_linear_with_fallback, moe_backend: str = "triton") -> Root:
    """One rank's stand-in model for ``layout`` (a rank's layout as the engine holds it), tensors filled with
    ``fill`` (NaN: a stale byte shows); quant methods attached as SGLang 0.5.14 attaches them."""
    root = Root(model_config, fp8)
    cfg = root.quant_config
    for name, t in layout.tensors.items():
        *path, local = name.split(".")
        mod = root
        for part in path:
            mod = _child(mod, part)
        mod.register_parameter(local, torch.nn.Parameter(
            torch.full(t.shape, fill).to(TORCH_DTYPES[t.dtype]), requires_grad=False))
    for mname, mod in list(root.named_modules()):
        own = dict(mod.named_parameters(recurse=False))
        if "weight_scale_inv" in own:
            mod.quant_method = Fp8LinearMethod(cfg, gemm)
            own["weight_scale_inv"].format_ue8m0 = False
        elif "w13_weight_scale_inv" in own:
            mod.quant_method = Fp8MoEMethod(cfg, moe_backend)
            for s in ("w13_weight_scale_inv", "w2_weight_scale_inv"):
                own[s].format_ue8m0 = False
        elif "w13_weight" in own:
            mod.quant_method = UnquantizedFusedMoEMethod()
        elif mname.endswith(("embed_tokens", "lm_head")):
            mod.quant_method = UnquantizedEmbeddingMethod()
        elif "weight" in own and own["weight"].dim() == 2 and not mname.endswith("mlp.gate"):
            mod.quant_method = UnquantizedLinearMethod()
        if mname.endswith("self_attn"):
            attns = ("attn_mqa", "attn_mha") if hasattr(mod, "kv_b_proj") else ("attn",)
            for a in attns:
                att = _child(mod, a)
                att.k_scale = att.v_scale = att.k_scale_float = att.v_scale_float = None
                att.quant_method = None
                if fp8:  # Fp8Config.get_quant_method gives every RadixAttention an Fp8KVCacheMethod (fp8.py:308)
                    att.quant_method = Fp8KVCacheMethod(cfg)
                    att.k_scale = torch.nn.Parameter(torch.tensor(1.0), requires_grad=False)
                    att.v_scale = torch.nn.Parameter(torch.tensor(1.0), requires_grad=False)
                    att.k_scale_float = att.v_scale_float = 1.0
            if hasattr(mod, "kv_b_proj"):
                mod.qk_nope_head_dim = int(model_config["qk_nope_head_dim"])
                mod.v_head_dim = int(model_config["v_head_dim"])
                mod.w_kc = mod.w_vc = mod.w_scale_k = mod.w_scale_v = None
                mod.w_scale = 1.0
                mod.use_deep_gemm_bmm = False
    layers = root.model._modules.get("layers")
    if layers is not None:  # SGLang indexes them (self.model.layers[layer_id])
        root.model.layers = torch.nn.ModuleList([layers._modules[str(i)] for i in range(len(layers._modules))])
        root.model.start_layer, root.model.end_layer = 0, len(root.model.layers)
    return root


def load(root: Root, layout: Any, checkpoint: Mapping[str, torch.Tensor]) -> Root:
    """What SGLang's load leaves: the checkpoint's pieces in the parameters, then ``post_load_weights`` once (in
    ``load_weights``), then the quant methods' post-load steps (none changes these forms on Hopper)."""
    tensors = dict(root.named_parameters())
    with torch.no_grad():
        fill_from(layout, tensors, checkpoint)
        zero_uncovered(layout, tensors)  # vocab padding rows: a checkpoint load leaves them zero
        root.post_load_weights()
    return root


def fresh(model_config: Mapping[str, Any], layout: Any, checkpoint: Mapping[str, torch.Tensor], fp8: bool) -> Root:
    """A stand-in fresh engine on ``checkpoint`` (its form: :func:`weightsync.sglang.verify.checkpoint_form`)."""
    return load(standin(model_config, layout, fp8), layout, checkpoint)
