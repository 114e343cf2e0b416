"""Which canonical tensors an FP8-served engine holds in block FP8, and what is refused before any byte moves.

An engine's quantization is what its checkpoint's ``quantization_config`` says (or ``quant=fp8`` in its engine
config, meaning the default below). The rules are vLLM 0.32's (``Fp8Config``, read from
``vllm/model_executor/layers/quantization/fp8.py`` and ``utils/quant_utils.py: is_layer_skipped``), SGLang's
being the same for these models:

- FP8: every linear projection's weight -- attention q/k/v/o (MLA: q_a, q_b, kv_a, kv_b), dense and shared-expert
  gate/up/down, and each routed expert's gate/up/down -- unless its module is listed in ``ignored_layers``
  (or ``modules_to_not_convert``), matched exactly by module name (``model.layers.0.self_attn.q_proj``); a routed
  expert's whole MoE layer is skipped when an ignored name containing ``experts`` contains the layer's
  ``...mlp.experts`` prefix; the shards of one fused module (q/k/v, gate/up, q_a/kv_a) must all agree.
- Not FP8, whatever the config: embeddings, ``lm_head`` (vLLM's ParallelLMHead is no LinearBase), norms, the MoE
  router ``mlp.gate`` and its bias, projection biases. vLLM 0.32 and SGLang build the router with
  ``quant_config=None``; vLLM 0.26 builds Qwen3-MoE's with the model's (``models/qwen3_moe.py``: an FP8 layer unless
  the checkpoint lists it in ``ignored_layers``), so a checkpoint weightsync writes lists every router there
  (:func:`for_checkpoint`), as Qwen's own FP8 checkpoints list them, and a checkpoint that ignores routers only is
  what ``quant=fp8`` means (:meth:`BlockFP8.plain`).

Each FP8 weight ``W [N, K]`` has its scale ``W_scale_inv`` ``float32 [ceil(N/128), ceil(K/128)]`` (per expert, as
the checkpoint names them). Refused, each with one line: a quantization other than block FP8 128 x 128 e4m3 with
dynamic activations (per-tensor or channel-wise FP8, MXFP4, NVFP4, INT4 AWQ/GPTQ, any other block), a trainer whose
weights are not bf16/fp32, and a layout piece of an FP8 tensor that does not start on a 128 block (a TP shard of
704 rows: the engine itself refuses it, since one block's scale cannot come from two ranks).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.errors import ConfigError
from weightsync.layout.layout import EngineLayout
from weightsync.quant.fp8 import BLOCK
from weightsync.spec.model import ModelSpec
from weightsync.spec.records import TensorSpec
from weightsync.spec.roles import Kind, Role

#: the kinds of canonical tensor that are linear projections' weights (the rest is never FP8)
LINEAR_KINDS = frozenset({Kind.Q, Kind.K, Kind.V, Kind.O, Kind.Q_A, Kind.Q_B, Kind.KV_A, Kind.KV_B, Kind.GATE,
                          Kind.UP, Kind.DOWN})
#: canonical kinds the engines fuse into one module (all FP8 or none: vLLM's packed_modules_mapping)
FUSED = ((Kind.Q, Kind.K, Kind.V), (Kind.GATE, Kind.UP), (Kind.Q_A, Kind.KV_A))
TRAINER_DTYPES = ("bfloat16", "float32")
SCALE_SUFFIX = "_scale_inv"
#: an MoE router's module (HF name): never FP8 under these rules, whatever a checkpoint's ``ignored_layers`` says
ROUTER_MODULE = re.compile(r"\.(mlp\.gate|mlp\.shared_expert_gate|block_sparse_moe\.gate)$")

_UNSUPPORTED = {  # quant_method -> what it is, for the refusal
    "mxfp4": "MXFP4", "modelopt": "ModelOpt (FP8 per-tensor or NVFP4)", "modelopt_fp4": "NVFP4",
    "awq": "INT4 AWQ", "gptq": "INT4 GPTQ", "awq_marlin": "INT4 AWQ", "gptq_marlin": "INT4 GPTQ",
    "fbgemm_fp8": "channel-wise FP8", "compressed-tensors": "compressed-tensors", "bitsandbytes": "bitsandbytes",
    "fp8_per_tensor": "per-tensor FP8", "ptpc_fp8": "per-token per-channel FP8", "torchao": "torchao",
}


@dataclass(frozen=True)
class BlockFP8:
    """An engine's block-FP8 quantization: 128 x 128 e4m3 weights with fp32 ``weight_scale_inv``, dynamic activations;
    ``ignored``: module names (HF checkpoint names, without ``.weight``) left in the model dtype."""

    ignored: tuple[str, ...] = ()
    block: tuple[int, int] = (BLOCK, BLOCK)

    def __post_init__(self) -> None:
        if tuple(self.block) != (BLOCK, BLOCK):
            raise ConfigError(f"fp8: weight_block_size {list(self.block)} is not supported; only [{BLOCK}, {BLOCK}] "
                              "(DeepSeek-V3, Kimi-K2, Qwen3-FP8) is")

    def plain(self) -> bool:
        """Whether this is what ``quant=fp8`` means: 128 x 128 blocks, no module ignored but MoE routers (which are
        never FP8 here: listing them only keeps an engine version that would quantize them from doing so)."""
        return tuple(self.block) == (BLOCK, BLOCK) and all(ROUTER_MODULE.search(m) for m in self.ignored)

    def hf_config(self) -> dict[str, Any]:
        """The checkpoint's ``quantization_config`` for this quantization."""
        out: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": list(self.block)}
        if self.ignored:
            out["ignored_layers"] = list(self.ignored)
        return out


