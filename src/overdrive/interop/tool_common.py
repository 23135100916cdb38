"""What the readers of Axolotl, LLaMA-Factory and torchtune configs share: one `ToolReader` per
file (each value set with the file:line it came from, the tool's own defaults carried with the
tool named as their origin, keys without a counterpart listed by key, keys that would change the
math refused by key), and the names those tools borrow from Transformers' TrainingArguments
(optimizers, schedules, trackers, precision).

The blocks a tool hands to Accelerate or DeepSpeed (an FSDP block, a DeepSpeed JSON) come back in
`Blocks`, read by interop/tool_reading.py with the Accelerate and DeepSpeed readers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from overdrive.config.provenance import Origin, Setting


@dataclass
class Blocks:
    fsdp: Optional[dict] = None  # Accelerate's fsdp_config keys (fsdp_ prefixed)
    fsdp_paths: dict = field(default_factory=dict)  # fsdp_config key -> its path in the tool's file
    deepspeed: Optional[tuple[Any, tuple[str, ...]]] = None  # a DeepSpeed JSON (path or inline dict), its key


class ToolReader:
    """One tool's config, key by key, into a collector (interop/reading._Collector's interface)."""

    def __init__(self, tool: str, data: Mapping[str, Any], collector, source: str):
        self.tool, self.data, self.c, self.source = tool, dict(data), collector, source
        self.used: set[str] = set()
        self.blocks = Blocks()

    def _reading(self, key: str) -> None:
        """The key being read, for a value of the wrong type met while converting it (tool_reading.py)."""
        self.used.add(key)
        self.c.reading = (key,)

    def get(self, key: str, default: Any = None) -> Any:
        """The file's value (marked as read), or `default` when absent or null."""
        self._reading(key)
        value = self.data.get(key)
        return default if value is None else value

    def given(self, key: str) -> bool:
        self._reading(key)
        return self.data.get(key) is not None

    def put(self, target: str, value: Any, *path: str) -> None:
        self.c.set(target, value, *path)

    def put_key(self, key: str, target: str, convert=lambda v: v) -> None:
        """The file's `key`, when set, as `target` (converted). A number Python would convert
        wrongly without a word (`true` as 1, 16.5 as 16) is refused by the file's key."""
        if not self.given(key):
            return
        value = self.data[key]
        if convert in (int, float) and isinstance(value, bool):
            return self.refuse((key,), f"{value!r} is not a number", f"give {key} a number")
        if convert is int and isinstance(value, float) and not value.is_integer():
            return self.refuse((key,), f"{value!r} is not a whole number", f"give {key} a whole number")
        self.put(target, convert(value), key)

    def default(self, target: str, value: Any, why: str) -> None:
        """A value the tool takes when its file is silent, and overdrive's default differs: carried explicitly."""
        origin = self.c.origin_for(())
        self.c.out.settings.append(Setting(target, value, Origin(origin.layer, f"{origin.source} ({self.tool}: {why})"),
                                           self.c.native))

    def unmapped(self, path: tuple[str, ...], why: str = "") -> None:
        self.c.warn(path, f"{self.tool} key with no counterpart in overdrive: not used" + (f" ({why})" if why else ""))

    def refuse(self, path: tuple[str, ...], why: str, fix: str, settled_by: tuple[str, ...] = ()) -> None:
        """`settled_by`: overdrive keys that, set by a later layer (the import's KEY=VALUE items, a
        config file given after), answer the refusal."""
        self.c.error(path, why, fix, settled_by)

    def rest(self) -> None:
        """Every key not read: listed by key when it says something (null, false and empty say nothing)."""
        for key, value in self.data.items():
            if key not in self.used and value not in (None, False, "", [], {}):
                self.unmapped((str(key),))


def truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "yes", "1", "on", "auto") if isinstance(value, str) else bool(value)


