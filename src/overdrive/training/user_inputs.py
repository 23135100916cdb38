"""The user's own code and data checked before a model loads, in one pass with the config's rules
(`resolve(..., checks=check)`: `explain` and `train` ask it): the reward functions (imported,
their signatures bound, called once: training/reward_checks.py) and every row of a local prompt
set or KTO set (data/prompt_checks.py). Nothing is written. Only an RL or KTO run imports the data
package (and torch with it) to be checked."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError


def check(cfg: RunConfig, where: Callable[[str], str],
          directories: Sequence[Path]) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings); `directories`: where reward modules are looked for (the config files' and the
    working directory)."""
    rl, kto = cfg.rl.method != "none", cfg.preference.method == "kto"
    from overdrive.hf.vision import declared

    if declared(cfg) and cfg.data.format == "chat":  # a vision-language run's rows: images against placeholders
        from overdrive.data import vision_rows

        return vision_rows.problems(cfg), []
    if not (rl or kto):
        return [], []
    # Here, not above: the data package loads torch as it is imported, and `explain` of any other run needs none.
    from overdrive.data import prompt_checks
    from overdrive.data.row_table import local_table
    from overdrive.training import reward_checks, rewards

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
    if kto and table is not None:
        more_errors, warnings = prompt_checks.kto_balance(cfg, table, where)
        errors += more_errors
    return errors, warnings

