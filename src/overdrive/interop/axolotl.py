"""Axolotl's YAML config (https://docs.axolotl.ai/docs/config-reference.html), key by key.

Recognised by `base_model` with Axolotl's own keys beside it. Its FSDP block (`fsdp` +
`fsdp_config`, with or without the `fsdp_` prefixes, `fsdp_version`) is handed to the Accelerate
FSDP reader; `deepspeed:` names a DeepSpeed JSON, read as one. `rl:` dpo, ipo, orpo, simpo and kto
and a reward model map onto `preference.*` (interop/tool_preference.py, with their DPO / KTO dataset
types); `rl: grpo` and its `trl:` block onto `rl.*` (interop/tool_rl.py); other online stages are
refused by key.
"""

from __future__ import annotations

from typing import Any, Optional

from overdrive.interop import tool_common as common
from overdrive.interop import tool_preference
from overdrive.interop.tool_common import ToolReader

TOOL = "Axolotl"
MARKERS = {"adapter", "datasets", "micro_batch_size", "sequence_len", "sample_packing", "lora_r", "num_epochs",
           "lora_target_linear", "load_in_4bit", "load_in_8bit", "pretraining_dataset", "val_set_size"}


def recognises(data) -> bool:
    return "base_model" in data and bool(MARKERS & set(data))


# dataset `type` -> data.layout (None: plain text, `field` or `text` column)
DATASET_TYPES = {"alpaca": "alpaca", "alpaca_chat": "alpaca", "sharegpt": "sharegpt", "chat_template": "messages",
                 "completion": None, "pretrain": None, "input_output": "prompt-completion"}


def read(data, c, source: str):
    r = ToolReader(TOOL, data, c, source)
    common.hf_training_defaults(r)
    r.default("training.micro_batch_size", 1, "micro_batch_size defaults to 1")
    r.default("data.max_length", 512, "sequence_len defaults to 512")
    r.default("scheduler.name", "cosine", "lr_scheduler defaults to cosine")
    r.default("training.seed", 42, "seed defaults to 42")
    rl = tool_preference.axolotl(r)  # None: supervised fine-tuning
    _model(r)
    _adapter(r)
    _data(r, rl)
    _loop(r)
    _parallel(r)
    _outputs(r)
    r.rest()
    return r.blocks


def _model(r: ToolReader) -> None:
    r.put_key("base_model", "model.name_or_path")
    r.put_key("tokenizer_config", "tokenizer.name_or_path")
    r.put_key("trust_remote_code", "model.trust_remote_code", bool)
    r.put_key("revision_of_model", "model.revision", str)
    for key in ("model_type", "tokenizer_type", "base_model_config", "tokenizer_use_fast", "strict", "is_llama_derived_model"):
        r.get(key)  # Transformers' Auto classes pick these from the checkpoint
    r.put_key("gradient_checkpointing", "model.gradient_checkpointing", common.truthy)
    if r.given("gradient_checkpointing_kwargs"):
        r.unmapped(("gradient_checkpointing_kwargs",), "Transformers' defaults are used")
    if r.given("attn_implementation"):
        common.attention(r, "attn_implementation", r.data["attn_implementation"])
    for key, name in (("flash_attention", "flash_attention_2"), ("sdp_attention", "sdpa"), ("eager_attention", "eager"),
                      ("flex_attention", "flex_attention")):
        if r.given(key) and common.truthy(r.data[key]):
            r.put("model.attn_implementation", name, key)
    if r.given("xformers_attention") and common.truthy(r.data["xformers_attention"]):
        r.unmapped(("xformers_attention",), "Transformers' own attention kernels only")
    if r.get("special_tokens"):
        tokens = r.data["special_tokens"]
        extra = sorted(set(tokens) - {"pad_token"}) if isinstance(tokens, dict) else []
        if extra:
            r.c.warn(("special_tokens",), f"sets {', '.join(extra)} on the tokenizer: not done here, the tokenizer's own "
                     "are used", "save the tokenizer with these tokens (save_pretrained) and set tokenizer.name_or_path")
        else:
            r.unmapped(("special_tokens",), "the pad token is only used for padding here, never in the loss")
    if r.get("tokens"):
        r.refuse(("tokens",), "adds tokens to the vocabulary: the embeddings and the ids change",
                 "add the tokens to a saved tokenizer and model (resize_token_embeddings), then point model.name_or_path at it")


