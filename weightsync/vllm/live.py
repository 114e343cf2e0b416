"""One vLLM worker's tensors in LOADED form, and the transforms that turn them into what it computes with.

weightsync's ``vllm`` layout describes what vLLM's weight loaders write (fused qkv / gate_up,
TP-sharded, vocab-padded, experts stacked ``[E, 2I, H]`` / ``[E, H, I]``). After loading, vLLM's
``process_weights_after_loading`` may turn a layer into something else, and then a write into the
loaded form is not what the next forward pass reads. So at set-up every layer with parameters takes
one of these paths, decided once and reported (:class:`LiveReport`):

``in-place``
    The live parameter is what the engine computes with (norms; on GPU every unquantized bf16
    dense parameter; CPU linears on the plain ``F.linear`` fallback). Steps land in it directly.
``in-place+repack``
    The live parameter is kept and used (the embedding lookup) but another part of the engine uses a
    packed copy of it (CPU ``VocabParallelEmbedding`` / ``ParallelLMHead``, tied or not: logits come
    from the packed copy). Steps land in the parameter; after each update the layer's own
    ``quant_method.process_weights_after_loading`` re-packs it.
``staged+repack``
    The live parameter was packed away and replaced by an empty ``[0]`` tensor (CPU oneDNN / sgl /
    zentorch linears, ``dispatch_cpu_unquantized_gemm(remove_weight=True)``). A loaded-form staging
    tensor is allocated once; after each update it is put back as ``layer.weight`` and the layer's
    ``process_weights_after_loading`` packs it again (and removes it again).
``derived``
    MLA attention's ``W_UK_T`` / ``W_UV``, which vLLM derives from ``kv_b_proj`` after loading: after each update,
    once every other transform ran, the layer's own ``process_weights_after_loading`` derives them again, copying
    into the live parameters (:meth:`LiveModel._mla`). They are no layout tensors: nothing is sent for them.
``in-place+requant``
    A block-FP8 linear on DeepGEMM (vLLM's default FP8 kernel on Hopper): its ``process_weights_after_loading``
    requantizes the checkpoint's weight to power-of-two (UE8M0) scales and re-lays the scales, in the parameters'
    own shapes (:meth:`LiveModel._fp8_linear`). Steps land the checkpoint form in the live weight and scale; after
    each update, before any derivation, the layer's kernel runs its own ``process_weights_after_loading`` on them
    again, so the engine computes with what it would have made of the checkpoint (storage kept: a result in new
    storage is copied back into the live tensors and re-registered).
``staged+prepack``
    CPU fused-MoE experts (``CPUUnquantizedExperts``): staging tensors in loaded form; after each
    update they are zero-padded to the kernel's intermediate alignment (``_pad_moe_intermediate``)
    and ``torch.ops._C.prepack_moe_weight`` writes the packed form into the live storage. The padding
    is therefore never a layout piece: the layout (and ``check_live``) sees the loaded form.

A block-FP8 linear (``Fp8LinearMethod``, weight e4m3 ``[N, K]`` and fp32 ``weight_scale_inv``) takes ``in-place``
too where its GEMM kernel keeps the checkpoint form after loading (CUTLASS and Triton block kernels on CUDA; see
:meth:`LiveModel._fp8_linear` for the vLLM 0.26 lines), ``in-place+requant`` on DeepGEMM (alone or behind
FlashInfer), and only where the job's layout is the FP8 one (``quant=fp8``).

Block-FP8 experts (``Fp8MoEMethod``) take ``in-place`` on the TRITON backend (Hopper's default for tensor-parallel
experts) and ``in-place+requant`` on DEEPGEMM (:meth:`LiveModel._fp8_experts`).

Anything else is refused at set-up, naming the layer: other quantized methods (FP8 MoE on FlashInfer/Marlin/CPU
backends, FP8 linears on Marlin/CPU kernels, DeepGEMM's grouped-BMM form, per-tensor FP8), MLA forms weightsync does not re-derive (AMX, AITER, DCP query replication), MoE backends that re-lay experts
(AITER, FlashInfer, MoonEP, zentorch), MoE biases, a staging tensor whose loaded form has regions no
piece writes. What each path re-runs is vLLM's own transform, so a fresh engine loading the same
checkpoint computes with the same bytes (the tests compare both engines' packed forms).
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from weightsync.engines.live_report import LayerPath, LayerPaths
from weightsync.errors import ConfigError
from weightsync.layout.layout import Layout, check_live

log = logging.getLogger("weightsync.vllm")

IN_PLACE = "in-place"
IN_PLACE_REPACK = "in-place+repack"
STAGED_REPACK = "staged+repack"
STAGED_PREPACK = "staged+prepack"
IN_PLACE_REQUANT = "in-place+requant"
DERIVED = "derived"
PATHS = (IN_PLACE, IN_PLACE_REPACK, STAGED_REPACK, STAGED_PREPACK, IN_PLACE_REQUANT, DERIVED)

#: block-FP8 GEMM kernels whose post-load step keeps the checkpoint form: a step lands in place, nothing re-runs
FP8_AS_LOADED = ("CutlassFp8BlockScaledMMKernel", "TritonFp8BlockScaledMMKernel")
#: those whose post-load step rewrites weight and scales in their own shapes (DeepGEMM, and FlashInfer+DeepGEMM,
#: which runs DeepGEMM's): re-run after every update (:class:`_Requant`)
FP8_REQUANT = ("DeepGemmFp8BlockScaledMMKernel", "FlashInferFp8DeepGEMMDynamicBlockScaledKernel")

#: unquantized fused-MoE backends whose kernel reads the loaded form as is (GPU)
_PLAIN_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")


@dataclass(frozen=True)
class LiveReport(LayerPaths):
    """What :class:`LiveModel` decided for one worker."""

    paths: ClassVar[tuple[str, ...]] = PATHS
    rank: int
    device: str
    dtype: str
    layers: tuple[LayerPath, ...]
    staging_bytes: int

    def tensors_on(self, path: str) -> frozenset[str]:
        """The layout tensors of every layer on ``path`` (e.g. those the engine requantizes after each update)."""
        return frozenset(n for p in self.layers if p.path == path for n in p.tensors)

    def summary(self) -> str:
        counts = ", ".join(f"{n} {path}" for path, n in self.counts().items())
        return f"rank {self.rank} ({self.device}, {self.dtype}): {counts}; staging {self.staging_bytes / 2**20:.2f} MiB"


class _Transform(ABC):
    """A layer's post-load transform, re-run after every update."""

    def __init__(self, layer: str, module: torch.nn.Module):
        self.layer, self.module = layer, module

    @abstractmethod
    def run(self) -> None: ...


