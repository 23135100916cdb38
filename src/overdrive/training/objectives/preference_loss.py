"""The preference losses, as TRL defines them, on per-pair log-probabilities.

Each function takes the policy's log-probs of the chosen and rejected answers (summed over
the answer's tokens) and, where the method uses them, the answer lengths and the reference
model's log-probs; it returns per-pair losses and the rewards TRL logs. Sources (TRL 1.16):

    dpo     DPOTrainer, loss_type "sigmoid" (with TRL's cDPO label smoothing, as CPOTrainer's
            "sigmoid" keeps it): -(1-e) logsigmoid(b d) - e logsigmoid(-b d),
            d = (chosen - ref_chosen) - (rejected - ref_rejected)
    ipo     DPOTrainer, loss_type "ipo": the log-ratios divided by the answer lengths,
            (d_avg - 1/(2b))^2
    simpo   CPOTrainer, loss_type "simpo" (cpo_alpha 0): average log-probs,
            logits = avg_chosen - avg_rejected - gamma/b, smoothed as dpo
    orpo    ORPOTrainer.odds_ratio_loss: average log-probs, log odds
            (a - r) - (log(1 - e^a) - log(1 - e^r)); loss = NLL(chosen) - b logsigmoid(log odds)

    kto     KTOTrainer, loss_type "kto" (unpaired rows, each desirable or not): with r the
            log-ratio (policy - reference) of a completion and z the KL estimate,
            desirable 1 - sigmoid(b (r - z)), undesirable 1 - sigmoid(b (z - r)), weighted by
            desirable_weight / undesirable_weight; z is the mean log-ratio of mismatched
            (prompt, another row's completion) pairs, detached, averaged over ranks, clamped at 0

    reward  RewardTrainer.compute_loss: -logsigmoid(r_chosen - r_rejected) (Bradley-Terry), plus
            center_rewards_coefficient x mean((r_chosen + r_rejected)^2) when set

Rewards: b x log-ratio for dpo/ipo; b x average log-prob for simpo/orpo (TRL's logging); the
scalar head's scores for a reward model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from overdrive.data.samples import IGNORE


@dataclass
class PairScores:
    """What a method makes of a batch of pairs: per-pair losses, rewards and the log-probs it logs."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token (positions 1..n-1), in float32: gather minus logsumexp, no
    full log-softmax kept."""
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    return torch.gather(logits, -1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def answer_logps(per_token: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the answer tokens' log-probs, the answer's token count) per row."""
    mask = (labels[:, 1:] != IGNORE).to(per_token.dtype)
    return (per_token * mask).sum(dim=1), mask.sum(dim=1)


def _smoothed(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing)


def dpo(chosen, rejected, ref_chosen, ref_rejected, beta: float, label_smoothing: float = 0.0) -> PairScores:
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    losses = _smoothed(chosen_ratio - rejected_ratio, beta, label_smoothing)
    return PairScores(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), chosen, rejected)


def ipo(chosen, rejected, ref_chosen, ref_rejected, chosen_length, rejected_length, beta: float) -> PairScores:
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio / chosen_length.clamp(min=1.0) - rejected_ratio / rejected_length.clamp(min=1.0)
    losses = (delta - 1 / (2 * beta)) ** 2
    return PairScores(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), chosen, rejected)


def simpo(chosen, rejected, chosen_length, rejected_length, beta: float, gamma: float,
          label_smoothing: float = 0.0) -> PairScores:
    chosen_avg, rejected_avg = chosen / chosen_length.clamp(min=1.0), rejected / rejected_length.clamp(min=1.0)
    losses = _smoothed(chosen_avg - rejected_avg - gamma / beta, beta, label_smoothing)
    return PairScores(losses, beta * chosen_avg.detach(), beta * rejected_avg.detach(), chosen_avg, rejected_avg)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler 2012, as TRL's ORPO)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo(chosen, rejected, chosen_length, rejected_length, chosen_nll, beta: float) -> PairScores:
    """`chosen_nll`: the mean NLL over the chosen sequences (a scalar), added to each pair's loss
    so that the mean over pairs is TRL's `nll - mean(beta * logsigmoid(log_odds))`."""
    chosen_avg = (chosen / chosen_length.clamp(min=1.0)).float()
    rejected_avg = (rejected / rejected_length.clamp(min=1.0)).float()
    log_odds = (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg))
    losses = chosen_nll - beta * F.logsigmoid(log_odds)
    return PairScores(losses, beta * chosen_avg.detach(), beta * rejected_avg.detach(), chosen_avg, rejected_avg)


def bradley_terry(chosen_scores, rejected_scores, center_rewards_coefficient=None) -> PairScores:
    """A reward model's loss on its scalar scores; with centering, each pair's share of
    `coefficient x mean((chosen + rejected)^2)`, so the mean over pairs is TRL's loss."""
    losses = -F.logsigmoid(chosen_scores - rejected_scores)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen_scores + rejected_scores) ** 2
    return PairScores(losses, chosen_scores.detach(), rejected_scores.detach(), chosen_scores.detach(),
                      rejected_scores.detach())


@dataclass
class UnpairedScores:
    """KTO on a batch of rows: per-row weighted losses, the desirable and undesirable rows' rewards and log-probs."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


def kto_kl(mismatched, mismatched_reference) -> torch.Tensor:
    """One batch's KL estimate (before the mean over ranks and the clamp): the mean log-ratio
    of the mismatched pairs, without gradient."""
    return (mismatched - mismatched_reference).mean().detach()


def kto(logps, reference_logps, desirable: torch.Tensor, kl: torch.Tensor, beta: float,
        desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> UnpairedScores:
    """`desirable`: a bool per row; `kl`: the estimate already clamped at 0. The mean of the
    losses is TRL's loss (its rows ordered desirable first, which the mean does not see)."""
    ratios = logps - reference_logps
    good, bad = ratios[desirable], ratios[~desirable]
    losses = torch.cat([desirable_weight * (1 - torch.sigmoid(beta * (good - kl))),
                        undesirable_weight * (1 - torch.sigmoid(beta * (kl - bad)))])
    return UnpairedScores(losses, beta * good.detach(), beta * bad.detach(), logps[desirable].detach(),
                          logps[~desirable].detach())
