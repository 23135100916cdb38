"""Which estimator rows train would refuse: each row (memory/formulas.STRATEGIES) is the settings
strategies/registry.ROW_SETTINGS gives it, laid over the run (or the embedded default) with the
sizes the estimate was asked for, and judged by the resolver's rules and the model's
(resolving/validate_model.shape_rules): the rules `train` applies, not a second copy of them."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from overdrive.errors import Problem, UserError


def row_problems(rows: Sequence[str], model_config: Any, sizes: Mapping[str, Any],
                 run_file: Optional[str] = None, overrides: Sequence[str] = ()) -> dict[str, list[Problem]]:
    """{row: the problems train would refuse it for} over `sizes` (dotted key -> value: the
    processes, axes, micro-batch, length and precision estimated), `run_file` and its `overrides`
    (the run YAML estimated, if one was given); `model_config`: the Transformers config estimated."""
    from overdrive.resolving import resolve
    from overdrive.resolving.validate_model import shape_rules
    from overdrive.strategies.registry import row_settings

    def model_rules(config, chains):
        return shape_rules(config, model_config), []

    found = {}
    for row in rows:
        items = [f"{key}={_text(value)}" for key, value in {**sizes, **row_settings(row)}.items()]
        try:
            resolve([run_file] if run_file else [], cli=[*overrides, *items], rules=model_rules)
        except UserError as error:
            found[row] = list(error.problems)
        else:
            found[row] = []
    return found


def common(problems: Mapping[str, list[Problem]]) -> list[Problem]:
    """The problems every row shares (the sizes asked, not a strategy): refused as the estimate's own."""
    rows = list(problems.values())
    if not rows or not all(rows):
        return []
    shared = {(p.key, p.message) for p in rows[0]}
    for found in rows[1:]:
        shared &= {(p.key, p.message) for p in found}
    return [p for p in rows[0] if (p.key, p.message) in shared]


def refusal(problems: list[Problem]) -> Optional[str]:
    """A row's refusal as the table and JSON say it: `<key>: <why>`, each problem, `; ` between."""
    return "; ".join(f"{p.key}: {p.message}" if p.key else p.message for p in problems) or None


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