class _Repack(_Transform):
    """CPU unquantized linear / embedding: ``process_weights_after_loading`` from the loaded weight."""

    def __init__(self, layer: str, module: torch.nn.Module, loaded: torch.Tensor):
        super().__init__(layer, module)
        self.loaded = loaded

    def run(self) -> None:
        mod = self.module
        w = mod.weight
        if w.data_ptr() != self.loaded.data_ptr() or w.shape != self.loaded.shape:
            # packed away at load (an empty [0] parameter): put the loaded form back for the transform
            mod.weight = torch.nn.Parameter(self.loaded, requires_grad=False)
        mod.quant_method.process_weights_after_loading(mod)


class _Experts(_Transform):
    """CPU unquantized fused-MoE experts: pad the intermediate size, prepack into the live storage."""

    def __init__(self, layer: str, module: torch.nn.Module, w13: torch.Tensor, w2: torch.Tensor, isa: str,
                 padded: int):
        super().__init__(layer, module)
        self.w13, self.w2, self.isa, self.padded = w13, w2, isa, padded

    def run(self) -> None:
        mod, i, p = self.module, self.w2.shape[-1], self.padded
        w13, w2 = self.w13, self.w2
        if p != i:  # vLLM's CPUUnquantizedExperts._pad_moe_intermediate, exactly
            e, _, h = w13.shape
            padded13 = w13.new_zeros(e, 2 * p, h)
            padded13[:, :i] = w13[:, :i]
            padded13[:, p:p + i] = w13[:, i:]
            padded2 = w2.new_zeros(e, h, p)
            padded2[:, :, :i] = w2
            w13, w2 = padded13, padded2
        torch.ops._C.prepack_moe_weight(w13.contiguous(), mod.w13_weight.data, self.isa)
        torch.ops._C.prepack_moe_weight(w2.contiguous(), mod.w2_weight.data, self.isa)


