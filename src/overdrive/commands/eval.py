"""`overdrive eval RUN_OR_MODEL --tasks T [T ...]`: lm-evaluation-harness tasks on a finished
run's model (`runs/x` means `runs/x/model`), a saved model, or a PEFT adapter on its base; as a
run's evaluations (`eval.tasks`) score it. One table, or `--json`."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="RUN_OR_MODEL",
                        help="a run's output_dir, a save_pretrained directory, an adapter directory, or a hub name")
    parser.add_argument("--tasks", nargs="+", required=True, metavar="TASK",
                        help="lm-eval task names (its registry) or task YAML files")
    parser.add_argument("--limit", type=float, help="rows per task: a count, or a fraction below 1 (lm-eval's --limit)")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: each task's own)")
    parser.add_argument("--batch-size", type=int, default=8, help="requests per forward pass (default: 8)")
    parser.add_argument("--device", help="where the model runs (default: cuda when there is one, else cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default="float32",
                        help="dtype the model is loaded in (default: float32)")
    parser.add_argument("--base", metavar="MODEL", help="an adapter's base model (default: its adapter_config.json's)")
    parser.add_argument("--json", action="store_true", help="print {task: {metric: value}} as JSON")


def run(args: argparse.Namespace) -> int:
    import json
    import os
    import sys
    import tempfile
    from pathlib import Path

    from overdrive.console import print_table
    from overdrive.hf.benchmarks import TaskSettings, evaluate_saved

    settings = TaskSettings(args.limit, args.num_fewshot, args.batch_size)
    # What lm-eval prints (its progress bars, warnings, the `git` it runs for its report) goes to a
    # file, as a run's evaluations send it to <output_dir>/lm-eval.log; the table is what is said here.
    handle, log = tempfile.mkstemp(prefix="overdrive-lm-eval-", suffix=".log")
    os.close(handle)
    print(f"overdrive: lm-eval's own output goes to {log}", file=sys.stderr)
    what, table = evaluate_saved(args.target, args.tasks, settings, device=args.device, dtype=args.dtype,
                                 base=args.base, log=Path(log))
    if args.json:
        print(json.dumps({"model": what, "results": table}, indent=2))
        return 0
    rows = [(task, metric, f"{value:.4f}") for task, values in table.items() for metric, value in values.items()]
    print_table(["task", "metric", "value"], rows, title=f"lm-eval on {what}")
    if not rows:
        print("no numeric metrics came back from the tasks", file=sys.stderr)
    return 0
