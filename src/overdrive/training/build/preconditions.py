"""What the loop cannot run, refused before any process starts and before any weight is read: this
machine's hardware, the model's config against the layout and the data (resolving/validate_model.py),
the adapter's targets, chat data without a template, the eval tasks and reward functions a run reads.
Every problem in one message."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from overdrive.errors import Problem, UserError

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def before_launch(cfg: RunConfig, chains: Mapping[str, list]) -> tuple[list[Problem], list[Problem]]:
    """`overdrive train`'s own checks (resolving.resolve.Rules): judged with the resolver's rules,
    so a config with several problems is told them all in one run."""
    from overdrive import hub
    from overdrive.config.provenance import where
    from overdrive.launch.process import hide_gpus_for_cpu_runs
    from overdrive.resolving.resolve import train_hardware_problems
    from overdrive.resolving.validate_model import model_rules

    hide_gpus_for_cpu_runs(cfg)  # before the hardware check asks CUDA
    found = _refused(lambda: hub.refuse_unreadable_names(cfg))  # in a second without a network
    found += _refused(lambda: hub.refuse_missing_data(cfg))
    if cfg.logging.level != "quiet":
        from overdrive.training.build.startup import Stages

        Stages()("loading torch, Transformers and Accelerate")  # the first seconds, said
    found += train_hardware_problems(cfg, chains)
    if found and any(p.key in ("model.name_or_path", "tokenizer.name_or_path") for p in found):
        return found, []  # nothing more can be read of the model
    errors, unreadable = model_rules(cfg, lambda key: where(chains, key, unset="default"))
    found += errors + unreadable
    if not unreadable and not any(p.key.startswith("model.") for p in errors):
        found += fine_tuning_problems(cfg)
    if not any(p.key in _DATA_KEYS for p in found):  # the prompts can be read and the split is settled
        found += data_problems(cfg)
    found += _refused(lambda: check_inputs(cfg))
    return found, []


_DATA_KEYS = ("data.source", "data.format", "data.split", "data.prompt_column", "training.micro_batch_size",
              "training.gradient_accumulation_steps", "training.global_batch_size")


def data_problems(cfg: RunConfig) -> list[Problem]:
    """What the data's size refuses that is known without tokenizing: RL's prompts, counted, against
    one global batch of completions (text and rows are counted once tokenized, before the model loads)."""
    if cfg.data.format != "prompts" or not isinstance(cfg.training.micro_batch_size, int):
        return []
    from overdrive.data import prompts
    from overdrive.data.row_table import local_table

    try:
        count = len(prompts.read(cfg))
    except UserError as error:
        try:  # a local file's rows are checked one by one with the run's other inputs (user_inputs.py)
            checked_there = local_table(cfg.data.source) is not None
        except UserError:
            checked_there = True
        return [] if checked_there else list(error.problems)
    return prompts.slot_problems(prompts.slot_layout(cfg, count))


def _refused(check) -> list[Problem]:
    try:
        check()
    except UserError as error:
        return list(error.problems)
    return []


def fine_tuning_problems(cfg: RunConfig) -> list[Problem]:
    """`peft.target_modules` against the model's modules (built on the meta device, no weights),
    and chat data's tokenizer has a chat template."""
    from overdrive.training.build import adapter

    found = _refused(lambda: adapter.check(cfg))
    if cfg.data.format == "chat":
        from overdrive.training.build.tokenizer import build_tokenizer

        # a pretrained tokenizer (validated): refused by key without a template
        found += _refused(lambda: build_tokenizer(cfg, (), ""))
    return found


def check_inputs(cfg: RunConfig) -> None:
    """What a run reads besides its model and data, refused before its output directory is made:
    `eval.tasks` (lm-eval installed, every task known, its data present or readable). Found later,
    they would stop a run after it had written its directory, or after it had trained. The reward
    functions are the user's code: training/build/user_inputs.py imports and tries them, from the config
    file's directory too, with the config's other problems."""
    if cfg.eval.tasks:
        from overdrive.training import benchmark_eval

        benchmark_eval.check(cfg)


def check_model_layout(cfg: RunConfig) -> None:
    """The model's heads and tensor-parallel plan against parallel.tp_size / sp_size, read
    from its config alone (no weights), and what the loop does not do (sequence parallel),
    before any process starts (launch/job_checks.py, which the cluster writers share)."""
    from overdrive.launch.job_checks import layout_problems

    found = layout_problems(cfg)
    if found:
        raise UserError(found)


def check_fine_tuning(cfg: RunConfig) -> None:
    """fine_tuning_problems, raised."""
    found = fine_tuning_problems(cfg)
    if found:
        raise UserError(found)
