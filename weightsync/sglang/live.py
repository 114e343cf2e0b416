"""What an SGLang worker computes with, layer by layer, and how a step reaches it (SGLang 0.5.14 on CUDA).

weightsync's ``sglang`` layout (``quant=fp8``: :func:`weightsync.quant.layout.fp8_layout`) describes the parameters
as SGLang's weight loaders leave them: the checkpoint's form, fused and sharded. After loading, SGLang runs the
model's ``post_load_weights`` (inside ``load_weights``) and then every module's ``quant_method.
process_weights_after_loading`` (0.5.14 ``model_loader/loader.py:799-820``); a step that writes into the loaded form
reaches what the next forward pass reads only where those steps keep that form. At set-up every worker classifies
each layer once (:func:`classify`) into one of:

``in-place``
    The engine computes with the live parameter as loaded: steps land in it directly. Unquantized linears,
    embeddings and the Triton fused MoE on CUDA; norms, routers (``MoEGate``) and their fp32
    ``e_score_correction_bias``; and **block FP8** (checkpoint ``weight_block_size [128, 128]``) on every GEMM
    kernel SGLang picks on Hopper by default:

    - ``Fp8LinearMethod`` (``layers/quantization/fp8.py:321``): weight e4m3 ``[N, K]`` and ``weight_scale_inv`` fp32
      ``[ceil(N/128), ceil(K/128)]`` (``create_weights``, ``:409-506``). ``process_weights_after_loading_block_quant``
      (``:508-584``) on CUDA (not FNUZ, not CPU, not MXFP8) requantizes to UE8M0 only where
      ``should_deepgemm_weight_requant_ue8m0`` holds (``model_loader/utils.py:252-274``: DeepGEMM's JIT on *and*
      ``DEEPGEMM_SCALE_UE8M0``), and ``DEEPGEMM_SCALE_UE8M0 = DEEPGEMM_BLACKWELL`` (``layers/deep_gemm_wrapper/
      configurer.py:37-38``): False on Hopper. Then ``layer.weight.data = weight.data`` and ``layer.weight_scale_inv.
      data = weight_scale.data`` (``:571-572``) re-set each parameter over its own storage: nothing moves. The GEMM
      (``fp8_utils.py:_dispatch_auto_backend``, ``:489-507``: DeepGEMM where ``deep_gemm`` imports -- a stock install
      has ``sgl-deep-gemm`` -- else CUTLASS on sm90, else Triton) reads ``layer.weight`` / ``layer.weight_scale_inv``
      at call time (``apply``, ``:776-855``); DeepGEMM's and CUTLASS's re-layouts of the scale (TMA alignment,
      ``weight_scale.T``) are made per call, not stored.
    - ``Fp8MoEMethod`` (``:858``): ``w13_weight`` e4m3 ``[E, 2I, H]`` / ``w2_weight`` ``[E, H, I]`` and their
      ``*_scale_inv`` fp32 per 128 x 128 block and expert (``create_weights``, ``:905-1171``). On Hopper the runner is
      TRITON (``create_moe_runner``, ``:1787-1815``: DeepGEMM only with an all-to-all backend, DeepEP/Mooncake/NIXL,
      ``:889-903``); ``process_weights_after_loading_block_quant`` (``:1173-1401``) then changes nothing (the UE8M0
      requantization needs DeepGEMM experts and ``DEEPGEMM_SCALE_UE8M0``), and the Triton kernel reads the stacks and
      scales as loaded (``get_triton_quant_info``, ``:1817-1835``).

``constant``
    ``Fp8KVCacheMethod`` (``fp8.py:2169``, ``kv_cache.py:32-85``) gives every ``RadixAttention`` of an FP8 model the
    parameters ``k_scale`` / ``v_scale`` (scalars, -1 until loaded); with no KV scales in the checkpoint (what
    ``save_checkpoint(dir, quant="fp8")`` writes) ``process_weights_after_loading`` sets both to 1.0, in place. No
    layout tensor: nothing is sent for them, and a fresh engine holds the same 1.0.

``derived``
    MLA attention's ``w_kc`` / ``w_vc``: plain tensor attributes (not parameters) that the model's
    ``post_load_weights`` (``models/deepseek_common/deepseek_weight_loader.py:411-624``) derives from ``kv_b_proj``:
    from its bf16 weight as it is, from a block-FP8 one (``[128, 128]`` on CUDA) dequantized to bf16 with
    ``block_quant_dequant`` (``fp8_utils.py:1245-1265``: ``(w.float() * scale repeated per block).to(bf16)``,
    ``:512-530``), unless ``SGL_USE_DEEPGEMM_BMM`` (off by default), then split per head and written with
    ``bind_or_assign`` (``utils/common.py:3000-3005``: ``copy_`` into the tensors the first load made), so their
    storage never moves (CUDA graphs stay valid). For block ``[128, 128]`` ``w_scale`` stays ``1.0``. weightsync
    re-runs ``post_load_weights`` once after every update (:func:`refresh`); the derivation is a pure function of
    ``kv_b_proj`` in these forms, and every derived tensor's storage is checked unmoved after each run.

Refused at set-up, naming the layer (the engine keeps serving; nothing is written): per-tensor or channel FP8
(``Fp8LinearMethod`` without ``weight_block_size`` re-registers ``weight.t()`` after loading, ``:664-773``;
``Fp8MoEMethod`` without it requantizes ``w13`` to one scale per expert, ``:1585-1711``), FP8 quantized online from a
bf16 checkpoint, UE8M0 (DeepGEMM on Blackwell: ``requant_weight_ue8m0_inplace`` replaces the scale with packed int32,
``fp8_utils.py:1268-1303``), MXFP8, MXFP4/NVFP4 and every other quant method, FP8 experts on any runner but
TRITON (FlashInfer TRT-LLM re-lays them, DeepGEMM with an all-to-all backend, CUTLASS, Marlin, AITER), Marlin
linears, ROCm's e4m3fnuz and AITER shuffles, Intel AMX packing, KV-cache scales loaded from a checkpoint, MLA
attention without derived tensors to copy into, and any unquantized-MoE re-layout weightsync does not produce
(``triton_kernels`` transposed, flashinfer CUTLASS ``[up; gate]``, TRT-LLM blocks, interleaved SwiGLU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from weightsync.engines.live_report import LayerPath, LayerPaths
from weightsync.errors import WeightsMoved

IN_PLACE = "in-place"
CONSTANT = "constant"
DERIVED = "derived"
PATHS = (IN_PLACE, CONSTANT, DERIVED)

#: SGLang's block-FP8 GEMM functions (``Fp8LinearMethod.w8a8_block_fp8_linear``) that read the checkpoint form as
#: loaded (0.5.14 ``fp8_utils.py``: DeepGEMM -- without UE8M0 --, CUTLASS, Triton and FlashInfer's DeepGEMM for sm90)
FP8_AS_LOADED = ("deepgemm_w8a8_block_fp8_linear_with_fallback", "cutlass_w8a8_block_fp8_linear_with_fallback",
                 "triton_w8a8_block_fp8_linear", "flashinfer_deepgemm_w8a8_block_fp8_linear_with_fallback")
#: fused-MoE runners that read block-FP8 experts as loaded
FP8_MOE_AS_LOADED = ("triton",)
#: the tensor attributes an MLA attention derives in ``post_load_weights`` (those that are tensors are checked)
MLA_DERIVED = ("w_kc", "w_vc", "w_scale", "w_scale_k", "w_scale_v")
_FP8_LINEAR_PARAMS = ("weight", "weight_scale_inv", "bias")
_FP8_MOE_PARAMS = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")
_PLAIN = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


@dataclass(frozen=True)
class Derived:
    """One derived tensor attribute as bound at set-up: where it lives and its storage."""

    layer: str
    attr: str
    ptr: int
    shape: tuple[int, ...]
    dtype: str


@dataclass
class LiveReport(LayerPaths):
    """What :func:`classify` decided for one worker."""

    paths: ClassVar[tuple[str, ...]] = PATHS
    layers: list[LayerPath] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    #: parameters the engine holds that no layout tensor has (``constant``: KV-cache scales), excluded from the check
    constants: list[str] = field(default_factory=list)
    derived: list[Derived] = field(default_factory=list)


def _fnuz() -> bool:
    """Whether SGLang converts e4m3fn to e4m3fnuz after loading here (ROCm MI300): never on CUDA."""
    try:
        from sglang.srt.layers.quantization.fp8_kernel import is_fp8_fnuz
    except Exception:  # noqa: BLE001 -- no SGLang (a stand-in) or another layout of it: CUDA's answer
        return False
    return bool(is_fp8_fnuz())


def _backend_name(qm: Any) -> str:
    """The fused-MoE runner an FP8 MoE method computes with: its ``MoeRunner``'s backend (``create_moe_runner``), else
    SGLang's global choice (CUTLASS, FlashInfer and the rest build no ``MoeRunner`` there)."""
    backend = getattr(getattr(qm, "runner", None), "runner_backend", None)
    if backend is None:
        try:
            from sglang.srt.layers.moe.utils import get_moe_runner_backend

            backend = get_moe_runner_backend()
        except Exception:  # noqa: BLE001 -- no SGLang (a stand-in)
            return "?"
    return str(getattr(backend, "value", backend))


