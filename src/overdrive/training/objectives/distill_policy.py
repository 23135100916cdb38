"""On-policy distillation (`distill.lmbda` > 0, TRL GKD's meaning): with probability lmbda a step's
micro-batches are replaced by the student's own samples, which the teacher then scores.

    on_policy(seed, step, lmbda)     whether step `step` is on-policy: a function of the run's seed and
                                     the step alone, so every rank agrees and a resumed run decides
                                     as the first did
    Sampler(...).batch(model, micro_batch, seeds)
                                     the micro-batch's prompts continued by the student: prompt
                                     tokens out of the loss, the sampled tokens in it

The prompt of a row: for chat data the tokens before the last assistant turn's loss tokens (the
turns before it and its header: what the assistant answered); for plain text, which has no turns,
the first half of the row's tokens. The student samples at distill.temperature with nothing cut
from the distribution (TRL's GKD: top_k 0, top_p 1), up to distill.max_new_tokens new tokens and
never past data.max_length, each sample cut after its end-of-sequence token (training/generation/sampling.py,
the generation phase GRPO uses). A micro-batch's rows are sampled in one call, each row drawing from its
own seed, the run's seed mixed with the step and the row's place in the step's global batch (row_numbers):
the same samples whatever the split over
processes and micro-batches, and after a resume. Under a sharded student (ZeRO-3, FSDP2 over several
processes) every rank takes every forward of the sampling (`synced`): each rank holds a shard of each
layer, and a rank whose sample ended keeps joining the others' forwards until all have ended.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import torch

from overdrive.training.step import step_loss
from overdrive.training.generation import sampling


def on_policy(seed: int, step: int, lmbda: float) -> bool:
    """TRL's coin (`random.random() <= lmbda`), drawn from (seed, step) instead of the process's stream."""
    if lmbda <= 0.0:
        return False
    return lmbda >= 1.0 or random.Random(sampling.mixed_seed(seed, step)).random() < lmbda


def sample_seed(seed: int, step: int, row: int) -> int:
    """The seed of one row's sample: the run's seed, the step, the row's place in the step's global batch."""
    return sampling.mixed_seed(sampling.mixed_seed(seed, step), row)


def row_numbers(rank: int, world: int, accumulation_index: int, rows: int) -> range:
    """The places in the step's global batch of one micro-batch's rows. The loader's micro-batches
    go to the ranks in turn (Accelerate's batch sharding: micro-batch k to rank k mod world) and
    each rank draws its accumulation's micro-batches one after the other, so rank r's i-th holds
    the (i x world + r)-th `rows` rows: one process at micro 4 and two at micro 2 number them alike."""
    first = (accumulation_index * world + rank) * rows
    return range(first, first + rows)


def prompt_length(labels: list[int], length: int, chat: bool) -> int:
    """The prompt of one row (`labels` unshifted, -100 off the loss; `length` the row's real tokens)."""
    if chat:
        end = max((i for i in range(length) if labels[i] != step_loss.IGNORE), default=-1)
        if end >= 0:
            start = end
            while start > 0 and labels[start - 1] != step_loss.IGNORE:
                start -= 1
            if start > 0:
                return start
    return max(length // 2, 1)


class Sampler:
    """The student's samples in place of the data's answers, as a micro-batch the objective reads."""

    def __init__(self, accelerator: Any, pad_id: int, eos_id: Optional[int], temperature: float,
                 max_new_tokens: int, max_length: int, chat: bool, synced: bool = False):
        self.accelerator, self.pad_id, self.eos_id = accelerator, pad_id, eos_id
        self.temperature, self.max_new_tokens, self.max_length, self.chat = (temperature, max_new_tokens,
                                                                             max_length, chat)
        self.synced = synced  # a sharded student: every rank takes every forward of the sampling

    def prompts(self, batch: dict) -> list[list[int]]:
        ids, labels = batch["input_ids"].tolist(), batch["labels"].tolist()
        lengths = batch["attention_mask"].sum(-1).tolist() if "attention_mask" in batch else [len(r) for r in ids]
        return [row[:prompt_length(lab, n, self.chat)] for row, lab, n in zip(ids, labels, lengths)]

    def batch(self, model: Any, batch: dict, seeds: list[int]) -> dict:
        """The micro-batch's rows continued by the student in one batched call, row i drawn from seeds[i]
        alone (training/generation/sampling.py: a row's draws never depend on the rows beside it), each
        never past data.max_length."""
        prompts = self.prompts(batch)
        rooms = [min(self.max_new_tokens, self.max_length - len(prompt)) for prompt in prompts]
        with torch.no_grad(), sampling.seeded(self.accelerator, seeds[0] if seeds else 0):
            samples = sampling.sample(model, self.accelerator, prompts, max(max(rooms, default=1), 1),
                                      pad_id=self.pad_id, eos_id=self.eos_id, temperature=self.temperature,
                                      top_p=1.0, top_k=0, synced=self.synced, seeds=list(seeds))
        return self.assembled(prompts, [s[:max(room, 0)] for s, room in zip(samples, rooms)])

    def assembled(self, prompts: list[list[int]], samples: list[list[int]]) -> dict:
        """prompt + sample per row, right-padded (as the chat collator pads); labels: the sample alone."""
        width = max(len(p) + len(s) for p, s in zip(prompts, samples))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(prompts), width), step_loss.IGNORE, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, (p, s) in enumerate(zip(prompts, samples)):
            ids[i, :len(p) + len(s)] = torch.tensor(p + s, dtype=torch.long)
            labels[i, len(p):len(p) + len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, :len(p) + len(s)] = 1
        device = self.accelerator.device
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}