def for_checkpoint(spec: ModelSpec) -> BlockFP8:
    """``quant=fp8`` as a checkpoint of ``spec`` writes it: every MoE router's module in ``ignored_layers`` (module
    docstring: vLLM 0.26 would build Qwen3-MoE's as an FP8 layer otherwise)."""
    routers = sorted({_module(t) for t in spec.tensors if t.role.kind is Kind.ROUTER and not t.role.bias})
    return BlockFP8(tuple(routers))


def from_hf(quantization_config: Mapping[str, Any] | None) -> BlockFP8 | None:
    """The quantization a checkpoint's ``quantization_config`` describes (None: not quantized), or a one-line
    ConfigError naming what is not supported."""
    if not quantization_config:
        return None
    qc = dict(quantization_config)
    method = str(qc.get("quant_method", "?"))
    if method != "fp8":
        what = _UNSUPPORTED.get(method, f"quant_method {method!r}")
        algo = qc.get("quant_algo") or qc.get("format")
        raise ConfigError(f"fp8: the engine's checkpoint is quantized with {what}{f' ({algo})' if algo else ''}; "
                          "weightsync syncs block FP8 only (quant_method fp8, weight_block_size [128, 128])")
    block = qc.get("weight_block_size")
    if block is None:
        raise ConfigError("fp8: the engine's checkpoint is per-tensor FP8 (quant_method fp8 without "
                          "weight_block_size); "
                          "weightsync syncs block FP8 only (weight_block_size [128, 128])")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"fp8: fmt {fmt!r} is not supported; block FP8 weights are e4m3 (float8_e4m3fn)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"fp8: activation_scheme {scheme!r} is not supported with block FP8 (vLLM refuses it too); "
                          "use 'dynamic'")
    if qc.get("store_dtype"):
        raise ConfigError(f"fp8: store_dtype {qc['store_dtype']!r} (experts in another format) is not supported")
    ignored = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()
    if isinstance(block, (int, str)) or len(block) != 2:
        raise ConfigError(f"fp8: weight_block_size must be two sizes, got {block!r}")
    return BlockFP8(tuple(str(m) for m in ignored), (int(block[0]), int(block[1])))


@dataclass(frozen=True)
class FP8Tensor:
    """One canonical weight held in block FP8: the weight as the checkpoint has it (``float8_e4m3fn``) and its scale."""

    weight: TensorSpec  # dtype float8_e4m3fn
    scale: TensorSpec  # ``<weight>_scale_inv``, float32, the weight's shape counted in 128 blocks (role: the weight's)
    source_dtype: str  # the dtype of the spec's (trainer's) weight, quantized from


