"""Rules of distillation (`distill.*`): what it runs with, and what it does not, refused by key.

Distillation is an objective (training/objectives/distill.py) on the token data every text and chat format
gives; the layouts it does not compose with are rows of resolving/composition.py's table, the loss
kernels are refused in validate_loss.py (the divergence needs the student's whole logits). The
teacher's tokenizer against the student's is read from files, before launch (hf/teacher.py, through
training/build/user_inputs.py).
"""

from __future__ import annotations

from typing import Callable

from overdrive.config.schema import RunConfig
from overdrive.config.schema_distill import FIXED_BETA
from overdrive.errors import Problem

_KNOBS = ("distill.loss", "distill.beta", "distill.temperature", "distill.alpha", "distill.lmbda", "distill.top_k",
         "distill.max_new_tokens")


def distill_rules(cfg: RunConfig, where: Callable[[str], str],
                  set_explicitly: Callable[[str], bool]) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings): the teacher, the loss's knobs, the data and the other objectives agree."""
    d, errors, warnings = cfg.distill, [], []
    if d.teacher is None:
        stray = [k for k in _KNOBS if set_explicitly(k)]
        if stray:
            warnings.append(Problem(stray[0], "applies to distillation only (distill.teacher is empty)",
                                    where(stray[0]), "set distill.teacher, or remove the key"))
        return errors, warnings
    if d.loss in FIXED_BETA and d.beta is not None and d.beta != FIXED_BETA[d.loss]:
        errors.append(Problem("distill.beta", f"is {d.beta:g}, but distill.loss={d.loss} is beta "
                              f"{FIXED_BETA[d.loss]:g} (TRL's meaning: 0 forward KL, 1 reverse KL)", where("distill.beta"),
                              f"remove distill.beta, or set distill.loss=jsd to interpolate at {d.beta:g}"))
    if set_explicitly("distill.max_new_tokens") and not d.lmbda:
        warnings.append(Problem("distill.max_new_tokens", "applies to on-policy steps only (distill.lmbda is 0)",
                                where("distill.max_new_tokens"), "set distill.lmbda, or remove the key"))
    for key, other in (("preference.method", cfg.preference.method), ("rl.method", cfg.rl.method)):
        if other != "none":
            errors.append(Problem(key, f"{key}={other} and distillation are two objectives; a run has one",
                                  where(key), f"set {key}=none, or remove distill.teacher"))
    if cfg.model.task != "causal-lm":
        errors.append(Problem("model.task", "distillation teaches a causal LM (the teacher's next-token "
                              "distributions)", where("model.task"), "set model.task=causal-lm"))
    if d.lmbda and cfg.data.document_mask:
        errors.append(Problem("distill.lmbda", "on-policy steps sample one completion per row, and data.document_mask "
                              "packs several documents into a row", where("distill.lmbda"),
                              "set data.document_mask=false, or distill.lmbda=0"))
    if cfg.data.format in ("preference", "prompts"):
        errors.append(Problem("data.format", f"distillation reads text or chat data, and data.format is "
                              f"{cfg.data.format}", where("data.format"), "set data.format=chat (or a text format)"))
    if cfg.training.micro_batch_size == "auto":
        errors.append(Problem("training.micro_batch_size", "auto measures the student alone on the device, not the "
                              "teacher beside it", where("training.micro_batch_size"),
                              "set training.micro_batch_size to an integer (`overdrive plan` counts the teacher)"))
    return errors, warnings
