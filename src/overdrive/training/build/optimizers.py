"""The optimizer a run config names, built over the parameter groups (optimization.param_groups).

Every optimizer gets the same weight-decay rule: matrices and embeddings decay, biases and norm
scales do not. What each name is (its class, state, whether it is elementwise) is described in
config/optimizer_catalog.py; this module imports the classes and builds them.

Muon, as its authors prescribe, orthogonalises only the hidden 2-D matrices (inside the
transformer blocks); the embeddings, the output head and every vector go to AdamW at
`optim.lr`. The two run as one optimizer (`MuonWithAdamW`) so Accelerate, the schedule and
checkpoints see one object.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from overdrive.config.schema import RunConfig
from overdrive.strategies import expert_parallel
import overdrive.config.optimizer_catalog as optimizer_catalog
from overdrive.config.optimizer_classes import import_class, optimizer_class  # noqa: F401 (asked here too)
from overdrive.training.build.optimization import adamw_kernel, full_ndim, make_scheduler, param_groups

def _accepts(cls, name: str) -> bool:
    parameters = inspect.signature(cls.__init__).parameters
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def hidden_matrices(model: torch.nn.Module) -> set[int]:
    """ids of the 2-D parameters inside the model's body: not embeddings, not the head.

    The head (lm_head, score, classifier) lives outside `model.base_model`; embeddings are
    nn.Embedding modules (a tied lm_head is the token embedding itself)."""
    body = getattr(model, "base_model", model)
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    return {id(p) for p in body.parameters() if p.requires_grad and full_ndim(p) == 2 and id(p) not in embeddings}


class MuonWithAdamW(torch.optim.Optimizer):
    """torch's Muon on the hidden matrices and AdamW on the rest, stepped as one optimizer.

    `param_groups` are the two optimizers' own group dicts, so a schedule scaling them scales
    both (Muon's `optim.muon_lr` and AdamW's `optim.lr` by the same factor)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.parts = [muon, adamw]
        super().__init__([p for g in muon.param_groups + adamw.param_groups for p in g["params"]],
                         {"lr": adamw.defaults["lr"]})
        self.param_groups = muon.param_groups + adamw.param_groups  # the parts' own dicts, not copies

    @property
    def state(self):  # read by checkpoint and telemetry code: both parts' states
        merged = {}
        for part in getattr(self, "parts", []):
            merged.update(part.state)
        return merged

    @state.setter
    def state(self, value):  # Optimizer.__init__ assigns an empty one; the parts keep theirs
        pass

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state_dict):
        for part, saved in zip(self.parts, state_dict["parts"]):
            part.load_state_dict(saved)


