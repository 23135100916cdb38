"""The distillation teacher (`distill.teacher`) as Transformers' own objects:

    fit_problems(cfg)       the teacher against the student, from their configs and tokenizers only
                            (no weights): the same token ids and the same logits width, or refused by
                            key before anything launches (`explain` and `train` ask it)
    teacher_config(cfg)     the teacher's Transformers config (the estimator sizes it)

Logit distillation compares the two models' distributions position by position and id by id,
so both must read the text as the same ids and score the same vocabulary; a teacher with another
tokenizer (cross-tokenizer distillation, TRL's GOLD) is not run here and is said so.

torch and transformers are imported inside the functions: `explain` and `plan` reach here.
"""

from __future__ import annotations

from typing import Any, Optional

from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError

KEY = "distill.teacher"


def enabled(cfg: RunConfig) -> bool:
    return cfg.distill.teacher is not None


def teacher_config(cfg: RunConfig) -> Any:
    from transformers import AutoConfig

    from overdrive import hub

    name = cfg.distill.teacher
    with hub.reading(KEY, name):
        return AutoConfig.from_pretrained(name, trust_remote_code=cfg.model.trust_remote_code)


def _tokenizer(name: str, key: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    from overdrive import hub

    with hub.reading(key, name, what="tokenizer"):
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)


def _student_width(cfg: RunConfig, student_tokenizer: Any) -> Optional[int]:
    """The width of the student's logits: its config's vocabulary, or the tokenizer's (from scratch)."""
    if not cfg.model.name_or_path:  # an inline architecture takes the tokenizer's size
        return len(student_tokenizer)
    from transformers import AutoConfig

    from overdrive import hub

    with hub.reading("model.name_or_path", cfg.model.name_or_path, revision=cfg.model.revision):
        config = AutoConfig.from_pretrained(cfg.model.name_or_path, revision=cfg.model.revision,
                                            trust_remote_code=cfg.model.trust_remote_code)
    return getattr(config, "vocab_size", None)


def fit_problems(cfg: RunConfig) -> list[Problem]:
    """The teacher and the student read text as the same ids and score the same vocabulary."""
    if not enabled(cfg):
        return []
    from overdrive import hub

    name = cfg.distill.teacher
    try:
        config = teacher_config(cfg)
        teacher_tokenizer = _tokenizer(name, KEY, cfg.model.trust_remote_code)
    except UserError as error:
        return error.problems
    except (OSError, ValueError) as error:  # a directory without config.json or tokenizer files
        return [Problem(KEY, f"cannot read {name} as a causal LM with its tokenizer: {error}",
                        fix="point distill.teacher at a save_pretrained directory (config.json and the tokenizer's "
                        "files) or a hub name")]
    from overdrive.hf.vision import is_vision_config

    if is_vision_config(config):  # AutoModelForCausalLM builds no class for it: refused here, not once loaded
        return [Problem(KEY, f"{name} is a vision-language model ({getattr(config, 'model_type', '?')}): the teacher "
                        "is loaded as a causal LM, which Transformers does not build from its config",
                        fix="choose a text teacher with the student's tokenizer")]
    weightless = hub.weightless_local(KEY, name, "point distill.teacher at a save_pretrained directory that holds "
                                      "the teacher's weights, or a hub name")
    if weightless is not None:
        return [weightless]
    student_name = cfg.tokenizer.name_or_path or cfg.model.name_or_path
    if not student_name:
        return [Problem(KEY, "the student's tokenizer would be trained from the data here, so its ids cannot be "
                        "the teacher's", fix=f"set tokenizer.name_or_path={name} (the student learns with the "
                        "teacher's tokenizer)")]
    key = "tokenizer.name_or_path" if cfg.tokenizer.name_or_path else "model.name_or_path"
    try:
        student_tokenizer = _tokenizer(student_name, key, cfg.model.trust_remote_code)
        student_width = _student_width(cfg, student_tokenizer)
    except UserError as error:
        return error.problems
    except (OSError, ValueError):
        return []  # the student's own reading is refused by its own keys, with their messages
    if student_tokenizer.get_vocab() != teacher_tokenizer.get_vocab():
        theirs, ours = len(teacher_tokenizer), len(student_tokenizer)
        return [Problem(KEY, f"{name} has a different tokenizer from the student's ({student_name}: {ours} tokens, "
                        f"the teacher's {theirs}, not the same ids); logit distillation compares the two "
                        "distributions id by id (cross-tokenizer distillation is not run here)",
                        fix="choose a teacher of the student's family (the same tokenizer), or set "
                        f"tokenizer.name_or_path={name} and train the student from its tokenizer")]
    width = getattr(config, "vocab_size", None)
    if width is not None and cfg.distill.top_k > width:
        return [Problem("distill.top_k", f"is {cfg.distill.top_k}, more than the {width} tokens the teacher scores",
                        fix=f"set distill.top_k to at most {width} (0: the whole vocabulary)")]
    if student_width is not None and width is not None and width != student_width:
        return [Problem(KEY, f"the teacher scores {width} tokens per position and the student {student_width} "
                        "(the same tokenizer, embeddings padded differently): their distributions cannot be compared",
                        fix="choose a teacher whose config.json has the student's vocab_size")]
    return []

