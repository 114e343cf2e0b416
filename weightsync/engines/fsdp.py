"""``fsdp``: a transformers model under PyTorch FSDP2 (``fully_shard``), optionally with TP first.

Local tensors are the ``hf`` layout's (same names, dtypes, stacked experts, ``fp32_*`` keys);
each rank holds the *local tensor* of a sharded DTensor parameter (``param.to_local()``).

Sharding, as torch 2.x computes it:

* TP (``tp>1``, torchtitan's plan, applied first with ``parallelize_module`` on the ``tp`` mesh):
  ColwiseParallel on q/k/v_proj (weights and biases) and gate/up_proj -> ``Shard(0)``;
  RowwiseParallel on o_proj/down_proj -> ``Shard(1)``; embed_tokens RowwiseParallel (an embedding's
  weight is ``Shard(0)``, over the vocab); lm_head ColwiseParallel (``Shard(0)``); norms
  (SequenceParallel) and everything else ``Replicate``. DTensor splits with ``torch.chunk``
  (placement_types.py, ``Shard._custom_chunk``), so an uneven vocab leaves the last TP ranks short.
* FSDP2 then chunks the TP-local tensor (``DTensor._local_tensor``, or the plain parameter) on
  dim 0 over ``dp`` (fsdp/_fully_shard/_fsdp_param.py, ``_init_sharded_param``:
  ``_chunk_with_empty`` = ``torch.chunk`` padded with empty chunks). Chunk size is
  ``ceil(n / dp)``, so trailing ranks get smaller or *empty* shards; an empty shard's local tensor
  is ``narrow(0, 0, 0)`` of the padded shard, shape ``(0, *rest)``, and holds no piece (so it is
  absent from the derived layout). The resulting placements are ``(Shard(0), ...)`` on ``dp`` or
  ``(_StridedShard(0, split_factor=tp), Shard(0))`` when TP also splits dim 0.
* Buffers are not sharded by FSDP: DeepSeek-V3's ``e_score_correction_bias`` (a persistent fp32
  ``nn.Buffer`` in transformers 5) is whole on every rank.

Mesh: ``init_device_mesh(("dp", "tp"))`` is row-major, so ``tp`` varies fastest:
``rank = dp_index * tp + tp_index``.

MoE experts and MLA attention have no standard TP plan here: ``tp>1`` is refused for them.
"""

from __future__ import annotations

from typing import Iterable

from weightsync.engines.config import FSDPConfig, HFConfig
from weightsync.engines.hf import HFLayout, resolve_fp32_keys
from weightsync.errors import ConfigError
from weightsync.layout.box import Box, box_shape, full_box
from weightsync.layout.layout import EngineLayout, Mesh, Piece, Shard
from weightsync.spec.model import ModelSpec
from weightsync.spec.roles import Kind, Role

# torchtitan's TP plan: the role of a tensor's canonical tensor -> the dim TP shards it on (colwise 0,
# rowwise 1; an embedding's weight is Shard(0) over the vocab). Dense MLPs only: TP is refused for MoE.
TP_DIMS: dict[Kind, int] = {
    Kind.Q: 0, Kind.K: 0, Kind.V: 0, Kind.O: 1,  # biases (Qwen2) shard like their weights
    Kind.GATE: 0, Kind.UP: 0, Kind.DOWN: 1,
    Kind.EMBED: 0, Kind.LM_HEAD: 0,
}


