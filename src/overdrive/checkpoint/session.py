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
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from overdrive.checkpoint import fingerprint as fp
from overdrive.checkpoint import reshard, store
from overdrive.checkpoint.room import CheckpointRoom
from overdrive.checkpoint.routes import Route
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError

TRAINER_STATE = "trainer_state.json"
START_OVER = "start over instead: checkpoint.resume=never, or a new output_dir"


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


def read_state(path: Path) -> dict[str, Any]:
    return json.loads((path / TRAINER_STATE).read_text())


# ---------------------------------------------------------------- before the accelerator

@dataclass
class ResumePlan:
    """What a run will resume from, decided before anything is built.

    `config` is the config to build with: the one given, except that a different world size
    changes the accumulation so the checkpoint's global batch is kept.
    """

    config: RunConfig
    checkpoint: Optional[Path] = None
    saved: Optional[dict[str, Any]] = None
    notes: list[str] = field(default_factory=list)
    force: bool = False
    route: Optional[Route] = None  # how the checkpoint loads (resharded for another world size or strategy)


def _judge(saved: dict[str, Any], cfg: RunConfig, name: str, force: bool,
           comparison: Optional[fp.Comparison] = None) -> fp.Comparison:
    """Compare the checkpoint's config with `cfg`; raise on what cannot or may not resume."""
    comparison = comparison or fp.compare(saved["config"], cfg.model_dump(mode="json"))
    route = comparison.route
    problems = []
    if comparison.refusal and route is not None and route.how == "refused":
        keys = [c.key for c in comparison.of("layout")] or ["launch.num_processes"]
        old = ", ".join(f"{c.key}={c.old}" for c in comparison.of("layout")) or \
            f"launch.num_processes={route.source_world}"
        problems.append(Problem(keys[0], f"{name}: {comparison.refusal}", fix=f"resume with {old}, or {START_OVER}"))
    else:
        problems += [Problem(c.key, f"{c.old!r} -> {c.new!r}: {name} cannot be loaded ({c.why})",
                             fix=f"put the old value back, or {START_OVER}") for c in comparison.of("layout")]
        if comparison.refusal:
            problems.append(Problem("launch.num_processes", comparison.refusal,
                                    fix=f"resume with one of those, or launch.num_processes="
                                    f"{saved['config']['launch']['num_processes']}, or {START_OVER}"))
    if problems:
        raise UserError(problems, title=f"cannot resume from {name}")
    math = comparison.of("math")
    if math and not force:
        raise UserError(
            [Problem(c.key, f"{c.old!r} -> {c.new!r} since {name} was saved: changes {c.why}") for c in math]
            + [Problem("", f"to resume anyway with the new values: the same command with --force; or put the old "
                       f"values back; or {START_OVER}")],
            title=f"the config changed the math since {name}")
    return comparison


def plan_resume(cfg: RunConfig, force: bool = False) -> ResumePlan:
    """The newest complete-looking checkpoint in output_dir, and whether this config may resume it.

    Cheap: reads manifests and file sizes, not their contents (the main process checks the
    sha256 sums before loading, see `Checkpointer.restore`). Raises UserError when the
    config changed the math (without `force`) or cannot load the checkpoint at all, unless
    that checkpoint ends a finished run: then there is nothing to resume, and a different
    config starts a new run in the same output_dir.
    """
    plan = ResumePlan(cfg, force=force)
    if cfg.checkpoint.resume == "never":
        return plan
    search = store.latest_complete(store.checkpoints_dir(cfg.output_dir), checksums=False, put_aside=True)
    plan.notes += search.messages()
    if search.found is None:
        return plan
    path = search.found.path
    try:
        saved = read_state(path)
    except (OSError, ValueError) as error:
        raise UserError(Problem("checkpoint.resume", f"{path}/{TRAINER_STATE} is unreadable: {error}",
                                fix=START_OVER)) from None
    comparison = fp.compare(saved["config"], cfg.model_dump(mode="json"))
    finished = search.found.step >= saved["config"]["training"]["max_steps"]
    different = [c.key for c in comparison.of("math") + comparison.of("layout")]
    different += [c.key for c in comparison.of("harmless") if c.why.startswith(fp.MOVED_BY)]  # another strategy
    if comparison.world_note or comparison.refusal:
        different.append("launch.num_processes")
    if finished and different and not force:
        plan.notes.append(f"{path.name} ends a finished run with a different config ({', '.join(different)}): "
                          "starting a new run here (its checkpoints replace the old ones; --force would continue "
                          "the old one instead)")
        return plan
    _judge(saved, cfg, path.name, force, comparison)
    plan.checkpoint, plan.saved = path, saved
    harmless = [c.render() for c in comparison.of("harmless")]
    if harmless:
        plan.notes.append("changed since the checkpoint (the math is the same): " + "; ".join(harmless))
    forced = [c.render() for c in comparison.of("math")]
    if forced:
        plan.notes.append("--force: resuming with changed math: " + "; ".join(forced))
    if comparison.world_note:
        plan.notes.append(comparison.world_note)
    plan.route = comparison.route
    if plan.route is not None and plan.route.reshards:
        plan.notes.append(f"resharding {path.name}: {plan.route.summary()}")
    if comparison.accumulation is not None:
        t = cfg.training.model_copy(update={"gradient_accumulation_steps": comparison.accumulation})
        plan.config = cfg.model_copy(update={"training": t})
    return plan


