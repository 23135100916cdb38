"""A model's answers to prompts, as text: the sample answers of a run (`eval.prompts`) and
`overdrive generate`. (An objective that samples while it trains, GRPO, draws batched token ids
from the training model itself, seeded per group: training/objectives/grpo.py and
training/generation/.)

Given a model (a Transformers model or a PeftModel), its tokenizer, the prompts and the sampling
settings, `answers` returns the text each prompt gets. A prompt is given as one user turn through
the tokenizer's chat template when it has one (the template the run trained with: a run's
tokenizer is saved with it), else as plain text. Temperature 0 is greedy decoding: the same
tokens as `model.generate(do_sample=False)`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (Transformers' generate arguments)."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy, the most likely token each step
    top_p: float = 1.0
    seed: Optional[int] = None  # sampling: the same seed, the same answers

    def generate_kwargs(self) -> dict[str, Any]:
        if self.temperature <= 0:
            # top_p/temperature unset too: a model's generation_config may carry its own, which
            # Transformers would warn are ignored under greedy decoding.
            return {"max_new_tokens": self.max_new_tokens, "do_sample": False, "temperature": None, "top_p": None,
                    "top_k": None}
        return {"max_new_tokens": self.max_new_tokens, "do_sample": True, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": None}


def prompt_text(tokenizer: Any, prompt: str) -> str:
    """The prompt as the model sees it: a user turn and the assistant's opening through the chat
    template, or the prompt itself when the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of `prompt_text`: a chat template writes its own special tokens, plain text gets
    the tokenizer's (a BOS where it adds one)."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    return tokenizer(prompt_text(tokenizer, prompt), add_special_tokens=not templated)["input_ids"]


def generated_ids(model: Any, tokenizer: Any, prompt: str, sampling: Sampling, streamer: Any = None) -> list[int]:
    """The new token ids `model` generates for `prompt` (the prompt's own left out)."""
    import torch

    ids = torch.tensor([prompt_ids(tokenizer, prompt)], device=_device(model))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=pad,
                                 streamer=streamer, **sampling.generate_kwargs())
    finally:
        model.train(was_training)
    return out[0, ids.shape[1]:].tolist()


def answer(model: Any, tokenizer: Any, prompt: str, sampling: Sampling, streamer: Any = None) -> str:
    """The text `model` answers `prompt` with; `streamer` (Transformers' TextStreamer) sees each
    token as it comes."""
    return tokenizer.decode(generated_ids(model, tokenizer, prompt, sampling, streamer), skip_special_tokens=True)


def answers(model: Any, tokenizer: Any, prompts: list[str], sampling: Sampling) -> list[str]:
    """Each prompt's answer, one prompt at a time (no padding: each answer is the one that prompt
    alone gets). With a seed, sampling restarts from it, so the answers repeat run to run."""
    import torch

    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    return [answer(model, tokenizer, prompt, sampling) for prompt in prompts]


@dataclass(frozen=True)
class PromptRow:
    """One prompt of `eval.prompts`: its text, the images it asks about (paths, read relative to the prompts
    file's directory, as a data file's rows read theirs; a vision-language model's), and where it was given."""

    text: str
    images: tuple[str, ...] = ()
    place: str = "eval.prompts"


def read_prompts(value: Union[str, list[str]]) -> list[str]:
    """`eval.prompts`: a list as it is, or a file: one prompt per line, or JSON lines with a
    `prompt` field (.jsonl). ValueError naming what is wrong."""
    return [row.text for row in read_prompt_rows(value)]


def read_prompt_rows(value: Union[str, list[str]]) -> list[PromptRow]:
    """`eval.prompts` as rows: a .jsonl row may carry `images`, a list of image paths. ValueError naming
    the file and line of what is wrong."""
    if not isinstance(value, str):
        return [PromptRow(text) for text in value]
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"{value}: no such file (a list of prompts, or a file of them, one a line)")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return [PromptRow(line) for line in lines]
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{number}: no `prompt` text field")
        images = row.get("images") or []
        if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
            raise ValueError(f"{path}:{number}: `images` is not a list of image paths")
        prompts.append(PromptRow(row["prompt"], tuple(str(path.parent / i) for i in images), f"{path}:{number}"))
    return prompts


def _device(model: Any) -> Any:
    return next(model.parameters()).device
