"""LLaMA-Factory's v1 training YAML (`model: <name>` with `model_class`, `peft_config`, `dist_config`,
`train_dataset` naming a YAML of data sets with their `converter`), key by key. Its defaults
are carried with LLaMA-Factory named as their origin: full fine-tuning without a `peft_config`,
the LoRA plugin's r 8 / alpha 16 / dropout 0.05 / targets `all`, micro-batch 1, cutoff_len 2048,
lr 1e-4, 3 epochs, bf16 and activation checkpointing on, clipping 1.0, torch's AdamW at a constant lr.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from overdrive.interop import tool_common as common
from overdrive.interop.tool_common import ToolReader

TOOL = "LLaMA-Factory"
MARKERS = {"model_class", "peft_config", "dist_config", "train_dataset", "kernel_config", "quant_config"}
CONVERTERS = {"alpaca": "alpaca", "sharegpt": "sharegpt", "openai": "messages"}  # converter -> data.layout


def recognises(data) -> bool:
    return isinstance(data.get("model"), str) and bool(MARKERS & set(data))


def read(data, c, source: str):
    r = ToolReader(TOOL, data, c, source)
    for target, value, why in (("training.micro_batch_size", 1, "micro_batch_size defaults to 1"),
                               ("data.max_length", 2048, "cutoff_len defaults to 2048"),
                               ("optim.lr", 1e-4, "learning_rate defaults to 1e-4"),
                               ("training.gradient_clipping", 1.0, "max_grad_norm defaults to 1.0"),
                               ("precision.mixed_precision", "bf16", "bf16 defaults to true"),
                               ("model.gradient_checkpointing", True, "enable_activation_checkpointing defaults to true"),
                               ("training.seed", 42, "seed defaults to 42"),
                               ("data.validation_fraction", 0.0, "no eval_dataset: no evaluation"),
                               ("peft.method", "none", "no peft_config: every weight trained"),
                               ("scheduler.name", "constant", "no lr_scheduler_config: a constant learning rate"),
                               ("scheduler.warmup_steps", 0, "no lr_scheduler_config: no warmup"),
                               ("optim.weight_decay", 0.01, "no optim_config: torch.optim.AdamW's weight_decay=0.01"),
                               ("optim.betas", [0.9, 0.999], "no optim_config: torch.optim.AdamW's betas")):
        r.default(target, value, why)
    r.put_key("model", "model.name_or_path", str)
    r.put_key("trust_remote_code", "model.trust_remote_code", common.truthy)
    r.put_key("custom_chat_template", "tokenizer.chat_template", str)
    if r.given("flash_attn"):
        common.attention(r, "flash_attn", r.data["flash_attn"])
    if str(r.get("model_class", "llm")).lower() != "llm":
        r.c.warn(("model_class",), f"{r.data['model_class']}: overdrive trains causal language models")
    _peft(r)
    _data(r)
    _loop(r)
    r.rest()
    return r.blocks


def _peft(r: ToolReader) -> None:
    peft = r.get("peft_config") or {}
    quant = r.get("quant_config") or {}
    if not peft:
        return
    name = str(peft.get("name", "lora")).lower()
    if name != "lora":
        r.refuse(("peft_config", "name"), f"{name!r} fine-tuning has no counterpart in overdrive", "use name: lora")
        return
    bits = quant.get("quantization_bit")
    r.put("peft.method", "qlora" if bits else "lora", *(("quant_config", "quantization_bit") if bits else ("peft_config", "name")))
    if bits:
        r.put("peft.bits", int(bits), "quant_config", "quantization_bit")
    for key, target, default in (("r", "peft.r", 8), ("lora_alpha", "peft.alpha", 16.0), ("lora_dropout", "peft.dropout", 0.05)):
        if peft.get(key) is not None:
            r.put(target, type(default)(peft[key]), "peft_config", key)
        else:
            r.default(target, default, f"the LoRA plugin's {key}={default}")
    targets = peft.get("target_modules", "all")
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
    r.put("peft.target_modules", "all-linear" if names == ["all"] else names, "peft_config", "target_modules") \
        if "target_modules" in peft else r.default("peft.target_modules", "all-linear", "target_modules defaults to all")
    for key, target in (("use_dora", "peft.use_dora"), ("use_rslora", "peft.use_rslora"),
                        ("modules_to_save", "peft.modules_to_save")):
        if peft.get(key):
            r.put(target, peft[key], "peft_config", key)
    adapters = peft.get("adapter_name_or_path")
    if adapters:
        r.put("peft.adapter_path", adapters if isinstance(adapters, str) else adapters[0], "peft_config",
              "adapter_name_or_path")


def _data(r: ToolReader) -> None:
    r.put_key("cutoff_len", "data.max_length", int)
    listing = r.get("train_dataset")
    if not listing:
        return
    found = next((p for p in (Path.cwd() / listing, Path(r.source).parent / listing) if p.is_file()), None)
    if found is None:
        r.c.warn(("train_dataset",), f"{listing} not found: its data sets are not read", "set data.source")
        return
    info = yaml.safe_load(found.read_text()) or {}
    entries = []
    for name, spec in info.items():
        converter = str(spec.get("converter", "alpaca"))
        if converter not in CONVERTERS:
            r.refuse(("train_dataset",), f"{name!r}: converter {converter!r} has no counterpart in overdrive "
                     "(a preference pair or another layout)", "give supervised data (alpaca, sharegpt, openai)")
            continue
        path = Path(spec["path"])
        local = spec.get("source") == "local" or (Path.cwd() / path).exists()
        entry = {"name": str(name), "source": str(Path.cwd() / path) if local and not path.is_absolute() else str(path),
                 "layout": CONVERTERS[converter]}
        if spec.get("split"):
            entry["split"] = spec["split"]
        entries.append(entry)
    if not entries:
        return
    r.put("data.format", "chat", "train_dataset")
    if len(entries) == 1:
        for key, value in entries[0].items():
            if key != "name":
                r.put(f"data.{key}", value, "train_dataset")
    else:
        r.c.warn(("train_dataset",), f"{TOOL} concatenates its datasets; overdrive mixes them by weight (equal here): "
                 "set data.sources.N.weight to each one's share of the rows")
        r.put("data.sources", entries, "train_dataset")


def _loop(r: ToolReader) -> None:
    r.put_key("output_dir", "output_dir", str)
    r.put_key("micro_batch_size", "training.micro_batch_size", int)
    r.put_key("global_batch_size", "training.global_batch_size", int)
    r.put_key("learning_rate", "optim.lr", float)
    if r.given("max_steps"):
        r.put("training.max_steps", int(r.data["max_steps"]), "max_steps")
    elif r.given("num_train_epochs"):
        r.put("training.num_epochs", float(r.data["num_train_epochs"]), "num_train_epochs")
    else:
        r.default("training.num_epochs", 3.0, "num_train_epochs defaults to 3")
    r.get("num_train_epochs")
    r.put_key("max_grad_norm", "training.gradient_clipping", lambda v: float(v) if float(v) > 0 else None)
    if r.given("bf16"):
        r.put("precision.mixed_precision", "bf16" if common.truthy(r.data["bf16"]) else "no", "bf16")
    r.put_key("enable_activation_checkpointing", "model.gradient_checkpointing", common.truthy)
    r.put_key("seed", "training.seed", int)
    r.put_key("save_steps", "checkpoint.every_steps", int)
    r.put_key("save_total_limit", "checkpoint.keep_last", int)
    r.put_key("logging_steps", "training.log_every_steps", lambda v: max(1, int(v)))
    r.put_key("dist_timeout", "launch.timeout_minutes", lambda v: max(1, int(v) // 60))
    if r.given("save_epochs") and 0 < float(r.data["save_epochs"]) <= 1:
        r.put("checkpoint.saves_per_epoch", round(1 / float(r.data["save_epochs"])), "save_epochs")
    optim = r.get("optim_config") or {}
    if optim:
        common.optimizer(r, "optim_config", {"adamw": "adamw_torch"}.get(str(optim.get("name")), optim.get("name")))
        if "wd" in optim:
            r.put("optim.weight_decay", float(optim["wd"]), "optim_config", "wd")
    schedule = r.get("lr_scheduler_config") or {}
    if schedule.get("name"):
        common.schedule(r, "lr_scheduler_config", schedule["name"])
    dist = r.get("dist_config") or {}
    name = str(dist.get("name", "")).lower()
    if name in ("fsdp2", "fsdp"):
        r.blocks.fsdp, r.blocks.fsdp_paths = {"fsdp_version": 2}, {"fsdp_version": ("dist_config", "name")}
    elif name == "deepspeed" and dist.get("config_file"):
        r.blocks.deepspeed = (dist["config_file"], ("dist_config", "config_file"))
    elif name:
        r.unmapped(("dist_config", "name"))
    for key in ("kernel_config", "sample_backend", "max_new_tokens", "batching_workers"):
        r.used.add(key)