class _Derive(_Transform):
    """MLA attention: ``W_UK_T`` / ``W_UV`` re-derived by the layer's own ``process_weights_after_loading`` (see
    :meth:`LiveModel._mla`), which copies into the live parameters; their storage must not move."""

    def __init__(self, layer: str, module: torch.nn.Module, act_dtype: torch.dtype):
        super().__init__(layer, module)
        self.act_dtype = act_dtype
        self.ptrs = self._ptrs()

    def _ptrs(self) -> tuple[int, int]:
        return self.module.W_UK_T.data_ptr(), self.module.W_UV.data_ptr()

    def run(self) -> None:
        self.module.process_weights_after_loading(self.act_dtype)
        if self._ptrs() != self.ptrs:
            from weightsync.errors import WeightsMoved

            raise WeightsMoved(f"{self.layer}: vLLM's MLA transform re-registered W_UK_T/W_UV instead of copying into "
                               "them (storage moved): CUDA graphs captured before would read the old weights")


class _Requant(_Transform):
    """Block FP8 on DeepGEMM: the kernel's own ``process_weights_after_loading`` re-run on the landed checkpoint form
    (UE8M0 requantization, scale layout). It must run exactly once per landing -- requantizing twice is not a no-op
    (a block whose largest e4m3 value is 224 halves its scale) -- which holds because every update rewrites every
    byte of these tensors before ``after_update`` (a delta's proof of the requantized bytes fails: whole buckets).
    What the engine then reads must be the live tensors: a result in new storage is copied back and re-registered,
    one of another shape or dtype is :class:`~weightsync.errors.WeightsMoved`."""

    def __init__(self, layer: str, module: torch.nn.Module, kernel: Any, live: dict[str, torch.Tensor],
                 moved_ok: bool = True):
        super().__init__(layer, module)
        self.kernel, self.live = kernel, live  # parameter name on the module -> the live tensor steps land in
        self.moved_ok = moved_ok  # False: the step keeps references to what it returns (MoE), so it must not move

    def run(self) -> None:
        self.kernel.process_weights_after_loading(self.module)
        for local, live in self.live.items():
            now = getattr(self.module, local)
            if now.data_ptr() == live.data_ptr() and now.shape == live.shape:
                continue
            if now.shape != live.shape or now.dtype != live.dtype or not self.moved_ok:
                from weightsync.errors import WeightsMoved

                why = ("not the form weightsync lands and the engine was set up with"
                       if now.shape != live.shape or now.dtype != live.dtype else
                       "in new storage, which the kernel it built reads from now, not the live tensor steps land in")
                raise WeightsMoved(f"{self.layer}: {type(self.kernel).__name__}'s post-load step turned {local} "
                                   f"{list(live.shape)} {live.dtype} into {list(now.shape)} {now.dtype} {why}")
            live.copy_(now)
            keep = torch.nn.Parameter(live, requires_grad=False)
            if hasattr(now, "weight_loader"):
                keep.weight_loader = now.weight_loader
            setattr(self.module, local, keep)


def _base_fp8_process(kernel: Any) -> bool:
    """Whether ``kernel``'s ``process_weights_after_loading`` is vLLM's ``Fp8BlockScaledMMLinearKernel``'s own (not
    overridden by the kernel class: the transform :meth:`LiveModel._fp8_linear` reads as keeping the loaded form)."""
    base = next((c for c in type(kernel).__mro__ if c.__name__ == "Fp8BlockScaledMMLinearKernel"), None)
    return base is not None and type(kernel).process_weights_after_loading is base.process_weights_after_loading


def _moe_method() -> type | tuple:
    """vLLM's unquantized fused-MoE method class, or ``()`` (matches nothing) where the build lacks it (the
    GPU kit's vLLM 0.26 is cut down to dense models: no MoE kernels)."""
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError as e:  # pragma: no cover - only on a cut-down build
        log.debug("no fused-MoE method in this vLLM build: %s", e)
        return ()
    return UnquantizedFusedMoEMethod


