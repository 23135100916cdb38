"""Prompts for online RL (`data.format: prompts`): rows of a prompt (text, or chat turns rendered
with the generation prompt) and any other columns, which the reward functions receive.

The loader hands out completion *slots*, not prompts: the global batch counts completions, and
every prompt fills `rl.num_generations` consecutive slots (a group). Slots are laid out so that
each rank's share of a step holds whole groups (its `micro x accumulation` slots, in a rank-major
order), whatever the split: then a group is generated, scored and normalised on one rank, and the
same global batch holds the same groups on 1 process or N. A step's prompts are a function of
the seed and the step alone, so a resumed run draws what the uninterrupted one would.

    slot (what the sampler yields, epoch after epoch) -> (step, rank, accumulation index, row)
      -> logical index L (step-major, then rank, then micro-batch) -> group q = L // num_generations
      -> prompt: a permutation of the prompts (seeded by training.seed and the pass over them)
With `rl.num_iterations` k, k consecutive steps share one step's groups (TRL's repeated sampler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from overdrive.config.schema import RunConfig
from overdrive.data.prompt_checks import prompt_problems
from overdrive.data.row_table import RowTable
from overdrive.errors import Problem, UserError


@dataclass
class PromptSet:
    rows: list[dict]  # every column of every row, as read
    prompts: list[Any]  # the prompt of each row: text, or a list of turns
    prompt_ids: list[list[int]]  # tokenized (turns: with the generation prompt)
    conversational: bool


def read(cfg: RunConfig) -> list[dict]:
    """The rows of `data.source` (split `data.split`), all of them: a prompt set is small."""
    from overdrive.data.sources import Rows, read_source

    corpus = read_source(cfg, cfg.data.split, "data.split")
    if not isinstance(corpus, Rows):
        raise UserError(Problem("data.format", f"prompts need rows; {cfg.data.source!r} is plain text",
                                fix="give a jsonl, json, csv or parquet file (or a data set) with a prompt column"))
    with corpus.reading():
        rows = [dict(row) for row in corpus.dataset]
    if not rows:
        raise UserError(Problem("data.source", f"{cfg.data.source!r} has no rows"))
    # Every row, as `explain` checks a local file's (a hub data set's rows are first seen here): before the model loads.
    problems = prompt_problems(cfg, RowTable(rows, str(cfg.data.source)))
    if problems:
        raise UserError(problems)
    return rows


def text_prompts_problem(key: str) -> Problem:
    return Problem(key, "the prompts are text, and tools and environments are offered through the chat template's "
                   "turns", fix=f"give the prompts as chat turns ([{{role: user, content: ...}}]), or remove {key}")


def encode(cfg: RunConfig, rows: list[dict], tokenizer, tools: Optional[list] = None, key: str = "rl.tools"
           ) -> PromptSet:
    """The prompts' token ids; `tools` (the JSON schemas of rl.tools and rl.environment's methods, refused by
    `key` for text prompts) rendered by the chat template as TRL renders them."""
    column = cfg.data.prompt_column
    prompts = [row[column] for row in rows]
    conversational = isinstance(prompts[0], list)
    if tools and not conversational:
        raise UserError(text_prompts_problem(key))
    if conversational and not getattr(tokenizer, "chat_template", None):
        raise UserError(Problem("tokenizer.chat_template", "the prompts are chat turns, and the tokenizer has no chat "
                                "template", fix="set tokenizer.chat_template, or give the prompts as text"))
    ids = []
    for prompt in prompts:
        if conversational:
            out = tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=True, add_generation_prompt=True,
                                                tools=tools or None)  # None, not []: Llama renders tool text for []
            ids.append(list(out["input_ids"]))
        else:
            ids.append(list(tokenizer(text=str(prompt))["input_ids"]))
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    if len(ids[longest]) > cfg.data.max_length:  # bounds the sequences: prompt + rl.max_completion_length
        over = sum(len(row) > cfg.data.max_length for row in ids)
        raise UserError(Problem("data.max_length", f"{over} prompt(s) are longer than data.max_length="
                                f"{cfg.data.max_length} tokens (the longest, row {longest + 1}, has "
                                f"{len(ids[longest])})", fix="raise data.max_length, or shorten those prompts"))
    return PromptSet(rows, prompts, ids, conversational)


def epoch_slots(num_prompts: int, num_generations: int, num_iterations: int) -> int:
    """The completion slots of one pass over the prompts: what an RL run's epoch counts (the global
    batch counts completions), each prompt's group trained on `num_iterations` times."""
    return num_prompts * num_generations * num_iterations


