"""Every strategy on CPU processes over gloo: the workarounds, in one place.

Accelerate and DeepSpeed assume a GPU in a few places. Checked with accelerate 1.15,
deepspeed 0.19 and torch 2.13; each fact below is covered by tests/test_strategies_cpu.py.

DDP
    `Accelerator(cpu=True)` under torch.distributed.run gives MULTI_CPU over gloo. Without
    `cpu=True` and with no GPU, Accelerate finds no backend and every rank trains alone.
DeepSpeed
    `DS_ACCELERATOR=cpu` must be in the environment before deepspeed is first imported
    (launch.py puts it into every worker's environment). `cpu=True` must NOT be passed:
    Accelerate would then ignore the DeepSpeed plugin. The process-group backend must be
    named (`InitProcessGroupKwargs(backend="gloo")`): without it Accelerate finds no backend
    for a CPU device, counts one process, and DeepSpeed's batch-size assertion fails.
FSDP2
    Accelerate drops the FSDP plugin when `cpu=True`, and without `cpu=True` finds no
    backend. So: construct with `cpu=True` (MULTI_CPU over gloo), then mark the state as
    FSDP and hand it the plugin before `prepare()`; prepare then calls `fully_shard` on the
    gloo process group. FSDP1 does not run on CPU (it asks for device `cpu:0`).

N-D layouts (strategies/layout.py)
    Accelerate refuses a ParallelismConfig on MULTI_CPU (`_validate_accelerator` accepts FSDP2,
    DeepSpeed and the multi-GPU types only). So it is attached after construction, as
    Accelerate itself would on a GPU: the config and its device mesh (built for "cpu", over
    gloo) go into the accelerator's state, then Accelerate's own check runs where it accepts
    the type (FSDP, after the promotion above). TP, HSDP and FSDP2 x TP then run over gloo.
    Context parallel does not: torch's ring attention has no sharding rule for the CPU
    attention kernel (aten._scaled_dot_product_flash_attention_for_cpu, torch 2.13).
    Sequence parallel is DeepSpeed's Ulysses over its CUDA attention kernels: a GPU path.

QLoRA (bitsandbytes 0.50)
    On a CPU with AVX512-BF16, a 4-bit layer repacks itself for that CPU at its first forward
    outside training (evaluation), and the repacking fails for a layer narrower than one
    quantization block (in_features < blocksize: "shape '[32, 0]' is invalid"). Such layers
    keep bitsandbytes' generic CPU path (`keep_narrow_4bit_layers_generic`).

"No GPU" means `launch.use_cpu` is set or the machine the job runs on has none. Where the
job runs elsewhere (a script written on a login node), the caller says how many GPUs that
machine has (`target_gpus`, from the config alone); otherwise torch is asked here.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from overdrive.config.schema import RunConfig
from overdrive.errors import Problem


def on_cpu(cfg: RunConfig, gpus: Optional[int] = None) -> bool:
    """True when this run trains on CPU processes. `gpus`: the GPUs of the machine the job
    runs on, when it is not this one; None asks torch on this machine."""
    if cfg.launch.use_cpu:
        return True
    if gpus is None:
        import torch

        return not torch.cuda.is_available()
    return gpus == 0


def target_gpus(cfg: RunConfig) -> int:
    """GPUs per machine of the machines a script is written for, from the config alone:
    `launch.gpus_per_machine`, else none with `launch.use_cpu`, else one per local process.
    Never this machine's: a login node without GPUs writes scripts for GPU nodes."""
    if cfg.launch.use_cpu:
        return 0
    if cfg.launch.gpus_per_machine is not None:
        return cfg.launch.gpus_per_machine
    return max(cfg.launch.num_processes // max(cfg.launch.num_machines, 1), 1)


def fsdp_needs_host_group(cfg: RunConfig) -> bool:
    """FSDP with CPU offload (gradients are reduced on the host for the norm and clipping) or
    a full state dict (gathered to the CPU): Accelerate gives these a `cpu:gloo` side of the
    process group, but decides it from FSDP_OFFLOAD_PARAMS / FSDP_STATE_DICT_TYPE in the
    environment (accelerate/state.py), which overdrive never sets; so the backend is named here."""
    f = cfg.parallel.fsdp
    return cfg.parallel.strategy == "fsdp" and (f.offload_params or f.state_dict_type == "full_state_dict")


def process_group_backend(cfg: RunConfig, gpus: Optional[int] = None) -> str | None:
    """The backend to name explicitly, or None to let Accelerate pick (nccl on CUDA)."""
    if on_cpu(cfg, gpus):
        return "gloo" if cfg.launch.backend == "auto" else cfg.launch.backend
    if fsdp_needs_host_group(cfg) and cfg.launch.backend in ("auto", "nccl"):
        return "cuda:nccl,cpu:gloo"
    return None if cfg.launch.backend == "auto" else cfg.launch.backend


def construct_with_cpu_flag(cfg: RunConfig, gpus: Optional[int] = None) -> bool:
    """The `cpu=` argument of Accelerator: True on CPU, except for DeepSpeed (see above)."""
    return on_cpu(cfg, gpus) and cfg.parallel.strategy != "deepspeed"


def worker_env(cfg: RunConfig, gpus: Optional[int] = None) -> dict[str, str]:
    """Environment variables a worker needs before it imports anything (set by launch/)."""
    if on_cpu(cfg, gpus):
        # Read once, at `import deepspeed`: too late to set from inside the worker. Not only
        # for DeepSpeed runs: Accelerate's `unwrap_model` imports deepspeed whenever it is
        # installed, and an unset DS_ACCELERATOR makes that import warn on every CPU run.
        return {"DS_ACCELERATOR": "cpu"}
    return {}


def needs_fsdp_promotion(cfg: RunConfig) -> bool:
    return cfg.parallel.strategy == "fsdp" and on_cpu(cfg)


def promote_to_fsdp(accelerator: Any, fsdp_plugin: Any) -> None:
    """Turn a MULTI_CPU accelerator into an FSDP one. Must run before `prepare()`.

    Accelerate stores the plugin and applies the mixed-precision policy to it only on its
    GPU path, so both are done here as that path would. The type is written into
    PartialState's shared state too, as Accelerate itself does: every later
    `AcceleratorState()` (the DataLoader code makes one) copies it from there.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type == DistributedType.FSDP:
        return
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if state.mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = fsdp_plugin


def attach_parallelism(accelerator: Any, cfg: RunConfig, world: int) -> None:
    """Give a CPU accelerator its ParallelismConfig and device mesh (see above). Before prepare()."""
    from accelerate.utils import DistributedType

    from overdrive.strategies import layout

    parallelism = layout.parallelism_config(cfg, world)
    if parallelism is None:
        return
    state = accelerator.state
    state.parallelism_config = parallelism
    state.device_mesh = parallelism.get_device_mesh("cpu")
    if state.distributed_type == DistributedType.FSDP:
        parallelism._validate_accelerator(accelerator)  # its world-size and FSDP checks, as on a GPU


def problems(cfg: RunConfig, gpus: Optional[int] = None) -> list[Problem]:
    """What cannot run on CPU at all, named by key (empty when on a GPU). The one home of
    these rules; `gpus` as in `on_cpu` (a script for another machine passes `target_gpus`)."""
    if not on_cpu(cfg, gpus):
        return []
    found = []
    if cfg.parallel.strategy == "fsdp" and cfg.parallel.fsdp.version == 1:
        found.append(Problem("parallel.fsdp.version", "FSDP1 does not run on CPU (it asks for device cpu:0)",
                             fix="use parallel.fsdp.version=2 (fully_shard), which runs on CPU over gloo"))
    if cfg.launch.backend == "nccl":
        why = "launch.use_cpu is set" if cfg.launch.use_cpu else "there is no CUDA GPU"
        found.append(Problem("launch.backend", f"nccl needs CUDA GPUs ({why})",
                             fix="use launch.backend=auto (gloo on CPU); for a GPU cluster set launch.gpus_per_machine"))
    if cfg.parallel.cp_size > 1:
        found.append(Problem("parallel.cp_size", "context parallel does not run on CPU: torch's ring attention has no "
                             "CPU kernel (no sharding rule for aten._scaled_dot_product_flash_attention_for_cpu)",
                             fix="run it on CUDA GPUs (set launch.gpus_per_machine for a cluster script), or "
                                 "set parallel.cp_size=1 here"))
    if cfg.parallel.sp_size > 1:
        found.append(Problem("parallel.sp_size", "sequence parallel (DeepSpeed Ulysses/ALST) is a GPU path: it is not "
                             "run on CPU processes", fix="run it on CUDA GPUs, or set parallel.sp_size=1 here"))
    if cfg.parallel.strategy == "deepspeed" and cfg.precision.mixed_precision == "fp16":
        found.append(Problem("precision.mixed_precision", "DeepSpeed's CPU accelerator has no fp16 training",
                             fix="use precision.mixed_precision=bf16 or no on CPU"))
    if cfg.rl.use_transformers_continuous_batching:  # measured: bench/results/grpo.md
        found.append(Problem("rl.use_transformers_continuous_batching", "Transformers' continuous batching is a GPU "
                             "path: on a CPU it took 15-34 s for 32 completions that overdrive's sampler draws in "
                             "0.012 s", fix="remove rl.use_transformers_continuous_batching on CPU"))
    if cfg.rl.use_vllm:
        found.append(Problem("rl.use_vllm", "vLLM generates on CUDA GPUs: it does not run on CPU processes",
                             fix="remove rl.use_vllm here (overdrive's own sampler generates); on a GPU machine "
                                 "pip install 'overdrive[vllm]'"))
    found += deepspeed_optimizer_problems(cfg)
    return found


# DeepSpeed's own optimizers (engine._configure_basic_optimizer, deepspeed 0.19) that cannot
# run on its CPU accelerator, whose op builders are only cpu_adam, cpu_adagrad, cpu_lion and
# fused_adam (deepspeed/ops/op_builder/cpu/): type (lower case) -> why.
_DEEPSPEED_OPTIMIZERS_OFF_CPU = {
    "lamb": "builds FusedLamb, a CUDA kernel (DeepSpeed's CPU accelerator has no Lamb op)",
    "onebitadam": "1-bit Adam compresses its communication with NCCL or MPI, not gloo",
    "zerooneadam": "0/1 Adam compresses its communication with NCCL or MPI, not gloo",
    "onebitlamb": "1-bit Lamb needs FusedLamb (CUDA) and NCCL or MPI",
    "muadam": "needs the mup package", "muadamw": "needs the mup package", "musgd": "needs the mup package",
    # Built as torch.optim.Adagrad, then the first backward fails inside ZeRO's gradient
    # partitioning (IndexError in stage_1_and_2._get_flat_partition_unpadded), seen with
    # deepspeed 0.19 on CPU at stages 1 and 2.
    "adagrad": "fails in ZeRO's gradient partitioning on its CPU accelerator (seen with deepspeed 0.19)",
}


def deepspeed_optimizer_problems(cfg: RunConfig) -> list[Problem]:
    """A DeepSpeed JSON optimizer block (optim.name=deepspeed) that DeepSpeed cannot build on CPU."""
    block = cfg.parallel.deepspeed.extra.get("optimizer")
    if cfg.optim.name != "deepspeed" or not isinstance(block, dict):
        return []
    kind = str(block.get("type", "")).lower()
    why = _DEEPSPEED_OPTIMIZERS_OFF_CPU.get(kind)
    if kind == "lion" and cfg.parallel.deepspeed.offload_optimizer == "none":
        why = "without optimizer offload builds FusedLion, a CUDA kernel (offloaded, it is DeepSpeedCPULion)"
    if why and kind.startswith("mu"):
        import importlib.util

        why = None if importlib.util.find_spec("mup") else why
    if not why:
        return []
    return [Problem("parallel.deepspeed.extra.optimizer.type", f"{block.get('type')}: DeepSpeed {why}; this run "
                    "trains on CPU", fix="on CPU use type Adam/AdamW (overdrive's own), or set optim.name "
                    "(lion, sgd, ...) and remove the DeepSpeed optimizer block")]


@contextlib.contextmanager
def apply_to_user_accelerators(cfg: RunConfig) -> Iterator[None]:
    """The same workarounds for a user's script, which builds `Accelerator()` itself.

    `overdrive launch` sets the environment a bare `Accelerator()` reads; what no variable
    can say on CPU (the gloo backend for DeepSpeed, the FSDP promotion) is applied around
    the script's Accelerator (and, for the backend, process state) construction instead. And TrainingArguments is told that bf16
    runs here: it refuses `bf16=True` without a bf16 GPU unless `use_cpu=True`, which the
    worker does not need (ACCELERATE_USE_CPU says it) and which would turn DeepSpeed off.
    Scoped: `Accelerator.__init__` and that check are replaced only inside the `with` block
    (the script's run) and put back after, so nothing else in the process is changed.
    A no-op off CPU.
    """
    strategy = cfg.parallel.strategy
    if not on_cpu(cfg):
        yield
        return
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, InitProcessGroupKwargs

    original = Accelerator.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if strategy == "deepspeed":
            handlers = list(kwargs.get("kwargs_handlers") or [])
            if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
                handlers.append(InitProcessGroupKwargs(backend="gloo"))
            kwargs["kwargs_handlers"] = handlers
        if strategy == "fsdp" and kwargs.get("fsdp_plugin") is None:
            # Built from the FSDP_* variables `overdrive launch` set, as Accelerate would.
            kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin()
        original(self, *args, **kwargs)
        if strategy == "fsdp":
            promote_to_fsdp(self, kwargs["fsdp_plugin"])

    import transformers.training_args as training_args

    patched: list[tuple[Any, str, Any]] = [(training_args, "is_torch_bf16_gpu_available", lambda: True)]
    if strategy != "ddp":
        patched.append((Accelerator, "__init__", __init__))
    if strategy == "deepspeed":
        # TrainingArguments builds the process state itself, before any Accelerator, and
        # names no backend for DeepSpeed: the same gloo is named there.
        from accelerate.state import PartialState

        partial_init = PartialState.__init__

        def partial_state_init(self: Any, cpu: bool = False, **kwargs: Any) -> None:
            if kwargs.get("backend") is None:
                kwargs["backend"] = "gloo"
            partial_init(self, cpu, **kwargs)

        patched.append((PartialState, "__init__", partial_state_init))
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patched]
    try:
        for owner, name, replacement in patched:
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, before in saved:
            setattr(owner, name, before)


def keep_narrow_4bit_layers_generic(model: Any) -> int:
    """Turn off bitsandbytes' AVX512-BF16 repacking for 4-bit layers narrower than one block
    (see QLoRA above); the count of layers changed."""
    changed = 0
    for module in model.modules():
        quant_state = getattr(getattr(module, "weight", None), "quant_state", None)
        if getattr(module, "support_avx512bf16_for_cpu", False) and quant_state is not None \
                and module.in_features < quant_state.blocksize:
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed
