"""A child process running SGLang 0.5.14's own pure-torch functions on CPU for ``tests/test_sglang_instance.py::
test_against_sglang_0514s_own_functions`` (a test aid; see that test). Run as ``python tests/sglang_0514.py real OUT``
with SGLang 0.5.14's unpacked wheel and its pure-Python dependencies on ``PYTHONPATH``."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
from helpers import preset
from sglang_standin import fresh, load, standin

from weightsync.sglang.live import classify
from weightsync.sglang.verify import checkpoint_form, computed, held_layout
from weightsync.spec.model import spec_from_config
from weightsync.testing import random_canonical

MODEL = "tiny-deepseek-v3-fp8"
FP8_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _everything(root) -> dict[str, torch.Tensor]:
    return computed(types.SimpleNamespace(state={"model": root}))


def _engine(fp8: bool) -> str:
    return "sglang:quant=fp8" if fp8 else "sglang"


def _import_sglang_0514() -> None:
    """SGLang 0.5.14 from WEIGHTSYNC_SGLANG_SRC, on CPU: ``IPython``/``torchvision``/``gguf`` stubbed (multimodal and
    GGUF code imports them), transformers told torchvision is there (0.5.14's configs register image processors)."""
    import importlib.abc
    import importlib.machinery
    from unittest import mock

    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    import_utils.BACKENDS_MAPPING["torchvision"] = (lambda: True, "")

    class Stub(types.ModuleType):
        def __getattr__(self, item):
            if item.startswith("__"):
                raise AttributeError(item)
            value = mock.MagicMock(name=f"{self.__name__}.{item}")
            setattr(self, item, value)
            return value

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("IPython", "torchvision", "gguf"):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            m = Stub(spec.name)
            m.__path__ = []
            return m

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Finder())


