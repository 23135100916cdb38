"""The user's own code and data fail clearly: reward functions imported, bound and tried before a
model loads and guarded while they run; every row of a prompt set and a KTO set checked; secrets
masked where a refusal echoes a value. Validation is called directly (no model, no training)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from overdrive.config.redact import redact_text
from overdrive.config.schema_rl import RewardFunc
from overdrive.errors import UserError
from overdrive.resolving import resolve
from overdrive.training.objectives import rewards
from overdrive.training.build import user_inputs
from overdrive.training.metrics import MetricsLog

RL = """\
model: {{name_or_path: base-model}}
data: {{source: {source}, format: prompts, max_length: 64}}
rl:
  method: grpo
  num_generations: 4
  reward_funcs: {rewards}
training: {{micro_batch_size: 4}}
launch: {{use_cpu: true}}
"""


def _write(tmp_path: Path, rows: list[dict], reward_funcs: str, module: str = "", name: str = "") -> Path:
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if module:
        (tmp_path / f"{name}.py").write_text(module)
    config = tmp_path / "rl.yaml"
    config.write_text(RL.format(source=tmp_path / "prompts.jsonl", rewards=reward_funcs))
    return config


def _problems(config: Path, *items: str) -> list:
    with pytest.raises(UserError) as error:
        resolve([config], cli=list(items), env={}, accelerate_default=False, checks=user_inputs.check)
    return error.value.problems


GOOD_ROWS = [{"prompt": "say yes", "answer": "yes"}, {"prompt": "say ok", "answer": "ok"}]


def test_a_reward_module_beside_the_config_is_imported_in_the_form_trl_users_write(tmp_path):
    name = "beside_config_rewards"
    config = _write(tmp_path, GOOD_ROWS, f'["{name}.correct"]', "def correct(prompts, completions, answer, "
                    "**kwargs):\n    return [float(c == a) for c, a in zip(completions, answer)]\n", name)
    resolved = resolve([config], env={}, accelerate_default=False, checks=user_inputs.check)
    assert resolved.config.rl.reward_funcs[0].function == f"{name}.correct"


def test_reward_functions_are_checked_before_the_model_loads_all_in_one_pass(tmp_path):
    name = "checked_rewards"
    module = ("def narrow(prompts, completions):\n    return [1.0] * len(completions)\n"
              "def crashes(prompts, completions, **kwargs):\n    return [int(c) for c in completions]\n"
              "def words(prompts, completions, **kwargs):\n    return ['good' for c in completions]\n")
    funcs = (f"[{name}.nowhere, {name}.narrow, {name}.crashes, {name}.words, not_a_module_here.reward, "
             "{function: regex, pattern: '.*yes.*'}]")
    problems = _problems(_write(tmp_path, GOOD_ROWS, funcs, module, name), "model.from_scratch=true")
    said = {p.key: p.message for p in problems}
    assert "has no attribute 'nowhere'" in said["rl.reward_funcs[0].function"]
    assert "completion_id" in said["rl.reward_funcs[1].function"] and "answer" in said["rl.reward_funcs[1].function"]
    assert "raised ValueError" in said["rl.reward_funcs[2].function"]
    assert "'good' (str)" in said["rl.reward_funcs[3].function"]
    assert "No module named 'not_a_module_here'" in said["rl.reward_funcs[4].function"]
    assert "rl.reward_funcs[5].function" not in said
    # GRPO from scratch names the key that says so, reported in the same pass
    assert "model.from_scratch" in said and "model.name_or_path" not in said


def test_a_reward_misbehaving_while_training_is_refused_naming_it_the_row_and_the_value():
    def reward(returns):
        return rewards.Reward("judge", 1.0, lambda prompts, completions, **kw: returns(completions))

    def refused(returns) -> str:
        with pytest.raises(UserError) as error:
            rewards.score([reward(returns)], ["p", "q"], ["a", "b"], [[1], [2]], {"answer": ["x", "y"]}, rows=[4, 9])
        problem = error.value.problems[0]
        return f"{problem.message} [{problem.where}]"

    assert "'judge' returned nan for completion 2" in refused(lambda c: [1.0, math.nan]) and "row 10" in \
        refused(lambda c: [1.0, math.nan])
    assert "returned inf" in refused(lambda c: [math.inf, 1.0])
    assert "returned 'fine' (str)" in refused(lambda c: ["fine", 1.0])
    assert "returned 1 rewards for 2 completions" in refused(lambda c: [1.0])
    assert "raised ZeroDivisionError" in refused(lambda c: [1 / 0])
    assert rewards.score([reward(lambda c: [None, 0.5])], ["p", "q"], ["a", "b"], [[1], [2]], {}, rows=[0, 1])[1] == [0.5]


def test_every_prompt_row_is_checked_with_its_file_and_line(tmp_path):
    rows = [{"prompt": "fine", "answer": "yes"}, {"prompt": "  ", "answer": "yes"}, {"question": "q", "answer": "a"},
            {"prompt": [{"role": "user", "content": ""}], "answer": "a"}, {"prompt": "x"}]
    config = _write(tmp_path, rows, "[{function: exact_match, column: answer}]")
    problems = _problems(config)
    source = tmp_path / "prompts.jsonl"

    def said(key: str, line: int, words: str) -> bool:
        return any(p.key == key and p.where == f"{source}:{line}" and words in p.message for p in problems)

    assert said("data.prompt_column", 2, "the prompt is empty")
    assert said("data.prompt_column", 3, "no 'prompt' column")
    assert said("data.prompt_column", 4, "a user turn is empty")
    assert said("data.prompt_column", 4, "mixes text prompts (row 1) and chat turns (row 4)")
    assert said("rl.reward_funcs[0].column", 5, "no 'answer' value")


def test_a_kto_set_of_one_label_is_refused_and_an_unbalanced_one_warned_with_its_counts(tmp_path):
    def kto(labels: list[bool]) -> Path:
        (tmp_path / "kto.jsonl").write_text("".join(json.dumps({"prompt": "p", "completion": "c", "label": label})
                                                    + "\n" for label in labels))
        return tmp_path / "kto.jsonl"

    items = ["model.name_or_path=base-model", "data.format=preference", "preference.method=kto", "launch.use_cpu=true"]
    with pytest.raises(UserError) as error:
        resolve([], cli=[*items, f"data.source={kto([True] * 6)}"], env={}, accelerate_default=False,
                checks=user_inputs.check)
    problem = next(p for p in error.value.problems if p.key == "data.label_column")
    assert "all 6 rows" in problem.message and "desirable" in problem.message
    resolved = resolve([], cli=[*items, f"data.source={kto([True] * 6 + [False] * 2)}"], env={},
                       accelerate_default=False, checks=user_inputs.check)
    warning = next(p for p in resolved.warnings if p.key == "preference.desirable_weight")
    assert "6 desirable and 2 undesirable" in warning.message and "0.333" in warning.fix


def test_a_text_value_yaml_read_as_a_boolean_and_a_bad_regex_say_how_to_write_them(tmp_path):
    config = _write(tmp_path, GOOD_ROWS, "[{function: regex, pattern: yes}]")
    assert "quote the value" in _problems(config)[0].message
    config = _write(tmp_path, GOOD_ROWS, "[{function: regex, pattern: '(['}]")
    assert "is not a regular expression" in _problems(config)[0].message


def test_secrets_typed_in_a_rewards_mapping_are_masked_where_a_refusal_echoes_them():
    for text in ("[cli rl.reward_funcs=[{function: x.y, judge_token: abc123}]]",
                 'rl.reward_funcs=[{function: x.y, name: "api_key=abc123"}]', "{api_key: abc123, weight: 2}"):
        assert "abc123" not in redact_text(text), text
    assert redact_text("hub_token: unknown key") == "hub_token: unknown key"  # a key and its problem, not a pair


def test_no_nan_is_written_as_a_number_into_metrics_jsonl(tmp_path):
    MetricsLog(tmp_path / "metrics.jsonl").write({"step": 1, "reward": math.nan, "loss": 0.5})

    def no_constants(name):
        raise ValueError(name)

    assert json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=no_constants)["reward"] is None


FLAKY = """\
calls = 0


