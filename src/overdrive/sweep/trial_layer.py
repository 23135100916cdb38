"""A trial's values as a config layer of their own: `<trial dir>/trial.yaml`, labelled
`layer: sweep`, applied above every other layer when the trial's config is resolved. Its
origin in `explain` and in the trial's resolved.json is that file, so it names the trial:

    optim.lr    0.00213    sweep runs/sweep/trial-0003/trial.yaml:5
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import yaml

from overdrive.config.keys import unflatten as nest
from overdrive.storage.whole_file import replace_whole

LABEL = "sweep"


def write(directory: Path, values: dict[str, Any], header: Sequence[str]) -> Path:
    """`directory/trial.yaml`: the header as comments, then the values as dotted keys."""
    body = yaml.safe_dump({"layer": LABEL, **nest(values)}, sort_keys=False, default_flow_style=False)
    return replace_whole(directory / "trial.yaml", "".join(f"# {line}\n" for line in header) + body)


def trial_header(number: int, study: str, retry_of: int | None) -> list[str]:
    again = f", run again after trial {retry_of} was interrupted" if retry_of is not None else ""
    return [f"Trial {number} of study {study!r} (overdrive sweep){again}.",
            "Applied above every other layer when the sweep resolves the trial's config;",
            "`overdrive explain <the sweep's config> <this file>` shows these values with the origin `sweep`."]
