"""torchtune's recipe configs (`tune run <recipe> --config x.yaml`: components named by
`_component_`, https://docs.pytorch.org/torchtune), key by key.

Recognised by `_component_` blocks. The model builder's LoRA keys map to PEFT's names on a
Transformers checkpoint (`lora_attn_modules` q/k/v/output_proj -> q/k/v/o_proj, `apply_lora_to_mlp`
-> gate/up/down_proj, `apply_lora_to_output` -> lm_head); the model itself is the checkpointer's
Hugging Face directory. torchtune's defaults are carried explicitly: its cosine schedule decays
to 0 (min lr 0), no schedule means a constant lr, `clip_grad_norm: null` is no clipping, the
builders' lora_rank 8 / lora_alpha 16 / lora_dropout 0. The DPO recipes' losses (DPOLoss, SimPOLoss)
map onto `preference.*` (interop/tool_preference.py) with their paired data sets; another loss (PPO's,
RSO's hinge) is refused by key.
"""

from __future__ import annotations

from typing import Any

from overdrive.interop import tool_common as common
from overdrive.interop import tool_preference
from overdrive.interop.tool_common import ToolReader

TOOL = "torchtune"
MODULES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
MLP = ["gate_proj", "up_proj", "down_proj"]  # torchtune's w1, w3, w2
CROSS_ENTROPY = ("CEWithChunkedOutputLoss", "CrossEntropyLoss", "LinearCrossEntropyLoss")
OPTIMIZERS = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd", "Adafactor": "adafactor", "PagedAdamW8bit": "adamw_8bit",
              "AdamW8bit": "adamw_8bit", "Muon": "muon", "PagedAdamW": "adamw", "PagedAdamW32bit": "adamw",
              "AdamW4bit": "adamw"}  # paged memory and torchao's quantized state are not used: said on import
# dataset builders -> (source, layout) ; None source: from the entry's own `source`
DATASETS = {"alpaca_dataset": ("tatsu-lab/alpaca", "alpaca"), "alpaca_cleaned_dataset": ("yahma/alpaca-cleaned", "alpaca"),
            "slimorca_dataset": ("Open-Orca/SlimOrca-Dedup", "sharegpt"), "chat_dataset": (None, None),
            "instruct_dataset": (None, "prompt-completion"), "text_completion_dataset": (None, "text"),
            "cnn_dailymail_articles_dataset": ("ccdv/cnn_dailymail", "text"),
            # preference pairs: TRL's implicit-prompt turns, or the question and two answers
            "preference_dataset": (None, "pairs"), "stack_exchange_paired_dataset": ("lvwerra/stack-exchange-paired",
                                                                                     "pairs")}


def recognises(data) -> bool:
    return any(isinstance(v, dict) and "_component_" in v for v in data.values()) or \
        any(isinstance(v, list) and v and isinstance(v[0], dict) and "_component_" in v[0] for v in data.values())


def _name(block: Any) -> str:
    return str(block.get("_component_", "")).rsplit(".", 1)[-1] if isinstance(block, dict) else ""


def read(data, c, source: str):
    r = ToolReader(TOOL, data, c, source)
    r.default("scheduler.name", "constant", "no lr_scheduler: a constant learning rate")
    r.default("scheduler.warmup_steps", 0, "no warmup unless the scheduler's num_warmup_steps")
    r.default("scheduler.min_lr_ratio", 0.0, "its cosine schedule decays to 0")
    r.default("training.gradient_clipping", None, "clip_grad_norm: null, no clipping")
    r.default("optim.weight_decay", 0.01, "torch.optim.AdamW's weight_decay=0.01")
    r.default("optim.betas", [0.9, 0.999], "torch.optim.AdamW's betas=(0.9, 0.999)")
    r.default("training.gradient_accumulation_steps", 1, "gradient_accumulation_steps defaults to 1")
    r.default("data.validation_fraction", 0.0, "no validation unless dataset_val")
    _loss(r)
    _model(r)
    _data(r)
    _loop(r)
    _outputs(r)
    r.rest()
    return r.blocks


