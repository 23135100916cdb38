"""`overdrive estimate MODEL_OR_CONFIG`: memory per device for every strategy, and which fits.

MODEL_OR_CONFIG is a directory with config.json, a config.json file, an overdrive run YAML
(its model, micro-batch, sequence length, precision and process count), or a hub name. The
model is built on the meta device: no weights are read or downloaded.
"""

from __future__ import annotations

from typing import Any

import argparse

from overdrive.errors import Problem, UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_OR_CONFIG",
                        help="directory with config.json, a config.json, a run YAML, or a hub name")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides for a run YAML (as in train)")
    parser.add_argument("--devices", type=int, help="processes, all axes together (default: the YAML's, else 1)")
    parser.add_argument("--tp", type=int, help="tensor parallel degree (default: the YAML's parallel.tp_size, else 1)")
    parser.add_argument("--cp", type=int, help="context parallel degree (parallel.cp_size)")
    parser.add_argument("--sp", type=int, help="sequence parallel degree (parallel.sp_size)")
    parser.add_argument("--dp-replicate", type=int, help="HSDP replicas (parallel.dp_replicate_size); the rest of "
                        "--devices is the shard degree")
    parser.add_argument("--ep", type=int, help="expert parallel degree of a mixture of experts (parallel.ep_size): "
                        "the routed experts' weights per rank")
    parser.add_argument("--precision", choices=["no", "fp16", "bf16"], help="default: the YAML's, else bf16")
    parser.add_argument("--micro-batch", type=int, help="samples per device per step (default: the YAML's, else 1)")
    parser.add_argument("--seq-len", type=int, help="tokens per sample (default: the YAML's, else min(2048, max positions))")
    ckpt = parser.add_mutually_exclusive_group()
    ckpt.add_argument("--checkpointing", dest="checkpointing", action="store_true", default=None,
                      help="count the total with activation checkpointing")
    ckpt.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--loss-kernel", choices=["auto", "full", "chunked", "fused"],
                        help="the token loss's kernel (training.loss_kernel; default: the YAML's, else auto)")
    parser.add_argument("--activation-offloading", action="store_true", default=None,
                        help="count saved activations in host memory (training.activation_offloading)")
    parser.add_argument("--gpu-memory", type=float, metavar="GIB",
                        help="plan for GPUs of this size (default: the GPU found, else host RAM)")
    parser.add_argument("--host-memory", type=float, metavar="GIB", help="host RAM per node (default: this machine's)")
    parser.add_argument("--nodes", type=int, default=1, help="machines the devices are spread over (host RAM is per node)")
    parser.add_argument("--target", choices=["auto", "cuda", "cpu"], default="auto",
                        help="kernels to assume (attention, dropout masks); auto: cuda with a GPU or --gpu-memory")
    parser.add_argument("--peft", choices=["none", "lora", "qlora"],
                        help="fine-tune an adapter on the frozen base (default: the YAML's peft.method, else none)")
    parser.add_argument("--lora-r", type=int, help="LoRA rank with --peft (default: the YAML's peft.r, else 16)")
    parser.add_argument("--strategies", help="comma list of rows to show (default: all)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (GB) instead")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the stacked bars as a PNG")
    parser.add_argument("--force", action="store_true", help="overwrite the --plot file if it exists")


def _positive(name: str, value) -> None:
    if value is not None and value < 1:
        raise UserError(Problem(name, f"must be at least 1 (got {value})"))


def build(args: argparse.Namespace):
    """(Estimate, Source) for the parsed arguments; shared with `plan`."""
    for name in ("--devices", "--micro-batch", "--seq-len", "--nodes", "--tp", "--cp", "--sp", "--dp-replicate", "--ep"):
        _positive(name, getattr(args, name[2:].replace("-", "_"), None))
    from overdrive.commands.arguments import check_memory_sizes

    check_memory_sizes(args)
    if args.overrides and not args.model.endswith((".yaml", ".yml")):
        raise UserError(Problem("", "key=value overrides apply to a run YAML only"))
    if not args.model.endswith((".yaml", ".yml", ".json")):
        from overdrive import hub

        hub.refuse_if_unreadable("MODEL", args.model)  # before torch and Transformers are imported
    from overdrive.memory import STRATEGIES, estimate
    from overdrive.memory.model_shape import model_shape, resolve_source
    from overdrive.memory.model_shape import run_setup
    from overdrive.memory.shape import Setup

    source = resolve_source(args.model, args.overrides)
    shape = model_shape(source)
    target = _target(args)
    changes = dict(devices=args.devices, precision=args.precision, micro_batch=args.micro_batch,
                   seq_len=args.seq_len, checkpointing=args.checkpointing, tp=args.tp, cp=args.cp, sp=args.sp,
                   dp_replicate=args.dp_replicate, ep=getattr(args, "ep", None),
                   activation_offloading=getattr(args, "activation_offloading", None))
    if getattr(args, "loss_kernel", None):
        changes["loss_kernel"] = _loss_kernel(args.loss_kernel, source.run, target)
    overridden = getattr(args, "peft", None) is not None or getattr(args, "lora_r", None) is not None
    if source.run is not None:
        setup = run_setup(source.run, target, **changes)  # with the adapter the run trains
    else:
        positions = getattr(source.config, "max_position_embeddings", None) or getattr(source.config, "n_positions", None)
        defaults = dict(devices=1, precision="bf16", micro_batch=1, seq_len=min(2048, positions or 2048),
                        checkpointing=False, target=target)
        defaults.update({k: v for k, v in changes.items() if v is not None})
        setup = Setup(**defaults)
    if overridden or source.run is None:  # --peft / --lora-r say what trains
        from dataclasses import replace

        setup = replace(setup, adapter=_adapter(args, source, setup))
    axes = setup.dp_replicate * setup.tp * setup.cp * setup.sp
    if setup.devices % axes:
        raise UserError(Problem("--devices", f"{setup.devices} devices do not divide into dp_replicate x tp x cp x sp = {axes}",
                                fix=f"give a multiple of {axes}"))
    strategies = STRATEGIES
    if args.strategies:
        strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
        unknown = [s for s in strategies if s not in STRATEGIES]
        if unknown:
            raise UserError(Problem("--strategies", f"unknown {unknown}; choose from {', '.join(STRATEGIES)}"))
    est = estimate(shape, setup, strategies)
    _judge_rows(args, source, setup, est)
    return est, source


