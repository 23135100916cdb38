"""LLaMA-Factory's training YAML (`llamafactory-cli train x.yaml`: its model, data, finetuning and
Transformers' training arguments, https://llamafactory.readthedocs.io), key by key.

Recognised by `model_name_or_path` with LLaMA-Factory's own keys beside it. Its defaults that
differ from overdrive's are carried explicitly with LLaMA-Factory named as their origin:
`finetuning_type: lora`, `lora_rank: 8`, `lora_alpha` = 2 x rank, `lora_target: all`, gradient
checkpointing on, `cutoff_len: 2048`, 3 epochs, and Transformers' TrainingArguments defaults
(linear schedule to 0, no warmup, no weight decay, betas 0.9/0.999). Datasets are looked up in
`<dataset_dir>/dataset_info.json` as LLaMA-Factory does (file or hub id, alpaca or sharegpt
formatting, column names and role tags). The preference stages dpo, kto and rm map onto `preference.*`
(interop/tool_preference.py) with their `ranking: true` / `kto_tag` data sets; ppo is refused by key.
"""

from __future__ import annotations

import json
from pathlib import Path

from overdrive.interop import llamafactory_v1
from overdrive.interop import tool_common as common
from overdrive.interop import tool_preference
from overdrive.interop.tool_common import ToolReader

TOOL = "LLaMA-Factory"
# The keys that name a run's data: given on the import's command line, they answer a data set the file cannot say.
DATA_KEYS = ("data.source", "data.sources")
MARKERS = {"stage", "finetuning_type", "template", "cutoff_len", "dataset", "lora_target", "lora_rank",
           "quantization_bit", "dataset_dir", "do_train"}
# LLaMA-Factory's sharegpt role tags, when none are given
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
_REFUSED = {  # key: (what it does, fix)
    "loraplus_lr_ratio": "LoRA+ (another learning rate for the B matrices)",
    "pissa_init": "PiSSA initialisation of the adapter", "use_galore": "GaLore projected gradients",
    "use_apollo": "APOLLO", "use_badam": "BAdam block-wise updates", "use_llama_pro": "LLaMA Pro block expansion",
    "use_adam_mini": "Adam-mini", "resize_vocab": "a resized vocabulary", "new_special_tokens": "added special tokens",
    "rope_scaling": "RoPE scaling of the positions", "shift_attn": "shift short attention", "mixture_of_depths":
    "mixture of depths", "neat_packing": "packing without cross-attention masks (overdrive's packing already keeps "
    "sequences apart: drop the key and keep `packing`)", "mask_history": "a loss on the last turn only",
}


def recognises(data) -> bool:
    return "model_name_or_path" in data and bool(MARKERS & set(data)) or llamafactory_v1.recognises(data)


def read(data, c, source: str):
    if llamafactory_v1.recognises(data):  # the v1 form: `model:` with plugin configs
        return llamafactory_v1.read(data, c, source)
    r = ToolReader(TOOL, data, c, source)
    common.hf_training_defaults(r)
    r.default("scheduler.name", "linear", "Transformers' TrainingArguments lr_scheduler_type=linear")
    r.default("data.max_length", 2048, "cutoff_len defaults to 2048")
    r.default("model.gradient_checkpointing", True, "gradient checkpointing is on unless disable_gradient_checkpointing")
    r.default("data.validation_fraction", 0.0, "val_size defaults to 0")
    stage = str(r.get("stage", "sft")).lower()
    if stage in ("dpo", "kto", "rm"):
        tool_preference.llamafactory(r, stage)
    elif stage not in ("sft", "pt"):
        r.refuse(("stage",), f"stage {stage!r} is a training stage overdrive does not run (an online stage)",
                 f"{tool_preference.OFFERED}; pt and sft; train this stage with LLaMA-Factory")
    for key, what in _REFUSED.items():
        if r.given(key) and r.data[key] not in (False, 0, "none"):
            r.refuse((key,), f"{what} is not done by overdrive: the math would differ", f"remove {key}")
    _model(r)
    _adapter(r)
    _data(r, stage)
    _loop(r)
    _outputs(r)
    r.rest()
    return r.blocks


