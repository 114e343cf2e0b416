"""A real vllm-cpu engine on a block-FP8 checkpoint written by ``save_checkpoint(dir, quant="fp8")``.

vllm-cpu 0.32's only block-FP8 linear kernels need AMX tiles (Intel Sapphire Rapids or newer): on other CPUs -- our
CI's AMD EPYC machines among them -- it refuses the checkpoint while building the model ("Failed to find a kernel
that can implement the ScaledMM linear layer ... requires AMX tile support"; docs/fp8.md). So this test is skipped
there, and it has not been run by us: no AMX machine was at hand. Where it runs it checks that vLLM chose
``Fp8LinearMethod`` for every linear layer, and that two engines on the checkpoint decode the same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny

amx = pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                         reason="vllm-cpu 0.32 serves block FP8 only with AMX tiles (docs/fp8.md)")


def _quant_methods(self) -> dict[str, str]:
    """In each vLLM worker: the quant method of every module that has one."""
    return {n: type(m.quant_method).__name__ for n, m in self.model_runner.model.named_modules()
            if getattr(m, "quant_method", None) is not None}


@amx
def test_vllm_cpu_loads_and_decodes_a_weightsync_fp8_checkpoint(tmp_path):
    pytest.importorskip("vllm")  # here, not at import: importing vLLM takes seconds to minutes on CI's 2 cores
    from vllm_harness import generate, start_llm, stop_llm

    from weightsync.bind.train import HFTrainEngine
    from weightsync.checkpoint import save_checkpoint
    from weightsync.checkpoint.hf import build_hf_model
    from weightsync.layout.materialize import fill_from
    from weightsync.testing import random_canonical

    spec = tiny("tiny-qwen3-h64", hidden_size=256, num_key_value_heads=2, intermediate_size=512)
    bound = HFTrainEngine(build_hf_model(spec, seed=0)).bound
    with torch.no_grad():
        fill_from(bound.layout, bound.tensors, random_canonical(spec, 5))
    save_checkpoint(bound, tmp_path, quant="fp8")
    tokens = []
    for _ in range(2):
        llm = start_llm(tmp_path)
        try:
            (methods,) = llm.collective_rpc(_quant_methods)
            linears = {n: m for n, m in methods.items()
                       if n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}
            assert len(linears) == 4 * spec.num_layers and set(linears.values()) == {"Fp8LinearMethod"}, methods
            tokens.append(generate(llm))
        finally:
            stop_llm(llm)
    assert tokens[0] == tokens[1] and all(len(t) > 0 for t in tokens[0])


def test_the_engines_quantization_is_read_from_its_model_config_and_refused_by_name():
    """weightsync.vllm.config.quantization: vLLM's model config says what the engine serves; block FP8 128 x 128
    becomes ``quant=fp8`` in its engine string, anything else is refused before any byte moves. (Stand-in config
    objects with the two attributes vLLM has: ``quantization`` and ``hf_config.quantization_config``.)"""
    from types import SimpleNamespace as NS

    from weightsync.errors import ConfigError
    from weightsync.quant.config import BlockFP8
    from weightsync.vllm.config import quantization

    assert quantization(NS(quantization=None, hf_config=NS())) is None
    assert quantization(NS(quantization="fp8", hf_config=NS(quantization_config=BlockFP8().hf_config()))) == BlockFP8()
    cases = [(None, "fp8", "quantizes a checkpoint that is not quantized itself"),
             ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8", "per-tensor FP8"),
             ({"quant_method": "awq"}, "awq", "INT4 AWQ"),
             ({**BlockFP8().hf_config(), "weight_block_size": [64, 64]}, "fp8", r"weight_block_size \[64, 64\]"),
             ({**BlockFP8().hf_config(), "ignored_layers": ["model.layers.0.mlp.down_proj"]}, "fp8", "ignored_layers")]
    for qc, method, match in cases:
        with pytest.raises(ConfigError, match=match):
            quantization(NS(quantization=method, hf_config=NS(quantization_config=qc)))


class Fp8BlockScaledMMLinearKernel:
    """Stand-in for vLLM 0.26's base block-FP8 kernel class (its post-load step keeps the checkpoint form)."""

    def process_weights_after_loading(self, layer):
        pass


