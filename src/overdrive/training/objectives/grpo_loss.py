"""GRPO's arithmetic as TRL 1.16's GRPOTrainer defines it (`_generate_and_score_completions`,
`_compute_loss`), on plain tensors, so tests hold it against TRL's own code:

    token_scores      per-token log-probs and entropies of the completion tokens at the sampling
                      temperature (TRL's fused LM head divides the logits by it)
    group_advantages  the weighted reward sum, minus its group's mean, over the group's (or batch's)
                      standard deviation + 1e-4; rows every function left unscored get 0. Or minus the
                      mean of the group's other completions (RLOO's leave-one-out baseline, TRL's
                      RLOOTrainer), or each reward normalised in its group before the weighted sum
                      (GDPO, TRL's multi_objective_aggregation=normalize_then_sum)
    per_token_loss    the clipped ratio times the advantage (times vLLM's importance ratio with
                      rl.use_vllm), plus beta x the k3 KL to the reference
    vllm_importance_ratio  exp(trainer - sampler log-probs), per token or completion, truncated or masked
    sampler_ratio     the same from a micro-batch's lists of sampler log-probs, spread over its tokens
    reduce            the loss type's sum over its units (completions or tokens), which the loop
                      divides by the units of the whole global batch: the same normalisation
                      whatever the micro-batch split (training/step/step_loss.py)

TRL normalises per micro-batch and divides by the accumulation steps; with one micro-batch per
step that is exactly the global-batch normalisation here. `bnpo` is TRL's token mean over the
local batch; over the global batch, as here, it is `dapo`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

# What each loss type's mean is over: a completion, or a completion token (TRL's reductions: sapo
# reduces as grpo, cispo as dapo; gspo is grpo's loss with one ratio per sequence).
UNIT = {"grpo": "completions", "dr_grpo": "completions", "dapo": "tokens", "bnpo": "tokens", "gspo": "completions",
        "sapo": "completions", "cispo": "tokens"}


def nanstd(values: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """The standard deviation ignoring NaNs, with Bessel's correction (TRL's `nanstd`)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(values), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count / 1.0, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def token_scores(logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies) [B, C] of the completion tokens; `logits` [B, C, V] are those that
    predict them (positions -C-1 .. -2 of the sequence)."""
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = torch.gather(logps, -1, completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logps.exp() * logps).sum(-1)
    return chosen, entropy


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B] per completion
    rewards: torch.Tensor  # [B] the weighted sum (NaN where no function scored the completion)
    std_rewards: torch.Tensor  # [B] the standard deviation each advantage was scaled by
    is_std_zero: torch.Tensor  # [B] bool: a group whose completions all got the same reward


def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str, aggregation: str = "sum_then_normalize",
                     baseline: str = "group_mean") -> Advantages:
    """TRL's `sum_then_normalize` over the whole (gathered) batch [B, F]; groups are consecutive rows."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    weights = weights.to(rewards_per_func.device).unsqueeze(0)
    rewards = (rewards_per_func * weights).nansum(dim=1)
    rewards[unscorable] = torch.nan
    if aggregation == "normalize_then_sum":
        return _normalize_then_sum(rewards_per_func, weights, num_generations, unscorable, rewards)
    if aggregation != "sum_then_normalize":
        raise ValueError(f"multi_objective_aggregation must be sum_then_normalize or normalize_then_sum, "
                         f"not {aggregation!r}")
    if baseline == "leave_one_out":
        return _leave_one_out(rewards, num_generations, scale_rewards)
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    if scale_rewards in ("group", "none"):  # "none" keeps the group std for the zero-std count only
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    elif scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"scale_rewards must be group, batch or none, not {scale_rewards!r}")
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), rewards, std, is_std_zero)


def _normalize_then_sum(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                        unscorable: torch.Tensor, summed: torch.Tensor) -> Advantages:
    """GDPO (TRL's normalize_then_sum): each reward centred and scaled within its group, the weighted sum of those
    normalised over the batch. `rewards` stays the plain weighted sum: what is logged as the reward."""
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nanstd(grouped, dim=1).unsqueeze(1)
    normalised = ((grouped - mean) / (std + 1e-4)).view(-1, rewards_per_func.shape[1])
    combined = (normalised * weights).nansum(dim=1)
    combined[unscorable] = torch.nan
    batch_std = nanstd(combined).expand_as(combined) if combined.numel() > 1 else torch.zeros_like(combined)
    advantages = (combined - torch.nanmean(combined)) / (batch_std + 1e-4)
    is_std_zero = torch.isclose(batch_std, torch.zeros_like(batch_std))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), summed, batch_std, is_std_zero)


