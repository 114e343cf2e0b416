"""LoRA adapter versions landed in place in a running vLLM engine's LoRA slots (offline ``vllm.LLM``).

    slots = VLLMLoRASlots(llm)                      # llm = LLM(..., enable_lora=True, worker_extension_cls=EXTENSION)
    v = slots.land(trainer.bound, "policy", step)   # trainer = PeftTrainEngine(peft_model)
    llm.generate(prompts, params, lora_request=v.request())
    slots.release(old)                               # the previous version served until now

    policy = SwitchWhenLanded(slots, "policy")      # or "switch when landed": new requests take the newest
    policy.land(trainer.bound, step)                # landed version; an older one is released once no request
    with policy.request() as request:               # taken from the policy runs on it
        llm.generate(prompts, params, lora_request=request)

What one :meth:`VLLMLoRASlots.land` does, each step a signed call into every worker (a *host call*:
:func:`weightsync.vllm.side.host_call`; the engine's loaded-form base tensors are never bound, the base never
moves):

1. **check** (control process, before any byte moves): the adapter against the engine -- LoRA enabled, same base
   model, rank within ``max_lora_rank``, a LoRA wrapper for every targeted module, not ``fully_sharded_loras``, a
   slot free of live versions -- each refused by name (:meth:`check`);
2. **reserve** (:func:`lora_reserve`): a placeholder adapter under a fresh int id, registered, activated into the
   first free slot and pinned there, as vLLM registers its own warm-up adapters
   (``LRUCacheWorkerLoRAManager.add_dummy_lora``: vllm/lora/worker_manager.py:176-187, a rank-1
   ``create_dummy_lora``), so vLLM's LRU never evicts it and a request naming the id never reads a file; every
   wrapper's slot is then reset to zero (``reset_lora``). Every worker must pick the same slot;
3. **land** (:func:`lora_land`): each worker checks its live stacked buffers against the slot layout
   (:class:`~weightsync.lora.layouts.VLLMSlotLayout`, every buffer's name, shape, dtype), plans its copies from the
   trainer's layout with the :class:`~weightsync.plan.planner.Planner` itself, proves the sender's per-pair plan
   hash, copies each payload into its view of the slot (cast to ``lora_dtype`` by the copy) and multiplies the
   landed ``lora_B`` regions by the adapter's scaling in ``lora_dtype`` -- vLLM's own load transform
   (``from_lora_tensors`` casts, ``optimize`` scales, ``set_lora`` slices per TP rank and pads to
   ``max_lora_rank``: docs/lora.md);
4. **publish**: the version is recorded and its ``LoRARequest`` (name ``<name>@<version>``, the int id, a path under
   ``/weightsync-lora/`` that does not exist) handed out; until then no request can name it, so a request runs on
   one whole version or another, never a mix. A failure in 2-3 releases the reserved slot on every worker and
   raises: the versions already published keep serving.

Shortcut (docs/lora.md, "What remains"): the bytes travel inside the signed call (each worker receives every
rank's planned payloads, in the source dtype as the full codec would put them on the wire), not through a
weightsync transport, and the trainer is this control process; no ``WeightWriter`` / ``WeightReader`` /
MetaServer step yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import shutil
import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from weightsync.errors import ConfigError, InstanceError
from weightsync.lora.adapter import AdapterSpec
from weightsync.lora.layouts import SLICES, PeftLayout, SlotConfig, VLLMSlotLayout
from weightsync.vllm.side import host_call

#: where the path of a synced version's ``LoRARequest`` points: nowhere (vLLM reads it only for an id it does not
#: hold, which then fails loudly: ``LoRAAdapterNotFoundError``, never a stale file)
PATH_ROOT = "/weightsync-lora"
#: the int ids of synced versions count from here (vLLM keeps int ids in int32 arrays; users' own adapters'
#: ids are usually small)
FIRST_ID = 1 << 30


# -- records ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotProbe:
    """One worker's LoRA state as it reports it (:func:`lora_probe`)."""

    rank: int
    tp: int
    enabled: bool
    max_loras: int = 0
    max_lora_rank: int = 0
    max_cpu_loras: int = 0
    lora_dtype: str = ""
    fully_sharded: bool = False
    #: the decoder-linear wrappers of layer 0 (``self_attn.qkv_proj`` ...), each with its slice count
    wrappers: tuple[tuple[str, int], ...] = ()
    #: every other LoRA wrapper (embeddings, lm_head): reset in a landed slot, never written
    others: tuple[str, ...] = ()
    #: per slot, the int id it holds (0: free)
    slots: tuple[int, ...] = ()
    pinned: tuple[int, ...] = ()
    #: wrappers whose per-layer set differs from layer 0's (refused: the slot layout assumes one set)
    uneven: tuple[str, ...] = ()


