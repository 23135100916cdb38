"""What each strategy is, described once, for the rest of overdrive to ask.

Code outside strategies/ asks the description of the run's strategy (`of(cfg)`) what it needs
to know (does it shard the parameters? is its checkpoint one shard per rank? which Accelerate
distributed type?) rather than comparing `parallel.strategy` to names. Two places compare names,
since the names are what they are about: checkpoint/routes.py, whose table of the moves between
the strategies' file formats is keyed by them, and commands/next_steps.py, which suggests the
next strategy to try.

Pure: imports neither torch nor accelerate, so `overdrive explain` and `--help` stay fast.
Every question takes the run config as a RunConfig (a resolved.json or a checkpoint's saved
config is read into one first: config/stored.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from overdrive.strategies import settings

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


@dataclass(frozen=True)
class Sharding:
    """Which training state a strategy splits over the ranks, and which it keeps on the host,
    as the memory estimator counts it: `parameters` is whether they stay sharded between
    forward and backward (FSDP2 keeps them gathered without reshard_after_forward). Whether a
    rank ever holds the whole model is `Strategy.holds_whole_model`."""

    parameters: bool = False
    gradients: bool = False
    optimizer_state: bool = False
    offload_parameters: bool = False
    offload_optimizer_state: bool = False

    @property
    def any(self) -> bool:
        return self.parameters or self.gradients or self.optimizer_state


@dataclass(frozen=True)
class Strategy:
    name: str
    title: str
    # Accelerate's DistributedType for this strategy; None: decided by the launch (NO/MULTI_CPU/MULTI_GPU).
    accelerate_type: Optional[str]
    # Its own settings section, `parallel.<name>`; None: nothing beyond the common keys.
    section: Optional[str]
    # A process group (and rank variables) even as a lone process: Accelerate's plugins expect one.
    always_grouped: bool
    # The optimizer step runs inside the strategy's own engine (DeepSpeed), not the torch optimizer.
    engine_steps_optimizer: bool
    # A file of its own that `accelerate launch` reads beside the Accelerate YAML.
    native_file: Optional[str]
    # The run hands DeepSpeed a config dict (strategies/deepspeed_config.py), checked before launch.
    deepspeed_config: bool
    _sharding: Callable[[RunConfig], Sharding]
    _holds_whole_model: Callable[[RunConfig], bool]
    _setting_problems: Callable[[RunConfig, settings.Where], settings.Found]
    _checkpoint_per_rank: Callable[[RunConfig], bool]
    _estimator_row: Callable[[RunConfig], str]
    _label: Callable[[RunConfig], str]
    # What the optimizer's step is given: "whole" tensors, "flat partitions" (ZeRO: one flattened
    # fp32 buffer per rank, tensors cut anywhere) or "shards" (FSDP2: DTensor pieces of each tensor).
    _optimizer_sees: Callable[[RunConfig], str] = lambda cfg: "whole"
    # The fp8 backends Accelerate runs under this strategy (it refuses MS-AMP with FSDP when the
    # model is prepared).
    fp8_backends: tuple[str, ...] = ("TE", "AO", "MSAMP")
    # What decides the format of its checkpoint's files (checkpoint/routes.py): the strategy's name and
    # what changes its files (ZeRO's stage; FSDP's version and state-dict type). Offload does not.
    _checkpoint_format: Callable[[RunConfig], tuple] = lambda cfg: ("ddp",)
    # The strategy as a person names it in a checkpoint's route: DDP, ZeRO-2 (optimizer offload to cpu), FSDP2.
    _person_name: Callable[[RunConfig], str] = lambda cfg: "DDP"

    def optimizer_sees(self, cfg: RunConfig) -> str:
        """What the optimizer steps on: "whole" tensors, ZeRO's "flat partitions", FSDP2's "shards"."""
        return self._optimizer_sees(cfg)

    def sharding(self, cfg: RunConfig) -> Sharding:
        return self._sharding(cfg)

    def holds_whole_model(self, cfg: RunConfig) -> bool:
        """Whether a rank holds the whole model outside a gather: not under ZeRO-3 or FSDP
        (which shards the parameters at rest whatever reshard_after_forward says)."""
        return self._holds_whole_model(cfg)

    def setting_problems(self, cfg: RunConfig, where: settings.Where) -> settings.Found:
        """(errors, warnings) of this strategy's own settings; `where(key)`: where a value was set."""
        return self._setting_problems(cfg, where)

    def skips_overflowing_steps(self, cfg: RunConfig) -> bool:
        """The strategy's engine skips a step whose fp16 gradients overflow and lowers the loss
        scale itself: DeepSpeed with dynamic loss scaling (`loss_scale: 0`; a fixed scale skips nothing)."""
        return (self.engine_steps_optimizer and cfg.precision.mixed_precision == "fp16"
                and not cfg.parallel.deepspeed.loss_scale)

    def checkpoint_per_rank(self, cfg: RunConfig) -> bool:
        """True when the checkpoint's optimizer state (or weights) is written as one shard per rank."""
        return self._checkpoint_per_rank(cfg)

    def saves_through_dcp(self, cfg: RunConfig) -> bool:
        """True when Accelerate writes the model and optimizer through torch.distributed.checkpoint
        (FSDP's sharded state dict): what `checkpoint.async` can hand to DCP's async_save."""
        return self.name == "fsdp" and cfg.parallel.fsdp.state_dict_type == "sharded_state_dict"

    def estimator_row(self, cfg: RunConfig) -> str:
        """The memory estimator's row (overdrive.memory.formulas.STRATEGIES) this run selects."""
        return self._estimator_row(cfg)

    def label(self, cfg: RunConfig) -> str:
        """One line for reports: the strategy and what it was set to."""
        return self._label(cfg)

    def distributed_type(self, cfg: RunConfig) -> str:
        """Accelerate's DistributedType for this run (an Accelerate YAML's `distributed_type`)."""
        if self.accelerate_type:
            return self.accelerate_type
        if cfg.launch.num_processes == 1 and cfg.launch.num_machines == 1:
            return "NO"
        return "MULTI_CPU" if cfg.launch.use_cpu else "MULTI_GPU"

    def activation_checkpointing(self, cfg: RunConfig) -> bool:
        """The strategy's own activation checkpointing (beside model.gradient_checkpointing)."""
        return self.name == "fsdp" and cfg.parallel.fsdp.activation_checkpointing

    def checkpoint_format(self, cfg: RunConfig) -> tuple:
        """What decides the format of the checkpoint's files: ("ddp",), ("deepspeed", stage),
        ("fsdp", version, state_dict_type)."""
        return self._checkpoint_format(cfg)

    def person_name(self, cfg: RunConfig) -> str:
        """The strategy as a person names it: DDP, ZeRO-2 (optimizer offload to cpu), FSDP2."""
        return self._person_name(cfg)

    def owns(self, key: str) -> bool:
        """True when a dotted key belongs to this strategy's settings section."""
        return bool(self.section) and key.startswith(f"{self.section}.")


