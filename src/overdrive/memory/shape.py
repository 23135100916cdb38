"""What the estimator needs to know about a model and a run, as plain values.

`ModelShape` is read off a model built on the meta device (model_shape.py); `Setup` is the
run: devices, precision, batch, sequence length and the strategies' buffer settings. Both
are plain frozen dataclasses so the formulas (formulas.py, activations.py) stay pure
arithmetic that a test can drive with hand-written numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Optional

from overdrive.strategies import registry
import overdrive.config.optimizer_catalog as optimizer_catalog

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

Precision = Literal["no", "fp16", "bf16"]
Target = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class ModelShape:
    """A transformer's sizes, and the parameter tensors that shape sharding and padding."""

    name: str
    model_type: str
    params: int
    """Unique trainable parameters (tied embeddings count once)."""
    param_shapes: tuple[tuple[int, ...], ...]
    """Every unique parameter's shape: ZeRO-3 partitions and FSDP2 shards pad per tensor, and
    ZeRO-3 keeps tensors of at most its persistence threshold whole on every rank."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    block_params: int
    """Parameters of one repeated block: an FSDP2 unit under transformer-based wrapping."""
    root_params: int
    """Parameters outside the blocks (embeddings, final norm, untied head): FSDP2's root unit."""
    largest_module_params: int
    """Most parameters one module owns directly: the largest single ZeRO-3 fetch."""
    autocast_params: int
    """Parameters of matrix multiplies (linear weights and biases, a tied output embedding):
    what autocast copies to 16 bits in the forward pass."""
    hidden_matrix_params: int = 0
    """Parameters of the 2-D tensors inside the blocks: what Muon orthogonalises."""
    mlp: Literal["plain", "gated"] = "plain"
    activation: str = "gelu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0
    embd_dropout: float = 0.0
    attn_implementation: Optional[str] = None
    learned_positions: bool = False
    rotary: bool = False
    tp_split: tuple[int, ...] = ()
    """Per entry of `param_shapes`, the dimension the model's tensor-parallel plan splits it along
    (-1: kept whole on every tp rank). Empty: the model has no plan."""
    block_tp_split_params: int = 0
    """Parameters of one block that the tensor-parallel plan splits."""
    experts: int = 0
    """Routed experts per MoE layer (config/experts.py); 0: a dense model."""
    top_k: int = 0
    """Experts each token is routed to."""
    expert_params: int = 0
    """Parameters of all the routed experts (their stacked or per-expert weights)."""
    expert_tensors: tuple[bool, ...] = ()
    """Per entry of `param_shapes`, whether it is a routed expert's tensor (dim 0 the experts when stacked)."""
    parts: tuple[str, ...] = ()
    """A vision-language model: per entry of `param_shapes`, `language`, `vision` or `projector`
    (hf/vision.part_of). Empty: a text model."""
    vision_hidden: int = 0
    """A vision-language model's vision tower: its width and blocks (what it keeps when it trains)."""
    vision_layers: int = 0
    explicit_head_dim: int = 0
    """The config's head_dim where it is not hidden / heads (Qwen3: 128 at every width); 0: hidden / heads."""
    q_norm: int = 0
    """Qwen3, Gemma 3, OLMo 2: the length Q's RMSNorm normalises over (a head's, or the whole width); 0: none."""
    k_norm: int = 0

    @property
    def active_params(self) -> int:
        """Parameters one token meets: the dense ones and top_k of the experts (6 x this is the
        training FLOPs per token that MFU counts, not 6 x `params`)."""
        if not self.experts:
            return self.params
        return self.params - round(self.expert_params * (1 - min(self.top_k / self.experts, 1.0)))

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads


