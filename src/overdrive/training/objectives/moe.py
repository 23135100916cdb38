"""The router's load-balancing loss of a mixture-of-experts model, in the loss the loop optimises,
and the per-expert load in metrics.jsonl.

What is added. Transformers' `load_balancing_loss_func` (Switch Transformer eq. 4-6): over a
set of tokens and every MoE layer, E x sum_e f_e x P_e, where f_e is the share of the top-k
assignments expert e got (no gradient) and P_e its mean router probability. The loss optimised
is the global token-mean cross entropy (step_loss.py) + coef x that statistic, coef the config's
`router_aux_loss_coef` or `model.moe.aux_loss_coef`.

How it scales whatever the split. The statistic is a product of two means, so it is not a sum
over tokens: the cross entropy's rule (sum, then divide by the global count) does not apply, and
taken per micro-batch (as the model does with `output_router_logits=True`) it changes with the
micro-batch size. `model.moe.aux_loss_scope`:

    sequence      each row's own statistic; the term is their mean over the global batch's rows:
                  sum over this micro-batch's rows / the global row count (a second term of the
                  objective, counted in the step's one all-reduce beside the token count). Any split (4x1 = 2x2 = 2 ranks x 2) gives the
                  same loss and gradient. A micro-batch of one row is exactly the model's own.
    micro_batch   the model's own statistic over each micro-batch's tokens, averaged over the
                  global batch's micro-batches (/ accumulation x data-parallel ranks). One
                  micro-batch per step is exactly the model's own loss; other splits differ.

How the statistic is taken. A forward hook on each router module (the class Transformers
records `router_logits` from, `_can_record_outputs`) keeps its logits; a pre-hook on the model
clears them and calls it with `output_router_logits=False` (unless the caller passes it), so the
model adds no balance term of its own to the summed cross entropy, whatever its config says. Gradient checkpointing's recomputation in backward adds
logits after they were read; the next forward clears them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from overdrive.config.schema import RunConfig
from overdrive.config import experts as moe_rules
from overdrive.training.objectives.objective import Objective


def _router_class(module: Any) -> Optional[tuple[type, int]]:
    recorders = getattr(type(module), "_can_record_outputs", None) or {}
    recorder = recorders.get("router_logits") if isinstance(recorders, dict) else None
    target = getattr(recorder, "target_class", None)
    return (target, int(getattr(recorder, "index", 0) or 0)) if target is not None else None


def _causal_lm(model: Any) -> Optional[tuple[Any, type, int]]:
    """The Transformers model inside `model` (a PEFT wrapper's base too) and its router class."""
    for module in model.modules():
        found = _router_class(module)
        if found is not None:
            return module, *found
    return None


def attach(cfg: RunConfig, model: Any, accelerator: Any) -> Optional["RouterBalance"]:
    """The balance loss of a mixture-of-experts causal LM, hooked into `model` (before it is wrapped);
    None for a dense model, another task, or preference training (whose loss is the method's alone)."""
    experts = moe_rules.experts_of(model.config)
    found = _causal_lm(model)
    if experts is None or found is None or cfg.model.task != "causal-lm" or cfg.preference.method != "none":
        return None
    return RouterBalance(found[0], found[1], found[2], experts, cfg.model.moe.aux_loss_scope, accelerator.device)


class RouterBalance:
    """Router logits caught in the forward, turned into a micro-batch's summed balance statistic."""

    def __init__(self, model: Any, router: type, index: int, experts: moe_rules.Experts, scope: str,
                 device: torch.device):
        self.experts, self.scope, self.coef = experts, scope, experts.aux_loss_coef
        self.logits: list[torch.Tensor] = []
        self.routers = [m for m in model.modules() if isinstance(m, router)]
        for module in self.routers:
            module.register_forward_hook(lambda _m, _i, out: self.logits.append(out[index] if isinstance(out, tuple)
                                                                                else out))
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self.aux_sum = torch.zeros((), device=device)  # the statistic summed over its units, since the last read
        self.aux_units = torch.zeros((), device=device)
        self.load = torch.zeros(len(self.routers), experts.experts, device=device)  # tokens per layer and expert

    def _before_forward(self, _module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.logits.clear()
        return args, {"output_router_logits": False, **kwargs}  # a caller that asks for them still gets them

    def units(self, batch: Any) -> torch.Tensor:
        """What the term is a mean over: the global batch's rows (`sequence`), or its micro-batches."""
        ids = batch["input_ids"]
        return torch.full((), ids.shape[0] if self.scope == "sequence" else 1, dtype=torch.long, device=ids.device)

    def summed(self, batch: Any) -> torch.Tensor:
        """This micro-batch's statistic summed over its units (read after its forward), unscaled."""
        layers = self.logits[: len(self.routers)]
        rows = batch["input_ids"].shape[0]
        mask = batch.get("attention_mask")
        mask = (torch.ones(batch["input_ids"].shape, device=layers[0].device) if mask is None
                else mask.to(layers[0].device)).float()
        statistic = balance_statistic(layers, mask.reshape(rows, -1), self.experts.experts, self.experts.top_k,
                                      per_row=self.scope == "sequence", load=self.load).sum()
        self.aux_sum += statistic.detach()
        self.aux_units += self.units(batch).to(self.aux_units.device)
        return statistic

    def read(self, accelerator: Any, sharing: int) -> dict[str, Any]:
        """`aux_loss` (the statistic, unscaled, its mean over the units since the last log), tokens per
        expert (summed over layers) and the imbalance (the busiest expert's tokens over the mean, the worst
        layer) since the last log."""
        sums = torch.stack([self.aux_sum, self.aux_units])
        sums = accelerator.reduce(sums.clone(), "sum") if accelerator.num_processes > 1 else sums
        load = accelerator.reduce(self.load.clone(), "sum") if accelerator.num_processes > 1 else self.load
        load = load / max(sharing, 1)
        mean = load.mean(dim=1).clamp(min=1e-9)
        record = {"aux_loss": (sums[0] / sums[1].clamp(min=1)).item(),
                  "aux_loss_coef": self.coef,
                  "expert_tokens": [round(v) for v in load.sum(dim=0).tolist()],
                  "expert_imbalance": (load.max(dim=1).values / mean).max().item()}
        self.aux_sum.zero_()
        self.aux_units.zero_()
        self.load.zero_()
        return record


class BalancedObjective(Objective):
    """An objective with the router's balance term as one more term of its loss (step_loss.py):
    coef x the statistic, over its own units (rows or micro-batches) of the global batch."""

    def __init__(self, inner: Objective, balance: RouterBalance, accelerator: Any, sharing: int):
        self.inner, self.balance, self.accelerator, self.sharing = inner, balance, accelerator, sharing
        self.name, self.spike_measure = inner.name, inner.spike_measure

    def counts(self, batch: dict) -> torch.Tensor:
        return torch.cat([self.inner.counts(batch).reshape(-1), self.balance.units(batch).reshape(1)])

    def sums(self, model: Any, batch: dict) -> torch.Tensor:
        main = self.inner.sums(model, batch).reshape(-1)  # its forward records the router logits
        return torch.cat([main, (self.balance.coef * self.balance.summed(batch)).reshape(1).to(main.dtype)])

    def prepare(self, model: Any, micro_batches: list) -> list:
        return self.inner.prepare(model, micro_batches)

    def read(self) -> dict[str, Any]:
        return {**self.inner.read(), **self.balance.read(self.accelerator, self.sharing)}

    def corrupt(self, batch: dict, generator: torch.Generator) -> dict:
        return self.inner.corrupt(batch, generator)

    def snapshot(self) -> Any:
        b = self.balance
        return self.inner.snapshot(), b.aux_sum.clone(), b.aux_units.clone(), b.load.clone()

    def rewind(self, snapshot: Any) -> None:
        inner, *sums = snapshot
        self.inner.rewind(inner)
        for kept, now in zip(sums, (self.balance.aux_sum, self.balance.aux_units, self.balance.load)):
            now.copy_(kept)

    def resplit(self, micro: int) -> None:
        self.inner.resplit(micro)

    def pending(self) -> Optional[list]:
        return self.inner.pending()

    def restore(self, pending: Optional[list]) -> None:
        self.inner.restore(pending)

    def evaluate(self, model: Any, loader: Any, accelerator: Any) -> dict[str, float]:
        return self.inner.evaluate(model, loader, accelerator)


def balance_statistic(layers: list[torch.Tensor], mask: torch.Tensor, experts: int, top_k: int,
                      per_row: bool, load: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Transformers' `load_balancing_loss_func` on router logits ([rows x positions, experts] per
    layer) with the attention mask ([rows, positions]): one value per row (`per_row`), else one for
    all of them (exactly the model's). `load` gathers the masked top-k assignments per layer and expert."""
    rows = mask.shape[0]
    assigned = torch.zeros(rows, experts, device=mask.device)
    probability = torch.zeros(rows, experts, device=mask.device)
    tokens = torch.zeros(rows, device=mask.device)
    for i, logits in enumerate(layers):
        weights = torch.softmax(logits.to(mask.device), dim=-1)  # in the logits' dtype, as the model does
        _, chosen = torch.topk(weights, top_k, dim=-1)
        counts = torch.nn.functional.one_hot(chosen, experts).sum(dim=-2).float().reshape(rows, -1, experts)
        counts = counts * mask.unsqueeze(-1)
        assigned = assigned + counts.sum(dim=1)
        probability = probability + (weights.float().reshape(rows, -1, experts) * mask.unsqueeze(-1)).sum(dim=1)
        tokens = tokens + mask.sum(dim=1)
        if load is not None:
            load[i] += counts.detach().sum(dim=(0, 1))
    if not per_row:
        assigned, probability, tokens = assigned.sum(0, keepdim=True), probability.sum(0, keepdim=True), tokens.sum().reshape(1)
    tokens = tokens.clamp(min=1.0).unsqueeze(-1)  # a row with no token: 0, not 0/0
    return experts * ((assigned / tokens) * (probability / tokens)).sum(dim=-1)


def idle_params(model: Any) -> tuple[int, int]:
    """(all, frozen) expert parameters a token is not routed to: taken off N in 6N FLOPs per token."""
    experts = moe_rules.experts_of(getattr(model, "config", None))
    if experts is None:
        return 0, 0
    named = [(name, getattr(p, "ds_numel", None) or p.numel(), p.requires_grad) for name, p in model.named_parameters()]
    idle = 1.0 - experts.active_fraction
    return (round(moe_rules.expert_params((n, k) for n, k, _ in named) * idle),
            round(moe_rules.expert_params((n, k) for n, k, trained in named if not trained) * idle))


def adapter_note(model: Any) -> list[str]:
    """An adapter on a mixture of experts: which parts got one, and their trainable parameters."""
    base = getattr(model, "get_base_model", lambda: model)()
    if moe_rules.experts_of(getattr(base, "config", None)) is None:
        return []
    counts: dict[str, int] = {}
    for name, param in model.named_parameters():
        if param.requires_grad and ".lora_" in name:
            group = moe_rules.adapter_group(name)
            counts[group] = counts.get(group, 0) + param.numel()
    said = ", ".join(f"{group} {counts[group]:,}" for group in ("attention", "experts", "router", "other") if group in counts)
    return [f"LoRA on a mixture of experts, trainable parameters by part: {said or 'none'}. peft.target_modules "
            "chooses them (PEFT maps the names onto Transformers' stacked experts): q_proj,k_proj,v_proj,o_proj for "
            "attention, gate_proj,up_proj,down_proj for the experts, gate for the router; all-linear takes all three"]


def mapped_expert_names(model: Any) -> dict[str, str]:
    """Names `peft.target_modules` may give that are no module of a Transformers 5 mixture of experts:
    the per-expert projections (and the router's Linear) of the Transformers 4 layout, which PEFT maps
    onto the stacked experts' parameters (`gate_proj` -> `gate_up_proj`). Empty where PEFT maps none."""
    try:  # PEFT's table, shared with Transformers' weight conversion
        from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING
    except ImportError:
        return {}
    base = _MODEL_TO_CONVERSION_PATTERN.get(getattr(getattr(model, "config", None), "model_type", None))
    return dict(_MOE_TARGET_MODULE_MAPPING.get(base, {}))
