"""What the loop is built from: tokenizer, model, data, optimizer and schedule, prepared by
the Accelerator (`build_parts`), and the trained model saved at the end (`save_final`)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union

import torch

from overdrive import data as data_mod
from overdrive import strategies
from overdrive.strategies import registry
import overdrive.config.batch as batch
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError
from overdrive.training import telemetry
from overdrive.training.build import adapter, grpo_parts, master_weights, optimizers, vision
from overdrive.training.build import model as model_mod
from overdrive.training.build.dtypes import matmul_precision
from overdrive.training.build.recipe import Recipe
from overdrive.training.build.tokenizer import build_tokenizer
from overdrive.training.objectives import grpo, moe, preference, reference
from overdrive.training.objectives import registry as registry_of_objectives
from overdrive.training.objectives.objective import Objective, TokenObjective
from overdrive.training.step import activation_offload, context_parallel, forward_backward, pipeline
from overdrive.training.step.pipeline import Pipeline

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerBase, ProcessorMixin


class LearningRateSchedule(Protocol):
    """torch's LRScheduler, or Accelerate's AcceleratedScheduler around one: what the loop asks of it."""

    def step(self) -> None: ...

    def get_last_lr(self) -> list[float]: ...


@dataclass
class Parts:
    """What the loop is built from, and the pieces its step is composed of."""

    accelerator: Accelerator
    model: torch.nn.Module  # prepared: DDP, FSDP2, DeepSpeed's engine (or this rank's pipeline stages)
    optimizer: torch.optim.Optimizer  # Accelerate's AcceleratedOptimizer around the one built
    scheduler: LearningRateSchedule
    train_loader: DataLoader
    eval_loader: Optional[DataLoader]
    tokenizer: Union[PreTrainedTokenizerBase, ProcessorMixin]  # a vision-language model's processor
    flops_per_token: float
    peak: telemetry.DevicePeak
    seq_len: int
    objective: Objective  # what a micro-batch's loss is (training/objectives/objective.py)
    # how the step's micro-batches go through the model: forward_backward.plain, or the pipeline's schedule
    forward_backward: Callable[..., torch.Tensor] = forward_backward.plain
    recipe: Optional[Recipe] = None  # what the loop asks of the optimizer and the data mixture
    notes: list[str] = field(default_factory=list)  # said once the run starts (trainable parameters, packing)
    config: Optional[RunConfig] = None  # the config as it runs: steps counted from the data (training.num_epochs)
    derived: dict[str, Any] = field(default_factory=dict)  # key -> how the data derived it
    pipeline: Optional["Pipeline"] = None  # under parallel.pp_size > 1 (model: this rank's stages)
    # the training loader at a split, as a run started at it builds it (training.oom_retry's redo)
    loader_at: Optional[Callable[[batch.BatchSplit], DataLoader]] = None

    def resplit(self, split: batch.BatchSplit) -> DataLoader:
        """The training loader at `split` (the same data, sampler and collation, prepared as the first
        was) and the objective cut to its micro-batch: what a redo at another split needs."""
        if self.loader_at is None:
            raise ValueError("these parts were built without a loader at another split (a pipeline's)")
        acc, old = self.accelerator, self.train_loader
        self.train_loader = acc.prepare_data_loader(self.loader_at(split))
        # save_state walks the loaders Accelerate prepared: the one left behind is no longer the run's.
        acc._dataloaders = [d for d in acc._dataloaders if d is not old]
        self.objective.resplit(split.settled_micro())
        return self.train_loader

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The gradient norm over every rank (and every stage), the gradients clipped to `max_norm`."""
        if self.pipeline is not None:
            return self.pipeline.clip(max_norm)
        return self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm)

    @property
    def counts_loss_tokens(self) -> bool:
        """Whether this rank adds its micro-batches to metrics.jsonl's `loss_tokens`: once per
        pipeline replica, not once per stage."""
        return self.pipeline is None or self.pipeline.pp_rank == 0



def _check_positions(cfg: RunConfig, config) -> None:
    """The rule train judged from the model's config before launch, asked again of the model built
    (a run started from Python, not through `overdrive train`)."""
    from overdrive.resolving.validate_model import positions_problems

    found = positions_problems(cfg, config)
    if found:
        raise UserError(found)


@dataclass
class _Data:
    """The run's tokenizer and data, and the training loader at any split."""

    cfg: RunConfig  # steps counted from the data (training.num_epochs)
    derived: dict[str, Any]
    tokenizer: Any
    tokens: Any
    collate: Any
    loader_at: Callable[[batch.BatchSplit], Any]
    train_loader: Any  # at the run's split
    vision: bool


