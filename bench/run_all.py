"""Run every benchmark in bench/ and collect their tables into bench/results/README.md."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"


def main() -> int:
    scripts = sorted(BENCH.glob("bench_*.py"))
    summary = ["# Benchmark results", "", "Written by `python bench/run_all.py`; each section is one script's table.", ""]
    failed = []
    for script in scripts:
        start = time.perf_counter()
        print(f"== {script.name}", flush=True)
        result = subprocess.run([sys.executable, str(script)])
        seconds = time.perf_counter() - start
        status = "met its target" if result.returncode == 0 else f"exit {result.returncode} (target missed or error)"
        summary.append(f"- `{script.name}`: {status}, {seconds:.0f} s")
        if result.returncode:
            failed.append(script.name)
    summary.append("")
    for table in sorted(RESULTS.glob("*.md")):
        if table.name != "README.md":
            summary += [table.read_text().strip(), ""]
    (RESULTS / "README.md").write_text("\n".join(summary))
    print(f"wrote {RESULTS / 'README.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
