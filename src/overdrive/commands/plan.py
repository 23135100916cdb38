"""`overdrive plan [CONFIG] [key=value ...]`: the run's arithmetic before anything launches.

Global batch, tokens per optimizer step, steps per epoch and in total (with the basis of
the data size), memory per device for the configured strategy (no weights loaded), and the
step time when an earlier run in the same output_dir measured throughput.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overdrive.console import counted

import argparse
import json

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="run YAML (default: the embedded default run)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as in train")
    parser.add_argument("--gpu-memory", type=float, metavar="GIB", help="plan for GPUs of this size")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    from overdrive.commands.arguments import add_accelerate_default_argument

    add_accelerate_default_argument(parser)


def run(args: argparse.Namespace) -> int:
    from overdrive.memory import plan as arith
    from overdrive.memory import report
    from overdrive.memory.model_shape import run_estimate, run_shape
    from overdrive.resolving.inputs import resolve_items, split_items
    from overdrive.training import metrics

    from overdrive.commands.arguments import check_memory_sizes
    from overdrive.resolving.validate_model import explained
    from overdrive.strategies import layout

    check_memory_sizes(args)
    items = [*([args.config] if args.config else []), *args.overrides]
    # The rules of the model's config (positions, experts, heads against the layout) judged as explain and train judge them.
    cfg = resolve_items(items, accelerate_default=not args.no_accelerate_default, rules=explained).config
    path = next(iter(split_items(items)[0]), None)
    from overdrive import hub

    hub.refuse_unreadable_names(cfg)
    micro = cfg.training.micro_batch_size
    micro_note = ""
    if not isinstance(micro, int):
        micro, micro_note = 1, " (micro_batch_size is auto: the tuner picks it; 1 shown)"
    if cfg.data.sources:  # a mixture: each source measured on its own, the data is their sum
        tokenize, sizes = None, _source_sizes(cfg)
        known = [size.tokens for _, size in sizes]
        data = arith.DataSize(sum(known) if None not in known else None, "the sum of the sources below",
                              exact=all(size.exact for _, size in sizes))
    else:
        tokenize, sizes = _tokenize_forecast(cfg), []
        data = _data_size(cfg, tokenize)
    math_ = arith.arithmetic(cfg, data, micro)
    shape = run_shape(cfg)
    target = "cuda" if args.gpu_memory else ("cpu" if _cpu(cfg) else "cuda")
    est = run_estimate(cfg, target, shape, micro_batch=micro)
    cap = report.detect_capacity(args.gpu_memory)
    report.apply_verdict(est, cap)
    row = est.rows[0]
    from overdrive.checkpoint.room import planned

    room = planned(cfg, shape.params)
    speed = metrics.measured_throughput(cfg, micro)
    step_s = math_.tokens_per_step / speed.tokens_per_s if speed else None
    if cfg.training.num_epochs is not None and math_.steps_per_epoch:  # the steps the run will count
        from overdrive.config.length import derived

        cfg = derived(cfg, math_.steps_per_epoch * math_.global_batch, math_.global_batch)[0]
    curve = _lr_points(cfg)
    sources = _sources(cfg, sizes, math_)
    from overdrive.memory import pipeline as stage_memory

    stages = stage_memory.stages(cfg, shape, target) if cfg.parallel.pp_size > 1 else None
    if stages:  # the verdict of the layout asked: each stage rank against one device
        stages["fits"] = stage_memory.fits(stages, cap, report.HEADROOM, cfg.launch.num_processes // cfg.launch.num_machines)
    from overdrive.checkpoint.resume import describe_resume

    resume = describe_resume(cfg)  # what train does with output_dir's checkpoint, as train decides it

    if args.json:
        print(json.dumps({
            "config": path, "world_size": math_.world, "micro_batch_size": micro,
            "gradient_accumulation_steps": math_.accumulation, "seq_len": math_.seq_len,
            "global_batch": math_.global_batch, "tokens_per_step": math_.tokens_per_step,
            "max_steps": math_.max_steps, "max_steps_from": "training.num_epochs" if cfg.training.num_epochs else
            "training.max_steps", "warmup_steps": _warmup(cfg, math_.max_steps), "data_tokens": data.tokens,
            "data_basis": data.basis,
            "data_exact": data.exact, "train_tokens": math_.train_tokens, "steps_per_epoch": math_.steps_per_epoch,
            "epochs": math_.epochs, "samples_per_epoch": math_.samples, "samples_basis": data.samples_basis or None,
            "validation_held_out": math_.held_out, "parameters": shape.params, "active_parameters": shape.active_params,
            "memory": row.to_dict(),
            **({"vision": report.vision_fields(est)} if shape.parts else {}),
            "capacity_bytes": cap.device_bytes, "capacity_source": cap.source,
            "tokens_per_s": speed.tokens_per_s if speed else None, "step_time_s": step_s,
            "total_time_s": step_s * math_.max_steps if step_s else None,
            "throughput_source": speed.path if speed else None,
            "tokenize": tokenize.to_dict() if tokenize else None,
            "optimizer": _optimizer(cfg), "lr_points": [{"step": step + 1, "lr": lr} for step, lr in curve],
            "sources": sources,
            "layout": layout.summary(cfg), "pipeline": stages,
            "checkpoint_bytes": room.per_checkpoint, "checkpoint_bytes_measured": room.measured,
            "disk_free_bytes": room.free, "disk_warning": room.warning(), "resume": resume,
        }, indent=2))
        return 0

    gib = report.gib
    lines = [
        f"model        {shape.name}: {shape.params:,} parameters{_active(shape)}, {shape.layers} layers x "
        f"{shape.hidden} wide",
        f"batch        micro {micro} x accumulation {math_.accumulation} x "
        f"{'data-parallel' if layout.layout(cfg).has_axes else 'world'} {math_.world} "
        f"= global batch {math_.global_batch} sequences{micro_note}",
        f"tokens/step  {math_.global_batch} x {math_.seq_len} = {math_.tokens_per_step:,} tokens per optimizer step",
        *([f"layout       {layout.summary(cfg)['text']}"] if layout.layout(cfg).has_axes else []),
        f"data         {_fmt(data.tokens)} tokens — {data.basis}",
    ]
    lines.append(_tokenize_line(cfg, tokenize) if not sources else "tokenize     each source on its own (below)")
    if math_.steps_per_epoch is not None:
        lines.append(f"steps        {math_.steps_per_epoch:,} per epoch ({_epoch_basis(math_, data)}); "
                     f"max_steps {math_.max_steps:,} = {math_.epochs:.2f} epochs{_length_origin(cfg)}"
                     if math_.epochs is not None else
                     f"steps        fewer training samples ({_epoch_basis(math_, data)}) than one global batch of "
                     f"{math_.global_batch}: no full step per epoch")
    else:
        lines.append(f"steps        max_steps {math_.max_steps:,}; per epoch unknown (data size unknown)")
    for source in sources:
        draws = f"the run draws ~{source['samples_drawn']:,} samples = ~{source['tokens_drawn']:,} tokens"
        epochs = f" = {source['epochs']:.2f} epochs" if source["epochs"] is not None else ""
        lines.append(f"source       {source['name']} (weight {source['share']:.0%}): {_fmt(source['data_tokens'])} tokens "
                     f"({source['data_basis']}); {draws}{epochs}")
    lines.append(f"optimizer    {_optimizer(cfg)['title']}; optimizer state {_optimizer(cfg)['state']}")
    lines.append(f"lr           {cfg.scheduler.name}: " + ", ".join(f"step {step + 1}: {lr:.3g}" for step, lr in curve))
    if stages:
        largest = max(stages["ranks"], key=lambda r: r["total_bytes"])
        lines.append(f"memory       pipeline of {stages['pp_size']} stage ranks on "
                     f"{counted(cfg.launch.num_processes, 'device')}: the largest, pp rank {largest['pp_rank']}, "
                     f"{gib(largest['total_bytes'])} GiB per device (below)")
        lines.append(f"             {'fits' if stages['fits'] else 'does NOT fit'} in {cap.source} with 10% headroom"
                     f"{'' if stages['fits'] else ' — more stages (parallel.pp_size) or a smaller micro-batch'}")
    else:
        lines.append(
            f"memory       {row.label} on {counted(cfg.launch.num_processes, 'device')}: {gib(row.total_bytes)} GiB per "
            f"device (params {gib(row.params_bytes)}, grads {gib(row.grads_bytes)}, optim {gib(row.optimizer_bytes)}, "
            f"master {gib(row.master_weights_bytes)}, activations {gib(row.activations_bytes)}, "
            f"buffers {gib(row.buffers_bytes)})" + (f" + {gib(row.host_bytes)} GiB host RAM" if row.host_bytes else ""))
        lines.append(f"             {'fits' if row.fits else 'does NOT fit'} in {cap.source} with 10% headroom"
                     f"{'' if row.fits else ' — see `overdrive estimate` for the strategies that do'}")
    lines.extend(_stage_lines(stages, gib) if stages else [])
    if shape.parts:
        lines.append(f"vision       {report.vision_line(est).removeprefix('vision-language: ')}")
    if cfg.checkpoint.enabled:
        lines.append(f"disk         {room.summary()}")
        if room.warning():
            lines.append(f"             warning: {room.warning()}")
    if speed:
        caveat = "" if speed.same_shape else " (measured at a different world size, micro-batch or length)"
        lines.append(f"time         {speed.tokens_per_s:,.0f} tokens/s measured in {speed.path}{caveat}: "
                     f"{step_s:.3g} s per step, {_duration(step_s * math_.max_steps)} for {math_.max_steps:,} steps")
    else:
        lines.append(f"time         no measurement yet ({cfg.output_dir}/metrics.jsonl): train a few steps or run "
                     "`overdrive tune` to predict step time")
    if resume:
        lines.append(f"resume       {resume['text']}")
    print("\n".join(lines))
    return 0


def _epoch_basis(math_, data) -> str:
    """What an epoch's samples are counted from, and the hold-out only where the run has one."""
    held = f", after the {math_.held_out:.0%} validation hold-out" if math_.held_out and not data.samples_basis else ""
    basis = data.samples_basis or f"packed blocks of {math_.seq_len} tokens"
    return f"{math_.samples:,} samples: {basis}{held}"