class Fp8LinearMethod:
    """Stand-in for vLLM 0.26's ``Fp8LinearMethod`` with block quantization: the attributes LiveModel reads."""

    def __init__(self, kernel, marlin=False):
        self.fp8_linear, self.block_quant, self.weight_block_size = kernel, True, [128, 128]
        self.use_marlin, self.is_scale_e8m0 = marlin, False


class Fp8MoEMethod:
    """Stand-in for vLLM 0.26's ``Fp8MoEMethod`` with block quantization: its backend, and its post-load step (a
    visible change where ``step`` is given)."""

    def __init__(self, backend: str, step=None):
        from types import SimpleNamespace as NS

        self.fp8_backend, self.block_quant, self.weight_block_size = NS(name=backend), True, [128, 128]
        self.step = step

    def process_weights_after_loading(self, layer):
        if self.step is not None:
            self.step(layer)


def _fp8_standin(layout, kernel, marlin=False, moe=lambda: Fp8MoEMethod("TRITON")) -> torch.nn.Module:
    """Modules named and shaped as ``layout``'s tensors (random data), each FP8 linear with ``kernel()``, each FP8
    experts module with ``moe()``."""
    from weightsync.layout.materialize import TORCH_DTYPES

    g = torch.Generator().manual_seed(0)
    root = torch.nn.Module()
    for name, t in layout.tensors.items():
        mname, local = name.rsplit(".", 1)
        mod = root
        for part in mname.split("."):
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        data = torch.randn(t.shape, generator=g).to(TORCH_DTYPES[t.dtype])
        mod.register_parameter(local, torch.nn.Parameter(data, requires_grad=False))
        if local == "weight_scale_inv":
            mod.quant_method = Fp8LinearMethod(kernel(), marlin)
        if local == "w13_weight_scale_inv":
            mod.quant_method = moe()
    return root


def test_live_model_takes_fp8_linears_in_place_only_on_kernels_that_keep_the_checkpoint_form():
    """weightsync.vllm.live.LiveModel on stand-in modules shaped as vLLM 0.26 builds them: an ``Fp8LinearMethod``
    whose kernel keeps ``Fp8BlockScaledMMLinearKernel.process_weights_after_loading`` (CUTLASS) is in place, its
    e4m3 weight and fp32 scale handed to the reader; one on an unknown kernel that overrides it, or with Marlin, is
    refused naming the layer; so is an FP8 engine under a layout that is not quant=fp8. (DeepGEMM: the next test.)
    Stand-ins, not vLLM: the real engine is checked on the GPU host (benchmarks/fp8_vllm_gpu.py)."""
    pytest.importorskip("vllm")
    from weightsync.engines import make_layout
    from weightsync.errors import ConfigError
    from weightsync.quant.layout import fp8_layout
    from weightsync.spec import load_spec
    from weightsync.vllm.live import LiveModel

    class CutlassFp8BlockScaledMMKernel(Fp8BlockScaledMMLinearKernel):
        pass

    class HummingFP8ScaledMMLinearKernel(Fp8BlockScaledMMLinearKernel):
        def process_weights_after_loading(self, layer):
            pass

    spec = load_spec("tiny-qwen3-fp8")
    layout = fp8_layout(make_layout(spec, "vllm:quant=fp8")).layout(0)

    def model(kernel, marlin=False):
        return _fp8_standin(layout, kernel, marlin)

    live = LiveModel(model(CutlassFp8BlockScaledMMKernel), layout, torch.device("cuda"), "stand-in")
    assert set(live.tensors) == set(layout.tensors) and live.report.counts() == {"in-place": len(live.report.layers)}
    assert any(t.dtype == torch.float8_e4m3fn for t in live.tensors.values())
    with pytest.raises(ConfigError, match=r"self_attn\.qkv_proj: Module with Fp8LinearMethod on "
                                          r"HummingFP8ScaledMMLinearKernel: .*re-lays or requantizes"):
        LiveModel(model(HummingFP8ScaledMMLinearKernel), layout, torch.device("cuda"), "stand-in")
    with pytest.raises(ConfigError, match="Marlin repacks the weight"):
        LiveModel(model(CutlassFp8BlockScaledMMKernel, marlin=True), layout, torch.device("cuda"), "stand-in")
    bf16 = make_layout(spec, "vllm").layout(0)
    with pytest.raises(ConfigError, match="the job's layout for this engine is not quant=fp8"):
        LiveModel(model(CutlassFp8BlockScaledMMKernel), bf16, torch.device("cuda"), "stand-in")