def _model(r: ToolReader) -> None:
    r.put_key("model_name_or_path", "model.name_or_path", str)
    r.put_key("model_revision", "model.revision", str)
    r.put_key("trust_remote_code", "model.trust_remote_code", common.truthy)
    r.put_key("train_from_scratch", "model.from_scratch", common.truthy)
    if r.given("disable_gradient_checkpointing"):
        r.put("model.gradient_checkpointing", not common.truthy(r.data["disable_gradient_checkpointing"]),
              "disable_gradient_checkpointing")
    r.put_key("gradient_checkpointing", "model.gradient_checkpointing", common.truthy)
    if r.given("flash_attn"):
        common.attention(r, "flash_attn", r.data["flash_attn"])
    for key in ("hf_hub_token", "ms_hub_token", "om_hub_token"):
        if r.given(key):
            r.unmapped((key,), "set HF_TOKEN in the environment")


def _adapter(r: ToolReader) -> None:
    kind = str(r.get("finetuning_type", "lora")).lower()
    bits = r.get("quantization_bit")
    if kind == "full":
        r.put("peft.method", "none", "finetuning_type")
        return
    if kind != "lora":
        r.refuse(("finetuning_type",), f"finetuning_type {kind!r} has no counterpart in overdrive",
                 "use lora or full (peft.method)")
        return
    where = ("finetuning_type",) if "finetuning_type" in r.data else ()
    if bits is not None:
        method = str(r.get("quantization_method", "bnb")).lower()
        if method not in ("bnb", "bitsandbytes") or int(bits) not in (4, 8):
            r.refuse(("quantization_bit",), f"{method} {bits}-bit quantization has no counterpart in overdrive",
                     "quantization_method: bnb with quantization_bit 4 or 8 (QLoRA)")
        r.put("peft.method", "qlora", "quantization_bit")
        r.put("peft.bits", int(bits), "quantization_bit")
    elif where:
        r.put("peft.method", "lora", *where)
    else:
        r.default("peft.method", "lora", "finetuning_type defaults to lora")
    rank = int(r.get("lora_rank", 8))
    if r.given("lora_rank"):
        r.put("peft.r", rank, "lora_rank")
    else:
        r.default("peft.r", 8, "lora_rank defaults to 8")
    if r.given("lora_alpha"):
        r.put("peft.alpha", float(r.data["lora_alpha"]), "lora_alpha")
    else:
        r.default("peft.alpha", float(2 * rank), f"lora_alpha unset: 2 x lora_rank = {2 * rank}")
    if r.given("lora_dropout"):
        r.put("peft.dropout", float(r.data["lora_dropout"]), "lora_dropout")
    else:
        r.default("peft.dropout", 0.0, "lora_dropout defaults to 0")
    target = r.get("lora_target", "all")
    names = [t.strip() for t in target.split(",")] if isinstance(target, str) else list(target)
    value = "all-linear" if names == ["all"] else names
    r.put("peft.target_modules", value, "lora_target") if r.given("lora_target") else \
        r.default("peft.target_modules", value, "lora_target defaults to all")
    r.put_key("additional_target", "peft.modules_to_save",
              lambda v: [t.strip() for t in v.split(",")] if isinstance(v, str) else list(v))
    r.put_key("use_dora", "peft.use_dora", common.truthy)
    r.put_key("use_rslora", "peft.use_rslora", common.truthy)
    r.put_key("double_quantization", "peft.double_quant", common.truthy)
    r.put_key("quantization_type", "peft.quant_type", str)
    adapters = r.get("adapter_name_or_path")
    if adapters:
        names = [a.strip() for a in str(adapters).split(",")]
        if len(names) > 1:
            r.refuse(("adapter_name_or_path",), "several adapters merged before training: overdrive continues one",
                     "merge them first (overdrive merge), or give one adapter")
        else:
            r.put("peft.adapter_path", names[0], "adapter_name_or_path")


def _dataset_info(r: ToolReader) -> tuple[dict, Path]:
    folder = Path(str(r.get("dataset_dir", "data")))
    for base in (Path.cwd(), Path(r.source).parent):
        info = (base / folder if not folder.is_absolute() else folder) / "dataset_info.json"
        if info.is_file():
            return json.loads(info.read_text()), info.parent
    return {}, folder


