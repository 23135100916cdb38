"""Strategy questions are answered by the strategy objects, one answer each, and code outside
strategies/ asks them instead of comparing names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import cfg_of

from overdrive.strategies import registry, shards_parameters

SRC = Path(__file__).resolve().parent.parent / "src" / "overdrive"


@pytest.mark.parametrize("items, whole", [
    ((), True), (("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2"), True),
    (("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3"), False),
    (("parallel.strategy=fsdp", "parallel.fsdp.reshard_after_forward=false"), False),
    (("parallel.strategy=fsdp",), False)])
def test_whether_a_rank_holds_the_whole_model_has_one_answer(items, whole):
    cfg = cfg_of(*items)
    assert registry.of(cfg).holds_whole_model(cfg) is whole
    assert shards_parameters(cfg) is not whole  # the older name asks the same method


def test_the_deepspeed_questions_are_the_strategys_own():
    fp16 = cfg_of("parallel.strategy=deepspeed", "precision.mixed_precision=fp16")
    assert registry.of(fp16).skips_overflowing_steps(fp16) and registry.of(fp16).deepspeed_config
    fixed = cfg_of("parallel.strategy=deepspeed", "precision.mixed_precision=fp16", "parallel.deepspeed.loss_scale=128")
    assert not registry.of(fixed).skips_overflowing_steps(fixed)
    ddp = cfg_of("precision.mixed_precision=fp16")
    assert not registry.of(ddp).skips_overflowing_steps(ddp) and not registry.of(ddp).deepspeed_config
    errors, _ = registry.of(fp16).setting_problems(
        fp16.model_copy(update={"parallel": fp16.parallel.model_copy(update={"deepspeed": fp16.parallel.deepspeed.model_copy(
            update={"offload_param": "cpu"})})}), lambda key: "here")
    assert [p.key for p in errors] == ["parallel.deepspeed.offload_param"] and errors[0].where == "here"


def test_no_code_outside_strategies_asks_which_strategy_it_is():
    asked = re.compile(r"registry\.of\([^)]*\)\s+is\b|parallel\.strategy\s*(==|!=|in)\s*[\(\[\{]?\s*[\"']")
    found = [f"{path.relative_to(SRC)}:{n}" for path in SRC.rglob("*.py") if "strategies" not in path.parts
             for n, line in enumerate(path.read_text().splitlines(), 1) if asked.search(line)]
    assert found == []
