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
