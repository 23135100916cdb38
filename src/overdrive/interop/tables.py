"""Key tables for Accelerate and DeepSpeed config files: their names, ours."""

from __future__ import annotations

# Accelerate ClusterConfig / SageMakerConfig keys (accelerate/commands/config/config_args.py),
# plus the legacy top-level `fp16` and `dynamo_backend`.
ACCELERATE_KEYS = (
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug",
    "num_processes", "machine_rank", "num_machines", "gpu_ids", "main_process_ip",
    "main_process_port", "rdzv_backend", "same_network", "main_training_function",
    "enable_cpu_affinity", "deepspeed_config", "fsdp_config", "parallelism_config",
    "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name", "tpu_zone",
    "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "dynamo_config", "fp8_config", "ipex_config", "fp16", "dynamo_backend",
    "ec2_instance_type", "iam_role_name", "image_uri", "profile", "region", "base_job_name",
    "pytorch_version", "transformers_version", "py_version", "sagemaker_inputs_file",
    "sagemaker_metrics_file", "additional_args",
)

SAGEMAKER_KEYS = (
    "ec2_instance_type", "iam_role_name", "image_uri", "profile", "base_job_name",
    "sagemaker_inputs_file", "sagemaker_metrics_file", "additional_args",
)

TPU_ONLY_KEYS = ("tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env")

ACCELERATE_TOP = {
    "mixed_precision": "precision.mixed_precision",
    "use_cpu": "launch.use_cpu",
    "debug": "launch.debug",
    "num_processes": "launch.num_processes",
    "machine_rank": "launch.machine_rank",
    "num_machines": "launch.num_machines",
    "gpu_ids": "launch.gpu_ids",
    "main_process_ip": "launch.main_process_ip",
    "main_process_port": "launch.main_process_port",
    "rdzv_backend": "launch.rdzv_backend",
    "same_network": "launch.same_network",
    "main_training_function": "launch.main_training_function",
    "enable_cpu_affinity": "launch.enable_cpu_affinity",
    "downcast_bf16": "precision.downcast_bf16",
    # Not ClusterConfig keys, but ACCELERATE_* variables that mirror them reach the same table.
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "gradient_clipping": "training.gradient_clipping",
}

# Variables Accelerate reads that mirror a top-level config key (accelerate/utils/launch.py).
ACCELERATE_ENV_DIRECT = {
    "ACCELERATE_MIXED_PRECISION": "mixed_precision",
    "ACCELERATE_USE_CPU": "use_cpu",
    "ACCELERATE_DEBUG_MODE": "debug",
    "ACCELERATE_CPU_AFFINITY": "enable_cpu_affinity",
    "ACCELERATE_DOWNCAST_BF16": "downcast_bf16",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
    "ACCELERATE_GRADIENT_CLIPPING": "gradient_clipping",
}

DISTRIBUTED_TYPES = {
    "NO": "ddp", "MULTI_GPU": "ddp", "MULTI_CPU": "ddp", "MULTI_XPU": "ddp", "MULTI_NPU": "ddp",
    "MULTI_MLU": "ddp", "MULTI_SDAA": "ddp", "MULTI_MUSA": "ddp", "MULTI_HPU": "ddp",
    "MULTI_NEURON": "ddp", "DEEPSPEED": "deepspeed", "FSDP": "fsdp",
    "MEGATRON_LM": "ddp",  # its tensor and pipeline degrees: interop/megatron_reading.py
}

# deepspeed_config keys in an Accelerate YAML (and ACCELERATE_DEEPSPEED_* variables).
ZERO_KEYS = {
    "zero_stage": "parallel.deepspeed.zero_stage",
    "offload_optimizer_device": "parallel.deepspeed.offload_optimizer",
    "offload_param_device": "parallel.deepspeed.offload_param",
    "offload_optimizer_nvme_path": "parallel.deepspeed.nvme_path",
    "offload_param_nvme_path": "parallel.deepspeed.nvme_path",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "gradient_clipping": "training.gradient_clipping",
    "zero3_init_flag": "parallel.deepspeed.zero3_init",
    "zero3_save_16bit_model": "parallel.deepspeed.zero3_save_16bit_model",
    "deepspeed_config_file": "parallel.deepspeed.config_file",
    "deepspeed_hostfile": None, "deepspeed_inclusion_filter": None, "deepspeed_exclusion_filter": None,
    "deepspeed_multinode_launcher": None, "deepspeed_moe_layer_cls_names": None,
}

