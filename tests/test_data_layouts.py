"""Chat data in the layouts people have: OpenAI messages, ShareGPT, Alpaca, recognised by their
columns; tool calls and a tools column handed to the chat template; each mixed source with its
own layout, columns and template; `plan` taking ShareGPT and Alpaca rows as chat data."""

from __future__ import annotations

import json

import pytest

from hf_fixtures import make_tiny_llama
from overdrive.resolving import resolve
from overdrive.data import layouts
from overdrive.errors import UserError

# Rows written from the layouts' documentation: ShareGPT as Axolotl's and LLaMA-Factory's data docs
# show it (`conversations` of {from, value}), Alpaca as Stanford Alpaca's and LLaMA-Factory's
# (instruction, input, output, optional system and history).
SHAREGPT = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "a b c"},
                              {"from": "gpt", "value": "the answer is yes"}]}
SHAREGPT_TOOLS = {"conversations": [{"from": "human", "value": "a b"},
                                    {"from": "function_call", "value": '{"name": "look", "arguments": {"q": "a"}}'},
                                    {"from": "observation", "value": "ok"}, {"from": "gpt", "value": "yes"}],
                  "tools": '[{"type": "function", "function": {"name": "look", "parameters": {}}}]'}
ALPACA = {"instruction": "a b", "input": "c d", "output": "the answer is yes", "system": "be brief",
          "history": [["e", "ok"]]}
TOOLS_TEMPLATE = ("{% if tools %}<system> {% for t in tools %}{{ t['function']['name'] }} {% endfor %}<eos> {% endif %}"
                  "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}"
                  "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %} {{ c['function']['name'] }}{% endfor %}"
                  "{% endif %} <eos> {% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}")


def data_of(**keys):
    return resolve([], cli=[f"data.{k}={v}" for k, v in keys.items()], env={}, accelerate_default=False).config.data


def test_each_layout_is_recognised_by_its_columns():
    d = data_of()
    assert layouts.recognise(["messages"], d) == ("messages", ("messages",))
    assert layouts.recognise(["prompt", "completion"], d) == ("prompt-completion", ("prompt", "completion"))
    assert layouts.recognise(["conversations", "tools"], d) == ("sharegpt", ("conversations",))
    assert layouts.recognise(["instruction", "input", "output", "history"], d) == \
        ("alpaca", ("instruction", "output", "input", "history"))
    with pytest.raises(UserError) as error:
        layouts.recognise(["text"], d)
    assert error.value.problems[0].key == "data.messages_column"
    with pytest.raises(UserError) as error:  # a named layout the data does not have
        layouts.recognise(["messages"], data_of(layout="alpaca"))
    assert error.value.problems[0].key == "data.layout"


def test_sharegpt_turns_become_roles_with_tool_calls():
    d = data_of()
    turns = layouts.turns_of("sharegpt", ("conversations",), SHAREGPT, 0, d)
    assert turns == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c"},
                     {"role": "assistant", "content": "the answer is yes"}]
    turns = layouts.turns_of("sharegpt", ("conversations",), SHAREGPT_TOOLS, 0, d)
    assert [t["role"] for t in turns] == ["user", "assistant", "tool", "assistant"]
    assert turns[1]["tool_calls"] == [{"type": "function", "function": {"name": "look", "arguments": {"q": "a"}}}]
    assert layouts.tools_of(SHAREGPT_TOOLS, 0, d)[0]["function"]["name"] == "look"
    with pytest.raises(UserError) as error:
        layouts.turns_of("sharegpt", ("conversations",), {"conversations": [{"from": "narrator", "value": "x"}]}, 3, d)
    assert error.value.problems[0].key == "data.layout" and "row 3" in error.value.problems[0].message


def test_alpaca_rows_join_instruction_and_input_after_system_and_history():
    d = data_of()
    columns = layouts.recognise(list(ALPACA), d)[1]
    turns = layouts.turns_of("alpaca", columns, ALPACA, 0, d)
    assert turns == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "e"},
                     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "a b\nc d"},
                     {"role": "assistant", "content": "the answer is yes"}]


def test_messages_keep_tool_calls_and_refuse_sharegpt_turns_by_key():
    d = data_of()
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    turns = layouts.turns_of("messages", ("messages",), {"messages": [{"role": "user", "content": "a"}, call,
                                                                      {"role": "tool", "content": "ok",
                                                                       "tool_call_id": "1"}]}, 0, d)
    assert turns[1]["tool_calls"] and turns[1]["content"] == "" and turns[2]["tool_call_id"] == "1"
    with pytest.raises(UserError) as error:
        layouts.turns_of("messages", ("messages",), {"messages": SHAREGPT["conversations"]}, 0, d)
    assert "data.layout=sharegpt" in error.value.problems[0].fix


def test_tools_reach_the_chat_template_and_the_answer_is_masked(tmp_path):
    from transformers import AutoTokenizer

    from overdrive.data.chat import ChatEncoder

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_llama(tmp_path / "m", chat_template=TOOLS_TEMPLATE))
    d = data_of()
    turns = layouts.turns_of("sharegpt", ("conversations",), SHAREGPT_TOOLS, 0, d)
    encoder = ChatEncoder(tokenizer, 64)
    with_tools = encoder.encode({"messages": turns, "tools": layouts.tools_of(SHAREGPT_TOOLS, 0, d)})
    without = encoder.encode(turns)
    assert len(with_tools[0]) > len(without[0])  # the tool's name rendered by the template
    assert sum(with_tools[1]) == sum(without[1]) > 0  # the same assistant tokens in the loss


@pytest.mark.parametrize("row", [SHAREGPT, ALPACA], ids=["sharegpt", "alpaca"])
def test_plan_takes_sharegpt_and_alpaca_rows_as_chat_data(tmp_path, capsys, row):
    from overdrive.cli import main

    model = make_tiny_llama(tmp_path / "m")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for _ in range(40)))
    argv = ["plan", f"model.name_or_path={model}", f"data.source={data}", "data.format=chat", "data.max_length=32",
            f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["data_tokens"] and plan["data_tokens"] > 40 * 8  # every row rendered into tokens


def test_each_source_sets_its_own_layout_columns_and_template(tmp_path):
    from transformers import AutoTokenizer

    from overdrive.data.chat import encoder_for, template_key
    from overdrive.data.mixing import source_configs

    (tmp_path / "a.jsonl").write_text(json.dumps({"dialog": SHAREGPT["conversations"]}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(ALPACA) + "\n")
    model = make_tiny_llama(tmp_path / "m")
    run = tmp_path / "run.yaml"
    run.write_text(f"""model: {{name_or_path: {model}}}
data:
  format: chat
  sources:
    - {{name: a, source: {tmp_path / 'a.jsonl'}, layout: sharegpt, messages_column: dialog}}
    - {{name: b, source: {tmp_path / 'b.jsonl'}, chat_template: "{{% for m in messages %}}{{{{ m['content'] }}}} {{% endfor %}}"}}
""")
    cfg = resolve([run], env={}, accelerate_default=False).config
    a, b = source_configs(cfg)
    assert a.cfg.data.layout == "sharegpt" and a.cfg.data.messages_column == "dialog"
    assert layouts.recognise(["dialog"], a.cfg.data) == ("sharegpt", ("dialog",))
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert template_key(a.cfg, tokenizer) != template_key(b.cfg, tokenizer)
    assert encoder_for(b.cfg, tokenizer).tokenizer.chat_template.startswith("{% for m in messages %}{{ m['content']")
    assert tokenizer.chat_template.startswith("{% for m in messages %}<")  # the shared one untouched
