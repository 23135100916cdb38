"""`parallel.*`: how the work is split across processes (DDP, DeepSpeed ZeRO, FSDP2), and the
N-D layout Accelerate's ParallelismConfig composes on top (HSDP, tensor, context, sequence)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field

from overdrive.config.sections import Auto, NonNegativeInt, OffloadDevice, Section


class DdpConfig(Section):
    """DistributedDataParallel (also the single-process path)."""

    find_unused_parameters: bool = Field(False, description="Tolerate parameters without gradients (slower).")
    bucket_cap_mb: int = Field(25, ge=1, description="Gradient all-reduce bucket size.")
    broadcast_buffers: bool = Field(True, description="Broadcast buffers from rank 0 every forward.")
    gradient_as_bucket_view: bool = Field(True, description="Gradients alias the all-reduce buckets (saves memory).")
    static_graph: bool = Field(False, description="Declare the graph static across steps (enables optimisations).")


class DeepSpeedConfig(Section):
    """DeepSpeed ZeRO. A DeepSpeed JSON given as a config file is mapped onto these keys;
    what has no key here is kept verbatim in `extra`."""

    zero_stage: Literal[0, 1, 2, 3] = Field(
        2, description="0: DDP-like; 1: shard optimizer states; 2: + gradients; 3: + parameters."
    )
    offload_optimizer: OffloadDevice = Field("none", description="Keep optimizer states on cpu or nvme (ZeRO 1-3).")
    offload_param: OffloadDevice = Field("none", description="Keep parameters on cpu or nvme (ZeRO-3 only).")
    nvme_path: Optional[str] = Field(None, description="Directory on a fast local disk for nvme offload.")
    offload_pin_memory: bool = Field(True, description="Page-locked host buffers for offload.")
    zero3_init: bool = Field(False, description="ZeRO-3: build the model already sharded (for models too large to build whole).")
    zero3_save_16bit_model: bool = Field(
        True, description="ZeRO-3: gather the 16-bit weights on save so save_pretrained writes a whole model."
    )
    overlap_comm: Optional[bool] = Field(None, description="Overlap gradient reduction with backward. Empty: DeepSpeed's default.")
    contiguous_gradients: Optional[bool] = Field(None, description="Copy gradients into one buffer as they are produced.")
    reduce_bucket_size: Union[NonNegativeInt, Auto] = Field("auto", description="Elements per reduce bucket; `auto`: hidden^2.")
    allgather_bucket_size: Optional[int] = Field(None, ge=0, description="Elements per all-gather bucket (ZeRO 1-2).")
    stage3_prefetch_bucket_size: Union[NonNegativeInt, Auto] = Field("auto", description="ZeRO-3 prefetch elements; `auto`: 0.9 x hidden^2.")
    stage3_param_persistence_threshold: Union[NonNegativeInt, Auto] = Field(
        "auto", description="ZeRO-3: parameters smaller than this stay whole; `auto`: 10 x hidden."
    )
    stage3_max_live_parameters: Optional[int] = Field(None, ge=0, description="ZeRO-3: live parameters before release.")
    stage3_max_reuse_distance: Optional[int] = Field(None, ge=0, description="ZeRO-3: reuse distance before release.")
    sub_group_size: Optional[int] = Field(None, ge=0, description="ZeRO-3: optimizer step granularity (0 is allowed, as DeepSpeed allows it).")
    activation_checkpointing: bool = Field(False, description="DeepSpeed's activation checkpointing (partitioned activations).")
    train_batch_size: Optional[int] = Field(
        None, ge=1, description="Only checked: must equal micro-batch x accumulation x world size."
    )
    loss_scale: float = Field(0, ge=0, description="fp16: 0 for dynamic loss scaling, else a fixed scale.")
    initial_scale_power: int = Field(16, ge=0, description="fp16: initial dynamic scale is 2^this.")
    loss_scale_window: int = Field(1000, ge=1, description="fp16: steps without overflow before the scale grows.")
    hysteresis: int = Field(2, ge=1, description="fp16: overflows tolerated before the scale shrinks.")
    min_loss_scale: float = Field(1, gt=0, description="fp16: lowest dynamic scale.")
    config_file: Optional[str] = Field(
        None, description="A DeepSpeed JSON the run was configured from (shown for reference; its values are mapped onto these keys)."
    )
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="Further DeepSpeed config entries passed through verbatim (e.g. steps_per_print).",
    )


class FsdpConfig(Section):
    """PyTorch FSDP2 (fully_shard)."""

    version: Literal[1, 2] = Field(2, description="FSDP API. 2 (fully_shard) is the one that runs everywhere, CPU included.")
    reshard_after_forward: bool = Field(
        True, description="Free gathered parameters after forward (ZeRO-3-like). False keeps them to backward (ZeRO-2-like)."
    )
    offload_params: bool = Field(False, description="Keep parameters and gradients on the CPU between uses.")
    auto_wrap_policy: Literal["transformer_based_wrap", "size_based_wrap", "no_wrap"] = Field(
        "transformer_based_wrap", description="How modules become FSDP units."
    )
    transformer_layer_cls_to_wrap: Optional[list[str]] = Field(
        None, description="Layer classes to shard as units. Empty: the model's `_no_split_modules`."
    )
    min_num_params: int = Field(100_000_000, ge=1, description="size_based_wrap: parameters per unit.")
    state_dict_type: Literal["full_state_dict", "sharded_state_dict"] = Field(
        "sharded_state_dict", description="Checkpoint layout: one gathered file, or one shard per rank."
    )
    activation_checkpointing: bool = Field(False, description="Recompute each wrapped layer's activations in backward.")
    cpu_ram_efficient_loading: bool = Field(True, description="Load pretrained weights on rank 0 only, then broadcast.")
    sync_module_states: bool = Field(True, description="Broadcast rank 0's weights at wrap time.")
    backward_prefetch: Optional[Literal["backward_pre", "backward_post"]] = Field(
        "backward_pre", description="FSDP1: when to prefetch the next unit's parameters in backward."
    )
    forward_prefetch: bool = Field(False, description="FSDP1: prefetch in forward.")
    use_orig_params: bool = Field(True, description="FSDP1: expose original parameters (needed by torch.compile).")
    ignored_modules: Optional[str] = Field(None, description="Regex of module names FSDP leaves alone.")


class ParallelConfig(Section):
    """How the work is split across processes."""

    strategy: Literal["ddp", "deepspeed", "fsdp"] = Field(
        "ddp", description="ddp (plain data parallel, also one process), deepspeed (ZeRO), or fsdp (FSDP2)."
    )
    ddp: DdpConfig = Field(default_factory=DdpConfig, description="DDP settings.")
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig, description="DeepSpeed settings.")
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig, description="FSDP settings.")
    dp_replicate_size: int = Field(
        1, ge=1, description="Data-parallel replicas. With fsdp and dp_shard_size > 1: HSDP (shard within a "
        "replica, all-reduce across replicas; set it to the number of machines).")
    dp_shard_size: Optional[int] = Field(
        None, ge=1, description="Ranks the fsdp strategy shards the model over. Empty: the rest of the world, "
        "num_processes / (dp_replicate_size x pp_size x tp_size x cp_size x sp_size).")
    tp_size: int = Field(
        1, ge=1, description="Tensor parallel degree (Transformers' tensor-parallel plan of the model; heads and KV "
        "heads must divide by it). Its ranks see the same batch.")
    cp_size: int = Field(
        1, ge=1, description="Context parallel degree (torch ring attention over the sequence; needs fsdp and CUDA). "
        "data.max_length must divide by 2 x cp_size.")
    cp_comm_strategy: Literal["allgather", "alltoall"] = Field(
        "allgather", description="How context-parallel ranks exchange keys and values (Accelerate's cp_comm_strategy).")
    sp_size: int = Field(
        1, ge=1, description="Sequence parallel degree (DeepSpeed Ulysses/ALST; needs deepspeed and CUDA). "
        "Attention heads and data.max_length must divide by it.")
    sp_seq_length_is_variable: bool = Field(
        True, description="Sequence parallel: batches may differ in length (False: every batch is sp_seq_length long).")
    sp_seq_length: Optional[int] = Field(
        None, ge=1, description="Sequence parallel: the fixed sequence length when sp_seq_length_is_variable is false. "
        "Empty: data.max_length.")
    sp_attn_implementation: Literal["sdpa", "flash_attention_2", "flash_attention_3"] = Field(
        "sdpa", description="Sequence parallel: the attention kernel DeepSpeed's Ulysses wraps.")
    ep_size: int = Field(
        1, ge=1, description="Expert parallel degree: a mixture-of-experts model's routed experts split over this "
        "many ranks of the data-parallel group (experts / ep_size each), tokens sent to their experts' ranks by "
        "all-to-all (Transformers' expert-parallel plan). Routed experts and the data-parallel degree must divide "
        "by it. With parallel.strategy=ddp or fsdp (FSDP2 shards the dense weights, the experts stay whole on their "
        "rank; each rank its own batch); runs over gloo on CPU processes too.")
    pp_size: int = Field(
        1, ge=1, description="Pipeline parallel degree: the model's decoder layers split into stages, one group of "
        "ranks per stage (torch.distributed.pipelining; the embedding goes with the first stage, the final norm "
        "and head with the last). Its ranks see the same batch.")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                         "zbv_zero_bubble", "dual_pipe_v"] = Field(
        "1f1b", description="Pipeline schedule (torch's): gpipe (all forwards, then all backwards), 1f1b (one "
        "forward, one backward: fewer microbatches in flight), interleaved_1f1b and looped_bfs (several stages per "
        "rank: a smaller bubble), interleaved_zero_bubble, zbv_zero_bubble and dual_pipe_v (backward split into "
        "input and weight gradients).")
    pp_microbatches: Optional[int] = Field(
        None, ge=1, description="Pipeline microbatches per optimizer step: the step's samples on one data-parallel "
        "replica (micro_batch_size x gradient_accumulation_steps) are split into this many. Empty: "
        "gradient_accumulation_steps when it is at least pp_size (each micro-batch is one pipeline microbatch), "
        "else one sample per microbatch.")
    pp_stages_per_rank: Optional[int] = Field(
        None, ge=1, description="Pipeline stages each rank holds. Empty: 1 for gpipe and 1f1b, 2 for the "
        "multi-stage schedules (interleaved_1f1b, looped_bfs, interleaved_zero_bubble; zbv_zero_bubble and "
        "dual_pipe_v need exactly 2).")
