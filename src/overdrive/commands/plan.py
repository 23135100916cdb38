"""`overdrive plan [CONFIG] [key=value ...]`: the run's arithmetic before anything launches.

Global batch, tokens per optimizer step, steps per epoch and in total (with the basis of
the data size), memory per device for the configured strategy (no weights loaded), and the
step time when an earlier run in the same output_dir measured throughput.
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="run YAML (default: the embedded default run)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as in train")
    parser.add_argument("--gpu-memory", type=float, metavar="GIB", help="plan for GPUs of this size")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _split(args) -> tuple[str | None, list[str]]:
    # `overdrive plan lr=3e-4` has no file: the first positional is then an override.
    if args.config and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def run(args: argparse.Namespace) -> int:
    from overdrive.memory import plan as arith
    from overdrive.memory import report
    from overdrive.memory.model_shape import load_run_config, run_estimate, run_shape
    from overdrive.training import metrics

    from overdrive.commands.estimate import check_memory_sizes

    check_memory_sizes(args)
    path, cli = _split(args)
    cfg = load_run_config(path, cli)
    micro = cfg.training.micro_batch_size
    micro_note = ""
    if not isinstance(micro, int):
        micro, micro_note = 1, " (micro_batch_size is auto: the tuner picks it; 1 shown)"
    tokenize = _tokenize_forecast(cfg)
    data = _data_size(cfg, tokenize)
    math_ = arith.arithmetic(cfg, data, micro)
    shape = run_shape(cfg)
    target = "cuda" if args.gpu_memory else ("cpu" if _cpu(cfg) else "cuda")
    est = run_estimate(cfg, target, shape, micro_batch=micro)
    cap = report.detect_capacity(args.gpu_memory)
    report.apply_verdict(est, cap)
    row = est.rows[0]
    speed = metrics.measured_throughput(cfg, micro)
    step_s = math_.tokens_per_step / speed.tokens_per_s if speed else None

    if args.json:
        print(json.dumps({
            "config": path, "world_size": math_.world, "micro_batch_size": micro,
            "gradient_accumulation_steps": math_.accumulation, "seq_len": math_.seq_len,
            "global_batch": math_.global_batch, "tokens_per_step": math_.tokens_per_step,
            "max_steps": math_.max_steps, "data_tokens": data.tokens, "data_basis": data.basis,
            "data_exact": data.exact, "train_tokens": math_.train_tokens, "steps_per_epoch": math_.steps_per_epoch,
            "epochs": math_.epochs, "parameters": shape.params, "memory": row.to_dict(),
            "capacity_bytes": cap.device_bytes, "capacity_source": cap.source,
            "tokens_per_s": speed.tokens_per_s if speed else None, "step_time_s": step_s,
            "total_time_s": step_s * math_.max_steps if step_s else None,
            "throughput_source": speed.path if speed else None,
            "tokenize": tokenize.to_dict() if tokenize else None,
        }, indent=2))
        return 0

    gib = report.gib
    lines = [
        f"model        {shape.name}: {shape.params:,} parameters, {shape.layers} layers x {shape.hidden} wide",
        f"batch        micro {micro} x accumulation {math_.accumulation} x world {math_.world} "
        f"= global batch {math_.global_batch} sequences{micro_note}",
        f"tokens/step  {math_.global_batch} x {math_.seq_len} = {math_.tokens_per_step:,} tokens per optimizer step",
        f"data         {_fmt(data.tokens)} tokens — {data.basis}",
    ]
    lines.append(_tokenize_line(cfg, tokenize))
    if math_.steps_per_epoch is not None:
        lines.append(f"steps        {math_.steps_per_epoch:,} per epoch (after the validation hold-out); "
                     f"max_steps {math_.max_steps:,} = {math_.epochs:.2f} epochs" if math_.epochs is not None else
                     "steps        fewer training tokens than one global batch: no full step per epoch")
    else:
        lines.append(f"steps        max_steps {math_.max_steps:,}; per epoch unknown (data size unknown)")
    lines.append(
        f"memory       {row.label} on {math_.world} device(s): {gib(row.total_bytes)} GiB per device "
        f"(params {gib(row.params_bytes)}, grads {gib(row.grads_bytes)}, optim {gib(row.optimizer_bytes)}, "
        f"master {gib(row.master_weights_bytes)}, activations {gib(row.activations_bytes)}, "
        f"buffers {gib(row.buffers_bytes)})" + (f" + {gib(row.host_bytes)} GiB host RAM" if row.host_bytes else ""))
    lines.append(f"             {'fits' if row.fits else 'does NOT fit'} in {cap.source} with 10% headroom"
                 f"{'' if row.fits else ' — see `overdrive estimate` for the strategies that do'}")
    if speed:
        caveat = "" if speed.same_shape else " (measured at a different world size, micro-batch or length)"
        lines.append(f"time         {speed.tokens_per_s:,.0f} tokens/s measured in {speed.path}{caveat}: "
                     f"{step_s:.3g} s per step, {_duration(step_s * math_.max_steps)} for {math_.max_steps:,} steps")
    else:
        lines.append(f"time         no measurement yet ({cfg.output_dir}/metrics.jsonl): train a few steps or run "
                     "`overdrive tune` to predict step time")
    print("\n".join(lines))
    return 0


def _tokenize_forecast(cfg):
    """Measured on a sample of this machine's data (data/estimate.py); None when it cannot be read."""
    from overdrive.data import estimate
    from overdrive.errors import UserError
    from overdrive.training.tokenizer import build_tokenizer, train_bpe

    try:
        return estimate.forecast(cfg, build_tokenizer, lambda texts: train_bpe(texts, cfg.tokenizer.vocab_size))
    except (UserError, OSError, ValueError) as error:  # the plan still stands without it
        return estimate.Forecast(note=f"not measured: {error}")


def _data_size(cfg, tokenize):
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


def _tokenize_line(cfg, tokenize) -> str:
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


def _cpu(cfg) -> bool:
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
