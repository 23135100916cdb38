"""GRPO in an environment (rl.environment, TRL's environment_factory): the factory probed and refused by
key, a scripted rollout acting on its own instance (the tool's result context, out of the loss; a raising
method answered), reset's text appended to the prompt, get_reward as one more reward, the group's random
stream seeded and the training one left as it was, and the layouts that do not compose refused by key."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from env_fixtures import make_lookup_llama, write_env_module, write_lookup_prompts

from overdrive.errors import UserError
from overdrive.training.generation import environments, grpo_rollout
from overdrive.training.objectives import grpo, rewards

CALL = ("<tool_call> <function=lookup> <parameter=key> {key} </parameter> </function> </tool_call> <eos>")
COLUMNS = ["prompt", "key", "answer"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("env")
    make_lookup_llama(root / "base")
    write_env_module(root)
    write_lookup_prompts(root / "prompts.jsonl")
    return root


@pytest.fixture
def lookup(work, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.syspath_prepend(str(work))
    return AutoTokenizer.from_pretrained(work / "base"), environments.build("lookup_env:LookupEnv", COLUMNS)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_factory_is_probed_as_trl_probes_it_and_refused_by_key(work, monkeypatch):
    monkeypatch.syspath_prepend(str(work))
    env = environments.build("lookup_env:LookupEnv", COLUMNS)
    assert (env.name, env.tool_names, env.has_reward) == ("LookupEnv", ["lookup"], True)
    assert env.schemas[0]["function"]["parameters"]["required"] == ["key"]
    said = {path: [(p.key, p.message) for p in environments.problems(path, COLUMNS)]
            for path in ("lookup_env:NoReset", "lookup_env:Undocumented", "lookup_env:RewardWithArgument",
                         "no_such_env:Env", "lookup_env:nothing", "lookup_env")}
    assert all(found and found[0][0] == "rl.environment" for found in said.values()), said
    assert "no reset" in said["lookup_env:NoReset"][0][1]
    assert "Undocumented.peek" in said["lookup_env:Undocumented"][0][1]
    assert "no arguments" in said["lookup_env:RewardWithArgument"][0][1]
    # reset(key=None, **row) takes any row; a reset of one named argument cannot take a row with others
    module = work / "strict_env.py"
    module.write_text("class Strict:\n    def reset(self, key):\n        return None\n")
    [problem] = environments.problems("strict_env:Strict", COLUMNS)
    assert "cannot take the data row's columns" in problem.message


def test_a_rollout_acts_on_its_own_instance_and_the_result_is_context_out_of_the_loss(lookup):
    tokenizer, env = lookup
    pool = environments.Pool(env)
    first, second = pool.take(2)
    assert pool.take(1) == [first] and first is env.probe  # made once, reused
    row = {"prompt": [{"role": "user", "content": "find k3"}], "key": "k3", "answer": "4"}
    assert environments.reset(first, row, "row 1") is None and environments.reset(second, row, "row 1") is None
    prompt = tokenizer.apply_chat_template(row["prompt"], tools=env.schemas, add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    said = iter(["4 <eos>", "5 <eos>"])
    out = grpo_rollout.run(lambda inputs, room, turns: [_ids(tokenizer, next(said)) for _ in inputs], tokenizer,
                           environments.tools_of(env.probe, env), [prompt] * 2,
                           [_ids(tokenizer, CALL.format(key="k3")), _ids(tokenizer, CALL.format(key="find"))], 64, None,
                           5.0, toolsets=[environments.tools_of(e, env) for e in (first, second)])
    assert first.looked_up == ["k3"] and second.looked_up == ["find"]  # each completion its own instance
    assert out.messages[0][1] == {"role": "tool", "name": "lookup", "content": "4"}
    assert "error" in out.messages[1][1]["content"] and "no key find" in out.messages[1][1]["content"]
    assert (out.calls, out.failures, out.turns) == (2, 1, [2, 2])
    ids, mask = out.completion_ids[0], out.tool_mask[0]
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m == 0]) == "<tool> 4 <eos> <assistant>"
    batch = grpo.completion_batch([prompt], [ids], torch.zeros(1), 0, torch.device("cpu"), tool_mask=[mask])
    assert grpo.trained_mask(batch)[0].tolist() == mask
    # get_reward is one more reward, read from each completion's instance; reward functions get them all
    reward = rewards.Reward(env.name, 1.0, environments.reward_function(env), environments.KEY)
    seen = []
    peek = rewards.Reward("peek", 1.0, lambda prompts, completions, environments, **c: seen.extend(environments) or
                          [0.0] * len(completions))
    table = rewards.score([reward, peek], [row["prompt"]] * 2, out.messages, out.completion_ids,
                          {"key": ["k3"] * 2, "environments": [first, second]}, [0, 0])
    assert [r[0] for r in table] == [1.0, 0.0] and seen == [first, second]


def test_reset_text_is_appended_to_the_prompt_and_a_failing_reset_stops_the_run_by_key_and_row(work, monkeypatch):
    monkeypatch.syspath_prepend(str(work))
    hinting = environments.build("lookup_env:Hinting", COLUMNS)
    row = {"prompt": [{"role": "user", "content": "find"}], "key": "k3"}
    observation = environments.reset(hinting.probe, row, "data.source row 4")
    assert environments.with_observation(row["prompt"], observation) == [{"role": "user", "content": "find k3"}]
    assert row["prompt"] == [{"role": "user", "content": "find"}]  # the row itself untouched
    failing = environments.build("lookup_env:FailingReset", COLUMNS)
    with pytest.raises(UserError) as raised:
        environments.reset(failing.probe, row, "data.source row 4")
    [problem] = raised.value.problems
    assert problem.key == "rl.environment" and problem.where == "data.source row 4" and "gone" in problem.message


def test_an_environment_draws_from_its_group_seed_and_leaves_the_training_stream_alone():
    random.seed(7)
    expected_next = random.Random(7).random()
    with environments.seeded(11):
        drawn = random.random()
    with environments.seeded(11):
        again = random.random()
    with environments.streams_kept():  # a rollout's tool calls: kept once, reseeded before each
        for seed in (5, 11):
            with environments.reseed(seed):
                last = random.random(), np.random.random()
    with environments.seeded(11):
        assert (random.random(), np.random.random()) == last
    assert drawn == again and random.random() == expected_next


RL_ENV = """\
data: {format: prompts, max_length: 64}
rl:
  method: grpo
  num_generations: 4
  max_completion_length: 40
  environment: lookup_env:LookupEnv