def _data(r: ToolReader, stage: str) -> None:
    r.put_key("cutoff_len", "data.max_length", int)
    r.put_key("train_on_prompt", "data.train_on_prompt", common.truthy)
    r.put_key("packing", "data.packing", common.truthy)
    r.put_key("streaming", "data.streaming", common.truthy)
    r.put_key("dataloader_num_workers", "data.num_workers", int)
    if r.given("disable_shuffling"):
        r.put("data.shuffle", not common.truthy(r.data["disable_shuffling"]), "disable_shuffling")
    size = r.get("val_size")
    if size is not None and 0 <= float(size) < 1:
        r.put("data.validation_fraction", float(size), "val_size")
    elif size is not None:
        r.unmapped(("val_size",), "a count of rows; overdrive holds out a fraction (data.validation_fraction)")
    if r.get("template") not in (None, "default", "empty"):
        r.c.warn(("template",), f"LLaMA-Factory's template {r.data['template']!r} is not shipped with overdrive: the "
                 "tokenizer's own chat template renders the chats", "set tokenizer.chat_template to the template's text")
    names = r.get("dataset")
    if not names:
        return
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    info, folder = _dataset_info(r)
    entries = []
    for name in names:
        if name not in info:  # refused, never left to the default data: the run trains on what the file names
            why = (f"it is not in {folder / 'dataset_info.json'}" if info else f"there is no dataset_info.json in "
                   f"{folder} (looked in the working directory and beside {r.source})")
            r.refuse(("dataset",), f"{name!r} cannot be found: {why}, so its file and layout are unknown",
                     "run the import where LLaMA-Factory ran (or set dataset_dir), or name the data set on the "
                     f"command line: overdrive import {r.source} data.source=PATH_OR_HUB_NAME"
                     f"{' data.format=chat' if stage == 'sft' else ''} -o run.yaml",
                     settled_by=DATA_KEYS)
            continue
        entries.append(_entry(r, name, info[name], folder, stage))
    entries = [e for e in entries if e]
    if stage == "sft" and entries:
        r.put("data.format", "chat", "dataset")
    if stage in ("dpo", "kto", "rm") and len(entries) > 1:
        r.refuse(("dataset",), "preference training reads one data set", "give one data set (merge the files)")
        return
    if len(entries) == 1:
        for key, value in entries[0].items():
            if key != "name":
                r.put(f"data.{key}", value, "dataset")
    elif entries:
        weights = r.get("interleave_probs")
        if weights:
            probs = [float(p) for p in (weights.split(",") if isinstance(weights, str) else weights)]
            for entry, p in zip(entries, probs):
                entry["weight"] = p
        else:
            r.c.warn(("dataset",), f"{TOOL} concatenates its datasets (mix_strategy concat); overdrive mixes them "
                     "by weight (equal here): set data.sources.N.weight to each one's share of the rows")
        r.put("data.sources", entries, "dataset")
    r.get("mix_strategy"), r.get("dataset_dir")


def _entry(r: ToolReader, name: str, spec: dict, folder: Path, stage: str) -> dict:
    preference = stage in ("dpo", "kto", "rm")
    if bool(spec.get("ranking")) != (stage in ("dpo", "rm")) and stage != "pt":
        r.refuse(("dataset",), f"{name!r} is {'a' if spec.get('ranking') else 'not a'} ranking data set "
                 f"(ranking: true in dataset_info.json) and stage is {stage}",
                 "give a ranking data set to dpo and rm, another to sft and kto")
        return {}
    source = spec.get("file_name") and str(folder / spec["file_name"]) or spec.get("hf_hub_url") or spec.get("ms_hub_url")
    if not source:
        r.refuse(("dataset",), f"{name!r}: neither file_name nor hf_hub_url in dataset_info.json",
                 "give the data set a file_name or an hf_hub_url")
        return {}
    if spec.get("file_name") and not Path(source).exists():
        r.refuse(("dataset",), f"{name!r}: its file_name {spec['file_name']} is not in {folder} ({source} does not exist)",
                 f"put the file in {folder}, or correct file_name in {folder / 'dataset_info.json'}")
        return {}
    entry = {"name": name, "source": source}
    for key, target in (("subset", "subset"), ("split", "split")):
        if spec.get(key):
            entry[target] = spec[key]
    columns = spec.get("columns") or {}
    if stage == "pt":
        entry["text_column"] = columns.get("prompt", "text")
        return entry
    if spec.get("formatting", "alpaca") == "sharegpt":
        tags = {**SHAREGPT_TAGS, **(spec.get("tags") or {})}
        entry["layout"] = "messages" if tags["role_tag"] == "role" and tags["content_tag"] == "content" else "sharegpt"
        if entry["layout"] == "sharegpt" and (tags["role_tag"], tags["content_tag"]) != ("from", "value"):
            r.refuse(("dataset",), f"{name!r}: ShareGPT turns with tags {tags['role_tag']}/{tags['content_tag']}",
                     "rewrite the turns as {from, value} or {role, content}")
        entry["messages_column"] = columns.get("messages", "conversations")
        if preference and entry["layout"] == "messages" and stage != "kto":  # the prompt's turns; chosen/rejected messages
            entry["prompt_column"] = entry.pop("messages_column")
    else:
        entry["layout"] = "alpaca"
        for key, target in (("prompt", "prompt_column"), ("query", "input_column"), ("response", "completion_column")):
            if columns.get(key):
                entry[target] = columns[key]
        if stage == "kto":
            r.refuse(("dataset",), f"{name!r}: KTO rows in the Alpaca formatting", "write them as a conversation "
                     "(formatting: sharegpt) or prompt/completion/label columns")
            return {}
    for key, target in (("chosen", "chosen_column"), ("rejected", "rejected_column"), ("kto_tag", "label_column")):
        if preference and columns.get(key):
            entry[target] = columns[key]
    for key, target in (("system", "system_column"), ("tools", "tools_column")):
        if columns.get(key):
            entry[target] = columns[key]
    return entry


