"""Tool-calling GRPO (rl.tools): the tools checked by key, the chat template asked whether it can run
them, a scripted rollout that calls the calculator (its result a tool message, its tokens out of the
loss), a tool that raises or hangs answered to the policy, and a short real run (slow) whose
metrics count the calls."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tool_fixtures import make_tool_llama, warm, write_prompts, write_tools_module

from overdrive.errors import UserError
from overdrive.training.objectives import grpo, rewards
from overdrive.training.generation import grpo_rollout, tools

CALL = ("<tool_call> <function=calculator> <parameter=a> 3 </parameter> <parameter=b> 4 </parameter> </function> "
        "</tool_call> <eos>")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tools")
    make_tool_llama(root / "base")
    write_tools_module(root)
    write_prompts(root / "prompts.jsonl")
    return root


@pytest.fixture
def calc(work, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.syspath_prepend(str(work))
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    built = tools.build(["calc_tools:calculator", "calc_tools.broken", "calc_tools:slow"])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "add 3 4"}], tools=[t.schema for t in built],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    return tokenizer, built, list(prompt)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _scripted(tokenizer, *turns: str):
    """A policy that says `turns` in order, one per call, whatever it is shown."""
    said = iter(turns)
    seen = []

    def generate(inputs, room, turns):
        seen.append(inputs)
        return [_ids(tokenizer, next(said))[:room] for _ in inputs]

    return generate, seen


def test_a_tool_call_runs_the_tool_and_its_result_is_context_out_of_the_loss(calc):
    tokenizer, built, prompt = calc
    generate, seen = _scripted(tokenizer, "7 <eos>")
    out = grpo_rollout.run(generate, tokenizer, built, [prompt], [_ids(tokenizer, CALL)], 64, None, 5.0)
    turns = out.messages[0]
    assert turns[0]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"a": 3, "b": 4}}
    assert turns[1] == {"role": "tool", "name": "calculator", "content": "7"}
    assert turns[2]["content"] == "7" and len(turns) == 3
    assert (out.calls, out.failures, out.turns) == (1, 0, [2])
    ids, mask = out.completion_ids[0], out.tool_mask[0]
    # token by token: the policy's call, then the template's tool turn (masked), then the policy's answer
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m == 0]) == "<tool> 7 <eos> <assistant>"
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m == 1]) == CALL + " 7 <eos>"
    assert seen[0] == [prompt + ids[:len(ids) - 2]]  # the policy continued from exactly what the loss sees
    assert rewards.completion_text(turns) == "7"  # the built-in rewards read the policy's turns, not the tool's

    batch = grpo.completion_batch([prompt], [ids], torch.zeros(1), 0, torch.device("cpu"), tool_mask=[mask])
    trained = grpo.trained_mask(batch)[0].tolist()
    assert trained == mask and batch["labels"][0, len(prompt):].ne(-100).long().tolist() == mask
    recut = grpo.recut([batch], 1, 0)[0]
    assert recut["tool_mask"].tolist() == batch["tool_mask"].tolist()


def test_a_tool_that_raises_or_hangs_or_does_not_exist_answers_the_policy_with_its_error(calc):
    tokenizer, built, prompt = calc
    calls = {"broken": "<tool_call> <function=broken> <parameter=a> 3 </parameter> </function> </tool_call> <eos>",
             "missing": "<tool_call> <function=calculator> <parameter=a> 3 </parameter> </function> </tool_call> "
                        "<eos>"}
    generate, _ = _scripted(tokenizer, "1 <eos>", "2 <eos>")
    out = grpo_rollout.run(generate, tokenizer, built, [prompt] * 2, [_ids(tokenizer, c) for c in calls.values()],
                           64, None, 5.0)
    assert out.failures == 2 and out.calls == 2
    assert "the broken tool broke" in out.messages[0][1]["content"]
    assert "error" in out.messages[1][1]["content"] and "b" in out.messages[1][1]["content"]  # missing argument b
    by_name = {t.name: t for t in built}
    name, result, failed = tools.call(by_name, {"type": "function", "function": {"name": "slow", "arguments": {"a": 1}}},
                                      0.2)
    assert failed and "rl.tool_timeout_s" in result["error"]
    assert tools.call(by_name, {"function": {"name": "nope", "arguments": {}}}, 1.0)[2]


def test_the_rounds_of_tool_calls_stop_at_the_limit_and_at_the_completion_length(calc):
    tokenizer, built, prompt = calc
    first = [_ids(tokenizer, CALL)]
    generate, seen = _scripted(tokenizer, CALL, CALL, CALL)
    out = grpo_rollout.run(generate, tokenizer, built, [prompt], first, 200, 2, 5.0)
    assert out.calls == 2 and len(seen) == 2 and out.turns == [3]
    out = grpo_rollout.run(_scripted(tokenizer, CALL)[0], tokenizer, built, [prompt], first, 200, 0, 5.0)
    assert out.calls == 0 and out.completion_ids == first
    # the results would pass max_completion_length: dropped, the completion ends as it was (TRL's rule)
    out = grpo_rollout.run(_scripted(tokenizer)[0], tokenizer, built, [prompt], first, len(first[0]) + 2, None, 5.0)
    assert out.completion_ids == first and out.tool_mask == [[1] * len(first[0])] and len(out.messages[0]) == 1


def test_synced_ranks_take_as_many_turns_as_the_busiest_one(calc):
    """A sharded policy's ranks turn together: a rank whose completions are done keeps calling generate (a
    stand-in input, its draw dropped) while another rank is busy; its own rollout is what it is alone."""
    tokenizer, built, prompt = calc
    alone = grpo_rollout.run(_scripted(tokenizer, "7 <eos>")[0], tokenizer, built, [prompt], [_ids(tokenizer, CALL)],
                             64, None, 5.0)
    others_busy = iter([True, True, False])  # the other rank: three turns (the first one asked as this one)
    asked = []

    def synced(busy: bool) -> bool:
        asked.append(busy)
        return busy or next(others_busy)

    generate, seen = _scripted(tokenizer, "7 <eos>", "x", "y")
    out = grpo_rollout.run(generate, tokenizer, built, [prompt], [_ids(tokenizer, CALL)], 64, None, 5.0, synced=synced)
    assert asked == [True, False, False, False] and len(seen) == 3  # its own turn, then two stand-in turns
    assert seen[1] == seen[2] == [prompt]
    assert (out.completion_ids, out.tool_mask, out.messages, out.calls) == (alone.completion_ids, alone.tool_mask,
                                                                           alone.messages, alone.calls)
    # a call with no room left is still taken when synced (the other ranks' forwards need it), its draw cut
    generate, seen = _scripted(tokenizer, CALL)
    first = [_ids(tokenizer, CALL)]
    room = len(first[0]) + len(tools.suffix_ids(tokenizer, [{"role": "tool", "name": "calculator", "content": "7"}]))
    out = grpo_rollout.run(generate, tokenizer, built, [prompt], first, room, None, 5.0, synced=lambda busy: busy)
    assert len(seen) == 1 and out.turns == [1] and out.tool_mask[0].count(1) == len(first[0])


def test_tools_are_refused_by_key_when_they_cannot_be_imported_or_described(work, monkeypatch):
    monkeypatch.syspath_prepend(str(work))
    found = tools.problems(["calc_tools:calculator", "calc_tools:nothing", "no_such_module:f", "calc_tools:undocumented",
                            "plainname"])
    assert [p.key for p in found] == ["rl.tools[1]", "rl.tools[2]", "rl.tools[3]", "rl.tools[4]"]
    assert "schema" in found[2].message and found[2].fix
    # called, these would answer the policy with an unawaited coroutine or an instance: refused up front
    (work / "odd_tools.py").write_text('async def fetch(a: int) -> int:\n    """Fetches.\n\n    Args:\n        a: x\n    """\n'
                                       '    return a\n\n\nclass Counter:\n    """Counts."""\n')
    odd = tools.problems(["odd_tools:fetch", "odd_tools:Counter"])
    assert [p.key for p in odd] == ["rl.tools[0]", "rl.tools[1]"]
    assert "async" in odd[0].message and "a class" in odd[1].message


def test_a_chat_template_without_tool_support_or_a_parser_is_refused_by_rl_tools(work, calc):
    from hf_fixtures import make_tiny_llama
    from transformers import AutoTokenizer

    tokenizer = calc[0]
    assert tools.template_problems(tokenizer) == []
    plain = AutoTokenizer.from_pretrained(make_tiny_llama(work / "plain"))
    [problem] = tools.template_problems(plain)
    assert problem.key == "rl.tools" and "drops a tool call" in problem.message
    tokenizer.response_template = None
    [problem] = tools.template_problems(tokenizer)
    assert problem.key == "rl.tools" and "response_template" in problem.message


def _explain(work: Path, *extra: str) -> list[str]:
    """The keys `overdrive explain rl_tools.yaml ...` refuses, in process: the config's rules and the user's
    tools imported from beside the config file, as `explain` and `train` check them."""
    from overdrive.resolving.resolve import resolve
    from overdrive.training.build import user_inputs

    config = work / "rl_tools.yaml"
    config.write_text(RL_TOOLS)
    try:
        resolve([config], cli=[f"model.name_or_path={work / 'base'}", f"data.source={work / 'prompts.jsonl'}", *extra],
                env={}, accelerate_default=False, checks=user_inputs.check)
    except UserError as error:
        return [p.key for p in error.problems]
    return []


RL_TOOLS = """\
data: {format: prompts, max_length: 64}
rl:
  method: grpo
  num_generations: 4
  max_completion_length: 40
  reward_funcs: [{function: exact_match, column: answer}]
  tools: [calc_tools:calculator]
training: {micro_batch_size: 8, gradient_accumulation_steps: 1, log_every_steps: 1}
optim: {lr: 1.0e-3}
scheduler: {name: constant, warmup_steps: 0}
precision: {mixed_precision: "no"}
launch: {use_cpu: true}
logging: {trackers: [none], progress: false}
"""


def test_explain_finds_the_tools_beside_the_config_and_refuses_a_bad_one_by_key(work):
    assert _explain(work) == []
    assert _explain(work, "rl.tools=[calc_tools:undocumented]") == ["rl.tools[0]"]
    for layout in ("parallel.strategy=fsdp", "parallel.strategy=ddp"):  # a sharded policy's ranks turn together
        assert _explain(work, layout, "launch.num_processes=2", "training.micro_batch_size=4") == []
    assert _explain(work, "parallel.pp_size=2", "launch.num_processes=2", "training.micro_batch_size=4") == [
        "parallel.pp_size"]
    assert _explain(work, "peft.method=lora") == []


def test_the_loss_family_is_checked_by_key(work):
    assert _explain(work, "rl.loss_type=cispo") == ["rl.epsilon_high"]
    assert _explain(work, "rl.loss_type=cispo", "rl.epsilon_high=5.0") == []
    assert _explain(work, "rl.loss_type=gspo", "rl.importance_sampling_level=token") == ["rl.importance_sampling_level"]
    assert _explain(work, "rl.loss_type=sapo") == _explain(work, "rl.importance_sampling_level=sequence") == []


@pytest.mark.slow  # warms a tiny model, then trains it with tools
def test_a_short_tool_calling_run_calls_the_calculator_and_counts_its_calls(work):
    from checkpoint_probe import run

    warm(work / "base", steps=40)
    config = work / "rl_tools.yaml"
    config.write_text(RL_TOOLS)
    out = work / "run"
    done = run([sys.executable, "-m", "overdrive.cli", "train", str(config), f"model.name_or_path={work / 'base'}",
                f"data.source={work / 'prompts.jsonl'}", f"data.cache_dir={work / 'cache'}", f"output_dir={out}",
                "training.max_steps=3", "rl.loss_type=gspo"], cwd=work, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tools/call_frequency" in r]
    assert len(steps) == 3 and all(r["tools/call_frequency"] > 0.5 for r in steps), steps
    assert all(0.0 <= r["tools/failure_frequency"] <= 1.0 and r["tools/turns_mean"] > 1.0 for r in steps)
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert any(turn["role"] == "tool" for s in samples for turn in s["completion"])
    print("tool run:", [{k: r[k] for k in ("step", "reward", "tools/call_frequency", "tools/failure_frequency",
                                           "completions/mean_length", "timing/generation_s", "timing/tools_s")}
                        for r in steps])
