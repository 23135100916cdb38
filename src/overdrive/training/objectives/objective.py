"""The objective of a run: what a micro-batch's loss is, one piece of the composed step.

    objective.counts(batch)       the units of each loss term, on the device (step_loss.py sums
                                  them over the global batch once per step)
    objective.sums(model, batch)  each term summed over its units: forward included
    objective.read()              the metrics it names (TRL's names where TRL has them), summed on
                                  the device since the last read; read at the loop's log point
    objective.evaluate(...)       the validation pass, normalised as a training step is

The forward-backward (training/step/forward_backward.py, training/step/pipeline.py) calls it; the loop's
books (training/loop.py, step_loss.py) never ask which objective it is. A new objective is one
class here or beside it, and one row of the table of what composes (resolving/composition.py).

- `TokenObjective`: causal LM and chat (one term: the token cross entropy over loss tokens) and
  sequence classification (rows);
- training/objectives/preference.py's `PreferenceObjective`: the preference methods (pairs) and the reward
  model (pairs of scalar scores).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, TypeVar

import torch

from overdrive.training.step import step_loss

T = TypeVar("T")


class Objective:
    """The defaults every objective shares: one term, no metrics of its own, nothing pending."""

    #: what the run's first line says it trains
    name = "causal-lm"
    #: what training.loss_spike judges (training/guards/loss_spikes.py): "loss", the step's loss per unit,
    #: where that is a positive scale a bad batch lifts; "grad_norm" where the loss is not one
    spike_measure = "loss"
    #: the loop's guard around work a rank does alone (training.oom_retry: training/guards/oom_retry.py's
    #: `OomRetry.alone`), set by the loop; without it the work just runs
    guard_alone: Optional[Callable[[Callable[[], Any]], Any]] = None

    def counts(self, batch: dict) -> torch.Tensor:
        return step_loss.loss_token_count(batch)

    def sums(self, model: Any, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, model: Any, micro_batches: list) -> list:
        """The step's micro-batches as the objective trains on them (an online method generates here)."""
        return micro_batches

    def alone(self, work: Callable[[], T]) -> T:
        """`work` this rank does without the others before the step's collectives (an online objective's
        sampling), under the loop's guard: an out-of-memory error in it is agreed on over the ranks."""
        return work() if self.guard_alone is None else self.guard_alone(work)

    def read(self) -> dict[str, float]:
        return {}

    def corrupt(self, batch: dict, generator: torch.Generator) -> dict:
        """A bad batch of this objective (the spike test hook, OVERDRIVE_FAULT_INJECT=spike): random
        token ids where there were labels, a batch the model cannot predict."""
        labels = batch["labels"]
        high = int(batch["input_ids"].max()) + 1
        noise = torch.randint(0, high, labels.shape, generator=generator).to(labels.device, labels.dtype)
        return {**batch, "labels": torch.where(labels == step_loss.IGNORE, labels, noise)}

    def snapshot(self) -> Any:
        """The metric sums a step adds to, before it (put back by `rewind` when the step is redone)."""
        return None

    def rewind(self, snapshot: Any) -> None:
        return None

    def resplit(self, micro: int) -> None:
        """The step's micro-batches are `micro` rows from now on (training.oom_retry's redo)."""
        return None

    def pending(self) -> Optional[list]:
        return None

    def restore(self, pending: Optional[list]) -> None:
        return None

    def evaluate(self, model: Any, loader: Any, accelerator: Any) -> dict[str, float]:
        raise NotImplementedError


def without_repeats(loader: Any, batch: dict) -> dict:
    """A held-out batch whose rows Accelerate repeated are out of the loss (labels ignored). With
    `even_batches` (its default, and what a sharded model needs: every rank takes every forward) the
    last batches of a loader whose rows do not divide among the ranks are filled from its first rows;
    summed as they are, those rows would count twice and the held-out loss of two processes would not
    be one process's. Accelerate's own rule (`gather_for_metrics`): in the last batch, the rank-major
    positions from `remainder` on are repeats."""
    if "labels" not in batch:
        return batch
    labels = batch["labels"]
    repeated = repeated_rows(loader, labels.shape[0], labels.device)
    if repeated is None:
        return batch
    shape = (-1,) + (1,) * (labels.dim() - 1)
    return {**batch, "labels": labels.masked_fill(repeated.view(shape), step_loss.IGNORE)}