@dataclass(frozen=True)
class AdapterVersion:
    """A landed adapter version: what requests name to run on it."""

    name: str
    version: int
    lora_int_id: int
    slot: int
    digest: str  # the adapter spec's

    @property
    def lora_name(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def path(self) -> str:
        return f"{PATH_ROOT}/{self.name}/{self.version}"

    def request(self) -> Any:
        """vLLM's ``LoRARequest`` for this version."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.lora_name, self.lora_int_id, self.path)


@dataclass(frozen=True)
class Landed:
    """What one worker landed: its rank, the slot, the copies and bytes (in the source dtype) landed, how many
    ``lora_B`` regions were scaled."""

    rank: int
    slot: int
    copies: int
    nbytes: int
    scaled: int


# -- worker side (host calls: ``host`` is the vLLM worker) -----------------------------------------------


def _manager(host: Any) -> Any:
    runner = host.model_runner
    wm = getattr(runner, "lora_manager", None)
    if wm is None:
        raise ConfigError("vllm: this engine was started without LoRA (enable_lora=True)")
    return wm._adapter_manager


def _linear_wrappers(lm: Any) -> dict[str, Any]:
    """``model.layers.N.<block>.<wrapper>`` -> its LoRA layer, for the decoder-linear wrappers only."""
    out = {}
    for name, mod in lm.modules.items():
        head, _, tail = name.partition("model.layers.")
        if head == "" and tail and tail.split(".", 1)[-1] in SLICES:
            out[name] = mod
    return out


def live_buffers(lm: Any) -> dict[str, torch.Tensor]:
    """Every stacked LoRA buffer of the decoder-linear wrappers, under the slot layout's names."""
    out = {}
    for name, mod in _linear_wrappers(lm).items():
        for i, t in enumerate(mod.lora_a_stacked):
            out[f"{name}.lora_a_stacked.{i}"] = t
        for i, t in enumerate(mod.lora_b_stacked):
            out[f"{name}.lora_b_stacked.{i}"] = t
    return out


@host_call
def lora_probe(host: Any) -> SlotProbe:
    """This worker's LoRA state (a host call)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    if getattr(host.model_runner, "lora_manager", None) is None:
        return SlotProbe(rank, tp, False)
    lm = _manager(host)
    cfg = lm.lora_config
    linear = _linear_wrappers(lm)
    per_layer: dict[str, set[str]] = {}
    for name in linear:
        layer, wrapper = name.removeprefix("model.layers.").split(".", 1)
        per_layer.setdefault(layer, set()).add(wrapper)
    first = per_layer.get("0", set())
    uneven = sorted({w for ws in per_layer.values() for w in ws ^ first})
    wrappers = tuple((w, len(linear[f"model.layers.0.{w}"].lora_a_stacked)) for w in SLICES if w in first)
    dtype = next(iter(live_buffers(lm).values())).dtype if linear else cfg.lora_dtype
    return SlotProbe(rank, tp, True, max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
                     max_cpu_loras=cfg.max_cpu_loras or 0, lora_dtype=str(dtype).removeprefix("torch."),
                     fully_sharded=bool(cfg.fully_sharded_loras), wrappers=wrappers,
                     others=tuple(n for n in lm.modules if n not in linear),
                     slots=tuple(i or 0 for i in lm.lora_index_to_id),
                     pinned=tuple(sorted(lm._active_adapters.pinned_items)), uneven=tuple(uneven))


@host_call
def lora_reserve(host: Any, lora_id: int) -> int:
    """Register a placeholder adapter under ``lora_id``, activate it into the first free slot, pin it there and
    zero the slot in every LoRA wrapper; the slot's index (a host call)."""
    lm = _manager(host)
    if lora_id in lm.list_adapters():
        raise ConfigError(f"vllm: LoRA id {lora_id} is already registered on this engine")
    free = [i for i, held in enumerate(lm.lora_index_to_id) if held is None]
    pinned = lm._active_adapters.pinned_items
    if not free and all(held in pinned for held in lm.lora_index_to_id):
        raise ConfigError(f"vllm: every one of the {lm.lora_slots} LoRA slots holds a pinned adapter "
                          f"({list(lm.lora_index_to_id)}): release a version first")
    wm = host.model_runner.lora_manager
    placeholder = lm.create_dummy_lora(lora_id, 1, wm.embedding_modules)
    lm.add_adapter(placeholder)
    try:
        lm.activate_adapter(lora_id)  # LRU: the first free slot, or the least recently used unpinned one's
        lm.pin_adapter(lora_id)
        slot = lm.lora_index_to_id.index(lora_id)
        for mod in lm.modules.values():
            mod.reset_lora(slot)
    except BaseException:
        _drop(lm, lora_id)
        raise
    return slot


def _drop(lm: Any, lora_id: int) -> None:
    """Unpin, deactivate and forget ``lora_id``, zeroing its slot."""
    slot = lm.lora_index_to_id.index(lora_id) if lora_id in lm.lora_index_to_id else None
    for cache in (lm._active_adapters, lm._registered_adapters):
        cache.pinned_items.discard(lora_id)
    lm.remove_adapter(lora_id)
    if slot is not None:
        for mod in lm.modules.values():
            mod.reset_lora(slot)


@host_call
def lora_release(host: Any, lora_id: int) -> bool:
    """Forget a landed version (a host call): unpinned, deactivated, removed, its slot zeroed. False when this
    worker did not hold it."""
    lm = _manager(host)
    if lora_id not in lm.list_adapters():
        return False
    _drop(lm, lora_id)
    return True


#: a worker's opened trainer tensors, by the export's id (:func:`lora_land` with ``shared``): mapped once per process
_OPENED: dict[str, dict[str, torch.Tensor]] = {}


def _sources(shared: dict) -> dict[str, torch.Tensor]:
    """The trainer's adapter tensors this worker reads in place (:mod:`weightsync.transport.share`: shared memory on
    CPU, CUDA IPC on a GPU, mapped on this worker's device), opened once per export."""
    from weightsync.transport.share import import_tensors

    got = _OPENED.get(shared["id"])
    if got is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        got = _OPENED[shared["id"]] = import_tensors(shared["tensors"], cuda_device=device)
    return got


@host_call
def lora_land(host: Any, spec: AdapterSpec, config: SlotConfig, lora_id: int, adapter_name: str,
              hashes: dict, payloads: dict | None, shared: dict | None = None) -> Landed:
    """Land this worker's part of an adapter version in slot ``config.slot`` (a host call; module docstring,
    step 3). ``hashes``: the sender's plan hash per (src, instance, dst) pair; ``payloads``: per dst rank, the
    payload of each copy in the plan's bucket order -- or None with ``shared``: the trainer's tensors exported on
    this host (:meth:`VLLMLoRASlots.land`), which the worker reads in place, so no byte rides in the call."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from weightsync.layout.box import box_shape, slices
    from weightsync.layout.materialize import local_view
    from weightsync.plan.planner import Planner, pair_hash

    lm = _manager(host)
    rank = get_tensor_model_parallel_rank()
    if lm.lora_index_to_id[config.slot] != lora_id:
        raise ConfigError(f"vllm rank {rank}: slot {config.slot} holds LoRA id {lm.lora_index_to_id[config.slot]}, "
                          f"not the reserved {lora_id}")
    layout = VLLMSlotLayout(spec, config)
    live = live_buffers(lm)
    want = layout.buffers(rank)
    got = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in live.items()}
    if got != want:
        diff = [f"{n}: live {got.get(n)}, derived {want.get(n)}" for n in sorted(set(got) | set(want))
                if got.get(n) != want.get(n)]
        raise ConfigError(f"vllm rank {rank}: the LoRA buffers differ from {layout.describe()}: " + "; ".join(diff[:8]))
    plan = Planner(PeftLayout(spec, adapter_name), layout).recv_plan(0, rank)
    if shared is not None:  # the trainer's tensors in place, each copy's source box read as the plan says
        sources = _sources(shared)
        mine = [sources[c.src_tensor][slices(c.src_box)] for pair in sorted(plan) for b in plan[pair]
                for c in b.copies]
    else:
        mine = payloads.get(rank, [])
    n = nbytes = 0
    for pair in sorted(plan):
        if hashes.get(pair) != pair_hash(plan[pair]):
            raise ConfigError(f"vllm rank {rank}: the sender's plan for pair {pair} differs from this worker's "
                              f"(hash {hashes.get(pair)} != {pair_hash(plan[pair])})")
        for bucket in plan[pair]:
            for c in bucket.copies:
                if n >= len(mine):
                    raise ConfigError(f"vllm rank {rank}: {len(mine)} payloads for a plan of more copies")
                src = mine[n]
                if tuple(src.shape) != box_shape(c.canon_box):
                    raise ConfigError(f"vllm rank {rank}: payload {n} ({c.canonical}) has shape {list(src.shape)}, "
                                      f"the plan {list(box_shape(c.canon_box))}")
                live[c.dst_tensor][slices(c.dst_box)].view(box_shape(c.canon_box)).copy_(src)
                n += 1
                nbytes += src.numel() * src.element_size()
    if n != len(mine):
        raise ConfigError(f"vllm rank {rank}: {len(mine)} payloads for a plan of {n} copies")
    scaling = spec.config.scaling
    scaled = 0
    for p in layout.layout(rank).pieces():
        if p.canonical in layout.scaled:
            local_view(live[p.tensor], p).mul_(scaling)  # LoRALayerWeights.optimize: lora_b *= scaling, lora dtype
            scaled += 1
    return Landed(rank, config.slot, n, nbytes, scaled)


@host_call
def lora_slot(host: Any, lora_id: int) -> dict[str, torch.Tensor]:
    """A copy of what slot of ``lora_id`` holds in every LoRA wrapper's stacked buffers (a host call; for checks):
    ``<wrapper>.lora_a_stacked.<i>`` -> ``[max_lora_rank, in]`` ..., embeddings' and lm_head's too."""
    lm = _manager(host)
    slot = lm.lora_index_to_id.index(lora_id)
    out = {}
    for name, mod in lm.modules.items():
        for kind in ("a", "b"):
            for i, t in enumerate(getattr(mod, f"lora_{kind}_stacked", ())):
                if t.dim() >= 3 and t.shape[0] == lm.lora_slots:
                    out[f"{name}.lora_{kind}_stacked.{i}"] = t[slot].clone()
    return out


# -- the control process ---------------------------------------------------------------------------------


@dataclass
class _Channel:
    instance: str
    dir: str
    key: bytes
    seq: Any = field(default_factory=lambda: itertools.count(1))


class VLLMLoRASlots:
    """Adapter versions in the LoRA slots of one offline ``vllm.LLM`` started with ``enable_lora=True`` and
    weightsync's worker extension (module docstring). ``versions``: the live versions, oldest first."""

    def __init__(self, llm: Any, timeout_s: float = 300.0, first_id: int = FIRST_ID, share: bool = True):
        from weightsync.runtime import wire
        from weightsync.vllm.extension import EXTENSION

        if not hasattr(llm, "llm_engine"):
            raise ConfigError("VLLMLoRASlots takes an offline vllm.LLM (AsyncLLM: not yet)")
        vc = llm.llm_engine.vllm_config
        if vc.parallel_config.worker_extension_cls != EXTENSION:
            raise ConfigError(f"VLLMLoRASlots needs weightsync's worker extension: start the engine with "
                              f"worker_extension_cls={EXTENSION!r}")
        if vc.lora_config is None:
            raise ConfigError("vllm: this engine was started without LoRA: start it with enable_lora=True "
                              "(max_loras, max_lora_rank) to land adapters in it")
        self.llm, self.timeout_s, self.share = llm, timeout_s, share
        self.vllm_config = vc
        self._exports: dict[int, tuple[tuple[int, ...], dict]] = {}  # id(bound) -> (its tensors' addresses, export)
        directory, key = wire.new_key_dir(wire.VLLM_DIR_PREFIX)
        self._channel = _Channel(uuid.uuid4().hex, directory, key)
        self._ids = itertools.count(first_id)
        self.versions: list[AdapterVersion] = []
        try:
            self.probes: list[SlotProbe] = self.call(lora_probe)
        except BaseException:
            self.close()
            raise
        self.base_digest = self._base_digest()

    # -- calls --------------------------------------------------------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(host, *args)`` on every worker, signed (:mod:`weightsync.vllm.rpc`); each worker's result."""
        from weightsync.vllm.rpc import CallChannel, pack_call, result

        c = self._channel
        payload = pack_call(CallChannel(c.instance, c.dir, c.key), next(c.seq), fn, args)
        answers = self.llm.collective_rpc("weightsync_call", timeout=self.timeout_s, args=(payload,))
        return [result(a, rank, "vllm") for rank, a in enumerate(answers)]

    def close(self) -> None:
        from weightsync.transport.share import release

        for _, shared in self._exports.values():
            release(shared["tensors"])
        self._exports.clear()
        shutil.rmtree(self._channel.dir, ignore_errors=True)

    def _base_digest(self) -> str:
        from weightsync.spec.model import spec_from_config
        from weightsync.vllm.config import describe

        return spec_from_config(describe(self.vllm_config).model_config).digest

    # -- the protocol ---------------------------------------------------------------------------------------
    def slot_config(self, spec: AdapterSpec, slot: int = 0) -> SlotConfig:
        p = self.probes[0]
        return SlotConfig(p.tp, p.max_loras, p.max_lora_rank, p.lora_dtype, slot, tuple(w for w, _ in p.wrappers))

    def check(self, spec: AdapterSpec) -> None:
        """Refuse, by name and before any byte moves, an adapter this engine cannot take now (module docstring,
        step 1)."""
        p = self.probes[0]
        problems = []
        if any(dataclasses.replace(q, rank=p.rank) != p for q in self.probes):
            problems.append(f"the workers report different LoRA states: {self.probes}")
        if spec.base_digest != self.base_digest:
            problems.append(f"the adapter was made over {spec.base} (digest {spec.base_digest}), the engine serves "
                            f"another model (digest {self.base_digest})")
        if p.fully_sharded:
            problems.append("the engine shards LoRA fully (fully_sharded_loras=True): not supported yet")
        if p.uneven:
            problems.append(f"the engine wraps different modules in different layers: {list(p.uneven)}")
        if len(self.versions) >= p.max_loras:
            live = ", ".join(v.lora_name for v in self.versions)
            problems.append(f"{len(self.versions)} live versions ({live}) fill the engine's {p.max_loras} LoRA "
                            "slots (max_loras): release one first")
        if problems:
            raise ConfigError(f"adapter {spec.name} cannot land in this engine: " + "; ".join(problems))
        VLLMSlotLayout(spec, self.slot_config(spec))  # rank above max_lora_rank, a module with no LoRA wrapper

    def land(self, bound: Any, name: str, version: int) -> AdapterVersion:
        """Land the adapter tensors of ``bound`` (a :class:`~weightsync.bind.Bound` of a
        :class:`~weightsync.lora.layouts.PeftLayout`: :class:`weightsync.lora.peft.PeftTrainEngine`'s) as version
        ``version`` of adapter ``name`` in a free slot; the landed version, published (module docstring).

        With ``share`` (the default: the engine's workers run on this host, as an offline ``LLM``'s do) the workers
        read the trainer's tensors in place: they are exported once (:func:`weightsync.transport.share.export_tensors`:
        moved into shared memory in place on CPU, CUDA IPC handles on a GPU) and only their description travels in
        the call. Without it every copy's bytes ride inside the signed call."""
        from weightsync.layout.box import slices
        from weightsync.plan.planner import Planner, pair_hash

        spec: AdapterSpec = bound.engine.spec
        if any(v.name == name and v.version == version for v in self.versions):
            raise ConfigError(f"adapter {name} version {version} is already live")
        self.check(spec)
        lora_id = next(self._ids)
        try:
            slots = self.call(lora_reserve, lora_id)  # a worker that refused holds nothing; the others are released
            if len(set(slots)) != 1:
                raise InstanceError(f"vllm: the workers reserved different slots for {name}@{version}: {slots}")
            config = self.slot_config(spec, slots[0])
            planner = Planner(bound.engine, VLLMSlotLayout(spec, config))
            plans = sorted(planner.send_plan(0).items())
            hashes = {pair: pair_hash(buckets) for pair, buckets in plans}
            payloads, shared = None, self._shared(bound) if self.share else None
            if shared is None:
                with torch.no_grad():
                    payloads = {pair[2]: [bound.tensors[c.src_tensor][slices(c.src_box)].detach().clone()
                                          for b in buckets for c in b.copies] for pair, buckets in plans}
            self.call(lora_land, spec, config, lora_id, bound.engine.adapter_name, hashes, payloads, shared)
        except BaseException:
            with contextlib.suppress(Exception):
                self.call(lora_release, lora_id)
            raise
        v = AdapterVersion(name, version, lora_id, slots[0], spec.digest)
        self.versions.append(v)
        return v

    def _shared(self, bound: Any) -> dict:
        """``bound``'s tensors exported for the workers to read in place (:meth:`land`): once, and again only where
        a tensor moved (an optimizer that replaced it; the export keeps the old memory alive until released)."""
        from weightsync.transport.share import addresses, export_tensors, release

        tensors = {n: bound.tensors[n].detach() for n in bound.tensors}
        got = self._exports.get(id(bound))
        if got is not None and got[0] == addresses(tensors):
            return got[1]
        if got is not None:
            release(got[1]["tensors"])
        shared = {"id": uuid.uuid4().hex, "tensors": export_tensors(tensors)}
        self._exports[id(bound)] = (addresses(tensors), shared)  # after export: a CPU storage moved into shm
        return shared

    def latest(self, name: str) -> AdapterVersion | None:
        return next((v for v in reversed(self.versions) if v.name == name), None)

    def release(self, v: AdapterVersion) -> None:
        """Forget a live version: its slot is free for the next. Requests must no longer name it."""
        if v not in self.versions:
            raise ConfigError(f"{v.lora_name} is not a live version of this engine")
        self.call(lora_release, v.lora_int_id)
        self.versions.remove(v)

    def slot_tensors(self, lora_int_id: int) -> list[dict[str, torch.Tensor]]:
        """Per worker, what the slot holding ``lora_int_id`` holds (any adapter: one vLLM loaded from disk too)."""
        return self.call(lora_slot, lora_int_id)


class SwitchWhenLanded:
    """The "switch when landed" policy for one adapter of a :class:`VLLMLoRASlots`: new requests take the newest
    landed version, requests already running keep the version they took, and an older version is released as soon
    as no request taken from here runs on it (its slot then free for the next landing).

        policy = SwitchWhenLanded(slots, "policy")
        policy.land(trainer.bound, step)             # a failed landing leaves ``current`` as it was
        request = policy.take()                      # a LoRARequest naming the newest landed version
        llm.llm_engine.add_request(rid, prompt, params, lora_request=request)
        ...                                          # once that request has finished:
        policy.done(request)
        with policy.request() as request:            # the same around one blocking call
            llm.generate(prompts, params, lora_request=request)

    Only the versions this policy landed (and the newest live one of ``name`` when it was made) are ever released
    by it. A version must not be released while a request names it: vLLM would look for its (nonexistent) path at
    the next step. Thread-safe."""

    def __init__(self, slots: VLLMLoRASlots, name: str):
        self.slots, self.name = slots, name
        self.current: AdapterVersion | None = slots.latest(name)
        self._mine: list[AdapterVersion] = [self.current] if self.current else []
        self._running: Counter[int] = Counter()  # lora_int_id -> requests taken and not done
        self._lock = threading.Lock()

    def land(self, bound: Any, version: int) -> AdapterVersion:
        """Land ``version`` (:meth:`VLLMLoRASlots.land`), make it the one new requests take, release the older
        versions no request runs on."""
        v = self.slots.land(bound, self.name, version)
        with self._lock:
            self._mine.append(v)
            self.current = v
            self._release_idle()
        return v

    def take(self) -> Any:
        """The ``LoRARequest`` of the newest landed version, counted as running until :meth:`done`."""
        with self._lock:
            if self.current is None:
                raise ConfigError(f"adapter {self.name} has no landed version yet")
            self._running[self.current.lora_int_id] += 1
            return self.current.request()

    def done(self, request: Any) -> None:
        """A request taken from :meth:`take` has finished (or was aborted): its version may go."""
        with self._lock:
            if self._running[request.lora_int_id] <= 0:
                raise ConfigError(f"{request.lora_name}: done more often than taken")
            self._running[request.lora_int_id] -= 1
            self._release_idle()

    @contextlib.contextmanager
    def request(self):
        """:meth:`take` for the body of a ``with``, :meth:`done` after it."""
        r = self.take()
        try:
            yield r
        finally:
            self.done(r)

    def running(self) -> dict[str, int]:
        """Per live version (``name@version``), the requests taken from here that have not finished."""
        with self._lock:
            return {v.lora_name: self._running[v.lora_int_id] for v in self._mine}

    def _release_idle(self) -> None:
        for v in [v for v in self._mine if v != self.current and self._running[v.lora_int_id] == 0]:
            if v in self.slots.versions:
                self.slots.release(v)
            self._mine.remove(v)
            del self._running[v.lora_int_id]


__all__ = ["AdapterVersion", "FIRST_ID", "Landed", "PATH_ROOT", "SlotProbe", "SwitchWhenLanded", "VLLMLoRASlots",
           "live_buffers", "lora_land", "lora_probe", "lora_release", "lora_reserve", "lora_slot"]