def _stage_lines(stages: dict, gib) -> list[str]:
    lines = [f"pipeline     {stages['pp_size']} ranks x {stages['stages_per_rank']} stage(s), {stages['schedule']}, "
             f"{stages['microbatches']} microbatches of {stages['samples_per_microbatch']} samples: bubble "
             f"{stages['bubble_fraction']:.1%} of each step"]
    for r in stages["ranks"]:
        lines.append(f"             pp rank {r['pp_rank']} (stages {', '.join(map(str, r['stages']))}): "
                     f"{gib(r['total_bytes'])} GiB per device ({r['parameters']:,} parameters: weights, grads, optim "
                     f"{gib(r['model_state_bytes'])}; activations of {r['microbatches_in_flight']} microbatches in "
                     f"flight {gib(r['activations_bytes'])})")
    return lines


def _lr_points(cfg: RunConfig) -> list[tuple[int, float]]:
    from overdrive.training.build.optimization import lr_curve

    return lr_curve(cfg)


def _optimizer(cfg: RunConfig) -> dict:
    import overdrive.config.optimizer_catalog as optimizer_catalog

    kind = optimizer_catalog.of(cfg)
    title = f"{kind.title} ({cfg.optim.class_path})" if cfg.optim.class_path else kind.title
    return {"name": kind.name, "title": title, "state": kind.state_words}