def repeated_rows(loader: Any, rows: int, device: Any) -> Optional[torch.Tensor]:
    """Which of the current batch's `rows` Accelerate repeated to even out the ranks' last batches
    (`without_repeats`), or None when none is."""
    remainder = getattr(loader, "remainder", -1)
    sampler = getattr(loader, "batch_sampler", None)
    width, rank = getattr(sampler, "batch_size", None), getattr(sampler, "process_index", 0)
    if not getattr(loader, "end_of_dataloader", False) or remainder <= 0 or width is None:
        return None
    repeated = rank * width + torch.arange(rows, device=device) >= remainder
    return repeated if bool(repeated.any()) else None


class TokenObjective(Objective):
    """The model's own loss: next-token cross entropy (causal LM, chat), or a class per row."""

    def __init__(self, task: str, kernel: str = "full"):
        self.task = self.name = task
        self.kernel = kernel  # training.loss_kernel as it runs (training/step/loss_kernels.py): full, chunked or fused

    def sums(self, model: Any, batch: dict) -> torch.Tensor:
        return step_loss.summed_loss(model, batch, self.kernel)

    def corrupt(self, batch: dict, generator: torch.Generator) -> dict:
        """Token labels scrambled; a classifier's rows each given another class, one it has (a
        class at most the batch's highest, or class 1: every classifier has two)."""
        if self.task != "sequence-classification":
            return super().corrupt(batch, generator)
        labels = batch["labels"]
        return {**batch, "labels": (labels + 1) % max(int(labels.max()) + 1, 2)}

    def evaluate(self, model: Any, loader: Any, accelerator: Any) -> dict[str, float]:
        """Mean loss (and accuracy for classification) over the validation subset."""
        acc = accelerator
        loss_sum, tokens = torch.zeros((), device=acc.device), torch.zeros((), device=acc.device)
        correct, seen = torch.zeros((), device=acc.device), 0
        # No gradients here: the chunked loop is the kernel that keeps no logits without them.
        kernel = "full" if self.kernel == "full" else "chunked"
        model.eval()
        with torch.no_grad():
            for batch in loader:
                if self.task != "sequence-classification":
                    batch = without_repeats(loader, batch)
                    tokens += step_loss.loss_token_count(batch)
                    loss_sum += step_loss.summed_loss(model, batch, kernel).detach().float()
                else:
                    out = model(**batch)
                    rows, count = classifier_rows_loss(out, batch["labels"], repeated_rows(loader, len(batch["labels"]),
                                                                                 acc.device))
                    loss_sum, tokens = loss_sum + rows, tokens + count
                    preds, labels = acc.gather_for_metrics((out.logits.argmax(dim=-1), batch["labels"]))
                    correct += (preds == labels).sum()
                    seen += labels.numel()
        model.train()
        # sync point: every rank's sums (a tensor-parallel group's ranks alike, so the ratio holds)
        mean_loss = (acc.reduce(loss_sum, "sum") / acc.reduce(tokens, "sum").clamp(min=1)).item()
        result = {"eval_loss": mean_loss}
        if self.task == "causal-lm":
            result["eval_perplexity"] = math.exp(min(mean_loss, 50.0))
        else:
            result["eval_accuracy"] = correct.item() / max(seen, 1)
        return result


def classifier_rows_loss(out: Any, labels: torch.Tensor, repeated: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed loss, the rows) of a classifier's batch, the rows Accelerate repeated left out: each row's
    cross entropy, as Transformers' single-label loss is (its mean x the rows where nothing is repeated)."""
    if repeated is None or labels.is_floating_point():  # regression or multi-label heads: their own mean
        return out.loss.detach().float() * labels.shape[0], torch.tensor(labels.shape[0], device=labels.device)
    kept = ~repeated
    per_row = torch.nn.functional.cross_entropy(out.logits.float().view(len(labels), -1), labels.view(-1),
                                                reduction="none")
    return per_row[kept].sum(), kept.sum()