# The estimate's flags and the Setup fields they set, as the config keys train reads them from.
_KEYS = {"devices": "launch.num_processes", "tp": "parallel.tp_size", "cp": "parallel.cp_size",
         "sp": "parallel.sp_size", "dp_replicate": "parallel.dp_replicate_size", "ep": "parallel.ep_size",
         "micro_batch": "training.micro_batch_size", "seq_len": "data.max_length",
         "precision": "precision.mixed_precision"}


def _judge_rows(args: argparse.Namespace, source, setup, est) -> None:
    """Each row judged by train's rules at the sizes estimated (memory/refusals.py): a row train would
    refuse is marked `refused: <key>: <why>`; what every row is refused for is the estimate's own
    input, refused by key (exit 2) and named by the flag that set it."""
    from overdrive.memory import refusals

    asked = {field: getattr(args, field, None) for field in _KEYS}
    if source.run is None:  # the embedded default run, at the sizes the estimate assumes
        asked = {field: getattr(setup, field) for field in _KEYS}
    sizes = {_KEYS[field]: value for field, value in asked.items() if value is not None}
    if source.run is None:  # the run trains the model estimated: pretrained weights an adapter can adapt
        sizes["model.name_or_path"] = args.model
    sizes.update({key: value for key, value in (("peft.method", getattr(args, "peft", None)),
                                                ("peft.r", getattr(args, "lora_r", None))) if value is not None})
    run_file = args.model if source.run is not None else None
    found = refusals.row_problems([row.strategy for row in est.rows], source.config, sizes, run_file, args.overrides)
    shared = refusals.common(found)
    if shared:
        flags = {key: f"--{field.replace('_', '-')} {args_value}" for field, key in _KEYS.items()
                 if (args_value := getattr(args, field, None)) is not None}
        from dataclasses import replace

        raise UserError([replace(p, where=flags.get(p.key, p.where)) for p in shared],
                        title="train would refuse every strategy at these sizes")
    for row in est.rows:
        row.refused = refusals.refusal(found[row.strategy])


def _adapter(args, source, setup):
    """The adapter a LoRA/QLoRA run trains (memory/adapter.py), from the YAML's peft section
    or --peft/--lora-r; None for full training."""
    from overdrive.config.schema_peft import PeftConfig

    peft = source.run.peft if source.run is not None else PeftConfig()
    changes = {k: v for k, v in (("method", getattr(args, "peft", None)), ("r", getattr(args, "lora_r", None)))
               if v is not None}
    _positive("--lora-r", changes.get("r"))
    peft = peft.model_copy(update=changes)
    if peft.method == "none":
        return None
    from overdrive.memory.adapter import adapter_shape
    from overdrive.memory.model_shape import build_meta_model

    dtype = source.run.model.dtype if source.run is not None else ("float32" if not setup.mixed else "bfloat16")
    model = build_meta_model(source.config, source.task, source.attn_implementation)
    return adapter_shape(model, peft, base_bytes=4 if dtype in ("float32", "auto") else 2)


def _loss_kernel(kernel: str, run: Any, target: str) -> str:
    """--loss-kernel for a run config: refused by key where its objective or layout cannot take it (no
    saving counted for a combination `train` refuses); for a bare model, the kernel as asked."""
    from overdrive.config.loss_kernel import chosen

    if run is None:
        return chosen(kernel, target)
    from overdrive.resolving import validate_loss

    asked = run.model_copy(update={"training": run.training.model_copy(update={"loss_kernel": kernel})})
    blocker = validate_loss.kernel_blocker(asked)
    if blocker is not None and kernel in ("chunked", "fused"):
        by = "" if blocker[0] == "training.loss_kernel" else f" ({blocker[0]})"
        raise UserError(Problem("training.loss_kernel", f"--loss-kernel {kernel} does not compose with this run{by}: "
                                f"{blocker[1]}", fix="leave --loss-kernel out, or give full or auto"))
    return validate_loss.kernel_runs(asked, target)


def _target(args) -> str:
    if args.target != "auto":
        return args.target
    if args.gpu_memory:
        return "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run(args: argparse.Namespace) -> int:
    from overdrive.storage.faults import output_file
    from overdrive.memory import report

    if args.plot:
        args.plot = str(output_file(args.plot, "--plot", args.force, suffix=".png"))
    est, _ = build(args)
    cap = report.detect_capacity(args.gpu_memory, args.host_memory)
    best = report.apply_verdict(est, cap, nodes=args.nodes)
    if args.plot:
        report.plot(est, args.plot, cap)
    if args.json:
        print(report.to_json(est, cap, best))
    elif args.markdown:
        print(report.markdown(est, cap, best))
    else:
        report.render(est, cap, best)
        if args.plot:
            print(f"plot: {args.plot}")
    return 0
