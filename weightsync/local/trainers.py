"""Real training engines for a local job's training processes: transformers, FSDP2 (+TP), megatron-core.

:func:`build_trainer` builds one rank of ``--train ENGINE:k=v,...`` in a process whose default
group is up, binds it (:mod:`weightsync.bind.train`) and returns a :class:`LocalTrainer`: the
bound tensors a WeightWriter sends, and a real optimizer step on a token batch.

Every engine starts from the same weights (the transformers model of the spec built with
``seed``), so any layout of a job holds the same model. On CPU, megatron-core runs over gloo with
a few shims, applied only there (:func:`_megatron_cpu_shims`): no parameter is created, renamed or
moved by them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from weightsync.bind import Bound
from weightsync.engines import make_layout
from weightsync.errors import ConfigError
from weightsync.spec.model import ModelSpec


@dataclass
class LocalTrainer:
    """One training rank: ``bound`` (what its WeightWriter sends) and ``modules`` (what it trains).

    ``train_step(tokens)`` runs forward, backward and an AdamW step on a ``[batch, seq]`` batch
    (collective: every rank calls it) and returns the loss where this rank computes one.
    ``logits(tokens)`` is the full model's output where it equals a plain transformers model's bit for
    bit (``hf``, and ``fsdp`` without TP, where it is collective); None elsewhere.
    """

    bound: Bound
    modules: list[torch.nn.Module]
    train_step: Callable[[torch.Tensor], float | None]
    logits: Callable[[torch.Tensor], torch.Tensor] | None = None
    data_rank: int = 0  # which batch this rank takes: ranks holding one replica's shards take the same one


def build_trainer(spec: ModelSpec, train: str, rank: int, world: int, *, device: str = "cpu", fp32: bool = False,
                  seed: int = 0, lr: float = 1e-3, same_start: bool = True,
                  fp32_master: bool = False) -> LocalTrainer:
    """Build training rank ``rank`` of ``world`` for the layout ``train`` (the default group must be up).

    ``device``: ``cpu`` or ``cuda`` (rank r on ``cuda:r``). ``fp32``: keep fp32 weights of a
    lower-precision model (mixed precision's master copy; transformers and FSDP2 only).
    ``same_start=False`` leaves megatron-core's own initial weights (seconds less to start, for a
    caller that overwrites every weight anyway) instead of the transformers model's.
    ``fp32_master``: AdamW steps fp32 master copies of the (bf16) weights, which are then rounded
    into the model: the bound tensors (the wire) stay bf16, and at RL learning rates most of their
    elements do not change from one step to the next (``weightsync demo --lr``, delta updates).
    """
    engine = make_layout(spec, train)
    if engine.world_size != world:
        raise ConfigError(f"{train}: {engine.world_size} training ranks, {world} processes started")
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    if engine.engine == "megatron":
        if fp32:
            raise ConfigError("megatron: fp32 master weights live in Megatron's optimizer, not the model; "
                              "train megatron in the model dtype")
        if fp32_master:
            raise ConfigError("megatron: fp32 master weights live in Megatron's optimizer; the local trainer "
                              "keeps them for hf and fsdp only")
        return _megatron(spec, engine, rank, dev, seed, lr, same_start)
    from weightsync.checkpoint.hf import build_hf_model

    model = build_hf_model(spec, seed=seed)
    if fp32:
        model = model.float()
    model = model.to(dev)
    if engine.engine == "hf":
        from weightsync.bind.train import HFTrainEngine

        bound = HFTrainEngine(model).bound
        data_rank = 0
    elif engine.engine == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        from weightsync.bind.train import FSDPTrainEngine

        tp = engine.config.get("tp", 1)
        if tp > 1:  # torchtitan's order: TP first, then FSDP over dp (2-D mesh, tp fastest)
            mesh2 = init_device_mesh(dev.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
            apply_tp(model, mesh2["tp"], spec.tie_word_embeddings, sequence_parallel=False)
            mesh = mesh2["dp"]
        else:
            mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
        shard_fsdp(model, mesh)
        bound = FSDPTrainEngine(model).bound
        data_rank = rank // tp
    else:
        raise ConfigError(f"{train}: no local trainer for engine {engine.engine!r}; use hf, fsdp or megatron")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def train_step(tokens: torch.Tensor) -> float:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    if fp32_master:
        if fp32:
            raise ConfigError("fp32_master keeps fp32 copies of lower-precision weights; the model is fp32 already")
        train_step = _master_step(model, lr)

    def logits(tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=tokens).logits.detach()

    # under TP the row-parallel sums run in another order than one process's: the logits are not the
    # transformers model's bit for bit (the weights are), so none are offered
    return LocalTrainer(bound, [model], train_step, logits if engine.config.get("tp", 1) == 1 else None, data_rank)


def _master_step(model: torch.nn.Module, lr: float) -> Callable[[torch.Tensor], float]:
    """A train step whose AdamW updates fp32 master copies of the model's parameters (DTensors under
    FSDP2 too) and rounds them back into the parameters, as mixed-precision trainers do."""
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=lr)

    def train_step(tokens: torch.Tensor) -> float:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = None if p.grad is None else p.grad.detach().float()
            p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        return loss.item()

    return train_step


# --------------------------------------------------------------------------------------------
# FSDP2


def shard_fsdp(model: torch.nn.Module, mesh: Any) -> None:
    """``fully_shard`` every decoder layer, then the root, as torchtitan does.

    FSDP2 needs one parameter dtype per group. A module whose own parameters are of another dtype
    than the rest of its layer -- DeepSeek-V3's router weight, kept fp32 by transformers beside
    bf16 weights -- is sharded as a group of its own first; its parameters stay fp32. Sharding is
    per parameter (dim 0 over dp) whatever the groups, so the layout is the same.
    """
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        dtypes = [p.dtype for p in layer.parameters()]
        main = max(set(dtypes), key=dtypes.count) if dtypes else None
        for name, sub in layer.named_modules():
            own = {p.dtype for p in sub.parameters(recurse=False)}
            if name and own and own != {main}:
                if len(own) > 1:
                    raise ConfigError(f"fsdp: module {name} of a layer holds parameters of dtypes "
                                      f"{sorted(map(str, own))}; FSDP2 needs one dtype per group")
                fully_shard(sub, mesh=mesh)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def apply_tp(model: torch.nn.Module, tp_mesh: Any, tied: bool, sequence_parallel: bool = True) -> None:
    """torchtitan's Llama TP plan on a transformers model: q/k/v, gate and up column-parallel, o and down
    row-parallel, the embedding and the output layer split over the vocab.

    ``sequence_parallel`` (torchtitan's default) also splits the norms' activations over the sequence:
    the weights are the same, but a transformers decoder cannot run a forward so (it takes its
    positions and mask from the sequence length it sees), so a trainer that runs one passes False
    and keeps every activation whole."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    if sequence_parallel:
        root = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    else:
        root = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        }
    if tied and sequence_parallel:
        del root["lm_head"]  # it shares the (Shard(0) over vocab) embedding DTensor, as ColwiseParallel would shard it
    parallelize_module(model, tp_mesh, root)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    for layer in model.model.layers:
        plan = {
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel(),
        }
        if sequence_parallel:
            plan.update(input_layernorm=SequenceParallel(), post_attention_layernorm=SequenceParallel())
        for m in ("q_proj", "k_proj", "v_proj"):
            plan[f"self_attn.{m}"] = ColwiseParallel()
        parallelize_module(layer, tp_mesh, plan)


