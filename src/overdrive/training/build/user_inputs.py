"""The user's own code and data checked before a model loads, in one pass with the config's rules
(`resolve(..., checks=check)`: `explain` and `train` ask it): a distillation teacher's tokenizer against
the student's (hf/teacher.py, from their files), the reward functions (imported,
their signatures bound, called once: training/objectives/reward_checks.py) and every row of a local prompt
set, preference or KTO set (data/prompt_checks.py, data/preference.py). Nothing is written. Only an
RL or preference run imports the data package (and torch with it) to be checked."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError


def check(cfg: RunConfig, where: Callable[[str], str],
          directories: Sequence[Path]) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings); `directories`: where reward modules are looked for (the config files' and the
    working directory)."""
    rl, kto = cfg.rl.method != "none", cfg.preference.method == "kto"
    pairs = cfg.data.format == "preference"
    from overdrive.hf import teacher
    from overdrive.hf.vision import declared

    # the teacher's tokenizer against the student's, from files (no weights)
    taught = [replace(p, where=p.where or where(p.key)) for p in teacher.fit_problems(cfg)]
    if declared(cfg) and cfg.data.format in ("chat", "preference"):  # a vision-language run's rows: images
        # against placeholders (conversations, or pairs whose prompts hold the images)
        from overdrive.data import vision_pairs, vision_rows
        from overdrive.data.row_table import local_table

        rows = local_table(cfg.data.source)  # a data set that is not a local file is checked as it is read
        if rows is None:
            return taught, []
        if cfg.preference.method != "none":  # pairs: a prompt with the images, two answers
            return taught + vision_pairs.problems(cfg, rows), []
        return taught + vision_rows.problems(cfg, rows), []
    if not (rl or kto or pairs):
        return taught, []
    # Here, not above: the data package loads torch as it is imported, and `explain` of any other run needs none.
    from overdrive.data import prompt_checks
    from overdrive.data.row_table import local_table
    from overdrive.training.objectives import reward_checks, rewards

    errors: list[Problem] = []
    warnings: list[Problem] = []
    table = None
    try:
        table = local_table(cfg.data.source)
    except UserError as error:
        errors += error.problems
    if rl:
        if table is not None:
            errors += prompt_checks.prompt_problems(cfg, table)
        with rewards.importable_from(directories):
            errors += reward_checks.problems(cfg, table, where)
            if cfg.rl.tools:  # importable, with a schema Transformers can make (the template is asked at train)
                from overdrive.training.generation import tools

                errors += [Problem(p.key, p.message, where("rl.tools"), p.fix) for p in tools.problems(cfg.rl.tools)]
            if cfg.rl.environment:  # imported and probed as TRL probes it: reset, the tools' schemas, get_reward
                errors += environment_problems(cfg, table.columns if table is not None else None, where)
    if rl and table is not None and declared(cfg):  # a vision-language policy's prompts: images against image parts
        from overdrive.data import vision_prompts

        errors += vision_prompts.problems(cfg, table)
    if pairs and table is not None:  # every row read as training reads it, before anything is written
        from overdrive.data.preference import row_problems

        errors += row_problems(cfg, table.columns, table.rows, table.place)
    if kto and table is not None and not errors:
        more_errors, warnings = prompt_checks.kto_balance(cfg, table, where)
        errors += more_errors
    return taught + errors, warnings



def environment_problems(cfg: RunConfig, columns: Optional[list[str]], where: Callable[[str], str]) -> list[Problem]:
    """rl.environment's contract, and a reward source: rl.reward_funcs or the environment's get_reward."""
    from overdrive.training.generation import environments

    if cfg.rl.environment is None:
        return []
    try:
        environment = environments.build(cfg.rl.environment, columns)
    except UserError as error:
        return [Problem(p.key, p.message, where("rl.environment"), p.fix) for p in error.problems]
    if not cfg.rl.reward_funcs and not environment.has_reward:
        return [Problem("rl.reward_funcs", f"no reward function, and the environment {environment.name} has no "
                        "get_reward: every completion would score the same", where("rl.environment"),
                        "add rl.reward_funcs (they get the instances as `environments`), or define "
                        f"{environment.name}.get_reward(self) -> float")]
    return []