def real_main() -> dict:
    """In a child process with SGLang 0.5.14 importable: what its own objects and functions do (module docstring)."""
    import warnings

    warnings.filterwarnings("ignore")
    _import_sglang_0514()
    import sglang
    from sglang.srt.layers import deep_gemm_wrapper as D
    from sglang.srt.layers.moe import MoeRunnerConfig
    from sglang.srt.layers.quantization import fp8 as F
    from sglang.srt.layers.quantization import fp8_utils as U
    from sglang.srt.models.deepseek_common import deepseek_weight_loader as L

    from weightsync.quant.fp8 import quantize_reference

    out: dict = {"sglang": sglang.__version__}
    # the module flags an H100 with a stock install gives (is_cuda, no FNUZ, DeepGEMM importable and on, sm90: no UE8M0)
    F._is_cpu = F._is_fp8_fnuz = F._use_aiter = False
    L._is_cuda, L._is_hip, L._is_npu, L._is_musa, L._use_aiter_gfx95 = True, False, False, False, False
    D.ENABLE_JIT_DEEPGEMM, D.DEEPGEMM_BLACKWELL, D.DEEPGEMM_SCALE_UE8M0 = True, False, False
    F.get_parallel = lambda: types.SimpleNamespace(tp_size=1)
    cfg = F.Fp8Config.from_config(FP8_QC)

    # 1. SGLang's own FP8 methods, as weightsync classifies them and as their post-load steps leave the checkpoint form
    root = torch.nn.Module()
    root.lin, root.moe, root.attn = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    lm = F.Fp8LinearMethod(cfg)
    out["linear_gemm_on_cpu"] = lm.w8a8_block_fp8_linear.__name__
    lm.create_weights(root.lin, 256, [256, 128], 256, 384, torch.bfloat16, weight_loader=None)
    root.lin.quant_method = lm
    mm = F.Fp8MoEMethod(cfg)
    mm.create_weights(root.moe, 8, 256, 128, torch.bfloat16, weight_loader=None)
    mm.create_moe_runner(root.moe, MoeRunnerConfig())
    root.moe.quant_method = mm
    kv = F.Fp8KVCacheMethod(cfg)
    kv.create_weights(root.attn)
    kv.process_weights_after_loading(root.attn)
    root.attn.quant_method = kv
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in root.parameters():
            if p.dtype == torch.float8_e4m3fn:
                p.copy_(torch.randn(p.shape, generator=g).to(torch.float8_e4m3fn))
            elif p.dim():
                p.copy_(torch.rand(p.shape, generator=g))
    for gemm in (U.deepgemm_w8a8_block_fp8_linear_with_fallback, U.cutlass_w8a8_block_fp8_linear_with_fallback):
        lm.w8a8_block_fp8_linear = gemm  # _dispatch_auto_backend on sm90: DeepGEMM where it imports, else CUTLASS
        report = classify(root, fp8=True)
        before = {n: (p.data_ptr(), p.detach().clone()) for n, p in root.named_parameters()}
        lm.process_weights_after_loading(root.lin)
        mm.process_weights_after_loading(root.moe)
        out[gemm.__name__] = {
            "paths": {p.layer: p.path for p in report.layers}, "refusals": report.refusals,
            "constants": report.constants, "moe_runner": str(mm.runner.runner_backend.value),
            "kept": all(p.data_ptr() == before[n][0] and same(p.detach(), before[n][1])
                        for n, p in root.named_parameters())}

    # 2. SGLang's own post_load_weights on the stand-in DeepSeek tree: the stand-in's copy, and weightsync's re-run
    for fp8 in (False, True):
        mcfg = preset(MODEL)
        held = held_layout(mcfg, _engine(fp8))
        layout = held.layout(0)

        def real_root(seed):
            r = standin(mcfg, layout, fp8)
            r.quant_config = cfg if fp8 else None
            real = types.MethodType(L.DeepseekV2WeightLoaderMixin.post_load_weights, r)
            r.post_load_weights = lambda *a, _real=real, _r=r, **k: (setattr(_r, "post_loads", _r.post_loads + 1),
                                                                     _real(*a, **k))[1]
            return load(r, layout, checkpoint_form(random_canonical(spec_from_config(mcfg), seed=seed), held))

        mine, theirs = _everything(fresh(mcfg, layout, checkpoint_form(random_canonical(spec_from_config(mcfg), seed=3),
                                                                       held), fp8)), _everything(real_root(3))
        live = real_root(1)
        report = classify(live, fp8=fp8)
        ck = checkpoint_form(random_canonical(spec_from_config(mcfg), seed=3), held)
        from weightsync.layout.materialize import fill_from
        from weightsync.sglang.live import refresh

        with torch.no_grad():
            fill_from(layout, dict(live.named_parameters()), ck)
        refresh(live, report.derived)
        synced = _everything(live)
        out[f"mla_{'fp8' if fp8 else 'bf16'}"] = {
            "derived": sorted(n for n in theirs if n.startswith("derived:")),
            "standin_copy_equal": [n for n in theirs if not same(mine[n], theirs[n])] == [] and mine.keys() == theirs.keys(),
            "resynced_equal": [n for n in theirs if not same(synced[n], theirs[n])] == [],
            "w_kc_dtype": str(theirs["derived:model.layers.0.self_attn.w_kc"].dtype),
            "w_scale": live.model.layers[0].self_attn.w_scale, "refusals": report.refusals}
    # the dequantization it runs is weightsync's stand-in's, bit for bit, on a quantized kv_b_proj
    x = torch.randn(512, 512, generator=g).to(torch.bfloat16)
    q = quantize_reference(x)
    from sglang_standin import block_quant_dequant

    out["block_quant_dequant_equal"] = same(U.block_quant_dequant(q.weight, q.scale_inv, [128, 128], torch.bfloat16),
                                            block_quant_dequant(q.weight, q.scale_inv, [128, 128], torch.bfloat16))
    return out


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "real":
    Path(sys.argv[2]).write_text(json.dumps(real_main(), default=str))
