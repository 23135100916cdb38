"""The training loop, readable top to bottom.

`train(resolved)` settles the run config once (training/settle.py), builds everything from
it (accelerator, tokenizer, model, data, optimizer, schedule), then runs `training.max_steps`
optimizer steps (`_loop`, given one `Session`, returning an `Outcome`). Each optimizer
step is `training.gradient_accumulation_steps` micro-batches under
`accelerator.accumulate`; the loss is summed on the device and read (a host-device sync)
only at logging steps. Everything that says where the loop is lives in `LoopState`; the end
of each step is the one place where a checkpoint is taken (checkpoint/: atomic saves,
exact resume, stopping on SIGTERM), and a non-finite step is kept out of the weights by
nonfinite.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from overdrive import checkpoint, strategies
from overdrive import data as data_mod
from overdrive.training import model as model_mod
from overdrive.training import nonfinite
from overdrive.training import telemetry
from overdrive.training.evaluation import evaluate
from overdrive.config import batch
from overdrive.config.redact import redact
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError
from overdrive.strategies import registry
from overdrive.training.optimization import make_optimizer, make_scheduler
from overdrive.training.tokenizer import build_tokenizer


@dataclass
class LoopState:
    """Where the loop is: with model, optimizer, schedule and RNG states, a resumable point."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # passes over the training data started
    batch_in_epoch: int = 0  # micro-batches consumed in the current epoch (data position)
    tokens_seen: int = 0  # across all processes
    nonfinite_in_a_row: int = 0


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    first_loss: Optional[float] = None
    final_loss: Optional[float] = None
    eval: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0  # mean after the first logged step (which includes warm-up)
    elapsed_s: float = 0.0
    is_main_process: bool = True
    stopped_early: str = ""
    stopped_by: int = 0  # the signal (SIGTERM, SIGINT) that stopped the run after a checkpoint
    checkpoint: Optional[Path] = None  # the last checkpoint written or resumed from


# ---------------------------------------------------------------- setup

@dataclass
class Parts:
    accelerator: Any
    model: Any
    optimizer: Any
    scheduler: Any
    train_loader: Any
    eval_loader: Any
    tokenizer: Any
    flops_per_token: float
    peak: telemetry.DevicePeak
    seq_len: int


def _micro_batch(cfg: RunConfig) -> int:
    mbs = cfg.training.micro_batch_size
    if mbs == "auto":
        raise UserError(Problem("training.micro_batch_size", "`auto` must be resolved before the parts are built",
                                fix="train() resolves it (overdrive.training.autobatch); or set an integer"))
    return mbs


def _check_positions(config, seq_len: int) -> None:
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise UserError(Problem("data.max_length", f"{seq_len} is longer than the model's {limit} positions",
                                fix=f"set data.max_length <= {limit}"))


def build_parts(cfg: RunConfig, accelerator) -> Parts:
    """Tokenizer, model, data, optimizer and schedule, prepared by `accelerator`."""
    from accelerate.utils import set_seed

    t, d = cfg.training, cfg.data
    micro = _micro_batch(cfg)
    split = batch.split(cfg)
    cache_dir = Path(d.cache_dir).expanduser()
    # One process per machine trains the tokenizer and fills the token cache; the others wait
    # for those files (not in a barrier), then every process memory-maps the same token ids.
    tokenizer, tokens = data_mod.prepare(cfg, build_tokenizer, build=accelerator.is_local_main_process,
                                         show=accelerator.is_main_process and cfg.logging.level != "quiet")
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if cfg.model.task == "sequence-classification":
        # The classifier reads the last non-pad token. A causal LM gets no pad id: packed
        # blocks have no padding, and with pad == eos Transformers would warn on every batch.
        special["pad_token_id"] = tokenizer.pad_token_id
    set_seed(t.seed)  # same initial weights on every rank and every run
    model = model_mod.build_model(cfg, vocab_size=len(tokenizer), label_names=tokens.label_names,
                                  special_tokens=special)
    _check_positions(model.config, d.max_length)
    layers, width = model_mod.shape_of(model.config)
    fpt = telemetry.flops_per_token(model_mod.flop_params(model), layers, width, d.max_length)

    collate = data_mod.collate_for(cfg.model.task, tokenizer.pad_token_id)
    train_loader = data_mod.train_loader(tokens.train, split.micro, split.accumulation,
                                         split.data_parallel, t.seed, d.shuffle, d.num_workers,
                                         d.pin_memory, collate)
    eval_loader = None
    if tokens.validation is not None:
        # A fixed leading subset: evaluations are comparable across steps, and the loader is
        # always iterated to its end (leaving it early confuses Accelerate's end-of-data tracking).
        n = min(len(tokens.validation), t.eval_batches * micro * split.data_parallel)
        eval_loader = data_mod.eval_loader(torch.utils.data.Subset(tokens.validation, range(n)), micro,
                                           d.num_workers, d.pin_memory, collate)
    o, s = cfg.optim, cfg.scheduler
    optimizer = make_optimizer(model, o.lr, o.weight_decay, o.betas, o.eps, o.implementation, accelerator.device.type)
    scheduler = make_scheduler(optimizer, s.name, s.warmup_steps, t.max_steps, s.min_lr_ratio)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)
    model = _maybe_compile(model, cfg, accelerator)
    peak = telemetry.DevicePeak(accelerator.device, cfg.precision.mixed_precision, cache_dir)
    return Parts(accelerator, model, optimizer, scheduler, train_loader, eval_loader, tokenizer, fpt, peak,
                 d.max_length)