def test_live_model_reruns_deepgemms_post_load_step_once_after_every_update():
    """DeepGEMM, vLLM 0.26's default block-FP8 kernel on Hopper, requantizes the checkpoint's weight and scales after
    loading, in their own shapes: LiveModel takes such a layer as ``in-place+requant`` -- the checkpoint form lands
    in the live weight and scale, and ``refresh`` runs the kernel's own ``process_weights_after_loading`` on them once,
    the engine's parameters then being the live storage (a kernel that answers in new storage is copied back and its
    parameter re-registered over the live tensor; one that changes a shape fails naming the layer). The grouped-BMM
    form is refused. Stand-in kernels whose step is a visible in-place change: the real DeepGEMM step is checked
    against a fresh engine on the GPU host (benchmarks/fp8_vllm_gpu.py)."""
    pytest.importorskip("vllm")
    from weightsync.engines import make_layout
    from weightsync.errors import ConfigError, WeightsMoved
    from weightsync.quant.layout import fp8_layout
    from weightsync.spec import load_spec
    from weightsync.vllm.live import IN_PLACE_REQUANT, LiveModel

    def requant(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stand-in's step: flip the low bit of every e4m3 byte, double every scale (not idempotent, as UE8M0
        requantization is not: run twice, it gives other bytes than once)."""
        return (w.view(torch.uint8) ^ 1).view(torch.float8_e4m3fn), s * 2

    class DeepGemmFp8BlockScaledMMKernel(Fp8BlockScaledMMLinearKernel):
        answer = "in place"  # or "new storage", "other shape"

        def process_weights_after_loading(self, layer):
            w, s = requant(layer.weight.data, layer.weight_scale_inv.data)
            if self.answer == "in place":
                layer.weight.data.copy_(w)
                layer.weight_scale_inv.data.copy_(s)
                w, s = layer.weight.data, layer.weight_scale_inv.data
            elif self.answer == "other shape":
                s = s.reshape(-1)
            layer.weight = torch.nn.Parameter(w, requires_grad=False)  # replace_parameter: a new Parameter
            layer.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)

    spec = load_spec("tiny-qwen3-fp8")
    layout = fp8_layout(make_layout(spec, "vllm:quant=fp8")).layout(0)
    fp8 = {n for n, t in layout.tensors.items() if t.dtype == "float8_e4m3fn"}
    for answer in ("in place", "new storage"):
        DeepGemmFp8BlockScaledMMKernel.answer = answer
        model = _fp8_standin(layout, DeepGemmFp8BlockScaledMMKernel)
        live = LiveModel(model, layout, torch.device("cuda"), "stand-in")
        requantized = live.report.tensors_on(IN_PLACE_REQUANT)
        assert requantized == fp8 | {n + "_scale_inv" for n in fp8} and live.derivations == []
        g = torch.Generator().manual_seed(1)
        landed = {n: torch.randn(live.tensors[n].shape, generator=g).to(live.tensors[n].dtype) for n in requantized}
        for n in requantized:  # a step lands the checkpoint form
            live.tensors[n].copy_(landed[n])
        assert live.refresh() == len(live.transforms) == len(fp8)
        params = dict(model.named_parameters())
        for w in fp8:
            want_w, want_s = requant(landed[w], landed[w + "_scale_inv"])
            for name, want in ((w, want_w), (w + "_scale_inv", want_s)):
                assert params[name].data_ptr() == live.tensors[name].data_ptr(), (answer, name)
                assert torch.equal(params[name].view(torch.uint8), want.view(torch.uint8)), (answer, name)
    DeepGemmFp8BlockScaledMMKernel.answer = "other shape"
    live = LiveModel(_fp8_standin(layout, DeepGemmFp8BlockScaledMMKernel), layout, torch.device("cuda"), "stand-in")
    with pytest.raises(WeightsMoved, match=r"layers\.0\.self_attn\.qkv_proj: DeepGemmFp8BlockScaledMMKernel's "
                                           r"post-load step turned weight_scale_inv \[\d+, \d+\] torch\.float32 into"):
        live.refresh()
    model = _fp8_standin(layout, DeepGemmFp8BlockScaledMMKernel)
    model.get_submodule("model.layers.1.mlp.down_proj").is_bmm = True
    with pytest.raises(ConfigError, match=r"layers\.1\.mlp\.down_proj: .*grouped-BMM form"):
        LiveModel(model, layout, torch.device("cuda"), "stand-in")


def test_live_model_takes_fp8_experts_on_triton_in_place_and_reruns_deepgemms_step():
    """Block-FP8 experts (``Fp8MoEMethod``; tiny-qwen3-moe-fp8): on TRITON, vLLM 0.26's choice on Hopper for
    tensor-parallel experts, the stacks and their block scales are computed with as loaded, so they are in place;
    on DEEPGEMM the method's own post-load step re-runs once after each update and must leave the live storage
    where it was (its kernel keeps references to what it returns); FlashInfer CUTLASS (expert parallelism's choice)
    and per-tensor FP8 are refused naming the layer, as is an FP8 MoE under a bf16 layout. Stand-ins shaped as vLLM
    builds the layer; the real engine is for the GPU host."""
    pytest.importorskip("vllm")
    from weightsync.engines import make_layout
    from weightsync.errors import ConfigError, WeightsMoved
    from weightsync.quant.layout import fp8_layout
    from weightsync.spec import load_spec
    from weightsync.vllm.live import IN_PLACE, IN_PLACE_REQUANT, LiveModel

    class CutlassFp8BlockScaledMMKernel(Fp8BlockScaledMMLinearKernel):
        pass

    spec = load_spec("tiny-qwen3-moe-fp8")
    layout = fp8_layout(make_layout(spec, "vllm:quant=fp8")).layout(0)
    experts = sorted({n.rsplit(".", 1)[0] for n in layout.tensors if n.endswith("w13_weight_scale_inv")})
    assert len(experts) == spec.num_layers
    stacks = {f"{e}.{t}" for e in experts for t in ("w13_weight", "w2_weight", "w13_weight_scale_inv",
                                                    "w2_weight_scale_inv")}
    live = LiveModel(_fp8_standin(layout, CutlassFp8BlockScaledMMKernel), layout, torch.device("cuda"), "stand-in")
    assert {live.report.path_of(e) for e in experts} == {IN_PLACE} and live.transforms == []
    assert stacks <= set(live.tensors)

    def double_scales(layer):  # in place, as DeepGEMM's requantization writes into the stacks it was given
        layer.w13_weight_scale_inv.data.mul_(2)
        layer.w2_weight_scale_inv.data.mul_(2)

    model = _fp8_standin(layout, CutlassFp8BlockScaledMMKernel, moe=lambda: Fp8MoEMethod("DEEPGEMM", double_scales))
    live = LiveModel(model, layout, torch.device("cuda"), "stand-in")
    assert live.report.tensors_on(IN_PLACE_REQUANT) == stacks
    before = {n: live.tensors[n].clone() for n in stacks if n.endswith("scale_inv")}
    assert live.refresh() == len(experts)
    assert all(torch.equal(live.tensors[n], 2 * t) for n, t in before.items())

    def new_storage(layer):
        layer.w2_weight_scale_inv = torch.nn.Parameter(layer.w2_weight_scale_inv * 2, requires_grad=False)

    model = _fp8_standin(layout, CutlassFp8BlockScaledMMKernel, moe=lambda: Fp8MoEMethod("DEEPGEMM", new_storage))
    with pytest.raises(WeightsMoved, match=r"experts.*post-load step turned w2_weight_scale_inv .* in new storage"):
        LiveModel(model, layout, torch.device("cuda"), "stand-in").refresh()
    model = _fp8_standin(layout, CutlassFp8BlockScaledMMKernel, moe=lambda: Fp8MoEMethod("FLASHINFER_CUTLASS"))
    with pytest.raises(ConfigError, match=r"layers\.0\.mlp\.experts.*Fp8MoEMethod on backend FLASHINFER_CUTLASS: it "
                                          r"re-lays the experts"):
        LiveModel(model, layout, torch.device("cuda"), "stand-in")

    def per_tensor():
        m = Fp8MoEMethod("TRITON")
        m.block_quant = False
        return m

    with pytest.raises(ConfigError, match="fused MoE with per-tensor FP8"):
        LiveModel(_fp8_standin(layout, CutlassFp8BlockScaledMMKernel, moe=per_tensor), layout, torch.device("cuda"),
                  "stand-in")
    bf16 = make_layout(spec, "vllm").layout(0)
    with pytest.raises(ConfigError, match="fused MoE served in block FP8 .*not quant=fp8"):
        LiveModel(_fp8_standin(layout, CutlassFp8BlockScaledMMKernel), bf16, torch.device("cuda"), "stand-in")


def test_vllms_own_deepgemm_step_rerun_once_gives_a_fresh_engines_bytes(monkeypatch):
    """vLLM's DeepGEMM post-load step itself -- ``deepgemm_post_process_fp8_weight_block`` with E8M0 from the
    installed vLLM (``requant_weight_ue8m0_inplace``: dequantize with the checkpoint's scales, requantize to
    power-of-two scales) -- driven through LiveModel's ``in-place+requant`` path: an engine loaded from checkpoint A
    (the step run once, as at load) and then synced to checkpoint B (B's checkpoint form lands in the live weight
    and scale, ``refresh`` re-runs the step) holds, bit for bit, what an engine loaded from B holds. Run twice on
    one landing the step gives other bytes (a block whose largest e4m3 value lands on 224 halves its scale), which
    is why it runs exactly once per landing. DeepGEMM's own ``transform_sf_into_required_layout``, which keeps fp32
    128 x 128 weight scales as they are on Hopper, does not run on a CPU: the identity stands in for it; the layer
    modules are stand-ins shaped as vLLM builds them."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    from weightsync.engines import make_layout
    from weightsync.quant.fp8 import quantize_reference
    from weightsync.quant.layout import fp8_layout
    from weightsync.spec import load_spec
    from weightsync.vllm.live import IN_PLACE_REQUANT, LiveModel

    monkeypatch.setattr(fp8_utils, "transform_sf_into_required_layout", lambda sf, **_: sf)

    class DeepGemmFp8BlockScaledMMKernel(Fp8BlockScaledMMLinearKernel):
        def process_weights_after_loading(self, layer):  # scaled_mm/deep_gemm.py, less the base's no-op
            wq, ws = fp8_utils.deepgemm_post_process_fp8_weight_block(
                wq=layer.weight.data, ws=layer.weight_scale_inv.data, quant_block_shape=(128, 128), use_e8m0=True)
            layer.weight = torch.nn.Parameter(wq, requires_grad=False)
            layer.weight_scale_inv = torch.nn.Parameter(ws, requires_grad=False)

    layout = fp8_layout(make_layout(load_spec("tiny-qwen3-fp8"), "vllm:quant=fp8")).layout(0)
    weights = sorted(n for n, t in layout.tensors.items() if t.dtype == "float8_e4m3fn")

    def checkpoint(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        out = {}
        for w in weights:
            q = quantize_reference((torch.randn(layout.tensors[w].shape, generator=g) * 0.05).bfloat16())
            out[w], out[w + "_scale_inv"] = q.weight, q.scale_inv
        return out

    def loaded(ckpt: dict[str, torch.Tensor], times: int = 1) -> dict[str, torch.Tensor]:
        """An engine loaded from ``ckpt``: the checkpoint form in its parameters, the post-load step run."""
        model = _fp8_standin(layout, DeepGemmFp8BlockScaledMMKernel)
        params = dict(model.named_parameters())
        for n, t in ckpt.items():
            params[n].data.copy_(t)
        for _ in range(times):
            for mod in model.modules():
                if type(getattr(mod, "quant_method", None)).__name__ == "Fp8LinearMethod":
                    mod.quant_method.fp8_linear.process_weights_after_loading(mod)
        return model

    a, b = checkpoint(1), checkpoint(2)
    engine = loaded(a)
    live = LiveModel(engine, layout, torch.device("cuda"), "stand-in")
    assert live.report.tensors_on(IN_PLACE_REQUANT) == set(a)
    for n, t in b.items():  # a step lands B's checkpoint form
        live.tensors[n].copy_(t)
    live.refresh()
    fresh = dict(loaded(b).named_parameters())
    synced = dict(engine.named_parameters())
    for n in b:
        assert torch.equal(synced[n].view(torch.uint8), fresh[n].view(torch.uint8)), n
        assert synced[n].data_ptr() == live.tensors[n].data_ptr()
    twice = dict(loaded(b, times=2).named_parameters())
    assert not all(torch.equal(twice[n].view(torch.uint8), fresh[n].view(torch.uint8)) for n in b)
    scales = [n for n in b if n.endswith("_scale_inv")]
    assert all(torch.equal(torch.exp2(torch.log2(fresh[n]).round()), fresh[n]) for n in scales)  # powers of two


def test_what_an_fp8_worker_computes_with_travels_back_and_is_compared_by_bits():
    """weightsync.quant.engine_check.computed answers through pickle (weightsync.vllm.rpc): a pickled float8 tensor
    does not load back (torch 2.11 on the GPU host, 2.13 here: UntypedStorage has no dtype), so FP8 parameters go as
    their bytes under a name carrying the dtype; differences compares bits. (A stand-in model: the parameters only.)"""
    import pickle
    from types import SimpleNamespace as NS

    from weightsync.quant.engine_check import computed, differences

    def model(shift: float):
        m = torch.nn.Module()
        g = torch.Generator().manual_seed(0)
        m.register_parameter("w", torch.nn.Parameter(torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
                                                     requires_grad=False))
        m.register_parameter("n", torch.nn.Parameter(torch.randn(4, generator=g).bfloat16() + shift,
                                                     requires_grad=False))
        return NS(state={"model": m})

    got = pickle.loads(pickle.dumps(computed(model(0.0))))
    assert sorted(got) == ["param:n", "param:w:float8_e4m3fn"] and not differences(got, computed(model(0.0)))
    assert differences(got, computed(model(1.0))) == ["param:n: differs"]


def test_an_engine_whose_quantization_is_not_the_jobs_is_refused():
    """weightsync.vllm.engine.start checks the started engine's own engine string (read from its model config)
    against the job's --infer: quant=fp8 expected and bf16 served, or the reverse, is refused before any byte moves."""
    from weightsync.errors import ConfigError
    from weightsync.vllm.engine import check_quant

    check_quant("vllm:tp=2", "vllm:tp=2")
    check_quant("vllm:tp=1,quant=fp8", "vllm:tp=1,quant=fp8")
    with pytest.raises(ConfigError, match=r"expects vllm:tp=1,quant=fp8 but the engine serves vllm:tp=1 "):
        check_quant("vllm:tp=1,quant=fp8", "vllm:tp=1")
    with pytest.raises(ConfigError, match=r"expects vllm:tp=2 but the engine serves vllm:tp=2,quant=fp8"):
        check_quant("vllm:tp=2", "vllm:tp=2,quant=fp8")


def test_loaded_problems_compares_a_worker_with_the_fp8_checkpoint():
    """weightsync.quant.engine_check.loaded_problems (what the GPU script asks each vLLM worker): a worker holding the
    FP8 checkpoint of the weights placed by its layout has no problem; one flipped e4m3 byte, or one scale, is named.
    (A stand-in worker context: the layout-faithful tensors, no engine.)"""
    from types import SimpleNamespace as NS

    from weightsync.engines import make_layout
    from weightsync.layout.materialize import TORCH_DTYPES, fill_from
    from weightsync.quant.engine_check import loaded_problems
    from weightsync.quant.fp8 import quantize_reference
    from weightsync.quant.layout import fp8_layout
    from weightsync.spec import load_spec
    from weightsync.testing import random_canonical
    from weightsync.vllm.live import LiveReport

    spec = load_spec("tiny-qwen3-fp8")
    layout = fp8_layout(make_layout(spec, "vllm:tp=2,quant=fp8"))
    canonical = random_canonical(spec, seed=9)
    quantized = dict(canonical)
    for w, f in layout.fp8.items():
        q = quantize_reference(canonical[w])
        quantized[w], quantized[f.scale.name] = q.weight, q.scale_inv
    mine = layout.layout(1)
    tensors = {n: torch.zeros(t.shape, dtype=TORCH_DTYPES[t.dtype]) for n, t in mine.tensors.items()}
    fill_from(mine, tensors, quantized)
    ctx = NS(rank=1, tensors=tensors, state={"live": NS(layout=mine, report=LiveReport(1, "cpu", "?", (), 0))})
    assert loaded_problems(ctx, canonical) == []
    w = "model.layers.1.mlp.down_proj.weight"
    tensors[w].view(torch.uint8)[3, 5] ^= 1
    tensors[w + "_scale_inv"][0, 0] *= 2
    got = loaded_problems(ctx, canonical)
    assert len(got) == 2 and all(w in p for p in got), got
