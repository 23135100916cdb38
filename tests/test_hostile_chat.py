"""Chat material that would train wrongly, or fail inside a library, is refused by key before
anything trains: every row's roles and content types, the template's own errors reported as
the template's with the conversation, and a template under which no token is in the loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overdrive.resolving import resolve
from overdrive.errors import UserError

GOOD = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "yes"}]


def refusal(llama: Path, tmp_path: Path, rows: list, *items: str) -> UserError:
    from overdrive.data import prepare
    from overdrive.training.build.tokenizer import build_tokenizer

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": turns}) + "\n" for turns in rows))
    cfg = resolve([], cli=[f"model.name_or_path={llama}", f"data.source={path}", "data.format=chat",
                           f"data.cache_dir={tmp_path / 'cache'}", *items]).config
    with pytest.raises(UserError) as error:
        prepare(cfg, build_tokenizer)
    return error.value


def test_a_turn_of_an_unknown_role_or_with_mapping_content_is_refused_by_key(llama, tmp_path):
    error = refusal(llama, tmp_path, [GOOD, [{"role": "bot", "content": "hi"}, *GOOD]])
    assert [p.key for p in error.problems] == ["data.messages_column"] and "row 1" in error.render()
    assert "'bot'" in error.render()
    error = refusal(llama, tmp_path, [[GOOD[0], {"role": "assistant", "content": {"text": "yes"}}]])
    assert [p.key for p in error.problems] == ["data.messages_column"] and "dict" in error.render()


def test_a_template_file_that_is_missing_or_does_not_compile_is_refused_by_key(llama, tmp_path):
    error = refusal(llama, tmp_path, [GOOD], f"tokenizer.chat_template={tmp_path / 'missing.jinja'}")
    assert [p.key for p in error.problems] == ["tokenizer.chat_template"] and "no file" in error.render()
    error = refusal(llama, tmp_path, [GOOD], "tokenizer.chat_template={% for m in messages %}{{ m['content'] }")
    assert [p.key for p in error.problems] == ["tokenizer.chat_template"] and "compile" in error.render()


def test_a_template_that_raises_is_reported_as_the_templates_with_the_conversation(llama, tmp_path):
    raising = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}"
               "{% endif %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
               "{% if add_generation_prompt %}<assistant> {% endif %}")
    error = refusal(llama, tmp_path, [GOOD, [{"role": "system", "content": "a"}, *GOOD]],
                    f"tokenizer.chat_template={raising}")
    assert [p.key for p in error.problems] == ["tokenizer.chat_template"]
    assert "no system turns" in error.render() and "row 1" in error.render()


def test_a_template_that_never_renders_the_answer_leaves_no_token_in_the_loss_and_is_refused(llama, tmp_path):
    silent = ("{% for m in messages %}{% if m['role'] != 'assistant' %}<{{ m['role'] }}> {{ m['content'] }} <eos> "
              "{% endif %}{% endfor %}")
    error = refusal(llama, tmp_path, [GOOD, GOOD], f"tokenizer.chat_template={silent}")
    assert [p.key for p in error.problems] == ["tokenizer.chat_template"] and "in the loss" in error.render()