def _leave_one_out(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> Advantages:
    """RLOO (TRL's RLOOTrainer): the reward minus the mean of its group's other scorable completions; `batch`
    scaling is RLOO's normalize_advantages (centred and scaled over the batch), `group` the group's std."""
    grouped = rewards.view(-1, num_generations)
    std = nanstd(grouped, dim=1)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = ((torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)).view(-1)
    advantages = rewards - baselines
    if scale_rewards == "batch":
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    elif scale_rewards == "group":
        advantages = advantages / (std.repeat_interleave(num_generations) + 1e-4)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, not {scale_rewards!r}")
    std = std.repeat_interleave(num_generations)
    return Advantages(torch.nan_to_num(advantages, nan=0.0), rewards, std, torch.isclose(std, torch.zeros_like(std)))


@dataclass
class TokenLoss:
    loss: torch.Tensor  # [B, C] before the mask
    kl: Optional[torch.Tensor]  # [B, C] the k3 estimate, None without a reference (beta 0)
    ratio: torch.Tensor  # [B, C] pi / pi_old (TRL's coef_1); [B, 1] at the sequence level
    low_clipped: torch.Tensor  # [B, C] (or [B, 1]) bool
    high_clipped: torch.Tensor  # [B, C] (or [B, 1]) bool; under cispo the ratios its clip cut


def per_token_loss(logps: torch.Tensor, old_logps: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor],
                   advantages: torch.Tensor, beta: float, epsilon_low: float, epsilon_high: float,
                   loss_type: str = "dapo", sequence_level: bool = False, mask: Optional[torch.Tensor] = None,
                   sapo_temperatures: tuple[float, float] = (1.0, 1.05),
                   importance_ratio: Optional[torch.Tensor] = None) -> TokenLoss:
    """TRL's `_compute_loss` up to the reduction: the importance ratio per token, or per sequence
    (`sequence_level`, GSPO: the exponent of the mean log-ratio over `mask`'s tokens, shape [B, 1]);
    then the clipped objective (grpo, dapo, dr_grpo, bnpo, gspo), CISPO's detached ratio clipped at
    epsilon_high times the log-prob, or SAPO's sigmoid gate; times `importance_ratio` (rl.use_vllm: the
    sampler's correction, `vllm_importance_ratio`); plus beta x the k3 KL."""
    old = logps.detach() if old_logps is None else old_logps  # one update per generation: pi_old = pi
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = logps - old
    if sequence_level:
        mask = torch.ones_like(logps) if mask is None else mask.to(logps.dtype)
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    if loss_type == "cispo":
        loss = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logps
        low, high = torch.zeros_like(ratio, dtype=torch.bool), (ratio > epsilon_high) & (advantages > 0)
    elif loss_type == "sapo":
        positive, negative = sapo_temperatures
        temperatures = torch.where(advantages > 0, positive, negative)
        loss = -(torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures) * advantages
        low = high = torch.zeros_like(ratio, dtype=torch.bool)
    else:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        loss = -torch.min(ratio * advantages, clipped * advantages)
        low = (ratio < 1 - epsilon_low) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
    if importance_ratio is not None:  # TRL multiplies before the KL is added: the KL term is not reweighted
        loss = loss * importance_ratio
    kl = None
    if beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        loss = loss + beta * kl
    return TokenLoss(loss, kl, ratio, low, high)


IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def vllm_importance_ratio(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                          clip_min: Optional[float], clip_max: Optional[float]) -> torch.Tensor:
    """TRL 1.16's correction for vLLM sampling from a slightly different distribution than the trainer computes
    (GRPOTrainer._generate_and_score_completions): exp(trainer - sampler log-probs) over `mask`'s tokens (a NaN
    sampler log-prob counts as no difference), per token or summed per completion (`sequence_*`), clamped to
    [clip_min, clip_max] (`*_truncate`) or set to 0 outside them (`*_mask`). [B, C] per token, [B, 1] per
    completion; the per-token loss is multiplied by it."""
    diff = torch.nan_to_num((trainer_logps - sampler_logps) * mask.to(trainer_logps.dtype), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max) if clip_min is not None or clip_max is not None \
            else ratio
    if mode.endswith("mask"):
        low = clip_min if clip_min is not None else -math.inf
        high = clip_max if clip_max is not None else math.inf
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"rl.vllm_importance_sampling_mode must be one of {', '.join(IS_MODES)}, not {mode!r}")


def sampler_ratio(trainer_logps: torch.Tensor, sampler_logps: list[list[float]], mask: torch.Tensor, mode: str,
                  clip_min: Optional[float], clip_max: Optional[float]) -> torch.Tensor:
    """`vllm_importance_ratio` of a micro-batch whose sampler log-probs are lists (one per completion), [B, C]
    per token: a completion's one ratio spread over its tokens, so a re-cut batch carries it as it carries
    log-probs."""
    width = trainer_logps.shape[1]
    sampled = torch.zeros_like(trainer_logps)
    for i, row in enumerate(sampler_logps):
        n = min(len(row), width)
        sampled[i, :n] = torch.tensor(row[:n], dtype=sampled.dtype, device=sampled.device)
    ratio = vllm_importance_ratio(trainer_logps, sampled, mask, mode, clip_min, clip_max)
    return ratio.expand_as(trainer_logps).contiguous()


def units(loss_type: str, mask: torch.Tensor) -> torch.Tensor:
    """What this micro-batch adds to the global batch's count: its completions, or its completion tokens."""
    if UNIT[loss_type] == "completions":
        return torch.tensor(mask.shape[0], dtype=torch.long, device=mask.device)
    return mask.sum().long()


def reduce(loss: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """The loss type's sum over this micro-batch's units; / the global batch's units is TRL's loss."""
    mask = mask.to(loss.dtype)
    loss = loss.expand_as(mask) if loss.shape != mask.shape else loss  # [B, 1]: one sequence-level term per row
    if loss_type in ("grpo", "gspo", "sapo"):
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if loss_type == "dr_grpo":
        return (loss * mask).sum() / max_completion_length
    if loss_type in ("dapo", "bnpo", "cispo"):
        return (loss * mask).sum()
    raise ValueError(f"unknown loss_type {loss_type!r}")
