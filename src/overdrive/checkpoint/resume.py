"""Resuming: what a run continues from, judged once, and handed to the workers whole.

    plan = plan_resume(cfg, force)          # before anything is built: what to resume, is it allowed
    resolved = with_plan(resolved, plan)    # the config it runs with, and the plan as a record
    plan = resume_plan(resolved, force)     # a worker: the handed plan, while its checkpoint is the newest

The judgement compares the checkpoint's config with this one once (fingerprint.compare):
what changed, whether this config may resume it, how its files get in (`route`), and on a
new world size the accumulation that keeps the checkpoint's global batch. The plan keeps all
of it, also through the resolved file the launcher hands its workers, so a worker does not
compare again; only a checkpoint other than the judged one (written since, or the judged one
failing its checksums) is judged anew.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from overdrive.checkpoint import fingerprint as fp
from overdrive.checkpoint import reshard, store
from overdrive.checkpoint.routes import Route
from overdrive.config import Origin
import overdrive.config.batch as batch
from overdrive.resolving import Resolved
from overdrive.config.schema import RunConfig
from overdrive.config.stored import read_stored
from overdrive.errors import Problem, UserError

TRAINER_STATE = "trainer_state.json"
START_OVER = "start over instead: checkpoint.resume=never, or a new output_dir"
# Keys whose change gives the model other weights (names, shapes): a checkpoint of the old ones
# cannot be loaded into it, with or without --force, so --force is never offered for them.
OTHER_WEIGHTS = ("model.name_or_path", "model.architecture", "model.task", "model.num_labels", "model.from_scratch",
                 "model.moe", "peft.method", "peft.r", "peft.target_modules", "tokenizer.vocab_size")


def other_weights(keys: list[str]) -> list[str]:
    """The keys among `keys` whose change means another model's weights."""
    return [k for k in keys if any(k == w or k.startswith(w + ".") for w in OTHER_WEIGHTS)]


def _new_output_dir(cfg_dir: str) -> str:
    """A new output_dir beside this one, not yet used, for the fix a user copies."""
    base = Path(cfg_dir).expanduser()
    for n in range(2, 1000):
        candidate = base.with_name(f"{base.name}-{n}")
        if not candidate.exists():
            return str(candidate)
    return f"{base}-new"


def read_state(path: Path) -> dict[str, Any]:
    return json.loads((path / TRAINER_STATE).read_text())


def saved_config(state: dict[str, Any], path: Path) -> RunConfig:
    """The config checkpoint `path` was written under (its trainer state `state`), read back as
    a RunConfig (config/stored.py: a key it was written without gets its default)."""
    return read_stored(state, str(path / TRAINER_STATE))


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

    def record(self) -> dict[str, Any]:
        """The plan as the resolved file carries it to the workers (`resume` in resolved.json)."""
        record: dict[str, Any] = {"checkpoint": str(self.checkpoint) if self.checkpoint else None, "force": self.force,
                  "notes": list(self.notes)}
        if self.route is not None:
            record["route"] = dataclasses.asdict(self.route)
        return record

    @classmethod
    def from_record(cls, config: RunConfig, record: dict[str, Any], saved: Optional[dict[str, Any]],
                    force: bool = False) -> "ResumePlan":
        route = record.get("route")
        return cls(config, Path(record["checkpoint"]) if record.get("checkpoint") else None, saved,
                   list(record.get("notes", [])), bool(record.get("force", force)), Route(**route) if route else None)


