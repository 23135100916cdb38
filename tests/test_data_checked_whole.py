"""A local data file read whole before anything is written, as training reads it: a byte-order mark
is not a column, an empty prompt set is refused, and every row of a preference or KTO set is read by
the reader training uses (data/preference.PairReader), each problem with its file and line."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import cfg_of

from overdrive.data.preference import row_problems
from overdrive.data.prompt_checks import prompt_problems
from overdrive.data.row_table import local_table

MODEL = "model.name_or_path=some/model"


def _jsonl(path: Path, rows: list[dict], bom: bool = False) -> Path:
    path.write_text(("\ufeff" if bom else "") + "".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    table = local_table(str(_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}], bom=True)))
    assert [row["prompt"] for row in table.rows] == ["a", "b"]
    csv = tmp_path / "p.csv"
    csv.write_text("\ufeffprompt,answer\nwhat,yes\n", encoding="utf-8")
    assert local_table(str(csv)).columns == ["prompt", "answer"]


def test_an_empty_prompt_set_is_refused_by_its_source(tmp_path):
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("")
    cfg = cfg_of(MODEL, "rl.method=grpo", "data.format=prompts", f"data.source={empty}",
                 "rl.reward_funcs=[{function: exact_match, column: answer}]")
    [problem] = prompt_problems(cfg, local_table(str(empty)))
    assert problem.key == "data.source" and "no rows" in problem.message


def _kto(tmp_path: Path, rows: list[dict]):
    path = _jsonl(tmp_path / "kto.jsonl", rows)
    cfg = cfg_of(MODEL, "preference.method=kto", "data.format=preference", f"data.source={path}")
    table = local_table(str(path))
    return row_problems(cfg, table.columns, table.rows, table.place)


def test_every_kto_row_is_read_with_empty_text_refused_by_its_column_and_line(tmp_path):
    good = [{"prompt": f"q{i}", "completion": f"a{i}", "label": i % 2 == 0} for i in range(4)]
    assert _kto(tmp_path, good) == []
    found = _kto(tmp_path, good + [{"prompt": " ", "completion": "x", "label": True},
                                   {"prompt": "q", "completion": [{"role": "assistant", "content": ""}], "label": 0}])
    assert [(p.key, p.where.rsplit(":", 1)[-1]) for p in found] == [("data.prompt_column", "5"),
                                                                    ("data.completion_column", "6")]
    assert "row 5" in found[0].message and "empty prompt" in found[0].message


def test_every_preference_pair_is_read_before_training(tmp_path):
    rows = [{"prompt": "q", "chosen": "yes", "rejected": "no"}] * 3 + [{"prompt": "q", "chosen": "yes", "rejected": ""}]
    path = _jsonl(tmp_path / "pairs.jsonl", rows)
    cfg = cfg_of(MODEL, "preference.method=dpo", "data.format=preference", f"data.source={path}")
    table = local_table(str(path))
    [problem] = row_problems(cfg, table.columns, table.rows, table.place)
    assert problem.key == "data.rejected_column" and problem.where.endswith("pairs.jsonl:4")


def test_a_document_mask_on_rl_prompts_is_refused_by_its_key():
    """RL prompts are never packed: the mask would be accepted with no effect."""
    import pytest

    from overdrive.errors import UserError

    with pytest.raises(UserError) as error:
        cfg_of(MODEL, "rl.method=grpo", "data.format=prompts", "data.source=p.jsonl", "data.document_mask=true",
               "rl.reward_funcs=[{function: exact_match, column: answer}]")
    assert "data.document_mask" in [p.key for p in error.value.problems]