class LiveModel:
    """The loaded-form tensors of one worker's model (``tensors``, under the layout's names) and the
    transforms that make the engine compute with them (:meth:`refresh`, after every update).

    Raises :class:`~weightsync.errors.ConfigError` naming every layer whose form cannot be produced,
    and :class:`~weightsync.errors.LayoutMismatch` if what it would hand the reader differs from the
    layout (names, shapes, dtypes)."""

    def __init__(self, model: torch.nn.Module, layout: Layout, device: torch.device, where: str):
        self.model, self.layout, self.where = model, layout, where
        self.cpu = device.type == "cpu"
        self.tensors: dict[str, torch.Tensor] = {}
        self.transforms: list[_Transform] = []
        self.derivations: list[_Transform] = []  # run after every transform (MLA: from kv_b_proj as rebuilt)
        self._paths: list[LayerPath] = []
        self._refused: list[str] = []
        self._staging = 0
        names = {id(p): n for n, p in model.named_parameters()}  # tied parameters appear once, first name
        for mname, mod in model.named_modules():
            direct = list(mod.named_parameters(recurse=False))
            if not direct:
                continue
            self._classify(mname, mod, {local: names[id(p)] for local, p in direct})
        if self._refused:
            raise ConfigError(f"{where}: weightsync cannot produce what vLLM computes with for "
                              f"{len(self._refused)} layer(s), refused before any byte moves:\n  "
                              + "\n  ".join(self._refused[:12])
                              + ("\n  ..." if len(self._refused) > 12 else ""))
        check_live(layout, {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in self.tensors.items()},
                   where=where)
        dtype = str(next(iter(self.tensors.values())).dtype).removeprefix("torch.") if self.tensors else "?"
        self.report = LiveReport(layout.rank, str(device), dtype, tuple(self._paths), self._staging)
        log.info("%s: %s", where, self.report.summary())
        for p in self._paths:
            log.debug("%s: %s -> %s (%s)", where, p.layer, p.path, p.detail)

    # -- per layer -------------------------------------------------------------------------------
    def _classify(self, mname: str, mod: torch.nn.Module, params: dict[str, str]) -> None:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        UnquantizedFusedMoEMethod = _moe_method()
        qm = getattr(mod, "quant_method", None)
        kind = type(mod).__name__
        if hasattr(mod, "W_UK_T") or hasattr(mod, "W_UV") or "MLA" in kind:
            return self._mla(mname, mod, kind)
        if qm is None:
            if callable(getattr(mod, "process_weights_after_loading", None)):
                return self._refuse(mname, f"{kind} has its own process_weights_after_loading, a post-load "
                                           "transform weightsync does not know")
            return self._in_place(mname, mod, params, kind)
        if isinstance(qm, UnquantizedLinearMethod):
            return self._linear(mname, mod, params, kind)
        if isinstance(qm, UnquantizedEmbeddingMethod):
            return self._embedding(mname, mod, params, kind)
        if isinstance(qm, UnquantizedFusedMoEMethod):
            return self._experts(mname, mod, params, qm)
        if type(qm).__name__ == "Fp8LinearMethod":
            return self._fp8_linear(mname, mod, params, qm, kind)
        if type(qm).__name__ == "Fp8MoEMethod":
            return self._fp8_experts(mname, mod, params, qm)
        self._refuse(mname, f"{kind} with {type(qm).__name__}: a quantized or unknown method whose "
                            "post-load form weightsync cannot produce; serve the model unquantized")

    def _refuse(self, mname: str, why: str) -> None:
        self._refused.append(f"{mname}: {why}")

    def _add(self, name: str, t: torch.Tensor) -> None:
        self.tensors.setdefault(name, t)  # a tied parameter is one tensor

    def _in_place(self, mname: str, mod: torch.nn.Module, params: dict[str, str], detail: str,
                  path: str = IN_PLACE) -> None:
        for local, name in params.items():
            self._add(name, getattr(mod, local))
        self._paths.append(LayerPath(mname, path, tuple(params.values()), detail))

    def _linear(self, mname: str, mod: torch.nn.Module, params: dict[str, str], kind: str) -> None:
        w = mod.weight
        if not self.cpu or getattr(mod, "_cpu_skip_gemm_dispatch", False) or w.numel() > 0:
            # GPU: the GEMM reads layer.weight; CPU: MLA's kv_b_proj or the F.linear fallback read it too
            return self._in_place(mname, mod, params, f"{kind}: the GEMM reads layer.weight")
        name = params["weight"]
        want = self.layout.tensors.get(name)
        if want is None:
            return self._refuse(mname, f"{kind}: its weight {name} was packed away and the layout has no such tensor")
        if not self._covered(name):
            return self._refuse(mname, f"{kind}: its loaded form {name} has regions no piece writes (padding), so "
                                       "its packed form cannot be rebuilt from received data")
        staged = torch.empty(want.shape, dtype=w.dtype, device=w.device)
        self._add(name, staged)
        self._staging += staged.numel() * staged.element_size()
        for local, other in params.items():  # the bias (read at call time), DeepSeek's correction bias
            if local != "weight":
                self._add(other, getattr(mod, local))
        self.transforms.append(_Repack(mname, mod, staged))
        self._paths.append(LayerPath(mname, STAGED_REPACK, tuple(params.values()),
                                     f"{kind}: CPU packed GEMM, weight removed after packing"))

    def _fp8_linear(self, mname: str, mod: torch.nn.Module, params: dict[str, str], qm: Any, kind: str) -> None:
        """A block-FP8 linear (``Fp8LinearMethod``, checkpoint ``weight_block_size [128, 128]``): in place where
        its kernel's ``process_weights_after_loading`` keeps the checkpoint form, refused otherwise.

        vLLM 0.26 (``model_executor/layers/quantization/fp8.py:398-444``): for block quant, without Marlin,
        ``Fp8LinearMethod.process_weights_after_loading`` only calls its kernel's. On CUDA the kernel is the first
        of ``_POSSIBLE_FP8_BLOCK_KERNELS[CUDA]`` that can run (``kernels/linear/__init__.py:355-363``): FlashInfer+
        DeepGEMM and DeepGEMM (``scaled_mm/deep_gemm.py:84-107``: ``deepgemm_post_process_fp8_weight_block``, which
        re-lays the scales and, with UE8M0, requantizes the weight: below), CUTLASS, Marlin (repacks: refused),
        Triton. CUTLASS and Triton (``scaled_mm/cutlass.py:275``, ``triton.py:159``) keep the base
        ``Fp8BlockScaledMMLinearKernel.process_weights_after_loading`` (``BlockScaledMMLinearKernel.py:75-95``):
        ``process_fp8_weight_block_strategy`` (``quantization/utils/fp8_utils.py:1371-1405``) returns the weight and
        ``weight_scale_inv`` unchanged unless the platform is FP8-FNUZ (ROCm) or pads for ROCm, and
        ``replace_parameter`` re-registers a Parameter over the same tensor (``model_executor/utils.py:47-98``);
        their ``apply`` reads ``weight`` [N, K] and ``weight_scale_inv`` [N/128, K/128] as loaded (CUTLASS transposes
        views at call time, ``cutlass.py:312-325``). So the live tensors are the checkpoint's, and a step lands in
        them directly.

        DeepGEMM (``scaled_mm/deep_gemm.py:84-107``; FlashInfer+DeepGEMM runs the same, ``flashinfer.py:179-182``):
        after the base step, ``deepgemm_post_process_fp8_weight_block`` (``fp8_utils.py``) requantizes the e4m3 weight
        in place to power-of-two scales where ``VLLM_USE_DEEP_GEMM_E8M0`` (default on) -- dequantize with the
        checkpoint's scales, ``per_block_cast_to_fp8(..., use_ue8m0=True)``, copied back into the weight and the
        scale tensor -- then ``transform_sf_into_required_layout`` (DeepGEMM), which on Hopper keeps fp32 128 x 128
        scales as they are; ``replace_parameter`` registers the results. The shapes and dtypes stay the checkpoint's,
        so the layout's pieces still land there, and :class:`_Requant` re-runs that step after each update (where it
        returns new storage or another form, the update fails naming the layer). Refused: DeepGEMM's grouped-BMM
        form (``is_bmm``, DeepSeek-V4's ``wo_a``)."""
        kernel = getattr(qm, "fp8_linear", None)
        kname = type(kernel).__name__
        scale = params.get("weight_scale_inv")
        if not getattr(qm, "block_quant", False) or scale is None:
            return self._refuse(mname, f"{kind} with per-tensor FP8 (Fp8LinearMethod without weight_block_size): "
                                       "weightsync syncs block FP8 (weight_block_size [128, 128]) only")
        if scale != params["weight"] + "_scale_inv" or scale not in self.layout.tensors:
            return self._refuse(mname, f"{kind}: the engine serves it in block FP8 (Fp8LinearMethod), but the job's "
                                       "layout for this engine is not quant=fp8 (no "
                                       f"{params['weight']}_scale_inv in it)")
        if list(getattr(qm, "weight_block_size", None) or ()) != [128, 128]:
            return self._refuse(mname, f"{kind}: weight_block_size {qm.weight_block_size}; only [128, 128] is synced")
        if getattr(qm, "use_marlin", False) or getattr(qm, "is_scale_e8m0", False):
            return self._refuse(mname, f"{kind} with Fp8LinearMethod on {kname}: "
                                       f"{'Marlin repacks the weight' if qm.use_marlin else 'e8m0 scales'} after "
                                       "loading; weightsync lands the checkpoint form only")
        requant = kname in FP8_REQUANT
        if requant and getattr(mod, "is_bmm", False):
            return self._refuse(mname, f"{kind} with Fp8LinearMethod on {kname} in its grouped-BMM form (is_bmm): "
                                       "a scale layout weightsync does not produce")
        if not requant and (kname not in FP8_AS_LOADED or not _base_fp8_process(kernel)):
            return self._refuse(mname, f"{kind} with Fp8LinearMethod on {kname}: its process_weights_after_loading "
                                       "re-lays or requantizes the checkpoint form in a way weightsync does not know "
                                       f"(Marlin, CPU, FlashInfer alone); weightsync lands FP8 in place for "
                                       f"{'/'.join(FP8_AS_LOADED)} and re-runs the post-load step of "
                                       f"{'/'.join(FP8_REQUANT)}")
        try:
            from vllm.platforms import current_platform

            fnuz = current_platform.is_fp8_fnuz()
        except Exception:  # noqa: BLE001 - an older build without it: not ROCm
            fnuz = False
        if fnuz:
            return self._refuse(mname, f"{kind}: this platform converts e4m3fn to e4m3fnuz after loading (ROCm)")
        if requant:
            e8m0 = getattr(getattr(kernel, "fallback", kernel), "use_deep_gemm_e8m0", None)
            self._in_place(mname, mod, params, f"{kind}: Fp8LinearMethod, {kname} (E8M0 {e8m0}): the checkpoint "
                                               "form lands, the kernel's post-load step re-runs", IN_PLACE_REQUANT)
            self.transforms.append(_Requant(mname, mod, kernel, {local: getattr(mod, local)
                                                                 for local in ("weight", "weight_scale_inv")}))
            return None
        self._in_place(mname, mod, params, f"{kind}: Fp8LinearMethod, {kname}: weight e4m3 and weight_scale_inv "
                                           "fp32 computed with as loaded")

    def _fp8_experts(self, mname: str, mod: torch.nn.Module, params: dict[str, str], qm: Any) -> None:
        """Block-FP8 fused-MoE experts (``Fp8MoEMethod``: ``w13_weight`` / ``w2_weight`` e4m3 ``[E, 2I, H]`` /
        ``[E, H, I]`` with ``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` fp32 per 128 x 128 block, per expert).

        vLLM 0.26 (``quantization/fp8.py:640-740``): ``process_weights_after_loading`` hands the four tensors to
        ``convert_to_fp8_moe_kernel_format`` (``fused_moe/oracle/fp8.py:457-561``) for the backend
        ``select_fp8_moe_backend`` chose, ``replace_parameter``s the results and builds the kernel around them. On
        Hopper, block FP8 puts TRITON first for tensor-parallel experts (``_get_priority_backends``, ``oracle/fp8.py:
        112-122``); TRITON and BATCHED_TRITON convert nothing, so the experts compute with the checkpoint form as
        loaded and a step lands in place. DEEPGEMM (chosen where ``VLLM_USE_DEEP_GEMM`` / ``VLLM_MOE_USE_DEEP_GEMM``
        are set to 1) runs ``prepare_fp8_moe_layer_for_deepgemm`` -- ``deepgemm_post_process_fp8_weight_block`` on
        each stack, the dense DeepGEMM step -- so it takes ``in-place+requant``, the method's own step re-run after
        each update; its results must stay in the live storage (the kernel it builds keeps references to them).
        Refused: FlashInfer CUTLASS / TRT-LLM (Hopper's choice for expert parallelism: it re-lays the stacks),
        Marlin, AITER, CPU and the others, per-tensor FP8, expert biases, an FP8 engine under a bf16 layout."""
        backend = getattr(getattr(qm, "fp8_backend", None), "name", "?")
        names = {k: params.get(k) for k in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")}
        if not getattr(qm, "block_quant", False) or names["w13_weight_scale_inv"] is None:
            return self._refuse(mname, "fused MoE with per-tensor FP8 (Fp8MoEMethod without weight_block_size): "
                                       "weightsync syncs block FP8 (weight_block_size [128, 128]) only")
        if list(getattr(qm, "weight_block_size", None) or ()) != [128, 128]:
            return self._refuse(mname, f"fused MoE: weight_block_size {qm.weight_block_size}; only [128, 128] is synced")
        missing = [n for n in names.values() if n is None or n not in self.layout.tensors]
        if missing:
            return self._refuse(mname, "fused MoE served in block FP8 (Fp8MoEMethod), but the job's layout for this "
                                       f"engine is not quant=fp8 (no {', '.join(str(m) for m in missing)} in it)")
        extra = sorted(n for n in params if n.startswith(("w13_", "w2_")) and n not in names)
        if extra:
            return self._refuse(mname, f"fused MoE with {', '.join(extra)}: expert biases / input scales are not "
                                       "supported")
        if self.cpu:
            return self._refuse(mname, f"fused MoE in block FP8 on CPU (backend {backend}): not synced")
        for local, name in params.items():  # e.g. DeepSeek's e_score_correction_bias: read as loaded
            if local not in names:
                self._add(name, getattr(mod, local))
        if backend in ("TRITON", "BATCHED_TRITON"):
            return self._in_place(mname, mod, params, f"fused MoE, Fp8MoEMethod on {backend}: the stacks and their "
                                                      "block scales computed with as loaded")
        if backend in ("DEEPGEMM", "BATCHED_DEEPGEMM"):
            self._in_place(mname, mod, params, f"fused MoE, Fp8MoEMethod on {backend}: the checkpoint form lands, "
                                               "the method's post-load step re-runs", IN_PLACE_REQUANT)
            self.transforms.append(_Requant(mname, mod, qm, {local: getattr(mod, local) for local in names},
                                            moved_ok=False))
            return None
        return self._refuse(mname, f"fused MoE, Fp8MoEMethod on backend {backend}: it re-lays the experts after "
                                   "loading; weightsync lands block-FP8 experts for TRITON (in place) and DEEPGEMM "
                                   "(its step re-run)")

    def _mla(self, mname: str, mod: torch.nn.Module, kind: str) -> None:
        """MLA attention: ``W_UK_T`` / ``W_UV`` are derived from ``kv_b_proj`` after loading, and re-derived after
        every update by the layer's own ``process_weights_after_loading`` (:class:`_Derive`), run last.

        vLLM 0.32 (``model_executor/layers/attention/mla_attention.py``, ``MLAAttention.process_weights_after_loading``):
        the backend impl's own step (a no-op but for AMX), then ``split_kv_b_proj`` (kv_b_proj's weight, dequantized
        to the activation dtype where quantized, transposed, split per head) and ``replace_parameter(...,
        prefer_copy=True)`` of ``W_UV`` (``W_UV.transpose(0, 1)``) and ``W_UK_T`` (``W_UK.permute(1, 2, 0)``): a copy
        into the live parameters, which keep their storage (CUDA graphs stay valid). Refused: the AMX path (it packs
        W_UK/W_UV and frees kv_b_proj's weight), ROCm's AITER FP4/FP8 BMM forms, DCP query replication (an
        all-gather across the decode context group), and a build whose transform does not copy in place (checked
        after each run: the parameters' storage must not move)."""
        why = next((w for flag, w in (("is_amx_bmm_enabled", "AMX packs W_UK/W_UV and frees kv_b_proj"),
                                      ("is_aiter_triton_fp4_bmm_enabled", "AITER FP4 BMM weights"),
                                      ("is_aiter_triton_fp8_bmm_enabled", "AITER FP8 BMM weights"),
                                      ("dcp_q_replicate", "DCP query replication"))
                    if getattr(mod, flag, False)), None)
        derived = [getattr(mod, n, None) for n in ("W_UK_T", "W_UV")]
        if why is None and any(not isinstance(t, torch.Tensor) for t in derived):
            why = "no W_UK_T / W_UV tensors to re-derive into"
        if why is None and not callable(getattr(mod, "process_weights_after_loading", None)):
            why = "no process_weights_after_loading to re-derive W_UK_T / W_UV with"
        if why is not None:
            return self._refuse(mname, f"{kind}: MLA attention whose derived weights weightsync cannot re-derive in "
                                       f"place ({why})")
        self.derivations.append(_Derive(mname, mod, derived[0].dtype))
        self._paths.append(LayerPath(mname, DERIVED, ("W_UK_T", "W_UV"),
                                     f"{kind}: W_UK_T/W_UV re-derived from kv_b_proj ({derived[0].dtype}) in place"))

    def _embedding(self, mname: str, mod: torch.nn.Module, params: dict[str, str], kind: str) -> None:
        if not self.cpu:
            return self._in_place(mname, mod, params, f"{kind}: lookup and logits read layer.weight")
        self._in_place(mname, mod, params, f"{kind}: CPU logits from a packed copy", IN_PLACE_REPACK)
        self.transforms.append(_Repack(mname, mod, mod.weight))

    def _experts(self, mname: str, mod: torch.nn.Module, params: dict[str, str], qm: Any) -> None:
        backend = getattr(getattr(qm, "unquantized_backend", None), "name", "?")
        biases = sorted(n for n in params if n.startswith(("w13_", "w2_")) and n not in ("w13_weight", "w2_weight"))
        if biases:
            return self._refuse(mname, f"fused MoE with {', '.join(biases)}: expert biases are not supported")
        for local, name in params.items():  # e.g. DeepSeek's e_score_correction_bias: read as loaded
            if local not in ("w13_weight", "w2_weight"):
                self._add(name, getattr(mod, local))
        if not self.cpu:
            if backend in _PLAIN_MOE_BACKENDS:
                return self._in_place(mname, mod, params, f"fused MoE, {backend} backend reads w13/w2 as loaded")
            return self._refuse(mname, f"fused MoE backend {backend} re-lays the experts after loading; "
                                       f"weightsync writes the loaded form only for {'/'.join(_PLAIN_MOE_BACKENDS)}")
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        experts = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            return self._refuse(mname, f"fused MoE experts {type(experts).__name__} (backend {backend}): only "
                                       "CPUUnquantizedExperts' prepacked form is rebuilt on CPU")
        n13, n2 = params["w13_weight"], params["w2_weight"]
        want13, want2 = self.layout.tensors.get(n13), self.layout.tensors.get(n2)
        if want13 is None or want2 is None:
            return self._refuse(mname, f"fused MoE: the layout has no {n13} / {n2}")
        live13, live2 = mod.w13_weight, mod.w2_weight
        e, two_i, h = want13.shape
        i, p = two_i // 2, live2.shape[-1]
        if live13.shape != (e, 2 * p, h) or live2.shape != (e, h, p) or p < i or want2.shape != (e, h, i):
            return self._refuse(mname, f"fused MoE: live w13 {list(live13.shape)} / w2 {list(live2.shape)} are not "
                                       f"the loaded {list(want13.shape)} / {list(want2.shape)} padded along the "
                                       "intermediate size")
        if not (self._covered(n13) and self._covered(n2)):
            return self._refuse(mname, "fused MoE: the loaded experts have regions no piece writes")
        s13 = torch.empty(want13.shape, dtype=live13.dtype, device=live13.device)
        s2 = torch.empty(want2.shape, dtype=live2.dtype, device=live2.device)
        self._add(n13, s13)
        self._add(n2, s2)
        self._staging += (s13.numel() + s2.numel()) * s13.element_size()
        self.transforms.append(_Experts(mname, mod, s13, s2, experts.isa, p))
        pad = f", intermediate {i} padded to {p} per rank" if p != i else ""
        self._paths.append(LayerPath(mname, STAGED_PREPACK, tuple(params.values()),
                                     f"fused MoE, CPUUnquantizedExperts isa={experts.isa}{pad}"))

    def _covered(self, name: str) -> bool:
        """Whether the layout's pieces cover every element of local tensor ``name`` (they never overlap)."""
        t = self.layout.tensors[name]
        return sum(math.prod(n for _, n in p.local_box) for p in t.pieces) == t.numel

    # -- every step ------------------------------------------------------------------------------
    def refresh(self) -> int:
        """Re-run every layer's transform from the loaded form (after an update), the derivations last (they read
        what the others rebuilt); returns how many ran."""
        with torch.no_grad():
            for t in (*self.transforms, *self.derivations):
                t.run()
        return len(self.transforms) + len(self.derivations)
