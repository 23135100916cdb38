"""Knowledge distillation as the composed step's objective (`distill.teacher`; training/objectives/objective.py):
the student's forward and the frozen teacher's on the same micro-batch (text or chat, whose labels
already mark the loss tokens: the assistant's alone for chat), and per loss token

    (1 - distill.alpha) x divergence(teacher, student)  +  distill.alpha x the data's cross entropy

summed over the micro-batch; step_loss.py divides by the global batch's loss tokens, so the loss
is the same whatever the split. The divergence is TRL's generalized_jsd_loss (distill_loss.py).

The teacher is loaded whole on every rank, in the student's dtype, in eval mode (no dropout), with
no gradients: the strategies that shard the student are refused by key (resolving/validate_distill.py)
rather than given a whole teacher per rank. metrics.jsonl gets the divergence and the cross entropy
apart (`distill/loss`, `distill/cross_entropy`) and how often the two models' most likely next token
agree (`distill/top1_agreement`), summed on the device until the loop's log point reads them.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from overdrive.config.schema import RunConfig
from overdrive.config.schema_distill import effective_beta
from overdrive.errors import Problem, UserError
from overdrive.hf import teacher as teacher_files
from overdrive.training.objectives import distill_loss
from overdrive.training.step import step_loss
from overdrive.training.build.dtypes import DTYPES
from overdrive.training.objectives.objective import Objective

# metrics.jsonl's names, in the order of the summed tensor; the last slot counts loss tokens.
METRICS = ("distill/loss", "distill/cross_entropy", "distill/top1_agreement")


def enabled(cfg: RunConfig) -> bool:
    return teacher_files.enabled(cfg)


def load_teacher(cfg: RunConfig, device: Any) -> torch.nn.Module:
    """The teacher's weights as the student's are loaded (dtype, attention kernel), frozen, in eval mode."""
    from transformers import AutoModelForCausalLM

    from overdrive import hub

    m = cfg.model
    loading: dict[str, Any] = {"trust_remote_code": m.trust_remote_code}
    if m.dtype != "auto":
        loading["dtype"] = DTYPES[m.dtype]
    if m.attn_implementation:
        loading["attn_implementation"] = m.attn_implementation
    with hub.reading(teacher_files.KEY, cfg.distill.teacher):
        teacher = AutoModelForCausalLM.from_pretrained(cfg.distill.teacher, **loading)
    teacher.config.use_cache = False  # the cache only serves generation
    teacher.requires_grad_(False)
    return teacher.to(device).eval()


class DistillObjective(Objective):
    """Off-policy logit distillation: a loss token is the unit, one term (step_loss.py)."""

    def __init__(self, cfg: RunConfig, accelerator: Any, teacher: torch.nn.Module):
        d = cfg.distill
        self.beta, self.temperature, self.alpha = effective_beta(d), d.temperature, d.alpha
        self.accelerator, self.teacher = accelerator, teacher
        kind = "chat" if cfg.data.format == "chat" else "text"
        self.name = f"{kind} distilled from {d.teacher} ({d.loss}, beta {self.beta:g}, alpha {self.alpha:g})"
        self.sums_of_metrics = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=accelerator.device)

    def _scores(self, model: Any, batch: dict, train: bool) -> tuple[torch.Tensor, ...]:
        """(divergence sum, cross-entropy sum, top-1 agreements, loss tokens) of the micro-batch."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        student = model(**inputs, use_cache=False).logits
        # The teacher is not prepared by the Accelerator: the student's autocast is applied here.
        with torch.no_grad(), self.accelerator.autocast():
            teacher = self.teacher(**inputs, use_cache=False).logits
        if teacher.shape != student.shape:  # fit_problems refuses this before launch; a hand-built config too
            raise UserError(Problem(teacher_files.KEY, f"the teacher's logits are {tuple(teacher.shape)} and the "
                                    f"student's {tuple(student.shape)}", fix="a teacher with the student's tokenizer"))
        labels = step_loss.shifted_labels(batch["labels"])  # position i predicts token i + 1 (TRL's shift)
        mask = labels != step_loss.IGNORE
        divergence = distill_loss.per_token(student, teacher, self.beta, self.temperature)[mask].sum()
        # With alpha 0 the cross entropy is only watched: kept out of the graph.
        watched = student if (train and self.alpha) else student.detach()
        cross_entropy = step_loss.summed_cross_entropy(watched, batch["labels"])
        agree = ((student.detach().argmax(-1) == teacher.argmax(-1)) & mask).sum()
        return divergence, cross_entropy, agree, mask.sum()

    def sums(self, model: Any, batch: dict) -> torch.Tensor:
        divergence, cross_entropy, agree, tokens = self._scores(model, batch, train=True)
        with torch.no_grad():
            self.sums_of_metrics += torch.stack([divergence.detach().double(), cross_entropy.detach().double(),
                                                 agree.double(), tokens.double()])
        loss = (1 - self.alpha) * divergence if self.alpha < 1 else torch.zeros_like(divergence)
        if self.alpha:
            loss = loss + self.alpha * cross_entropy
        return loss.reshape(1)

    def evaluate(self, model: Any, loader: Any, accelerator: Any) -> dict[str, float]:
        """The held-out cross entropy as `eval_loss` (what plain SFT reports, so the two compare), and
        the divergence and agreement over the same tokens, normalised over the whole subset."""
        totals = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=self.accelerator.device)
        model.eval()
        try:
            with torch.no_grad():
                for batch in loader:
                    totals += torch.stack([v.double() for v in self._scores(model, batch, train=False)])
        finally:
            model.train()
        divergence, cross_entropy, agree, tokens = self.accelerator.reduce(totals, "sum").tolist()
        tokens = max(tokens, 1.0)
        return {"eval_loss": cross_entropy / tokens, "eval_perplexity": math.exp(min(cross_entropy / tokens, 50.0)),
                "eval_distill/loss": divergence / tokens, "eval_distill/top1_agreement": agree / tokens}

    def restore(self, pending: Optional[list]) -> None:
        """A resumed run's interval since its last log point (summed over ranks: kept on one)."""
        if pending is not None and self.accelerator.is_main_process:
            self.sums_of_metrics += torch.tensor(pending, dtype=torch.float64, device=self.accelerator.device)

    def pending(self) -> list[float]:
        """The sums since the last read, over every rank, without resetting (what a checkpoint keeps)."""
        return self.accelerator.reduce(self.sums_of_metrics.clone(), "sum").tolist()

    def read(self) -> dict[str, float]:
        """The metrics per loss token since the last read, on every rank (a sync: the log point)."""
        *sums, tokens = self.accelerator.reduce(self.sums_of_metrics.clone(), "sum").tolist()
        self.sums_of_metrics.zero_()
        return {name: value / max(tokens, 1.0) for name, value in zip(METRICS, sums)}


def objective(cfg: RunConfig, accelerator: Any) -> DistillObjective:
    """The objective with its teacher, on this rank's device."""
    return DistillObjective(cfg, accelerator, load_teacher(cfg, accelerator.device))
