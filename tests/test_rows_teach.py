"""Data checked for what it teaches before anything trains: preference pairs whose answers are
equal (dropped, counted and said; refused when every pair is), answers that are not the
assistant's, tool calls without a name or of the wrong shape, tool descriptions without a name,
a prompt column the rows lack: refused by the key of the column, with the row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_fixtures import make_tiny_llama
from overdrive.errors import UserError
from overdrive.resolving import resolve

USER = {"role": "user", "content": "a b"}
ANSWER = {"role": "assistant", "content": "yes"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "base")


def _prepare(llama: Path, tmp_path: Path, rows: list, *items: str, show: bool = False):
    from overdrive.data import prepare
    from overdrive.training.build.tokenizer import build_tokenizer

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = resolve([], cli=[f"model.name_or_path={llama}", f"data.source={path}", f"data.cache_dir={tmp_path / 'c'}",
                           "data.validation_fraction=0", *items], env={}, accelerate_default=False).config
    return prepare(cfg, build_tokenizer, show=show)


def refused(llama: Path, tmp_path: Path, rows: list, *items: str) -> UserError:
    with pytest.raises(UserError) as error:
        _prepare(llama, tmp_path, rows, *items)
    return error.value


PREFERENCE = ("data.format=preference", "preference.method=dpo", "peft.method=lora")


def pair(chosen: str, rejected: str) -> dict:
    return {"prompt": [USER], "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def test_pairs_whose_answers_are_equal_are_dropped_and_said_and_refused_when_all_are(llama, tmp_path, capsys):
    error = refused(llama, tmp_path, [pair("yes", "yes")] * 3, *PREFERENCE)
    assert [p.key for p in error.problems] == ["data.rejected_column"] and "row 0" in error.render()
    _prepare(llama, tmp_path, [pair("yes", "no"), pair("a", "a"), pair("b", "no")] * 2, *PREFERENCE,
             f"data.cache_dir={tmp_path / 'c2'}", show=True)
    said = capsys.readouterr()
    assert "2 dropped: chosen equals rejected" in said.out + said.err and "row 1 first" in said.out + said.err


def test_a_preference_answer_given_as_a_user_turn_is_refused_by_its_column(llama, tmp_path):
    row = {"prompt": [USER], "chosen": [USER], "rejected": [ANSWER]}
    error = refused(llama, tmp_path, [pair("yes", "no"), row], *PREFERENCE)
    assert [p.key for p in error.problems] == ["data.chosen_column"] and "row 1" in error.render()


def test_a_renamed_prompt_column_the_rows_lack_is_refused_by_key(llama, tmp_path):
    rows = [{"question": [USER], "chosen": [ANSWER], "rejected": [{"role": "assistant", "content": "no"}]}]
    error = refused(llama, tmp_path, rows, *PREFERENCE, "data.prompt_column=query")
    assert [p.key for p in error.problems] == ["data.prompt_column"] and "'query'" in error.render()
    assert "empty conversation" not in error.render()


def test_a_completion_given_as_user_turns_is_refused(llama, tmp_path):
    rows = [{"prompt": [USER, ANSWER, USER], "completion": [USER]}]
    error = refused(llama, tmp_path, rows, "data.format=chat")
    assert [p.key for p in error.problems] == ["data.completion_column"] and "row 0" in error.render()


@pytest.mark.parametrize("calls, said", [
    ('get_time()', "not a list"),
    ([{"type": "function", "function": {"arguments": {}}}], "without a function name"),
    ([{"type": "function", "function": {"name": "now", "arguments": "[1, 2"}}], "not JSON"),
])
def test_tool_calls_without_a_name_or_of_the_wrong_shape_are_refused(llama, tmp_path, calls, said):
    turns = [USER, {"role": "assistant", "content": "", "tool_calls": calls},
             {"role": "tool", "content": "12:00"}, ANSWER]
    error = refused(llama, tmp_path, [{"messages": [USER, ANSWER]}, {"messages": turns}], "data.format=chat")
    assert [p.key for p in error.problems] == ["data.messages_column"] and "row 1" in error.render()
    assert said in error.render()


def test_a_tool_description_without_a_name_is_refused_by_the_tools_column(llama, tmp_path):
    rows = [{"messages": [USER, ANSWER], "tools": [{"type": "function", "function": {"description": "x"}}]}]
    error = refused(llama, tmp_path, rows, "data.format=chat")
    assert [p.key for p in error.problems] == ["data.tools_column"] and "row 0" in error.render()


def test_a_sharegpt_function_call_without_a_name_is_refused(llama, tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "a"},
                               {"from": "function_call", "value": json.dumps({"arguments": {}})},
                               {"from": "observation", "value": "b"}, {"from": "gpt", "value": "yes"}]}]
    error = refused(llama, tmp_path, rows, "data.format=chat")
    assert [p.key for p in error.problems] == ["data.layout"] and "without a function name" in error.render()


def test_a_from_scratch_preference_run_is_refused_by_model_from_scratch(llama):
    with pytest.raises(UserError) as error:
        resolve([], cli=[f"model.name_or_path={llama}", "model.from_scratch=true", *PREFERENCE], env={},
                accelerate_default=False)
    assert "model.from_scratch" in [p.key for p in error.value.problems]
    assert "model.name_or_path" not in [p.key for p in error.value.problems]