def _blocks(t: torch.Tensor) -> tuple[int, ...]:
    """The checkpoint's ``scale_inv`` shape of a weight ``t``: the last two dims counted in 128 blocks."""
    return (*t.shape[:-2], *(math.ceil(d / 128) for d in t.shape[-2:]))


class _Classifier:
    def __init__(self, model: torch.nn.Module, fp8: bool, aiter: bool):
        self.model, self.fp8, self.aiter = model, fp8, aiter
        self.report = LiveReport()
        self.names = {id(p): n for n, p in model.named_parameters()}

    def run(self) -> LiveReport:
        for mname, mod in self.model.named_modules():
            params = {local: self.names[id(p)] for local, p in mod.named_parameters(recurse=False)
                      if id(p) in self.names}
            self._classify(mname, mod, params)
        return self.report

    def _refuse(self, mname: str, why: str) -> None:
        self.report.refusals.append(f"{mname}: {why}")

    def _path(self, mname: str, path: str, params: dict[str, str], detail: str) -> None:
        self.report.layers.append(LayerPath(mname, path, tuple(params.values()), detail))

    def _classify(self, mname: str, mod: torch.nn.Module, params: dict[str, str]) -> None:
        kind = type(mod).__name__
        if getattr(mod, "use_intel_amx_backend", False):
            return self._refuse(mname, "weights packed for Intel AMX on CPU (amx_utils.py, parameters replaced)")
        if hasattr(mod, "kv_b_proj") and hasattr(mod, "w_kc"):
            self._mla(mname, mod, kind)
        qm = getattr(mod, "quant_method", None)
        if qm is None:
            if params:
                self._path(mname, IN_PLACE, params, f"{kind}: read as loaded")
            return None
        method = type(qm).__name__
        if method in _PLAIN:
            return self._path(mname, IN_PLACE, params, f"{kind}: {method} reads its parameters as loaded on CUDA")
        if method == "UnquantizedFusedMoEMethod":
            return self._experts(mname, params, qm)
        if method == "Fp8LinearMethod":
            return self._fp8_linear(mname, mod, params, qm, kind)
        if method == "Fp8MoEMethod":
            return self._fp8_experts(mname, mod, params, qm)
        if method == "Fp8KVCacheMethod":
            return self._kv_scales(mname, mod, params)
        self._refuse(mname, f"quant method {method} (its process_weights_after_loading form is not the sglang layout: "
                            "weightsync lands block FP8 [128, 128] and unquantized weights only)")

    # -- per kind ---------------------------------------------------------------------------------------
    def _experts(self, mname: str, params: dict[str, str], qm: Any) -> None:
        why = [w for flag, w in (
            ("use_triton_kernels", "triton_kernels MoE backend stores w13/w2 transposed"),
            ("load_up_proj_weight_first", "flashinfer_cutlass MoE backend loads w13 as [up; gate]"),
            ("use_flashinfer_trtllm_moe", "flashinfer TRT-LLM MoE backend re-lays w13/w2 into blocks after loading "
                                          "(0.5.14 has no session that undoes it)"),
            ("w13_swiglu_interleaved", "SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED interleaves w13 rows, which no session "
                                       "undoes"),
        ) if getattr(qm, flag, False)]
        if self.aiter:
            why.append("AITER shuffles w13/w2 after loading, which no session undoes")
        for w in why:
            self._refuse(mname, w)
        if not why:
            self._path(mname, IN_PLACE, params, "fused MoE, UnquantizedFusedMoEMethod: w13/w2 read as loaded")

    def _not_fp8_layout(self, mname: str, what: str) -> bool:
        if self.fp8:
            return False
        self._refuse(mname, f"{what} served in block FP8, but the job's layout for this engine is not quant=fp8")
        return True

    def _fp8_linear(self, mname: str, mod: torch.nn.Module, params: dict[str, str], qm: Any, kind: str) -> None:
        cfg = getattr(qm, "quant_config", None)
        block = list(getattr(cfg, "weight_block_size", None) or ())
        kernel = getattr(getattr(qm, "w8a8_block_fp8_linear", None), "__name__", "?")
        w, s = getattr(mod, "weight", None), getattr(mod, "weight_scale_inv", None)
        what = f"{kind} with Fp8LinearMethod"
        if not getattr(qm, "block_quant", False):
            return self._refuse(mname, f"{what} in per-tensor/channel FP8 (no weight_block_size): its "
                                       "process_weights_after_loading re-registers weight.t() and new scales "
                                       "(fp8.py:664-773); weightsync syncs block FP8 [128, 128] only")
        if getattr(qm, "use_mxfp8", False):
            return self._refuse(mname, f"{what} in MXFP8 (uint8 UE8M0 scales per 1 x 32): not synced")
        if block != [128, 128]:
            return self._refuse(mname, f"{what}: weight_block_size {block}; only [128, 128] is synced")
        if not getattr(qm, "is_checkpoint_fp8_serialized", False):
            return self._refuse(mname, f"{what} quantized online from a bf16 checkpoint: serve a block-FP8 "
                                       "checkpoint (save_checkpoint(dir, quant='fp8'))")
        if getattr(qm, "use_marlin", False):
            return self._refuse(mname, f"{what} on Marlin: it repacks the weight after loading")
        if _fnuz():
            return self._refuse(mname, f"{what}: this platform converts e4m3fn to e4m3fnuz after loading (ROCm)")
        if not isinstance(w, torch.Tensor) or not isinstance(s, torch.Tensor) or w.dtype != torch.float8_e4m3fn \
                or s.dtype != torch.float32 or getattr(s, "format_ue8m0", False) or tuple(s.shape) != _blocks(w):
            got = "missing" if not isinstance(s, torch.Tensor) else f"{list(s.shape)} {str(s.dtype).removeprefix('torch.')}"
            return self._refuse(mname, f"{what} on {kernel}: weight_scale_inv is {got}"
                                       f"{' in UE8M0' if getattr(s, 'format_ue8m0', False) else ''}, not the "
                                       "checkpoint's fp32 per 128 x 128 block (requantized after loading: DeepGEMM "
                                       "with DEEPGEMM_SCALE_UE8M0, i.e. Blackwell)")
        if kernel not in FP8_AS_LOADED:
            return self._refuse(mname, f"{what} on {kernel}: a GEMM whose post-load form weightsync does not know; "
                                       f"it lands block FP8 in place for {', '.join(FP8_AS_LOADED)}")
        extra = sorted(local for local in params if local not in _FP8_LINEAR_PARAMS)
        if extra:
            return self._refuse(mname, f"{what} with {', '.join(extra)} (static activation scales): not synced")
        if self._not_fp8_layout(mname, what):
            return None
        self._path(mname, IN_PLACE, params, f"{what} on {kernel}: weight e4m3 and weight_scale_inv fp32 read as "
                                            "loaded")

    def _fp8_experts(self, mname: str, mod: torch.nn.Module, params: dict[str, str], qm: Any) -> None:
        cfg = getattr(qm, "quant_config", None)
        block = list(getattr(cfg, "weight_block_size", None) or ())
        backend = _backend_name(qm)
        what = f"fused MoE with Fp8MoEMethod on {backend}"
        if not getattr(qm, "block_quant", False):
            return self._refuse(mname, f"{what} in per-tensor FP8: process_weights_after_loading requantizes w13 to "
                                       "one scale per expert (fp8.py:1585-1711); weightsync syncs block FP8 only")
        if getattr(qm, "is_fp4_expert", False):
            return self._refuse(mname, f"{what} with MXFP4 experts: not synced")
        if getattr(qm, "use_mxfp8", False):
            return self._refuse(mname, f"{what} in MXFP8: not synced")
        if block != [128, 128]:
            return self._refuse(mname, f"{what}: weight_block_size {block}; only [128, 128] is synced")
        if not getattr(getattr(qm, "quant_config", None), "is_checkpoint_fp8_serialized", False):
            return self._refuse(mname, f"{what} quantized online from a bf16 checkpoint: not synced")
        if self.aiter or _fnuz():
            return self._refuse(mname, f"{what}: ROCm converts/shuffles the experts after loading")
        if backend not in FP8_MOE_AS_LOADED:
            return self._refuse(mname, f"{what}: that runner re-lays or requantizes the experts (or was not examined); "
                                       f"weightsync lands block-FP8 experts in place for {'/'.join(FP8_MOE_AS_LOADED)}, "
                                       "SGLang's default on Hopper")
        extra = sorted(local for local in params if local not in _FP8_MOE_PARAMS)
        if extra or getattr(qm, "with_bias", False):
            return self._refuse(mname, f"{what} with {', '.join(extra) or 'biases'}: expert biases / input scales are "
                                       "not synced")
        for w, s in (("w13_weight", "w13_weight_scale_inv"), ("w2_weight", "w2_weight_scale_inv")):
            wt, st = getattr(mod, w, None), getattr(mod, s, None)
            if not isinstance(wt, torch.Tensor) or not isinstance(st, torch.Tensor) or wt.dtype != torch.float8_e4m3fn \
                    or st.dtype != torch.float32 or getattr(st, "format_ue8m0", False) or tuple(st.shape) != _blocks(wt):
                return self._refuse(mname, f"{what}: {s} is not the checkpoint's fp32 per 128 x 128 block (requantized "
                                           "to UE8M0 after loading)")
        if self._not_fp8_layout(mname, what):
            return None
        self._path(mname, IN_PLACE, params, f"{what}: stacks and their block scales read as loaded")

    def _kv_scales(self, mname: str, mod: torch.nn.Module, params: dict[str, str]) -> None:
        scales = {local: getattr(mod, f"{local}_float", None) for local in ("k_scale", "v_scale")}
        if set(params) - set(scales) or any(v != 1.0 for v in scales.values()):
            return self._refuse(mname, f"RadixAttention with Fp8KVCacheMethod: KV-cache scales {scales} loaded from "
                                       "the checkpoint (weightsync neither makes nor sends them; its FP8 checkpoints "
                                       "have none, which leaves 1.0)")
        self.report.constants.extend(params.values())
        self._path(mname, CONSTANT, params, "RadixAttention with Fp8KVCacheMethod: k_scale = v_scale = 1.0 (no KV "
                                            "scales in the checkpoint), not synced")

    def _mla(self, mname: str, mod: torch.nn.Module, kind: str) -> None:
        derived = {a: getattr(mod, a) for a in MLA_DERIVED if isinstance(getattr(mod, a, None), torch.Tensor)}
        why = None
        if not callable(getattr(self.model, "post_load_weights", None)):
            why = "the model has no post_load_weights to re-derive w_kc / w_vc with"
        elif "w_kc" not in derived or "w_vc" not in derived:
            why = "no w_kc / w_vc tensors (post_load_weights has not run)"
        if why is not None:
            return self._refuse(mname, f"{kind}: MLA attention whose derived weights weightsync cannot re-derive in "
                                       f"place ({why})")
        for a, t in derived.items():
            self.report.derived.append(Derived(mname, a, t.data_ptr(), tuple(t.shape), str(t.dtype)))
        dt = str(derived["w_kc"].dtype).removeprefix("torch.")
        self.report.layers.append(LayerPath(mname, DERIVED, tuple(derived),
                                            f"{kind}: {', '.join(derived)} ({dt}) re-derived from kv_b_proj by the "
                                            "model's post_load_weights, copied in place"))


