"""A mixture-of-experts model as Transformers describes it: how many experts, how many a token
uses, which parameters are experts, and so how many parameters one token meets (the active ones).

One rule (config/, so every floor asks it) for the model that trains (training/objectives/moe.py: the router's loss, FLOPs and MFU) and for
the estimator (memory/: total and active parameters, expert weights per expert-parallel rank).
Pure: it reads a config's attributes and parameter names, imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

from overdrive.config.schema_moe import MoeConfig
from overdrive.errors import Problem, UserError

# The config attribute naming the routed experts, by family: Qwen2/3-MoE, Mixtral, GPT-OSS and
# Llama 4, DeepSeek-V2/V3.
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class Experts:
    """What a Transformers config says of its experts."""

    experts: int
    """Routed experts per MoE layer (shared experts, which every token uses, are not counted)."""
    top_k: int
    """Experts each token is routed to."""
    aux_loss_coef: float
    """The config's `router_aux_loss_coef` (0 where the family has none)."""

    @property
    def active_fraction(self) -> float:
        return min(self.top_k / self.experts, 1.0)


def experts_of(config: Any) -> Optional[Experts]:
    """The experts of a Transformers config (its text config for a multimodal one); None: dense."""
    config = getattr(config, "text_config", None) or config
    count = next((getattr(config, name) for name in _EXPERT_COUNTS if isinstance(getattr(config, name, None), int)), 0)
    top_k = getattr(config, "num_experts_per_tok", None)
    if count < 2 or not isinstance(top_k, int) or top_k < 1:
        return None
    return Experts(count, top_k, float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0))


def is_expert_parameter(name: str) -> bool:
    """A routed expert's weight: a path segment named `experts` (Transformers 5's stacked
    `experts.gate_up_proj`, or an older `experts.3.w1.weight`), never `shared_experts`/`shared_expert`."""
    return "experts" in name.split(".")


def expert_params(named: Iterable[tuple[str, int]]) -> int:
    """Parameters of the routed experts among (name, numel) pairs."""
    return sum(n for name, n in named if is_expert_parameter(name))


def inactive_params(named: Iterable[tuple[str, int]], config: Any) -> int:
    """Expert parameters a token does not meet: all experts' x (1 - top_k / experts). 0 for a dense model.
    Active parameters = total - this; training FLOPs per token are 6 x active (PaLM's 6N, N the active)."""
    found = experts_of(config)
    if found is None:
        return 0
    return round(expert_params(named) * (1.0 - found.active_fraction))


def apply_overrides(moe: MoeConfig, config: Any) -> None:
    """`model.moe.top_k` and `model.moe.aux_loss_coef` written into the Transformers config the run
    builds (the model that trains and the estimator read the same); refused by key on a dense model."""
    if moe.top_k is None and moe.aux_loss_coef is None:
        return
    found = experts_of(config)
    key = "model.moe.top_k" if moe.top_k is not None else "model.moe.aux_loss_coef"
    if found is None:
        raise UserError(Problem(key, f"the model ({getattr(config, 'model_type', '?')}) has no routed experts",
                                fix=f"remove {key}: it applies to mixture-of-experts models (Qwen3-MoE, Mixtral, ...)"))
    target = getattr(config, "text_config", None) or config
    if moe.top_k is not None:
        if moe.top_k > found.experts:
            raise UserError(Problem("model.moe.top_k", f"{moe.top_k} is more than the model's {found.experts} experts",
                                    fix=f"set model.moe.top_k <= {found.experts}"))
        target.num_experts_per_tok = moe.top_k
    if moe.aux_loss_coef is not None:
        target.router_aux_loss_coef = moe.aux_loss_coef


def qlora_problems(peft_method: str, config: Any) -> list[Problem]:
    """QLoRA of a mixture of experts: bitsandbytes quantizes `nn.Linear` layers, and Transformers 5
    stacks each layer's routed experts in one tensor, which it leaves at full precision; those are
    most of the weights, so the quantized base would not be the memory QLoRA promises."""
    if peft_method != "qlora" or experts_of(config) is None:
        return []
    return [Problem("peft.method", f"qlora quantizes linear layers only; the {getattr(config, 'model_type', '?')} "
                    "model's routed experts are stacked tensors bitsandbytes cannot quantize, and they are most of "
                    "its weights", fix="use peft.method=lora (the base in bf16: model.dtype=bfloat16)")]


def adapter_group(name: str) -> str:
    """Which part of a mixture of experts a LoRA parameter adapts: `experts`, `router`, `attention`, or
    `other` (dense MLPs, shared experts). PEFT puts `lora_` after the adapted module's own path."""
    path = name.split(".lora_")[0].replace(".base_layer", "").split(".")
    if "experts" in path:
        return "experts"
    if path[-1] in ("gate", "router") or path[-1].endswith("_router"):
        return "router"
    if any(part in ("self_attn", "attention", "attn", "self_attention") for part in path):
        return "attention"
    return "other"
