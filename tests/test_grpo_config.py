"""RL's keys, refusals by key, the completion slots' layout and the built-in rewards (no training)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from overdrive.data.prompts import SlotLayout, Slots
from overdrive.errors import UserError
from overdrive.resolving import resolve
from overdrive.training.objectives import rewards


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say {w}", "answer": w}) + "\n" for w in ("yes", "ok") * 8))
    return path


def _resolve(llama, source, *items):
    return resolve((), cli=[f"model.name_or_path={llama}", f"data.source={source}", "data.format=prompts",
                            "data.max_length=64", "rl.method=grpo", "rl.num_generations=4",
                            "rl.reward_funcs=[{function: exact_match, column: answer}]", "training.micro_batch_size=4",
                            *items], env={})


def _refused(llama, source, *items) -> list[str]:
    with pytest.raises(UserError) as error:
        _resolve(llama, source, *items)
    return [p.key for p in error.value.problems]


def test_a_grpo_config_resolves_with_trls_defaults_and_explains_its_keys(llama, prompts):
    resolved = _resolve(llama, prompts)
    rl = resolved.config.rl
    assert (rl.loss_type, rl.beta, rl.epsilon, rl.scale_rewards, rl.num_iterations) == ("dapo", 0.0, 0.2, "group", 1)
    assert rl.reward_funcs[0].function == "exact_match" and rl.reward_funcs[0].weight == 1.0
    assert resolved.origins["rl.method"].layer == "cli" and resolved.origins["rl.epsilon"].layer == "default"
    assert resolved.warnings == []
    # keys the prompt reader does not read: said, as they would seem to hold prompts out or bound them
    unread = _resolve(llama, prompts, "data.validation_fraction=0.2", "data.validation_split=test", "data.max_bytes=9")
    assert sorted(p.key for p in unread.warnings) == ["data.max_bytes", "data.validation_fraction",
                                                      "data.validation_split"]


def test_what_does_not_compose_with_grpo_is_refused_by_key(llama, prompts):
    assert "parallel.pp_size" in _refused(llama, prompts, "parallel.pp_size=2", "launch.num_processes=2")
    assert "parallel.tp_size" in _refused(llama, prompts, "parallel.tp_size=2", "launch.num_processes=2")
    assert "training.micro_batch_size" in _refused(llama, prompts, "training.micro_batch_size=3")
    assert "rl.beta" in _refused(llama, prompts, "rl.beta=0.04", "parallel.strategy=fsdp", "launch.num_processes=2")
    _resolve(llama, prompts, "rl.beta=0.04", "parallel.strategy=fsdp", "launch.num_processes=2", "peft.method=lora")
    assert "preference.method" in _refused(llama, prompts, "preference.method=dpo")
    assert "rl.reward_funcs" in _refused(llama, prompts, "rl.reward_funcs=[]")
    assert "data.format" in _refused(llama, prompts, "data.format=chat")
    assert "rl.loss_type" in " ".join(_refused(llama, prompts, "rl.loss_type=ppo"))
    with pytest.raises(UserError) as error:  # prompts without a method
        resolve((), cli=[f"model.name_or_path={llama}", f"data.source={prompts}", "data.format=prompts"], env={})
    assert error.value.problems[0].key == "rl.method"


@pytest.mark.parametrize("micro,accumulation,world", [(4, 2, 1), (8, 1, 1), (2, 2, 2), (4, 1, 2), (1, 4, 2)])
def test_each_ranks_step_holds_whole_groups_and_a_step_the_same_prompts_whatever_the_split(micro, accumulation, world):
    generations, prompts, steps = 4, 10, 6
    layout = SlotLayout(micro, accumulation, world, generations, 1, prompts, seed=3)
    slots = Slots(layout)
    per_step = micro * accumulation * world
    reference = Slots(SlotLayout(per_step, 1, 1, generations, 1, prompts, seed=3))
    for step in range(steps):
        by_rank = {}
        for batch in range(step * accumulation * world, (step + 1) * accumulation * world):
            rank = batch % world  # Accelerate's dealing of the loader's batches
            for index in range(batch * micro, (batch + 1) * micro):
                by_rank.setdefault(rank, []).append(slots[index])
        for rank, rows in by_rank.items():
            assert all(n == generations for n in Counter(r["group"] for r in rows).values()), (step, rank)
        got = sorted((r["slot"], r["group"], r["prompt_index"]) for rows in by_rank.values() for r in rows)
        expected = sorted((r["slot"], r["group"], r["prompt_index"])
                          for r in (reference[i] for i in range(step * per_step, (step + 1) * per_step)))
        assert got == expected
    seen = Counter(reference[i]["prompt_index"] for i in range(prompts * generations))
    assert set(seen.values()) == {generations} and len(seen) == prompts  # a pass visits every prompt once


def test_num_iterations_trains_k_steps_on_one_steps_groups():
    layout = SlotLayout(4, 1, 1, 4, 2, 10, seed=0)
    groups = [layout.group(layout.logical(i)) for i in range(16)]
    assert groups == [0] * 4 + [0] * 4 + [1] * 4 + [1] * 4


def test_built_in_rewards_and_an_imported_one():
    from overdrive.config.schema_rl import RewardFunc

    built = rewards.build([RewardFunc(function="exact_match"), RewardFunc(function="regex", pattern=r"<a>\w+</a>"),
                           RewardFunc(function="length", target_length=4, weight=0.5),
                           RewardFunc(function="json:dumps", name="imported")])
    assert [r.name for r in built] == ["exact_match", "regex", "length", "imported"]
    chat = [{"role": "assistant", "content": " <a>yes</a> "}]
    assert built[0].function(["p", "p"], ["yes ", chat], answer=["yes", "yes"]) == [1.0, 0.0]
    assert built[1].function(["p", "p"], ["<a>yes", chat]) == [0.0, 1.0]
    assert built[2].function(["p"], ["abcdef"]) == [-0.5]
    with pytest.raises(UserError) as error:
        rewards.build([RewardFunc(function="no_such_module:f")])
    assert error.value.problems[0].key == "rl.reward_funcs[0].function"
    with pytest.raises(UserError) as error:
        rewards.score([rewards.Reward("short", 1.0, lambda prompts, completions, **kw: [1.0, 2.0])], ["p"], ["c"],
                      [[1]], {})
    assert error.value.problems[0].key == "rl.reward_funcs" and "'short'" in error.value.render()


def test_plan_counts_the_generations_kv_cache_and_the_kl_reference(llama, prompts):
    from overdrive.memory.model_shape import run_estimate, run_shape

    # a rank's step (micro 4 x accumulation 2 completions) is generated at once
    cfg = _resolve(llama, prompts, "rl.max_completion_length=16", "training.gradient_accumulation_steps=2").config
    shape = run_shape(cfg)
    row = run_estimate(cfg, "cuda", shape).rows[0]
    kv = [t for t in row.terms if t[1].startswith("generation: KV cache")]
    head = shape.hidden // shape.heads
    assert kv == [("buffers_bytes", "generation: KV cache of a rank's step (640 tokens, rl.*)",
                   2 * shape.layers * shape.kv_heads * head * 8 * (64 + 16) * 4)]
    assert not [t for t in row.terms if t[1].startswith("reference model")]
    with_kl = run_estimate(_resolve(llama, prompts, "rl.beta=0.04").config, "cuda", shape).rows[0]
    assert ("params_bytes", "reference model: a frozen copy of the weights (rl.beta)", 4 * shape.params) in with_kl.terms


def test_prompts_render_as_text_or_turns_and_one_too_long_is_refused_by_key(llama, prompts, tmp_path):
    from transformers import AutoTokenizer

    from overdrive.data import prompts as prompts_mod

    tokenizer = AutoTokenizer.from_pretrained(llama)
    cfg = _resolve(llama, prompts).config
    text = prompts_mod.encode(cfg, prompts_mod.read(cfg), tokenizer)
    assert not text.conversational and len(text.rows) == 16 and text.rows[0]["answer"] == "yes"
    turns = tmp_path / "turns.jsonl"
    turns.write_text(json.dumps({"prompt": [{"role": "user", "content": "a b"}], "answer": "a"}) + "\n")
    cfg = _resolve(llama, turns).config
    chat = prompts_mod.encode(cfg, prompts_mod.read(cfg), tokenizer)
    assert chat.conversational and tokenizer.decode(chat.prompt_ids[0]).split() == ["<user>", "a", "b", "<eos>",
                                                                                     "<assistant>"]
    with pytest.raises(UserError) as error:  # 5 tokens over a bound of 4 (below the schema's floor: set directly)
        prompts_mod.encode(cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": 4})}),
                           prompts_mod.read(cfg), tokenizer)
    assert error.value.problems[0].key == "data.max_length" and "row 1" in error.value.render()


def test_trls_generation_backends_are_refused_by_key_where_they_do_not_run(llama, prompts):
    # vLLM: on a CPU (strategies/cpu.py), without the vllm package, and beside a tool rollout, each by key
    from overdrive.strategies import cpu
    from overdrive.training.generation import vllm_sampling

    refused = _refused(llama, prompts, "rl.use_vllm=true", "rl.vllm_mode=server", "rl.tools=[math:gcd]",
                       "launch.use_cpu=true")
    assert refused.count("rl.use_vllm") == 2 + (not vllm_sampling.installed())
    gpu = _resolve(llama, prompts).config.model_copy()
    gpu = gpu.model_copy(update={"rl": gpu.rl.model_copy(update={"use_vllm": True})})
    assert [p.key for p in cpu.problems(gpu, gpus=0)] == ["rl.use_vllm"] and cpu.problems(gpu, gpus=8) == []
    # continuous batching: a GPU path (measured about 1000x slower here), and one turn of an unsharded text policy
    assert "rl.use_transformers_continuous_batching" in _refused(
        llama, prompts, "rl.use_transformers_continuous_batching=true", "launch.use_cpu=true")
    assert _refused(llama, prompts, "rl.use_transformers_continuous_batching=true", "launch.use_cpu=true",
                    "rl.tools=[math:gcd]").count("rl.use_transformers_continuous_batching") == 2