def _source_sizes(cfg: RunConfig) -> list:
    """(source, DataSize) for each source of a mixture, from the forecast a single source gets."""
    from overdrive.data.mixing import source_configs

    return [(part, _data_size(part.cfg, _tokenize_forecast(part.cfg))) for part in source_configs(cfg)]


def _sources(cfg: RunConfig, sizes: list, math_) -> list[dict]:
    """Per source of a mixture: its size, its share, and what the run draws from it (samples,
    tokens, passes over it)."""
    total_weight = sum(part.weight for part, _ in sizes) or 1.0
    run_samples = math_.global_batch * math_.max_steps
    rows = []
    for part, size in sizes:
        share = part.weight / total_weight
        drawn = round(share * run_samples)
        samples = None
        if size.tokens is not None and cfg.model.task == "causal-lm":
            from overdrive.data.sources import holdout_fraction  # the rule the run splits by

            samples = int(size.tokens * (1 - holdout_fraction(part.cfg))) // math_.seq_len
        rows.append({"name": part.name, "share": share, "data_tokens": size.tokens, "data_basis": size.basis,
                     "samples": samples, "samples_drawn": drawn, "tokens_drawn": drawn * math_.seq_len,
                     "epochs": drawn / samples if samples else None})
    return rows


def _tokenize_forecast(cfg: RunConfig):
    """Measured on a sample of this machine's data (data/estimate.py); None when it cannot be read."""
    from overdrive.data import estimate
    from overdrive.errors import UserError
    from overdrive.training.build.tokenizer import build_tokenizer, train_bpe

    try:
        return estimate.forecast(cfg, build_tokenizer, lambda texts: train_bpe(texts, cfg.tokenizer.vocab_size))
    except UserError as error:
        # What train would refuse (a tokenizer it cannot read, data in a layout it does not take) is
        # refused here too, with the same exit code 2, rather than noted inline under a plan.
        if any(p.key in _NAMES or p.key.startswith(("data.", "tokenizer.")) for p in error.problems):
            raise
        return estimate.Forecast(note=f"not measured: {error}")
    except (OSError, ValueError) as error:  # the plan still stands without it
        return estimate.Forecast(note=f"not measured: {error}")


