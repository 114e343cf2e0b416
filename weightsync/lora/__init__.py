"""LoRA adapter-only sync: a PEFT trainer's adapter tensors into an inference engine's LoRA slots, in place.

- :mod:`weightsync.lora.adapter`: the adapter's canonical tensors (``lora_A`` / ``lora_B`` as PEFT saves them), a
  pure function of its PEFT config and the base model's spec; unsupported PEFT features and targets refused by name;
- :mod:`weightsync.lora.layouts`: where they live -- on a PEFT trainer (``peft``; under FSDP2 ``peft-fsdp``) and
  in one LoRA slot of vLLM's stacked buffers, TP-sharded as vLLM shards them (``vllm-lora``) -- as engine layouts
  the planner plans between;
- :mod:`weightsync.lora.peft`: a live PEFT model bound to its adapter, in one process or each rank's shards under
  FSDP2 (needs ``peft``: the ``lora`` extra);
- :mod:`weightsync.lora.vllm`: adapter versions landed into a running vLLM engine's free slots and published as
  ``LoRARequest``\\ s (needs ``vllm``);
- :mod:`weightsync.lora.verify`: a landed version checked against vLLM's own load of PEFT's ``save_pretrained``;
- :mod:`weightsync.lora.demo`: ``weightsync demo --lora RANK``.

docs/lora.md has vLLM's contract (file:line), what stands and what remains of issue 37. Nothing is imported here:
each submodule needs only what it names.
"""