def _loss(r: ToolReader) -> None:
    loss = r.get("loss")
    if loss and _name(loss) not in CROSS_ENTROPY and not tool_preference.torchtune_loss(r, loss, _name(loss)):
        r.refuse(("loss", "_component_"), f"loss {loss.get('_component_')!r} is not computed by overdrive (the "
                 "next-token cross-entropy, DPOLoss, SimPOLoss)", f"{tool_preference.OFFERED}; or train this recipe "
                 "with torchtune")
    r.get("ref_checkpointer")
    for key in ("reward_and_value_model", "ppo_epochs", "kl_coeff"):
        if r.given(key):
            r.refuse((key,), "a preference or reinforcement-learning recipe: not run by overdrive",
                     "train this recipe with torchtune")


def _model(r: ToolReader) -> None:
    model = r.get("model") or {}
    builder = _name(model)
    if builder.startswith(("lora_", "qlora_")) or "lora_rank" in model:
        quantized = builder.startswith("qlora_") or bool(model.get("quantize_base"))
        r.put("peft.method", "qlora" if quantized else "lora", "model", "_component_")
        attention = model.get("lora_attn_modules") or []
        targets = [MODULES.get(m, m) for m in attention]
        if model.get("apply_lora_to_mlp"):
            targets += MLP
        if model.get("apply_lora_to_output"):
            targets.append("lm_head")
        where = ("model", "lora_attn_modules") if "lora_attn_modules" in model else ("model", "_component_")
        r.put("peft.target_modules", targets, *where)
        for key, target, default in (("lora_rank", "peft.r", 8), ("lora_alpha", "peft.alpha", 16.0),
                                     ("lora_dropout", "peft.dropout", 0.0)):
            if model.get(key) is not None:
                r.put(target, type(default)(model[key]), "model", key)
            else:
                r.default(target, default, f"the builder's {key}={default}")
        if model.get("use_dora"):
            r.put("peft.use_dora", True, "model", "use_dora")
    elif builder:
        r.put("peft.method", "none", "model", "_component_")
    checkpointer = r.get("checkpointer") or {}
    directory = checkpointer.get("checkpoint_dir")
    if directory:
        r.put("model.name_or_path", str(directory), "checkpointer", "checkpoint_dir")
        if _name(checkpointer) not in ("FullModelHFCheckpointer", ""):
            r.c.warn(("checkpointer", "_component_"), f"{_name(checkpointer)}: overdrive loads the checkpoint with "
                     "Transformers (a save_pretrained directory)", "point checkpoint_dir at the Hugging Face weights")
    if checkpointer.get("adapter_checkpoint"):
        r.unmapped(("checkpointer", "adapter_checkpoint"), "set peft.adapter_path to the adapter's PEFT directory")
    tokenizer = r.get("tokenizer") or {}
    if tokenizer.get("max_seq_len"):
        r.put("data.max_length", int(tokenizer["max_seq_len"]), "tokenizer", "max_seq_len")
    else:
        r.c.warn(("tokenizer",), "no max_seq_len: torchtune does not truncate; overdrive's data.max_length applies",
                 "set data.max_length")
    if r.given("enable_activation_checkpointing"):
        r.put("model.gradient_checkpointing", common.truthy(r.data["enable_activation_checkpointing"]),
              "enable_activation_checkpointing")
    dtype = str(r.get("dtype", "fp32"))
    r.put("precision.mixed_precision", {"bf16": "bf16", "fp16": "fp16"}.get(dtype, "no"), "dtype")
    if dtype in ("bf16", "fp16"):
        r.c.warn(("dtype",), f"torchtune keeps the weights in {dtype}; overdrive trains float32 weights under "
                 f"{dtype} autocast", "set model.dtype=bfloat16 to hold the weights in bf16 too")
    if r.get("compile"):
        r.put("compile.backend", "inductor", "compile")


