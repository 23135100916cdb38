"""Wall time of `overdrive --help` against `accelerate --help`, measured in one run.

Target: overdrive at most a quarter of accelerate's time. Each command runs in a fresh
interpreter, as a user's shell would start it; the median of several runs is reported.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUNS = 7
RESULTS = Path(__file__).resolve().parent / "results" / "cli_startup.md"


def wall_time(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def median_time(command: list[str]) -> float:
    wall_time(command)  # warm the page cache so both sides start from the same state
    return statistics.median(wall_time(command) for _ in range(RUNS))


def main() -> int:
    bin_dir = Path(sys.executable).parent
    overdrive = [str(bin_dir / "overdrive")] if (bin_dir / "overdrive").exists() else [sys.executable, "-m", "overdrive.cli"]
    accelerate = [str(bin_dir / "accelerate")] if (bin_dir / "accelerate").exists() else [shutil.which("accelerate") or "accelerate"]
    rows = []
    for label, args in (("--help", ["--help"]), ("explain (default config)", ["explain"])):
        ours = median_time(overdrive + args)
        theirs = median_time(accelerate + (["--help"] if args == ["--help"] else ["env"]))
        rows.append((label, ours, theirs))
    lines = [
        "# CLI start-up",
        "",
        f"Median wall time of {RUNS} runs each, fresh interpreter per run, measured together by `bench/bench_cli_startup.py`.",
        "",
        "| overdrive command | overdrive s | accelerate counterpart | accelerate s | ratio | target |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, ours, theirs in rows:
        counterpart = "--help" if label == "--help" else "env"
        target = "<= 0.25" if label == "--help" else "-"
        lines.append(f"| {label} | {ours:.3f} | {counterpart} | {theirs:.3f} | {ours / theirs:.2f} | {target} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    ratio = rows[0][1] / rows[0][2]
    return 0 if ratio <= 0.25 else 1


if __name__ == "__main__":
    sys.exit(main())
