"""`overdrive report`: a finished run's plots and summary.md, written side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from overdrive.reports.plots import plot_run
from overdrive.reports.summary import load_run, summarize, summary_markdown


def write_report(run_dir: str | Path, out_dir: Optional[str | Path] = None) -> tuple[Path, list[Path], dict]:
    """Plots and summary.md under `<run>/report/`. Returns (summary path, images, summary)."""
    from overdrive.config.redact import redact_text
    from overdrive.storage.faults import writable_target

    run = load_run(run_dir)
    target = writable_target(Path(out_dir) if out_dir else run.path / "report", "-o/--out", directory=True)
    summary = summarize(run)
    images = plot_run(run, target)
    path = target / "summary.md"
    path.write_text(redact_text(summary_markdown(run, summary, images)))
    return path, images, summary
