"""Pipeline parallel training: the model cut into stages at its decoder layers
(training/step/pipeline_stage.py), run by torch.distributed.pipelining's schedules on a
(pp, dp, tp) device mesh: each stage split by the model's tensor-parallel plan when tp_size > 1,
its gradients averaged over its data-parallel replicas.

    pipe = Pipeline(cfg, accelerator, model)  # this rank's stages (training/build/parts.py builds the rest)
    pipe.forward_backward(loop, micro_batches, totals)   # the step's forward-backward: the schedule

The step is the one-process step, cut differently: every rank of a pipeline takes the same
samples (micro_batch_size x gradient_accumulation_steps of its data-parallel replica), the
schedule splits them into `parallel.pp_microbatches`, and the last stage's loss of each
microbatch is its summed token loss over the tokens of the whole step (step_loss.py), so the
step's loss is the token-weighted mean over its samples (what the one-process loop averages)
and its gradient the gradient of that mean. Gradients are clipped by the norm over all stages.

Every microbatch is padded to `data.max_length` (labels IGNORE, right padding, which a causal
model needs no mask for): the schedule splits one tensor, and each stage sizes the messages it
sends and receives by the first step's shapes, so rows of varying length (chat, unpacked
text) would not concatenate, and a later, longer step would overrun those messages.
Which rules the layout keeps: strategies/pipeline.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from overdrive.config.schema import RunConfig
from overdrive.strategies import pipeline as rules
from overdrive.strategies import shards_parameters
from overdrive.training.build import model as model_mod
from overdrive.training.step import step_loss
from overdrive.training.step.forward_backward import Books
from overdrive.training.step.pipeline_stage import cut

def enabled(cfg: RunConfig) -> bool:
    return rules.pp_size(cfg) > 1


class StepTokenMean:
    """The schedule's loss of one microbatch: its summed next-token loss over the tokens of the
    whole step (set before each step), so the microbatches' losses add up to the step's mean."""

    def __init__(self, replicas: int = 1):
        self.tokens: Any = 1
        # The replicas' gradients are averaged after backward (DDP's mean, FSDP2's reduce-scatter):
        # scaled back here, so the step's gradient is the sum of their shares of the global mean.
        self.replicas = replicas

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return step_loss.summed_cross_entropy(logits, labels) / self.tokens * self.replicas


class Pipeline:
    """This rank's place in the pipeline: its stages, the mesh, the schedule."""

    def __init__(self, cfg: RunConfig, accelerator: Any, model: Any):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        pp, tp, world = rules.pp_size(cfg), int(cfg.parallel.tp_size), accelerator.num_processes
        self.dp = world // (pp * tp)
        # torchtitan's order: stages outermost, tensor parallel innermost (within a machine).
        self.mesh = init_device_mesh(accelerator.device.type, (pp, self.dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        self.pp_group, self.dp_group, self.tp_group = (self.mesh.get_group(n) for n in ("pp", "dp", "tp"))
        self.pp_rank, self.dp_rank, self.tp_rank = (self.mesh.get_local_rank(n) for n in ("pp", "dp", "tp"))
        if tp > 1:
            _tensor_parallel(model, self.mesh["tp"], tp)
        kind, count = rules.schedule(cfg), rules.stage_count(cfg)
        self.stage_ids = rules.stages_of_rank(self.pp_rank, pp, rules.stages_per_rank(cfg), kind.v_shape)
        layers, _ = model_mod.shape_of(model.config)
        self.modules = cut(model, rules.layer_split(layers, count), self.stage_ids)
        self.sharded = shards_parameters(cfg)  # FSDP2 beside the stages (DeepSpeed is refused with them)
        if self.sharded:
            for module in self.modules:
                _fully_shard(module, self.mesh["dp"], cfg.parallel.fsdp.reshard_after_forward)
        self.bucket_bytes, self.device = cfg.parallel.ddp.bucket_cap_mb * 2**20, accelerator.device
        stages = [PipelineStage(m, i, count, accelerator.device, group=self.pp_group)
                  for m, i in zip(self.modules, self.stage_ids)]
        self.has_first, self.has_last = 0 in self.stage_ids, count - 1 in self.stage_ids
        # The pipeline rank whose last stage computes the loss (rank 0 in a V, the last rank otherwise).
        self.loss_rank = next(r for r in range(pp) if count - 1 in rules.stages_of_rank(
            r, pp, rules.stages_per_rank(cfg), kind.v_shape))
        self.loss = StepTokenMean(self.dp)
        self.module = torch.nn.ModuleList(self.modules)  # what the optimizer and the checkpoint hold
        # Any id pads: a right pad is attended by no real token before it and predicts nothing.
        self.pad_id, self.length = 0, cfg.data.max_length
        cls = get_schedule_class(kind.torch_name)
        self.schedule = cls(stages if kind.multi else stages[0], n_microbatches=rules.microbatches(cfg),
                            loss_fn=self.loss, scale_grads=False)

    def average_gradients(self) -> None:
        """The replicas' gradients averaged over the data-parallel group, in buckets of
        parallel.ddp.bucket_cap_mb, once the schedule's backward is done (DDP's reducer, driven
        by the schedule's own no_sync, fails to rebuild its buckets when 1F1B interleaves two
        microbatches' backward in the first step; this reduction is the same mean, unoverlapped)."""
        if self.dp == 1 or self.sharded:  # FSDP2 reduce-scatters (and averages) them itself
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = self.gradients()
        bucket: list[torch.Tensor] = []
        size, limit = 0, self.bucket_bytes

        def flush():
            if bucket:
                flat = _flatten_dense_tensors(bucket)
                dist.all_reduce(flat, group=self.dp_group)
                flat /= self.dp
                for grad, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    grad.copy_(reduced)
                bucket.clear()

        for grad in grads:
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            if size >= limit:
                flush()
                size = 0
        flush()

    def gradients(self) -> list[torch.Tensor]:
        """This rank's gradients, a tensor-parallel shard as its local tensor."""
        return [_local(p.grad) for p in self.parameters() if p.grad is not None]

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def notes(self, cfg: RunConfig) -> list[str]:
        """What the run says of its stages when it starts."""
        layers, _ = model_mod.shape_of(self.modules[0].lm.config)
        split = rules.layer_split(layers, rules.stage_count(cfg))
        held = ", ".join(f"stage {i} (layers {split[i][0]}-{split[i][1] - 1})" for i in self.stage_ids)
        return [f"pipeline: {rules.pp_size(cfg)} stages x {self.dp} data-parallel, schedule {cfg.parallel.pp_schedule}, "
                f"{rules.microbatches(cfg)} microbatches per step; rank 0 holds {held}"]

    def padded(self, micro_batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's micro-batches as one (input_ids, labels) pair, each row padded to the run's length."""
        ids, labels = [], []
        for micro_batch in micro_batches:
            short = self.length - micro_batch["input_ids"].shape[1]
            ids.append(torch.nn.functional.pad(micro_batch["input_ids"], (0, short), value=self.pad_id))
            labels.append(torch.nn.functional.pad(micro_batch["labels"], (0, short), value=step_loss.IGNORE))
        return torch.cat(ids), torch.cat(labels)

    def forward_backward(self, loop: Books, micro_batches: list, totals: torch.Tensor) -> torch.Tensor:
        """The step's forward-backward under stages (training/step/forward_backward.py's contract): the
        schedule over the microbatches; this replica's share of the loss."""
        input_ids, labels = self.padded(micro_batches)
        loop.observe.enter("forward")  # the schedule interleaves forward and backward
        with loop.parts.accelerator.autocast():
            loss = self.step(input_ids, labels, totals[0])
        return loss.float()

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Forward and backward over the microbatches, normalised by the global batch's loss
        `tokens`; this replica's share of the step's loss on every pipeline rank."""
        self.loss.tokens = tokens
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.has_first else ()
        self.schedule.step(*args, target=labels if self.has_last else None, losses=losses)
        self.average_gradients()
        value = torch.stack(losses).sum().detach() / self.dp if losses else torch.zeros((), device=labels.device)
        dist.broadcast(value, group=self.pp_group, group_src=self.loss_rank)
        return value

    def clip(self, max_norm: float) -> torch.Tensor:
        """The gradient norm over every stage and every shard (a DTensor's squared norm summed
        over the mesh dimensions it is sharded along: tensor parallel, FSDP2), and the gradients
        scaled as torch.nn.utils.clip_grad_norm_ scales them when `max_norm` is finite."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.parameters() if p.grad is not None]
        # Squares summed per set of process groups a gradient is sharded over (none: whole here).
        sums: dict[tuple, torch.Tensor] = {}
        for grad in grads:
            groups: tuple = ()
            if isinstance(grad, DTensor):
                groups = tuple(grad.device_mesh.get_group(i) for i, p in enumerate(grad.placements) if p.is_shard())
            if groups not in sums:
                sums[groups] = torch.zeros((), dtype=torch.float32, device=self.device)
            sums[groups] += _local(grad).float().pow(2).sum()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for groups, value in sums.items():
            for group in groups:
                dist.all_reduce(value, group=group)
            total += value
        dist.all_reduce(total, group=self.pp_group)
        total = total.sqrt()
        if max_norm != float("inf"):
            scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for grad in grads:
                _local(grad).mul_(scale.to(grad.dtype))
        return total

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The stages' whole weights (tensor-parallel shards gathered: every rank of the group calls it)."""
        return {k: _whole(v).detach().cpu() for m in self.modules for k, v in m.model_state_dict().items()}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)  # a DTensor's own shard, written in place


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _fully_shard(stage, mesh, reshard_after_forward: bool) -> None:
    """FSDP2 over the stage's data-parallel replicas: each decoder layer a unit, the stage the
    root (torchtitan's wrapping); the schedule syncs gradients at the step's last microbatch."""
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(stage.lm.base_model, stage.family.layers).values():
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(stage, mesh=mesh, reshard_after_forward=reshard_after_forward)


def _tensor_parallel(model, mesh, tp: int) -> None:
    """The whole model split by its tensor-parallel plan before it is cut into stages, as
    strategies/tensor_parallel.py splits it without stages (each rank keeps its slice of the
    weights every rank built from the same seed)."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    config = DistributedConfig(tp_size=tp)
    plan, _, _ = model._resolve_parallel_plans(config)
    apply_tensor_parallelism(model, mesh, plan)


def replica_loader(loader: Any, accelerator: Any, pipe: Pipeline) -> Any:
    """The loader sharded over the data-parallel replicas only: every stage of one pipeline
    reads its replica's samples (Accelerate's own sharding, given the dp degree and rank)."""
    from accelerate.data_loader import prepare_data_loader

    acc = accelerator
    prepared = prepare_data_loader(loader, acc.device, num_processes=pipe.dp, process_index=pipe.dp_rank,
                                   split_batches=acc.split_batches, put_on_device=True, rng_types=acc.rng_types.copy(),
                                   dispatch_batches=acc.dispatch_batches, even_batches=acc.even_batches,
                                   use_seedable_sampler=acc.use_seedable_sampler,
                                   data_seed=acc.dataloader_config.data_seed, non_blocking=acc.non_blocking,
                                   use_stateful_dataloader=acc.use_stateful_dataloader)
    acc._dataloaders.append(prepared)  # skip_first_batches and the checkpoint find it there
    return prepared


def save_final(cfg: RunConfig, pipe: Pipeline, acc: Any, tokenizer: Any, out: Path) -> None:
    """The stages' weights joined into the whole model on rank 0, written by `save_pretrained`."""
    acc.wait_for_everyone()
    if not cfg.checkpoint.save_final_model:
        return
    mine = pipe.model_state_dict()  # every rank: gathering shards is collective
    mine = mine if pipe.dp_rank == 0 and pipe.tp_rank == 0 else {}
    gathered = [None] * acc.num_processes if acc.is_main_process else None
    dist.gather_object(mine, gathered, dst=0)
    if acc.is_main_process:
        from transformers import AutoModelForCausalLM

        from overdrive.storage import atomic

        from transformers.utils import logging as hf_logging

        whole = {k: v for part in gathered for k, v in part.items()}
        model = AutoModelForCausalLM.from_config(pipe.modules[0].lm.config)
        model.load_state_dict(whole, strict=True)  # every stage's weights, nothing missing
        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar is only noise
        try:
            with atomic.directory(out / "model", "output_dir", "the final model") as target:
                model.save_pretrained(target)
                tokenizer.save_pretrained(target)
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()
    acc.wait_for_everyone()
