"""The recipe's sections of the schema: `optim.*` (which optimizer, its learning rate, weight
decay and the rest) and `scheduler.*` (the learning-rate schedule)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from overdrive.config.sections import Section


class OptimConfig(Section):
    """The optimizer: its name (or import path), learning rate and weight decay."""

    name: Literal["adamw", "adam", "sgd", "adafactor", "muon", "lion", "schedule_free_adamw", "adamw_8bit",
                  "deepspeed"] = Field(
        "adamw", description="Optimizer. `adamw` (decoupled weight decay), `adam`, `sgd` (`optim.momentum`, "
        "`optim.nesterov`), `adafactor` (torch's, factored second moments), `muon` (torch's Muon on the hidden "
        "2-D matrices at `optim.muon_lr`, AdamW at `optim.lr` on the rest), `lion` (lion-pytorch), "
        "`schedule_free_adamw` (schedulefree; pair it with `scheduler.name=constant`), `adamw_8bit` "
        "(bitsandbytes), `deepspeed` (the `optimizer` block of a DeepSpeed JSON, built by DeepSpeed). "
        "`optim.class_path` names any other."
    )
    class_path: Optional[str] = Field(
        None, description="Import path of any torch optimizer class (`torch.optim.RAdam`, `mypkg.opt.MyOpt`), "
        "built with the parameter groups, `optim.lr` and `optim.kwargs`. Used instead of `optim.name`."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="More keyword arguments for the optimizer's constructor, checked "
        "against its signature when the config loads."
    )
    lr: float = Field(2e-3, gt=0.0, description="Peak learning rate.")
    weight_decay: float = Field(0.01, ge=0.0, description="Weight decay, applied to matrices and embeddings only "
                                "(never to biases and norms), for every optimizer.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam beta1, beta2 (also Lion's and the "
                                       "schedule-free and 8-bit AdamW's; Muon's AdamW part).")
    eps: float = Field(1e-8, gt=0.0, description="Adam epsilon.")
    momentum: Optional[float] = Field(
        None, ge=0.0, lt=1.0, description="SGD and Muon momentum. Empty: 0.9 for SGD, 0.95 for Muon."
    )
    nesterov: Optional[bool] = Field(None, description="Nesterov momentum (SGD, Muon). Empty: off for SGD, on for Muon.")
    muon_lr: float = Field(0.02, gt=0.0, description="Muon's learning rate for the hidden matrices "
                           "(`optim.lr` is the AdamW part's).")
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = Field(
        "auto", description="Kernel (torch AdamW, Adam, SGD): `auto` takes fused where the device supports it, "
        "else foreach."
    )


class SchedulerConfig(Section):
    """Learning-rate schedule, counted in optimizer steps."""

    name: Literal["constant", "linear", "cosine", "wsd", "polynomial", "inverse_sqrt", "cosine_with_restarts"] = Field(
        "cosine", description="Decay after warmup: `constant`; `linear` to 0; `cosine` to `min_lr_ratio`; `wsd` "
        "(warmup, stable, then decay over the last `decay_fraction` of the steps to `min_lr_ratio`); `polynomial` "
        "(power `power`) to `min_lr_ratio`; `inverse_sqrt`; `cosine_with_restarts` (`num_cycles` hard restarts); "
        "the last four from Transformers' schedules."
    )
    warmup_steps: int = Field(40, ge=0, description="Optimizer steps of linear warmup from 0 to `optim.lr`. Left unset, "
                              "40 capped at a tenth of `training.max_steps` (a 20-step run warms up for 2).")
    warmup_ratio: Optional[float] = Field(
        None, ge=0.0, le=1.0, description="Warmup as a fraction of the run's steps: ceil(ratio x steps), as "
        "Transformers counts it. Of `warmup_steps` and `warmup_ratio` the one set in the later layer wins. Empty: "
        "`warmup_steps`."
    )
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final lr as a fraction of `optim.lr` (cosine, "
                                "wsd, polynomial, cosine_with_restarts; the floor of inverse_sqrt).")
    decay_fraction: float = Field(0.1, gt=0.0, le=1.0, description="wsd: fraction of the steps after warmup spent "
                                  "decaying.")
    decay_type: Literal["cosine", "linear", "1-sqrt"] = Field("cosine", description="wsd: the shape of the decay.")
    power: float = Field(1.0, gt=0.0, description="polynomial: the power of the decay.")
    num_cycles: int = Field(1, ge=1, description="cosine_with_restarts: cosine cycles (hard restarts) after warmup.")
