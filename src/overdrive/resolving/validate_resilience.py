"""Where `training.oom_retry`, `training.loss_spike` and `checkpoint.async` can work, judged
before anything launches (what each does: training/guards/oom_retry.py, training/guards/loss_spikes.py,
checkpoint/background.py)."""

from __future__ import annotations

from typing import Callable

from overdrive.config.schema import RunConfig
from overdrive.errors import Problem
from overdrive.strategies import registry

Where = Callable[[str], str]


def resilience_rules(cfg: RunConfig, where: Where) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings) of the three keys against the strategy and layout."""
    errors: list[Problem] = []
    warnings: list[Problem] = []
    strategy, p = registry.of(cfg), cfg.parallel
    model_parallel = max(p.tp_size, p.cp_size, p.sp_size, p.pp_size) > 1
    if cfg.training.oom_retry:
        # The ranks agree just before each backward; a forward that itself gathers parameters or
        # exchanges activations would leave the other ranks inside that collective.
        if strategy.engine_steps_optimizer or not strategy.holds_whole_model(cfg) or model_parallel:
            errors.append(Problem("training.oom_retry", f"cannot redo a step under {strategy.label(cfg)}"
                                  + (" with tensor, context or pipeline parallel" if model_parallel else "")
                                  + ": a rank out of memory would leave the others inside a collective of the forward",
                                  where("training.oom_retry"),
                                  "use it with plain data parallel (parallel.strategy=ddp), or instead set "
                                  "training.oom_retry=false with training.micro_batch_size=auto to find what fits "
                                  "before step 1"))
    if cfg.training.loss_spike.factor is not None:
        if strategy.engine_steps_optimizer or p.pp_size > 1:
            errors.append(Problem("training.loss_spike.factor", "a spike cannot be kept out of the weights here: "
                                  + ("DeepSpeed steps its optimizer inside backward" if strategy.engine_steps_optimizer
                                     else "the pipeline schedule steps inside its own loop"),
                                  where("training.loss_spike.factor"), "leave training.loss_spike.factor empty"))
        elif cfg.precision.mixed_precision == "fp16":
            errors.append(Problem("training.loss_spike.factor", "a skipped step under fp16 would leave the loss "
                                  "scaler without its update", where("training.loss_spike.factor"),
                                  "use precision.mixed_precision=bf16, or leave training.loss_spike.factor empty"))
    if getattr(cfg.checkpoint, "async") and not strategy.saves_through_dcp(cfg):
        # Never accepted with no effect: the checkpoints would be written in the step all the same.
        errors.append(Problem("checkpoint.async", f"{strategy.label(cfg)} does not save through DCP: its "
                              "checkpoints would stay synchronous", where("checkpoint.async"),
                              "set checkpoint.async=false, or parallel.strategy=fsdp with "
                              "parallel.fsdp.state_dict_type=sharded_state_dict to save in the background"))
    return errors, warnings
