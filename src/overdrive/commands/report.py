"""`overdrive report RUN_DIR`: plots and a markdown summary of a run, under RUN_DIR/report/.
A sweep's output_dir gets the sweep's: every trial, the best, Optuna's plots."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run's output_dir (holds metrics.jsonl), or a sweep's (holds sweep.json)")
    parser.add_argument("-o", "--out", help="directory for the plots and summary.md (default: RUN_DIR/report)")
    parser.add_argument("--force", action="store_true", help="write into an -o directory that already holds files")
    parser.add_argument("--print", dest="print_summary", action="store_true", help="also print summary.md")
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    verbosity.add_argument("-v", "--verbose", action="store_true", help="print the summary and every file written")


READS = ("metrics.jsonl", "resolved.json", "sweep.json")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from overdrive.console import get_console, is_interactive, print_table
    from overdrive.reports.summary import METRICS, fmt
    from overdrive.reports.write import write_report

    console = get_console(quiet=args.quiet)
    args.run_dir = run_directory(args.run_dir)
    from overdrive.sweep.outputs import is_sweep_dir

    from overdrive.storage.overlap import refuse_overlap

    # The files a report reads: --force may replace the user's files, never the run's record.
    refuse_overlap({"-o/--out": args.out}, {name: Path(args.run_dir) / name for name in READS
                                            if (Path(args.run_dir) / name).exists()})
    _keep_out_dir(args.out, args.force)

    if is_sweep_dir(args.run_dir):
        return _sweep(args, console)
    if is_interactive() and not args.quiet:
        with console.status("plotting ..."):
            path, images, summary = write_report(args.run_dir, args.out)
    else:
        path, images, summary = write_report(args.run_dir, args.out)
    if args.quiet:
        return 0
    rows = [(label, fmt(summary[key], kind)) for key, label, kind in METRICS if summary[key] is not None]
    print_table(["metric", "value"], rows, title=f"run {args.run_dir}", console=console)
    _rank_panel(args.run_dir, console, print_table)
    _told(args).print(f"wrote {path}" + (f" and {_plots(len(images))}" if images else " (nothing to plot)"))
    return _list_files(args, console, path, images)


def _keep_out_dir(out, force: bool) -> None:
    """A directory given with -o is the user's: a report writes several files there (summary.md,
    report.png, a plot per panel), so one that already holds files is refused without --force.
    RUN_DIR/report, the default, is the report's own and is rewritten."""
    from pathlib import Path

    from overdrive.errors import Problem, UserError

    if out is None or force:
        return
    target = Path(out).expanduser()
    try:
        held = sorted(p.name for p in target.iterdir())[:5] if target.is_dir() else []
    except OSError:
        held = []  # writable_target explains a directory that cannot be read
    if held:
        raise UserError(Problem("-o/--out", f"{target} already holds files ({', '.join(held)}), which the report "
                                "could overwrite", fix="give a new or empty directory, or pass --force"))


def run_directory(given: str) -> str:
    """RUN_DIR as given, or the run of a file in it (`report runs/x/metrics.jsonl`)."""
    from pathlib import Path

    path = Path(given)
    return str(path.parent) if path.is_file() and path.name in ("metrics.jsonl", "resolved.json", "sweep.json") else given


def _told(args: argparse.Namespace):
    """Messages (what was written) on stderr: stdout is the report's data, for a pipe."""
    from overdrive.console import get_console

    return get_console(stderr=True, quiet=args.quiet)


def _plots(count: int) -> str:
    return f"{count} plot" + ("" if count == 1 else "s")


def _list_files(args: argparse.Namespace, console, path, images) -> int:
    if args.verbose:
        for image in images:
            console.print(f"  {image}")
    if args.print_summary or args.verbose:
        console.print(path.read_text(), markup=False)
    return 0


def _rank_panel(run_dir, console, print_table) -> None:
    """Each rank's compute and waiting, and the straggler, for a multi-process run."""
    from overdrive.reports.ranks import panel, straggler_sentence
    from overdrive.training.metrics import path_in, read

    p = panel([r for r in read(path_in(run_dir)).records if "loss" in r])
    if p is None:
        return
    rows = [(f"{r['rank']}{' (straggler)' if r['rank'] == p['straggler'] else ''}", r["host"],
             f"{r['compute_s']:.4f}", f"{r['wait_s']:.4f}") for r in p["ranks"]]
    print_table(["rank", "host", "compute s/step", "waiting s/step"], rows, title="ranks", console=console)
    console.print(straggler_sentence(p) or "no straggler: no rank's compute stayed clearly above the others'")


def _sweep(args: argparse.Namespace, console) -> int:
    from pathlib import Path

    from overdrive.sweep import outputs, table

    study, marker = outputs.load(Path(args.run_dir))
    path, images, notes = outputs.write_report(study, Path(args.run_dir), marker, Path(args.out) if args.out else None)
    if args.quiet:
        return 0
    table.print_summary(study, marker["metric"], marker["trials"], file=console.file)
    _told(args).print(f"wrote {path} and {_plots(len(images))}" + "".join(f"\n  no {note}" for note in notes))
    return _list_files(args, console, path, images)