@dataclass
class _Placed:
    """The model where it trains (prepared by Accelerate, or cut into this rank's pipeline stages), with
    what goes with that placement: the optimizer, the schedule, the loaders, the forward-backward."""

    model: Any
    optimizer: Any
    scheduler: Any
    train_loader: Any
    eval_loader: Any
    flops_per_token: float
    notes: list[str]
    forward_backward: Callable[..., torch.Tensor] = forward_backward.plain
    pipeline: Optional[Pipeline] = None
    reference_model: Any = None


def build_parts(cfg: RunConfig, accelerator: Any, say: Optional[Callable[[str], None]] = None) -> Parts:
    """Tokenizer, model, data, optimizer and schedule, prepared by `accelerator` (or cut into this
    rank's pipeline stages: a forward-backward choice), and the step's pieces; `say(what)` tells each
    stage as it starts (training/build/startup.py). The one builder of a run's parts."""
    from accelerate.utils import set_seed

    from overdrive.training.build.startup import silent

    say = say or silent
    staged = pipeline.enabled(cfg)
    data = _data(cfg, accelerator, say)
    cfg, tokenizer, split = data.cfg, data.tokenizer, batch.split(data.cfg)
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if cfg.model.task == "sequence-classification":
        # The classifier reads the last non-pad token. A causal LM gets no pad id: packed
        # blocks have no padding, and with pad == eos Transformers would warn on every batch.
        special["pad_token_id"] = tokenizer.pad_token_id
    set_seed(cfg.training.seed)  # same initial weights on every rank and every run
    say(f"building the model ({cfg.model.name_or_path or 'from scratch'})")
    label_names = ["reward"] if preference.trains_reward_model(cfg) else (data.tokens.label_names or [])  # one scalar
    # Pipeline stages are cut from the whole model on this rank's device; otherwise prepare() places it.
    device = accelerator.device if staged else adapter.load_device(cfg, accelerator.device)
    model = model_mod.build_model(cfg, vocab_size=len(tokenizer), label_names=label_names,
                                  special_tokens=special, device=device)
    _check_positions(cfg, model.config)
    upcast = master_weights.upcast_trainable(cfg, model)
    # Hooked before anything wraps the model; pipeline stages take no balance term (refused where the model
    # has one: resolving/validate_model.py), so no hook is left catching router logits there.
    balance = None if staged else moe.attach(cfg, model, accelerator)
    # MFU against the peak of the precision the matmuls run in (bf16 weights without autocast: bf16).
    peak = telemetry.DevicePeak(accelerator.device, matmul_precision(cfg.precision.mixed_precision, model),
                                Path(cfg.data.cache_dir).expanduser())
    placed = (_staged if staged else _prepared)(cfg, accelerator, model, data, say)
    if staged:  # the last stage computes the token loss itself; other objectives are refused with stages
        objective: Objective = TokenObjective(cfg.model.task)
    else:
        placed.notes += master_weights.note(upcast) + _passes(cfg, data.tokens.train, split.required_global())
        objective = registry_of_objectives.chosen(cfg).build(registry_of_objectives.Building(
            cfg, accelerator, placed.model, placed.reference_model, tokenizer, data.tokens, data.collate, split,
            placed.eval_loader is not None, say))
    if balance is not None:  # a mixture of experts: the router's balance term beside the objective's loss
        sharing = max(accelerator.num_processes // split.data_parallel // context_parallel.cp_size(cfg), 1)
        objective = moe.BalancedObjective(objective, balance, accelerator, sharing=sharing)
    return Parts(accelerator, placed.model, placed.optimizer, placed.scheduler, placed.train_loader,
                 placed.eval_loader, tokenizer, placed.flops_per_token, peak, cfg.data.max_length, objective,
                 placed.forward_backward, Recipe(cfg, placed.optimizer, placed.train_loader, cfg.data.max_length),
                 placed.notes, cfg, data.derived, pipeline=placed.pipeline,
                 loader_at=None if staged else data.loader_at)


def _data(cfg: RunConfig, accelerator: Any, say: Callable[[str], None]) -> _Data:
    """The tokenizer and the data, and the training loader at the run's split: data too small for one
    global batch is refused here, before any weight is read."""
    t, d = cfg.training, cfg.data
    split = batch.split(cfg)
    say("reading the tokenizer and the data (a token cache is filled once, then reused)")
    # One process per machine trains the tokenizer and fills the token cache; the others wait
    # for those files (not in a barrier), then every process memory-maps the same token ids.
    vision_collate = None
    vision_model, model_type = vision.settle(cfg)  # a vision-language model: its processor, images in the rows
    if grpo.enabled(cfg) and vision_model:  # prompts with images, through the processor (training/build/vision.py)
        tokenizer, tokens = vision.prompts(cfg, model_type)
    elif grpo.enabled(cfg):  # prompts and completion slots, no token cache (training/build/grpo_parts.py)
        tokenizer, tokens = grpo_parts.prepare(cfg, build_tokenizer)
    elif vision_model:
        tokenizer, tokens, vision_collate = vision.prepare(cfg, model_type, show=accelerator.is_main_process)
    else:
        tokenizer, tokens = data_mod.prepare(cfg, build_tokenizer, build=accelerator.is_local_main_process,
                                             show=accelerator.is_main_process and cfg.logging.level != "quiet")
    counted, derived = _counted_from_data(cfg, tokens.train, split.required_global())
    collate = vision_collate if vision_model else data_mod.collate_for(data_mod.sample_kind(counted),
                                                                       tokenizer.pad_token_id, d.max_length)

    def loader_at(at: batch.BatchSplit):  # at the run's split, or at the split an OOM redo settles on
        if grpo.enabled(counted):  # RL: prompts in completion slots
            return grpo_parts.loader(tokens, at)
        return data_mod.train_loader(tokens.train, at.settled_micro(), at.accumulation, at.data_parallel, t.seed,
                                     d.shuffle, d.num_workers, d.pin_memory, collate)

    # Built here: data too small for one global batch is refused before any weight is read.
    return _Data(counted, derived, tokenizer, tokens, collate, loader_at, loader_at(split), vision_model)


def _staged(cfg: RunConfig, accelerator: Any, model: Any, data: _Data, say: Callable[[str], None]) -> _Placed:
    """This rank's pipeline stages, cut from the whole model: their own optimizer and loader sharding;
    the forward-backward is the pipeline's schedule."""
    layers, width = model_mod.shape_of(model.config)
    fpt = telemetry.flops_per_token(model_mod.flop_params(model), layers, width, cfg.data.max_length)
    stages = pipeline.Pipeline(cfg, accelerator, model)
    train_loader = pipeline.replica_loader(data.train_loader, accelerator, stages)
    optimizer = optimizers.build_optimizer(stages.module, cfg, accelerator.device.type)  # this rank's stages only
    notes = stages.notes(cfg) + (["pipeline: the validation split is not evaluated (no forward-only schedule "
                                  "is run here)"] if data.tokens.validation is not None else [])
    return _Placed(stages.module, optimizer, optimizers.build_schedule(optimizer, cfg), train_loader, None, fpt,
                   notes, stages.forward_backward, pipeline=stages)


def _prepared(cfg: RunConfig, accelerator: Any, model: Any, data: _Data, say: Callable[[str], None]) -> _Placed:
    """The whole model split by its tensor- and expert-parallel plans and prepared by Accelerate with
    its optimizer, schedule and loaders; the forward-backward is the plain one."""
    t, d, split = cfg.training, cfg.data, batch.split(cfg)
    layers, width = model_mod.shape_of(model.config)
    idle = moe.idle_params(model)  # experts a token is not routed to: FLOPs and MFU by the active parameters
    fpt = telemetry.flops_per_token(model_mod.flop_params(model) - idle[0], layers, width, d.max_length,
                                    frozen_params=model_mod.flop_params(model, frozen=True) - idle[1])
    model = strategies.split_model(model, accelerator, cfg)  # tensor and expert parallel, when the layout has them
    notes = adapter.notes(cfg, model) + (vision.notes(cfg, model) if data.vision else [])  # before the wrapping
    eval_loader = None
    if data.tokens.validation is not None:
        # A fixed leading subset: evaluations are comparable across steps, and the loader is
        # always iterated to its end (leaving it early confuses Accelerate's end-of-data tracking).
        micro = split.settled_micro()
        n = min(len(data.tokens.validation), t.eval_batches * micro * split.data_parallel)
        eval_loader = data_mod.eval_loader(torch.utils.data.Subset(data.tokens.validation, range(n)), micro,
                                           d.num_workers, d.pin_memory, data.collate)
    reference_model = reference.frozen_copy(cfg, model)  # the starting weights, before anything wraps them
    optimizer = optimizers.build_optimizer(model, cfg, accelerator.device.type)
    strategies.hook_optimizer(optimizer, model)  # expert parallel: the experts' moments saved whole
    scheduler = optimizers.build_schedule(optimizer, cfg)  # None when DeepSpeed builds the optimizer
    say(f"preparing the model and optimizer ({registry.of(cfg).label(cfg)}, "
        f"{accelerator.num_processes} process{'es' if accelerator.num_processes != 1 else ''})")
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, data.train_loader)
    scheduler = scheduler or optimizers.schedule_after_prepare(accelerator, cfg)
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)
    if cfg.compile.backend:
        say(f"compiling with torch.compile ({cfg.compile.backend}): the first step compiles the kernels")
    model = _maybe_compile(model, cfg, accelerator)
    activation_offload.attach(model, t.activation_offloading)  # saved activations in host memory, when asked
    return _Placed(model, optimizer, scheduler, train_loader, eval_loader, fpt, notes, reference_model=reference_model)