def _maybe_compile(model, cfg: RunConfig, accelerator):
    """torch.compile when `compile.backend` is set and the Accelerator has not already done it."""
    c = cfg.compile
    if not c.backend or accelerator.state.dynamo_plugin.backend.value.lower() != "no":
        return model
    return torch.compile(model, backend=c.backend, mode=c.mode, fullgraph=c.fullgraph, dynamic=c.dynamic)


# ---------------------------------------------------------------- the loop

def batches(loader, state: LoopState, skip_first_batches=None):
    """Micro-batches forever, epoch after epoch; keeps the data position in `state`.

    A resumed run starts inside an epoch: that epoch's loader skips the batches already
    trained on by index (nothing is loaded), so the order is the uninterrupted run's.
    """
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(state.epoch)
        epoch = loader
        if state.batch_in_epoch and skip_first_batches is not None:
            epoch = skip_first_batches(loader, state.batch_in_epoch)
        for batch in epoch:
            state.batch_in_epoch += 1
            yield batch
        state.epoch += 1
        state.batch_in_epoch = 0


def train(run, force: bool = False, observer=None) -> TrainResult:
    """Train as `run` says: a `Resolved` (config with provenance) or a RunConfig.

    With `checkpoint.resume=auto` it continues from the newest complete checkpoint in
    output_dir; `force` allows that even when the config changed the math since.
    `observer(output_dir, accelerator)` replaces the run's observer (observe/: step timers,
    heartbeats, stragglers): the profiler and the bench pass their own.
    """
    from overdrive.launch.process import build_accelerator
    from overdrive.training.settle import as_resolved, settle

    given = as_resolved(run).config  # output_dir, threads and trackers: settling changes none of them
    out = Path(given.output_dir).expanduser()
    if given.launch.threads_per_process:
        torch.set_num_threads(given.launch.threads_per_process)
    trackers = telemetry.resolve_trackers(given.logging.trackers)
    # The resume plan and the auto micro-batch, settled once into the config that runs.
    settled = settle(run, force, lambda cfg: build_accelerator(cfg, log_with=trackers or None, project_dir=str(out)))
    cfg, accelerator = settled.config, settled.accelerator
    main = accelerator.is_main_process
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "resolved.json").write_text(settled.resolved.to_json())
    parts = build_parts(cfg, accelerator)
    if trackers:  # the trackers' hyperparameters are files too: secrets masked
        accelerator.init_trackers(cfg.logging.project_name, config=telemetry.flat_config(redact(cfg.model_dump(mode="json"))))

    progress = telemetry.ProgressDisplay(cfg.training.max_steps, enabled=main and cfg.logging.level != "quiet",
                                         bar=cfg.logging.progress)
    progress.print(f"training: {cfg.model.task}, {cfg.training.max_steps} steps, output in {out}")
    metrics = telemetry.MetricsLog(out / "metrics.jsonl", enabled=main)
    ckpt = checkpoint.Checkpointer(cfg, accelerator, parts.scheduler, settled.plan, out / "metrics.jsonl",
                                   say=progress.print)
    state = LoopState()
    restored = ckpt.restore(state)
    from overdrive import observe

    watch = (observer or observe.for_run)(out, accelerator)
    watch.say = progress.print
    try:
        with checkpoint.StopRequest(checkpoint.cpu_group(), accelerator.num_processes) as stop, watch:
            outcome = _loop(Session(cfg, parts, state, restored, ckpt, stop, progress, metrics, watch))
    finally:
        progress.close()
    result = TrainResult(out, state.step, is_main_process=main, **vars(outcome))
    if not result.stopped_by:  # a stopped run is not finished: its checkpoint is the result
        _save_final(cfg, parts, out)
    accelerator.end_training()
    return result