def _data(r: ToolReader) -> None:
    blocks = r.get("dataset")
    blocks = blocks if isinstance(blocks, list) else [blocks] if blocks else []
    entries = [e for e in (_dataset(r, i if len(blocks) > 1 else None, b) for i, b in enumerate(blocks)) if e]
    if any(e.get("layout") for e in entries) and not any("chosen_column" in e for e in entries):
        r.put("data.format", "chat", "dataset")
    if len(entries) == 1:
        path = entries[0].pop("path")
        entries[0].pop("name")
        for key, value in entries[0].items():
            r.put(f"data.{key}", value, *path)
    elif entries:
        r.c.warn(("dataset",), "torchtune concatenates its datasets; overdrive mixes them by weight (equal here): "
                 "set data.sources.N.weight to each one's share of the rows")
        r.put("data.sources", [{k: v for k, v in e.items() if k != "path"} for e in entries], "dataset")
    if r.given("shuffle"):
        r.put("data.shuffle", common.truthy(r.data["shuffle"]), "shuffle")
    if r.get("dataset_val"):
        r.unmapped(("dataset_val",), "set data.validation_split or data.validation_fraction")


def _dataset(r: ToolReader, index, block) -> dict:
    path = ("dataset",) if index is None else ("dataset", str(index))
    builder = _name(block)
    if builder not in DATASETS:
        r.refuse(path + ("_component_",), f"dataset builder {builder!r} has no counterpart in overdrive (its prompts "
                 "would be built otherwise)", "convert the data to messages, ShareGPT or Alpaca rows (data.layout)")
        return {}
    source, layout = DATASETS[builder]
    entry: dict = {"name": builder, "path": path + ("_component_",)}
    given = block.get("data_files") or block.get("source") or source
    entry["source"] = given[0] if isinstance(given, list) else given
    if block.get("split") and not str(block["split"]).startswith("train["):
        entry["split"] = block["split"]
    if builder == "chat_dataset":
        style = str(block.get("conversation_style", "sharegpt"))
        layout = {"sharegpt": "sharegpt", "openai": "messages"}.get(style)
        if layout is None:
            r.refuse(path + ("conversation_style",), f"conversation style {style!r} has no counterpart",
                     "use sharegpt or openai")
            return {}
        entry["messages_column"] = block.get("conversation_column", "conversations")
    if layout == "prompt-completion":
        columns = block.get("column_map") or {}
        entry["prompt_column"], entry["completion_column"] = columns.get("input", "input"), columns.get("output", "output")
    if layout == "text":
        entry["text_column"] = block.get("column", "text")
        layout = None
    if layout == "pairs":  # preference pairs: their columns, the layout recognised by them
        columns = block.get("column_map") or {}
        if builder == "stack_exchange_paired_dataset":
            entry.update(layout="alpaca", prompt_column="question", chosen_column="response_j",
                         rejected_column="response_k")
        else:
            entry.update(chosen_column=columns.get("chosen", "chosen"), rejected_column=columns.get("rejected", "rejected"))
        return entry
    if layout:
        entry["layout"] = layout
    if "packed" in block:
        r.put("data.packing", bool(block["packed"]), *path, "packed")
    if "train_on_input" in block:
        r.put("data.train_on_prompt", bool(block["train_on_input"]), *path, "train_on_input")
    if block.get("new_system_prompt"):
        r.unmapped(path + ("new_system_prompt",))
    return entry


