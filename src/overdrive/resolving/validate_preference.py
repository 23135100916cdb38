"""Rules of preference training (`preference.*` with `data.format: preference`)."""

from __future__ import annotations

from typing import Callable

from overdrive.config.schema import RunConfig
from overdrive.config.schema_preference import WITH_REFERENCE
from overdrive.errors import Problem

_KNOBS = {"preference.label_smoothing": ("dpo", "simpo"), "preference.simpo_gamma": ("simpo",),
          "preference.precompute_reference": WITH_REFERENCE,
          "preference.beta": ("dpo", "ipo", "orpo", "simpo", "kto"), "preference.center_rewards_coefficient": ("reward",),
          "preference.desirable_weight": ("kto",), "preference.undesirable_weight": ("kto",)}


def preference_rules(cfg: RunConfig, where: Callable[[str], str],
                     set_explicitly: Callable[[str], bool]) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings): the method and the data agree; each knob belongs to the method."""
    p, errors, warnings = cfg.preference, [], []
    pairs = cfg.data.format == "preference"
    if p.method == "none":
        if pairs:
            errors.append(Problem("preference.method", "data.format is preference, but no preference method is set",
                                  where("data.format"), "set preference.method (dpo, ipo, orpo, simpo, kto or reward)"))
        stray = [k for k in _KNOBS if set_explicitly(k)]
        if stray:
            warnings.append(Problem(stray[0], "applies to preference training only (preference.method is none)",
                                    where(stray[0]), "set preference.method, or remove the key"))
        return errors, warnings
    # With a second objective asked for (RL, distillation), its rules name the conflict; the data's format,
    # which the two objectives would each ask for, is left until one is chosen.
    if not pairs and cfg.rl.method == "none" and cfg.distill.teacher is None:
        errors.append(Problem("data.format", f"preference.method={p.method} trains on chosen/rejected pairs, but "
                              f"data.format is {cfg.data.format}", where("preference.method"),
                              "set data.format=preference, with prompt/chosen/rejected columns"))
    task = "sequence-classification" if p.method == "reward" else "causal-lm"
    if cfg.model.task != task:
        errors.append(Problem("model.task", f"preference.method={p.method} trains a "
                              f"{'scalar head' if p.method == 'reward' else 'causal LM'}", where("model.task"),
                              f"set model.task={task}"))
    if cfg.model.name_or_path and cfg.model.from_scratch:  # the model is named: the key to change is from_scratch
        errors.append(Problem("model.from_scratch", f"{p.method} aligns a pretrained model, but model.from_scratch "
                              f"builds {cfg.model.name_or_path}'s architecture with random weights",
                              where("model.from_scratch"), "set model.from_scratch=false to load its weights"))
    elif not cfg.model.name_or_path:
        errors.append(Problem("model.name_or_path", f"{p.method} aligns a pretrained model, but the model starts "
                              "from random weights", where("preference.method"),
                              "set model.name_or_path to a save_pretrained directory or hub name"))
    if cfg.data.packing:
        errors.append(Problem("data.packing", "preference pairs are not packed: each answer is scored on its own",
                              where("data.packing"), "set data.packing=false"))
    if cfg.data.sources:
        errors.append(Problem("data.sources", "preference training reads one source", where("data.sources"),
                              "set data.source to the pairs"))
    for key, methods in _KNOBS.items():
        if set_explicitly(key) and p.method not in methods:
            warnings.append(Problem(key, f"has no effect with preference.method={p.method} (used by "
                                    f"{', '.join(methods)})", where(key), "remove the key"))
    return (errors + kto_rules(cfg, where) + reference_rules(cfg, where),
            warnings + pretraining_defaults(cfg, where, set_explicitly))


def kto_rules(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    """KTO's KL estimate pairs each row's prompt with another row's completion of the same micro-batch
    (as TRL's KTOTrainer, which refuses a per-device batch of 1), so the mismatched pairs are drawn anew
    each step and cannot be scored once before training."""
    if cfg.preference.method != "kto":
        return []
    problems = []
    if cfg.training.micro_batch_size == 1:
        problems.append(Problem("training.micro_batch_size", "kto estimates its KL term from the other rows of a "
                                "micro-batch; with one row the estimate is the row's own reward",
                                where("training.micro_batch_size"), "set training.micro_batch_size to 2 or more "
                                "(lower training.gradient_accumulation_steps to keep the global batch)"))
    if cfg.preference.precompute_reference:
        problems.append(Problem("preference.precompute_reference", "kto's mismatched pairs are drawn with each "
                                "micro-batch, so their reference log-probs cannot be computed once",
                                where("preference.precompute_reference"),
                                "set preference.precompute_reference=false (with peft.method=lora the base model "
                                "is the reference)"))
    return problems


def pretraining_defaults(cfg: RunConfig, where: Callable[[str], str],
                         set_explicitly: Callable[[str], bool]) -> list[Problem]:
    """A preference run whose learning rate or length is still the embedded pretraining job's:
    2e-3 for 1,200 steps moves a trained model far from its reference (TRL trains at 1e-6, one
    epoch). Said, not refused: the user may mean it."""
    found = []
    if not set_explicitly("optim.lr"):
        found.append(Problem("optim.lr", f"is {cfg.optim.lr:g}, the pretraining default: preference methods move a "
                             "trained model a little", where("optim.lr"), "set optim.lr (TRL's default is 1e-6; "
                             "configs/dpo-lora.yaml uses 5e-6)"))
    if not (set_explicitly("training.max_steps") or set_explicitly("training.num_epochs")):
        found.append(Problem("training.max_steps", f"is {cfg.training.max_steps}, the pretraining default, not a "
                             "count of passes over the pairs", where("training.max_steps"),
                             "set training.num_epochs=1 (DPOTrainer's default) or training.max_steps"))
    return found


def reference_rules(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    """A full-parameter reference model is a frozen copy on every rank; where the strategy shards
    the policy, the run computes the reference once instead (or trains an adapter)."""
    from overdrive.strategies import registry

    p = cfg.preference
    if p.method not in WITH_REFERENCE or p.precompute_reference:
        return []
    if cfg.peft.adapter_path:  # the adapter disabled would be the bare base, not the model the run starts from
        return [Problem("preference.precompute_reference", f"{p.method} continuing the adapter in peft.adapter_path "
                        "needs the model it starts from as its reference; with the adapter disabled it would be the "
                        "base without that adapter", where("peft.adapter_path"),
                        "set preference.precompute_reference=true (the reference computed once, with the adapter "
                        "loaded), or merge the adapter into its base (`overdrive merge`) and train a new one on it")]
    if cfg.peft.method != "none":
        return []
    strategy = registry.of(cfg)
    if strategy.holds_whole_model(cfg):
        return []
    fix = ("set peft.method=lora (the base model is the reference)" if p.method == "kto" else
           "set preference.precompute_reference=true (the reference log-probs computed once before training), or "
           "peft.method=lora (the base model is the reference)")
    return [Problem("preference.precompute_reference", f"{p.method} with every parameter trained needs a reference "
                    f"model; under {strategy.label(cfg)} the policy is sharded and a whole frozen copy would not be",
                    where("preference.method"), fix)]