@dataclass
class Session:
    """What the loop works with, built by train() before the first step."""

    cfg: RunConfig
    parts: Parts
    state: LoopState
    restored: "checkpoint.Restored"
    ckpt: "checkpoint.Checkpointer"
    stop: "checkpoint.StopRequest"
    progress: "telemetry.ProgressDisplay"
    metrics: "telemetry.MetricsLog"
    observe: Any = None  # observe.RunObserver: where each step's time goes, heartbeats


@dataclass
class Outcome:
    """What the loop found out; train() turns it into the TrainResult."""

    first_loss: Optional[float] = None
    final_loss: Optional[float] = None
    eval: dict[str, float] = field(default_factory=dict)
    stopped_early: str = ""
    stopped_by: int = 0
    checkpoint: Optional[Path] = None
    tokens_per_s: float = 0.0
    elapsed_s: float = 0.0


def _loop(run: Session) -> Outcome:
    cfg, parts, state, progress, metrics, obs = run.cfg, run.parts, run.state, run.progress, run.metrics, run.observe
    t, acc, model, optimizer, scheduler = cfg.training, parts.accelerator, parts.model, parts.optimizer, parts.scheduler
    world = acc.num_processes
    data = batches(parts.train_loader, state, acc.skip_first_batches)
    throughput = telemetry.Throughput()
    # Summed on the device: no sync per step. A resume carries on the interval being summed.
    loss_sum = torch.full((), run.restored.pending_loss, device=acc.device)
    micro_steps = run.restored.pending_micro_steps
    guard = nonfinite.NonfiniteGuard(t.nonfinite_loss, optimizer, acc.device, scaler=acc.scaler,
                                     deepspeed=registry.of(cfg).engine_steps_optimizer,
                                     dynamic_loss_scale=strategies.loss_scaler_owns_overflows(cfg))
    guard.restore(state.nonfinite_in_a_row)
    outcome = Outcome(run.restored.extra.get("first_loss"), run.restored.extra.get("final_loss"),
                      checkpoint=run.restored.path)
    grad_norm = None
    after_first = None  # (time, tokens) at the first log: steady-state throughput starts there
    model.train()
    obs.watch(model)
    while state.step < t.max_steps:
        lr = scheduler.get_last_lr()[0]  # the lr this optimizer step uses
        for _ in range(t.gradient_accumulation_steps):
            obs.enter("data")
            batch = next(data)
            with acc.accumulate(model):
                obs.enter("forward")
                loss = model(**batch).loss
                obs.enter("backward")
                acc.backward(loss)  # Accelerate divides by the accumulation steps: the mean of means
                obs.enter("optimizer")
                if acc.sync_gradients and (t.gradient_clipping is not None or guard.needs_norm):
                    # Clipping to infinity measures the norm (over all ranks) and changes nothing.
                    grad_norm = acc.clip_grad_norm_(model.parameters(), t.gradient_clipping or math.inf)
                    guard.check(grad_norm)  # a non-finite norm: this step will not touch the weights
                if guard.allows_step():
                    optimizer.step()  # a no-op until the last micro-batch of the accumulation
                optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach().float()
            micro_steps += 1
            tokens = batch["input_ids"].numel() * world  # shapes are host-side: no sync
            throughput.add(tokens)
            state.tokens_seen += tokens
        if not acc.sync_gradients:
            raise RuntimeError("accumulation out of step with the data: optimizer did not step")
        if not acc.optimizer_step_was_skipped:  # fp16 overflow skips a step; the schedule waits too
            scheduler.step()
        else:
            guard.scaler_skipped()  # reported as such at the next log, not as a bad loss
        state.step += 1
        obs.step_done(state.step)
        progress.step(state.step)

        if state.step == 1 or state.step % t.log_every_steps == 0 or state.step == t.max_steps:
            # The one sync point of the loop: read the loss accumulated since the last log.
            obs.enter("sync")
            loss_value = acc.reduce(loss_sum / micro_steps, "mean").item()
            loss_sum.zero_()
            micro_steps = 0
            counts = guard.read()  # steps skipped since the last log
            state.nonfinite_in_a_row = counts.in_a_row
            record = {**_train_record(cfg, parts, state, loss_value, lr, throughput.read(), grad_norm),
                      **counts.record(), "elapsed_s": throughput.elapsed(), **obs.fields()}
            if counts.note(state.step):
                progress.print(counts.note(state.step))
            metrics.write(record)
            acc.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"},
                    step=state.step)
            progress.log(state.step, record)
            outcome.first_loss = loss_value if outcome.first_loss is None else outcome.first_loss
            outcome.final_loss = loss_value
            if after_first is None:
                after_first = (time.perf_counter(), state.tokens_seen)
            outcome.stopped_early = counts.verdict(t.nonfinite_loss, t.max_nonfinite_in_a_row, loss_value, state.step)
            if outcome.stopped_early:
                progress.print(f"stopping: {outcome.stopped_early}")

        if parts.eval_loader is not None and t.eval_every_steps and state.step % t.eval_every_steps == 0 \
                and state.step < t.max_steps and not outcome.stopped_early:
            obs.enter("eval")
            outcome.eval = _eval_and_log(run)

        # Save point: (model, optimizer, schedule, RNG, LoopState) when due, and before any stop.
        # Every rank asks whether any rank got SIGTERM/SIGINT, so all stop after the same step.
        obs.enter("sync")
        signum = run.stop.agreed()
        if run.ckpt.due(state.step, stopping=bool(signum or outcome.stopped_early)):
            obs.enter("checkpoint")
            state.nonfinite_in_a_row = guard.run_length()
            outcome.checkpoint = run.ckpt.save(state, loss_sum, micro_steps,
                                               {"first_loss": outcome.first_loss, "final_loss": outcome.final_loss})
            progress.print(f"checkpoint: {outcome.checkpoint}")
        if signum:
            outcome.stopped_by = signum
            progress.print(f"stopping after step {state.step}: received {checkpoint.signal_name(signum)}")
        if signum or outcome.stopped_early:
            break

    outcome.elapsed_s = throughput.elapsed()
    if after_first is not None and state.step > 1:
        seconds = time.perf_counter() - after_first[0]
        outcome.tokens_per_s = (state.tokens_seen - after_first[1]) / max(seconds, 1e-9)
    if parts.eval_loader is not None and not outcome.stopped_by:
        outcome.eval = _eval_and_log(run)
    return outcome


