"""Helpers shared by several test files, so that no test file imports another's.

(The end-to-end harness is :mod:`e2e`; transformers checkpoints are :mod:`hf_models`.)
"""

from __future__ import annotations

import json
import re
import socket
from collections import deque

import torch

from weightsync.spec.model import PRESET_DIR, ModelSpec, load_spec, spec_from_config

EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def run_rank_processes(script: str, job: dict, world: int, timeout: float) -> list[str]:
    """Run ``python script worker <job as JSON>`` as ranks 0..world-1 of one torch.distributed job
    (``env://`` on loopback, gloo) and return each rank's output, once every rank exited 0 and printed
    ``RANK r OK``; a rank not done within ``timeout`` seconds gets every rank killed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = dict(
        os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join(filter(None, [str(here.parent), str(here), os.environ.get("PYTHONPATH")])),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, script, "worker", json.dumps(job)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(world)
    ]
    outs = []
    try:
        for p in procs:
            try:
                outs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    if q.poll() is None:
                        q.kill()
                outs.append((p.communicate()[0] or "") + "\n[timed out]")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"RANK {r} OK" in out, f"rank {r} (rc={p.returncode}):\n{out[-8000:]}"
    return outs


# what the shared forkserver imports once for the test files that fork their processes from it
FORKSERVER_PRELOAD = ["torch", "weightsync.engines", "weightsync.transport.colocated", "weightsync.transport.p2p",
                      "weightsync.bench.baselines", "weightsync.meta.client", "weightsync.meta.server",
                      "test_colocated", "test_baselines", "test_p2p"]


def forkserver():
    """multiprocessing's forkserver context, its server started with FORKSERVER_PRELOAD imported.

    Python 3.11's forkserver drops the parent's sys.path (forkserver.main takes sys_path and never sets
    it), so a test module in the preload list failed to import there, silently, and every forked child
    imported it again (0.2 s of CPU each, most of a co-located case's cost): the server is started here
    with this directory on its PYTHONPATH. One server per process: the first caller's list wins, hence
    one list for every caller."""
    import multiprocessing as mp
    import os
    from multiprocessing import forkserver as server
    from pathlib import Path

    import torch

    ctx = mp.get_context("forkserver")
    # a test module's import asks torch.cuda.is_available() (a pytest.param's skipif), which on a CUDA build
    # initialises the driver and poisons every fork of the server ("Cannot re-initialize CUDA in forked
    # subprocess", seen on the GPU host): there the server imports the library only
    ctx.set_forkserver_preload([m for m in FORKSERVER_PRELOAD if torch.version.cuda is None or not m.startswith("test_")])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent), old]))
    try:
        server.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return ctx


def nixl_missing() -> str | None:
    """Why NIXL cannot be loaded here (the rdma extra is not installed), or None when it can."""
    from weightsync.errors import ConfigError
    from weightsync.transport.nixl_wire import load_nixl

    try:
        load_nixl()
    except ConfigError as e:
        return str(e)
    return None


def free_port() -> int:
    """A loopback port held for the rendezvous that will listen on it (see weightsync.transport.group.free_port)."""
    from weightsync.transport.group import free_port as held_port

    return held_port()


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN (the padding the plan never writes must keep its poison)."""
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def simulate(ops_per_rank: dict[int, list[tuple]], window: int) -> bool:
    """Strict in-order completion (NCCL-like): True iff every rank finishes all its operations.

    Each rank has at most ``window`` posted operations; only its oldest can complete, and only when
    the oldest of the peer's queue is the same transfer.
    """
    todo = {r: deque(ops) for r, ops in ops_per_rank.items()}
    posted = {r: deque() for r in ops_per_rank}
    progress = True
    while progress:
        progress = False
        for r in todo:
            while todo[r] and len(posted[r]) < window:
                posted[r].append(todo[r].popleft())
                progress = True
        for r in posted:
            if not posted[r]:
                continue
            op, peer = posted[r][0]
            if posted[peer] and posted[peer][0][0] == op:
                posted[r].popleft()
                posted[peer].popleft()
                progress = True
    return not any(todo.values()) and not any(posted.values())


def preset(name: str) -> dict:
    """A preset's config.json as a dict."""
    return json.loads((PRESET_DIR / f"{name}.json").read_text())


def hf_tensors(spec: ModelSpec, canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers-5 in-memory tensors from checkpoint tensors (experts stacked, gate rows first)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for t in spec.tensors:
        m = EXPERT.match(t.name)
        if m:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = canonical[t.name]
        else:
            out[t.name] = canonical[t.name]
    for prefix, by_e in experts.items():
        es = [by_e[e] for e in range(len(by_e))]
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]], 0) for x in es])
        out[prefix + ".down_proj"] = torch.stack([x["down_proj"] for x in es])
    return out


