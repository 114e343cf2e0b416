"""Engine configs: one frozen dataclass per engine whose fields drive parsing, checking and printing.

A config is what ``ENGINE:k=v,...`` says (``megatron:tp=2,pp=2``): the user's text, the layout's
description and the string the MetaServer carries between participants are all ``str(config)``, and
:meth:`EngineConfig.parse` reads them back, so a key the engine accepts cannot be lost on the way
(``parse(str(c)) == c`` for every config). Checks that need only the config run once, in
``__post_init__``; checks against a model stay with the layout, which has the spec.

Every value is an int. A field's :class:`Domain` says which ints it takes (a domain with ``names``
reads and prints each int as its word: ``quant=fp8`` is 1); defaults are omitted when printing, and
the keys print in field order.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; only annotations name it (requires-python >= 3.10)

from weightsync.errors import ConfigError


@dataclass(frozen=True)
class Domain:
    """The ints a config key takes: ``lo`` up to ``hi`` (``None``: no upper bound)."""

    lo: int
    hi: int | None = None
    words: str = ""
    names: tuple[str, ...] = ()  # the word of each int from lo on, read and printed instead of the int

    def __contains__(self, v: int) -> bool:
        return v >= self.lo and (self.hi is None or v <= self.hi)

    def describe(self) -> str:
        if self.words:
            return self.words
        return f"at least {self.lo}" if self.hi is None else f"from {self.lo} to {self.hi}"

    def text(self, v: int) -> str:
        """How a value prints: its word where the domain has names, else the int."""
        return self.names[v - self.lo] if self.names and v in self else str(v)

    def read(self, v: str) -> int:
        """A value from its text: one of the names where the domain has them, else an int (ValueError otherwise)."""
        if self.names:
            if v in self.names:
                return self.lo + self.names.index(v)
            raise ValueError(v)
        return int(v)


SIZE = Domain(1)  # a parallel size
COUNT = Domain(0)  # a number that may be 0 (0: unset)
FLAG = Domain(0, 1, "0 or 1")
AUTO_FLAG = Domain(-1, 1, "-1 (auto), 0 or 1")
QUANT = Domain(0, 1, "none or fp8", names=("none", "fp8"))  # how an inference engine holds its linear weights
QUANT_DOC = ("linear weights as the engine holds them: none (the model dtype) or fp8 (128 x 128 block FP8, e4m3 "
             "with fp32 weight_scale_inv; weightsync/quant)")


def key(default: int, domain: Domain, doc: str) -> Any:
    """A config field: its default, the values it takes and one line on what it means."""
    return field(default=default, metadata={"domain": domain, "doc": doc})


@dataclass(frozen=True)
class EngineConfig:
    """Base of the per-engine configs; subclasses add fields made with :func:`key` and set ``engine``."""

    engine: ClassVar[str] = "?"

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool):  # True/False as 1/0, so equal configs compare and print equal
                object.__setattr__(self, f.name, v := int(v))
            dom: Domain = f.metadata["domain"]
            if isinstance(v, str) and v in dom.names:  # quant="fp8" as quant=1
                object.__setattr__(self, f.name, v := dom.read(v))
            if type(v) is not int:
                raise self._refusal(f"{f.name} must be an integer, got {v!r}")
            if v not in dom:
                raise self._refusal(f"{f.name} must be {dom.describe()}, got {v}")
        self._check()

    def _check(self) -> None:
        """Checks between keys (no model needed); subclasses raise ConfigError."""

    # -- the keys ---------------------------------------------------------------------------------
    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The keys this engine takes, in canonical (printing) order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def defaults(cls) -> dict[str, int]:
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}

    @classmethod
    def help(cls) -> str:
        """One line per key: ``tp=1  tensor-parallel size (at least 1)``."""
        return "\n".join(
            f"{f.name}={f.metadata['domain'].text(f.default)}  {f.metadata['doc']} ({f.metadata['domain'].describe()})"
            for f in fields(cls)
        )

    @classmethod
    def _refusal(cls, message: str) -> ConfigError:
        return ConfigError(f"{cls.engine}: {message}; known keys: {', '.join(cls.keys())}")

    # -- text ---------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> Self:
        """Read ``k=v,...`` or ``ENGINE:k=v,...`` (this engine's name only); refuse unknown keys and bad values."""
        head, colon, rest = text.strip().partition(":")
        if not colon:  # "tp=2,pp=2" (keys only), or "megatron" / "" (all defaults)
            head, rest = (cls.engine, head) if "=" in head else (head or cls.engine, "")
        if head.strip() != cls.engine:
            raise ConfigError(f"{cls.engine}: this is a config of engine {head.strip()!r}: {text!r}")
        known = cls.keys()
        values: dict[str, int] = {}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            k, eq, v = (s.strip() for s in item.partition("="))
            if not eq:
                raise cls._refusal(f"expected key=value, got {item!r}")
            if k not in known:
                raise cls._refusal(f"unknown key {k!r}")
            if k in values:
                raise cls._refusal(f"key {k!r} given twice")
            dom: Domain = next(f.metadata["domain"] for f in fields(cls) if f.name == k)
            try:
                values[k] = dom.read(v)
            except ValueError:
                want = f"one of {', '.join(dom.names)}" if dom.names else "an integer"
                raise cls._refusal(f"{k}={v!r} is not {want}") from None
        return cls(**values)

    @classmethod
    def of(cls, config: EngineConfig | None = None, **options: int) -> Self:
        """The config a layout is built from: ``config`` as given, or one made of keyword ``options``."""
        if config is None:
            unknown = [k for k in options if k not in cls.keys()]
            if unknown:
                raise cls._refusal(f"unknown key {unknown[0]!r}")
            return cls(**options)
        if options:
            raise ConfigError(f"{cls.engine}: give a config or keyword options, not both ({', '.join(options)})")
        if type(config) is not cls:
            raise ConfigError(f"{cls.engine}: expected a {cls.__name__}, got {config!r}")
        return config

    def items(self) -> dict[str, int]:
        """The keys that differ from their defaults, in canonical order (what the text shows)."""
        d = self.defaults()
        return {k: v for k, v in asdict(self).items() if v != d.get(k)}

    def __str__(self) -> str:
        doms = {f.name: f.metadata["domain"] for f in fields(self)}
        kv = ",".join(f"{k}={doms[k].text(v)}" for k, v in self.items().items())
        return f"{self.engine}:{kv}" if kv else self.engine

    def describe(self) -> str:
        """``megatron:tp=2,pp=2``: the canonical text, which :func:`parse_engine` reads back to this config."""
        return str(self)

    # -- mapping-style reads (the old ``EngineLayout.config`` was a dict of the non-default keys) ------
    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name) if name in self.keys() else default

    def as_dict(self) -> dict[str, int]:
        """Every key with its value, defaults included."""
        return asdict(self)


