"""What people type that overdrive does not take, answered with what it does take.

    overdrive trian                    -> did you mean `overdrive train`?
    overdrive train --max_steps 20     -> write it as training.max_steps=20
    overdrive train --resume           -> resuming is automatic: run the same command again

Config keys are KEY=VALUE items, never `--flags`: a flag named like a key (in any section,
with - or _) is turned into the item it meant.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Optional, Sequence

from overdrive.errors import Problem, UserError

RESUME = ("resuming is automatic: run the same command again and it continues from the newest complete "
          "checkpoint in output_dir (checkpoint.resume=auto); checkpoint.resume=never starts afresh, "
          "and --force resumes even when the config changed keys that alter the math")
FORCE = ("--force is train's: it resumes from the checkpoint in output_dir even though the config changed "
         "keys that alter the math")


def unknown_command(name: str, commands: Sequence[str]) -> UserError:
    """`overdrive trian`: the close command names; a config file given as a command: train it."""
    close = difflib.get_close_matches(name, list(commands), n=3, cutoff=0.6)
    if name.endswith((".yaml", ".yml", ".json", ".toml")) or "=" in name:
        fix = f"train it: overdrive train {name}"
    elif close:
        fix = " or ".join(f"`overdrive {c}`" for c in close) + "?"
    else:
        fix = "overdrive --help lists the commands; overdrive help COMMAND shows one"
    return UserError(Problem("", f"unknown command {name!r}", fix=("did you mean " if close else "") + fix))


# Flags other tools (Transformers' Trainer, TRL, torchrun, Axolotl, LLaMA-Factory) taught people,
# named like no overdrive key: the key each one means. Only hints: never accepted as aliases.
HABITS = {
    "epochs": "training.num_epochs", "num_train_epochs": "training.num_epochs", "epoch": "training.num_epochs",
    "warmup": "scheduler.warmup_steps", "bs": "training.micro_batch_size",
    "per_device_train_batch_size": "training.micro_batch_size", "train_batch_size": "training.micro_batch_size",
    "grad_accum": "training.gradient_accumulation_steps", "gradient_accumulation": "training.gradient_accumulation_steps",
    "grad_acc": "training.gradient_accumulation_steps", "max_seq_len": "data.max_length",
    "max_seq_length": "data.max_length", "seq_length": "data.max_length", "block_size": "data.max_length",
    "cutoff_len": "data.max_length", "sequence_len": "data.max_length", "model_name_or_path": "model.name_or_path",
    "model_name": "model.name_or_path", "base_model": "model.name_or_path", "dataset": "data.source",
    "dataset_name": "data.source", "train_file": "data.source", "output": "output_dir", "nproc_per_node": "launch.num_processes",
    "num_gpus": "launch.num_processes", "gpus": "launch.num_processes", "max_grad_norm": "training.gradient_clipping",
    "lora_r": "peft.r", "lora_rank": "peft.r", "rank": "peft.r", "lora_alpha": "peft.alpha", "lora_dropout": "peft.dropout",
    "dpo_beta": "preference.beta", "beta": "preference.beta", "loss_type": "preference.method", "dpo_loss": "preference.method", "lr_scheduler_type": "scheduler.name",
    "scheduler": "scheduler.name", "optim": "optim.name", "optimizer": "optim.name", "logging_steps":
    "training.log_every_steps", "save_steps": "checkpoint.every_steps", "eval_steps": "training.eval_every_steps",
}
# Switches with no value: the item each one means.
SWITCHES = {"bf16": "precision.mixed_precision=bf16", "fp16": "precision.mixed_precision=fp16",
            "gradient_checkpointing": "model.gradient_checkpointing=true", "cpu": "launch.use_cpu=true",
            "use_cpu": "launch.use_cpu=true", "packing": "data.packing=true"}


def key_for_flag(flag: str) -> Optional[str]:
    """The config key a `--flag` names: `--max_steps`, `--max-steps`, `--training.max_steps`, `--lr`,
    and the flags other tools taught (`--epochs`, `--per_device_train_batch_size`)."""
    from overdrive.config.keys import ALIASES, expand_alias, is_known, leaf_annotations

    name = flag.lstrip("-").replace("-", "_")
    if name in HABITS and is_known(HABITS[name]):
        return HABITS[name]
    if is_known(expand_alias(name)):
        return expand_alias(name)
    by_last = [key for key in leaf_annotations() if key.rpartition(".")[2] == name]
    if len(by_last) == 1:
        return by_last[0]
    return expand_alias(name) if name in ALIASES else None


def flag_hint(argv: Sequence[str], parser: argparse.ArgumentParser) -> Optional[UserError]:
    """A hint for the first `--flag` this command does not take, when it names a key or a habit."""
    known = set(parser._option_string_actions)  # argparse's own table of the command's options
    for index, token in enumerate(argv):
        if not token.startswith("--") or token == "--":
            continue
        flag, eq, inline = token.partition("=")
        if flag in known:
            continue
        if flag in ("--resume", "--resume-from", "--resume_from_checkpoint", "--continue"):
            return UserError(Problem(flag, "is not an option", fix=RESUME))
        if flag == "--force":
            return UserError(Problem(flag, "is not an option of this command", fix=FORCE))
        switch = SWITCHES.get(flag.lstrip("-").replace("-", "_"))
        if switch is not None and not eq:
            return UserError(Problem(flag, "config keys are KEY=VALUE items, not options", fix=f"write it as {switch}"))
        key = key_for_flag(flag)
        if key is None:
            continue
        following = argv[index + 1] if index + 1 < len(argv) else ""
        value = inline if eq else (following if following and not following.startswith("-") and "=" not in following
                                   else "VALUE")
        return UserError(Problem(flag, "config keys are KEY=VALUE items, not options",
                                 fix=f"write it as {key}={value}"))
    return None


class HintingParser(argparse.ArgumentParser):
    """An ArgumentParser whose refusals of a config key as a flag say how to write it."""

    argv: Sequence[str] = ()

    def error(self, message: str):  # argparse's hook for every refusal
        hint = flag_hint(self.argv, self)
        if hint is not None:
            raise hint
        super().error(message)