def build_model(cfg: dict):
    """A bf16 transformers model from a config dict (random init)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    rest = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = AutoConfig.for_model(cfg["model_type"], **rest)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def tiny(name: str, **overrides) -> ModelSpec:
    """A preset's spec with config keys changed."""
    cfg = dict(load_spec(name).config)
    cfg.update(overrides)
    return spec_from_config(cfg, name=f"{name}{overrides or ''}")


def megatron_model(name: str) -> ModelSpec:
    """A preset, or one of the megatron tests' variants of one (``llama10``, ``dsv3-noqlora``, ``dsv3-8``)."""
    if name == "llama10":
        return tiny("tiny-llama3", num_hidden_layers=10)
    if name == "dsv3-noqlora":
        return tiny("tiny-deepseek-v3", q_lora_rank=None)
    if name == "dsv3-8":
        return tiny("tiny-deepseek-v3", num_hidden_layers=8)
    return load_spec(name)


def record_local_job_tokens(monkeypatch) -> tuple[list, list]:
    """Record, for a :class:`weightsync.local.runner.LocalJob` run in this process, the token each MetaServer started
    here was given and the arguments every participant was started with: ``(tokens, [(participant, args)])``. A
    launcher must start the server with an admin token and hand participants their job's token only."""
    import weightsync.local.runner as runner
    import weightsync.meta.server as server

    tokens, handed = [], []

    class Recorded(server.MetaServer):
        def __init__(self, *args, **kwargs):
            tokens.append(kwargs.get("token"))
            super().__init__(*args, **kwargs)

    real = runner.start_participant

    def start(ctx, participant, target, args, q, log_path=None):
        handed.append((participant, args))
        return real(ctx, participant, target, args, q, log_path)

    monkeypatch.setattr(server, "MetaServer", Recorded)
    monkeypatch.setattr(runner, "start_participant", start)
    return tokens, handed


def assert_job_tokens_only(tokens: list, handed: list, jobs_of) -> None:
    """Every MetaServer started had an admin token; no participant was given one, and each was given a job token
    (:func:`weightsync.meta.auth.job_token`) of every job ``jobs_of(participant)`` names (of one of the servers, when
    a run started several)."""
    from weightsync.meta.auth import job_token

    assert tokens and all(tokens), f"a MetaServer ran without a token: {tokens}"
    assert handed
    for participant, args in handed:
        text = repr(args)
        assert not any(admin in text for admin in tokens), f"{participant} was handed an admin token"
        for job in jobs_of(participant):
            assert any(job_token(admin, job) in text for admin in tokens), f"{participant} lacks job {job}'s token"


def canonical_weights(case: dict, spec: ModelSpec, seed: int, cast: bool = False) -> dict[str, torch.Tensor]:
    """A step's canonical weights: ``random_canonical``, or (``case["fp32_data"]``) random fp32 values, most of which
    bf16 cannot hold -- cast to bf16 when ``cast``: the reference cast a bf16 receiver must hold, bit for bit."""
    from weightsync.testing import random_canonical

    if not case.get("fp32_data"):
        return random_canonical(spec, seed)
    g = torch.Generator().manual_seed(seed)
    out = {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}
    return {n: v.to(torch.bfloat16) for n, v in out.items()} if cast else out


