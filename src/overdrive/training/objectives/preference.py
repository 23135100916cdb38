"""Preference training's step of computing the loss (`preference.method`): the chosen and
rejected sequences of a batch in one forward (data/preference_samples.py), the reference
model's log-probs where the method compares with one, the loss (preference_loss.py), and
TRL's metrics summed on the device until the loop's log point reads them.

The reference model, without a second copy where it can be:
- LoRA: the policy itself with its adapter disabled (PEFT's `disable_adapter()`);
- `preference.precompute_reference`: the log-probs of every pair computed once, with the
  starting weights, before the first step, and kept in output_dir (a resumed run reads them);
- full-parameter training otherwise: a frozen copy, prepared as the policy is (sharded the same
  way under FSDP2 and ZeRO-3): training/objectives/reference.py.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from overdrive.config.schema import RunConfig
from overdrive.config.schema_preference import WITH_REFERENCE
from overdrive.training.objectives import preference_kto as kto
from overdrive.training.objectives import preference_loss as losses
from overdrive.training.objectives.objective import Objective, repeated_rows

# metrics.jsonl's names (TRL's), in the order of the summed tensor; the last slot counts pairs.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
MODEL_INPUTS = ("input_ids", "attention_mask")
# A vision-language model's image inputs beside them (data/vision_pairs.py): each row's images, in row order.
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "mm_token_type_ids", "image_sizes")


def model_inputs(batch: dict) -> dict:
    return {k: batch[k] for k in MODEL_INPUTS + IMAGE_INPUTS if k in batch}


REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def enabled(cfg: RunConfig) -> bool:
    return cfg.preference.method != "none"


def trains_reward_model(cfg: RunConfig) -> bool:
    return cfg.preference.method == "reward"


def needs_reference(cfg: RunConfig) -> bool:
    return cfg.preference.method in WITH_REFERENCE


def sequence_scores(model, batch: dict, context=contextlib.nullcontext) -> tuple[torch.Tensor, ...]:
    """(answer log-prob sums, answer lengths, per-token log-probs) of every row of the batch."""
    with context():
        out = model(**model_inputs(batch), use_cache=False)
    per_token = losses.token_logps(out.logits, batch["input_ids"])
    logps, lengths = losses.answer_logps(per_token, batch["labels"])
    return logps, lengths, per_token


class PreferenceObjective(Objective):
    """A preference method as the composed step's objective (training/objectives/objective.py): a pair is
    the unit; ORPO adds a second term, the chosen answers' NLL over their real tokens (TRL's
    mean over the batch's tokens, here over the global batch's, whatever the split)."""

    # The pair losses fall towards zero as the margins grow (a ratio to their mean would flag
    # ordinary steps); a bad batch shows in the gradient it pulls with (training/guards/loss_spikes.py).
    spike_measure = "grad_norm"

    def __init__(self, cfg: RunConfig, accelerator, reference: Optional[Callable[[Any, dict], torch.Tensor]] = None,
                 eval_reference: Optional[Callable[[Any, dict], torch.Tensor]] = None):
        p = cfg.preference
        self.method, self.beta, self.smoothing, self.gamma = p.method, p.beta, p.label_smoothing, p.simpo_gamma
        self.name = f"{p.method} on " + ("desirable and undesirable completions" if p.method == "kto" else
                                         "preference pairs")
        self.centering = p.center_rewards_coefficient
        self.accelerator, self.reference, self.eval_reference = accelerator, reference, eval_reference
        # KTO (unpaired rows): its own loss and sums (preference_kto.py)
        self.unpaired = kto.UnpairedLoss(cfg, accelerator, _logps) if p.method == "kto" else None
        slots = len(kto.SLOTS) if self.unpaired is not None else len(METRICS) + 1
        self.sums_of_metrics = torch.zeros(slots, dtype=torch.float64, device=accelerator.device)

    def corrupt(self, batch: dict, generator: torch.Generator) -> dict:
        """Random token ids in the answers (the log-probs are read at the input ids, the labels only mask them)."""
        from overdrive.training.step.step_loss import IGNORE

        ids, answer = batch["input_ids"], batch["labels"] != IGNORE
        noise = torch.randint(0, int(ids.max()) + 1, ids.shape, generator=generator).to(ids.device, ids.dtype)
        return {**batch, "input_ids": torch.where(answer, noise, ids),
                "labels": torch.where(answer, noise.to(batch["labels"].dtype), batch["labels"])}

    def snapshot(self) -> torch.Tensor:
        return self.sums_of_metrics.clone()

    def rewind(self, snapshot: torch.Tensor) -> None:
        self.sums_of_metrics.copy_(snapshot)

    def restore(self, pending: Optional[list]) -> None:
        """A resumed run's interval since its last log point (summed over ranks: kept on one)."""
        if pending is not None and self.accelerator.is_main_process:
            self.sums_of_metrics += torch.tensor(pending, dtype=torch.float64, device=self.accelerator.device)

    def evaluate(self, model, loader, accelerator=None) -> dict[str, float]:
        """The loss and TRL's metrics over the validation pairs (as `eval_*`), the loss normalised
        over the whole subset as a training step's is over its global batch."""
        from overdrive.training.step import step_loss

        kept, self.sums_of_metrics = self.sums_of_metrics, torch.zeros_like(self.sums_of_metrics)
        train_reference, self.reference = self.reference, self.eval_reference
        sums, counts = None, None
        model.eval()
        try:
            with torch.no_grad():
                for batch in loader:
                    batch = _without_repeats(loader, batch)
                    here, units = self.sums(model, batch).double(), self.counts(batch).double().to(self.accelerator.device)
                    sums, counts = (here, units) if sums is None else (sums + here, counts + units)
            metrics = self.read()
        finally:
            model.train()
            self.sums_of_metrics, self.reference = kept, train_reference
        if sums is None:
            sums = counts = torch.zeros(1, dtype=torch.float64, device=self.accelerator.device)
        loss = step_loss.share(self.accelerator.reduce(sums, "sum"), self.accelerator.reduce(counts, "sum").clamp(min=1))
        return {"eval_loss": loss.item(), **{f"eval_{k}": v for k, v in metrics.items()}}

    def counts(self, batch: dict) -> torch.Tensor:
        """The pairs of a micro-batch (chosen rows, then rejected ones), or KTO's rows; ORPO: and
        the tokens of the chosen rows its NLL is taken over."""
        device = batch["input_ids"].device
        if self.unpaired is not None:
            return kto.units(batch).to(device).reshape(1)
        pairs = batch["input_ids"].shape[0] // 2
        kept = _kept(batch, pairs)
        if self.method != "orpo":
            return kept.sum().long().reshape(1)
        chosen_tokens = (_nll_mask(batch)[:pairs, 1:] * kept[:, None]).sum()
        return torch.stack([kept.sum().long(), chosen_tokens.long()])

    def sums(self, model, batch: dict) -> torch.Tensor:
        if self.unpaired is not None:  # KTO: its mean over the micro-batch's rows (the KL estimate is the batch's)
            loss, metrics = self.unpaired(model, batch, self.reference)
            self.sums_of_metrics += metrics
            return (loss * kto.units(batch).to(loss.device)).reshape(1)
        if self.method == "reward":  # a scalar per sequence: chosen rows, then rejected ones
            scores = model(**{k: batch[k] for k in MODEL_INPUTS}, use_cache=False).logits.squeeze(-1).float()
            n = len(scores) // 2
            pairs = losses.bradley_terry(scores[:n], scores[n:], self.centering)
            kept = _kept(batch, n)
            self._add(pairs, kept)
            return (pairs.losses * kept).sum().reshape(1)
        ref = self.reference(model, batch) if self.reference is not None else None
        logps, lengths, per_token = sequence_scores(model, batch)
        n = len(logps) // 2
        kept = _kept(batch, n)  # held-out pairs Accelerate repeated: 0
        chosen, rejected = logps[:n], logps[n:]
        chosen_length, rejected_length = lengths[:n], lengths[n:]
        if self.method == "dpo":
            scores = losses.dpo(chosen, rejected, ref[:n], ref[n:], self.beta, self.smoothing)
        elif self.method == "ipo":
            scores = losses.ipo(chosen, rejected, ref[:n], ref[n:], chosen_length, rejected_length, self.beta)
        elif self.method == "simpo":
            scores = losses.simpo(chosen, rejected, chosen_length, rejected_length, self.beta, self.gamma,
                                  self.smoothing)
        else:  # orpo: the odds-ratio term per pair, and the NLL over the chosen sequences, prompt included
            real = _nll_mask(batch)[:n, 1:].to(per_token.dtype) * kept[:, None].to(per_token.dtype)
            nll_sum = -(per_token[:n] * real).sum()
            scores = losses.orpo(chosen, rejected, chosen_length, rejected_length, 0.0, self.beta)
            self._add(scores, kept)
            return torch.stack([(scores.losses * kept).sum(), nll_sum.float()])
        self._add(scores, kept)
        return (scores.losses * kept).sum().reshape(1)

    def _add(self, s: "losses.PairScores", kept: torch.Tensor) -> None:
        """TRL's metrics of the pairs, those with `kept` 0 (held-out repeats) left out."""
        with torch.no_grad():
            margins = s.chosen_rewards - s.rejected_rewards
            values = [s.chosen_rewards * kept, s.rejected_rewards * kept, (margins > 0) * kept, margins * kept,
                      s.chosen_logps.detach() * kept, s.rejected_logps.detach() * kept, kept]
            self.sums_of_metrics += torch.stack([v.double().sum() for v in values])

    def pending(self) -> list[float]:
        """The sums since the last read, over every rank, without resetting (what a checkpoint keeps)."""
        return self.accelerator.reduce(self.sums_of_metrics.clone(), "sum").tolist()

    def read(self) -> dict[str, float]:
        """TRL's metrics over the pairs since the last read, on every rank (a sync: the log point)."""
        total = self.accelerator.reduce(self.sums_of_metrics.clone(), "sum").tolist()
        self.sums_of_metrics.zero_()
        if self.unpaired is not None:
            return kto.means(total)
        count = max(total[-1], 1.0)
        if self.method == "reward":  # the rewards are the scores; also RewardTrainer's own names
            means = {name: value / count for name, value in zip(REWARD_METRICS, total)}
            return {**means, "accuracy": means["rewards/accuracies"], "margin": means["rewards/margins"],
                    "mean_reward": (means["rewards/chosen"] + means["rewards/rejected"]) / 2}
        return {name: value / count for name, value in zip(METRICS, total)}


