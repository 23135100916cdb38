"""The distillation divergence per token, as TRL's `GKDTrainer.generalized_jsd_loss` defines it
(Eq. 1 of the GKD paper, arXiv 2306.13649), summed rather than averaged: step_loss.py divides by
the global batch's loss tokens, so the loss is the same whatever the micro-batch split.

    per_token(student_logits, teacher_logits, beta, temperature)   [..., positions] divergences

TRL's formula, term for term (tests/test_distill.py holds it against TRL's function):
- both logits divided by `temperature` (no T^2 factor);
- beta 0: KL(teacher || student) (forward); beta 1: KL(student || teacher) (reverse);
- otherwise the mixture m = log(beta p_teacher + (1 - beta) p_student), and
  beta KL(teacher || m) + (1 - beta) KL(student || m).
Each position's divergence is the sum over the vocabulary, as TRL's masked sum is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
              temperature: float) -> torch.Tensor:
    """The generalised JSD of each position (the vocabulary summed), in fp32: logits under autocast
    may be bf16, and a sum over a large vocabulary of small terms loses them in bf16."""
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0:
        divergence = F.kl_div(student, teacher, reduction="none", log_target=True)
    elif beta == 1:
        divergence = F.kl_div(teacher, student, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=student.dtype, device=student.device)
        mixture = torch.logsumexp(torch.stack([student + torch.log1p(-b), teacher + torch.log(b)]), dim=0)
        # F.kl_div(input, target) is KL(target || input): the order is the paper's swapped, as TRL writes it.
        divergence = (b * F.kl_div(mixture, teacher, reduction="none", log_target=True)
                      + (1 - b) * F.kl_div(mixture, student, reduction="none", log_target=True))
    return divergence.sum(dim=-1)


# The teacher's top-k log-probabilities are kept in this dtype, live or cached (data/teacher_cache.py),
# so a run that reads the cache computes the loss from the very numbers a live teacher gives.
TOP_K_DTYPE = torch.float16


def top_k(teacher_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [..., k], log-probabilities [..., k]) of the teacher's k most likely tokens per position,
    at temperature 1 over the whole vocabulary, most likely first."""
    logprobs, ids = F.log_softmax(teacher_logits.float(), dim=-1).topk(k, dim=-1)
    return ids, logprobs.to(TOP_K_DTYPE)


def per_token_top_k(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
                    beta: float, temperature: float) -> torch.Tensor:
    """`per_token` over the teacher's top-k ids alone: both distributions renormalised over those k
    (the student's logits gathered at the teacher's ids; the teacher's log-probabilities, divided by
    the temperature, taken to a softmax over k as its logits would be). The mass outside the top-k
    is dropped from both, so every divergence, forward, reverse or JSD, stays one between two
    distributions."""
    student = student_logits.float().gather(-1, teacher_ids)
    return per_token(student, teacher_logprobs.float(), beta, temperature)