def record_landings(set_attr=setattr, full_too: bool = False) -> list:
    """Each landing the full codec builds in this process from now on (``payload.codec.landing``; ``full_too``: also
    the name ``codec.full`` re-exports, which its ``land`` calls), as (how many of its pairs were casts, the landing).
    ``set_attr``: how to patch (``monkeypatch.setattr`` in a test; plain ``setattr`` in a worker process)."""
    from weightsync.codec import full
    from weightsync.payload import codec as base

    landed, real = [], base.landing

    def recording(pairs):
        got = real(pairs)
        landed.append((sum(d.dtype != s.dtype for d, s in pairs), got))
        return got

    set_attr(base, "landing", recording)
    if full_too:
        set_attr(full, "landing", recording)
    return landed


# -- LoRA adapters: landings planned into vLLM's slot layout, in process (tests/test_lora_layout.py, test_bind.py) --

LORA_MODEL = "tiny-qwen3-h64"
LORA_WRAPPERS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
LORA_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_spec(r: int = 8):
    """A rank-``r`` adapter (alpha 2r) on every decoder projection of the tiny LoRA preset."""
    from weightsync.lora.adapter import adapter_config, adapter_spec
    from weightsync.spec import load_spec

    return adapter_spec(load_spec(LORA_MODEL),
                        adapter_config({"r": r, "lora_alpha": 2 * r, "target_modules": LORA_PROJ}))


def lora_canonical(spec, seed: int) -> dict[str, torch.Tensor]:
    """Random canonical adapter tensors (fp32, never zeros by construction of randn)."""
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}


def lora_poisoned_slots(layout, tp: int) -> dict[int, dict[str, torch.Tensor]]:
    """Every slot buffer of every TP rank, random (the same on every call)."""
    from weightsync.layout.materialize import TORCH_DTYPES

    g = torch.Generator().manual_seed(77)
    return {rank: {n: torch.randn(shape, generator=g).to(TORCH_DTYPES[dtype])
                   for n, (shape, dtype) in sorted(layout.buffers(rank).items())} for rank in range(tp)}


def lora_plan_copies(planner, src_rank: int, tensors: dict[str, torch.Tensor]) -> list[tuple]:
    """Source rank ``src_rank``'s planned copies with their payloads (what it would send)."""
    from weightsync.layout.box import slices

    return [(c.dst_rank, c.dst_tensor, c.dst_box, c.canon_box, tensors[c.src_tensor][slices(c.src_box)].clone())
            for _, buckets in sorted(planner.send_plan(src_rank).items()) for b in buckets for c in b.copies]


def lora_land_copies(copies: list[tuple], buffers: dict[int, dict[str, torch.Tensor]]) -> None:
    """Each payload into its view of the slot, cast by the copy (as ``weightsync.lora.vllm.lora_land`` lands it)."""
    from weightsync.layout.box import box_shape, slices

    for dst, name, dst_box, canon_box, payload in copies:
        buffers[dst][name][slices(dst_box)].view(box_shape(canon_box)).copy_(payload)


def lora_unsharded_landing(spec, canonical, tp: int):
    """(slot layout of slot 1 of 3 at ``tp``, its poisoned buffers with ``canonical`` landed from one unsharded PEFT
    rank): the reference a sharded trainer's landing must equal."""
    from weightsync.lora.adapter import peft_names
    from weightsync.lora.layouts import PeftLayout, SlotConfig, VLLMSlotLayout
    from weightsync.plan.planner import Planner

    slot = VLLMSlotLayout(spec, SlotConfig(tp, 3, 16, "bfloat16", 1, LORA_WRAPPERS))
    names = peft_names(spec)
    want = lora_poisoned_slots(slot, tp)
    whole = {names[n]: t for n, t in canonical.items()}
    lora_land_copies(lora_plan_copies(Planner(PeftLayout(spec), slot), 0, whole), want)
    return slot, want


def lora_vocab(model) -> int:
    """The vocabulary size of a PEFT model's base."""
    return model.get_base_model().config.vocab_size


def lora_fsdp_shard(spec, canonical, dp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s FSDP2 shards of the canonical adapter (``torch.chunk`` on dim 0), under the live names."""
    from weightsync.lora.adapter import peft_names

    names = peft_names(spec)
    out = {}
    for n, t in canonical.items():
        chunks = torch.chunk(t, dp)
        out[names[n]] = chunks[rank].clone() if rank < len(chunks) else t[:0].clone()
    return out
