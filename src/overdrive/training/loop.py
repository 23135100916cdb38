"""The training loop, readable top to bottom.

`train(resolved)` settles the run config once (training/build/settle.py), builds everything from
it (training/build/parts.py: accelerator, tokenizer, model, data, optimizer, schedule), then runs
`training.max_steps` optimizer steps. The outer loop (`_steps`) is short: each pass calls the
named steps, each with its own "due":

    optimizer_step   the step composed of its pieces (parts.py builds them): the objective's loss
                     (objective.py) of the split's micro-batches, run by the forward-backward
                     (forward_backward.py, or the pipeline's schedule), wrapped by the strategy;
                     the books kept here once (step_loss.py's counts, clipping, the optimizer)
    log_point        every `training.log_every_steps`: the one host-device sync, metrics.jsonl
    evaluate         every `training.eval_every_steps`
    save             checkpoint/: every `checkpoint.every_steps`, at the end, before any stop

Where the loop is lives in one `LoopState`, which the checkpoint saves and restores whole;
a non-finite step is kept out of the weights by nonfinite.py, a loss spike by loss_spikes.py, and
an out-of-memory step is redone at a smaller micro-batch when oom_retry.py decides so (the loop
applies the decision: `_redo_at`).
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

from overdrive import checkpoint
from overdrive.console import counted
import overdrive.config.batch as batch
from overdrive.config import fault_injection
from overdrive.config.provenance import Origin
from overdrive.config.redact import redact
from overdrive.config.schema import RunConfig
from overdrive.storage import faults
from overdrive.strategies import registry
from overdrive.training import telemetry
from overdrive.training.step import context_parallel, step_loss
from overdrive.training.guards import loss_scale, loss_spikes, nonfinite, oom_retry
from overdrive.training import benchmark_eval
from overdrive.training.step.loss_tokens import LossTokens
from overdrive.training.loop_state import LoopState, Outcome, StepMark, TrainResult, batches  # noqa: F401
# (LoopState, TrainResult and batches are asked for here too)
from overdrive.training.build.parts import Parts, build_parts, save_final


def train(run, force: bool = False, observer=None) -> TrainResult:
    """Train as `run` says: a `Resolved` (config with provenance) or a RunConfig.

    With `checkpoint.resume=auto` it continues from the newest complete checkpoint in
    output_dir; `force` allows that even when the config changed the math since.
    `observer(output_dir, accelerator)` replaces the run's observer (observe/: step timers,
    heartbeats, stragglers): the profiler and the bench pass their own.
    """
    from overdrive.launch.process import build_accelerator
    from overdrive.training.build.settle import as_resolved, settle

    from overdrive.launch.process import quiet_deprecated_collectives

    quiet_deprecated_collectives()
    given = as_resolved(run).config  # output_dir, threads and trackers: settling changes none of them
    out = Path(given.output_dir).expanduser()
    if given.launch.threads_per_process:
        torch.set_num_threads(given.launch.threads_per_process)
    trackers = telemetry.resolve_trackers(given.logging.trackers)
    # The batch split, the resume plan and the auto micro-batch, settled once into the config that runs.
    settled = settle(run, force, lambda cfg: build_accelerator(cfg, log_with=trackers or None, project_dir=str(out)))
    cfg, accelerator = settled.config, settled.accelerator
    main = accelerator.is_main_process
    if main:
        out.mkdir(parents=True, exist_ok=True)
        faults.write_text(out / "resolved.json", settled.resolved.to_json(), "output_dir")
    from overdrive.training.build.startup import Stages

    say = Stages(main and cfg.logging.level != "quiet")  # each stage before the first step, as it begins
    parts = build_parts(cfg, accelerator, say=say)
    if parts.derived:  # steps counted from the data (training.num_epochs): the config that runs, recorded
        cfg = parts.config
        origins = {**settled.resolved.origins, **{key: Origin("derived", why) for key, why in parts.derived.items()}}
        settled = replace(settled, resolved=replace(settled.resolved, config=cfg, origins=origins))
        if main:
            faults.write_text(out / "resolved.json", settled.resolved.to_json(), "output_dir")
    if trackers:  # the trackers' hyperparameters are files too: secrets masked
        accelerator.init_trackers(cfg.logging.project_name, config=telemetry.flat_config(redact(cfg.model_dump(mode="json"))))

    progress = telemetry.ProgressDisplay(cfg.training.max_steps, enabled=main and cfg.logging.level != "quiet",
                                         bar=cfg.logging.progress)
    progress.print(f"training: {parts.objective.name}, {counted(cfg.training.max_steps, 'step')}, output in {out}")
    for note in parts.notes:
        progress.print(note)
    metrics = telemetry.MetricsLog(out / "metrics.jsonl", enabled=main)
    ckpt = checkpoint.Checkpointer(cfg, accelerator, parts.scheduler, settled.plan, out / "metrics.jsonl",
                                   say=progress.print)
    if parts.pipeline is not None:  # the stages are this rank's, not Accelerate's: checkpoint/pipeline_state.py
        ckpt.stages = (parts.pipeline, parts.model, parts.optimizer)
    state = LoopState()
    restored = ckpt.restore(state)
    from overdrive import observe

    watch = (observer or observe.for_run)(out, accelerator)
    watch.say = progress.print
    try:
        with checkpoint.StopRequest(checkpoint.cpu_group(), accelerator.num_processes) as stop, watch:
            if main:  # answered at once, not when the step and its checkpoint are done
                _answer_signals(stop, state, cfg, out)
            loop = Loop(cfg, parts, state, ckpt, stop, progress, metrics, checkpoint=restored.path, observe=watch)
            if main:  # the step the run will stop after, as the loop stands when the signal comes
                stop.answer = lambda signum: checkpoint.stopping_note(signum, loop.stop_step(), cfg.checkpoint.enabled)
            loop.on_new_config = lambda cfg: _record_split(settled, cfg, out, main)
            outcome = _steps(loop)
        if not outcome.stopped_by:  # a stopped run is not finished: its checkpoint is the result
            save_final(cfg, parts, out)
            loop.closing_evaluation()  # after the save: an evaluation that fails never costs the model
    finally:
        progress.close()
    result = TrainResult(out, state.step, state.first_loss, state.final_loss, is_main_process=main, **vars(outcome))
    accelerator.end_training()
    return result


def _record_split(settled, cfg: RunConfig, out: Path, main: bool) -> None:
    """resolved.json after training.oom_retry changed the split: the config that now runs."""
    if main:
        faults.write_text(out / "resolved.json", oom_retry.recorded(settled.resolved, cfg).to_json(), "output_dir")


def _answer_signals(stop: "checkpoint.StopRequest", state: "LoopState", cfg: RunConfig, out: Path) -> None:
    def kept() -> str:
        found = checkpoint.latest_complete(checkpoint.checkpoints_dir(out), checksums=False).found
        return checkpoint.kept_note(found.path if found else None)

    stop.answer = lambda signum: checkpoint.stopping_note(signum, state.step + 1, cfg.checkpoint.enabled)
    stop.abandon = kept


def _steps(loop: "Loop") -> Outcome:
    """The outer loop: the named steps, each when it is due."""
    loop.parts.model.train()
    loop.parts.recipe.train_mode()
    loop.observe.watch(loop.parts.model)
    while loop.state.step < loop.cfg.training.max_steps:
        if loop.exhausted():  # a resumed run whose mixture had already run out
            break
        loop.optimizer_step()
        loop.step_done = True  # a stop signal from here to the agreement below stops after this step
        if loop.log_due():
            loop.log_point()
        if loop.eval_due():
            loop.observe.enter("eval")
            loop.evaluate()
        loop.exhausted()
        # Every rank asks whether any rank got SIGTERM/SIGINT, so all stop after the same step.
        loop.observe.enter("sync")
        loop.step_done = False  # from here, a signal is counted at the next step's agreement
        signum = loop.stop.agreed()
        if loop.ckpt.due(loop.state.step, stopping=bool(signum or loop.outcome.stopped_early)):
            loop.observe.enter("checkpoint")
            loop.save()
        if signum:
            loop.stopped_by(signum)
        if signum or loop.outcome.stopped_early:
            break
        fault_injection.freeze_after(loop.injection, loop.state.step)
    loop.ckpt.wait()  # checkpoint.async: the last save sealed before the run ends
    return loop.finish()


class Loop:
    """What the steps work with, built by train() before the first step, and the steps."""

    def __init__(self, cfg: RunConfig, parts: Parts, state: LoopState, ckpt: "checkpoint.Checkpointer",
                 stop: "checkpoint.StopRequest", progress: "telemetry.ProgressDisplay",
                 metrics: "telemetry.MetricsLog", checkpoint: Optional[Path] = None, observe: Any = None):
        self.cfg, self.parts, self.state, self.ckpt, self.stop = cfg, parts, state, ckpt, stop
        self.observe = observe  # observe.RunObserver: where each step's time goes, the heartbeat
        self.progress, self.metrics = progress, metrics
        acc, t = parts.accelerator, cfg.training
        self.split = batch.split(cfg)
        self.model_parallel = max(acc.num_processes // self.split.data_parallel, 1)  # ranks sharing one batch
        self.cp = context_parallel.cp_size(cfg)  # ranks that each take a slice of every sequence
        self.data = batches(parts.train_loader, state, acc.skip_first_batches)
        self.throughput = telemetry.Throughput()
        state.loss_sum = torch.full((), float(state.loss_sum), device=acc.device)
        self.loss_tokens = LossTokens(acc.device, state.loss_tokens if acc.is_main_process else 0)
        strategy = registry.of(cfg)
        self.guard = nonfinite.NonfiniteGuard(t.nonfinite_loss, parts.optimizer, acc.device, scaler=acc.scaler,
                                              deepspeed=strategy.engine_steps_optimizer,
                                              dynamic_loss_scale=strategy.skips_overflowing_steps(cfg))
        self.guard.restore(state.nonfinite_in_a_row)
        self.scale_watch = loss_scale.ScaleWatch(acc.scaler)  # fp16: skips a fused optimizer hides from Accelerate
        self.outcome = Outcome(checkpoint=checkpoint)
        # What a long run looks after itself (training.loss_spike, training.oom_retry, their test hooks).
        self.injection = fault_injection.from_environment()
        self.spikes = loss_spikes.LossSpikes(cfg, acc, state, self.injection, max(self.model_parallel // self.cp, 1),
                                             measure=parts.objective.spike_measure)
        self.oom = oom_retry.OomRetry(cfg, acc, self.injection)
        parts.objective.guard_alone = self.oom.alone  # an online objective's sampling, agreed on when it fails
        self.on_new_config: Any = lambda cfg: None  # train() records the config a redo changed (resolved.json)
        ckpt.stall_at = self.injection.stall_step
        self.grad_norm = None
        self.lr = 0.0
        self.after_first: Optional[tuple[float, int]] = None  # (time, tokens) at the first log: steady state
        parts.objective.restore(state.preference_pending)
        benchmark_eval.check(cfg)  # eval.tasks: lm-eval and every task known, before the first step
        note = parts.recipe.check_resumed(state)
        if note:
            progress.print(note)

    # -------------------------------------------------------------- the optimizer step

    step_done = False  # between a step's end and the ranks' agreement on stopping (_steps)

    def stop_step(self) -> int:
        """The step a stop signal received now stops after: this one when it has ended and the ranks have
        not yet agreed, else the one in progress (or the next)."""
        return self.state.step if self.step_done else self.state.step + 1

    def optimizer_step(self) -> None:
        """One optimizer step: the objective's loss of the step's micro-batches, run by the
        forward-backward, then the books (the optimizer update at the last micro-batch, the schedule);
        redone at a smaller micro-batch when it runs out of memory (training.oom_retry)."""
        while True:
            mark = StepMark.of(state=self.state, loss_tokens=self.loss_tokens.count, objective=self.parts.objective,
                               needed=self.oom.enabled)
            redo = self.oom.attempt(self._optimizer_step, self.split, self.state.step + 1)
            if redo is None:
                return
            self._redo_at(redo, mark)

    def _redo_at(self, redo: "oom_retry.Redo", mark: StepMark) -> None:
        """training.oom_retry's decision applied: what the failed step held dropped, the loop put
        back where the step began, and the split changed (the global batch kept), so the step is
        redone over the same samples as a run started at the new split takes them."""
        acc, state, before = self.parts.accelerator, self.state, self.split.micro
        self.parts.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        mark.put_back(state, self.loss_tokens.count, self.parts.objective)
        state.batch_in_epoch = mark.batch_in_epoch * (before // redo.micro)  # the same samples, in the new units
        self.spikes.rewind()
        t = self.cfg.training
        self.cfg = self.cfg.model_copy(update={"training": t.model_copy(update={
            "micro_batch_size": redo.micro, "gradient_accumulation_steps": redo.accumulation})})
        self.split, self.ckpt.cfg = batch.split(self.cfg), self.cfg  # what every later step and save reads
        self.data = batches(self.parts.resplit(self.split), state, acc.skip_first_batches)
        acc.gradient_accumulation_steps = redo.accumulation
        acc.step = 0  # Accelerate counts micro-batches to the accumulation's end: the step starts again
        self.on_new_config(self.cfg)
        step = state.step + 1
        self.progress.print(f"step {step}: out of memory at micro-batch {before}; redoing it at micro-batch "
                            f"{redo.micro} x accumulation {redo.accumulation} (the same global batch; training.oom_retry)")
        self.metrics.write({"step": step, "oom_retry": self.oom.retries, "micro_batch_size": redo.micro,
                            "gradient_accumulation_steps": redo.accumulation, "time": time.time()})

    def _optimizer_step(self) -> None:
        acc, state = self.parts.accelerator, self.state
        self.lr = self.parts.scheduler.get_last_lr()[0]  # the lr this optimizer step uses
        self.scale_watch.before_step()
        self.observe.enter("data")
        # The step's micro-batches drawn ahead: the loss is normalised by the global batch's units
        # (loss tokens, pairs), counted over every rank before context parallel shards the
        # sequences, ahead of the first forward (step_loss.py).
        objective = self.parts.objective
        drawn = [next(self.data) for _ in range(self.split.accumulation)]
        micro_batches = self.spikes.injected(objective, objective.prepare(self.parts.model, drawn), state.step + 1)
        totals = step_loss.global_counts(acc, micro_batches, self.model_parallel, objective.counts)
        loss = self.parts.forward_backward(self, micro_batches, totals)  # the step's gradients, whole
        self.observe.enter("optimizer")
        self.optimizer_update()
        state.loss_sum += loss
        state.micro_steps += len(micro_batches)
        tokens = sum(b["input_ids"].numel() for b in micro_batches) * self.split.data_parallel  # host-side shapes
        if self.parts.counts_loss_tokens:
            for micro_batch in micro_batches:
                self.loss_tokens.add(micro_batch)
        self.throughput.add(tokens)
        state.tokens_seen += tokens
        if self.spikes.skipped:  # a loss spike (loss_spikes.py): the schedule waits with the weights
            pass
        elif not self.scale_watch.skipped(acc):  # fp16 overflow skips a step; the schedule waits too
            self.parts.scheduler.step()
        else:
            self.guard.scaler_skipped()  # reported as such at the next log, not as a bad loss
        state.step += 1
        self.spikes.after_step(self)
        self.observe.step_done(state.step)
        self.progress.step(state.step)

    def optimizer_update(self) -> None:
        """Once the step's gradients are whole: the norm (clipped when asked), the guards'
        decisions (non-finite, loss spike), the optimizer."""
        clipping = self.cfg.training.gradient_clipping
        if clipping is not None or self.guard.needs_norm or self.spikes.needs_norm:
            # Clipping to infinity measures the norm (over all ranks) and changes nothing.
            self.grad_norm = self.parts.clip_grad_norm(clipping or math.inf)
            self.guard.check(self.grad_norm)  # a non-finite norm: this step will not touch the weights
        if self.spikes.allows_step(self.grad_norm) and self.guard.allows_step():  # loss_spikes.py judges before the step
            self.parts.optimizer.step()
        self.parts.optimizer.zero_grad(set_to_none=True)

    # -------------------------------------------------------------- the log point

    def log_due(self) -> bool:
        step, t = self.state.step, self.cfg.training
        return step == 1 or step % t.log_every_steps == 0 or step == t.max_steps

    def log_point(self) -> None:
        """The one sync point of the loop: read the loss accumulated since the last log."""
        acc, state = self.parts.accelerator, self.state
        self.observe.enter("sync")
        # Each rank holds its share of each step's mean; the ranks of a tensor-parallel group the same
        # share, those of a context-parallel group a share each of their slices.
        steps = max(state.micro_steps // self.split.accumulation, 1)
        sharing = max(self.model_parallel // self.cp, 1)
        loss_value = acc.reduce(state.loss_sum.clone(), "sum").item() / sharing / steps
        state.loss_sum.zero_()
        state.micro_steps = 0
        counts = self.guard.read()  # steps skipped since the last log
        state.nonfinite_in_a_row = counts.in_a_row
        record = {**self._record(loss_value), **counts.record(), **self.spikes.record(),
                  "elapsed_s": self.throughput.elapsed(), "loss_tokens": self.loss_tokens.read(acc),
                  **self.observe.fields(), **self.parts.peak.fields(), **self.parts.objective.read()}
        record["loss_tokens_per_s"] = self.throughput.rate_of(record["loss_tokens"])
        if counts.note(state.step):
            self.progress.print(counts.note(state.step))
        self.metrics.write(record)
        acc.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}, step=state.step)
        self.progress.log(state.step, record)
        state.first_loss = loss_value if state.first_loss is None else state.first_loss
        state.final_loss = loss_value
        if self.after_first is None:
            self.after_first = (time.perf_counter(), state.tokens_seen)
        t = self.cfg.training
        self.outcome.stopped_early = self.outcome.stopped_early or counts.verdict(
            t.nonfinite_loss, t.max_nonfinite_in_a_row, loss_value, state.step)
        if self.outcome.stopped_early:
            self.progress.print(f"stopping: {self.outcome.stopped_early}")

    def _record(self, loss: float) -> dict[str, Any]:
        parts, state, acc = self.parts, self.state, self.parts.accelerator
        tokens_per_s = self.throughput.read()
        mfu = parts.peak.mfu(parts.flops_per_token * tokens_per_s / acc.num_processes)
        return {
            "step": state.step, "loss": loss, "lr": self.lr, "tokens_per_s": tokens_per_s, "seq_len": parts.seq_len,
            "micro_batch_size": self.split.micro, "gradient_accumulation_steps": self.split.accumulation,
            "num_processes": acc.num_processes, "mixed_precision": self.cfg.precision.mixed_precision, "mfu": mfu,
            "grad_norm": float(self.grad_norm) if self.grad_norm is not None else None,
            "tokens": state.tokens_seen, "epoch": state.epoch, "source_tokens": parts.recipe.source_tokens(state),
            "peak_memory_mb": telemetry.peak_memory_mb(acc.device), "time": time.time(),
        }

    # -------------------------------------------------------------- evaluation

    def eval_due(self) -> bool:
        step, t = self.state.step, self.cfg.training
        return (self._evaluates() and bool(t.eval_every_steps) and step % t.eval_every_steps == 0
                and step < t.max_steps and not self.outcome.stopped_early)

    def _evaluates(self) -> bool:
        """A validation split, or benchmarks and sample answers (eval.*), to evaluate on."""
        return self.parts.eval_loader is not None or benchmark_eval.wanted(self.cfg)

    def evaluate(self) -> None:
        self.parts.recipe.eval_mode()  # a schedule-free optimizer is evaluated at its averaged point
        values = (self.parts.objective.evaluate(self.parts.model, self.parts.eval_loader, self.parts.accelerator)
                  if self.parts.eval_loader is not None else {})
        values.update(benchmark_eval.at_eval(self.cfg, self.parts, self.state.step, self.progress.print))
        self.parts.recipe.train_mode()
        self.metrics.write({"step": self.state.step, **values, "time": time.time()})
        self.parts.accelerator.log(values, step=self.state.step)
        self.progress.log(self.state.step, values)
        self.outcome.eval = values

    # -------------------------------------------------------------- saving and stopping

    def save(self) -> None:
        """(model, optimizer, schedule, RNG, LoopState), due by the checkpointer's rule."""
        self.state.nonfinite_in_a_row = self.guard.run_length()
        self.state.source_positions = self.parts.recipe.positions(self.state)
        self.state.loss_tokens = self.loss_tokens.total(self.parts.accelerator)
        self.state.preference_pending = self.parts.objective.pending()
        self.parts.recipe.eval_mode()  # a schedule-free optimizer saves its averaged point
        self.outcome.checkpoint = self.ckpt.save(self.state)
        self.parts.recipe.train_mode()
        if not self.ckpt.in_background:  # checkpoint.async: the path is said when the write is complete (wait)
            self.progress.print(f"checkpoint: {self.outcome.checkpoint}")

    def exhausted(self) -> bool:
        """A mixture told to stop when a source runs out (data.when_exhausted=stop) has."""
        if not self.outcome.stopped_early:
            self.outcome.stopped_early = self.parts.recipe.exhausted(self.state) or ""
            if self.outcome.stopped_early:
                self.progress.print(f"stopping: {self.outcome.stopped_early}")
        return bool(self.outcome.stopped_early)

    def stopped_by(self, signum: int) -> None:
        self.outcome.stopped_by = signum
        self.progress.print(f"stopping after step {self.state.step}: received {checkpoint.signal_name(signum)}")

    def finish(self) -> Outcome:
        """Throughput over the steady state (the closing evaluation follows the final save)."""
        outcome, state = self.outcome, self.state
        outcome.elapsed_s = self.throughput.elapsed()
        if self.after_first is not None and state.step > 1:
            seconds = time.perf_counter() - self.after_first[0]
            outcome.tokens_per_s = (state.tokens_seen - self.after_first[1]) / max(seconds, 1e-9)
        return outcome

    def closing_evaluation(self) -> None:
        """The evaluation at the end of a run, on the saved model. A failure (a task's data set, lm-eval,
        a user's task code) is recorded in the outcome, said by `train`, and the run exits non-zero;
        the model written just before stays."""
        if not self._evaluates():
            return
        try:
            self.evaluate()
        except Exception as error:  # noqa: BLE001  (whatever the evaluation raised: the model is kept)
            self.outcome.eval_failed = benchmark_eval.failure_note(error, Path(self.cfg.output_dir).expanduser())
