"""`overdrive tune [CONFIG...] [key=value ...]`: measure candidates here, keep the fastest.

Searches micro-batch (accumulation adjusted so the global batch stays the same), mixed
precision, activation checkpointing, torch.compile, strategy and ZeRO stage (with several
processes), DataLoader workers and CPU threads. What cannot fit is pruned by the memory
estimator before anything runs; every trial is a fresh process with a timeout; slow
candidates are stopped early. Writes tuned.yaml (a config layer: `overdrive train run.yaml
tuned.yaml`), prints every candidate, and draws them into a PNG beside it. The result is
cached by a fingerprint of the inputs: asking again answers at once, without torch.
"""

from __future__ import annotations

from overdrive.console import counted

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("items", nargs="*", metavar="FILE | KEY=VALUE",
                        help="config files, then key=value overrides (none: the embedded default job)")
    parser.add_argument("--budget", type=float, metavar="MINUTES",
                        help="stop starting trials after this long (the best measured so far is kept)")
    parser.add_argument("-o", "--output", default="tuned.yaml", metavar="PATH",
                        help="the tuned config layer (default tuned.yaml; an existing file is kept and a new "
                        "name is used, unless --force); the chart goes beside it as .png")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output file")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--grid", action="store_true",
                        help="measure every combination in full instead of the staged successive-halving search")
    parser.add_argument("--only", action="append", default=[], metavar="DIMENSION=V1,V2",
                        help="narrow one dimension (batch, precision, checkpointing, strategy, compile, workers, "
                        "threads) to these values, e.g. --only batch=8,16 --only compile=eager; repeatable")
    parser.add_argument("--fresh", action="store_true", help="measure again even if a cached result exists")
    parser.add_argument("--measure", type=float, default=15.0, metavar="SECONDS",
                        help="timed seconds (at least 20 steps) that complete one candidate's measurement; "
                        "candidates stopped early get a ninth or a third of it (default 15)")
    parser.add_argument("--trial-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="a trial with no training step after this long (start-up, compilation) is hung")
    parser.add_argument("--runner", choices=["fork", "spawn"], default="fork",
                        help="start trials forked from a warm server (default) or as fresh interpreters")
    parser.add_argument("--no-accelerate-default", action="store_true", help="ignore Accelerate's default_config.yaml")


def _only(values: list[str]) -> dict[str, list[str]]:
    from overdrive.errors import Problem, UserError

    only: dict[str, list[str]] = {}
    for value in values:
        name, sep, labels = value.partition("=")
        if not sep or not labels:
            raise UserError(Problem("--only", f"expected DIMENSION=V1,V2, got {value!r}", fix="e.g. --only batch=8,16"))
        only.setdefault(name.strip(), []).extend(v.strip() for v in labels.split(",") if v.strip())
    return only


def run(args: argparse.Namespace) -> int:
    from overdrive.resolving.inputs import resolve_items
    from overdrive.tune import TuneOptions, TrialPlan, lookup, make_job
    from overdrive.tune import output

    from overdrive.commands.arguments import not_over_items

    not_over_items({"--output": args.output}, args.items)  # tuned.yaml never written over a config it read
    resolved = resolve_items(args.items, accelerate_default=not args.no_accelerate_default)
    plan = TrialPlan.measuring(args.measure, startup_timeout_s=args.trial_timeout, runner=args.runner)
    options = TuneOptions(budget_minutes=args.budget, mode="grid" if args.grid else "staged", only=_only(args.only),
                          plan=plan)
    job = make_job(resolved, options)
    result = None if args.fresh else lookup(job)
    hit = result is not None
    if not hit:
        result = _measure(job, quiet=args.json)

    if result["chosen"] is None:
        output.print_table(result, file=sys.stderr)
        print("overdrive: no candidate completed its measurement: nothing written (see the notes above)",
              file=sys.stderr)
        return 1
    sources = _sources(args.items, set(output.by_label(result, result["chosen"])["overrides"]))
    tuned = output.write_tuned(result, Path(args.output), args.force, sources)
    from overdrive.tune import cache

    chart = output.chart(result, tuned.with_suffix(".png"), cache.chart_path(job.config, result["fingerprint"]))
    if args.json:
        print(json.dumps({**{k: v for k, v in result.items() if k != "inputs"}, "cache_hit": hit,
                          "tuned": str(tuned), "chart": str(chart)}, indent=1, default=str))
        return 0
    output.print_table(result)
    chosen = output.by_label(result, result["chosen"])
    base = output.by_label(result, result["baseline"])
    lines = [""]
    if hit:
        lines.append(f"from the cache: measured {result['created']} on the same machine, libraries, model and "
                     f"space (fingerprint {result['fingerprint']}); --fresh measures again")
    if tuned != Path(args.output):
        lines.append(f"{args.output} exists and was kept: wrote {tuned} instead (--force overwrites)")
    gain = ""
    if base and base.get("run_tokens_per_s"):
        gain = f", {chosen['run_tokens_per_s'] / base['run_tokens_per_s']:.2f}x the config as given"
    lines += [
        f"chosen: {chosen['label']}: {chosen['run_tokens_per_s']:,.0f} tokens/s{gain}",
        f"wrote {tuned} (layer: tune) and {chart}",
        f"next: overdrive train {sources + ' ' if sources else ''}{tuned}",
        f"      overdrive explain {sources + ' ' if sources else ''}{tuned}   # the tuned keys show origin `tune`",
    ]
    print("\n".join(lines))
    return 0


def _sources(items: list[str], tuned_keys: set[str]) -> str:
    """The files and key=value items to train with beside tuned.yaml: an item that sets a
    tuned key is left out, because on the command line it would win over the tuned value
    and could split the global batch differently."""
    from overdrive.config.keys import expand_alias

    kept = [i for i in items if "=" not in i or expand_alias(i.split("=", 1)[0].strip()) not in tuned_keys]
    return " ".join(kept)


def _measure(job, quiet: bool):
    from overdrive.resolving import check_for_train
    from overdrive.tune import run, space_size

    check_for_train(job.resolved)
    log = (lambda _: None) if quiet else (lambda line: print(f"tune: {line}", file=sys.stderr, flush=True))
    space = job.space
    log(f"{space_size(space)} combinations; global batch {space.global_batch} on {counted(space.world, 'process')} kept "
        f"in every one; {'every one measured in full' if job.settings.mode == 'grid' else 'staged successive halving'}")
    for note in space.notes:
        log(note)
    return run(job, log)
