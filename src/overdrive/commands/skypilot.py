"""`overdrive skypilot [config...] [key=value...]`: the run as a SkyPilot task YAML, on stdout
(launch it with `sky launch task.yaml --secret HF_TOKEN ...`)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from overdrive.commands.arguments import add_config_arguments, add_output_arguments

    add_config_arguments(parser)
    add_output_arguments(parser, "task YAML")
    parser.add_argument("--job-name", default="overdrive", help="name of the task")


def run(args: argparse.Namespace) -> int:
    from overdrive.commands.arguments import checked_output, emit
    from overdrive.resolving.inputs import split_items

    checked_output(args)
    from overdrive.launch import job, skypilot

    from overdrive.errors import UserError

    described = job.describe(job.resolve_for_cluster(*split_items(args.items), not args.no_accelerate_default), args.job_name)
    found = skypilot.problems(described)
    if found:
        raise UserError(found, title="cannot write the task")
    emit(skypilot.render(described), args)
    return 0