def _zero_stage(cfg: RunConfig) -> int:
    return cfg.parallel.deepspeed.zero_stage


def _zero_sharding(cfg: RunConfig) -> Sharding:
    ds = cfg.parallel.deepspeed
    stage = ds.zero_stage
    return Sharding(parameters=stage >= 3, gradients=stage >= 2, optimizer_state=stage >= 1,
                    offload_parameters=stage >= 3 and ds.offload_param != "none",
                    offload_optimizer_state=stage >= 1 and ds.offload_optimizer != "none")


def _fsdp_sharding(cfg: RunConfig) -> Sharding:
    # FSDP2 always shards all three between uses; reshard_after_forward decides whether the
    # gathered parameters are freed after forward (ZeRO-3-like) or kept to backward (ZeRO-2-like).
    fsdp = cfg.parallel.fsdp
    return Sharding(parameters=fsdp.reshard_after_forward, gradients=True, optimizer_state=True,
                    offload_parameters=fsdp.offload_params, offload_optimizer_state=fsdp.offload_params)


def _zero_row(cfg: RunConfig) -> str:
    ds = cfg.parallel.deepspeed
    stage, offload_opt = ds.zero_stage, ds.offload_optimizer != "none"
    if stage == 3:
        if ds.offload_param != "none":
            return "zero3_offload"
        return "zero3_offload_optimizer" if offload_opt else "zero3"
    if stage == 0:
        return "ddp"
    if offload_opt:
        return "zero2_offload"  # ZeRO-1 with offload holds what ZeRO-2 with offload holds
    return f"zero{stage}"


def _zero_label(cfg: RunConfig) -> str:
    ds = cfg.parallel.deepspeed
    offload = [f"{what} to {dev}" for what, dev in (("optimizer", ds.offload_optimizer), ("params", ds.offload_param))
               if dev not in (None, "none")]
    return f"deepspeed ZeRO-{ds.zero_stage}" + (f" (offload {', '.join(offload)})" if offload else "")


def _zero_person_name(cfg: RunConfig) -> str:
    ds = cfg.parallel.deepspeed
    offload = [f"{what} offload to {device}" for what, device in (("optimizer", ds.offload_optimizer),
                                                                  ("parameter", ds.offload_param))
               if device != "none"]
    return f"ZeRO-{ds.zero_stage}" + (f" ({', '.join(offload)})" if offload else "")