# Transformers' TrainingArguments `optim` names (Axolotl's `optimizer`, LLaMA-Factory's `optim`) ->
# (optim.name, optim.implementation or None, a note when something of theirs is not kept).
HF_OPTIMIZERS = {
    "adamw_torch": ("adamw", None, ""), "adamw_hf": ("adamw", None, ""), "adamw_torch_fused": ("adamw", "fused", ""),
    "adamw_apex_fused": ("adamw", "fused", ""), "adamw_torch_xla": ("adamw", None, ""),
    "adamw_bnb_8bit": ("adamw_8bit", None, ""), "adamw_8bit": ("adamw_8bit", None, ""),
    "paged_adamw_8bit": ("adamw_8bit", None, "paged optimizer memory is not used"),
    "paged_adamw_32bit": ("adamw", None, "paged optimizer memory is not used"),
    "paged_adamw": ("adamw", None, "paged optimizer memory is not used"),
    "adamw_torch_4bit": ("adamw", None, "torchao's 4-bit state kept in full precision (more memory, no quantization)"),
    "adamw_torch_8bit": ("adamw", None, "torchao's 8-bit state kept in full precision (more memory, no quantization)"),
    "sgd": ("sgd", None, ""), "adafactor": ("adafactor", None, "torch's Adafactor, not Transformers' (relative step "
                                           "and warmup init are not kept)"),
    "lion_8bit": ("lion", None, "32-bit Lion"), "lion_32bit": ("lion", None, ""),
    "paged_lion_8bit": ("lion", None, "32-bit Lion, no paged memory"), "paged_lion_32bit": ("lion", None, ""),
    "muon": ("muon", None, ""), "schedule_free_adamw": ("schedule_free_adamw", None, ""),
    "schedule_free_radam": None, "adamw_anyprecision": None, "galore_adamw": None, "lomo": None, "adalomo": None,
    "grokadamw": None, "ao_adamw_8bit": ("adamw", None, "torchao's 8-bit state kept in full precision"),
    "rmsprop": None, "adagrad": None, "apollo_adamw": None, "came_pytorch": None, "optimi_adamw": ("adamw", None, ""),
}
# Transformers' lr_scheduler_type names -> scheduler.name (None: refused, overdrive has no such schedule).
HF_SCHEDULES = {
    "linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant",
    "cosine_with_restarts": "cosine_with_restarts", "polynomial": "polynomial", "inverse_sqrt": "inverse_sqrt",
    "warmup_stable_decay": "wsd", "cosine_with_min_lr": "cosine", "cosine_warmup_with_min_lr": "cosine",
    "reduce_lr_on_plateau": None, "one_cycle": None, "rex": None,
}
# report_to names -> logging.trackers (Accelerate's tracker names)
TRACKERS = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow", "comet_ml": "comet_ml",
            "aim": "aim", "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab", "trackio": "trackio"}
# attention names (Transformers' attn_implementation and the tools' own words) -> model.attn_implementation
ATTENTION = {"fa2": "flash_attention_2", "flash_attention_2": "flash_attention_2", "flash_attention_3":
             "flash_attention_3", "sdpa": "sdpa", "eager": "eager", "disabled": "eager", "flex_attention":
             "flex_attention", "flex": "flex_attention", "fa3": "flash_attention_3"}


def optimizer(reader: ToolReader, key: str, name: Any) -> None:
    """An HF optimizer name at `key`: mapped, or refused by key (another optimizer changes the math)."""
    entry = HF_OPTIMIZERS.get(str(name).lower(), None)
    if entry is None:
        reader.refuse((key,), f"optimizer {name!r} has no counterpart in overdrive (training with another one "
                      "changes the math)", "set optim.name (adamw, adamw_8bit, sgd, adafactor, lion, muon, "
                      "schedule_free_adamw) or optim.class_path to a torch optimizer class")
        return
    target, implementation, note = entry
    reader.put("optim.name", target, key)
    if implementation:
        reader.put("optim.implementation", implementation, key)
    if note:
        reader.c.warn((key,), f"{name} read as overdrive's `{target}`: {note}")


def schedule(reader: ToolReader, key: str, name: Any) -> Optional[str]:
    """An HF schedule name at `key`: mapped (and returned), or refused by key."""
    target = HF_SCHEDULES.get(str(name).lower(), "?")
    if target in (None, "?"):
        reader.refuse((key,), f"learning-rate schedule {name!r} has no counterpart in overdrive",
                      "set scheduler.name: constant, linear, cosine, wsd, polynomial, inverse_sqrt or "
                      "cosine_with_restarts")
        return None
    reader.put("scheduler.name", target, key)
    return target


