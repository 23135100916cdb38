"""`overdrive k8s [config...] [key=value...] [--kind trainjob|pytorchjob|jobset]`: the run as
Kubernetes manifests, on stdout (a ConfigMap with the resolved config, and the job)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from overdrive.commands.arguments import add_config_arguments, add_output_arguments

    add_config_arguments(parser)
    add_output_arguments(parser, "manifests")
    parser.add_argument("--kind", choices=("trainjob", "pytorchjob", "jobset"), default="trainjob",
                        help="Kubeflow Trainer TrainJob (default), Kubeflow PyTorchJob, or JobSet")
    parser.add_argument("--job-name", default="overdrive",
                        help="name of the job; its ConfigMap, Secret and volume claim are named after it")


def run(args: argparse.Namespace) -> int:
    from overdrive.commands.arguments import checked_output, emit
    from overdrive.resolving.inputs import split_items

    checked_output(args)
    from overdrive.launch import job, k8s

    described = job.describe(job.resolve_for_cluster(*split_items(args.items), not args.no_accelerate_default), args.job_name, container=True)
    from overdrive.errors import UserError

    found = k8s.problems(described)
    if found:
        raise UserError(found, title="cannot write the job")
    emit(k8s.render(described, args.kind), args)
    return 0
