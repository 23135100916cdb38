"""The adapter step of building a model: PEFT's LoRA (and QLoRA's quantized base) from `peft.*`.

    quantization(cfg)        Transformers' BitsAndBytesConfig for qlora (None otherwise)
    lora_config(cfg)         PEFT's LoraConfig, every value from the config
    apply(cfg, model)        the frozen base wrapped by PEFT: only the adapter requires grad
    check(cfg)               `peft.target_modules` against the model's modules (meta device)
    trainable_counts(model)  (trainable, total) parameters, as the run prints them

Nothing of LoRA is written here: PEFT builds and saves the adapter, bitsandbytes quantizes.
How a strategy wraps the result is strategies/' concern (FSDP2 shards each block with the
adapter inside it, frozen and trainable tensors in one unit; ZeRO-3 partitions both).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from overdrive.errors import Problem, UserError
from overdrive.hf import lora
from overdrive.strategies import adapter as strategy_adapter

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def enabled(cfg: RunConfig) -> bool:
    return cfg.peft.method != "none"


def quantization(cfg: RunConfig):
    """BitsAndBytesConfig for `peft.method: qlora`, else None."""
    if cfg.peft.method != "qlora":
        return None
    import torch
    from transformers import BitsAndBytesConfig

    p = cfg.peft
    from overdrive.hf.vision import PROJECTORS, VISION_TOWERS, declared

    # A vision-language model's tower and projector stay unquantized (as LLaMA-Factory and TRL keep them):
    # small, and read by every image token. Transformers 5 matches each name from the start of a module's path
    # (or as its end), and the tower sits under the model (`model.visual.blocks.0.attn.qkv`): each name also as a
    # pattern for any depth.
    parts = [*VISION_TOWERS, *PROJECTORS]
    skip = {"llm_int8_skip_modules": [*parts, *(rf"(?:.*\.)?{name}" for name in parts), "lm_head"]} \
        if declared(cfg) else {}
    if p.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.mixed_precision, torch.float32)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=p.quant_type,
                              bnb_4bit_use_double_quant=p.double_quant, bnb_4bit_compute_dtype=compute,
                              bnb_4bit_quant_storage=getattr(torch, strategy_adapter.quant_storage_dtype(cfg)), **skip)


def lora_config(cfg: RunConfig, task: Optional[str] = None):
    """PEFT's LoraConfig for this run (also what `overdrive export --peft` writes)."""
    return lora.lora_config(cfg.peft, task or cfg.model.task)


def _module_names(model) -> tuple[list[str], list[str]]:
    """(every module path, the distinct last names of the linear layers)."""
    import torch

    paths, linear = [], []
    for name, module in model.named_modules():
        paths.append(name)
        kind = type(module).__name__
        if isinstance(module, torch.nn.Linear) or kind in ("Conv1D", "Linear4bit", "Linear8bitLt"):
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in linear:
                linear.append(leaf)
    return paths, linear