def _adapter(r: ToolReader) -> None:
    adapter = str(r.get("adapter", "") or "").lower()
    four, eight = common.truthy(r.get("load_in_4bit", False)), common.truthy(r.get("load_in_8bit", False))
    if adapter in ("lora", "qlora"):
        quantized = adapter == "qlora" or four or eight
        r.put("peft.method", "qlora" if quantized else "lora", "adapter")
        if quantized:
            r.put("peft.bits", 8 if eight and not four else 4, "load_in_8bit" if eight and not four else
                  "load_in_4bit" if four else "adapter")
        r.default("peft.alpha", 8.0, "lora_alpha unset: PEFT's LoraConfig default 8")
        r.default("peft.dropout", 0.0, "lora_dropout defaults to 0")
        r.default("peft.r", 8, "lora_r unset: PEFT's LoraConfig default 8")
    elif adapter:
        r.refuse(("adapter",), f"adapter {adapter!r} has no counterpart in overdrive",
                 "use adapter: lora or qlora (peft.method), or remove it to train every weight")
    elif four or eight:
        r.refuse(("load_in_4bit" if four else "load_in_8bit",), "a quantized base without an adapter cannot be trained",
                 "set adapter: qlora")
    r.put_key("lora_r", "peft.r", int)
    r.put_key("lora_alpha", "peft.alpha", float)
    r.put_key("lora_dropout", "peft.dropout", float)
    r.put_key("lora_model_dir", "peft.adapter_path", str)
    modules = r.get("lora_target_modules")
    if common.truthy(r.get("lora_target_linear", False)):
        r.put("peft.target_modules", "all-linear", "lora_target_linear")
        if modules:
            r.c.warn(("lora_target_modules",), "lora_target_linear is set too: every linear layer gets an adapter")
    elif modules:
        r.put("peft.target_modules", [modules] if isinstance(modules, str) else list(modules), "lora_target_modules")
    r.put_key("lora_modules_to_save", "peft.modules_to_save", lambda v: [v] if isinstance(v, str) else list(v))
    r.put_key("peft_use_dora", "peft.use_dora", common.truthy)
    r.put_key("peft_use_rslora", "peft.use_rslora", common.truthy)
    bnb = r.get("bnb_config_kwargs") or {}
    for key, target in (("bnb_4bit_quant_type", "peft.quant_type"), ("bnb_4bit_use_double_quant", "peft.double_quant"),
                        ("bnb_4bit_quant_storage", "peft.storage_dtype")):
        if key in bnb:
            r.put(target, bnb[key], "bnb_config_kwargs", key)
    if r.given("lora_fan_in_fan_out") and common.truthy(r.data["lora_fan_in_fan_out"]):
        r.unmapped(("lora_fan_in_fan_out",), "PEFT sets it from the model's layers")


def _data(r: ToolReader, rl: Optional[str] = None) -> None:
    r.put_key("sequence_len", "data.max_length", int)
    r.put_key("sample_packing", "data.packing", common.truthy)
    r.put_key("train_on_inputs", "data.train_on_prompt", common.truthy)
    r.put_key("chat_template_jinja", "tokenizer.chat_template", str)
    template = r.get("chat_template")
    if template and template not in ("tokenizer_default", "jinja") and not r.given("chat_template_jinja"):
        r.c.warn(("chat_template",), f"Axolotl's named template {template!r} is not shipped with overdrive: the "
                 "tokenizer's own template renders the chats", "set tokenizer.chat_template to the template's text")
    size = r.get("val_set_size")
    if size is not None:
        if 0 <= float(size) < 1:
            r.put("data.validation_fraction", float(size), "val_set_size")
        else:
            r.unmapped(("val_set_size",), "a count of rows; overdrive holds out a fraction (data.validation_fraction)")
    elif "val_set_size" not in r.data:
        r.default("data.validation_fraction", 0.0, "val_set_size defaults to 0: no evaluation")
    datasets = r.get("datasets") or []
    if r.given("pretraining_dataset"):
        datasets = r.data["pretraining_dataset"]
        datasets = [datasets] if isinstance(datasets, (str, dict)) else datasets
        key = "pretraining_dataset"
    else:
        key = "datasets"
    entries = [_dataset(r, key, i, d, rl) for i, d in enumerate(datasets if isinstance(datasets, list) else [datasets])]
    entries = [e for e in entries if e]
    _put_sources(r, key, entries)
    for name in ("dataset_prepared_path", "shuffle_merged_datasets", "dataset_processes", "pad_to_sequence_len",
                 "eval_sample_packing", "group_by_length", "test_datasets"):
        if r.get(name) not in (None, False):
            r.unmapped((name,))


