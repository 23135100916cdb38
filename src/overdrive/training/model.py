"""Models through the Transformers Auto classes.

`model_config(cfg, vocab_size)` builds the Transformers config without any weights (the
memory estimator uses it); `build_model(cfg, ...)` builds the model: from a hub name or a
local `save_pretrained` directory, or with fresh weights from `model.architecture`.
Remote code runs only when `model.trust_remote_code` says so.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from overdrive import hub
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError
from overdrive.training import adapter

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
# Names under which models keep learned position embeddings; they are table look-ups, not
# matrix multiplies, so they do not count towards training FLOPs (as in nanoGPT).
_POSITION_EMBEDDINGS = ("wpe", "position_embeddings", "embed_positions")


def auto_class(task: str):
    import transformers

    return {
        "causal-lm": transformers.AutoModelForCausalLM,
        "sequence-classification": transformers.AutoModelForSequenceClassification,
    }[task]


def _task_fields(task: str, label_names: Sequence[str], num_labels: Optional[int]) -> dict:
    if task != "sequence-classification":
        return {}
    n = num_labels or len(label_names) or 2
    names = list(label_names) or [str(i) for i in range(n)]
    return {"num_labels": n, "id2label": dict(enumerate(names)), "label2id": {v: k for k, v in enumerate(names)}}


def model_config(cfg: RunConfig, vocab_size: Optional[int] = None, *, label_names: Sequence[str] = (),
                 special_tokens: Optional[Mapping[str, Optional[int]]] = None):
    """The Transformers config for this run, without weights.

    `vocab_size` comes from the tokenizer; `special_tokens` maps `pad_token_id`,
    `bos_token_id`, `eos_token_id` to the tokenizer's ids (GPT-2 finds the last real token
    of a classification input through `pad_token_id`).
    """
    from transformers import AutoConfig

    m = cfg.model
    extra = {**_task_fields(m.task, label_names, m.num_labels),
             **{k: v for k, v in (special_tokens or {}).items() if v is not None}}
    if m.name_or_path:
        with hub.reading("model.name_or_path", m.name_or_path, revision=m.revision):
            config = AutoConfig.from_pretrained(m.name_or_path, revision=m.revision,
                                                trust_remote_code=m.trust_remote_code, **extra)
    else:
        arch = dict(m.architecture)
        model_type = arch.pop("model_type", None)
        if not model_type:
            raise UserError(Problem("model.architecture", "needs a `model_type` (e.g. gpt2, llama)",
                                    fix="add model.architecture.model_type=gpt2, or set model.name_or_path"))
        if vocab_size is not None:
            arch["vocab_size"] = vocab_size
        try:
            config = AutoConfig.for_model(model_type, **arch, **extra)
        except ValueError as error:
            raise UserError(Problem("model.architecture.model_type", str(error))) from error
    # The key/value cache only serves generation; in training it is memory and time spent.
    config.use_cache = False
    return config


def build_model(cfg: RunConfig, vocab_size: Optional[int] = None, *, label_names: Sequence[str] = (),
                special_tokens: Optional[Mapping[str, Optional[int]]] = None, device: Optional[str] = None):
    """The model to train. `device="meta"` builds the structure without allocating weights.

    With `peft.method` set the base is frozen and PEFT's adapter added (training/adapter.py);
    a qlora base is quantized onto `device` as it loads."""
    m = cfg.model
    config = model_config(cfg, vocab_size, label_names=label_names, special_tokens=special_tokens)
    cls = auto_class(m.task)
    common = {"trust_remote_code": m.trust_remote_code, "dtype": _DTYPES[m.dtype]}
    if m.attn_implementation:
        common["attn_implementation"] = m.attn_implementation
    if not m.name_or_path or m.from_scratch or device == "meta":
        if common["dtype"] == "auto":
            common.pop("dtype")
        with torch.device(device or "cpu"):
            model = cls.from_config(config, **common)
    else:
        quantization = adapter.quantization(cfg)
        if quantization is not None:  # bitsandbytes quantizes as the weights are loaded onto the device
            common.update(quantization_config=quantization, device_map={"": str(device or "cpu")})
        with hub.reading("model.name_or_path", m.name_or_path, revision=m.revision):
            model = cls.from_pretrained(m.name_or_path, config=config, revision=m.revision, **common)
    if m.task == "causal-lm" and getattr(model, "loss_type", None) is None:
        # Class names like GPT2LMHeadModel do not tell Transformers which loss they use; say
        # it (the same shifted cross-entropy it falls back to) rather than be warned.
        model.loss_type = "ForCausalLM"
    if vocab_size is not None and vocab_size > model.get_input_embeddings().num_embeddings:
        # A tokenizer with added tokens: grow the table rather than index past its end.
        model.resize_token_embeddings(vocab_size)
    if m.gradient_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise UserError(Problem("model.gradient_checkpointing", f"{type(model).__name__} does not support it",
                                    fix="set model.gradient_checkpointing=false"))
        # Non-reentrant checkpointing works with DDP/FSDP and with inputs that need no grad.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # the name since Transformers 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if adapter.enabled(cfg) and device != "meta":
        model = adapter.apply(cfg, model, gradient_checkpointing=m.gradient_checkpointing)
    return model


def flop_params(model, frozen: bool = False) -> int:
    """Parameters that take part in matrix multiplies (N in 6N FLOPs per token); with
    `frozen`, only those that get no gradient (an adapter run's base).

    Tied input/output embeddings count once, as the output projection; learned position
    embeddings are excluded. A ZeRO-3 parameter built under `zero.Init` holds nothing
    (`numel()` 0): its whole size is `ds_numel`.
    """
    seen, total = set(), 0
    for name, param in model.named_parameters(remove_duplicate=True):
        if id(param) in seen or any(p in name for p in _POSITION_EMBEDDINGS) or (frozen and param.requires_grad):
            continue
        seen.add(id(param))
        n = getattr(param, "ds_numel", None) or param.numel()
        total += n * 2 * param.element_size() if type(param).__name__ == "Params4bit" else n  # packed 4-bit
    return total


def shape_of(config) -> tuple[int, int]:
    """(layers, hidden width) of a Transformers config, for the attention FLOPs term."""
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
    return int(layers or 0), int(width or 0)
