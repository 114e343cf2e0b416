"""Layouts of an adapter's canonical tensors: on a PEFT trainer, and in one LoRA slot of vLLM's workers.

Both are :class:`~weightsync.layout.layout.EngineLayout`\\ s over an :class:`~weightsync.lora.adapter.AdapterSpec`
(pure functions of the adapter spec and a config, so the existing :class:`~weightsync.plan.planner.Planner`
plans between them, each end computing the same copies):

``peft`` (:class:`PeftLayout`)
    One rank holding every adapter tensor whole, under the live PEFT parameter's name
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``).

``peft-fsdp`` (:class:`PeftFSDPLayout`)
    A PEFT model under FSDP2 ``fully_shard`` over ``dp`` ranks: each adapter tensor's rows split as FSDP2 splits
    every parameter (``Shard(0)``: ``torch.chunk``, ceil(rows / dp) each, trailing ranks possibly empty), rank ``d``
    holding chunk ``d`` under the live parameter's name (the DTensor's local tensor).

``vllm-lora`` (:class:`VLLMSlotLayout`)
    vLLM 0.32's stacked LoRA buffers (docs/lora.md has the file:line of each rule), one local tensor per
    buffer: ``<wrapper>.lora_a_stacked.<i>`` ``[max_loras, 1, max_lora_rank, in_local]`` and
    ``<wrapper>.lora_b_stacked.<i>`` ``[max_loras, 1, out_local, max_lora_rank]`` for every LoRA wrapper of the
    decoder's linears (``qkv_proj``: 3 slices q, k, v; ``gate_up_proj``: 2 slices gate, up; ``o_proj``,
    ``down_proj``: 1). The adapter's pieces lie in slot ``slot`` only, rows / columns ``0:r`` of the rank
    dimension (the rest of the slot, ``r:max_lora_rank``, is zero padding: vLLM's ``reset_lora`` then a
    ``[:r]`` copy). TP (not fully sharded): column-parallel wrappers (``qkv_proj``, ``gate_up_proj``) keep
    ``lora_A`` whole on every rank and hold rows ``[rank * out/tp, (rank+1) * out/tp)`` of each sub-module's
    ``lora_B`` (k and v: the rank's KV-head block, ``rank // replicas`` where TP exceeds the KV heads);
    row-parallel wrappers (``o_proj``, ``down_proj``) hold columns ``[rank * in/tp, ...)`` of ``lora_A`` and
    ``lora_B`` whole. A slot's bytes are the adapter's cast to ``lora_dtype``; ``lora_B``'s are then multiplied
    by the adapter's scaling in that dtype (:attr:`VLLMSlotLayout.scaled`: a transform after landing, as vLLM's
    ``LoRALayerWeights.optimize`` applies it on load; the pieces say where the unscaled bytes land).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from weightsync.errors import ConfigError
from weightsync.layout.box import Box
from weightsync.layout.layout import EngineLayout, Mesh, Piece, Shard
from weightsync.lora.adapter import AdapterSpec, AdapterTensor, peft_names

#: vLLM's LoRA wrapper of each HF projection, and the projection's slice in it (vllm/lora/utils.py
#: process_packed_modules_mapping; Qwen3/Llama ``packed_modules_mapping``)
WRAPPERS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0), "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
#: the slices of each wrapper (its ``n_slices``), in order
SLICES: dict[str, tuple[str, ...]] = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                      "self_attn.o_proj": ("o_proj",),
                                      "mlp.gate_up_proj": ("gate_proj", "up_proj"),
                                      "mlp.down_proj": ("down_proj",)}
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class _Config:
    text: str

    def describe(self) -> str:
        return self.text


class PeftLayout(EngineLayout):
    """A PEFT model in one process: every adapter tensor whole, under its live parameter name."""

    engine = "peft"

    def __init__(self, spec: AdapterSpec, adapter_name: str = "default"):
        self.config = _Config(f"peft:adapter={adapter_name}")
        self.adapter_name = adapter_name
        self._names = peft_names(spec, adapter_name)
        super().__init__(spec, [Mesh("one", [("x", 1)])])  # type: ignore[arg-type]

    def _shards(self, canonical: str) -> Iterable[Shard]:
        t = self.spec.tensor(canonical)  # type: ignore[attr-defined]
        box = tuple((0, n) for n in t.shape)
        yield Shard(self.meshes["one"].group(), Piece(self._names[canonical], box, canonical, box), t.shape, t.dtype)

    def canonical_names(self, rank: int) -> Iterable[str]:
        return (t.name for t in self.spec.tensors)


class PeftFSDPLayout(EngineLayout):
    """A PEFT model under FSDP2 over ``dp`` ranks: every adapter tensor's dim 0 chunked as FSDP2 shards it."""

    engine = "peft-fsdp"

    def __init__(self, spec: AdapterSpec, dp: int, adapter_name: str = "default"):
        if dp < 1:
            raise ConfigError(f"peft-fsdp: dp must be at least 1, got {dp}")
        self.dp, self.adapter_name = dp, adapter_name
        self.config = _Config(f"peft-fsdp:dp={dp},adapter={adapter_name}")
        self._names = peft_names(spec, adapter_name)
        self.mesh = Mesh("fsdp", [("dp", dp)])
        super().__init__(spec, [self.mesh])  # type: ignore[arg-type]

    def _shards(self, canonical: str) -> Iterable[Shard]:
        from weightsync.engines.fsdp import chunk_range

        t = self.spec.tensor(canonical)  # type: ignore[attr-defined]
        rest = tuple((0, n) for n in t.shape[1:])
        for d in range(self.dp):
            off, n = chunk_range(t.shape[0], self.dp, d)
            if n == 0:  # an empty trailing chunk holds nothing
                continue
            piece = Piece(self._names[canonical], ((0, n),) + rest, canonical, ((off, n),) + rest)
            yield Shard(self.mesh.group(dp=d), piece, (n, *t.shape[1:]), t.dtype)

    def canonical_names(self, rank: int) -> Iterable[str]:
        return (t.name for t in self.spec.tensors)