def trackers(reader: ToolReader, key: str, value: Any) -> None:
    names = value if isinstance(value, list) else [n.strip() for n in str(value).split(",")]
    if [n for n in names if str(n).lower() in ("none", "")] or not names:
        reader.put("logging.trackers", [], key)
        return
    if [n for n in names if str(n).lower() == "all"]:
        reader.put("logging.trackers", ["auto"], key)
        return
    kept = [TRACKERS[str(n).lower()] for n in names if str(n).lower() in TRACKERS]
    for name in [n for n in names if str(n).lower() not in TRACKERS]:
        reader.c.warn((key,), f"tracker {name!r} is not one Accelerate knows: left out")
    reader.put("logging.trackers", kept, key)


def attention(reader: ToolReader, key: str, value: Any) -> None:
    name = ATTENTION.get(str(value).lower())
    if name is None:
        if str(value).lower() != "auto":
            reader.c.warn((key,), f"attention {value!r} left to Transformers' choice")
        return
    reader.put("model.attn_implementation", name, key)


def precision(reader: ToolReader) -> None:
    """bf16 / fp16 (true, false or `auto`) -> precision.mixed_precision."""
    if reader.given("bf16") and truthy(reader.data["bf16"]):
        reader.put("precision.mixed_precision", "bf16", "bf16")
    elif reader.given("fp16") and truthy(reader.data["fp16"]):
        reader.put("precision.mixed_precision", "fp16", "fp16")
    for key in ("tf32", "pure_bf16"):
        if reader.given(key) and truthy(reader.data[key]):
            reader.unmapped((key,), "matmul precision is the device's default")


def hf_training_defaults(reader: ToolReader) -> None:
    """Transformers' TrainingArguments defaults where overdrive's differ and the file is silent."""
    data, tool = reader.data, "Transformers' TrainingArguments default"
    for key, target, value in (("weight_decay", "optim.weight_decay", 0.0), ("warmup_steps", "scheduler.warmup_steps", 0),
                               ("max_grad_norm", "training.gradient_clipping", 1.0), ("seed", "training.seed", 42),
                               ("adam_epsilon", "optim.eps", 1e-8)):
        if data.get(key) is None:
            reader.default(target, value, f"{tool} {key}={value}")
    if data.get("adam_beta1") is None and data.get("adam_beta2") is None:
        reader.default("optim.betas", [0.9, 0.999], f"{tool} adam_beta1=0.9, adam_beta2=0.999")
    reader.default("scheduler.min_lr_ratio", 0.0, "Transformers' schedules decay to 0")
    reader.default("training.micro_batch_size", 8, f"{tool} per_device_train_batch_size=8")
    reader.default("training.gradient_accumulation_steps", 1, f"{tool} gradient_accumulation_steps=1")


def betas(reader: ToolReader) -> None:
    b1, b2 = reader.get("adam_beta1"), reader.get("adam_beta2")
    if b1 is not None or b2 is not None:
        reader.put("optim.betas", [float(0.9 if b1 is None else b1), float(0.999 if b2 is None else b2)],
                   "adam_beta1" if b1 is not None else "adam_beta2")


def steps_or_epochs(reader: ToolReader, max_steps: Any, epochs_key: str, default_epochs: float, default_why: str,
                    trainer: str) -> None:
    """Transformers' Trainer rule, as both tools keep it: a positive max_steps decides, else the
    epochs (the tool's default when unset)."""
    if max_steps is not None and int(max_steps) > 0:
        reader.put("training.max_steps", int(max_steps), "max_steps")
        if reader.given(epochs_key):
            reader.c.warn((epochs_key,), f"max_steps is set too: as in {trainer}, max_steps decides")
    elif reader.given(epochs_key):
        reader.put("training.num_epochs", float(reader.data[epochs_key]), epochs_key)
    else:
        reader.default("training.num_epochs", default_epochs, default_why)


def trainer_optimizer(reader: ToolReader, optimizer_key: str, schedule_key: str) -> None:
    """The optimizer keys both tools take from Transformers' TrainingArguments, under their names."""
    reader.put_key("learning_rate", "optim.lr", float)
    reader.put_key("weight_decay", "optim.weight_decay", float)
    reader.put_key("adam_epsilon", "optim.eps", float)
    betas(reader)
    reader.put_key("max_grad_norm", "training.gradient_clipping", lambda v: float(v) if float(v) > 0 else None)
    if reader.given(optimizer_key):
        optimizer(reader, optimizer_key, reader.data[optimizer_key])
    if reader.given(schedule_key):
        schedule(reader, schedule_key, reader.data[schedule_key])
