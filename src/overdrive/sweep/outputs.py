"""What a sweep leaves in its output_dir, beside the trial directories:

    sweep.json        where the study is (storage, name) and what it judged: `overdrive report` reads it
    best.yaml         the sweep's config with the best trial's values: `overdrive train best.yaml`
    report/           summary.md (every trial) and Optuna's matplotlib plots: history.png,
                      importances.png, parallel.png
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import yaml

from overdrive.errors import Problem, UserError
from overdrive.sweep import table
from overdrive.storage.whole_file import replace_whole

MARKER = "sweep.json"
BEST = "best.yaml"
PLOTS = {
    "history.png": "plot_optimization_history",
    "importances.png": "plot_param_importances",
    "parallel.png": "plot_parallel_coordinate",
}


def is_sweep_dir(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def write_marker(job, storage_url_shown: str, name: str) -> Path:
    data = {"storage": storage_url_shown, "study_name": name, "metric": job.config.sweep.metric,
            "direction": job.config.sweep.direction, "trials": job.config.sweep.trials}
    return replace_whole(job.output_dir / MARKER, json.dumps(data, indent=1))


def best_yaml(job, best) -> str:
    """The sweep's config files (extended), its command-line values and the best values."""
    from overdrive.config.keys import coerce
    from overdrive.config.redact import shown
    from overdrive.sweep.study import study_name
    from overdrive.sweep.trial_layer import LABEL, nest

    out = job.output_dir
    body: dict[str, Any] = {}
    if job.files:
        body["extends"] = [os.path.relpath(Path(f).resolve(), out) for f in job.files]
    body["layer"] = LABEL
    for key, chain in job.resolved.chains.items():
        value = coerce(key, chain[-1].value)
        if chain[-1].origin.layer == "cli" and key != "output_dir" and shown(key, value) == value:
            body[key] = value  # a secret stays where it came from: the environment
    body.update(best.params)
    body["output_dir"] = str(out / "best")
    header = [f"The best trial of study {study_name(job.config)!r}: trial {best.number}, "
              f"{job.config.sweep.metric} {best.value:.6g} ({best.user_attrs.get('output_dir', '')}).",
              "Written by `overdrive sweep`: the sweep's config with the best values. Train it with",
              f"  overdrive train {out / BEST}"]
    return "".join(f"# {line}\n" for line in header) + yaml.safe_dump(nest(body), sort_keys=False)


def write_best(job, study) -> Optional[Path]:
    best = table.best_trial(study)
    if best is None:
        return None
    return replace_whole(job.output_dir / BEST, best_yaml(job, best))  # several sweep processes may finish together


def plots(study, target: Path) -> tuple[list[Path], list[str]]:
    """Optuna's matplotlib plots as PNGs; a plot the study cannot have yet is a note instead."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt
    from optuna.importance import PedAnovaImportanceEvaluator
    from optuna.visualization import matplotlib as views

    target.mkdir(parents=True, exist_ok=True)
    images, notes = [], []
    for name, function in PLOTS.items():
        # PED-ANOVA: the importance evaluator that needs no scikit-learn.
        kwargs = {"evaluator": PedAnovaImportanceEvaluator()} if name == "importances.png" else {}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                axes = getattr(views, function)(study, **kwargs)
            figure = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
            figure.savefig(target / name, dpi=110, bbox_inches="tight")
            plt.close(figure)
            images.append(target / name)
        except Exception as error:  # too few trials, one parameter, ...: Optuna says why
            notes.append(f"{name}: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
    return images, notes


def summary_markdown(study, marker: dict[str, Any], images: list[Path], notes: list[str], best_path: Optional[Path]) -> str:
    from overdrive.console import format_plain_table

    best = table.best_trial(study)
    lines = [f"# Sweep {study.study_name}", "",
             f"Storage `{marker['storage']}`, metric `{marker['metric']}` ({marker['direction']}), "
             f"{marker['trials']} trials asked.", ""]
    if best is not None:
        lines += [f"Best: trial {best.number}, {marker['metric']} {best.value:.6g}: "
                  + ", ".join(f"`{k}={v}`" for k, v in best.params.items()) + ".", ""]
    if best_path is not None:
        lines += [f"`overdrive train {best_path}` trains the sweep's config with the best values.", ""]
    lines += ["```", format_plain_table(table.HEADERS, table.rows(study, best.number if best else None)), "```", ""]
    lines += [f"![{image.stem}]({image.name})" for image in images]
    lines += [f"- {note}" for note in notes]
    lines += ["", "Browse the study live: `pip install optuna-dashboard`, then "
              f"`optuna-dashboard {marker['storage']}`."]
    return "\n".join(lines) + "\n"


def write_report(study, sweep_dir: Path, marker: dict[str, Any], out: Optional[Path] = None) -> tuple[Path, list[Path], list[str]]:
    from overdrive.config.redact import redact_text

    target = out or sweep_dir / "report"
    images, notes = plots(study, target)
    best_path = sweep_dir / BEST if (sweep_dir / BEST).is_file() else None
    path = target / "summary.md"
    path.write_text(redact_text(summary_markdown(study, marker, images, notes, best_path)))
    return path, images, notes


def load(sweep_dir: Path):
    """The study a sweep directory belongs to (storage and name from its sweep.json)."""
    import optuna

    from overdrive.sweep.study import quiet_optuna

    try:
        marker = json.loads((sweep_dir / MARKER).read_text())
    except (OSError, ValueError) as error:
        raise UserError(Problem(str(sweep_dir / MARKER), f"cannot be read: {error}")) from None
    if "***" in marker.get("storage", ""):
        raise UserError(Problem("sweep.storage", f"{sweep_dir / MARKER} holds the storage URL with its password masked",
                                fix="open the study with optuna.load_study(storage=URL, study_name=...) yourself"))
    quiet_optuna()
    try:
        study = optuna.load_study(study_name=marker["study_name"], storage=marker["storage"])
    except Exception as error:
        raise UserError(Problem("sweep.storage", f"cannot open the study {marker.get('study_name')!r} in "
                                f"{marker.get('storage')}: {str(error).splitlines()[0] if str(error) else error}")) from None
    return study, marker