def flaky(prompts, completions, **kwargs):
    # the trial call before training, then step 1: no reward applies (None); then a NaN
    global calls
    calls += 1
    return [None if calls <= 2 else float("nan")] * len(completions)
"""


@pytest.mark.slow
def test_a_grpo_run_whose_reward_turns_nan_stops_by_name_with_its_checkpoint_and_json_files_intact(tmp_path):
    from conftest import run_cli
    from hf_fixtures import make_tiny_llama

    make_tiny_llama(tmp_path / "base")
    config = _write(tmp_path, [{"prompt": [{"role": "user", "content": f"q {i}"}], "answer": "yes"} for i in range(8)],
                    '["flaky_reward.flaky"]', FLAKY, "flaky_reward")
    done = run_cli("train", str(config), f"model.name_or_path={tmp_path / 'base'}", "rl.max_completion_length=2",
                   "training.max_steps=3", "checkpoint.every_steps=1", "training.log_every_steps=1",
                   f"output_dir={tmp_path / 'out'}", f"data.cache_dir={tmp_path / 'cache'}", "logging.progress=false",
                   "precision.mixed_precision=no", cwd=tmp_path, timeout=600)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "'flaky' returned nan" in done.stderr and "row" in done.stderr
    assert any((tmp_path / "out" / "checkpoints").iterdir())  # step 1's checkpoint, kept

    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    samples = [json.loads(line, parse_constant=no_constants)
               for line in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert samples and all(sample["reward"] is None for sample in samples)
    for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=no_constants)


def test_user_code_that_exits_is_refused_by_its_key_at_import_in_a_call_and_while_training(tmp_path):
    from overdrive.training.generation import tools

    name = "exiting_rewards"
    config = _write(tmp_path, GOOD_ROWS, f'["{name}.correct"]', "import sys\nsys.exit(0)\n", name)
    said = {p.key: p.message for p in _problems(config)}
    assert said["rl.reward_funcs[0].function"] == f"'{name}' called sys.exit(0) while being imported"
    (tmp_path / "exiting_tools.py").write_text("import sys\nsys.exit(3)\n")
    with rewards.importable_from([tmp_path]), pytest.raises(UserError) as error:
        tools.build(["exiting_tools.add"])
    assert error.value.problems[0].key == "rl.tools[0]" and "called sys.exit(3) while being imported" in str(error.value)

    def exits(**kwargs):
        raise SystemExit(0)

    with pytest.raises(UserError) as error:  # while training: a refusal (exit 2), its checkpoint kept by the loop
        rewards.score([rewards.Reward("judge", 1.0, exits, "rl.reward_funcs[1].function")], ["p"], ["a"], [[1]], {})
    assert error.value.problems[0].key == "rl.reward_funcs[1].function"
    assert "'judge' called sys.exit(0) while being called" in error.value.problems[0].message
    tool = tools.Tool("add", exits, {}, "rl.tools[2]")
    with pytest.raises(UserError) as error:
        tools.call({"add": tool}, {"type": "function", "function": {"name": "add", "arguments": {}}}, 5.0)
    assert error.value.problems[0].key == "rl.tools[2]" and "called sys.exit(0)" in error.value.problems[0].message

    def interrupted(prompts, completions, **kwargs):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # a real Ctrl-C still stops the run as one
        rewards.score([rewards.Reward("judge", 1.0, interrupted)], ["p"], ["a"], [[1]], {})


def test_a_reward_is_refused_by_what_it_returned_unless_one_number_per_completion(tmp_path):
    import gc
    import warnings

    import numpy
    import torch

    def scored(returned) -> list:
        reward = rewards.Reward("judge", 1.0, lambda prompts, completions, **kw: returned)
        return rewards.score([reward], ["p", "q"], ["a", "b"], [[1], [2]], {})

    def refused(returned) -> str:
        with pytest.raises(UserError) as error:
            scored(returned)
        return error.value.problems[0].message + " | " + error.value.problems[0].fix

    for good in ([1.0, True], (1.0, 1), (v for v in [1.0, 1.0]), numpy.ones(2), torch.ones(2, dtype=torch.bfloat16)):
        assert scored(good) == [[1.0], [1.0]]
    for bad, words in (({0: 0.5, 1: 0.5}, "(dict)"), ({0.5, 1.0}, "(set)"), ("ab", "(str)"), (b"ab", "(bytes)"),
                       (None, "None (NoneType)"), (1.0, "1.0 (float)"), (numpy.ones((2, 1)), "2-D ndarray")):
        said = refused(bad)
        assert words in said and "return a list of floats, one per completion" in said, said
        assert "raised" not in said and "not iterable" not in said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        async def judged(prompts, completions, **kw):
            return [1.0] * len(completions)

        assert "async reward functions are not supported" in refused(judged(["p"], ["a"]))
        name = "async_rewards"
        config = _write(tmp_path, GOOD_ROWS, f'["{name}.judge"]', "async def judge(prompts, completions, **kw):\n"
                        "    return [1.0] * len(completions)\n", name)
        said = {p.key: p.message for p in _problems(config)}
        assert "async reward functions are not supported" in said["rl.reward_funcs[0].function"]
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_a_column_named_as_a_reward_argument_is_refused_by_the_data_not_the_reward(tmp_path):
    name = "collision_rewards"
    module = ("def good(prompts, completions, **kwargs):\n    return [1.0] * len(completions)\n"
              "def crashes(prompts, completions, **kwargs):\n    return [1 / len(c) for c in completions]\n"
              "def mapping(prompts, completions, **kwargs):\n    return {0: 1.0}\n")
    rows = [{**row, "completions": "x"} for row in GOOD_ROWS]
    problems = _problems(_write(tmp_path, rows, f'["{name}.good"]', module, name))
    assert [p.key for p in problems] == ["data.source"]
    assert "'completions'" in problems[0].message and "rename the column" in problems[0].fix
    with pytest.raises(UserError) as error:  # a hub data set's columns, met while training
        rewards.score(rewards.build([RewardFunc(function=f"{name}.good")]), ["p"], ["a"], [[1]], {"prompts": ["x"]})
    assert error.value.problems[0].key == "data.source" and "'prompts'" in error.value.problems[0].message
    # the empty completion's fix only for a reward that raised on it
    fixes = {p.key: p.fix for p in _problems(_write(tmp_path, GOOD_ROWS, f'["{name}.crashes", "{name}.mapping"]'))}
    assert "a completion may be empty" in fixes["rl.reward_funcs[0].function"]
    assert "a completion may be empty" not in fixes["rl.reward_funcs[1].function"]


def test_a_reward_name_shaped_like_a_secret_is_refused_by_its_key_and_not_echoed(tmp_path):
    token = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
    config = _write(tmp_path, GOOD_ROWS, f"[{{function: exact_match, column: answer, name: {token}}}]")
    problem = next(p for p in _problems(config) if p.key == "rl.reward_funcs[0].name")
    assert "looks like a secret" in problem.message and token not in problem.render()


def test_a_module_named_as_one_of_pythons_is_said_to_be_shadowed_not_missing(tmp_path):
    from overdrive.training.generation import tools

    (tmp_path / "json.py").write_text("def score(prompts, completions, **kwargs):\n    return [1.0] * len(completions)\n")
    with rewards.importable_from([tmp_path]), pytest.raises(UserError) as error:
        tools.build(["json:score"])  # the standard library's json, imported long before, answers the name
    [problem] = error.value.problems
    assert str(tmp_path / "json.py") in problem.message and "rename your module" in problem.fix
    with rewards.importable_from([tmp_path]), pytest.raises(UserError) as error:
        tools.build(["json_rewards:score"])  # no such file: the usual advice
    assert "beside the config file" in error.value.problems[0].fix


def test_two_rewards_of_one_name_are_refused_as_their_metrics_would_hide_one(tmp_path):
    from conftest import cfg_of
    from overdrive.training.objectives import reward_checks

    def keys(funcs: str) -> list[str]:
        cfg = cfg_of("model.name_or_path=org/model", "rl.method=grpo", "data.format=prompts",
                     f"rl.reward_funcs={funcs}")
        return [p.key for p in reward_checks.problems(cfg, None, lambda key: "")]

    assert keys("[{function: exact_match, name: a}, {function: length, name: a}]") == ["rl.reward_funcs[1].name"]
    assert keys("[{function: exact_match}, {function: exact_match, column: other}]") == ["rl.reward_funcs[1].name"]
    assert keys("[{function: exact_match}, {function: exact_match, name: other}]") == []


def test_a_reward_that_needs_a_column_the_data_lacks_says_to_add_the_column(tmp_path):
    # TRL's accuracy_reward reads `solution`: a library's function is not the user's to change
    module = "def accuracy(completions, solution, **kwargs):\n    return [1.0] * len(completions)\n"
    config = _write(tmp_path, GOOD_ROWS, '["lib_rewards.accuracy"]', module, "lib_rewards")
    [problem] = _problems(config)
    assert problem.key == "rl.reward_funcs[0].function" and "give the data a 'solution' column" in problem.fix
