"""The trials of a study as rows: the live progress table on a terminal (one line per
change elsewhere), and the summary table at the end and in `overdrive report`."""

from __future__ import annotations

import sys
import time
from typing import Any, Optional

HEADERS = ["trial", "state", "value", "steps", "seconds", "values", "directory / note"]


def _params(trial) -> str:
    return "  ".join(f"{k}={_fmt(v)}" for k, v in trial.params.items())


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def best_trial(study) -> Optional[Any]:
    from optuna.trial import TrialState

    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return None
    return study.best_trial


def rows(study, best_number: Optional[int] = None) -> list[list[Any]]:
    out = []
    for t in study.get_trials(deepcopy=False):
        value = t.value if t.value is not None else (
            t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else None)
        note = t.user_attrs.get("reason") or t.user_attrs.get("output_dir", "")
        if t.system_attrs.get("failed_trial") is not None:
            note = f"again after trial {t.system_attrs['failed_trial']}: {note}"
        if t.user_attrs.get("pruned_at_step") is not None:
            note = f"pruned at step {t.user_attrs['pruned_at_step']}: {note}"
        mark = " *" if t.number == best_number else ""
        out.append([f"{t.number}{mark}", t.state.name, value, t.user_attrs.get("steps"), t.user_attrs.get("seconds"),
                    _params(t), note])
    return out


def title(study, metric: str, target: int) -> str:
    from overdrive.sweep.study import tally

    n = tally(study)
    return (f"sweep {study.study_name}: {n.finished}/{target} finished, {n.running} running, {n.failed} failed; "
            f"value = last {metric} ({study.direction.name.lower()}), * best")


def print_summary(study, metric: str, target: int, file=None) -> None:
    from overdrive.console import print_table

    best = best_trial(study)
    print_table(HEADERS, rows(study, best.number if best else None), title=title(study, metric, target), file=file)


class Progress:
    """Called with the study as the sweep goes (at most a few times a second)."""

    def __init__(self, metric: str, target: int, live: bool, file=None):
        self.metric, self.target, self.file = metric, target, file or sys.stderr
        self.seen: dict[int, str] = {}
        self.last = 0.0
        self.live = None
        if live:
            from rich.console import Console
            from rich.live import Live

            self.live = Live(console=Console(file=self.file), refresh_per_second=2, transient=False)
            self.live.start()

    def __call__(self, study) -> None:
        now = time.monotonic()
        if now - self.last < 0.5:
            return
        self.last = now
        if self.live is not None:
            self.live.update(self._table(study))
            return
        for t in study.get_trials(deepcopy=False):
            if self.seen.get(t.number) != t.state.name:
                self.seen[t.number] = t.state.name
                value = f" {self.metric} {t.value:.5g}" if t.value is not None else ""
                print(f"sweep: trial {t.number} {t.state.name.lower()}{value}  {_params(t)}", file=self.file, flush=True)

    def _table(self, study):
        from rich.table import Table

        best = best_trial(study)
        table = Table(title=title(study, self.metric, self.target), title_justify="left", header_style="bold")
        for header in HEADERS:
            table.add_column(header, overflow="fold")
        for row in rows(study, best.number if best else None):
            table.add_row(*("-" if c is None else _fmt(c) for c in row))
        return table

    def close(self, study=None) -> None:
        if self.live is not None:
            if study is not None:
                self.live.update(self._table(study))
            self.live.stop()
        elif study is not None:
            self.last = 0.0
            self(study)
