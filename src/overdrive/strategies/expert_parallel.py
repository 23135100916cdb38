"""Expert parallel (`parallel.ep_size`): a mixture of experts' routed experts split over the ranks
of the data-parallel group, tokens sent to their experts' ranks by all-to-all.

Transformers owns the plan (a config's `base_model_ep_plan`: the stacked expert weights cut on
their expert dimension, `grouped_gemm`, and the experts module's forward replaced by a token
dispatch, `ep_dispatch_experts`) and the all-to-all (`ep_implementation="all_to_all"`);
`split_experts` hands it the model built whole from the run's seed on every rank, before
`prepare()`, as `split_model` does for tensor parallel. Each rank then keeps its experts / ep
as plain tensors. Over gloo on CPU processes the same code runs (all_to_all_single is gloo's too).

Composed with DDP: every rank sees its own batch; the ep ranks of a group (consecutive ranks,
so a group stays within a machine) exchange tokens; groups are replicas of one another
(mesh ep_replicate x ep). What DDP would do wrong, done here:

- DDP leaves the expert weights alone (`_ddp_params_and_buffers_to_ignore`): their gradient on
  the owning rank already sums every rank's tokens routed there (the all-to-all's backward).
  A gradient hook sums it over the replicas and divides by the data-parallel degree, which
  is what DDP's averaging does for the dense weights (the loop scales the backward by it).
- The gradient norm (clipping, the non-finite guard) adds the expert gradients' squares over
  the ep group to the dense ones', so every rank clips by the same norm.
- The model's state dict gathers the experts whole (Transformers' layout: `save_pretrained`,
  `merge`), and loading one cuts this rank's experts out of it.

- The optimizer's state dict gathers the experts' moments whole too (`hook_optimizer`), so a
  checkpoint is a plain DDP one and resumes at another ep_size, or none, at the same global batch.

Composed with FSDP2 (`parallel.strategy=fsdp`): FSDP2 shards the dense weights over every
data-parallel rank and leaves the experts to expert parallel (`ignored_params`); the experts'
gradient, the clipping norm (FSDP2's shards summed over their mesh), the state dicts and the
checkpoint are as under DDP. The experts are held whole by their rank, not sharded a second time
over the replicas (torchtitan's `dp_shard_mod_ep`).

Not composed here (refused by key in `problems`): ZeRO beside it, HSDP, tensor, context,
sequence or pipeline parallel, an adapter.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable, Optional

from overdrive.config.mesh import layout as _mesh_layout
from overdrive.errors import Problem
from overdrive.strategies.registry import of

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def ep_size(cfg: RunConfig) -> int:
    """parallel.ep_size (a checkpoint's config from before the key existed reads back with its default, 1)."""
    return cfg.parallel.ep_size


def problems(cfg: RunConfig, world: Optional[int] = None) -> list[Problem]:
    """The degrees and the composition, by key: ep within the data-parallel group (dividing its
    degree), DDP alone beside it, no adapter."""
    ep = ep_size(cfg)
    if ep == 1:
        return []
    lay, found = _mesh_layout(cfg, world), []
    strategy = of(cfg).name
    if lay.data_parallel % ep:
        found.append(Problem("parallel.ep_size", f"{ep} does not divide the data-parallel degree {lay.data_parallel}: "
                             "expert parallel ranks are data-parallel ranks (each its own batch)",
                             fix=f"set launch.num_processes to a multiple of {ep}, or parallel.ep_size to a divisor of "
                                 f"{lay.data_parallel}"))
    if strategy not in ("ddp", "fsdp"):
        found.append(Problem("parallel.ep_size", f"expert parallel is composed with ddp and fsdp here, not with "
                             f"{strategy} (its engine would shard the experts a second time)",
                             fix="set parallel.strategy=fsdp (or ddp)"))
    elif strategy == "fsdp" and _mesh_layout(cfg, world, shard_the_rest=True).dp_replicate > 1:
        found.append(Problem("parallel.ep_size", "is composed with FSDP2 sharding over every data-parallel rank, "
                             f"not with HSDP (parallel.dp_replicate_size={cfg.parallel.dp_replicate_size})",
                             fix="set parallel.dp_replicate_size=1, or parallel.ep_size=1"))
    for axis, size in (("tp", lay.tp), ("cp", lay.cp), ("sp", lay.sp), ("pp", lay.pp)):
        if size > 1:
            found.append(Problem("parallel.ep_size", f"is not composed with parallel.{axis}_size={size} here",
                                 fix=f"set parallel.{axis}_size=1, or parallel.ep_size=1"))
    if cfg.peft.method != "none":
        found.append(Problem("parallel.ep_size", "is not composed with an adapter (peft.method) here",
                             fix="set peft.method=none, or parallel.ep_size=1"))
    return found


def beside_shards(cfg: RunConfig) -> bool:
    """Whether the experts are plain tensors beside FSDP2's DTensors (ep_size > 1 under FSDP2):
    torch's fused and foreach optimizer kernels refuse a list mixing the two, so the optimizer
    steps one tensor at a time (its for-loop implementation)."""
    return ep_size(cfg) > 1 and cfg.parallel.strategy == "fsdp"


def model_problems(cfg: RunConfig, hf_config: Any) -> list[Problem]:
    """The model against ep_size: routed experts that divide by it, and an expert-parallel plan."""
    from overdrive.config.experts import experts_of

    ep = ep_size(cfg)
    if ep == 1:
        return []
    experts = experts_of(hf_config)
    name = type(hf_config).__name__
    if experts is None:
        return [Problem("parallel.ep_size", f"{name} has no routed experts to split",
                        fix="set parallel.ep_size=1 (it is for mixture-of-experts models: Qwen3-MoE, Mixtral, ...)")]
    found = []
    if experts.experts % ep:
        found.append(Problem("parallel.ep_size", f"the model's {experts.experts} experts do not divide by {ep}",
                             fix=f"choose an ep_size that divides {experts.experts}"))
    if not getattr(hf_config, "base_model_ep_plan", None):
        found.append(Problem("parallel.ep_size", f"{name} has no expert-parallel plan (Transformers' "
                             "base_model_ep_plan)", fix="set parallel.ep_size=1, or use a model whose config has one "
                                                        "(qwen3_moe, mixtral, ...)"))
    return found


def split_experts(model: Any, accelerator: Any, cfg: RunConfig) -> Any:
    """Each rank keeps its experts / ep_size of every MoE layer, reached by all-to-all (a no-op at ep_size 1)."""
    ep = ep_size(cfg)
    if ep == 1:
        return model
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed import DistributedConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    world = accelerator.num_processes
    mesh = init_device_mesh(accelerator.device.type, (world // ep, ep, 1), mesh_dim_names=("ep_replicate", "ep", "tp"))
    _, ep_plan, _ = model._resolve_parallel_plans(DistributedConfig(ep_size=ep, fsdp_size=ep))
    apply_expert_parallelism(model, mesh["ep"], mesh["tp"], ep_plan, ep_implementation="all_to_all")
    experts = _local_experts(model, torch)
    model._ddp_params_and_buffers_to_ignore = [name for name, _ in experts]
    if cfg.parallel.strategy == "fsdp":
        _leave_experts_to_ep(accelerator, model, {id(p) for _, p in experts})
    replicas = mesh["ep_replicate"].get_group() if world // ep > 1 else None
    for _, param in experts:
        param.register_hook(_expert_gradient(world, replicas))
    group = mesh["ep"].get_group()
    expert_ids = {id(p) for _, p in experts}
    model._expert_shards = (expert_ids, group, ep, mesh["ep"].get_local_rank())  # for hook_optimizer
    _hook_state_dict(model, *model._expert_shards)
    def clip(parameters: Iterable[Any], max_norm: float, norm_type: float = 2) -> Any:  # this accelerator only
        accelerator.unscale_gradients()  # fp16: the loss scale out first, as Accelerate's own clipping does
        return clip_grad_norm(parameters, max_norm, expert_ids, group)

    accelerator.clip_grad_norm_ = clip
    return model


def _leave_experts_to_ep(accelerator: Any, model: Any, expert_ids: set) -> None:
    """FSDP2 shards the dense weights over every data-parallel rank and leaves the experts alone
    (`ignored_params`, through Accelerate's `ignored_modules`): each rank already holds only its
    experts, whole, and their gradient is the hook's. The weights are built whole on every rank
    from the run's seed or checkpoint, so rank 0's broadcast (cpu_ram_efficient_loading, which
    moves the model to the meta device, experts included) is not needed and is turned off."""
    owners = [module for module in model.modules()
              if any(id(p) in expert_ids for p in module.parameters(recurse=False))]
    plugin = accelerator.state.fsdp_plugin
    plugin.ignored_modules = [*(plugin.ignored_modules or []), *owners]
    plugin.cpu_ram_efficient_loading = False


def _local_experts(model: Any, torch: Any) -> list:
    """The experts' DTensors as plain tensors holding this rank's experts (DDP, the optimizer's
    foreach kernels and clipping take plain tensors; the dispatch runs on local expert ids)."""
    from torch.distributed.tensor import DTensor

    found = []
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                local = torch.nn.Parameter(param.to_local().detach().clone(), requires_grad=param.requires_grad)
                module._parameters[name] = local
                found.append((f"{module_name}.{name}" if module_name else name, local))
    return found


def _expert_gradient(data_parallel: int, replicas: Any):
    """Summed over the replicas holding the same experts, divided by the data-parallel degree: the
    global batch's mean, as DDP's averaging gives the dense weights."""
    import torch.distributed as dist

    def hook(grad):
        if replicas is not None:
            grad = grad.clone()
            dist.all_reduce(grad, group=replicas)
        return grad / data_parallel

    return hook


def clip_grad_norm(parameters: Iterable[Any], max_norm: float, expert_ids: set, group: Any):
    """torch's clip_grad_norm_ (2-norm, coefficient max_norm / (norm + 1e-6), at most 1) over the whole
    model: the dense gradients (the same on every rank under DDP; FSDP2's shards, DTensors, summed
    over their mesh) and every rank's experts' (summed over the ep group)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [(p.grad, id(p) in expert_ids) for p in parameters if p.grad is not None]
    device = next(((g.to_local() if isinstance(g, DTensor) else g).device for g, _ in grads), torch.device("cpu"))

    def squares(g: Any) -> Any:
        return g.detach().float().pow(2).sum()

    dense = sum((squares(g) for g, e in grads if not e and not isinstance(g, DTensor)), torch.zeros((), device=device))
    sharded = [squares(g) for g, e in grads if not e and isinstance(g, DTensor)]
    if sharded:  # every rank holds FSDP2 shards of the same parameters: one reduction over their mesh
        dense = dense + sum(sharded[1:], sharded[0]).full_tensor()
    routed = sum((squares(g) for g, e in grads if e), torch.zeros((), device=device))
    dist.all_reduce(routed, group=group)
    total = (dense + routed).sqrt()
    if max_norm is not None and not math.isinf(max_norm):
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g, _ in grads:
            g.mul_(coefficient.to(g.dtype))
    return total


def _hook_state_dict(model: Any, expert_ids: set, group: Any, ep: int, ep_rank: int) -> None:
    """The experts whole in every state dict (gathered over the ep group, a collective: every rank
    asks, as the final save does), and cut back to this rank's on loading."""
    import torch
    import torch.distributed as dist

    names = {name for name, p in model.named_parameters() if id(p) in expert_ids}

    def gather(module, state_dict, prefix, local_metadata):
        for key in sorted(prefix + name for name in names if prefix + name in state_dict):
            local = state_dict[key].contiguous()
            parts = [torch.empty_like(local) for _ in range(ep)]
            dist.all_gather(parts, local, group=group)
            state_dict[key] = torch.cat(parts, dim=0)
        return state_dict

    def cut(state_dict, prefix, *args):
        local = dict(model.named_parameters())
        for key in names:
            full = state_dict.get(prefix + key)
            if full is not None and full.shape[0] == local[key].shape[0] * ep:
                state_dict[prefix + key] = full.chunk(ep, dim=0)[ep_rank]

    model._register_state_dict_hook(gather)
    model._register_load_state_dict_pre_hook(cut)


def hook_optimizer(optimizer: Any, model: Any) -> None:
    """The optimizer's state of the experts (Adam's moments) gathered whole in its state dict, every
    rank taking part as Accelerate's `save_state` has each rank call `state_dict()`, and cut back to
    this rank's experts on loading: a checkpoint of an expert-parallel run is a plain DDP one, which
    resumes at any ep_size or none. A no-op unless `split_experts` split the model's experts."""
    shards = getattr(model, "_expert_shards", None)
    if shards is None:
        return
    import torch
    import torch.distributed as dist

    expert_ids, group, ep, rank = shards
    params = [p for g in optimizer.param_groups for p in g["params"]]
    local = {i: p.shape[0] for i, p in enumerate(params) if id(p) in expert_ids}

    def gather(_optimizer, state_dict):
        for index in sorted(local):
            # A new dict per parameter: `state_dict()` hands out the optimizer's own ones, and the
            # gathered moments written there would be the ones the next step updates.
            values = dict(state_dict["state"].get(index, {}))
            for name, value in list(values.items()):
                if torch.is_tensor(value) and value.dim() and value.shape[0] == local[index]:
                    parts = [torch.empty_like(value) for _ in range(ep)]
                    dist.all_gather(parts, value.contiguous(), group=group)
                    values[name] = torch.cat(parts, dim=0)
            if index in state_dict["state"]:
                state_dict["state"][index] = values
        return state_dict

    def cut(_optimizer, state_dict):
        for index, rows in local.items():
            values = state_dict["state"].get(index, {})
            for name, value in list(values.items()):
                if torch.is_tensor(value) and value.dim() and value.shape[0] == rows * ep:
                    values[name] = value.chunk(ep, dim=0)[rank].clone()
        return state_dict

    optimizer.register_state_dict_post_hook(gather)
    optimizer.register_load_state_dict_pre_hook(cut)
