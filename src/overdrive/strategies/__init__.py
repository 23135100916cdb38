"""Run config -> Accelerator. One pure function per strategy, one place that builds.

`accelerator_kwargs(cfg, world_size)` returns the keyword arguments for `Accelerator(...)`;
`construct_accelerator(cfg)` constructs it. Plugins are always built explicitly from the config,
so nothing is read from `ACCELERATE_*` environment variables behind the user's back.

    ddp.py        DistributedDataParallel, and the single-process path
    deepspeed.py  ZeRO 0-3, offload, the DeepSpeed config dict and its "auto" values
    fsdp.py       FSDP2 (fully_shard)
    compile.py    torch.compile through Accelerate's dynamo plugin
    layout.py     the N-D layout (HSDP, TP, CP, SP): sizes, rules, Accelerate's ParallelismConfig
    tensor_parallel.py  the model split by Transformers' tensor-parallel plan on Accelerate's mesh
    cpu.py        what it takes to run each of them on CPU processes over gloo
"""

from overdrive.strategies.accelerator import (  # noqa: F401  (the package's names)
    accelerator_kwargs, construct_accelerator, loss_scaler_owns_overflows, problems,
    hook_optimizer, shard_fraction, shards_parameters, split_model, use_split,
)
