"""A refusal's `fix: set KEY=VALUE` can be followed: the config given that value (every alternative
the fix offers, one at a time) no longer has the problem, and the next refusal never asks to put
back what the fix changed. Over configs that break rules of every area (batch, layouts,
strategies, precision, adapters, objectives, kernels, run-level features), as `explain` meets them."""

from __future__ import annotations

import re

import pytest

from overdrive.errors import UserError
from overdrive.resolving import resolve

# Each a config that is refused; what the rule is about is in the name.
REFUSED = {
    "global batch does not divide": ["training.global_batch_size=999"],
    "async checkpoint under ddp": ["checkpoint.async=true"],
    "packing on json data": ["data.format=json", "data.packing=true"],
    "oom retry under fsdp": ["training.oom_retry=true", "parallel.strategy=fsdp", "launch.num_processes=2"],
    "loss spike under deepspeed": ["training.loss_spike.factor=3", "parallel.strategy=deepspeed"],
    "loss spike under fp16": ["training.loss_spike.factor=3", "precision.mixed_precision=fp16"],
    "document mask on chat": ["data.format=chat", "data.document_mask=true", "model.name_or_path=gpt2"],
    "document mask with context parallel": ["data.document_mask=true", "parallel.cp_size=2", "parallel.strategy=fsdp",
                                            "launch.num_processes=2"],
    "pipeline with zero": ["parallel.pp_size=2", "launch.num_processes=2", "parallel.strategy=deepspeed"],
    "offload param without zero3": ["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2",
                                    "parallel.deepspeed.offload_param=cpu"],
    "lora from scratch": ["peft.method=lora"],
    "fused kernel on grpo": ["rl.method=grpo", "data.format=prompts", "model.name_or_path=gpt2",
                             "training.loss_kernel=fused", "rl.reward_funcs=[{function: exact_match, column: answer}]"],
    "stages per rank of a single schedule": ["parallel.pp_size=2", "launch.num_processes=2",
                                             "parallel.pp_stages_per_rank=2"],
    "one stage per rank of an interleaved schedule": ["parallel.pp_size=2", "launch.num_processes=2",
                                                      "parallel.pp_schedule=interleaved_1f1b",
                                                      "parallel.pp_stages_per_rank=1"],
    "a v schedule with 3 stages per rank": ["parallel.pp_size=2", "launch.num_processes=2",
                                            "parallel.pp_schedule=zbv_zero_bubble", "parallel.pp_stages_per_rank=3"],
    "rl with a preference method": ["rl.method=grpo", "preference.method=dpo", "model.name_or_path=gpt2"],
    "distillation with a preference method": ["distill.teacher=gpt2", "preference.method=dpo",
                                              "model.name_or_path=gpt2"],
}

# A setting a fix names: `KEY=VALUE`, or `leave KEY empty` (the key's default: none).
SETTING = re.compile(r"(?<![\w.])([a-z_]+(?:\.[a-z_0-9]+)+)=([^\s,;()]+)")
EMPTY = re.compile(r"leave ([a-z_]+(?:\.[a-z_0-9]+)+) empty")


def alternatives(fix: str) -> list[list[str]]:
    """The alternatives a fix offers (`A, or B`; `A; or B`), each as the items that follow it: the
    settings one alternative names are applied together (`set a=x with b=y`)."""
    found = []
    for part in re.split(r";|,? or ", fix or ""):
        items = [f"{k}={v}" for k, v in SETTING.findall(part)] + [f"{k}=null" for k in EMPTY.findall(part)]
        if items:
            found.append(items)
    return found


def refusal(items: list[str]) -> list:
    try:
        resolve(cli=items, env={}, accelerate_default=False)
    except UserError as error:
        return list(error.problems)
    return []


@pytest.mark.parametrize("name", REFUSED)
def test_every_fix_that_names_settings_is_followed_without_a_contradiction(name):
    items = REFUSED[name]
    problems = refusal(items)
    assert problems, f"{name}: {items} is no longer refused"
    followed = 0
    for problem in problems:
        for alternative in alternatives(problem.fix):
            after = refusal([*items, *alternative])
            same = [p for p in after if (p.key, p.message) == (problem.key, problem.message)]
            assert not same, f"{name}: following `{' '.join(alternative)}` left {problem.key}: {problem.message}"
            # The next refusal never asks to put back what the fix set.
            given = dict(item.split("=", 1) for item in alternative)
            for later in after:
                for back in alternatives(later.fix):
                    for key, value in (item.split("=", 1) for item in back):
                        assert key not in given or given[key] == value, (
                            f"{name}: `{' '.join(alternative)}` is answered by `{key}={value}` ({later.key})")
            followed += 1
    assert followed, f"{name}: no fix names a setting: {[p.fix for p in problems]}"
