"""Model states and temporary buffers per device, for each strategy, written out.

The reference is the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", sec. 3.1 and 5): mixed-precision Adam keeps
2*Psi bytes of 16-bit parameters, 2*Psi of 16-bit gradients and K*Psi of optimizer states,
K = 12 (fp32 master weights 4, momentum 4, variance 4), and

    stage 0 (DDP)   (2 + 2 + K) * Psi
    ZeRO-1          2*Psi + 2*Psi + K*Psi/N
    ZeRO-2          2*Psi + (2 + K)*Psi/N
    ZeRO-3          (2 + 2 + K)*Psi/N

`zero_paper_bytes` is that table. The rows below are what each implementation holds, which
is where it differs from the paper (every difference named in `Row.terms`):

- Accelerate's DDP and FSDP2 keep the weights in fp32 and compute under autocast (or an
  FSDP2 mixed-precision policy): parameters 4, gradients 4, Adam 8 bytes per parameter,
  no separate master copy (the fp32 weights are it) - the same 16 bytes, split differently.
- DeepSpeed ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py) always clones an fp32
  master partition (`single_partition_of_fp32_groups`), even when the model is already
  fp32. In step() it builds an fp32 gradient partition (the master's `.grad`) while the
  16-bit partition is still referenced by the next parameter group's `averaged_gradients`
  (the trainer's no-decay group): (2 + 4)*Psi/N of gradients where the paper counts 2*Psi/N.
  ZeRO-1 reduces only at the end of backward, so whole 16-bit gradients exist until then.
- DeepSpeed ZeRO-3 (stage3.py) keeps a flat gradient-partition buffer
  (`grad_partitions_flat_buffer`) plus an fp32 copy per optimizer sub-group in the step, and
  an fp32 master clone (also for an fp32 model: its no-copy shortcut compares a
  torch.device with a string, never equal). Parameters of at most
  `stage3_param_persistence_threshold` elements stay whole on every rank.
- Gradients whose reduce hook fires last (a tied or input embedding) are still whole when
  backward ends: ZeRO-2/3 hold the largest parameter's gradient on top of the partition.

Each of these was measured per rank on 2 CPU processes (tests/memory_probe.py).

The optimizer's state is the run's optimizer's (`Setup.optimizer_state_bytes`, from
config/optimizer_catalog.py): Adam's 8 bytes per parameter by default, SGD 4 (0 without
momentum), Lion 4, 8-bit AdamW 2, Adafactor its row and column vectors, Muon 4 on the hidden
matrices and AdamW's 8 on the rest.
N-D layouts: with tensor parallel each rank holds its slice of every tensor the model's plan
splits (shape.tp_slice), and the strategies above shard that slice over `Setup.shard_ranks`
(FSDP2: dp_shard x cp; HSDP's replicas hold copies). For mixed-precision Adam this is the
ZeRO paper's 16*Psi / N with N = tp x shard ranks, the Megatron-LM + ZeRO composition
(Rajbhandari et al. 2020, sec. 8; Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from overdrive.memory.shape import ModelShape, Setup, fsdp2_shard_numel, numel, zero3_partition_numel

MASTER_BYTES = 4  # fp32 copy of the weights
FIELDS = ("params_bytes", "grads_bytes", "optimizer_bytes", "master_weights_bytes", "activations_bytes",
          "buffers_bytes")


def zero_paper_bytes(psi: float, devices: int, stage: int, k: int = 12) -> dict[str, float]:
    """Per-device model states from the ZeRO paper, sec. 3.1 and 5 (K=12: mixed-precision Adam)."""
    n = devices
    params = 2 * psi / n if stage >= 3 else 2 * psi
    grads = 2 * psi / n if stage >= 2 else 2 * psi
    optimizer = k * psi / n if stage >= 1 else k * psi
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


@dataclass
class Row:
    """One strategy's bytes per device (and per process in host RAM)."""

    strategy: str
    label: str
    params_bytes: int = 0
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    master_weights_bytes: int = 0
    activations_bytes: int = 0
    buffers_bytes: int = 0
    host_bytes: int = 0
    activations_saved_bytes: int = 0
    activations_full_bytes: int = 0
    activations_checkpointed_bytes: int = 0
    fits: bool | None = None
    # Why train would refuse this row's strategy with the sizes asked (`<key>: <why>`, memory/refusals.py);
    # None: it would run. A refused row never fits.
    refused: str | None = None
    terms: list[tuple[str, str, int]] = field(default_factory=list)
    """(field, what, bytes): every addend, so each number can be traced to its cause."""
    notes: list[str] = field(default_factory=list)

    def add(self, target: str, what: str, nbytes: float) -> None:
        nbytes = int(round(nbytes))
        if target == "host":
            self.host_bytes += nbytes
        else:
            setattr(self, target, getattr(self, target) + nbytes)
        self.terms.append((target, what, nbytes))

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, name) for name in FIELDS)

    def to_dict(self) -> dict:
        out = {name: getattr(self, name) for name in ("strategy", "label", *FIELDS)}
        out.update(total_bytes=self.total_bytes, host_bytes=self.host_bytes, fits=self.fits, refused=self.refused,
                   activations_saved_bytes=self.activations_saved_bytes,
                   activations_full_bytes=self.activations_full_bytes,
                   activations_checkpointed_bytes=self.activations_checkpointed_bytes,
                   terms=[{"field": f, "what": w, "bytes": b} for f, w, b in self.terms], notes=list(self.notes))
        return out