def judge(saved: RunConfig, cfg: RunConfig, name: str, force: bool,
          comparison: Optional[fp.Comparison] = None) -> fp.Comparison:
    """Compare the checkpoint's config `saved` with `cfg`; raise on what cannot or may not resume."""
    comparison = comparison or fp.compare(saved, cfg)
    route = comparison.route
    problems = []
    if comparison.refusal and route.how == "refused":
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
                                    f"{saved.launch.num_processes}, or {START_OVER}"))
    if problems:
        raise UserError(problems, title=f"cannot resume from {name}")
    math = comparison.of("math")
    weights = other_weights([c.key for c in math])
    if weights:  # --force would only fail later, listing every parameter name the checkpoint lacks
        raise UserError([Problem(c.key, f"{c.old!r} -> {c.new!r} since {name} was saved: another model's weights, "
                                 f"which {name} cannot be loaded into") for c in math if c.key in weights]
                        + [Problem("output_dir", "its checkpoints hold the other model",
                                   fix=f"train in a new output_dir: output_dir={_new_output_dir(cfg.output_dir)}; "
                                   "or put the old values back to resume it")],
                        title=f"cannot resume from {name}")
    if math and not force:
        raise UserError(
            [Problem(c.key, f"{c.old!r} -> {c.new!r} since {name} was saved: changes {c.why}") for c in math]
            + [Problem("", f"to resume anyway with the new values: the same command with --force; or put the old "
                       f"values back; or {START_OVER}")],
            title=f"the config changed the math since {name}")
    return comparison


@dataclass
class Found:
    """The newest checkpoint in output_dir against this config: what `train` will do with it.
    `decide` builds it; train (`plan_resume`), explain and plan (`describe_resume`) read it, so
    they say the same."""

    path: Path
    step: int
    saved: dict[str, Any]  # its trainer state
    config: RunConfig  # the config it was written under, read back
    comparison: fp.Comparison
    finished: bool  # its step is its run's max_steps: nothing left to resume
    different: list[str]  # keys whose change a finished run cannot take without --force
    extends: bool = False  # a finished run, and the only change a larger training.max_steps: it trains on

    def refusal(self, force: bool) -> Optional[UserError]:
        """A finished run is a record: another config in its output_dir would replace its
        metrics, checkpoints and resolved config. Refused without --force, naming the keys."""
        if not (self.finished and self.different) or force:
            return None
        changes = {c.key: c for c in self.comparison.changes}
        problems = [Problem(key, f"{changes[key].old!r} -> {changes[key].new!r}" if key in changes else "changed")
                    for key in self.different]
        new_dir = _new_output_dir(str(self.path.parent.parent))
        fix = (f"train in a new output_dir: output_dir={new_dir}" + (
            "" if other_weights(self.different) else "; or the same command with --force to continue the finished "
            "run with the new values"))
        problems.append(Problem("output_dir", f"{self.path.parent.parent} holds a run finished at step {self.step} "
                                "with another config: training here would replace its record", fix=fix))
        return UserError(problems, title=f"{self.path.name} ends a finished run with another config")


def decide(cfg: RunConfig) -> Optional[Found]:
    """The newest complete-looking checkpoint in output_dir compared with `cfg` (None: none,
    or checkpoint.resume=never). Cheap: manifests and sizes, not contents."""
    if cfg.checkpoint.resume == "never":
        return None
    search = store.latest_complete(store.checkpoints_dir(cfg.output_dir), checksums=False, put_aside=True)
    if search.found is None:
        return None
    path = search.found.path
    try:
        saved = read_state(path)
    except (OSError, ValueError) as error:
        raise UserError(Problem("checkpoint.resume", f"{path}/{TRAINER_STATE} is unreadable: {error}",
                                fix=START_OVER)) from None
    stored = saved_config(saved, path)
    comparison = fp.compare(stored, cfg)
    recorded, now = saved.get("data_content"), fp.data_content(cfg)
    if recorded is not None and now is not None and recorded != now:  # rewritten in place: the same path and keys
        comparison.changes.append(fp.Change(fp.DATA_CONTENT, recorded, now, "math", "which samples are trained on, "
                                            "from the saved position on: the data file changed since the checkpoint"))
    different = [c.key for c in comparison.of("math") + comparison.of("layout")]
    different += [c.key for c in comparison.of("harmless") if c.why.startswith(fp.MOVED_BY)]  # another strategy
    if comparison.world_note or comparison.refusal:
        different.append("launch.num_processes")
    saved_steps = stored.training.max_steps
    finished = saved_steps is not None and search.found.step >= saved_steps
    extends = finished and saved_steps is not None and _only_longer(comparison, saved_steps, cfg)
    if extends:  # what the finished run's message offers ("raise training.max_steps"): taken as asked
        different = []
    return Found(path, search.found.step, saved, stored, comparison, finished, different, extends)