def _loop(r: ToolReader) -> None:
    r.put_key("batch_size", "training.micro_batch_size", int)
    r.put_key("gradient_accumulation_steps", "training.gradient_accumulation_steps", int)
    if r.given("max_steps_per_epoch"):  # each epoch cut short: the run is epochs x that many steps
        epochs = float(r.get("epochs", 1))
        r.put("training.max_steps", int(epochs * int(r.data["max_steps_per_epoch"])), "max_steps_per_epoch")
        r.c.warn(("max_steps_per_epoch",), "read as training.max_steps = epochs x max_steps_per_epoch (the same "
                 "when every epoch has at least that many steps)")
    else:
        r.put_key("epochs", "training.num_epochs", float)
    r.put_key("seed", "training.seed", int)
    r.put_key("clip_grad_norm", "training.gradient_clipping", lambda v: float(v) if float(v) > 0 else None)
    optimizer = r.get("optimizer") or {}
    name = _name(optimizer)
    if name:
        if name not in OPTIMIZERS:
            r.refuse(("optimizer", "_component_"), f"optimizer {optimizer['_component_']!r} has no counterpart",
                     "set optim.class_path to its import path, or use AdamW")
        else:
            r.put("optim.name", OPTIMIZERS[name], "optimizer", "_component_")
            if name.startswith("Paged") or name == "AdamW4bit":
                r.c.warn(("optimizer", "_component_"), f"{name} read as overdrive's `{OPTIMIZERS[name]}` (no paged "
                         "memory, no torchao quantized state)")
        for key, target in (("lr", "optim.lr"), ("weight_decay", "optim.weight_decay"), ("eps", "optim.eps")):
            if key in optimizer:
                r.put(target, float(optimizer[key]), "optimizer", key)
        if "betas" in optimizer:
            r.put("optim.betas", [float(b) for b in optimizer["betas"]], "optimizer", "betas")
        if optimizer.get("fused"):
            r.put("optim.implementation", "fused", "optimizer", "fused")
    scheduler = r.get("lr_scheduler") or {}
    schedule = _name(scheduler)
    if schedule:
        known = {"get_cosine_schedule_with_warmup": "cosine", "get_linear_schedule_with_warmup": "linear",
                 "get_constant_schedule_with_warmup": "constant"}
        if schedule not in known:
            r.refuse(("lr_scheduler", "_component_"), f"schedule {scheduler['_component_']!r} has no counterpart",
                     "set scheduler.name")
        else:
            r.put("scheduler.name", known[schedule], "lr_scheduler", "_component_")
        if "num_warmup_steps" in scheduler:
            r.put("scheduler.warmup_steps", int(scheduler["num_warmup_steps"]), "lr_scheduler", "num_warmup_steps")
        if scheduler.get("num_cycles", 0.5) != 0.5:
            r.refuse(("lr_scheduler", "num_cycles"), "a cosine of other than half a cycle has no counterpart",
                     "remove num_cycles")
    r.put_key("log_every_n_steps", "training.log_every_steps", int)
    r.put_key("run_val_every_n_steps", "training.eval_every_steps", int)
    if r.given("fsdp_cpu_offload") or r.given("fsdp_reshard_after_forward") or r.given("data_parallel_shard_dim"):
        config = {"fsdp_version": 2}
        paths = {"fsdp_version": ("fsdp_cpu_offload",) if r.given("fsdp_cpu_offload") else ("data_parallel_shard_dim",)}
        if r.given("fsdp_cpu_offload"):
            config["fsdp_offload_params"], paths["fsdp_offload_params"] = bool(r.data["fsdp_cpu_offload"]), ("fsdp_cpu_offload",)
        if r.given("fsdp_reshard_after_forward"):
            config["fsdp_reshard_after_forward"] = bool(r.data["fsdp_reshard_after_forward"])
            paths["fsdp_reshard_after_forward"] = ("fsdp_reshard_after_forward",)
        r.blocks.fsdp, r.blocks.fsdp_paths = config, paths
    for key in ("device", "log_peak_memory_stats", "resume_from_checkpoint", "save_adapter_weights_only",
                "enable_activation_offloading", "profiler", "output_dir"):
        r.used.add(key) if key in ("device", "log_peak_memory_stats", "save_adapter_weights_only") or \
            not r.data.get(key) or (isinstance(r.data.get(key), dict) and not r.data[key].get("enabled")) else None


def _outputs(r: ToolReader) -> None:
    r.put_key("output_dir", "output_dir", str)
    logger = r.get("metric_logger") or {}
    kind = _name(logger)
    trackers = {"WandBLogger": ["wandb"], "TensorBoardLogger": ["tensorboard"], "MLFlowLogger": ["mlflow"],
                "CometLogger": ["comet_ml"], "DiskLogger": [], "StdoutLogger": []}
    if kind in trackers:
        r.put("logging.trackers", trackers[kind], "metric_logger", "_component_")
        if logger.get("project"):
            r.put("logging.project_name", str(logger["project"]), "metric_logger", "project")
    elif kind:
        r.unmapped(("metric_logger",))