def _without_repeats(loader: Any, batch: dict) -> dict:
    """A held-out batch with `kept`: 0 for the pairs (KTO: rows) Accelerate repeated to even out the ranks' last
    batches (objective.without_repeats), so each pair is in the held-out loss and metrics once on any number of
    processes. A paired batch holds its chosen rows, then its rejected ones."""
    rows = batch["input_ids"].shape[0] // (1 if "desirable" in batch else 2)
    repeated = repeated_rows(loader, rows, batch["input_ids"].device)
    return batch if repeated is None else {**batch, "kept": (~repeated).float()}


def _kept(batch: dict, rows: int) -> torch.Tensor:
    """1 for each pair (row) in the loss, 0 for a held-out repeat."""
    return batch["kept"] if "kept" in batch else torch.ones(rows, device=batch["input_ids"].device)


def _nll_mask(batch: dict) -> torch.Tensor:
    """ORPO's NLL tokens: the real ones (TRL's), less an image's where the rows carry images (data/vision_pairs.py)."""
    return batch.get("text_mask", batch["attention_mask"])


def _logps(model, batch: dict) -> torch.Tensor:
    return sequence_scores(model, batch)[0]


def lora_reference(accelerator) -> Callable[[Any, dict], torch.Tensor]:
    """The reference under LoRA: the same model with its adapter disabled, no gradients."""

    def reference(model, batch: dict) -> torch.Tensor:
        peft_model = accelerator.unwrap_model(model)
        with torch.no_grad():
            logps, _, _ = sequence_scores(model, batch, peft_model.disable_adapter)
        return logps

    return reference


def frozen_reference(reference_model, accelerator) -> Callable[[Any, dict], torch.Tensor]:
    """The reference as a frozen model of its own (a copy of the starting weights), under the
    policy's autocast."""

    def reference(model, batch: dict) -> torch.Tensor:
        with torch.no_grad(), accelerator.autocast():
            logps, _, _ = sequence_scores(reference_model, batch)
        return logps

    return reference


def cached_reference(table: torch.Tensor) -> Callable[[Any, dict], torch.Tensor]:
    """The reference from log-probs computed before training: `table[pair] = (chosen, rejected)`."""

    def reference(model, batch: dict) -> torch.Tensor:
        rows = table.to(batch["input_ids"].device)[batch["pair_index"].long()]
        return torch.cat([rows[:, 0], rows[:, 1]]).float()

    return reference