def _only_longer(comparison: fp.Comparison, saved_steps: int, cfg: RunConfig) -> bool:
    """The math changed only by training.max_steps, now larger; nothing of the layout changed."""
    math = comparison.of("math")
    wanted = cfg.training.max_steps
    return ([c.key for c in math] == ["training.max_steps"] and not comparison.of("layout")
            and not comparison.refusal and wanted is not None and wanted > saved_steps)


def plan_resume(cfg: RunConfig, force: bool = False) -> ResumePlan:
    """The newest complete-looking checkpoint in output_dir, and whether this config may resume it.

    Cheap: reads manifests and file sizes, not their contents (the main process checks the
    sha256 sums before loading, see `Checkpointer.restore`). Raises UserError when the
    config changed the math (without `force`) or cannot load the checkpoint at all, and when
    that checkpoint ends a finished run and the config differs (without `force`): nothing a
    user has is replaced without --force.
    """
    plan = ResumePlan(cfg, force=force)
    if cfg.checkpoint.resume == "never":
        return plan
    plan.notes += store.latest_complete(store.checkpoints_dir(cfg.output_dir), checksums=False,
                                        put_aside=True).messages()
    found = decide(cfg)
    if found is None:
        return plan
    refused = found.refusal(force)
    if refused is not None:
        raise refused
    path, saved, comparison = found.path, found.saved, found.comparison
    judge(found.config, cfg, path.name, force or found.extends, comparison)
    plan.checkpoint, plan.saved = path, saved
    harmless = [c.render() for c in comparison.of("harmless")]
    if harmless:
        plan.notes.append("changed since the checkpoint (the math is the same): " + "; ".join(harmless))
    forced = [c.render() for c in comparison.of("math")]
    if found.extends:
        plan.notes.append(f"continuing the finished run from step {found.step} to step {cfg.training.max_steps}: "
                          f"the schedule now runs over {cfg.training.max_steps} steps")
    elif forced:
        plan.notes.append("--force: resuming with changed math: " + "; ".join(forced))
    if comparison.world_note:
        plan.notes.append(comparison.world_note)
    plan.route = comparison.route
    if plan.route is not None and plan.route.reshards:
        plan.notes.append(f"resharding {path.name}: {plan.route.summary()}")
    if comparison.accumulation is not None:
        t = cfg.training.model_copy(update={"gradient_accumulation_steps": comparison.accumulation})
        plan.config = cfg.model_copy(update={"training": t})
    smaller = _split_that_fit(plan.config, saved, found.config)
    if smaller is not None:
        t = plan.config.training.model_copy(update={"micro_batch_size": smaller[0],
                                                    "gradient_accumulation_steps": smaller[1]})
        plan.config = plan.config.model_copy(update={"training": t})
        plan.notes.append(f"training.oom_retry: resuming at micro-batch {smaller[0]} x accumulation {smaller[1]}, "
                          f"the split {path.name} was saved at after an out-of-memory step")
    return plan


def _split_that_fit(cfg: RunConfig, saved: dict[str, Any], stored: RunConfig) -> Optional[tuple[int, int]]:
    """With training.oom_retry, a checkpoint saved at a smaller micro-batch than this config's (the
    same global batch and data-parallel degree) resumes at its split: the larger one ran out of memory."""
    micro, accumulation = saved.get("micro_batch_size"), saved.get("gradient_accumulation_steps")
    current = cfg.training.micro_batch_size
    if not cfg.training.oom_retry or not isinstance(micro, int) or not isinstance(current, int) or micro >= current:
        return None
    same_world = batch.data_parallel_degree(stored) == batch.data_parallel_degree(cfg)
    if not same_world or saved.get("global_batch") != fp.global_batch(cfg):
        return None
    return (micro, accumulation) if isinstance(accumulation, int) else None