def classify(model: torch.nn.Module, fp8: bool = False, aiter: bool = False) -> LiveReport:
    """Every layer of ``model`` (one SGLang worker's) on its path, or refused (module docstring). ``fp8``: the job's
    layout for this engine is ``quant=fp8``; ``aiter``: SGLang's AITER (ROCm) is on."""
    return _Classifier(model, fp8, aiter).run()


def moved(model: torch.nn.Module, derived: list[Derived]) -> list[str]:
    """Derived tensors no longer where they were bound (re-assigned instead of copied into: CUDA graphs captured
    before would read the old ones)."""
    mods = dict(model.named_modules())
    out = []
    for d in derived:
        t = getattr(mods.get(d.layer), d.attr, None)
        if not isinstance(t, torch.Tensor) or t.data_ptr() != d.ptr or tuple(t.shape) != d.shape or str(t.dtype) != d.dtype:
            got = "gone" if not isinstance(t, torch.Tensor) else f"{list(t.shape)} {t.dtype} at a new address"
            out.append(f"{d.layer}.{d.attr} ({got})")
    return out


def refresh(model: torch.nn.Module, derived: list[Derived]) -> bool:
    """After an update: the model's own ``post_load_weights()`` once (MLA ``w_kc`` / ``w_vc`` from ``kv_b_proj`` as
    landed; what ``load_weights`` runs after a fresh load, 0.5.14 ``deepseek_weight_loader.py:375``), then every derived
    tensor checked unmoved (:class:`~weightsync.errors.WeightsMoved` naming them). False where the model has none."""
    post = getattr(model, "post_load_weights", None)
    if not callable(post):
        return False
    with torch.no_grad():
        post()
    gone = moved(model, derived)
    if gone:
        raise WeightsMoved(f"SGLang's post_load_weights re-assigned {len(gone)} derived tensors instead of copying into "
                           f"them ({', '.join(gone[:3])}): CUDA graphs captured before would read the old weights")
    return True


__all__ = ["IN_PLACE", "CONSTANT", "DERIVED", "PATHS", "FP8_AS_LOADED", "FP8_MOE_AS_LOADED", "MLA_DERIVED", "LayerPath",
           "Derived", "LiveReport", "classify", "moved", "refresh"]