def scale_name(weight: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj.weight_scale_inv``."""
    return weight + SCALE_SUFFIX


def _module(t: TensorSpec) -> str:
    return t.name.removesuffix(".weight")


def _skipped(t: TensorSpec, ignored: frozenset[str]) -> bool:
    """vLLM's ``is_layer_skipped`` (exact mode) on the canonical tensor's module; experts by their MoE layer."""
    module = _module(t)
    if t.role.routed:
        layer = module.rsplit(".experts.", 1)[0] + ".experts"
        return any(layer in name for name in ignored if "experts" in name)
    return module in ignored


def fp8_tensors(spec: ModelSpec, quant: BlockFP8) -> tuple[FP8Tensor, ...]:
    """The canonical tensors ``quant`` makes FP8 in ``spec``, in checkpoint order; a fused module whose shards
    disagree (q listed in ``ignored_layers`` but not k) is refused as vLLM refuses it."""
    ignored = frozenset(quant.ignored)
    out: list[FP8Tensor] = []
    for t in spec.tensors:
        if t.role.kind not in LINEAR_KINDS or t.role.bias or _skipped(t, ignored):
            continue
        if len(t.shape) != 2:
            raise ConfigError(f"fp8: {t.name} has shape {t.shape}; block FP8 needs 2-d weights")
        n, k = t.shape
        scale = TensorSpec(scale_name(t.name), (-(-n // BLOCK), -(-k // BLOCK)), "float32", t.role)
        out.append(FP8Tensor(TensorSpec(t.name, t.shape, "float8_e4m3fn", t.role), scale, t.dtype))
    _check_fused(spec, ignored)
    return tuple(out)


def _check_fused(spec: ModelSpec, ignored: frozenset[str]) -> None:
    for t in spec.tensors:
        for group in FUSED:
            if t.role.kind != group[0] or t.role.bias:
                continue
            members = [spec.by_role.get(Role(k, t.role.layer, t.role.expert, t.role.shared)) for k in group]
            members = [m for m in members if m is not None]
            skipped = {m.name: _skipped(m, ignored) for m in members}
            if len(set(skipped.values())) > 1:
                listed = ", ".join(_module(m) for m in members if skipped[m.name])
                unlisted = ", ".join(_module(m) for m in members if not skipped[m.name])
                raise ConfigError(f"fp8: ignored_layers lists {listed} but not {unlisted}; the engine "
                                  "fuses them into one module, which must be all FP8 or all unquantized")


def not_fp8(spec: ModelSpec, quant: BlockFP8) -> tuple[str, ...]:
    """The canonical tensors that stay in the model dtype (embeddings, norms, lm_head, routers, biases, ignored)."""
    fp8 = {f.weight.name for f in fp8_tensors(spec, quant)}
    return tuple(t.name for t in spec.tensors if t.name not in fp8)


def checkpoint_tensors(spec: ModelSpec, quant: BlockFP8) -> tuple[TensorSpec, ...]:
    """Every canonical tensor of the FP8 checkpoint of ``spec``: FP8 weights (e4m3) each followed by its
    ``_scale_inv`` (fp32), the rest as the spec has them, in checkpoint order."""
    fp8 = {f.weight.name: f for f in fp8_tensors(spec, quant)}
    out: list[TensorSpec] = []
    for t in spec.tensors:
        f = fp8.get(t.name)
        out += [t] if f is None else [f.weight, f.scale]
    return tuple(out)


def check_trainer_dtypes(dtypes: Mapping[str, str], fp8: Iterable[FP8Tensor]) -> None:
    """Refuse an FP8 tensor whose trainer-side dtype (``dtypes[name]``, e.g. a layout's local tensors) is not
    bf16/fp32: the quantizer reads bf16 or fp32 only."""
    for f in fp8:
        d = dtypes.get(f.weight.name, f.source_dtype)
        if d not in TRAINER_DTYPES:
            raise ConfigError(f"fp8: the trainer holds {f.weight.name} in {d}; block FP8 is quantized from bf16 or "
                              "fp32 weights only (a later issue may add others)")


def block_problems(layout: EngineLayout, fp8: Iterable[FP8Tensor]) -> list[str]:
    """One line per piece of an FP8 tensor that a 128 block boundary does not start (in the canonical tensor or in
    the engine's local, possibly fused, tensor), or that ends inside a block short of the tensor's edge: the
    block's scale would have to come from two pieces. (vLLM refuses the same shards at load: the output partition
    sizes of a column-parallel or merged linear, the input size of a row-parallel one, an expert's intermediate
    size per partition, must be multiples of the block.)"""
    out: list[str] = []
    for f in fp8:
        line = _first_cut(layout, f)
        if line:
            out.append(line)
    return out


def _first_cut(layout: EngineLayout, f: FP8Tensor) -> str | None:
    cshape = f.weight.shape
    for shard in layout.shards(f.weight.name):
        p = shard.piece
        lead = len(p.local_box) - len(p.canon_box)
        for dim, what in ((0, "rows"), (1, "columns")):
            co, cn = p.canon_box[dim]
            lo, _ = p.local_box[lead + dim]
            bad_canon = co % BLOCK or (cn % BLOCK and co + cn != cshape[dim])
            bad_local = lo % BLOCK or (cn % BLOCK and lo + cn != shard.shape[lead + dim])
            if bad_canon:
                return (f"fp8: {f.weight.name}: {layout.describe()} shards its {cshape[dim]} {what} {cn} a piece "
                        f"({what} {co}..{co + cn} on a rank), which cuts a {BLOCK} x {BLOCK} FP8 block; the engine "
                        f"refuses such a shard too: choose a parallel size that splits {cshape[dim]} in multiples of "
                        f"{BLOCK}")
            if bad_local:
                return (f"fp8: {f.weight.name}: {layout.describe()} places its {cn} {what} at {what} {lo}..{lo + cn} "
                        f"of the fused {p.tensor} {list(shard.shape)}, off the {BLOCK} x {BLOCK} FP8 blocks; the "
                        f"engine refuses such a fused layer too (its parts must be multiples of {BLOCK})")
    return None


def check_layout(layout: EngineLayout, quant: BlockFP8) -> tuple[FP8Tensor, ...]:
    """The FP8 tensors of ``layout``'s model, after refusing (one ConfigError, its first problem named, the count
    of the others) any piece that cuts a 128 block."""
    fp8 = fp8_tensors(layout.spec, quant)
    problems = block_problems(layout, fp8)
    if problems:
        more = f" (and {len(problems) - 1} more tensors)" if len(problems) > 1 else ""
        raise ConfigError(problems[0] + more)
    return fp8


__all__ = [
    "BlockFP8", "FP8Tensor", "LINEAR_KINDS", "TRAINER_DTYPES", "block_problems", "check_layout",
    "check_trainer_dtypes", "checkpoint_tensors", "for_checkpoint", "fp8_tensors", "from_hf", "not_fp8", "scale_name",
]