def _muon(model, cfg: RunConfig, kernel: dict) -> MuonWithAdamW:
    o = cfg.optim
    hidden = hidden_matrices(model)
    matrices = [p for p in model.parameters() if id(p) in hidden]
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in hidden]
    muon = torch.optim.Muon(matrices, lr=o.muon_lr, weight_decay=o.weight_decay,
                            momentum=0.95 if o.momentum is None else o.momentum,
                            nesterov=True if o.nesterov is None else o.nesterov, **o.kwargs)
    groups = [{"params": [p for p in rest if full_ndim(p) >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in rest if full_ndim(p) < 2], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=o.lr, betas=tuple(o.betas), eps=o.eps, **kernel)
    return MuonWithAdamW(muon, adamw)


def _sees_shards(cfg: RunConfig) -> bool:
    from overdrive.strategies import registry

    return registry.of(cfg).optimizer_sees(cfg) == "shards"


def _deepspeed_cpu_lion(cfg: RunConfig) -> bool:
    from overdrive.strategies import registry
    from overdrive.strategies.deepspeed import cpu_optimizer_available

    strategy = registry.of(cfg)
    return (strategy.deepspeed_config and strategy.sharding(cfg).offload_optimizer_state
            and cpu_optimizer_available("CPULionBuilder"))


def build_optimizer(model: torch.nn.Module, cfg: RunConfig, device_type: str):
    """The run's optimizer over `model`'s trainable parameters (before accelerator.prepare)."""
    optimizer = _built(model, cfg, device_type)
    for part in getattr(optimizer, "parts", [optimizer]):
        if isinstance(part, torch.optim.Optimizer):
            part.register_load_state_dict_pre_hook(_keep_own_kernel)
    return optimizer


# Options of a param group that choose an implementation, not a value of the run.
KERNEL_OPTIONS = ("fused", "foreach", "capturable", "differentiable")


def _keep_own_kernel(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A checkpoint's param groups keep this optimizer's kernel: `load_state_dict` would otherwise
    bring back the saving run's (fused on one device, for-loop under expert parallel x FSDP2), and
    with it a step this run cannot take."""
    groups = []
    for saved, own in zip(state_dict["param_groups"], optimizer.param_groups):
        groups.append({**saved, **{k: own[k] for k in KERNEL_OPTIONS if k in own}})
    return {**state_dict, "param_groups": groups + state_dict["param_groups"][len(groups):]}


def _built(model: torch.nn.Module, cfg: RunConfig, device_type: str):
    o = cfg.optim
    name = "class_path" if o.class_path else o.name
    groups = param_groups(model, o.weight_decay)
    kernel = adamw_kernel(o.implementation, device_type)
    if expert_parallel.beside_shards(cfg):  # one tensor at a time: fused and foreach take one kind per call
        kernel = {"fused": False, "foreach": False}
    adam_like = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps}
    if name == "adamw":
        return torch.optim.AdamW(groups, **adam_like, **kernel, **o.kwargs)
    if name == "adam":
        return torch.optim.Adam(groups, **adam_like, **kernel, **o.kwargs)
    if name == "sgd":
        if kernel["fused"] and _sees_shards(cfg):  # aten._fused_sgd_ has no DTensor rule (torch 2.13)
            kernel = {"fused": False, "foreach": True}
        return torch.optim.SGD(groups, lr=o.lr, momentum=0.9 if o.momentum is None else o.momentum,
                               nesterov=bool(o.nesterov), **kernel, **o.kwargs)
    if name == "adafactor":
        return torch.optim.Adafactor(groups, lr=o.lr, foreach=kernel["foreach"] or None, **o.kwargs)
    if name == "muon":
        return _muon(model, cfg, kernel)
    if name == "deepspeed":
        from accelerate.utils import DummyOptim

        return DummyOptim(groups, lr=o.lr, weight_decay=o.weight_decay)
    cls = optimizer_class(cfg)
    if name == "lion":
        if _deepspeed_cpu_lion(cfg):  # ZeRO-Offload: DeepSpeed's own CPU kernel, the same update
            from deepspeed.ops.lion import DeepSpeedCPULion

            return DeepSpeedCPULion(groups, lr=o.lr, betas=tuple(o.betas), **o.kwargs)
        return cls(groups, lr=o.lr, betas=tuple(o.betas), **o.kwargs)
    if name == "schedule_free_adamw":
        # Its own warm-up replaces the schedule's (build_schedule gives it a flat one).
        return cls(groups, **adam_like, warmup_steps=cfg.scheduler.warmup_steps, **o.kwargs)
    if name == "adamw_8bit":
        return cls(groups, **adam_like, **o.kwargs)
    if not _accepts(cls, "weight_decay"):  # an optimizer without decay: one group, no decay key
        groups = [{"params": [p for g in groups for p in g["params"]]}]
    return cls(groups, lr=o.lr, **o.kwargs)


def build_schedule(optimizer, cfg: RunConfig):
    """The learning-rate schedule over `optimizer`. Schedule-free AdamW needs none (it warms up
    itself): it gets a flat factor of 1, so the loop and the logs stay the same."""
    s, steps = cfg.scheduler, cfg.training.max_steps
    if optimizer_catalog.of(cfg).name == "deepspeed":
        return None  # DeepSpeed builds the optimizer in prepare(): see schedule_after_prepare
    if optimizer_catalog.of(cfg).name == "schedule_free_adamw":
        return make_scheduler(optimizer, "constant", 0, steps, 1.0)
    return make_scheduler(optimizer, s.name, s.warmup_steps, steps, s.min_lr_ratio, s)


def schedule_after_prepare(accelerator, cfg: RunConfig):
    """The schedule over the optimizer DeepSpeed built from the JSON block (`optim.name=deepspeed`):
    its basic optimizer, whose param_groups ZeRO reads the lr from at every step."""
    engine = accelerator.deepspeed_engine_wrapped.engine
    return build_schedule(engine.basic_optimizer, cfg.model_copy(update={"optim": cfg.optim.model_copy(
        update={"name": "adamw"})}))


def set_mode(optimizer, mode: str) -> None:
    """Schedule-free optimizers keep two points: `train` before training steps, `eval` before
    evaluating or saving (their docs require it). Other optimizers have no modes."""
    target: Optional[Any] = optimizer
    for _ in range(3):  # AcceleratedOptimizer -> (DeepSpeed wrapper) -> the optimizer itself
        if target is None:
            return
        method = getattr(target, mode, None)
        if callable(method) and hasattr(target, "param_groups") and "train_mode" in target.param_groups[0]:
            method()
            return
        target = getattr(target, "optimizer", None)