FSDP_KEYS = {
    "fsdp_version": "parallel.fsdp.version",
    "fsdp_reshard_after_forward": "parallel.fsdp.reshard_after_forward",
    "fsdp_sharding_strategy": "parallel.fsdp.reshard_after_forward",
    "fsdp_offload_params": "parallel.fsdp.offload_params",
    "fsdp_auto_wrap_policy": "parallel.fsdp.auto_wrap_policy",
    "fsdp_transformer_layer_cls_to_wrap": "parallel.fsdp.transformer_layer_cls_to_wrap",
    "fsdp_min_num_params": "parallel.fsdp.min_num_params",
    "fsdp_state_dict_type": "parallel.fsdp.state_dict_type",
    "fsdp_activation_checkpointing": "parallel.fsdp.activation_checkpointing",
    "fsdp_cpu_ram_efficient_loading": "parallel.fsdp.cpu_ram_efficient_loading",
    "fsdp_sync_module_states": "parallel.fsdp.sync_module_states",
    "fsdp_backward_prefetch": "parallel.fsdp.backward_prefetch",
    "fsdp_forward_prefetch": "parallel.fsdp.forward_prefetch",
    "fsdp_use_orig_params": "parallel.fsdp.use_orig_params",
    "fsdp_ignored_modules": "parallel.fsdp.ignored_modules",
}

# FSDP1 sharding strategies (names and Accelerate's 1-based numbers) -> reshard_after_forward.
FSDP_SHARDING = {
    "FULL_SHARD": (True, ""), "1": (True, ""),
    "SHARD_GRAD_OP": (False, ""), "2": (False, ""),
    "NO_SHARD": (False, "NO_SHARD replicates everything: parallel.strategy=ddp does the same with less overhead"),
    "3": (False, "NO_SHARD replicates everything: parallel.strategy=ddp does the same with less overhead"),
    "HYBRID_SHARD": (True, "HYBRID_SHARD runs as FULL_SHARD across all ranks (no replica groups)"),
    "4": (True, "HYBRID_SHARD runs as FULL_SHARD across all ranks (no replica groups)"),
    "HYBRID_SHARD_ZERO2": (False, "HYBRID_SHARD_ZERO2 runs as SHARD_GRAD_OP across all ranks"),
    "5": (False, "HYBRID_SHARD_ZERO2 runs as SHARD_GRAD_OP across all ranks"),
}

DYNAMO_KEYS = {
    "dynamo_backend": "compile.backend",
    "dynamo_mode": "compile.mode",
    "dynamo_use_fullgraph": "compile.fullgraph",
    "dynamo_use_dynamic": "compile.dynamic",
    "dynamo_use_regional_compilation": "compile.regional",
}

FP8_KEYS = {
    "backend": "precision.fp8.backend",
    "fp8_format": "precision.fp8.fp8_format",
    "amax_history_len": "precision.fp8.amax_history_len",
    "amax_compute_algo": "precision.fp8.amax_compute_algo",
    "interval": "precision.fp8.interval",
    "margin": "precision.fp8.margin",
    "override_linear_precision": "precision.fp8.override_linear_precision",
    "use_autocast_during_eval": "precision.fp8.use_autocast_during_eval",
    "opt_level": "precision.fp8.opt_level",
}

# Top-level DeepSpeed keys with a schema home.
DEEPSPEED_CONFIG_KEYS = {
    "train_micro_batch_size_per_gpu": "training.micro_batch_size",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "train_batch_size": "parallel.deepspeed.train_batch_size",
    "gradient_clipping": "training.gradient_clipping",
}

DEEPSPEED_MARKERS = {
    "zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "bf16", "bfloat16",
    "optimizer", "scheduler", "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
}

# parallelism_config keys in an Accelerate YAML (accelerate/commands/config/cluster.py writes
# them; `accelerate launch` turns each into a PARALLELISM_CONFIG_* variable).
PARALLELISM_PREFIX = "parallelism_config_"
PARALLELISM_KEYS = {
    "parallelism_config_dp_replicate_size": "parallel.dp_replicate_size",
    "parallelism_config_dp_shard_size": "parallel.dp_shard_size",
    "parallelism_config_tp_size": "parallel.tp_size",
    "parallelism_config_cp_size": "parallel.cp_size",
    "parallelism_config_cp_comm_strategy": "parallel.cp_comm_strategy",
    "parallelism_config_sp_size": "parallel.sp_size",
    "parallelism_config_sp_seq_length": "parallel.sp_seq_length",
    "parallelism_config_sp_seq_length_is_variable": "parallel.sp_seq_length_is_variable",
    "parallelism_config_sp_attn_implementation": "parallel.sp_attn_implementation",
    # The one backend Accelerate 1.15 has for each: checked, nothing to set.
    "parallelism_config_cp_backend": None,
    "parallelism_config_sp_backend": None,
}
PARALLELISM_BACKENDS = {"parallelism_config_cp_backend": "torch", "parallelism_config_sp_backend": "deepspeed"}