def chunk_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of ``torch.chunk(x, parts)[index]`` along a dim of size ``n`` (empty past the end)."""
    c = -(-n // parts)
    lo = min(index * c, n)
    return lo, min(lo + c, n) - lo


def chunks_touching(n: int, parts: int, lo: int, length: int) -> range:
    """Indices of the ``torch.chunk`` parts of a size-``n`` dim that overlap rows ``[lo, lo+length)``."""
    if length <= 0 or n <= 0:
        return range(0)
    c = -(-n // parts)
    return range(lo // c, min(parts, (lo + length - 1) // c + 1))


def restrict(piece: Piece, region: Box) -> Piece | None:
    """The part of ``piece`` (boxes in full hf-tensor coordinates) inside ``region``, re-based to it.

    ``piece.local_box`` may have extra leading dimensions of length 1 (a stacked expert) that its
    ``canon_box`` lacks.
    """
    extra = len(piece.local_box) - len(piece.canon_box)
    local, canon = [], []
    for j, ((po, pn), (ro, rn)) in enumerate(zip(piece.local_box, region)):
        lo, hi = max(po, ro), min(po + pn, ro + rn)
        if hi <= lo:
            return None
        local.append((lo - ro, hi - lo))
        if j >= extra:
            co = piece.canon_box[j - extra][0]
            canon.append((co + lo - po, hi - lo))
    return Piece(piece.tensor, tuple(local), piece.canonical, tuple(canon))


class FSDPLayout(EngineLayout):
    engine = "fsdp"
    keys = FSDPConfig.keys()

    def __init__(self, spec: ModelSpec, config: FSDPConfig | None = None, **options: int):
        self.config = c = resolve_fp32_keys(spec, FSDPConfig.of(config, **options))
        dp, tp = c.dp, c.tp
        self.dp, self.tp = dp, tp
        if tp > 1:
            self._check_tp(spec, tp)
        self.mesh = Mesh("fsdp", [("tp", tp), ("dp", dp)])
        super().__init__(spec, [self.mesh])
        # fp32=1: fp32 master weights (FSDP2 mixed precision); fp32_*: what transformers keeps in fp32
        self._hf = HFLayout(spec, HFConfig(fp32=c.fp32, fp32_router=c.fp32_router, fp32_router_bias=c.fp32_router_bias))
        self._everyone = self.mesh.group()

    @staticmethod
    def _check_tp(spec: ModelSpec, tp: int) -> None:
        a = spec.attention
        if spec.is_moe:
            raise ConfigError(
                f"fsdp: tp={tp} is not supported for MoE model {spec.name}: transformers' stacked experts "
                "(mlp.experts.gate_up_proj) have no standard tensor-parallel plan; use tp=1"
            )
        if a.kind != "gqa":
            raise ConfigError(f"fsdp: tp={tp} is not supported for {a.kind} attention ({spec.name}); use tp=1")
        for what, n in (("num_attention_heads", a.num_heads), ("num_key_value_heads", a.num_kv_heads)):
            if n % tp:
                raise ConfigError(f"fsdp: {what}={n} of {spec.name} is not divisible by tp={tp}")
        for layer in spec.layers:
            if layer.intermediate_size % tp:
                raise ConfigError(
                    f"fsdp: intermediate_size={layer.intermediate_size} (layer {layer.index}) of {spec.name} "
                    f"is not divisible by tp={tp}"
                )

    def tp_dim(self, role: Role) -> int | None:
        """The dim TP shards the local tensor holding ``role`` on, or None when it is replicated over ``tp``."""
        if self.tp == 1 or (role.kind in (Kind.GATE, Kind.UP, Kind.DOWN) and not role.dense_mlp):
            return None
        return TP_DIMS.get(role.kind)

    def canonical_names(self, rank: int) -> Iterable[str]:
        return (t.name for t in self.spec.tensors)

    def _shards(self, canonical: str) -> Iterable[Shard]:
        role = self.spec.tensor(canonical).role
        for hs in self._hf.shards(canonical):
            piece, shape = hs.piece, hs.shape
            if role.kind in self.spec.arch.hf_buffers:  # a buffer: FSDP leaves it whole everywhere
                yield Shard(self._everyone, piece, shape, hs.dtype)
                continue
            tdim = self.tp_dim(role)
            if tdim is None:
                tp_parts = [(None, full_box(shape))]
            else:
                po, pn = piece.local_box[tdim]
                tp_parts = []
                for t in chunks_touching(shape[tdim], self.tp, po, pn):
                    box = list(full_box(shape))
                    box[tdim] = chunk_range(shape[tdim], self.tp, t)
                    tp_parts.append((t, tuple(box)))
            for t, tp_box in tp_parts:
                (r0, n0), rest = tp_box[0], tp_box[1:]
                po, pn = piece.local_box[0]
                lo, hi = max(po - r0, 0), min(po + pn - r0, n0)  # the piece's rows inside the TP-local tensor
                for d in chunks_touching(n0, self.dp, lo, hi - lo):
                    off, n = chunk_range(n0, self.dp, d)
                    region = ((r0 + off, n),) + rest
                    sub = restrict(piece, region)
                    if sub is None:
                        continue
                    group = self.mesh.group(dp=d) if t is None else self.mesh.group(dp=d, tp=t)
                    yield Shard(group, sub, box_shape(region), hs.dtype)