# ----------------------------------------------------------------------------------------------------
# The engines


FP32_ROUTER_DOC = ("router weight (DeepSeek-V3's mlp.gate.weight) in fp32 beside a bf16 model (-1: as the installed "
                   "transformers keeps it; the layout records the answer)")
FP32_ROUTER_BIAS_DOC = ("router bias (DeepSeek-V3's e_score_correction_bias) in fp32 beside a bf16 model (-1: as the "
                        "installed transformers keeps it; the layout records the answer)")


@dataclass(frozen=True)
class HFConfig(EngineConfig):
    """``hf``: one rank holding a transformers model.

    ``fp32_router``/``fp32_router_bias`` say whether the tensors transformers may keep in fp32
    (``Architecture.hf_fp32``) are fp32. Which ones it keeps depends on its version, so ``-1``
    (auto) is resolved once, when the layout is built (:mod:`weightsync.engines.hf_fp32`), and the
    layout's description prints the answer: both ends of a job then plan the same layout whatever
    transformers each has. A binding sets them from the live tensors' dtypes.
    """

    engine: ClassVar[str] = "hf"
    fp32: int = key(0, FLAG, "fp32 master weights of a lower-precision model (they travel as fp32)")
    fp32_router: int = key(-1, AUTO_FLAG, FP32_ROUTER_DOC)
    fp32_router_bias: int = key(-1, AUTO_FLAG, FP32_ROUTER_BIAS_DOC)


@dataclass(frozen=True)
class FSDPConfig(EngineConfig):
    """``fsdp``: a transformers model under FSDP2, optionally with TP applied first (``fp32*`` as :class:`HFConfig`)."""

    engine: ClassVar[str] = "fsdp"
    dp: int = key(1, SIZE, "FSDP (data-parallel sharding) size")
    tp: int = key(1, SIZE, "tensor-parallel size")
    fp32: int = key(0, FLAG, "fp32 master weights of a lower-precision model (they travel as fp32)")
    fp32_router: int = key(-1, AUTO_FLAG, FP32_ROUTER_DOC)
    fp32_router_bias: int = key(-1, AUTO_FLAG, FP32_ROUTER_BIAS_DOC)