@dataclass(frozen=True)
class SlotLayout:
    """Where a slot of the sampler's order lands: see the module's docstring."""

    micro: int
    accumulation: int
    world: int
    num_generations: int
    num_iterations: int
    num_prompts: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.micro * self.accumulation * self.world

    def logical(self, index: int) -> int:
        # Accelerate deals the loader's micro-batches to the ranks in turn (BatchSamplerShard).
        batch, row = divmod(index, self.micro)
        rank_batch, rank = divmod(batch, self.world)
        step, within = divmod(rank_batch, self.accumulation)
        return step * self.global_batch + rank * self.accumulation * self.micro + within * self.micro + row

    def group(self, logical: int) -> int:
        step, offset = divmod(logical, self.global_batch)
        generated = step // self.num_iterations  # k steps train on one step's completions
        return (generated * self.global_batch + offset) // self.num_generations

    def prompt(self, group: int) -> int:
        sweep, position = divmod(group, self.num_prompts)
        order = torch.randperm(self.num_prompts, generator=torch.Generator().manual_seed(self.seed + sweep))
        return int(order[position])


class Slots(torch.utils.data.Dataset):
    """Slot index (any non-negative integer) -> (logical index, group, prompt row)."""

    def __init__(self, layout: SlotLayout):
        self.layout = layout
        self.ordered = True  # the order is the layout's: the loader must not shuffle it

    def __len__(self) -> int:
        return epoch_slots(self.layout.num_prompts, self.layout.num_generations, self.layout.num_iterations)

    def __getitem__(self, index: int) -> dict[str, int]:
        logical = self.layout.logical(index)
        group = self.layout.group(logical)
        return {"slot": logical, "group": group, "prompt_index": self.layout.prompt(group)}


class PassSampler(torch.utils.data.Sampler):
    """Slot numbers that keep counting across passes over the loader (epoch e starts at e x size)."""

    def __init__(self, size: int):
        self.size, self.epoch = size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(range(self.epoch * self.size, (self.epoch + 1) * self.size))

    def __len__(self) -> int:
        return self.size


def slot_problems(layout: SlotLayout) -> list[Problem]:
    """Fewer completions in a pass over the prompts than one global batch: no step could be made
    (`train` asks before launch, counting the prompts; the loader asks again)."""
    if len(Slots(layout)) >= layout.global_batch:
        return []
    return [Problem("training.micro_batch_size", f"{layout.num_prompts} prompts x {layout.num_generations} "
                    f"generations is fewer completions than one global batch ({layout.global_batch})",
                    fix="give more prompts, or lower training.micro_batch_size or the accumulation")]


def slot_layout(cfg: RunConfig, num_prompts: int) -> SlotLayout:
    """The slots of a run over `num_prompts` prompts, at the run's batch split."""
    import overdrive.config.batch as batch

    split = batch.split(cfg)
    return SlotLayout(split.micro, split.accumulation, split.data_parallel, cfg.rl.num_generations,
                      cfg.rl.num_iterations, num_prompts, cfg.training.seed)


def collate(rows: list[dict[str, int]]) -> dict[str, torch.Tensor]:
    return {key: torch.tensor([row[key] for row in rows], dtype=torch.long) for key in ("slot", "group", "prompt_index")}


def loader(layout: SlotLayout) -> torch.utils.data.DataLoader:
    """The slots in whole global batches, `micro` to a batch (Accelerate deals them to the ranks)."""
    dataset = Slots(layout)
    usable = (len(dataset) // layout.global_batch) * layout.global_batch
    if usable == 0:
        raise UserError(slot_problems(layout))
    return torch.utils.data.DataLoader(dataset, batch_size=layout.micro, sampler=PassSampler(usable), drop_last=True,
                                       collate_fn=collate)