@dataclass(frozen=True)
class Setup:
    """One training configuration to estimate. `None` bucket sizes mean Accelerate's "auto"
    rules (transformers.integrations.deepspeed): reduce h^2, prefetch 0.9 h^2, persistence 10 h."""

    devices: int = 1
    precision: Precision = "bf16"
    micro_batch: int = 1
    seq_len: int = 2048
    checkpointing: bool = False
    target: Target = "cuda"
    # DeepSpeed ZeRO
    reduce_bucket_size: Optional[int] = None
    prefetch_bucket_size: Optional[int] = None
    persistence_threshold: Optional[int] = None
    overlap_comm: Optional[bool] = None
    """DeepSpeed's default: on for stage 3, off for stages 1 and 2."""
    contiguous_gradients: bool = True
    sub_group_size: int = 1_000_000_000
    grad_accum_fp32: bool = False
    """`data_types.grad_accum_dtype: fp32` in the DeepSpeed config: a full fp32 gradient buffer."""
    # DDP and FSDP2
    gradient_as_bucket_view: bool = True
    reshard_after_forward: bool = True
    # The optimizer (optim.name; config/optimizer_catalog.py knows its state) and SGD's momentum.
    optimizer: str = "adamw"
    momentum: Optional[float] = None
    # The N-D layout (strategies/layout.py): devices = dp_replicate x dp_shard x tp x cp x sp.
    tp: int = 1
    cp: int = 1
    sp: int = 1
    dp_replicate: int = 1
    ep: int = 1
    """Expert parallel (parallel.ep_size): each rank of an EP group holds experts / ep of the routed experts."""
    extra_notes: tuple[str, ...] = field(default_factory=tuple)
    adapter: Optional[Any] = None
    """An adapter run (memory/adapter.AdapterShape): frozen base, trained adapter."""
    reference_copy: bool = False
    """Preference training (DPO, IPO) of every parameter: a frozen copy of the starting weights
    is the reference model, whole on every rank (training/objectives/reference.py)."""
    generation_tokens: int = 0
    """RL (rl.method): the tokens a rank generates at once, its step's completions (micro_batch_size x
    gradient_accumulation_steps, or one group where the micro-batch is not fixed) x (data.max_length +
    rl.max_completion_length) at most, whose KV cache the policy holds while it samples them."""
    teacher_params: int = 0
    """Distillation (distill.teacher): the teacher's parameters, frozen, in the student's dtype, placed as
    the student is: whole on every rank, or over the ranks that shard it (strategies/frozen.py)."""
    teacher_bytes: int = 4
    """Bytes of a teacher parameter: 2 where model.dtype is a 16-bit type, else 4."""
    loss_kernel: str = "full"
    """The token loss's kernel as it runs (`training.loss_kernel`, `auto` settled): full, chunked or fused."""
    logits_held: bool = False
    """The loss step keeps the model's logits until backward (preference methods' log-probabilities);
    a causal LM's own loss drops them once the loss is taken."""
    activation_offloading: bool = False
    """`training.activation_offloading`: saved activations in host memory between forward and backward."""
    frozen_parts: tuple[str, ...] = ()
    """A vision-language model's parts that do not train (`model.vision.freeze`, `model.vision.train_projector`):
    weights only, no gradients or optimizer state."""
    image_tokens: int = 0
    """Tokens one image takes in a row (hf/vision_sizes.py): part of `seq_len`, as data.max_length counts them."""
    image_patches: int = 0
    """Patches the vision tower runs over for one image (before Qwen2-VL's merge; LLaVA's CLS included)."""

    @property
    def mixed(self) -> bool:
        return self.precision in ("fp16", "bf16")

    @property
    def half_bytes(self) -> int:
        """Bytes of a "16-bit" value in this run: 2 with mixed precision, 4 in plain fp32."""
        return 2 if self.mixed else 4

    @property
    def shard_ranks(self) -> int:
        """Ranks that split the model states of one tensor-parallel slice: FSDP2 shards over
        dp_shard x cp (Accelerate's dp_shard_cp mesh), ZeRO over every data-parallel rank
        (Ulysses' sequence ranks included); replicas (dp_replicate) hold copies."""
        return max(self.devices // (self.dp_replicate * self.tp), 1)

    @property
    def local_seq_len(self) -> int:
        """Tokens of a sample on one rank: context and sequence parallel split the sequence."""
        return max(self.seq_len // (self.cp * self.sp), 1)

    def buckets(self, hidden: int) -> tuple[int, int, int]:
        """(reduce, prefetch, persistence) in elements, with the "auto" rules applied."""
        reduce = self.reduce_bucket_size if self.reduce_bucket_size is not None else hidden * hidden
        prefetch = self.prefetch_bucket_size if self.prefetch_bucket_size is not None else int(0.9 * hidden * hidden)
        persist = self.persistence_threshold if self.persistence_threshold is not None else 10 * hidden
        return reduce, prefetch, persist


    def optimizer_state_bytes(self, shape: "ModelShape") -> float:
        """Optimizer state per trainable parameter, averaged over the model (Adafactor's factored
        moments and Muon's split depend on the shapes)."""
        kind = optimizer_catalog.KINDS.get(self.optimizer, optimizer_catalog.CLASS_PATH)
        matrices = [s for s in shape.param_shapes if len(s) == 2]
        counts = optimizer_catalog.Counts(total=shape.params, matrices=sum(r * c for r, c in matrices),
                                          matrix_sides=sum(r + c for r, c in matrices),
                                          hidden_matrices=shape.hidden_matrix_params)
        return kind.state_bytes(counts, self.momentum) / max(shape.params, 1)

    def optimizer_words(self) -> str:
        return optimizer_catalog.KINDS.get(self.optimizer, optimizer_catalog.CLASS_PATH).state_words


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


def zero3_partition_numel(shape: tuple[int, ...], devices: int) -> int:
    """ZeRO-3 splits each parameter flat into `devices` equal parts, the last one padded
    (deepspeed/runtime/zero/partition_parameters.py: `partition_size = ceil(numel / world)`)."""
    return -(-numel(shape) // devices)


def fsdp2_shard_numel(shape: tuple[int, ...], devices: int) -> int:
    """FSDP2 shards each parameter on dim 0 and pads every shard to the largest chunk
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, `padded_sharded_param_size`)."""
    if not shape:
        return 1
    rows = -(-shape[0] // devices)
    return rows * numel(shape[1:])


def _int_or_none(value) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def setup_for_run(cfg: RunConfig, target: Target = "cuda", **changes) -> Setup:
    """The Setup a run config describes; `changes` (devices=..., precision=...) win."""
    ds, t = cfg.parallel.deepspeed, cfg.training
    data_types = (ds.extra.get("data_types") or {}) if isinstance(ds.extra, dict) else {}
    zero_extra = (ds.extra.get("zero_optimization") or {}) if isinstance(ds.extra, dict) else {}
    precision = cfg.precision.mixed_precision
    values = dict(
        devices=cfg.launch.num_processes,
        # fp8 keeps bf16 weights and gradients around its fp8 matmuls: count it as bf16.
        precision="bf16" if precision == "fp8" else precision,
        micro_batch=_int_or_none(t.micro_batch_size) or 1,
        seq_len=cfg.data.max_length,
        checkpointing=cfg.model.gradient_checkpointing or registry.of(cfg).activation_checkpointing(cfg),
        target=target,
        reduce_bucket_size=_int_or_none(zero_extra.get("reduce_bucket_size", ds.reduce_bucket_size)),
        prefetch_bucket_size=_int_or_none(zero_extra.get("stage3_prefetch_bucket_size", ds.stage3_prefetch_bucket_size)),
        persistence_threshold=_int_or_none(
            zero_extra.get("stage3_param_persistence_threshold", ds.stage3_param_persistence_threshold)),
        overlap_comm=zero_extra.get("overlap_comm", ds.overlap_comm),
        contiguous_gradients=zero_extra.get("contiguous_gradients", ds.contiguous_gradients) is not False,
        sub_group_size=int(zero_extra.get("sub_group_size", ds.sub_group_size or 1_000_000_000)),
        grad_accum_fp32=str(data_types.get("grad_accum_dtype", "")).lower() in ("fp32", "float32"),
        gradient_as_bucket_view=cfg.parallel.ddp.gradient_as_bucket_view,
        reshard_after_forward=cfg.parallel.fsdp.reshard_after_forward,
        optimizer=optimizer_catalog.of(cfg).name,
        momentum=cfg.optim.momentum,
        reference_copy=_reference_copy(cfg),
        generation_tokens=_generation_tokens(cfg),
        loss_kernel=_loss_kernel(cfg, target),
        # preference methods' log-probabilities; distillation's divergence over the whole logits
        logits_held=cfg.preference.method != "none" or cfg.distill.teacher is not None,
        activation_offloading=cfg.training.activation_offloading,
        **_vision_of(cfg),
        **_layout_of(cfg, changes.get("devices")),
    )
    values.update({k: v for k, v in changes.items() if v is not None})
    return Setup(**values)


def _loss_kernel(cfg: RunConfig, target: Target) -> str:
    from overdrive.resolving.validate_loss import kernel_runs  # the one rule train asks too

    return kernel_runs(cfg, target)


def _reference_copy(cfg: RunConfig) -> bool:
    from overdrive.config.schema_preference import WITH_REFERENCE

    p = cfg.preference
    rl_reference = cfg.rl.method != "none" and cfg.rl.beta != 0.0  # GRPO's KL term
    return (p.method in WITH_REFERENCE or rl_reference) and cfg.peft.method == "none" and not p.precompute_reference


def _generation_tokens(cfg: RunConfig) -> int:
    if cfg.rl.method == "none":
        return 0
    micro = cfg.training.micro_batch_size  # a rank's step is sampled in one batch (training/generation/sampling.py)
    at_once = micro * cfg.training.gradient_accumulation_steps if isinstance(micro, int) else cfg.rl.num_generations
    return at_once * (cfg.data.max_length + cfg.rl.max_completion_length)


def _vision_of(cfg: RunConfig) -> dict:
    """A vision-language model's frozen parts and image sizes (hf/vision.py, hf/vision_sizes.py); nothing for a
    text model."""
    from overdrive.hf.vision import declared, trained_parts

    if not declared(cfg):
        return {}
    from overdrive.hf.model_config import model_config, quiet_transformers
    from overdrive.hf.vision_sizes import of_run

    try:
        with quiet_transformers():
            tokens, patches, _ = of_run(cfg, model_config(cfg))
    except Exception:  # a hub model not readable here: the shape's own read says so, by key
        tokens = patches = 0
    frozen = tuple(p for p in ("vision", "projector") if p not in trained_parts(cfg.model.vision))
    return dict(frozen_parts=frozen, image_tokens=tokens, image_patches=patches)


def _layout_of(cfg: RunConfig, devices: Optional[int]) -> dict:
    from overdrive.strategies import layout

    lay = layout.layout(cfg, devices)
    return dict(tp=lay.tp, cp=lay.cp, sp=lay.sp, dp_replicate=lay.dp_replicate, ep=int(cfg.parallel.ep_size))


def tp_slice(shape: ModelShape, tp: int) -> ModelShape:
    """What one tensor-parallel rank holds of `shape`: every tensor the plan splits, divided
    along its split dimension (rounded up, as Transformers' uneven shards are)."""
    if tp == 1 or not shape.tp_split:
        return shape
    import dataclasses

    sliced = tuple(s if d < 0 else tuple(-(-n // tp) if i == d % len(s) else n for i, n in enumerate(s))
                   for s, d in zip(shape.param_shapes, shape.tp_split))
    params = sum(numel(s) for s in sliced)
    removed = shape.params - params
    block = shape.block_params - shape.block_tp_split_params + -(-shape.block_tp_split_params // tp)
    return dataclasses.replace(
        shape, params=params, param_shapes=sliced, block_params=block,
        root_params=max(params - shape.layers * block, 0),
        largest_module_params=-(-shape.largest_module_params // tp),
        autocast_params=max(shape.autocast_params - removed, 0))


def trained_and_frozen(shape: ModelShape, frozen_parts: tuple[str, ...]) -> tuple[ModelShape, tuple]:
    """A vision-language model split by `Setup.frozen_parts`: (the shape of what trains, whose model states the
    strategies' formulas count; the frozen tensors' shapes, held as weights only)."""
    if not shape.parts or not frozen_parts:
        return shape, ()
    import dataclasses

    kept = [i for i, part in enumerate(shape.parts) if part not in frozen_parts]
    frozen = tuple(shape.param_shapes[i] for i, part in enumerate(shape.parts) if part in frozen_parts)
    params = sum(numel(shape.param_shapes[i]) for i in kept)
    removed = shape.params - params

    def keep(values: tuple) -> tuple:
        return tuple(values[i] for i in kept) if values else values

    return dataclasses.replace(
        shape, params=params, param_shapes=keep(shape.param_shapes), parts=keep(shape.parts),
        tp_split=keep(shape.tp_split), expert_tensors=keep(shape.expert_tensors),
        root_params=max(shape.root_params - removed, 0),
        autocast_params=max(shape.autocast_params - removed, 0)), frozen


def strategy_of_run(cfg: RunConfig) -> str:
    """The estimator row a run config selects."""
    return registry.of(cfg).estimator_row(cfg)


def ep_slice(shape: ModelShape, ep: int) -> ModelShape:
    """What one expert-parallel rank holds of `shape` when the strategy keeps parameters whole: the
    routed experts' tensors cut on their expert dimension (dim 0 of a stacked tensor; a per-expert
    module's tensors are counted whole, as a share of the experts)."""
    if ep == 1 or not shape.experts or not shape.expert_tensors:
        return shape
    import dataclasses

    sliced = tuple((-(-s[0] // ep), *s[1:]) if is_expert and s and s[0] == shape.experts else s
                   for s, is_expert in zip(shape.param_shapes, shape.expert_tensors))
    whole_experts = sum(numel(s) for s, e in zip(shape.param_shapes, shape.expert_tensors) if e and s and s[0] != shape.experts)
    params = sum(numel(s) for s in sliced) - whole_experts + -(-whole_experts // ep)
    removed = shape.params - params
    block = shape.block_params - -(-removed // max(shape.layers, 1))
    return dataclasses.replace(shape, params=params, param_shapes=sliced, expert_params=shape.expert_params - removed,
                               block_params=block, autocast_params=max(shape.autocast_params - removed, 0))


def dense_and_held_experts(shape: ModelShape, ep: int) -> tuple[ModelShape, ModelShape]:
    """Expert parallel beside FSDP2: (what FSDP2 shards, every tensor but the routed experts'; the
    experts one ep rank holds whole, `ep_slice`'s share, which FSDP2 leaves alone)."""
    import dataclasses

    held = ep_slice(shape, ep)
    dense_shapes = tuple(s for s, e in zip(shape.param_shapes, shape.expert_tensors) if not e)
    expert_shapes = tuple(s for s, e in zip(held.param_shapes, held.expert_tensors) if e)
    per_layer = -(-shape.expert_params // max(shape.layers, 1))
    dense = dataclasses.replace(shape, params=shape.params - shape.expert_params, param_shapes=dense_shapes,
                                expert_params=0, expert_tensors=(False,) * len(dense_shapes),
                                block_params=max(shape.block_params - per_layer, 0),
                                autocast_params=max(shape.autocast_params - shape.expert_params, 0))
    experts = dataclasses.replace(held, params=held.expert_params, param_shapes=expert_shapes,
                                  expert_tensors=(True,) * len(expert_shapes), root_params=0,
                                  block_params=-(-held.expert_params // max(shape.layers, 1)),
                                  autocast_params=held.expert_params, hidden_matrix_params=held.expert_params)
    return dense, experts
