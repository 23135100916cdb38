"""Preference rows in the layouts people have, recognised by their columns (or named by
`data.layout`) and renamable: TRL's standard, conversational and implicit-prompt pairs,
LLaMA-Factory's ShareGPT and Alpaca pairs, Axolotl's chat_template.default rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_fixtures import make_tiny_llama
from overdrive.data.opening import open_splits
from overdrive.errors import UserError
from overdrive.resolving import resolve

USER, ANSWER, OTHER = "a b c", "the answer is a", "the answer is yes"
TURNS = {"prompt": [{"role": "user", "content": USER}], "chosen": [{"role": "assistant", "content": ANSWER}],
         "rejected": [{"role": "assistant", "content": OTHER}]}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "base")


def first_pair(llama: Path, tmp_path: Path, row: dict, *items: str) -> dict:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    cfg = resolve((), cli=[f"model.name_or_path={llama}", f"data.source={path}", "data.format=preference",
                           "preference.method=dpo", "peft.method=lora", *items], env={}).config
    return next(open_splits(cfg).train.batches()).texts[0]


@pytest.mark.parametrize("row, items", [
    (TURNS, ()),  # TRL's conversational layout
    ({"chosen": TURNS["prompt"] + TURNS["chosen"], "rejected": TURNS["prompt"] + TURNS["rejected"]}, ()),  # implicit
    ({"conversations": [{"from": "human", "value": USER}], "chosen": {"from": "gpt", "value": ANSWER},
      "rejected": {"from": "gpt", "value": OTHER}}, ()),  # LLaMA-Factory's ShareGPT pairs
    ({"instruction": "a b", "input": "c", "chosen": ANSWER, "rejected": OTHER}, ()),  # its Alpaca pairs
    ({"conversation": TURNS["prompt"], "chosen": {"role": "assistant", "content": ANSWER},
      "rejected": {"role": "assistant", "content": OTHER}}, ("data.prompt_column=conversation",)),  # Axolotl's
    ({"question": USER, "better": ANSWER, "worse": OTHER},  # renamed columns, named layout
     ("data.layout=alpaca", "data.prompt_column=question", "data.chosen_column=better", "data.rejected_column=worse")),
    ({"dialog": [{"from": "human", "value": USER}], "chosen": [{"from": "gpt", "value": ANSWER}],
      "rejected": [{"from": "gpt", "value": OTHER}]}, ("data.layout=sharegpt", "data.messages_column=dialog")),
])
def test_each_layout_reads_as_trls_conversational_pair(llama, tmp_path, row, items):
    pair = first_pair(llama, tmp_path, row, *items)
    if "input" in row:  # the instruction and its input are one user turn, as LLaMA-Factory joins them
        assert pair["prompt"] == [{"role": "user", "content": "a b\nc"}]
    else:
        assert pair["prompt"] == TURNS["prompt"]
    assert (pair["chosen"], pair["rejected"]) == (TURNS["chosen"], TURNS["rejected"])


def test_standard_text_pairs_stay_text_and_a_system_column_opens_the_prompt(llama, tmp_path):
    assert first_pair(llama, tmp_path, {"prompt": USER, "chosen": ANSWER, "rejected": OTHER}) == \
        {"prompt": USER, "chosen": ANSWER, "rejected": OTHER}
    pair = first_pair(llama, tmp_path, {"conversations": [{"from": "human", "value": USER}], "system": "be brief",
                                        "chosen": {"from": "gpt", "value": ANSWER}, "rejected": {"from": "gpt", "value": OTHER}})
    assert pair["prompt"][0] == {"role": "system", "content": "be brief"}


def test_a_bad_sharegpt_answer_is_refused_by_key_and_line(llama, tmp_path):
    with pytest.raises(UserError) as error:
        first_pair(llama, tmp_path, {"conversations": [{"from": "human", "value": USER}], "chosen": 3, "rejected": OTHER})
    assert error.value.problems[0].key == "data.chosen_column" and "row 1" in error.value.render()
    with pytest.raises(UserError) as error:
        first_pair(llama, tmp_path, {"conversations": [{"from": "alien", "value": USER}],
                                     "chosen": {"from": "gpt", "value": ANSWER}, "rejected": {"from": "gpt", "value": OTHER}})
    assert error.value.problems[0].key == "data.layout"
