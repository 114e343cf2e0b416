"""A landed adapter version checked against vLLM's own load of the same adapter from PEFT's ``save_pretrained``.

What "exact" means for a LoRA sync (issue 37, item 3): the slot a version landed in holds, in every stacked buffer of
every LoRA wrapper on every worker, the same bits vLLM's own load of the adapter's PEFT directory puts in a slot, and
greedy decoding on it gives the same tokens. ``weightsync demo --lora``, ``weightsync bench --lora`` and
tests/test_lora_vllm.py all check it so, through these functions (needs ``vllm``).

    request = load_saved(llm, peft_model, directory, lora_id)       # save_pretrained + vLLM's add_lora
    check = against_saved(llm, slots, peft_model, version, directory, lora_id)
    check.ok                                                         # slots bit-exact and tokens equal
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Sequence

import torch

log = logging.getLogger("weightsync.lora")

#: greedy-decoding prompts (token ids) the checks run: fixed, so two adapters' outputs can be compared
PROMPTS: tuple[list[int], ...] = ([3, 17, 42, 99, 7, 128], [200, 5, 61, 11])
MAX_TOKENS = 8


def greedy(llm: Any, request: Any = None, prompts: Sequence[list[int]] = PROMPTS,
           max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Greedy tokens of an offline ``vllm.LLM`` per prompt, on the adapter ``request`` names (None: the base)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False, lora_request=request)
    return [list(o.outputs[0].token_ids) for o in outs]


def load_saved(llm: Any, model: Any, directory: str | os.PathLike, lora_id: int, name: str | None = None) -> Any:
    """The adapter of PEFT model ``model`` written by its own ``save_pretrained`` into ``directory`` and added to
    the engine through vLLM's own path (``add_lora`` of a ``LoRARequest`` naming the folder); the request. vLLM
    activates it into a slot at its first request."""
    from vllm.lora.request import LoRARequest

    from weightsync.errors import ConfigError

    path = str(directory)
    if lora_id in llm.llm_engine.list_loras():  # vLLM would serve what it holds, never reading the folder
        raise ConfigError(f"LoRA id {lora_id} is already registered on this engine: a saved adapter under it would "
                          f"never be read; take a free id (free_id)")
    model.save_pretrained(path)
    request = LoRARequest(name or f"saved-{lora_id}", lora_id, path)
    if not llm.llm_engine.add_lora(request):
        raise RuntimeError(f"vLLM did not add the LoRA adapter saved in {path}")
    return request


def free_id(llm: Any, below: int = 1 << 30) -> int:
    """The smallest LoRA int id the engine holds no adapter under (below weightsync's synced ids)."""
    held = set(llm.llm_engine.list_loras())
    got = next((i for i in range(1, below) if i not in held), None)
    if got is None:
        raise RuntimeError(f"every LoRA id below {below} is registered on this engine")
    return got


def slot_differences(mine: list[dict[str, torch.Tensor]], theirs: list[dict[str, torch.Tensor]]) -> list[str]:
    """What differs between two slots' contents (per worker, as ``VLLMLoRASlots.slot_tensors`` gives them): each
    buffer not bit-equal (``torch.equal``), named with its worker; a worker count or buffer set that differs, or an
    empty slot listing (a check that compares nothing) is a difference too. Empty: the same bits everywhere."""
    if len(mine) != len(theirs):
        return [f"{len(mine)} workers against {len(theirs)}"]
    out = []
    for rank, (a, b) in enumerate(zip(mine, theirs)):
        if not a or a.keys() != b.keys():
            out.append(f"worker {rank}: buffers {sorted(set(a) ^ set(b)) or 'none'} differ in presence")
            continue
        out.extend(f"worker {rank}: {n}" for n in a if not torch.equal(a[n], b[n]))
    return out


@dataclass(frozen=True)
class Check:
    """One landed version against vLLM's own load of the same adapter: which slot buffers differ (none: bit-exact)
    and both runs' greedy tokens."""

    differing: tuple[str, ...]
    tokens: list[list[int]]
    saved_tokens: list[list[int]]

    @property
    def slots_equal(self) -> bool:
        return not self.differing

    @property
    def tokens_equal(self) -> bool:
        return self.tokens == self.saved_tokens

    @property
    def ok(self) -> bool:
        return self.slots_equal and self.tokens_equal


def against_saved(llm: Any, slots: Any, model: Any, version: Any, directory: str | os.PathLike, lora_id: int,
                  prompts: Sequence[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS, keep: bool = False) -> Check:
    """Check landed ``version`` (an :class:`~weightsync.lora.vllm.AdapterVersion` of ``slots``) against PEFT model
    ``model``'s adapter as vLLM loads it from ``save_pretrained`` under ``lora_id``: every slot buffer of every
    worker bit-equal, greedy tokens equal. Afterwards the saved adapter is removed from the engine and its folder
    deleted (its slot free again), unless ``keep``."""
    tokens = greedy(llm, version.request(), prompts, max_tokens)
    request = None
    try:  # the folder goes whatever fails (save, add); the engine's adapter only if this call added it
        request = load_saved(llm, model, directory, lora_id)
        saved_tokens = greedy(llm, request, prompts, max_tokens)  # activates it into a slot
        differing = slot_differences(slots.slot_tensors(version.lora_int_id), slots.slot_tensors(lora_id))
    finally:
        if not keep:
            if request is not None:
                llm.llm_engine.remove_lora(lora_id)
            shutil.rmtree(directory, ignore_errors=True)
    if differing:
        log.warning("%s: %d slot buffers differ from vLLM's own load of the saved adapter: %s", version.lora_name,
                    len(differing), ", ".join(differing[:6]))
    return Check(tuple(differing), tokens, saved_tokens)


__all__ = ["Check", "MAX_TOKENS", "PROMPTS", "against_saved", "free_id", "greedy", "load_saved", "slot_differences"]