def describe_resume(cfg: RunConfig) -> Optional[dict[str, Any]]:
    """What `overdrive train` with this config would resume, and how the checkpoint gets in
    (resharded from another world size or strategy, and at what cost). None without a checkpoint."""
    if cfg.checkpoint.resume == "never":
        return None
    found = store.latest_complete(store.checkpoints_dir(cfg.output_dir), checksums=False).found
    if found is None:
        return None
    try:
        saved = read_state(found.path)
    except (OSError, ValueError):
        return None
    comparison = fp.compare(saved["config"], cfg.model_dump(mode="json"))
    route = comparison.route
    text = f"{found.path.name}: " + (route.summary() if route.how != "as saved" else "loaded as saved")
    if comparison.refusal:
        text = f"{found.path.name}: refused: {comparison.refusal}"
    elif comparison.world_note:
        text += f"; {comparison.world_note}"
    math = [c.key for c in comparison.of("math")]
    if math:
        text += f"; the math changed since ({', '.join(math)}): train refuses it without --force"
    cost = reshard.conversion_record(found.path) if route.universal else None
    if route.universal and not comparison.refusal:
        text += (f"; universal form converted once in {cost['seconds']:.1f} s ({cost['bytes'] / 1e6:.1f} MB beside "
                 f"{cost['source_bytes'] / 1e6:.1f} MB)" if cost else "; converted to the universal form on resume")
    return {"checkpoint": str(found.path), "step": found.step, "how": route.how, "resharding": route.summary(),
            "refusal": comparison.refusal, "conversion": cost, "text": text}


def with_plan(resolved: Any, plan: ResumePlan) -> Any:
    """`resolved` carrying the plan's config; a changed accumulation gets its origin."""
    from overdrive.config import Origin, Resolved

    if getattr(resolved, "config", resolved) is plan.config:
        return resolved
    if not isinstance(resolved, Resolved):
        return plan.config
    origins = dict(resolved.origins)
    origins["training.gradient_accumulation_steps"] = Origin("resume", f"global batch of {plan.checkpoint}")
    return Resolved(config=plan.config, origins=origins, chains=resolved.chains, warnings=resolved.warnings)


# ---------------------------------------------------------------- with the accelerator

