"""A tiny chat model that can call a tool: a word-level tokenizer whose chat template renders tools,
assistant tool calls and tool messages (Qwen 3.5's layout, in space-separated words), with a
`response_template` that reads a call back; a `calculator` tool module; and the toy task "add a b"
whose answer needs the tool's result. `warm` teaches a 2-layer Llama the exchange in a few seconds
of plain next-token training (the held-out bar's "a tiny chat model warmed on the task")."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Sequence

TOOL_TEMPLATE = (
    "{% if tools %}<system> tools: {% for t in tools %}{{ t.function.name }} {% endfor %}<eos> {% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<assistant> {{ m.content }} "
    "{% for c in m.tool_calls or [] %}<tool_call> <function={{ c.function.name }}> "
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}> {{ v }} </parameter> {% endfor %}"
    "</function> </tool_call> {% endfor %}<eos> "
    "{% elif m.role == 'tool' %}<tool> {{ m.content }} <eos> "
    "{% else %}<{{ m.role }}> {{ m.content }} <eos> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}")
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<assistant>",
    "fields": {
        "tool_calls": {
            "open_pattern": r"<tool_call>\s*<function=(?P<name>[^\s>]+)>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\s]+)>\s*(?P<value>.*?)\s*</parameter>",
                             "value_parser": {"name": "text"}},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<eos>\s*", "content": "text"},
    },
}
WORDS = ["<system>", "<user>", "<assistant>", "<tool>", "tools:", "add", "calculator", "broken", "error",
         "<tool_call>", "</tool_call>", "<function=calculator>", "<function=broken>", "</function>",
         "<parameter=a>", "<parameter=b>", "</parameter>", *[str(i) for i in range(20)]]
TOOLS_MODULE = '''\
def calculator(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def broken(a: int) -> int:
    """Always fails.

    Args:
        a: Anything.
    """
    raise RuntimeError("the broken tool broke")


def slow(a: int) -> int:
    """Answers after a long time.

    Args:
        a: Anything.
    """
    import time
    time.sleep(5)
    return a


def undocumented(a, b):
    return a + b
'''


def make_tool_llama(directory: Path, seed: int = 0, hidden_size: int = 32, words: Sequence[str] = ()) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate([*WORDS, *words])}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<eos>", bos_token="<eos>")
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         vocab_size=len(vocab), max_position_embeddings=128, pad_token_id=0,
                                         eos_token_id=2, bos_token_id=2, tie_word_embeddings=False))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_tools_module(directory: Path, name: str = "calc_tools") -> Path:
    path = directory / f"{name}.py"
    path.write_text(TOOLS_MODULE)
    return path


def sums(rows: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(rows)]


def write_prompts(path: Path, rows: int = 32, seed: int = 0) -> Path:
    with open(path, "w") as f:
        for a, b in sums(rows, seed):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"add {a} {b}"}], "answer": str(a + b)}) + "\n")
    return path


def conversation(a: int, b: int) -> list[dict]:
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"a": a, "b": b}}}
    return [{"role": "user", "content": f"add {a} {b}"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": str(a + b)},
            {"role": "assistant", "content": str(a + b)}]


def warm(directory: Path, steps: int = 150, seed: int = 0) -> Path:
    """The model in `directory` trained on whole tool exchanges ("add a b" -> a call -> its result -> the
    answer), saved over itself: a policy that calls the calculator, before any RL."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import get_json_schema

    namespace: dict = {}
    exec(TOOLS_MODULE, namespace)
    schema = [get_json_schema(namespace["calculator"])]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    rows = [tokenizer.apply_chat_template(conversation(a, b), tools=schema, tokenize=True, return_dict=True)["input_ids"]
            for a in range(10) for b in range(10)]
    ids = torch.tensor(rows)  # every exchange has the same length in words
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        batch = ids[torch.randint(0, len(ids), (32,), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
    return directory
