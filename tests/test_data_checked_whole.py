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


def test_a_file_that_is_not_utf8_is_refused_by_its_line_before_or_while_it_is_read(tmp_path):
    import pytest

    from overdrive.data import open_splits
    from overdrive.data.row_table import undecodable
    from overdrive.errors import UserError

    rows = b"".join(b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
                    for _ in range(3))
    latin = tmp_path / "chat.jsonl"
    latin.write_bytes(rows + rows.replace(b'"a"', b'"caf\xe9"', 1))  # line 4: Latin-1's e-acute
    with pytest.raises(UserError) as before:  # explain's and the pre-launch checks' read
        local_table(str(latin))
    assert before.value.problems[0].key == "data.source" and before.value.problems[0].where == f"{latin}:4"
    cfg = cfg_of(f"model.name_or_path={tmp_path}", "data.format=chat", f"data.source={latin}")
    with pytest.raises(UserError) as during:  # the stream training tokenizes
        list(open_splits(cfg).train.batches())
    assert during.value.problems[0].where == f"{latin}:4" and "iconv" in during.value.problems[0].fix
    assert undecodable(latin, "x", piece_bytes=7).where == "x:4"  # a character cut between two pieces
    latin.write_bytes(rows + "café\n".encode())
    assert undecodable(latin, "x", piece_bytes=len(rows) + 4) is None
    latin.write_bytes(b"")
    with pytest.raises(UserError, match="has no rows"):  # datasets' own error would name nothing
        open_splits(cfg)


def test_a_local_prompt_file_is_refused_once_by_its_row_checks_not_again_by_its_count(tmp_path):
    from overdrive.training.build.preconditions import data_problems
    from overdrive.training.build.user_inputs import check

    prompts = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "y"}, {"question": "b", "answer": "y"}])
    cfg = cfg_of(MODEL, "rl.method=grpo", "data.format=prompts", f"data.source={prompts}",
                 "rl.reward_funcs=[{function: exact_match}]")
    errors, _ = check(cfg, lambda key: "", [tmp_path])
    assert [(p.key, p.where) for p in errors] == [("data.prompt_column", f"{prompts}:2")]
    assert data_problems(cfg) == []  # train asks both: the row is said once


def test_image_parts_in_prompts_for_a_model_without_a_vision_tower_are_refused_by_their_rows(tmp_path):
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour"}]}]
    prompts = _jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "answer": "y"},
                                            {"prompt": turns, "images": ["a.png"], "answer": "y"}])
    items = ("rl.method=grpo", "data.format=prompts", f"data.source={prompts}", "rl.reward_funcs=[{function: exact_match}]")
    [problem] = prompt_problems(cfg_of(MODEL, "model.vision.enabled=false", *items), local_table(str(prompts)))
    assert problem.key == "data.prompt_column" and problem.where == f"{prompts}:2" and "vision" in problem.message
    assert prompt_problems(cfg_of(MODEL, *items), local_table(str(prompts))) == []  # a hub model not read here


def test_csv_cells_of_a_prompt_set_are_read_as_the_text_they_are(tmp_path):
    from overdrive.data import prompts

    table = tmp_path / "p.csv"
    table.write_text("prompt,answer\nwhat is 3+4,007\n2024,1e3\n")  # pandas: 7, 2024 and 1000.0
    cfg = cfg_of("model.name_or_path=org/model", "rl.method=grpo", "data.format=prompts", f"data.source={table}",
                 "rl.reward_funcs=[{function: exact_match}]")
    assert prompts.read(cfg) == [{"prompt": "what is 3+4", "answer": "007"}, {"prompt": "2024", "answer": "1e3"}]
