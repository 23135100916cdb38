"""KTO's share of preference training (`preference.method: kto`), as TRL's KTOTrainer computes it:
a loss function over a micro-batch of unpaired rows, the unit its mean is over (rows), and the
metrics it names. Nothing here touches the loop.

A micro-batch (data/preference_unpaired.py) holds each row's prompt + completion and, for the
KL estimate, the same prompts with the completions rotated by one inside the micro-batch (row
i's prompt with row i-1's completion), as TRL's `get_kl_completion_ids` builds them. The KL
estimate is the mean log-ratio of those mismatched pairs, without gradient, averaged over the
ranks and clamped at 0 (TRL's `gather_for_metrics(kl).mean().clamp(min=0)`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from overdrive.training.objectives import preference_loss as losses

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

# The summed tensor's slots; metrics.jsonl gets TRL's names (means over the rows of each kind).
SLOTS = ("chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps", "kl", "chosen", "rejected",
         "batches")
MISMATCHED = {"input_ids": "kl_input_ids", "attention_mask": "kl_attention_mask", "labels": "kl_labels"}

Scores = Callable[[Any, dict], torch.Tensor]  # (model, batch) -> the completions' log-prob sums


def mismatched(batch: dict) -> dict:
    """The KL sequences of a micro-batch under the names a forward reads."""
    return {name: batch[key] for name, key in MISMATCHED.items()}


def units(batch: dict) -> torch.Tensor:
    """The rows of a micro-batch: what a step's KTO loss is the mean over (a held-out repeat, `kept` 0, not)."""
    if "kept" in batch:
        return batch["kept"].sum().long()
    return torch.tensor(batch["input_ids"].shape[0], dtype=torch.long)


class UnpairedLoss:
    """(model, batch) -> (the mean loss over the batch's rows, the metric sums to add)."""

    def __init__(self, cfg: RunConfig, accelerator, scores: Scores):
        p = cfg.preference
        self.beta, self.desirable_weight, self.undesirable_weight = p.beta, p.desirable_weight, p.undesirable_weight
        self.accelerator, self.scores = accelerator, scores

    def __call__(self, model, batch: dict, reference: Optional[Scores]) -> tuple[torch.Tensor, torch.Tensor]:
        kl_batch = mismatched(batch)
        with torch.no_grad():
            kl_logps = self.scores(model, kl_batch)
        logps = self.scores(model, batch)
        reference_logps, reference_kl = reference(model, batch), reference(model, kl_batch)
        kl = losses.kto_kl(kl_logps, reference_kl)
        if self.accelerator.num_processes > 1:  # every rank's estimate, averaged (a collective, as TRL's)
            kl = self.accelerator.reduce(kl.clone(), "mean")
        kl = kl.clamp(min=0)
        desirable = batch["desirable"].bool()
        s = losses.kto(logps, reference_logps, desirable, kl, self.beta, self.desirable_weight,
                       self.undesirable_weight)
        if "kept" not in batch:
            return s.losses.mean(), _metric_sums(s, desirable, kl)
        # A held-out batch with rows Accelerate repeated: those out of the mean and the metrics
        kept = batch["kept"].to(s.losses.device).bool()
        in_loss = torch.cat([kept[desirable], kept[~desirable]])  # the losses' order: desirable rows first
        return ((s.losses * in_loss).sum() / in_loss.sum().clamp(min=1),
                _metric_sums(s, desirable, kl, kept[desirable], kept[~desirable]))


def _metric_sums(s: "losses.UnpairedScores", desirable: torch.Tensor, kl: torch.Tensor,
                 kept_chosen: Optional[torch.Tensor] = None, kept_rejected: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The SLOTS' sums of a micro-batch (the rewards and log-probs of its desirable and undesirable rows, as
    `losses.kto` splits them), the rows not `kept` left out."""
    with torch.no_grad():
        chosen = [s.chosen_rewards, s.chosen_logps]
        rejected = [s.rejected_rewards, s.rejected_logps]
        if kept_chosen is not None and kept_rejected is not None:
            chosen, rejected = [v[kept_chosen] for v in chosen], [v[kept_rejected] for v in rejected]
        values = [chosen[0].sum(), rejected[0].sum(), chosen[1].sum(), rejected[1].sum(), kl,
                  torch.tensor(len(chosen[0])), torch.tensor(len(rejected[0])), torch.ones(())]
        return torch.stack([v.double().to(kl.device) for v in values])


def means(total: list[float]) -> dict[str, float]:
    """TRL's KTO metrics from the summed slots (over every rank since the last read)."""
    t = dict(zip(SLOTS, total))
    chosen, rejected = max(t["chosen"], 1.0), max(t["rejected"], 1.0)
    out = {"kl": t["kl"] / max(t["batches"], 1.0)}
    if t["chosen"]:
        out.update({"rewards/chosen": t["chosen_rewards"] / chosen, "logps/chosen": t["chosen_logps"] / chosen})
    if t["rejected"]:
        out.update({"rewards/rejected": t["rejected_rewards"] / rejected,
                    "logps/rejected": t["rejected_logps"] / rejected})
    if t["chosen"] and t["rejected"]:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out