@dataclass(frozen=True)
class SlotConfig:
    """Where one adapter version lands in a vLLM engine: the engine's LoRA config as its workers report it
    (:class:`weightsync.lora.vllm.SlotProbe`) and the slot chosen. ``wrappers``: the decoder-linear LoRA wrappers
    the engine made, as ``self_attn.qkv_proj`` ... (the same in every layer; vLLM's ``--lora-target-modules`` may
    leave some out)."""

    tp: int
    max_loras: int
    max_lora_rank: int
    lora_dtype: str
    slot: int
    wrappers: tuple[str, ...]

    def describe(self) -> str:
        wrappers = "+".join(w.split(".")[-1] for w in self.wrappers)
        return (f"vllm-lora:tp={self.tp},max_loras={self.max_loras},max_lora_rank={self.max_lora_rank},"
                f"dtype={self.lora_dtype},slot={self.slot},wrappers={wrappers}")


class VLLMSlotLayout(EngineLayout):
    """One LoRA slot of vLLM's stacked buffers on every TP rank (the module docstring has the rules).

    :meth:`buffers` lists every stacked buffer of every rank with its shape, whether the adapter has a piece in
    it or not (the worker checks the live buffers against it: :meth:`layout` alone lists only those with pieces).
    """

    engine = "vllm-lora"

    def __init__(self, spec: AdapterSpec, config: SlotConfig):
        self.config = config
        c = config
        if not 0 <= c.slot < c.max_loras:
            raise ConfigError(f"vllm-lora: slot {c.slot} outside 0..{c.max_loras - 1}")
        problems = []
        if spec.config.r > c.max_lora_rank:
            problems.append(f"rank {spec.config.r} is above the engine's max_lora_rank {c.max_lora_rank}")
        missing = sorted({t.module for t in spec.tensors if WRAPPERS[t.proj][0] not in c.wrappers})
        if missing:
            problems.append(f"the engine has no LoRA wrapper for {', '.join(missing[:6])}"
                            f"{f' and {len(missing) - 6} more' if len(missing) > 6 else ''} (its LoRA wrappers: "
                            f"{', '.join(c.wrappers) or 'none'}; vLLM's --lora-target-modules)")
        if problems:
            raise ConfigError(f"adapter {spec.name} cannot land in this engine: " + "; ".join(problems))
        base = spec.shape
        kv = base.num_kv_heads
        if c.tp >= kv:
            if c.tp % kv:
                raise ConfigError(f"vllm-lora: tp={c.tp} is not a multiple of the {kv} KV heads")
            self.kv_replicas, self.kv_local = c.tp // kv, 1
        else:
            if kv % c.tp:
                raise ConfigError(f"vllm-lora: the {kv} KV heads do not split over tp={c.tp}")
            self.kv_replicas, self.kv_local = 1, kv // c.tp
        tp = Mesh("tp", [("tp", c.tp)])
        kvm = Mesh("kv", [("rep", self.kv_replicas), ("kv", c.tp // self.kv_replicas)])
        super().__init__(spec, [tp, kvm])  # type: ignore[arg-type]
        self._dims = self._module_dims(spec)

    @staticmethod
    def _module_dims(spec: AdapterSpec) -> dict[str, tuple[int, int]]:
        """(out, in) of every adapted module, from its A and B."""
        out: dict[str, list[int]] = {}
        for t in spec.tensors:
            d = out.setdefault(t.module, [0, 0])
            if t.kind == "A":
                d[1] = t.shape[1]
            else:
                d[0] = t.shape[0]
        return {m: (o, i) for m, (o, i) in out.items()}

    @property
    def scaled(self) -> tuple[str, ...]:
        """The canonical tensors whose landed bytes are multiplied by the adapter's scaling afterwards (every
        ``lora_B``; none when the scaling is 1, as ``LoRALayerWeights.optimize`` skips it)."""
        if self.spec.config.scaling == 1:  # type: ignore[attr-defined]
            return ()
        return tuple(t.name for t in self.spec.tensors if t.kind == "B")  # type: ignore[attr-defined]

    # -- the rules ----------------------------------------------------------------------------------
    def _local_name(self, t: AdapterTensor) -> str:
        wrapper, i = WRAPPERS[t.proj]
        return f"model.layers.{t.layer}.{wrapper}.lora_{t.kind.lower()}_stacked.{i}"

    def _shards(self, canonical: str) -> Iterable[Shard]:
        c = self.config
        t: AdapterTensor = self.spec.tensor(canonical)  # type: ignore[attr-defined]
        name, dtype, s = self._local_name(t), c.lora_dtype, c.slot
        r = t.shape[0] if t.kind == "A" else t.shape[1]
        tp = self.meshes["tp"]
        out_f, in_f = self._dims[t.module]
        if t.kind == "A":
            if t.proj in ROW_PARALLEL:
                n = self._split(in_f, t)
                shape = (c.max_loras, 1, c.max_lora_rank, n)
                for rank in range(c.tp):
                    yield Shard(tp.group(tp=rank), self._piece(name, canonical, ((0, r), (rank * n, n)), s), shape,
                                dtype)
            else:
                shape = (c.max_loras, 1, c.max_lora_rank, in_f)
                yield Shard(tp.group(), self._piece(name, canonical, ((0, r), (0, in_f)), s), shape, dtype)
            return
        if t.proj in ROW_PARALLEL:
            shape = (c.max_loras, 1, out_f, c.max_lora_rank)
            yield Shard(tp.group(), self._piece(name, canonical, ((0, out_f), (0, r)), s), shape, dtype)
        elif t.proj in ("k_proj", "v_proj"):
            base = self.spec.shape  # type: ignore[attr-defined]
            n = self.kv_local * base.head_dim
            if n * (c.tp // self.kv_replicas) != out_f:
                raise ConfigError(f"vllm-lora: {canonical} has {out_f} rows, not {base.num_kv_heads} KV heads of "
                                  f"{base.head_dim}")
            kvm = self.meshes["kv"]
            shape = (c.max_loras, 1, n, c.max_lora_rank)
            for kid in range(c.tp // self.kv_replicas):
                yield Shard(kvm.group(kv=kid), self._piece(name, canonical, ((kid * n, n), (0, r)), s), shape, dtype)
        else:  # q_proj, gate_proj, up_proj: column-parallel rows
            n = self._split(out_f, t)
            shape = (c.max_loras, 1, n, c.max_lora_rank)
            for rank in range(c.tp):
                yield Shard(tp.group(tp=rank), self._piece(name, canonical, ((rank * n, n), (0, r)), s), shape, dtype)

    def _split(self, n: int, t: AdapterTensor) -> int:
        if n % self.config.tp:
            raise ConfigError(f"vllm-lora: {t.module} ({n}) does not split over tp={self.config.tp}")
        return n // self.config.tp

    @staticmethod
    def _piece(name: str, canonical: str, canon: Box, slot: int) -> Piece:
        return Piece(name, ((slot, 1), (0, 1)) + tuple((0, n) for _, n in canon), canonical, canon)

    def canonical_names(self, rank: int) -> Iterable[str]:
        return (t.name for t in self.spec.tensors)

    # -- every buffer, adapted or not ---------------------------------------------------------------
    def buffers(self, rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every stacked buffer of the decoder-linear wrappers on ``rank``: name -> (shape, dtype). What vLLM's
        ``create_lora_weights`` allocates (vllm/lora/layers/base_linear.py:104-155, column_parallel_linear.py:
        207-245), whether this adapter targets it or not."""
        c = self.config
        base = self.spec.shape  # type: ignore[attr-defined]
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for layer in range(base.num_layers):
            for wrapper in c.wrappers:
                for i, proj in enumerate(SLICES[wrapper]):
                    out_f, in_f = base.dims(proj)
                    if proj in ROW_PARALLEL:
                        a, b = (c.max_lora_rank, in_f // c.tp), (out_f, c.max_lora_rank)
                    elif proj in ("k_proj", "v_proj"):
                        a, b = (c.max_lora_rank, in_f), (self.kv_local * base.head_dim, c.max_lora_rank)
                    else:
                        a, b = (c.max_lora_rank, in_f), (out_f // c.tp, c.max_lora_rank)
                    name = f"model.layers.{layer}.{wrapper}"
                    out[f"{name}.lora_a_stacked.{i}"] = ((c.max_loras, 1) + a, c.lora_dtype)
                    out[f"{name}.lora_b_stacked.{i}"] = ((c.max_loras, 1) + b, c.lora_dtype)
        return out


__all__ = ["PeftFSDPLayout", "PeftLayout", "ROW_PARALLEL", "SLICES", "SlotConfig", "VLLMSlotLayout", "WRAPPERS"]
