"""A lookup task whose answer needs the environment: "find k3" is answered by the value of key k3 in a
table the model never sees (LookupEnv.lookup reads it), in the word-level tool chat of tool_fixtures.

    write_env_module(dir)     lookup_env.py: LookupEnv (reset, lookup, get_reward: the right key looked up)
                              and broken variants for the refusals
    make_lookup_llama(dir)    the tiny Llama with the lookup words
    warm_lookup(dir, p_call)  plain next-token training on exchanges that call RowLookup's lookup() (values
                              drawn at random: the model learns to copy a result, not the table), then on
                              exchanges of which a fraction `p_call` call it and the rest answer a number
                              straight away: a policy that calls the tool sometimes, before any RL
    write_lookup_prompts      the prompts and their answers (the table's values)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tool_fixtures import make_tool_llama

KEYS = [f"k{i}" for i in range(10)]
TABLE = {key: str((7 * i + 3) % 10) for i, key in enumerate(KEYS)}
LOOKUP_WORDS = ["find", "lookup", "<function=lookup>", "<parameter=key>", *KEYS]

ENV_MODULE = f'''\
import random

TABLE = {TABLE!r}


class LookupEnv:
    """A table the policy reads through its lookup tool; the reward: the row's key was looked up."""

    def __init__(self):
        self.key, self.looked_up, self.noise = None, [], None

    def reset(self, key=None, **row):
        self.key, self.looked_up = key, []
        self.noise = random.random()  # drawn from the group's seeded stream
        return None

    def lookup(self, key: str) -> str:
        """Looks a key up in the table.

        Args:
            key: The key to look up.
        """
        self.looked_up.append(key)
        if key not in TABLE:
            raise KeyError(f"no key {{key}}")
        return TABLE[key]

    def get_reward(self) -> float:
        return float(self.key in self.looked_up)


class RowLookup:
    """The demo's: lookup() reads the key of the row the instance was reset with (its state, not an argument).
    No get_reward: the reward is the answer's (exact_match); a reward for calling alone is gamed."""

    def reset(self, key=None, **row):
        self.key = key
        return None

    def lookup(self) -> str:
        """Looks up the value of the key asked for.
        """
        return TABLE[self.key]


class Hinting(LookupEnv):
    def reset(self, key=None, **row):
        super().reset(key=key)
        return " " + key


class NoReset:
    def lookup(self, key: str) -> str:
        """Looks up.

        Args:
            key: The key.
        """
        return key


class Undocumented(LookupEnv):
    def peek(self, key):
        return key


class FailingReset(LookupEnv):
    def reset(self, **row):
        raise RuntimeError("the table is gone")


class RewardWithArgument(LookupEnv):
    def get_reward(self, completion):
        return 1.0


def no_reward():
    class Silent:
        def reset(self, **row):
            return None
    return Silent()
'''


def write_env_module(directory: Path, name: str = "lookup_env") -> Path:
    path = directory / f"{name}.py"
    path.write_text(ENV_MODULE)
    return path


def make_lookup_llama(directory: Path, seed: int = 0, hidden_size: int = 32) -> Path:
    return make_tool_llama(directory, seed=seed, hidden_size=hidden_size, words=LOOKUP_WORDS)


def write_lookup_prompts(path: Path, rows: int = 40, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            key = rng.choice(KEYS)
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"find {key}"}], "key": key,
                                "answer": TABLE[key]}) + "\n")
    return path


def _exchange(key: str, value: str, call: bool) -> list[dict]:
    ask = {"role": "user", "content": f"find {key}"}
    if not call:
        return [ask, {"role": "assistant", "content": value}]
    tool_call = {"type": "function", "function": {"name": "lookup", "arguments": {}}}
    return [ask, {"role": "assistant", "content": "", "tool_calls": [tool_call]},
            {"role": "tool", "name": "lookup", "content": value}, {"role": "assistant", "content": value}]


def warm_lookup(directory: Path, p_call: float, steps: int = 225, seed: int = 0) -> Path:
    """The model in `directory` trained on exchanges, a fraction `p_call` calling lookup, saved over itself."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import get_json_schema

    namespace: dict = {}
    exec(ENV_MODULE, namespace)
    schema = [get_json_schema(namespace["RowLookup"]().lookup)]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    rng = random.Random(seed)

    def exchanges(p: float) -> torch.Tensor:
        rows = [tokenizer.apply_chat_template(_exchange(rng.choice(KEYS), str(rng.randint(0, 9)), rng.random() < p),
                                              tools=schema, tokenize=True, return_dict=True)["input_ids"]
                for _ in range(400)]
        width = max(len(r) for r in rows)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows])

    # Two thirds of the steps on calls alone (copying the result is learnt), the rest at p_call (how often it calls)
    calling, mixed = exchanges(1.0), exchanges(p_call)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for step in range(steps):
        ids = calling if step < 2 * steps // 3 else mixed
        pick = torch.randint(0, len(ids), (32,), generator=generator)
        batch = ids[pick]
        loss = model(input_ids=batch, attention_mask=(batch != 0).long(), labels=batch.masked_fill(batch == 0, -100)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
    return directory
