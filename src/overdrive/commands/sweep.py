"""`overdrive sweep [CONFIG...] [key=value ...]`: search the `sweep.space` of the config with Optuna.

Every trial is a real `overdrive train` (any strategy, any process count) in
`<output_dir>/trial-NNNN`, with its values as a `sweep` layer above the rest. The study lives
in `sweep.storage` (SQLite in output_dir by default): run the same command again after a
stop and it continues; run it in several terminals or on several machines on one storage and
they share the trials. At the end: best.yaml, report/ (summary.md and plots), a table.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from overdrive.commands.arguments import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--runner", choices=["fork", "spawn"], default="fork",
                        help="start trials forked from a warm server (default) or as fresh interpreters")


def run(args: argparse.Namespace) -> int:
    from overdrive import sweep
    from overdrive.commands.arguments import resolved_from
    from overdrive.resolving.inputs import split_items
    from overdrive.resolving import check_for_train
    from overdrive.console import is_interactive
    from overdrive.storage.faults import writable_target
    from overdrive.sweep import outputs, study as studies, table

    resolved = resolved_from(args)  # the space is checked here, with the rest of the config
    files, cli = split_items(args.items)
    job = sweep.make_job(resolved, files, cli, accelerate_default=not args.no_accelerate_default, runner=args.runner)
    cfg = job.config
    if not cfg.sweep.storage:  # the default storage lives in output_dir
        writable_target(cfg.output_dir, "output_dir", directory=True)
    study = sweep.open_study(job)  # before output_dir is made: a bad storage leaves nothing behind
    writable_target(cfg.output_dir, "output_dir", directory=True)
    check_for_train(resolved)
    outputs.write_marker(job, studies.storage_url_shown(cfg), study.study_name)
    print(f"sweep: study {study.study_name!r} in {studies.storage_url_shown(cfg)}: {cfg.sweep.trials} trials, "
          f"{cfg.sweep.sampler} sampler, {cfg.sweep.pruner} pruner, judged by the last {cfg.sweep.metric} "
          f"({cfg.sweep.direction}); trials in {job.output_dir}/trial-NNNN", file=sys.stderr, flush=True)
    progress = table.Progress(cfg.sweep.metric, cfg.sweep.trials, live=is_interactive(sys.stderr))
    try:
        finish = sweep.run(job, study, progress)
    finally:
        progress.close(study)
    if finish.stopped_by:
        import signal

        print(f"sweep: stopped by {signal.Signals(finish.stopped_by).name}; a trial it was running was checkpointed and "
              "queued again. Run the same command to continue the study.", file=sys.stderr)
        return 128 + finish.stopped_by
    best = outputs.write_best(job, study)
    report, images, notes = outputs.write_report(study, job.output_dir, json_marker(job))
    if not is_interactive(sys.stderr):
        table.print_summary(study, cfg.sweep.metric, cfg.sweep.trials)
    if finish.failed:
        print(f"sweep: {finish.failed}", file=sys.stderr)
        return 1
    lines = [f"wrote {report} and {len(images)} plot(s)"]
    for note in notes:
        lines.append(f"  no {note}")
    if best is not None:
        lines += [f"best: {best}", f"next: overdrive train {best}",
                  f"      optuna-dashboard {studies.storage_url_shown(cfg)}    # browse the study (pip install optuna-dashboard)"]
    print("\n".join(lines))
    return 0


def json_marker(job) -> dict:
    import json

    from overdrive.sweep.outputs import MARKER

    return json.loads((job.output_dir / MARKER).read_text())
