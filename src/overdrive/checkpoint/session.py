"""Saving and resuming a training run through `accelerator.save_state` / `load_state`.

What a checkpoint holds, and who writes it:

- `accelerator.save_state`: the model, the optimizer, the learning-rate schedule
  (registered with `register_for_checkpointing`), the fp16 loss scaler, and every rank's
  RNG states (`random_states_<rank>.pkl`: python, numpy, torch, cuda). Under DeepSpeed and
  FSDP (sharded state dict) every rank writes its own shard.
- `trainer_state.json` (main process): the loop position (`LoopState`), the data position
  as samples consumed in the current epoch (so a different world size can find it), the
  loss accumulated since the last log on every rank, the size metrics.jsonl had, and the
  whole config with its fingerprint.

The data position is restored by the sampler: each epoch's order depends only on the seed
and the epoch number (data/loaders.py), and `accelerator.skip_first_batches` drops the indices
already trained on without loading them. Optimizer step k always takes samples
[k x global batch, (k+1) x global batch) of that order, at any world size.

A checkpoint of another world size or strategy is resharded on load (routes.py decides how,
reshard.py does it with DCP or DeepSpeed's universal checkpoint); the resume says what moved
and how long it took.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from overdrive.checkpoint import adapter_state, background
from overdrive.checkpoint import fingerprint as fp
from overdrive.checkpoint import pipeline_state, reshard, store
from overdrive.checkpoint.room import CheckpointRoom
from overdrive.checkpoint.resume import (START_OVER, TRAINER_STATE, ResumePlan, judge, plan_resume,  # noqa: F401
                                         read_state, saved_config, with_plan)
from overdrive.config.schema import RunConfig
from overdrive.config.stored import CONFIG_VERSION
from overdrive.errors import Problem, UserError


class _TiedWeightsNotice(logging.Filter):
    """Drops Accelerate's "Removed shared tensor ..." warning, printed on every save of a
    model whose input and output embeddings are tied: `load_state` ties them again, and
    resume is checked bit for bit, so for our saves it is noise, not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor" not in record.getMessage()


@contextlib.contextmanager
def _quiet_tied_weights():
    accelerate_logger = logging.getLogger("accelerate.utils.other")
    notice = _TiedWeightsNotice()
    accelerate_logger.addFilter(notice)
    try:
        yield
    finally:
        accelerate_logger.removeFilter(notice)


# ---------------------------------------------------------------- with the accelerator

@dataclass
class Restored:
    """Which checkpoint a run resumed from (None: a fresh start)."""

    step: int = 0
    path: Optional[Path] = None