# --------------------------------------------------------------------------------------------
# megatron-core


def mcore_config(spec: ModelSpec, layout: Any) -> Any:
    """The megatron-core ``TransformerConfig`` of a spec under a ``megatron`` layout (local spec, bf16)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    a = spec.attention
    dense = [x for x in spec.layers if not x.moe]
    moe = [x for x in spec.layers if x.moe]
    L = layout
    kw = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=a.num_heads,
        ffn_hidden_size=dense[0].intermediate_size if dense else spec.config["intermediate_size"],
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=a.qkv_bias, qk_layernorm=a.qk_norm or a.kind == "mla", layernorm_epsilon=1e-6,
        use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True,
        pipeline_dtype=torch.bfloat16 if L.pp > 1 else None,
        tensor_model_parallel_size=L.tp, pipeline_model_parallel_size=L.pp,
        virtual_pipeline_model_parallel_size=L.vpp if L.vpp > 1 else None,
        expert_model_parallel_size=L.ep, expert_tensor_parallel_size=L.etp,
        num_layers_in_first_pipeline_stage=L.pp_first or None, num_layers_in_last_pipeline_stage=L.pp_last or None,
    )
    if moe:
        kw.update(
            num_moe_experts=moe[0].num_experts, moe_ffn_hidden_size=moe[0].intermediate_size,
            moe_router_topk=int(spec.config.get("num_experts_per_tok", 2)),
            moe_layer_freq=[1 if x.moe else 0 for x in spec.layers],
            moe_shared_expert_intermediate_size=moe[0].shared_intermediate_size or None,
            moe_router_enable_expert_bias=moe[0].router_bias,
            moe_router_score_function="sigmoid" if moe[0].router_bias else "softmax",
        )
    if a.kind == "mla":
        return MLATransformerConfig(
            **kw, multi_latent_attention=True, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
            qk_head_dim=a.qk_nope_head_dim, qk_pos_emb_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim,
            rope_type="rope",
        )
    return TransformerConfig(**kw, num_query_groups=a.num_kv_heads, kv_channels=a.head_dim)


def _megatron_cpu_shims() -> None:
    """What megatron-core 0.16 needs to train on CPU over gloo; none creates, renames or moves a parameter.

    Buffers it puts on ``torch.cuda.current_device()`` and the tied embedding it moves with
    ``.cuda()`` stay on CPU; the CUDA RNG tracker (forked around dropout, which is off here) forks
    nothing; the router's TE GEMM, undefined without Transformer Engine, is absent.
    """
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    from megatron.core.tensor_parallel import random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils

    mrandom.initialize_rng_tracker()
    mrandom.get_cuda_rng_tracker().fork = lambda name=None: contextlib.nullcontext()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def megatron_model(spec: ModelSpec, layout: Any, device: torch.device, seed: int = 0) -> list[torch.nn.Module]:
    """This rank's GPTModel chunk(s) under ``layout``, wrapped in ``Float16Module`` as Megatron's trainer
    does (``parallel_state`` is initialised here, over the default group)."""
    from megatron.core import parallel_state as ps

    if device.type == "cpu":
        _megatron_cpu_shims()
    if layout.vpp > 1:
        raise ConfigError("megatron: a local trainer runs one model chunk per rank (vpp=1)")
    if spec.attention.kind == "mla":
        raise ConfigError("megatron: multi-latent attention needs Transformer Engine to run a forward; "
                          "train a GQA model (tiny-qwen3, tiny-llama3, tiny-qwen3-moe, ...) under megatron here")
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module

    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
    )
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    cfg = mcore_config(spec, layout)
    cfg.attention_dropout = cfg.hidden_dropout = 0.0  # identical replicas stay identical
    p = ps.get_pipeline_model_parallel_rank()
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm", pp_rank=p)
    m = GPTModel(cfg, block, vocab_size=layout.padded_vocab, max_sequence_length=256, pre_process=p == 0,
                 post_process=p == layout.pp - 1, share_embeddings_and_output_weights=spec.tie_word_embeddings,
                 position_embedding_type="rope")
    return [Float16Module(cfg, m).to(device)]


def _megatron(spec: ModelSpec, engine: Any, rank: int, dev: torch.device, seed: int, lr: float,
              same_start: bool) -> LocalTrainer:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from weightsync.bind.train import MegatronTrainEngine
    from weightsync.layout.materialize import fill_from
    from weightsync.checkpoint.hf import build_hf_model, hf_canonical

    chunks = megatron_model(spec, engine, dev, seed)
    bound = MegatronTrainEngine(chunks, dict(spec.config)).bound
    if same_start:  # the same start as every other engine: the transformers model's weights
        with torch.no_grad():
            start = hf_canonical(build_hf_model(spec, seed))
            fill_from(bound.layout, bound.tensors, {n: t.to(dev) for n, t in start.items()})
    model = chunks[0]
    inner = model.module
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    first, last = pp_rank == 0, pp_rank == pp - 1

    def train_step(tokens: torch.Tensor) -> float | None:
        """One microbatch through the pipeline (forward stage by stage, backward in reverse), gradients
        averaged over data-parallel replicas (and tied embeddings over their two stages), AdamW."""
        tokens, labels = tokens[:, :-1], tokens[:, 1:]  # each position predicts the next token
        b, s = tokens.shape
        pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=tokens.device), diagonal=1)
        inp = None
        if not first:
            inp = torch.empty(s, b, spec.hidden_size, dtype=torch.bfloat16, device=tokens.device)
            dist.recv(inp, group=pp_group, group_src=pp_rank - 1)
            inp.requires_grad_(True)
            inner.set_input_tensor(inp)
        out = model(tokens, pos, mask, labels=labels if last else None)
        loss = None
        if last:
            loss = out.float().mean()
            loss.backward()
        else:
            dist.send(out.detach().contiguous(), group=pp_group, group_dst=pp_rank + 1)
            grad = torch.empty_like(out)
            dist.recv(grad, group=pp_group, group_src=pp_rank + 1)
            out.backward(grad)
        if not first:
            dist.send(inp.grad.contiguous(), group=pp_group, group_dst=pp_rank - 1)
        _reduce_megatron_grads(model, inner, spec.tie_word_embeddings and pp > 1)
        opt.step()
        opt.zero_grad()
        return None if loss is None else loss.item()

    dp_rank = ps.get_data_parallel_rank(with_context_parallel=False)
    return LocalTrainer(bound, chunks, train_step, None, dp_rank)


def _reduce_megatron_grads(model: torch.nn.Module, inner: torch.nn.Module, tied_across_stages: bool) -> None:
    """What Megatron's DDP and ``finalize_model_grads`` do, plainly: average dense gradients over the
    data-parallel group and expert gradients over the expert-data-parallel group; sum the tied
    embedding's gradient over the first and last stage, which hold one copy each."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dense = ps.get_data_parallel_group(with_context_parallel=False)
    expert = ps.get_expert_data_parallel_group()
    for p in model.parameters():
        if p.grad is None:
            continue
        group = dense if getattr(p, "allreduce", True) else expert
        n = dist.get_world_size(group)
        if n > 1:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(n)
    if tied_across_stages and ps.is_rank_in_embedding_group():
        w = inner.shared_embedding_or_output_weight()
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        dist.all_reduce(w.grad, group=ps.get_embedding_group())


__all__ = ["LocalTrainer", "build_trainer", "shard_fsdp", "apply_tp", "mcore_config", "megatron_model"]