def _fsdp_label(cfg: RunConfig) -> str:
    fsdp = cfg.parallel.fsdp
    return f"fsdp{fsdp.version or ''} (reshard_after_forward={fsdp.reshard_after_forward})"


DDP = Strategy(
    name="ddp", title="plain data parallel (also one process)", accelerate_type=None, section=None,
    always_grouped=False, engine_steps_optimizer=False, native_file=None, deepspeed_config=False,
    _sharding=lambda cfg: Sharding(), _holds_whole_model=lambda cfg: True, _setting_problems=settings.none,
    _checkpoint_per_rank=lambda cfg: False,
    _estimator_row=lambda cfg: "ddp", _label=lambda cfg: "ddp")

DEEPSPEED = Strategy(
    name="deepspeed", title="DeepSpeed ZeRO", accelerate_type="DEEPSPEED", section="parallel.deepspeed",
    always_grouped=True, engine_steps_optimizer=True, native_file="deepspeed.json", deepspeed_config=True,
    _sharding=_zero_sharding, _holds_whole_model=lambda cfg: _zero_stage(cfg) < 3,
    _setting_problems=settings.deepspeed,
    _checkpoint_per_rank=lambda cfg: _zero_stage(cfg) >= 1,
    _estimator_row=_zero_row, _label=_zero_label,
    _optimizer_sees=lambda cfg: "flat partitions" if _zero_stage(cfg) >= 1 else "whole",
    _checkpoint_format=lambda cfg: ("deepspeed", _zero_stage(cfg)), _person_name=_zero_person_name)

FSDP = Strategy(
    name="fsdp", title="PyTorch FSDP2", accelerate_type="FSDP", section="parallel.fsdp",
    always_grouped=True, engine_steps_optimizer=False, native_file=None, deepspeed_config=False,
    _sharding=_fsdp_sharding, _holds_whole_model=lambda cfg: False, _setting_problems=settings.fsdp,
    _checkpoint_per_rank=lambda cfg: cfg.parallel.fsdp.state_dict_type == "sharded_state_dict",
    _estimator_row=lambda cfg: "fsdp2_offload" if cfg.parallel.fsdp.offload_params else "fsdp2",
    _label=_fsdp_label, _optimizer_sees=lambda cfg: "shards", fp8_backends=("TE", "AO"),
    _checkpoint_format=lambda cfg: ("fsdp", cfg.parallel.fsdp.version, cfg.parallel.fsdp.state_dict_type),
    _person_name=lambda cfg: f"FSDP{cfg.parallel.fsdp.version}")

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (DDP, DEEPSPEED, FSDP)}
NAMES = tuple(STRATEGIES)


# Each estimator row (memory/formulas.STRATEGIES) as the settings a run would give to train it:
# `estimate` judges every row by the rules train applies to those settings (the inverse of
# Strategy.estimator_row, held against it by a test).
ROW_SETTINGS: dict[str, dict[str, Any]] = {
    "ddp": {"parallel.strategy": "ddp"},
    "zero1": {"parallel.strategy": "deepspeed", "parallel.deepspeed.zero_stage": 1},
    "zero2": {"parallel.strategy": "deepspeed", "parallel.deepspeed.zero_stage": 2},
    "zero3": {"parallel.strategy": "deepspeed", "parallel.deepspeed.zero_stage": 3},
    "fsdp2": {"parallel.strategy": "fsdp", "parallel.fsdp.version": 2},
    "zero2_offload": {"parallel.strategy": "deepspeed", "parallel.deepspeed.zero_stage": 2,
                      "parallel.deepspeed.offload_optimizer": "cpu"},
    "zero3_offload_optimizer": {"parallel.strategy": "deepspeed", "parallel.deepspeed.zero_stage": 3,
                                "parallel.deepspeed.offload_optimizer": "cpu"},
    "zero3_offload": {"parallel.strategy": "deepspeed", "parallel.deepspeed.zero_stage": 3,
                      "parallel.deepspeed.offload_optimizer": "cpu", "parallel.deepspeed.offload_param": "cpu"},
    "fsdp2_offload": {"parallel.strategy": "fsdp", "parallel.fsdp.version": 2, "parallel.fsdp.offload_params": True},
}


def row_settings(row: str) -> dict[str, Any]:
    """The dotted settings that train an estimator row's strategy."""
    try:
        return dict(ROW_SETTINGS[row])
    except KeyError:
        raise ValueError(f"unknown estimator row {row!r}: one of {', '.join(ROW_SETTINGS)}") from None


def named(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}: one of {', '.join(NAMES)}") from None


def of(cfg: RunConfig) -> Strategy:
    """The strategy a run config uses."""
    return named(cfg.parallel.strategy)