def _loop(r: ToolReader) -> None:
    r.put_key("per_device_train_batch_size", "training.micro_batch_size", int)
    r.put_key("gradient_accumulation_steps", "training.gradient_accumulation_steps", int)
    max_steps = r.get("max_steps")
    common.steps_or_epochs(r, max_steps, "num_train_epochs", 3.0,
                           "Transformers' TrainingArguments num_train_epochs=3", "Transformers' Trainer")
    common.trainer_optimizer(r, "optim", "lr_scheduler_type")
    kwargs = r.get("lr_scheduler_kwargs") or {}
    if isinstance(kwargs, dict) and "min_lr_rate" in kwargs:
        r.put("scheduler.min_lr_ratio", float(kwargs["min_lr_rate"]), "lr_scheduler_kwargs", "min_lr_rate")
    r.put_key("warmup_steps", "scheduler.warmup_steps", int)
    if r.given("warmup_ratio") and float(r.data["warmup_ratio"]) > 0 and not r.get("warmup_steps"):
        r.put("scheduler.warmup_ratio", float(r.data["warmup_ratio"]), "warmup_ratio")
    r.put_key("seed", "training.seed", int)
    r.put_key("logging_steps", "training.log_every_steps", lambda v: max(1, int(v)))
    evaluate_every = str(r.get("eval_strategy", r.get("evaluation_strategy", "no"))).lower()
    if evaluate_every == "epoch":
        r.put("training.evals_per_epoch", 1, "eval_strategy")
    elif evaluate_every == "steps":
        r.put_key("eval_steps", "training.eval_every_steps", lambda v: max(1, int(float(v))))
    save = str(r.get("save_strategy", "steps")).lower()
    if save == "epoch":
        r.put("checkpoint.saves_per_epoch", 1, "save_strategy")
    elif save == "steps":
        r.put_key("save_steps", "checkpoint.every_steps", lambda v: max(1, int(float(v))))
    r.put_key("save_total_limit", "checkpoint.keep_last", int)
    r.put_key("ddp_timeout", "launch.timeout_minutes", lambda v: max(1, int(v) // 60))
    common.precision(r)
    fsdp, block = r.get("fsdp"), r.get("fsdp_config")
    if fsdp or block:
        config = dict(block) if isinstance(block, dict) else {}
        config = {(k if str(k).startswith("fsdp_") else f"fsdp_{k}"): v for k, v in config.items()}
        r.blocks.fsdp = config
        r.blocks.fsdp_paths = {k: ("fsdp_config", k.removeprefix("fsdp_")) if k.removeprefix("fsdp_") in block
                               else ("fsdp_config", k) for k in config} if isinstance(block, dict) else {}
        r.blocks.fsdp_paths.setdefault("fsdp_version", ("fsdp",))
    if r.get("deepspeed"):
        r.blocks.deepspeed = (r.data["deepspeed"], ("deepspeed",))
    for key in ("do_train", "overwrite_output_dir", "overwrite_cache", "plot_loss", "preprocessing_num_workers",
                "do_eval", "per_device_eval_batch_size", "quantization_method", "evaluation_strategy", "eval_steps",
                "save_steps", "save_strategy"):
        r.used.add(key)


def _outputs(r: ToolReader) -> None:
    r.put_key("output_dir", "output_dir", str)
    if r.given("report_to"):
        common.trackers(r, "report_to", r.data["report_to"])
    r.put_key("run_name", "logging.project_name", str)
    if r.get("resume_from_checkpoint"):
        r.unmapped(("resume_from_checkpoint",), "overdrive resumes from output_dir's newest checkpoint")
