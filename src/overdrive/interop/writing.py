"""Run config -> the files `accelerate launch` reads: an Accelerate YAML and a DeepSpeed JSON.

The opposite direction (those files -> run config) is interop/reading.py; `overdrive import`
uses it and writes back only what differs from the schema defaults. A round trip keeps
every value the two formats can carry (launch, strategy, precision, compile, and the whole
DeepSpeed dict); model, data and the optimizer stay in the run config, because an
Accelerate script owns those itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from overdrive.config.batch import data_parallel_degree
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError
from overdrive.strategies import registry

# Entries overdrive's template adds for its own runs that Accelerate adds again by itself;
# leaving them out keeps an exported JSON free of what a user never wrote.
_TEMPLATE_ONLY = ("zero_allow_untested_optimizer",)


def distributed_type(cfg: RunConfig) -> str:
    return registry.of(cfg).distributed_type(cfg)


# What a Transformers Trainer owns in a DeepSpeed config: it fills these from its
# TrainingArguments and refuses any explicit value that differs (trainer_config_process /
# trainer_config_finalize in transformers/integrations/deepspeed.py), so a config handed to a
# user's script leaves them "auto", as Transformers' own DeepSpeed configs do.
TRAINER_OWNED = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
                 "gradient_clipping", "fp16.enabled", "bf16.enabled")


def deepspeed_json(cfg: RunConfig, batch_auto: bool = False, hidden_size: Optional[int] = None,
                   trainer_owned_auto: bool = False) -> dict[str, Any]:
    """The DeepSpeed dict overdrive runs, as a file for `accelerate launch`.

    Bucket sizes the config leaves `auto` stay `"auto"` unless `hidden_size` is given
    (Accelerate fills them from `model.config` at prepare, with the same rule, but only for
    models that have one). `train_batch_size` is always `"auto"`: Accelerate derives it for
    the world size it actually runs at. `batch_auto` leaves the micro-batch `"auto"` too, for
    a user's script whose DataLoader decides it. `trainer_owned_auto` leaves everything in
    TRAINER_OWNED `"auto"`: the values reach the Trainer's TrainingArguments instead (or, for
    a bare `Accelerator()`, Accelerate's environment), so the two cannot disagree.
    """
    from overdrive.strategies import deepspeed_config

    if not registry.of(cfg).deepspeed_config:
        raise UserError(Problem("parallel.strategy", f"is {cfg.parallel.strategy}: there is no DeepSpeed config to write",
                                fix="set parallel.strategy=deepspeed, or leave out --deepspeed"))
    config = deepspeed_config.ds_config(cfg, data_parallel_degree(cfg), hidden_size, find_hidden_size=False)
    for key in _TEMPLATE_ONLY:
        if key not in deepspeed_config.passed_on_extra(cfg):
            config.pop(key, None)
    config["train_batch_size"] = "auto"
    if batch_auto:
        config["train_micro_batch_size_per_gpu"] = "auto"
    if trainer_owned_auto:
        for path in TRAINER_OWNED:
            *parents, leaf = path.split(".")
            node = config
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = "auto"
    return config


def accelerate_config(cfg: RunConfig, deepspeed_file: Optional[str] = None) -> dict[str, Any]:
    """An Accelerate ClusterConfig as a dict. With `deepspeed_file`, the DeepSpeed settings
    live in that JSON (and so does the precision: Accelerate refuses it in both places)."""
    launch, dist = cfg.launch, distributed_type(cfg)
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": dist,
        "debug": launch.debug,
        "downcast_bf16": "yes" if cfg.precision.downcast_bf16 else "no",
        "enable_cpu_affinity": launch.enable_cpu_affinity,
        "gpu_ids": launch.gpu_ids,
        "machine_rank": launch.machine_rank,
        "main_training_function": launch.main_training_function,
        "mixed_precision": cfg.precision.mixed_precision,
        "num_machines": launch.num_machines,
        "num_processes": launch.num_processes,
        "main_process_port": launch.main_process_port,
        "rdzv_backend": launch.rdzv_backend,
        "same_network": launch.same_network,
        # Accelerate acts on use_cpu only where the launch decides the distributed type
        # (NO / MULTI_CPU): with it, its state ignores DEEPSPEED and FSDP. On a CPU those two
        # run through DS_ACCELERATOR=cpu and the gloo backend instead (strategies/cpu.py).
        "use_cpu": launch.use_cpu and registry.of(cfg).accelerate_type is None,
    }
    if launch.main_process_ip:
        out["main_process_ip"] = launch.main_process_ip
    if dist == "DEEPSPEED":
        ds = cfg.parallel.deepspeed
        if deepspeed_file:
            out.pop("mixed_precision")
            out["deepspeed_config"] = {"deepspeed_config_file": deepspeed_file, "zero3_init_flag": ds.zero3_init,
                                       "deepspeed_multinode_launcher": "standard"}
        else:
            out["deepspeed_config"] = {
                "zero_stage": ds.zero_stage,
                "offload_optimizer_device": ds.offload_optimizer,
                "offload_param_device": ds.offload_param,
                "offload_optimizer_nvme_path": ds.nvme_path or "none",
                "offload_param_nvme_path": ds.nvme_path or "none",
                "gradient_accumulation_steps": cfg.training.gradient_accumulation_steps,
                "gradient_clipping": cfg.training.gradient_clipping or 0.0,
                "zero3_init_flag": ds.zero3_init,
                "zero3_save_16bit_model": ds.zero3_save_16bit_model,
                "deepspeed_multinode_launcher": "standard",
            }
    if dist == "FSDP":
        out["fsdp_config"] = _fsdp_section(cfg)
    parallelism = parallelism_section(cfg)
    if parallelism:
        out["parallelism_config"] = parallelism
    if cfg.parallel.pp_size > 1:  # Accelerate's form of pipeline stages is Megatron-LM's block
        from overdrive.interop.megatron_reading import megatron_section

        out.update(distributed_type="MEGATRON_LM", megatron_lm_config=megatron_section(cfg))
    if cfg.compile.backend:
        c = cfg.compile
        out["dynamo_config"] = {"dynamo_backend": c.backend.upper(), "dynamo_mode": c.mode or "default",
                                "dynamo_use_fullgraph": c.fullgraph, "dynamo_use_regional_compilation": c.regional}
        if c.dynamic is not None:  # absent: torch decides
            out["dynamo_config"]["dynamo_use_dynamic"] = c.dynamic
    if cfg.precision.mixed_precision == "fp8":
        out["fp8_config"] = cfg.precision.fp8.model_dump(mode="json")
    return out


def _fsdp_section(cfg: RunConfig) -> dict[str, Any]:
    f = cfg.parallel.fsdp
    section: dict[str, Any] = {
        "fsdp_version": f.version,
        "fsdp_reshard_after_forward": f.reshard_after_forward,
        "fsdp_offload_params": f.offload_params,
        "fsdp_auto_wrap_policy": f.auto_wrap_policy.upper(),
        "fsdp_min_num_params": f.min_num_params,
        "fsdp_state_dict_type": f.state_dict_type.upper(),
        "fsdp_activation_checkpointing": f.activation_checkpointing,
        "fsdp_cpu_ram_efficient_loading": f.cpu_ram_efficient_loading,
        # Accelerate's launcher refuses cpu_ram_efficient_loading without it, even for FSDP2.
        "fsdp_sync_module_states": f.sync_module_states,
    }
    if f.transformer_layer_cls_to_wrap:
        section["fsdp_transformer_layer_cls_to_wrap"] = ",".join(f.transformer_layer_cls_to_wrap)
    if f.ignored_modules:
        section["fsdp_ignored_modules"] = f.ignored_modules
    if f.version == 1:  # FSDP2 made these obsolete
        section.update(fsdp_backward_prefetch=(f.backward_prefetch or "NO_PREFETCH").upper(),
                       fsdp_forward_prefetch=f.forward_prefetch, fsdp_use_orig_params=f.use_orig_params)
    return section


def parallelism_section(cfg: RunConfig) -> dict[str, Any]:
    """The `parallelism_config:` block for the run's N-D layout (empty without one): the sizes
    and handler options Accelerate's launcher turns into PARALLELISM_CONFIG_* variables."""
    from overdrive.strategies import layout

    kwargs = layout.parallelism_kwargs(cfg)
    if kwargs is None:
        return {}
    section = {f"parallelism_config_{name}": kwargs[name] for name in
               ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")}
    if kwargs["cp_size"] > 1:
        section.update(parallelism_config_cp_backend="torch",
                       parallelism_config_cp_comm_strategy=kwargs["cp_handler"]["cp_comm_strategy"])
    if kwargs["sp_size"] > 1:
        section["parallelism_config_sp_backend"] = "deepspeed"
        section.update({f"parallelism_config_{k}": v for k, v in kwargs["sp_handler"].items()})
    return section


# `accelerate launch` options that are switches: present when true, absent when false.
_SWITCHES = {"debug", "enable_cpu_affinity", "same_network", "dynamo_use_fullgraph", "dynamo_use_dynamic",
             "dynamo_use_regional_compilation"}
_NOT_FLAGS = {"compute_environment", "distributed_type", "use_cpu", "main_training_function",
              "deepspeed_multinode_launcher", "downcast_bf16", "fp8_config"}


def accelerate_flags(cfg: RunConfig, deepspeed_file: Optional[str] = None) -> list[str]:
    """The same settings as `accelerate launch` command-line options."""
    config = accelerate_config(cfg, deepspeed_file)
    dist = config["distributed_type"]
    flags = {"DEEPSPEED": ["--use_deepspeed"], "FSDP": ["--use_fsdp"], "MULTI_GPU": ["--multi_gpu"],
             "MULTI_CPU": ["--cpu"], "MEGATRON_LM": ["--use_megatron_lm"]}.get(dist, ["--cpu"] if cfg.launch.use_cpu else [])
    items = {k: v for k, v in config.items() if not isinstance(v, dict)}
    for section in ("deepspeed_config", "fsdp_config", "dynamo_config", "megatron_lm_config"):
        items.update(config.get(section, {}))
    if config.get("parallelism_config") and dist == "FSDP":
        # `accelerate launch` takes --use_parallelism_config with --use_fsdp only (its
        # _validate_launch_command); other types carry the block in the YAML alone.
        flags.append("--use_parallelism_config")
        items.update(config["parallelism_config"])
    if cfg.launch.threads_per_process:
        items["num_cpu_threads_per_process"] = cfg.launch.threads_per_process
    for key, value in items.items():
        if key in _NOT_FLAGS:
            continue
        if key in _SWITCHES:
            flags += [f"--{key}"] if value else []
        else:
            flags += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags


def write(cfg: RunConfig, accelerate_path: Optional[str | Path] = None, deepspeed_path: Optional[str | Path] = None,
          batch_auto: bool = False, hidden_size: Optional[int] = None, trainer_owned_auto: bool = False) -> list[Path]:
    """Write the requested files; the YAML points at the JSON when both are written.
    Secrets are masked: a credential belongs in the environment of the job, not in a file."""
    import yaml

    from overdrive.config.redact import redact

    written: list[Path] = []
    ds_ref = None
    if deepspeed_path:
        path = Path(deepspeed_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(redact(deepspeed_json(cfg, batch_auto, hidden_size, trainer_owned_auto)), indent=2) + "\n")
        written.append(path)
        # As given: Accelerate resolves it against the working directory `accelerate launch`
        # runs in (overdrive's import tries the YAML's directory first, then that).
        ds_ref = str(path)
    if accelerate_path:
        path = Path(accelerate_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(redact(accelerate_config(cfg, ds_ref)), sort_keys=True)
        path.write_text(f"# Accelerate config written by `overdrive export`\n{text}")
        written.append(path)
    return written


def imported_settings(resolved: Any) -> dict[str, Any]:
    """The values of a resolved config that differ from the schema defaults, nested."""
    defaults = RunConfig().model_dump(mode="json")
    values = resolved.config.model_dump(mode="json")
    out: dict[str, Any] = {}
    for key, chain in sorted(resolved.chains.items()):
        if not chain or chain[-1].origin.layer == "default" or getattr(resolved.origins.get(key), "layer", "") == "derived":
            continue  # derived values (steps from epochs, warmup from its ratio) follow from the keys written
        value, default = _lookup(values, key), _lookup(defaults, key)
        # Another tool's value is kept even where it equals overdrive's default: the run says what it was given.
        if value is _MISSING or value == default and chain[-1].native not in _TOOLS:
            continue
        if isinstance(value, list):  # data.sources entries: the keys each one sets
            value = [{k: v for k, v in item.items() if v is not None} if isinstance(item, dict) else item for item in value]
        _insert(out, key, value)
    return out


_MISSING = object()
_TOOLS = ("axolotl", "llamafactory", "torchtune")  # interop/tool_reading.py's readers


def _lookup(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def _insert(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):  # a whole mapping already written covers this key
            return
        tree = node
    tree[leaf] = value