def describe_resume(cfg: RunConfig) -> Optional[dict[str, Any]]:
    """What `overdrive train` with this config would do with the checkpoint in output_dir
    (`decide`, as train decides): resume it, and how it gets in (resharded from another world
    size or strategy, and at what cost), or refuse. None without a checkpoint."""
    try:
        found = decide(cfg)
    except UserError:
        return None
    if found is None:
        return None
    comparison = found.comparison
    route = comparison.route
    text = f"{found.path.name}: " + (route.summary() if route.how != "as saved" else "loaded as saved")
    refused = found.refusal(force=False)
    if refused is not None:
        text = (f"{found.path.name}: ends a finished run with another config ({', '.join(found.different)}): "
                "train refuses it without --force (a new output_dir keeps the finished run)")
    elif comparison.refusal:
        text = f"{found.path.name}: refused: {comparison.refusal}"
    elif comparison.world_note:
        text += f"; {comparison.world_note}"
    math = [] if found.extends else [c.key for c in comparison.of("math")]
    if found.extends:
        text += f"; continues the finished run to step {cfg.training.max_steps}"
    if math and refused is None:
        text += f"; the math changed since ({', '.join(math)}): train refuses it without --force"
    cost = reshard.conversion_record(found.path) if route.universal else None
    if route.universal and not comparison.refusal and refused is None:
        text += (f"; universal form converted once in {cost['seconds']:.1f} s ({cost['bytes'] / 1e6:.1f} MB beside "
                 f"{cost['source_bytes'] / 1e6:.1f} MB)" if cost else "; converted to the universal form on resume")
    return {"checkpoint": str(found.path), "step": found.step, "how": route.how, "resharding": route.summary(),
            "refusal": comparison.refusal, "conversion": cost, "text": text,
            "train": "refused" if refused is not None or comparison.refusal or math else "resumes",
            "changed": found.different}


def with_plan(resolved: Resolved, plan: ResumePlan) -> Resolved:
    """`resolved` carrying the plan: its config (a changed accumulation gets its origin) and
    the plan's record, which the resolved file hands to the workers."""
    origins = dict(resolved.origins)
    if resolved.config is not plan.config:
        origins["training.gradient_accumulation_steps"] = Origin("resume", f"global batch of {plan.checkpoint}")
    if resolved.config.training.micro_batch_size != plan.config.training.micro_batch_size:
        why = Origin("oom_retry", f"the split {plan.checkpoint} was saved at after an out-of-memory step")
        origins["training.micro_batch_size"] = origins["training.gradient_accumulation_steps"] = why
    return dataclasses.replace(resolved, config=plan.config, origins=origins, resume=plan.record())


def judge_resume(resolved: Resolved, force: bool = False) -> Resolved:
    """The launcher's judgement: refused before any worker starts, else handed to them."""
    return with_plan(resolved, plan_resume(resolved.config, force))


def _same(a: Optional[str | Path], b: Optional[str | Path]) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and Path(a).resolve() == Path(b).resolve())


def resume_plan(resolved: Resolved, force: bool = False) -> ResumePlan:
    """The handed plan while the checkpoint it names is still the newest one; a checkpoint
    written since (the elastic agent restarted the workers after a save), or a hand-off
    without a route (a resolved file written before routes were handed over), is judged here."""
    handed, cfg = resolved.resume, resolved.config
    if handed is not None and (handed.get("route") or not handed.get("checkpoint")):
        newest = store.latest_complete(store.checkpoints_dir(cfg.output_dir), checksums=False).found
        judged = handed.get("checkpoint")
        if _same(newest.path if newest else None, judged):
            try:
                saved = read_state(Path(judged)) if judged else None
            except (OSError, ValueError):  # judged again below, which says what is wrong with it
                saved = None
            if saved is not None or not judged:
                return ResumePlan.from_record(cfg, handed, saved, force)
    return plan_resume(cfg, force)