_NAMES = ("model.name_or_path", "model.revision", "tokenizer.name_or_path")


def _data_size(cfg: RunConfig, tokenize):

    from dataclasses import replace

    size = _token_size(cfg, tokenize)
    if tokenize and tokenize.samples is not None:  # samples counted as the run counts them, not from tokens
        return replace(size, samples=tokenize.samples, samples_basis=tokenize.samples_basis)
    return size


def _token_size(cfg: RunConfig, tokenize):
    from overdrive.memory import plan as arith

    est = tokenize.estimate if tokenize else None
    if tokenize and tokenize.cached_tokens:
        return arith.data_size(cfg, cached_tokens=tokenize.cached_tokens)
    if est is not None and est.tokens:
        where = "the standard-library .py files" if cfg.data.source == "stdlib" else cfg.data.source
        return arith.DataSize(est.tokens, f"estimate: {est.total_bytes:,} bytes of text in {where} / "
                              f"{est.bytes_per_token:.2f} "
                              f"bytes per token measured on a {est.sample_bytes / 1e6:.1f} MB sample")
    return arith.data_size(cfg)


def _tokenize_line(cfg: RunConfig, tokenize) -> str:
    if tokenize is None or (tokenize.estimate is None and not tokenize.cached_tokens):
        return f"tokenize     {tokenize.note if tokenize else 'not measured'}"
    if tokenize.cached_tokens:
        return f"tokenize     nothing to do: {tokenize.cached_tokens:,} token ids cached in {tokenize.entry}"
    est = tokenize.estimate
    bpe = (f", after ~{_duration(tokenize.tokenizer_seconds)} training the BPE on up to "
           f"{cfg.tokenizer.train_max_bytes / 1e6:,.0f} MB" if tokenize.tokenizer_seconds else "")
    if est.seconds is None:
        return (f"tokenize     {est.mb_per_s:.2f} MB/s measured on {est.sample_bytes / 1e6:.1f} MB "
                f"(total size unknown: a stream){bpe}")
    return (f"tokenize     {est.total_bytes / 1e6:,.0f} MB of text at {est.mb_per_s:.2f} MB/s (measured on "
            f"{est.sample_bytes / 1e6:.1f} MB, this machine as loaded now): ~{_duration(est.seconds)}{bpe}; "
            f"cache ~{est.cache_bytes / 1e6:,.0f} MB on disk under {cfg.data.cache_dir}/tokens")


def _cpu(cfg: RunConfig) -> bool:
    from overdrive.strategies.cpu import on_cpu

    return on_cpu(cfg)


def _fmt(value) -> str:
    return "unknown" if value is None else f"~{value:,}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _length_origin(cfg: RunConfig) -> str:
    t, s = cfg.training, cfg.scheduler
    text = f" (derived: training.num_epochs={t.num_epochs:g} x steps per epoch)" if t.num_epochs is not None else ""
    if s.warmup_ratio is not None:
        text += f"; warmup {_warmup(cfg, None)} steps (scheduler.warmup_ratio={s.warmup_ratio:g})"
    return text


def _warmup(cfg: RunConfig, max_steps) -> int:
    from overdrive.config.length import warmup_steps

    s = cfg.scheduler
    if s.warmup_ratio is None or cfg.training.num_epochs is None:
        return s.warmup_steps
    return warmup_steps(s.warmup_ratio, max_steps or cfg.training.max_steps)


def _active(shape) -> str:
    """A mixture of experts: the parameters one token meets (what MFU counts)."""
    if not shape.experts:
        return ""
    return f" ({shape.active_params:,} active: {shape.top_k} of {shape.experts} experts per token)"
