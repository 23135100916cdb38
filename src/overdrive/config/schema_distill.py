"""`distill.*`: a student taught by a teacher's token distributions (knowledge distillation).

The names and meanings are TRL's GKDConfig's, so a TRL user finds the knob they know: `beta`
(the generalised Jensen-Shannon interpolation: 0 = forward KL, 1 = reverse KL), `temperature`
(both logits divided by it, no T^2 factor, as TRL's `generalized_jsd_loss`), `lmbda` (the share of
on-policy batches). `alpha` adds the data's own cross entropy beside the divergence. The loss is
training/objectives/distill_loss.py's, checked against TRL's function (docs/distillation.md).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from overdrive.config.sections import Section

# distill.loss -> the beta TRL's function takes for it (jsd: distill.beta, 0.5 when unset).
FIXED_BETA = {"forward_kl": 0.0, "reverse_kl": 1.0}
JSD_BETA = 0.5


class DistillConfig(Section):
    """Off-policy logit distillation: the teacher scores the data's tokens, the student learns its
    distributions (docs/distillation.md)."""

    teacher: Optional[str] = Field(
        None, description="The teacher: a save_pretrained directory or a hub name of a causal LM with the same "
        "tokenizer as the student (checked from its config and tokenizer before anything launches). Frozen, in "
        "eval mode, never given gradients. Empty: no distillation."
    )
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
        "jsd", description="The divergence per token (TRL's `generalized_jsd_loss`): `forward_kl`: KL(teacher || "
        "student), mode covering (beta 0); `reverse_kl`: KL(student || teacher), mode seeking (beta 1); `jsd`: the "
        "generalised Jensen-Shannon divergence at `distill.beta` (GKD's default, 0.5)."
    )
    beta: Optional[float] = Field(
        None, ge=0.0, le=1.0, description="GKD's interpolation, TRL's meaning: 0 = forward KL, 1 = reverse KL, "
        "between them the generalised JSD with mixture beta x teacher + (1 - beta) x student. Empty: 0 for "
        "forward_kl, 1 for reverse_kl, 0.5 for jsd; a value that contradicts `distill.loss` is refused."
    )
    temperature: float = Field(
        1.0, gt=0.0, description="Both the student's and the teacher's logits are divided by it before the "
        "softmax (no T^2 factor on the loss, as TRL's function). Above 1 softens both distributions."
    )
    alpha: float = Field(
        0.0, ge=0.0, le=1.0, description="The share of the data's own cross entropy in the loss: alpha x cross "
        "entropy + (1 - alpha) x divergence, both per loss token of the global batch. 0: the divergence alone "
        "(TRL's GKD)."
    )
    lmbda: float = Field(
        0.0, ge=0.0, le=1.0, description="The share of on-policy steps (TRL GKD's meaning; TRL's default 0.5): "
        "each step, with this probability, the student samples the completions of the batch's prompts (chat: the "
        "turns before the last assistant turn; text: the first half of each row) and the teacher scores what it "
        "sampled; the sampled tokens are in the loss, the prompt's are not. Drawn from training.seed and the step, "
        "so every rank and a resumed run agree. 0: off-policy (the data's own tokens)."
    )
    max_new_tokens: int = Field(
        128, gt=0, description="On-policy steps (distill.lmbda > 0): the most tokens the student samples after a "
        "prompt (TRL GKD's max_new_tokens), never past data.max_length."
    )
    top_k: int = Field(
        0, ge=0, description="Keep only the teacher's k most likely tokens per position (their log-probabilities "
        "at temperature 1), both distributions renormalised over those k. With distill.lmbda 0 they can be "
        "computed once by `overdrive distill-cache` and read by later runs without loading the teacher. 0: the "
        "whole vocabulary."
    )


def effective_beta(d: DistillConfig) -> float:
    """The beta TRL's function is given for this config (`distill.loss` with `distill.beta`)."""
    if d.loss in FIXED_BETA:
        return FIXED_BETA[d.loss]
    return JSD_BETA if d.beta is None else d.beta