training: {micro_batch_size: 8, gradient_accumulation_steps: 1, log_every_steps: 1}
optim: {lr: 1.0e-3}
scheduler: {name: constant, warmup_steps: 0}
precision: {mixed_precision: "no"}
launch: {use_cpu: true}
logging: {trackers: [none], progress: false}
"""


def _explain(work: Path, *extra: str) -> list[str]:
    """The keys `overdrive explain rl_env.yaml ...` refuses (in process): the rules and the environment imported
    from beside the config file."""
    from overdrive.resolving.resolve import resolve
    from overdrive.training.build import user_inputs

    config = work / "rl_env.yaml"
    config.write_text(RL_ENV)
    try:
        resolve([config], cli=[f"model.name_or_path={work / 'base'}", f"data.source={work / 'prompts.jsonl'}", *extra],
                env={}, accelerate_default=False, checks=user_inputs.check)
    except UserError as error:
        return [p.key for p in error.problems]
    return []


def test_explain_checks_the_environment_and_refuses_what_does_not_compose_by_key(work):
    assert _explain(work) == []  # no reward_funcs: the environment's get_reward is the reward
    assert _explain(work, "rl.environment=lookup_env:no_reward") == ["rl.reward_funcs"]
    assert _explain(work, "rl.environment=lookup_env:NoReset") == ["rl.environment"]
    assert _explain(work, "parallel.strategy=fsdp", "launch.num_processes=2", "training.micro_batch_size=4") == []
    assert _explain(work, "parallel.strategy=ddp", "launch.num_processes=2", "training.micro_batch_size=4") == []
    assert "parallel.pp_size" in _explain(work, "parallel.pp_size=2", "launch.num_processes=2",
                                          "training.micro_batch_size=4")
    assert _explain(work, "rl.baseline=leave_one_out", "rl.multi_objective_aggregation=normalize_then_sum") == [
        "rl.baseline"]


def test_a_template_that_cannot_run_the_environments_methods_is_refused_by_rl_environment(work, monkeypatch):
    from transformers import AutoTokenizer

    from conftest import cfg_of
    from overdrive.training.build import grpo_parts

    monkeypatch.syspath_prepend(str(work))
    plain = AutoTokenizer.from_pretrained(work / "base")
    plain.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # drops the tool turns
    cfg = cfg_of(f"model.name_or_path={work / 'base'}", "rl.method=grpo", "data.format=prompts",
                 f"data.source={work / 'prompts.jsonl'}", "rl.environment=lookup_env:LookupEnv",
                 "rl.num_generations=2", "training.micro_batch_size=2")
    with pytest.raises(UserError) as error:  # the user set no rl.tools: the key they set is named
        grpo_parts.prepare(cfg, lambda *_: plain)
    assert [p.key for p in error.value.problems] == ["rl.environment"]