def target_problems(cfg: RunConfig, model) -> list[Problem]:
    """Names in `peft.target_modules` and `peft.modules_to_save` that match no module."""
    from overdrive.training.objectives.moe import mapped_expert_names

    p, found = cfg.peft, []
    paths, linear = _module_names(model)
    experts = mapped_expert_names(model)  # a mixture's stacked experts, by the names PEFT maps onto them
    for key, names in (("peft.target_modules", [] if isinstance(p.target_modules, str) else p.target_modules),
                       ("peft.modules_to_save", p.modules_to_save)):
        for name in names:
            if any(path == name or path.endswith("." + name) for path in paths) or (
                    key == "peft.target_modules" and name in experts):
                continue
            leaves = sorted({path.rsplit(".", 1)[-1] for path in paths if path})
            close = difflib.get_close_matches(name, leaves, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            found.append(Problem(key, f"{name!r} matches no module of {type(model).__name__}",
                                 fix=f"{hint}its linear layers: {', '.join(linear)} (or `all-linear`)"))
    return found


def check(cfg: RunConfig) -> None:
    """Refuse, by key, an adapter that fits no module of the model (built on the meta device:
    no weights are read). Called before any process starts."""
    if not enabled(cfg):
        return
    from overdrive.memory.model_shape import build_meta_model, hf_config_for_run

    model = build_meta_model(hf_config_for_run(cfg), cfg.model.task, cfg.model.attn_implementation)
    problems = target_problems(cfg, model)
    if problems:
        raise UserError(problems)


def apply(cfg: RunConfig, model, gradient_checkpointing: bool = False):
    """The base frozen, an adapter added by PEFT; a quantized base prepared for training."""
    problems = target_problems(cfg, model)
    if problems:
        raise UserError(problems)
    from peft import get_peft_model, prepare_model_for_kbit_training

    if cfg.peft.method == "qlora":
        from overdrive.strategies.cpu import keep_narrow_4bit_layers_generic

        keep_narrow_4bit_layers_generic(model)  # a CPU workaround; a no-op on other devices
        # Norms and other unquantized weights in fp32 for stability, inputs made to carry grads.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.peft.adapter_path:  # an adapter that exists, trained on (its config checked by resolving/validate_adapter.py)
        from peft import PeftModel

        from overdrive.hf.adapter_fit import fit_problems, model_type_problems

        adapter = Path(cfg.peft.adapter_path).expanduser()
        base = f"{cfg.model.name_or_path} (model.name_or_path)"
        misfit = model_type_problems(model, adapter, lora.adapter_config(str(adapter)), "peft.adapter_path", base) or \
            fit_problems(model, adapter, "peft.adapter_path", base)
        if misfit:
            raise UserError(misfit)
        return PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    return get_peft_model(model, _for_model(cfg, model))


def _for_model(cfg: RunConfig, model):
    """The LoraConfig; on a vision-language model, the parts left frozen (the vision tower and projector
    unless `model.vision.*` trains them) excluded from the targets by name (hf/vision.py)."""
    from overdrive.hf.vision import frozen_parts_pattern, is_vision_config

    config = lora_config(cfg)
    if is_vision_config(model.config):
        config.exclude_modules = frozen_parts_pattern(cfg.model.vision)
    return config


def trainable_counts(model) -> tuple[int, int]:
    """(trainable, total) parameter elements; a 4-bit weight counts as the elements it holds."""
    trainable = total = 0
    for param in model.parameters():
        n = getattr(param, "ds_numel", None) or param.numel()
        if type(param).__name__ == "Params4bit":
            n *= 2 * param.element_size()  # packed: two 4-bit values per byte of storage
        total += n
        trainable += n if param.requires_grad else 0
    return trainable, total


def describe(model) -> str:
    trainable, total = trainable_counts(model)
    return f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / max(total, 1):.3f}%)"


def load_device(cfg: RunConfig, device) -> Optional[str]:
    """Where the base is loaded: a quantized base straight onto this process's device
    (bitsandbytes quantizes as it places the weights); otherwise the caller's default."""
    return str(device) if cfg.peft.method == "qlora" else None


def notes(cfg: RunConfig, model) -> list[str]:
    """What the run says when it starts: trainable parameters of an adapter run, and whether
    packed chat conversations are kept apart by this model."""
    from overdrive.training.objectives.moe import adapter_note

    said = [describe(model), *adapter_note(model)] if enabled(cfg) else []
    if cfg.data.format == "chat" and cfg.data.packing:
        from overdrive.data.chat_samples import packing_note

        note = packing_note(getattr(model, "get_base_model", lambda: model)())
        said += [note] if note else ["data.packing: conversations packed into rows of data.max_length tokens, each "
                                     "attending only to itself (position ids restart per conversation)"]
    return said


def save_final(cfg: RunConfig, accelerator, model, tokenizer, state_dict, out) -> None:
    """`<out>/model`: PEFT's adapter directory and the tokenizer (PeftModel.from_pretrained
    loads it onto the base); with `peft.save_merged`, `<out>/merged` too. `state_dict` was
    gathered by every rank (ZeRO-3 and FSDP hold shards); the main process writes."""
    if not accelerator.is_main_process:
        return
    from transformers.utils import logging as hf_logging

    target = out / "model"
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        accelerator.unwrap_model(model).save_pretrained(target, state_dict=state_dict)
        tokenizer.save_pretrained(target)
        if cfg.peft.save_merged:
            merge(cfg, target, out / "merged", tokenizer)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()


def merge(cfg: RunConfig, adapter_dir, target, tokenizer) -> None:
    """The base, loaded afresh in full precision (never quantized, never written to), with the
    adapter merged into its weights (`merge_and_unload`), saved as a plain model."""
    from peft import PeftModel

    from overdrive.hf.model_config import auto_class
    from overdrive.training.build.dtypes import DTYPES

    dtype = "auto" if cfg.model.dtype == "auto" else DTYPES[cfg.model.dtype]
    from overdrive.hf.vision import declared

    base = auto_class(cfg.model.task, vision=declared(cfg)).from_pretrained(cfg.model.name_or_path, revision=cfg.model.revision,
                                                      trust_remote_code=cfg.model.trust_remote_code, dtype=dtype)
    if len(tokenizer) > base.get_input_embeddings().num_embeddings:
        base.resize_token_embeddings(len(tokenizer))
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(target)
    tokenizer.save_pretrained(target)