# ------------------------------------------------------------------ helpers


def _flat_numel(shape: ModelShape, devices: int) -> int:
    """ZeRO-1/2 flatten each parameter group and pad it to 2*N elements (stage_1_and_2.py,
    `nccl_start_alignment_factor * world`); two groups (decay / no decay) pad at most twice."""
    align = 2 * devices
    return -(-shape.params // align) * align


def _zero3_numel(shape: ModelShape, setup: Setup) -> tuple[int, int]:
    """(partition elements on this rank, elements of persistent parameters kept whole)."""
    _, _, persist = setup.buckets(shape.hidden)
    part = sum(zero3_partition_numel(s, setup.shard_ranks) for s in shape.param_shapes)
    whole = sum(numel(s) for s in shape.param_shapes if numel(s) <= persist)
    return part, whole


def _overlap(setup: Setup, stage: int) -> bool:
    # DeepSpeedZeroConfig.overlap_comm_valid: default on for stage 3, off otherwise.
    return setup.overlap_comm if setup.overlap_comm is not None else stage == 3


# ------------------------------------------------------------------ strategies


def ddp(shape: ModelShape, setup: Setup) -> Row:
    p = shape.params
    row = Row("ddp", "DDP")
    row.add("params_bytes", "fp32 weights (also the master copy)", 4 * p)
    row.add("grads_bytes", "fp32 gradients", 4 * p)
    row.add("optimizer_bytes", setup.optimizer_words(), setup.optimizer_state_bytes(shape) * p)
    if not setup.gradient_as_bucket_view:
        row.add("buffers_bytes", "DDP all-reduce buckets (gradient_as_bucket_view off)", 4 * p)
    if setup.mixed:
        row.add("buffers_bytes", "autocast's 16-bit weight copies, kept for backward", 2 * shape.autocast_params)
    return row


def zero12(shape: ModelShape, setup: Setup, stage: int, offload: bool = False) -> Row:
    n, e = setup.shard_ranks, setup.half_bytes
    flat = _flat_numel(shape, n)
    part = flat // n
    name = f"zero{stage}" + ("_offload" if offload else "")
    row = Row(name, f"ZeRO-{stage}" + (" + offload optimizer" if offload else ""))
    row.add("params_bytes", f"{_dtype(e)} flat weights, whole on every rank", e * flat)
    opt_target = "host" if offload else "optimizer_bytes"
    master_target = "host" if offload else "master_weights_bytes"
    row.add(master_target, "fp32 master partition (DeepSpeed clones it even for an fp32 model)", MASTER_BYTES * part)
    row.add(opt_target, f"{setup.optimizer_words()}, on the partition", setup.optimizer_state_bytes(shape) * part)
    eg = 4 if setup.grad_accum_fp32 else e
    if offload:
        # stage_1_and_2.py with cpu_offload: gradients go straight to a pinned fp32 buffer on
        # the host; the device keeps one largest-parameter staging buffer.
        largest = max(numel(s) for s in shape.param_shapes)
        row.add("grads_bytes", "staging buffer for the largest parameter's gradient", e * largest)
        row.add("host", "fp32 gradient partition (pinned)", 4 * part)
        row.add("host", f"{_dtype(e)} copy of the updated partition, for the upload", e * part)
        row.add("host", "staging buffer for the largest parameter's gradient", e * largest)
    elif stage == 1 and setup.grad_accum_fp32 and setup.precision == "bf16":
        # engine._do_optimizer_sanity_check -> BF16_Optimizer: full fp32 gradients.
        row.add("grads_bytes", "bf16 gradients of every parameter", 2 * shape.params)
        row.add("grads_bytes", "fp32 gradient accumulation buffer, whole (BF16_Optimizer)", 4 * flat)
    else:
        largest = max(numel(s) for s in shape.param_shapes)
        # step(): the fp32 partition exists while the 16-bit partition is still referenced.
        in_step = (eg + MASTER_BYTES) * part
        # End of backward: stage 1 holds every gradient (it reduces at the boundary); stage 2
        # its partition plus the gradient still waiting for its hook (the largest parameter).
        before = eg * shape.params if stage == 1 else eg * part + e * largest
        if in_step >= before:
            row.add("grads_bytes", f"{_dtype(eg)} gradient partition", eg * part)
            row.add("grads_bytes", "fp32 gradient partition built for step() (DeepSpeed; not in the paper)",
                    MASTER_BYTES * part)
        elif stage == 1:
            row.add("grads_bytes", f"{_dtype(eg)} gradients of every parameter, until the reduce", before)
        else:
            row.add("grads_bytes", f"{_dtype(eg)} gradient partition", eg * part)
            row.add("grads_bytes", "largest parameter's gradient, reduced last", e * largest)
    if setup.contiguous_gradients or offload:
        copies = 2 if _overlap(setup, stage) else 1
        reduce, _, _ = setup.buckets(shape.hidden)
        row.add("buffers_bytes", f"reduce bucket{'s (double, overlap_comm)' if copies == 2 else ''}", copies * e * reduce)
    if not offload and setup.mixed:
        row.add("buffers_bytes", "step(): flattened 16-bit copy of the gradient partition (transient)", e * part)
    return row


def zero3(shape: ModelShape, setup: Setup, offload_optimizer: bool = False, offload_param: bool = False) -> Row:
    e = setup.half_bytes
    part, whole = _zero3_numel(shape, setup)
    name = "zero3" + ("_offload" if offload_param else "_offload_optimizer" if offload_optimizer else "")
    label = "ZeRO-3" + (" + offload params & optimizer" if offload_param else
                        " + offload optimizer" if offload_optimizer else "")
    row = Row(name, label)
    row.add("host" if offload_param else "params_bytes", f"{_dtype(e)} parameter partitions (ds_tensor)", e * part)
    row.add("params_bytes", "persistent small parameters, whole (stage3_param_persistence_threshold)", e * whole)
    eg = 4 if setup.grad_accum_fp32 else e
    if offload_optimizer:
        row.add("host", f"{_dtype(eg)} gradient partitions (grad_partitions_flat_buffer)", eg * part)
        row.add("host", "fp32 gradient partitions for CPU Adam", 4 * part)
        row.add("host", "fp32 master partitions", MASTER_BYTES * part)
        row.add("host", setup.optimizer_words(), setup.optimizer_state_bytes(shape) * part)
    else:
        row.add("grads_bytes", f"{_dtype(eg)} gradient partitions (grad_partitions_flat_buffer)", eg * part)
        sub = min(setup.sub_group_size, part)
        largest = max(numel(s) for s in shape.param_shapes)
        if MASTER_BYTES * sub >= e * largest:
            row.add("grads_bytes", "fp32 gradient of one optimizer sub-group, in step()", MASTER_BYTES * sub)
        else:
            row.add("grads_bytes", "largest parameter's gradient, whole until its reduce", e * largest)
        row.add("master_weights_bytes", "fp32 master partitions (cloned, also for an fp32 model)", MASTER_BYTES * part)
        if setup.mixed:
            row.add("buffers_bytes", "step(): flattened 16-bit gradient of one sub-group (transient)", e * sub)
        row.add("optimizer_bytes", f"{setup.optimizer_words()}, on the partition", setup.optimizer_state_bytes(shape) * part)
    reduce, prefetch, _ = setup.buckets(shape.hidden)
    row.add("buffers_bytes", "gathered parameters: the largest module's, whole", e * shape.largest_module_params)
    row.add("buffers_bytes", "prefetched parameters (stage3_prefetch_bucket_size)", e * prefetch)
    row.add("buffers_bytes", "reduce bucket", e * reduce)
    return row


def fsdp2(shape: ModelShape, setup: Setup, offload: bool = False) -> Row:
    n = setup.shard_ranks  # HSDP: dp_shard x cp, not the replicas
    shard = sum(fsdp2_shard_numel(s, n) for s in shape.param_shapes)
    row = Row("fsdp2_offload" if offload else "fsdp2", "FSDP2" + (" + offload" if offload else ""))
    target = "host" if offload else None
    row.add(target or "params_bytes", "fp32 parameter shards (also the master copy)", 4 * shard)
    row.add(target or "grads_bytes", "fp32 gradient shards", 4 * shard)
    row.add(target or "optimizer_bytes", f"{setup.optimizer_words()}, on the shards", setup.optimizer_state_bytes(shape) * shard)
    # Unsharded (all-gathered) parameters in the compute dtype (MixedPrecisionPolicy.param_dtype).
    c = setup.half_bytes
    if setup.reshard_after_forward:
        # The root unit (embeddings, final norm, head) is not resharded after forward; block
        # units are: the current one and the one prefetched next are whole at a time.
        row.add("buffers_bytes", "root unit gathered (embeddings, final norm, head)", c * shape.root_params)
        row.add("buffers_bytes", "two blocks gathered (current + prefetched)", 2 * c * shape.block_params)
    else:
        row.add("buffers_bytes", "every unit gathered from forward to backward (reshard_after_forward off)",
                c * shape.params)
    row.add("buffers_bytes", "one block's unsharded gradients, before reduce-scatter", c * shape.block_params)
    return row


STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2", "zero2_offload", "zero3_offload_optimizer",
              "zero3_offload", "fsdp2_offload")