@dataclass(frozen=True)
class MegatronConfig(EngineConfig):
    """``megatron``: a Megatron-core GPTModel; sizes as ``parallel_state`` takes them."""

    engine: ClassVar[str] = "megatron"
    tp: int = key(1, SIZE, "tensor-parallel size")
    pp: int = key(1, SIZE, "pipeline-parallel size")
    vpp: int = key(1, SIZE, "virtual pipeline chunks per pp rank")
    dp: int = key(1, SIZE, "data-parallel size")
    ep: int = key(1, SIZE, "expert-parallel size (carved out of tp*dp)")
    etp: int = key(1, SIZE, "expert tensor-parallel size (megatron-core's default is tp: pass etp=tp to mirror it)")
    pp_first: int = key(0, COUNT, "layers of the first pipeline stage (0: even split)")
    pp_last: int = key(0, COUNT, "layers of the last pipeline stage (0: even split)")
    te: int = key(0, FLAG, "Transformer Engine layer spec (fused norms)")
    grouped: int = key(0, FLAG, "TE grouped experts (linear_fc1.weight{k}); needs te=1")
    vocab_multiple: int = key(128, SIZE, "make_vocab_size_divisible_by (padded vocab = multiple of this * tp)")

    def _check(self) -> None:
        if self.grouped and not self.te:
            raise ConfigError(
                "megatron: grouped=1 needs te=1 (TEGroupedMLP, weight{k} names); the local spec with "
                "moe_grouped_gemm builds the legacy GroupedMLP (transposed weight1/weight2), not supported"
            )
        if (self.tp * self.dp) % (self.ep * self.etp):
            raise ConfigError(
                f"megatron: tp*dp={self.tp * self.dp} is not divisible by ep*etp={self.ep * self.etp} "
                "(expert data parallel size must be an integer; parallel_state.initialize_model_parallel)"
            )
        if self.pp == 1 and self.vpp > 1:
            raise ConfigError("megatron: vpp>1 needs pp>1 (virtual pipeline interleaves pipeline stages)")
        if self.pp == 1 and (self.pp_first or self.pp_last):
            raise ConfigError("megatron: pp_first/pp_last need pp>1")


@dataclass(frozen=True)
class VLLMConfig(EngineConfig):
    """``vllm``: vLLM workers, world = tp * dp."""

    engine: ClassVar[str] = "vllm"
    tp: int = key(1, SIZE, "tensor-parallel size")
    dp: int = key(1, SIZE, "data-parallel size")
    ep: int = key(1, SIZE, "expert parallelism: 1 (off) or tp*dp (enable_expert_parallel)")
    quant: int = key(0, QUANT, QUANT_DOC)

    def _check(self) -> None:
        world = self.tp * self.dp
        if self.ep not in (1, world):
            raise ConfigError(
                f"vllm: ep={self.ep}: vLLM's expert parallelism spans all tp*dp={world} ranks; use ep={world} or ep=1"
            )


@dataclass(frozen=True)
class SGLangConfig(EngineConfig):
    """``sglang``: SGLang workers; world = tp * dp, or tp with DP attention."""

    engine: ClassVar[str] = "sglang"
    tp: int = key(1, SIZE, "tensor-parallel size")
    dp: int = key(1, SIZE, "data-parallel size (attention DP size with dp_attention=1)")
    ep: int = key(1, SIZE, "expert-parallel size (divides tp)")
    dp_attention: int = key(0, FLAG, "--enable-dp-attention")
    dp_lm_head: int = key(0, FLAG, "--enable-dp-lm-head (needs dp_attention=1)")
    fuse_shared: int = key(-1, AUTO_FLAG, "shared expert fused into the routed ones (-1: SGLang's default for the model)")
    quant: int = key(0, QUANT, QUANT_DOC)

    def _check(self) -> None:
        if self.dp_lm_head and not self.dp_attention:
            raise ConfigError("sglang: dp_lm_head needs dp_attention")
        if self.dp_attention and self.tp % self.dp:
            raise ConfigError(f"sglang: with dp_attention, tp={self.tp} must be divisible by dp={self.dp}")
        if self.tp % self.ep:
            raise ConfigError(f"sglang: tp={self.tp} must be divisible by ep={self.ep}")


#: engine name -> its config class
CONFIGS: dict[str, type[EngineConfig]] = {c.engine: c for c in (HFConfig, FSDPConfig, MegatronConfig, VLLMConfig, SGLangConfig)}


def config_class(name: str) -> type[EngineConfig]:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ConfigError(f"unknown engine {name!r}; known: {', '.join(CONFIGS)}") from None


def parse_engine(text: str | EngineConfig) -> EngineConfig:
    """``"megatron:tp=2,pp=2"`` -> ``MegatronConfig(tp=2, pp=2)`` (a config is returned as it is)."""
    if isinstance(text, EngineConfig):
        return text
    if not isinstance(text, str):
        raise ConfigError(f"an engine config is ENGINE:k=v,... or an EngineConfig, got {text!r}")
    return config_class(text.partition(":")[0].strip()).parse(text)


__all__ = [
    "EngineConfig", "HFConfig", "FSDPConfig", "MegatronConfig", "VLLMConfig", "SGLangConfig", "CONFIGS",
    "Domain", "config_class", "engine_quant", "parse_engine",
]


def engine_quant(infer: str) -> str:
    """The quantization an inference layout string (``vllm:tp=2,quant=fp8``) declares: ``none`` or ``fp8``."""
    return "fp8" if getattr(parse_engine(infer), "quant", 0) else "none"