def _counted_from_data(cfg: RunConfig, train, global_batch: int):
    """Steps, warmup, evaluation and saving counted in epochs of the token cache's samples (a
    mixture's: the sum over its sources), by config/length.py."""
    from overdrive.config import length

    samples = sum(train.sizes) if hasattr(train, "sizes") else len(train)
    try:
        return length.derived(cfg, samples, global_batch)
    except ValueError as error:
        raise UserError(Problem("training.num_epochs", str(error), fix="give more data, or lower "
                                "training.micro_batch_size / gradient_accumulation_steps")) from None


def _passes(cfg: RunConfig, train, global_batch: int) -> list[str]:
    from overdrive.config.length import passes_note

    return passes_note(cfg, sum(train.sizes) if hasattr(train, "sizes") else len(train), global_batch)


def _maybe_compile(model, cfg: RunConfig, accelerator):
    """torch.compile when `compile.backend` is set and the Accelerator has not already done it."""
    c = cfg.compile
    if not c.backend or accelerator.state.dynamo_plugin.backend.value.lower() != "no":
        return model
    return torch.compile(model, backend=c.backend, mode=c.mode, fullgraph=c.fullgraph, dynamic=c.dynamic)


def full_tensors(state_dict: Any) -> Any:
    """Tensor-parallel DTensors gathered whole on every rank, in one order (a collective): left
    to the main process alone, as save_pretrained would, the other ranks never join it and the
    final save hangs."""
    if not state_dict:
        return state_dict
    from torch.distributed.tensor import DTensor

    return {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state_dict.items()}