"""Ordered cheapest first by communication and speed: DDP, ZeRO-1 and ZeRO-2 move 2*Psi per
step, ZeRO-3 and FSDP 3*Psi (ZeRO paper sec. 7); offload adds host transfers and a CPU
optimizer step. FSDP2 before ZeRO-3: the same volume, without a separate runtime."""


# Each estimator row (STRATEGIES) and the formula that fills it.
_ROWS = {
    "ddp": ddp,
    "zero1": lambda shape, setup: zero12(shape, setup, 1),
    "zero2": lambda shape, setup: zero12(shape, setup, 2),
    "zero2_offload": lambda shape, setup: zero12(shape, setup, 2, offload=True),
    "zero3": zero3,
    "zero3_offload_optimizer": lambda shape, setup: zero3(shape, setup, offload_optimizer=True),
    "zero3_offload": lambda shape, setup: zero3(shape, setup, offload_optimizer=True, offload_param=True),
    "fsdp2": fsdp2,
    "fsdp2_offload": lambda shape, setup: fsdp2(shape, setup, offload=True),
}


def model_state_row(strategy: str, shape: ModelShape, setup: Setup) -> Row:
    if strategy not in _ROWS:
        raise ValueError(f"unknown strategy {strategy!r}")
    return _ROWS[strategy](shape, setup)


# Rows whose compute runs under autocast over fp32 weights (the others cast the model).
_AUTOCAST_ROWS = ("ddp",)


def uses_autocast(strategy: str, setup: Setup) -> bool:
    """DDP computes under autocast with fp32 weights; DeepSpeed casts the model; FSDP2 gathers
    in the policy's dtype. Decides the residual stream's dtype in activations.py."""
    return setup.mixed and strategy in _AUTOCAST_ROWS


def _dtype(nbytes: int) -> str:
    return {2: "16-bit", 4: "fp32"}[nbytes]