def _train_record(cfg: RunConfig, parts: Parts, state: LoopState, loss: float, lr: float, tokens_per_s: float,
                  grad_norm) -> dict[str, Any]:
    acc = parts.accelerator
    per_device = tokens_per_s / acc.num_processes
    mfu = parts.peak.mfu(parts.flops_per_token * per_device)
    return {
        "step": state.step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s, "seq_len": parts.seq_len,
        "micro_batch_size": cfg.training.micro_batch_size, "gradient_accumulation_steps":
        cfg.training.gradient_accumulation_steps, "num_processes": acc.num_processes,
        "mixed_precision": cfg.precision.mixed_precision, "mfu": mfu,
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "tokens": state.tokens_seen, "epoch": state.epoch,
        "peak_memory_mb": telemetry.peak_memory_mb(acc.device), "time": time.time(),
    }


def _eval_and_log(run: Session) -> dict[str, float]:
    values = evaluate(run.parts, run.cfg.model.task)
    run.metrics.write({"step": run.state.step, **values, "time": time.time()})
    run.parts.accelerator.log(values, step=run.state.step)
    run.progress.log(run.state.step, values)
    return values


def _save_final(cfg: RunConfig, parts: Parts, out: Path) -> None:
    """The trained model and tokenizer as a `save_pretrained` directory: out/model."""
    acc = parts.accelerator
    acc.wait_for_everyone()
    if not cfg.checkpoint.save_final_model:
        return
    # Every rank takes part: under ZeRO-3 or FSDP the full weights are gathered from shards.
    state_dict = acc.get_state_dict(parts.model)
    if acc.is_main_process:
        from transformers.utils import logging as hf_logging

        target = out / "model"
        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar is only noise
        try:
            acc.unwrap_model(parts.model).save_pretrained(target, state_dict=state_dict, save_function=acc.save)
            parts.tokenizer.save_pretrained(target)
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()
    acc.wait_for_everyone()