class Checkpointer:
    """Saves and restores one run's checkpoints; every rank makes the same calls."""

    def __init__(self, cfg: RunConfig, accelerator: Any, scheduler: Any, plan: ResumePlan,
                 metrics_path: Path, say: Callable[[str], None] = print):
        self.cfg, self.acc, self.plan = cfg, accelerator, plan
        self.root = store.checkpoints_dir(cfg.output_dir)
        self.metrics_path, self.say = metrics_path, say
        self.main = accelerator.is_main_process
        self.lineage = (plan.saved or {}).get("lineage") or uuid.uuid4().hex
        self.last_saved = -1
        self.stages: tuple = (None,)  # (pipeline, stages, optimizer) under pipeline parallel: pipeline_state.py
        # The schedule is stepped by the loop, not prepared: registering it puts it in save_state.
        accelerator.register_for_checkpointing(scheduler)
        # An adapter run saves what is trained, not the frozen base (adapter_state.py).
        self.save_kwargs, self.load_kwargs = adapter_state.attach(cfg, accelerator)
        self.room = CheckpointRoom(cfg, self.root, accelerator._models, plan.checkpoint)
        self.in_background = background.wanted(cfg)  # checkpoint.async (background.py)
        if self.in_background and cfg.checkpoint.enabled:
            background.prepare(len(accelerator._models) + len(accelerator._optimizers))  # before any step is timed
        self.pending: Optional[background.Pending] = None
        self.stall_at: Optional[int] = None  # the test hook's step (OVERDRIVE_FAULT_INJECT=stall:step=K)
        # The data files as the run read them at its start (resume compares it): once, not at every save
        self.data_content = fp.data_content(cfg)
        if self.main and cfg.checkpoint.enabled:
            self.room.warn_early(say)

    def due(self, step: int, stopping: bool = False) -> bool:
        """Every `every_steps`, at the last step, and before the loop stops early."""
        c = self.cfg.checkpoint
        return c.enabled and step != self.last_saved and (
            stopping or step == self.cfg.training.max_steps or bool(c.every_steps and step % c.every_steps == 0))

    # -------------------------------------------------------------- restore

    def _choose(self) -> Optional[Path]:
        """The main process checks sha256 sums, newest first; every rank gets its choice."""
        from accelerate.utils import broadcast_object_list

        name = None
        if self.main:
            judged = self.plan.checkpoint
            search = store.latest_complete(self.root, checksums=True,
                                           at_most=store.step_of(judged) if judged is not None else None,
                                           put_aside=True)
            for message in search.messages():
                self.say(f"checkpoint: {message}")
            name = search.found.path.name if search.found else None
        if self.acc.num_processes > 1:
            name = broadcast_object_list([name])[0]
        return self.root / name if name else None

    def restore(self, state: Any) -> Restored:
        """Load the plan's checkpoint (or the newest older one that verifies) into the prepared
        objects and `state`; without one, start at step 0 with an empty metrics.jsonl."""
        for note in self.plan.notes:
            self.say(f"checkpoint: {note}")
        path = self._choose() if self.plan.checkpoint is not None else None
        if path is None:
            if self.plan.checkpoint is not None:
                self.say("checkpoint: none verified; starting from step 0")
            if self.main:
                store.truncate(self.metrics_path, 0)  # a fresh start: no records of an earlier run
            return Restored()
        saved = read_state(path)
        route = self.plan.route
        if path != self.plan.checkpoint or route is None:  # an older checkpoint than the judged one
            route = judge(saved_config(saved, path), self.cfg, path.name, self.plan.force).route
        adapter_state.check_base(saved, self.cfg, path.name)
        self.lineage = saved.get("lineage") or self.lineage
        started = time.perf_counter()
        try:
            universal = self._universal(path) if route.universal else None
            if route.how == "across":
                reshard.load_across(self.acc, path, route, universal)
            elif route.how == "universal":
                with reshard.universal_loading(self.acc._models[0]):  # the DeepSpeed engine
                    self.acc.load_state(str(universal))
            else:
                pipeline_state.load_state(self.acc, path, *self.stages, **self.load_kwargs)
        except UserError:
            raise
        except Exception as error:  # shapes, missing shards: the message says what
            raise UserError(Problem("checkpoint.resume", f"{path.name} cannot be loaded into this run: "
                                    f"{type(error).__name__}: {error}", fix=START_OVER)) from None
        if route.reshards:
            # Accelerate counts micro-batches to know when the accumulation ends; the saved count
            # is in the old accumulation's units. A checkpoint is always at an optimizer step.
            self.acc.step = 0
            self.say(f"resharded {route.summary()} in {time.perf_counter() - started:.1f} s")
        state.load_state_dict(self._loop_values(saved))
        if self.main:
            store.truncate(self.metrics_path, saved["metrics_bytes"])
        self.last_saved = state.step
        self.say(f"resumed from {path} (step {state.step}, epoch {state.epoch}, "
                 f"{state.batch_in_epoch} micro-batches into it)")
        return Restored(step=state.step, path=path)

    def _loop_values(self, saved: dict[str, Any]) -> dict[str, Any]:
        """The saved loop state, for this run's world size and batch shape."""
        values = {**saved.get("extra", {}), **saved["loop"]}  # first/final loss: in "extra" before they were loop state
        # Micro-batches per rank already taken from this epoch, for this run's batch shape.
        values["batch_in_epoch"] = saved["samples_in_epoch"] // (self.cfg.training.micro_batch_size * self._data_parallel)
        world, saved_world = self.acc.num_processes, saved["world_size"]
        if saved_world == world:
            values["loss_sum"] = saved["pending_loss"][self.acc.process_index]
            values["micro_steps"] = saved["pending_micro_steps"]
        else:
            # The loss summed since the last log, shared out so the next logged mean is over the
            # same micro-batches: whole optimizer steps, so the count converts exactly.
            values["loss_sum"] = sum(saved["pending_loss"]) / world
            values["micro_steps"] = saved["pending_micro_steps"] * saved_world // world
        return values

    def _universal(self, path: Path) -> Path:
        """DeepSpeed's universal form of `path`: the main process converts it (once; cached in the
        checkpoint), the others wait for it."""
        target = path / reshard.UNIVERSAL
        if self.main:
            target, seconds = reshard.convert_to_universal(path)
            if seconds is None:
                self.say(f"checkpoint: universal form of {path.name} already converted (cached in {target})")
            else:
                self.say(f"checkpoint: converted {path.name} to DeepSpeed's universal checkpoint in {seconds:.1f} s "
                         f"({reshard.disk_bytes(target) / 1e6:.1f} MB beside the checkpoint's "
                         f"{reshard.disk_bytes(path / reshard.DEEPSPEED_TAG) / 1e6:.1f} MB, kept in {target})")
        self.acc.wait_for_everyone()
        return target

    # -------------------------------------------------------------- save

    def save(self, state: Any) -> Path:
        """A complete checkpoint of this step, or none: see store.py for the order of writes.
        `state` is the loop's state, saved whole: its `state_dict()`, and its device-side
        `loss_sum` gathered from every rank. A part that fails on any rank stops every rank
        there, the partial save removed (agreed.py); the previous checkpoints stay."""
        acc, step = self.acc, state.step
        started = time.perf_counter()
        self.wait()  # the save still in flight first: one at a time, each agreed on
        waited = time.perf_counter() - started
        tmp = store.temp_dir_for(self.root, step)
        losses = acc.gather(state.loss_sum.detach().float().reshape(1)).tolist()
        parts = self.room.save_parts(acc, tmp, step)
        parts.part(lambda: self.room.check_then_begin(step, self.say) if self.main else None)
        if self.in_background:
            return self._save_in_background(state, tmp, losses, parts, started, waited)
        with _quiet_tied_weights():
            parts.part(lambda: pipeline_state.save_state(acc, tmp, *self.stages, **self.save_kwargs))
        # every rank's files are written (the part agreed) before the manifest lists them
        parts.part(lambda: self._write_trainer_state(tmp, state, losses) if self.main else None)
        final = self.root / store.name_for(step)
        parts.part(lambda: self._commit(tmp, step) if self.main else None)
        self.last_saved = step
        self.say(f"checkpoint: step {step}: training blocked {time.perf_counter() - started:.3f} s")
        return final

    def _save_in_background(self, state: Any, tmp: Path, losses: list, parts: Any, started: float,
                            waited: float) -> Path:
        """checkpoint.async: staged now, written and sealed by a background thread (background.py)."""
        step, futures = state.step, []
        with _quiet_tied_weights():
            parts.part(lambda: futures.extend(background.stage(self.acc, tmp)))
        parts.part(lambda: self._write_trainer_state(tmp, state, losses) if self.main else None)
        seal = (lambda: self._commit(tmp, step)) if self.main else None
        self.pending = background.Pending(step, tmp, futures, seal, stall=self.stall_at == step)
        self.last_saved = step
        still = f", {waited:.3f} s of it for the previous save to be written" if waited >= 0.001 else ""
        self.say(f"checkpoint: step {step}: training blocked {time.perf_counter() - started:.3f} s "
                 f"(staged; written in the background{still})")
        return self.root / store.name_for(step)

    def wait(self) -> None:
        """The background save in flight, finished on every rank and agreed on (agreed.py): a
        failure on any rank removes its temporary directory and ends the run, the previous
        checkpoints kept. Called before the next save and before the run ends."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        self.room.save_parts(self.acc, pending.tmp, pending.step).part(pending.wait)
        if self.main and pending.seconds is not None:
            # The path said only now: before this it named a directory still being written.
            self.say(f"checkpoint: {self.root / store.name_for(pending.step)} complete, written in the background "
                     f"in {pending.seconds:.2f} s")

    def _commit(self, tmp: Path, step: int) -> None:
        final = store.commit(tmp, step)
        store.prune(self.root, self.cfg.checkpoint.keep_last, step, belongs=self._ours)
        self.room.measured(final)

    def _write_trainer_state(self, tmp: Path, state: Any, losses: list) -> None:
        from overdrive.config.redact import redact

        cfg, t = self.cfg, self.cfg.training
        config = cfg.model_dump(mode="json")
        world = self.acc.num_processes
        loop = state.state_dict()
        record = {
            "format": 1, "config_version": CONFIG_VERSION, "step": state.step, "saved_at": time.time(), "lineage": self.lineage,
            "loop": loop,
            "samples_in_epoch": state.batch_in_epoch * t.micro_batch_size * self._data_parallel,
            "world_size": world, "micro_batch_size": t.micro_batch_size,
            "gradient_accumulation_steps": t.gradient_accumulation_steps, "global_batch": fp.global_batch(cfg),
            "strategy": cfg.parallel.strategy, "sharded": fp.sharded(cfg),
            "fingerprint": fp.fingerprint(cfg), "data_content": self.data_content, "config": redact(config),
            "metrics_bytes": self.metrics_path.stat().st_size if self.metrics_path.exists() else 0,
            "pending_loss": losses, "pending_micro_steps": loop["micro_steps"],
            "extra": {"first_loss": loop["first_loss"], "final_loss": loop["final_loss"]},  # as earlier versions read it
        }
        base = adapter_state.base_record(cfg)
        if base is not None:  # referred to, not copied
            record["base_model"] = base
        (tmp / TRAINER_STATE).write_text(json.dumps(record, indent=1, default=str))

    @property
    def _data_parallel(self) -> int:
        """Ranks that take different samples: world / (tp x cp x sp)."""
        from overdrive.config import batch

        return batch.data_parallel_degree(self.cfg)

    def _ours(self, path: Path) -> bool:
        """A checkpoint of this run's lineage (not one left by an earlier run in output_dir)."""
        try:
            return read_state(path).get("lineage") == self.lineage
        except (OSError, ValueError):
            return False
