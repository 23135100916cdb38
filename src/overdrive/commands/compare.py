"""`overdrive compare RUN_A RUN_B`: which config values differ, and what it did to the run."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", metavar="RUN_A", help="first run directory (the baseline)")
    parser.add_argument("run_b", metavar="RUN_B", help="second run directory")
    parser.add_argument("--plot", metavar="OUT.png", help="write both loss curves on one plot")
    parser.add_argument("--json", action="store_true", help="print the differences as JSON")
    parser.add_argument("--force", action="store_true", help="overwrite the --plot file if it exists")
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    verbosity.add_argument("-v", "--verbose", action="store_true", help="also list config keys that are equal")


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from overdrive.console import get_console, print_table
    from overdrive.storage.faults import output_file
    from overdrive.reports.summary import config_differences, load_run, metric_rows, summarize

    from overdrive.commands.report import READS, run_directory
    from overdrive.storage.overlap import refuse_overlap

    if args.plot:
        read = {f"{name} of {run}": Path(run_directory(run)) / name for run in (args.run_a, args.run_b) for name in READS
                if (Path(run_directory(run)) / name).exists()}
        refuse_overlap({"--plot": args.plot}, read)
        args.plot = str(output_file(args.plot, "--plot", args.force, suffix=".png"))

    a, b = load_run(run_directory(args.run_a)), load_run(run_directory(args.run_b))
    sa, sb = summarize(a), summarize(b)
    differences = config_differences(a, b)
    metrics = metric_rows(sa, sb)
    if args.plot:
        from overdrive.reports.plots import plot_compare

        plot_compare(a, b, Path(args.plot))
    if args.json:
        print(json.dumps({"config": [{"key": k, "a": va, "b": vb} for k, va, vb in differences],
                          "metrics": [dict(zip(("metric", "a", "b", "change"), row)) for row in metrics]},
                         indent=2, default=str))
        return 0
    console = get_console(quiet=args.quiet)
    if args.quiet:
        return 0
    name_a, name_b = f"A: {a.name}", f"B: {b.name}"
    if a.config is None or b.config is None:
        missing = [str(r.path) for r in (a, b) if r.config is None]
        get_console(stderr=True).print(f"No resolved.json in {', '.join(missing)}: config differences cannot be shown.")
    elif differences:
        print_table(["config key", name_a, name_b], differences, title="Config differences", console=console)
    else:
        console.print("Configs are identical.")
    if args.verbose and a.config is not None and b.config is not None:
        same = sorted(set(a.values()) & set(b.values()) - {k for k, _, _ in differences})
        console.print(f"{len(same)} equal keys: " + ", ".join(same), markup=False)
    console.print("")
    print_table(["metric", name_a, name_b, "B vs A"], metrics, title="Results", console=console)
    if args.plot:
        get_console(stderr=True).print(f"wrote {args.plot}")
    return 0