def _dataset(r: ToolReader, key: str, index: int, entry: Any, rl: Optional[str] = None) -> dict:
    path = (key, str(index))
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(entry, dict) or not entry.get("path"):
        r.refuse(path, "a dataset without a `path`", "give each dataset a path (a hub id or a local file)")
        return {}
    kind = entry.get("type", "completion" if key == "pretraining_dataset" else None)
    kind_name = kind if isinstance(kind, str) else None
    out = {"name": str(entry.get("name") or entry["path"]).split("/")[-1], "source": entry.get("data_files") or entry["path"],
           "path": path}
    if isinstance(out["source"], list):
        out["source"] = out["source"][0]
    if rl == "grpo":  # prompts rows (interop/tool_rl.py)
        from overdrive.interop.tool_rl import axolotl_dataset

        return _source_keys(entry, out) if axolotl_dataset(r, path, entry, out) else {}
    if rl:  # a preference stage's dataset type: its columns (interop/tool_preference.py)
        if not tool_preference.axolotl_dataset(r, path, entry, rl, out):
            return {}
        return _source_keys(entry, out)
    base_kind = kind_name.split(":")[0].split(".")[0] if kind_name else None  # alpaca:chat, chat_template.default
    if base_kind in DATASET_TYPES and base_kind != kind_name and base_kind != "chat_template":
        r.c.warn(path + ("type",), f"{kind_name} read as {base_kind}: its prompt style is the chat template's here")
    if base_kind in DATASET_TYPES:
        layout = DATASET_TYPES[base_kind]
        messages = entry.get("field_messages") or entry.get("conversation") and "conversations"
        mapping = entry.get("message_property_mappings") or {}
        if layout == "messages" and (mapping.get("role") == "from" or messages == "conversations"):
            layout = "sharegpt"
        if layout is None:
            out["format"] = "text" if str(out["source"]).endswith(".txt") else None
            if entry.get("field"):
                out["text_column"] = entry["field"]
        else:
            out["format"], out["layout"] = "chat", layout
            if messages:
                out["messages_column"] = messages
            for field, target in (("field_instruction", "prompt_column"), ("field_input", "input_column"),
                                  ("field_output", "completion_column"), ("field_system", "system_column"),
                                  ("field_tools", "tools_column")):
                if entry.get(field):
                    out[target] = entry[field]
        if entry.get("chat_template_jinja"):
            out["chat_template"] = entry["chat_template_jinja"]
    else:
        r.refuse(path + ("type",), f"dataset type {kind!r} has no counterpart in overdrive (its prompts would be "
                 "built otherwise)", "convert the data to messages, ShareGPT or Alpaca rows (data.layout), or use "
                 "type: chat_template / alpaca / sharegpt / completion")
        return {}
    _source_keys(entry, out)
    for extra in ("roles_to_train", "train_on_eos", "shards", "preprocess_shards", "revision"):
        if entry.get(extra) is not None:
            r.c.warn(path + (extra,), "dataset key with no counterpart in overdrive: not used")
    return out


def _source_keys(entry: dict, out: dict) -> dict:
    if entry.get("name") and entry.get("path") and not entry.get("data_files"):
        out["subset"] = entry["name"]
    if entry.get("split"):
        out["split"] = entry["split"]
    return out


def _put_sources(r: ToolReader, key: str, entries: list[dict]) -> None:
    if not entries:
        return
    if any(e.get("format") == "chat" for e in entries):
        r.put("data.format", "chat", key)
    if len(entries) == 1:
        e = entries[0]
        for name, value in e.items():
            if name not in ("name", "path") and value is not None and not (name == "format" and value == "chat"):
                r.put(f"data.{name}", value, *e["path"])
        return
    r.c.warn((key,), f"{TOOL} concatenates its datasets; overdrive mixes them by weight (equal here): set "
             "data.sources.N.weight to each one's share of the rows")
    sources = [{k: v for k, v in e.items() if k != "path" and v is not None} for e in entries]
    names = [s["name"] for s in sources]
    for i, s in enumerate(sources):  # each source named once: the same data set twice gets its index
        s["name"] = f"{s['name']}-{i}" if names.count(s["name"]) > 1 else s["name"]
    for s in sources:
        s.pop("format", None) if s.get("format") == "chat" else None
    r.put("data.sources", sources, key)