@contextmanager
def _gathered(model: Any):
    """The model's tensor-parallel record set aside while the main process saves the state dict
    `full_tensors` gathered: with it, save_pretrained gathers and waits at a barrier itself,
    collectives the other ranks (not saving) never join."""
    config = getattr(model, "config", None)
    held = getattr(config, "distributed_config", None)
    if config is None or held is None:
        yield
        return
    config.distributed_config = None
    try:
        yield
    finally:
        config.distributed_config = held


def save_final(cfg: RunConfig, parts: Parts, out: Path) -> None:
    """The trained model and tokenizer as a `save_pretrained` directory: out/model (an adapter
    run's: PEFT's adapter directory, training/build/adapter.py; pipeline stages': joined on rank 0)."""
    if parts.pipeline is not None:
        return pipeline.save_final(cfg, parts.pipeline, parts.accelerator, parts.tokenizer, out)
    acc = parts.accelerator
    acc.wait_for_everyone()
    if not cfg.checkpoint.save_final_model:
        return
    if parts.recipe is not None:
        parts.recipe.eval_mode()  # a schedule-free optimizer's weights: its averaged point
    # Every rank takes part: under ZeRO-3 or FSDP the full weights are gathered from shards.
    state_dict = full_tensors(acc.get_state_dict(parts.model))
    if adapter.enabled(cfg):  # PEFT's adapter directory (and the merged model when asked)
        adapter.save_final(cfg, acc, parts.model, parts.tokenizer, state_dict, out)
        acc.wait_for_everyone()
        return
    if acc.is_main_process:
        from transformers.utils import logging as hf_logging

        from overdrive.storage import atomic

        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar is only noise
        try:
            model = acc.unwrap_model(parts.model)
            with atomic.directory(out / "model", "output_dir", "the final model") as target, _gathered(model):
                model.save_pretrained(target, state_dict=state_dict, save_function=acc.save)
                parts.tokenizer.save_pretrained(target)
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()
    acc.wait_for_everyone()