@dataclass
class Restored:
    """What the loop needs beyond the accelerator's own objects after a resume."""

    step: int = 0
    path: Optional[Path] = None
    pending_loss: float = 0.0  # this rank's loss summed since the last log
    pending_micro_steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


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
        # The schedule is stepped by the loop, not prepared: registering it puts it in save_state.
        accelerator.register_for_checkpointing(scheduler)
        self.room = CheckpointRoom(cfg, self.root, accelerator._models, plan.checkpoint)
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
            search = store.latest_complete(self.root, checksums=True, at_most=store.step_of(self.plan.checkpoint),
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
        if path != self.plan.checkpoint:
            _judge(saved, self.cfg, path.name, self.plan.force)
        self.lineage = saved.get("lineage") or self.lineage
        route = fp.compare(saved["config"], self.cfg.model_dump(mode="json")).route
        started = time.perf_counter()
        try:
            universal = self._universal(path) if route.universal else None
            if route.how == "across":
                reshard.load_across(self.acc, path, route, universal)
            elif route.how == "universal":
                with reshard.universal_loading(self.acc._models[0]):  # the DeepSpeed engine
                    self.acc.load_state(str(universal))
            else:
                self.acc.load_state(str(path))
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
        loop = saved["loop"]
        for item in dataclasses.fields(state):
            if item.name in loop:
                setattr(state, item.name, loop[item.name])
        # Micro-batches per rank already taken from this epoch, for this run's batch shape.
        state.batch_in_epoch = saved["samples_in_epoch"] // (self.cfg.training.micro_batch_size * self.acc.num_processes)
        restored = Restored(step=state.step, path=path, extra=saved.get("extra", {}))
        world, saved_world = self.acc.num_processes, saved["world_size"]
        if saved_world == world:
            restored.pending_loss = saved["pending_loss"][self.acc.process_index]
            restored.pending_micro_steps = saved["pending_micro_steps"]
        else:
            # The loss summed since the last log, shared out so the next logged mean is over the
            # same micro-batches: whole optimizer steps, so the count converts exactly.
            restored.pending_loss = sum(saved["pending_loss"]) / world
            restored.pending_micro_steps = saved["pending_micro_steps"] * saved_world // world
        if self.main:
            store.truncate(self.metrics_path, saved["metrics_bytes"])
        self.last_saved = state.step
        self.say(f"resumed from {path} (step {state.step}, epoch {state.epoch}, "
                 f"{state.batch_in_epoch} micro-batches into it)")
        return restored

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

    def save(self, state: Any, pending_loss: Any, pending_micro_steps: int, extra: dict[str, Any]) -> Path:
        """A complete checkpoint of this step, or none: see store.py for the order of writes.
        A part that fails on any rank stops every rank there, the partial save removed
        (agreed.py); the previous checkpoints stay."""
        acc, step = self.acc, state.step
        tmp = store.temp_dir_for(self.root, step)
        losses = acc.gather(pending_loss.detach().float().reshape(1)).tolist()
        parts = self.room.save_parts(acc, tmp, step)
        parts.part(lambda: self.main and self.room.check_then_begin(step, self.say))
        with _quiet_tied_weights():
            parts.part(lambda: acc.save_state(str(tmp)))
        # every rank's files are written (the part agreed) before the manifest lists them
        parts.part(lambda: self.main and self._write_trainer_state(tmp, state, losses, pending_micro_steps, extra))
        final = self.root / store.name_for(step)
        parts.part(lambda: self.main and self._commit(tmp, step))
        self.last_saved = step
        return final

    def _commit(self, tmp: Path, step: int) -> None:
        final = store.commit(tmp, step)
        store.prune(self.root, self.cfg.checkpoint.keep_last, step, belongs=self._ours)
        self.room.measured(final)

    def _write_trainer_state(self, tmp: Path, state: Any, losses: list, micro_steps: int, extra: dict) -> None:
        from overdrive.config.redact import redact

        cfg, t = self.cfg, self.cfg.training
        config = cfg.model_dump(mode="json")
        world = self.acc.num_processes
        record = {
            "format": 1, "step": state.step, "saved_at": time.time(), "lineage": self.lineage,
            "loop": dataclasses.asdict(state),
            "samples_in_epoch": state.batch_in_epoch * t.micro_batch_size * world,
            "world_size": world, "micro_batch_size": t.micro_batch_size,
            "gradient_accumulation_steps": t.gradient_accumulation_steps, "global_batch": fp.global_batch(config),
            "strategy": cfg.parallel.strategy, "sharded": fp.sharded(config),
            "fingerprint": fp.fingerprint(config), "config": redact(config),
            "metrics_bytes": self.metrics_path.stat().st_size if self.metrics_path.exists() else 0,
            "pending_loss": losses, "pending_micro_steps": micro_steps, "extra": extra,
        }
        (tmp / TRAINER_STATE).write_text(json.dumps(record, indent=1, default=str))

    def _ours(self, path: Path) -> bool:
        """A checkpoint of this run's lineage (not one left by an earlier run in output_dir)."""
        try:
            return read_state(path).get("lineage") == self.lineage
        except (OSError, ValueError):
            return False