def _loop(r: ToolReader) -> None:
    r.put_key("micro_batch_size", "training.micro_batch_size", int)
    r.put_key("gradient_accumulation_steps", "training.gradient_accumulation_steps", int)
    if r.given("batch_size") and not r.given("gradient_accumulation_steps"):
        r.unmapped(("batch_size",), "set training.global_batch_size")
    common.steps_or_epochs(r, r.data["max_steps"] if r.given("max_steps") else None, "num_epochs", 1.0,
                           "num_epochs defaults to 1", "Axolotl (Transformers' Trainer)")
    common.trainer_optimizer(r, "optimizer", "lr_scheduler")
    r.put_key("cosine_min_lr_ratio", "scheduler.min_lr_ratio", float)
    if r.given("warmup_steps"):
        r.put("scheduler.warmup_steps", int(r.data["warmup_steps"]), "warmup_steps")
    elif r.given("warmup_ratio"):
        r.put("scheduler.warmup_ratio", float(r.data["warmup_ratio"]), "warmup_ratio")
    r.get("warmup_ratio")
    r.put_key("seed", "training.seed", int)
    r.put_key("evals_per_epoch", "training.evals_per_epoch", lambda v: int(v) or None)  # 0: none
    r.put_key("eval_steps", "training.eval_every_steps", lambda v: int(v) if float(v) >= 1 else None)
    r.put_key("saves_per_epoch", "checkpoint.saves_per_epoch", lambda v: int(v) or None)
    r.put_key("save_steps", "checkpoint.every_steps", lambda v: int(v) if float(v) >= 1 else None)
    r.put_key("save_total_limit", "checkpoint.keep_last", int)
    r.put_key("logging_steps", "training.log_every_steps", int)
    common.precision(r)
    if r.given("lr_scheduler_kwargs"):
        r.unmapped(("lr_scheduler_kwargs",), "set the scheduler.* keys")


def _parallel(r: ToolReader) -> None:
    fsdp, block = r.get("fsdp"), r.get("fsdp_config") or {}
    version = r.get("fsdp_version") or (block.get("fsdp_version") if isinstance(block, dict) else None)
    if fsdp or block or version:
        config, paths = {}, {}
        for key, value in (block.items() if isinstance(block, dict) else []):
            name = key if str(key).startswith("fsdp_") else f"fsdp_{key}"
            config[name], paths[name] = value, ("fsdp_config", str(key))
        if version is not None:
            config["fsdp_version"] = version
            paths.setdefault("fsdp_version", ("fsdp_version",))
        words = [fsdp] if isinstance(fsdp, str) else list(fsdp or [])
        if "offload" in " ".join(map(str, words)) and "fsdp_offload_params" not in config:
            config["fsdp_offload_params"], paths["fsdp_offload_params"] = True, ("fsdp",)
        if "shard_grad_op" in words and "fsdp_sharding_strategy" not in config:
            config["fsdp_sharding_strategy"], paths["fsdp_sharding_strategy"] = "SHARD_GRAD_OP", ("fsdp",)
        r.blocks.fsdp, r.blocks.fsdp_paths = config, paths
    deepspeed = r.get("deepspeed")
    if deepspeed:
        r.blocks.deepspeed = (deepspeed, ("deepspeed",))


def _outputs(r: ToolReader) -> None:
    r.put_key("output_dir", "output_dir", str)
    if r.given("wandb_project"):
        r.put("logging.trackers", ["wandb"], "wandb_project")
        r.put("logging.project_name", str(r.data["wandb_project"]), "wandb_project")
    for key in ("wandb_entity", "wandb_name", "wandb_watch", "wandb_log_model", "wandb_run_id", "wandb_mode"):
        if r.get(key):
            r.unmapped((key,), "set it in the WANDB_* variables")
    if r.given("use_tensorboard") and common.truthy(r.data["use_tensorboard"]):
        r.put("logging.trackers", ["tensorboard"], "use_tensorboard")
    if r.given("mlflow_experiment_name") or r.given("mlflow_tracking_uri"):
        r.put("logging.trackers", ["mlflow"], "mlflow_tracking_uri" if r.given("mlflow_tracking_uri") else
              "mlflow_experiment_name")
    for key in ("resume_from_checkpoint", "auto_resume_from_checkpoints"):
        if r.get(key):
            r.unmapped((key,), "overdrive resumes from output_dir's newest checkpoint (checkpoint.resume=auto)")
