"""The Transformers config a run builds, without weights: for the model that trains
(training/build/model.py) and for the memory estimator (memory/), which sizes that same model.

torch and transformers are imported inside the functions: `overdrive plan` and `estimate` reach here.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Optional, Sequence

from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError


def auto_class(task: str, vision: bool = False):
    """The Auto class a run's model is built with; a vision-language model (hf/vision.py) by
    AutoModelForImageTextToText, whose classes take images beside the text."""
    import transformers

    if vision and task == "causal-lm":
        return transformers.AutoModelForImageTextToText
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
        from overdrive import hub

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
        problem = unknown_model_type("model.architecture.model_type", model_type)
        if problem is not None:
            raise UserError(problem)
        try:
            config = AutoConfig.for_model(model_type, **arch, **extra)
        except ValueError as error:
            raise UserError(Problem("model.architecture.model_type", str(error))) from error
    # The key/value cache only serves generation; in training it is memory and time spent.
    config.use_cache = False
    text = config.get_text_config()
    if text is not config:  # a vision-language model's language model reads its own (packed rows need none)
        text.use_cache = False
    from overdrive.config.experts import apply_overrides

    apply_overrides(m.moe, config)  # model.moe.top_k / aux_loss_coef: what trains and what is estimated
    return config


def model_class(config, task: str):
    """The Transformers class a run builds for `config` (no instance, no weights); None when the
    auto mapping does not know it (a model of remote code)."""
    try:
        return auto_class(task)._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None


COMMON_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "gemma2", "phi3", "gpt_neox", "opt", "bert", "t5")


def unknown_model_type(key: str, model_type: str, where: str = "") -> Optional[Problem]:
    """A model_type Transformers does not know: the close names and a few common ones, not
    the several hundred Transformers lists."""
    import difflib

    from transformers import CONFIG_MAPPING

    known = list(CONFIG_MAPPING.keys())
    if model_type in known:
        return None
    close = difflib.get_close_matches(str(model_type), known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return Problem(key, f"unknown model_type {model_type!r}", where,
                   f"{hint}common ones: {', '.join(COMMON_MODEL_TYPES)} ({len(known)} in this Transformers)")


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Transformers' log level at error while a config is read, then back to what it was: config
    validation warns about the token ids of a small inline vocabulary, noise before a run or an estimate."""
    from transformers.utils import logging

    before = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(before)
