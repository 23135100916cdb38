"""`model.moe.*`: a mixture-of-experts model's router, as the run trains it.

The values override the Transformers config's own (`router_aux_loss_coef`,
`num_experts_per_tok`); empty keeps the model's. The router's load-balancing loss is the
model's own statistic (Transformers' `load_balancing_loss_func`, Switch Transformer eq. 4-6),
added to the loss the loop optimises (training/objectives/moe.py); `aux_loss_scope` says over which
tokens it is taken, and so whether the split of the global batch changes it.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from overdrive.config.sections import Section


class MoeConfig(Section):
    """The router of a mixture-of-experts model (Qwen3-MoE, Mixtral, ...); ignored by a dense model."""

    aux_loss_coef: Optional[float] = Field(
        None, ge=0.0, description="Weight of the router's load-balancing loss in the loss optimised. Empty: the "
        "model config's `router_aux_loss_coef` (0.001 for Qwen3-MoE, 0.02 for Mixtral); 0 trains without it (the "
        "per-expert load is still logged)."
    )
    aux_loss_scope: Literal["sequence", "micro_batch"] = Field(
        "sequence", description="Tokens the balance statistic is taken over. `sequence`: each row's own, averaged "
        "over the rows of the global batch, so any split (micro-batch x accumulation x ranks) gives the same loss "
        "and gradient (DeepSeek-V3's sequence-wise balance loss, with the model's formula). `micro_batch`: over "
        "each micro-batch's tokens as Transformers computes it in `model(..., output_router_logits=True)`, averaged "
        "over the micro-batches; it changes with the micro-batch size."
    )
    top_k: Optional[int] = Field(
        None, ge=1, description="Experts each token is routed to (the config's `num_experts_per_tok`). Empty: the "
        "model's. Active parameters, FLOPs and MFU follow it."
    )
