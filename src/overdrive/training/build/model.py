"""Models through the Transformers Auto classes.

`model_config(cfg, vocab_size)` (hf/model_config.py) builds the Transformers config without any
weights (the memory estimator sizes the same); `build_model(cfg, ...)` builds the model: from a hub name or a
local `save_pretrained` directory, or with fresh weights from `model.architecture`.
Remote code runs only when `model.trust_remote_code` says so.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from overdrive import hub
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError
from overdrive.hf.model_config import auto_class, model_config  # noqa: F401 (the model's config, shared with memory/)
from overdrive.hf.vision import freeze as freeze_vision, is_vision_config
from overdrive.training.build import adapter
from overdrive.training.build.dtypes import DTYPES, autocast_dtype  # noqa: F401 (the one dtype map, asked here too)

# Names under which models keep learned position embeddings; they are table look-ups, not
# matrix multiplies, so they do not count towards training FLOPs (as in nanoGPT).
_POSITION_EMBEDDINGS = ("wpe", "position_embeddings", "embed_positions")


def build_model(cfg: RunConfig, vocab_size: Optional[int] = None, *, label_names: Sequence[str] = (),
                special_tokens: Optional[Mapping[str, Optional[int]]] = None, device: Optional[str] = None):
    """The model to train. `device="meta"` builds the structure without allocating weights.

    With `peft.method` set the base is frozen and PEFT's adapter added (training/build/adapter.py);
    a qlora base is quantized onto `device` as it loads."""
    m = cfg.model
    config = model_config(cfg, vocab_size, label_names=label_names, special_tokens=special_tokens)
    if not m.name_or_path or m.from_scratch or device == "meta":
        model = fresh_model(cfg, config, device)
    else:
        common = _loading(cfg)
        quantization = adapter.quantization(cfg)
        if quantization is not None:  # bitsandbytes quantizes as the weights are loaded onto the device
            common.update(quantization_config=quantization, device_map={"": str(device or "cpu")})
        with hub.reading("model.name_or_path", m.name_or_path, revision=m.revision):
            cls = auto_class(m.task, vision=is_vision_config(config))
            model = _with_loss_type(cfg, cls.from_pretrained(m.name_or_path, config=config, revision=m.revision,
                                                             **common))
    if vocab_size is not None and vocab_size > model.get_input_embeddings().num_embeddings:
        # A tokenizer with added tokens: grow the table rather than index past its end.
        model.resize_token_embeddings(vocab_size)
    model = with_gradient_checkpointing(cfg, model)
    if is_vision_config(model.config) and not adapter.enabled(cfg):  # an adapter run: PEFT freezes the base
        freeze_vision(model, m.vision)
    if adapter.enabled(cfg) and device != "meta":
        model = adapter.apply(cfg, model, gradient_checkpointing=m.gradient_checkpointing)
    return model


def _loading(cfg: RunConfig) -> dict:
    """How the run's model is built: remote code, dtype, attention implementation."""
    m = cfg.model
    common = {"trust_remote_code": m.trust_remote_code, "dtype": "auto" if m.dtype == "auto" else DTYPES[m.dtype]}
    if m.attn_implementation:
        common["attn_implementation"] = m.attn_implementation
    return common


def fresh_model(cfg: RunConfig, config, device: Optional[str | torch.device] = None):
    """The run's model with fresh weights from `config`, on `device`: what `build_model`
    builds from an architecture, and what the auto micro-batch probes."""
    common = _loading(cfg)
    if common["dtype"] == "auto":
        common.pop("dtype")
    with torch.device(device or "cpu"):
        cls = auto_class(cfg.model.task, vision=is_vision_config(config))
        return _with_loss_type(cfg, cls.from_config(config, **common))


def _with_loss_type(cfg: RunConfig, model):
    if cfg.model.task == "causal-lm" and getattr(model, "loss_type", None) is None:
        # Class names like GPT2LMHeadModel do not tell Transformers which loss they use; say
        # it (the same shifted cross-entropy it falls back to) rather than be warned.
        model.loss_type = "ForCausalLM"
    return model


def with_gradient_checkpointing(cfg: RunConfig, model):
    """`model.gradient_checkpointing` turned on, the one switch (the trained model and the probe)."""
    if not cfg.model.gradient_checkpointing:
        return model
    if not model.supports_gradient_checkpointing:
        raise UserError(Problem("model.gradient_checkpointing", f"{type(model).__name__} does not support it",
                                fix="set model.gradient_checkpointing=false"))
    # Non-reentrant checkpointing works with DDP/FSDP and with inputs that need no grad.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the name since Transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
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
    """(layers, hidden width) of a Transformers config, for the attention FLOPs term (a vision-language
    model's: its language model's)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
    return int(layers or 0), int(width or 0)
