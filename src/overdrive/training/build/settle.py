"""The run config settled once, before the loop: what resolved.json records is what runs.

    settled = settle(run, force, build)     # resume plan, auto micro-batch, the Accelerator
    settled.config                          # the config every part is built from, fixed from here on
    settled.resolved.to_json()              # -> <output_dir>/resolved.json

In order:
0. The batch split (config/batch.py), as `resolving.resolve` settles it, for a RunConfig built in Python.
1. The resume (checkpoint/resume.py): what to resume, whether this config may, and (on a new
   world size) the accumulation that keeps the checkpoint's global batch. Judged once: by the
   launcher when there is one (`judge_resume`, the plan handed to the workers in the resolved
   file), else here.
2. `training.micro_batch_size: auto` predicted by the memory estimator, so every strategy's
   plugin is built from integers.
3. The Accelerator, built by the caller's `build(config)`.
4. The auto micro-batch confirmed on this device and agreed by all ranks.
Each changed value gets its origin, so `resolved.json` says why it differs from the input.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from overdrive.checkpoint.resume import ResumePlan, judge_resume, resume_plan, with_plan  # noqa: F401 (judge_resume: the launcher's)
import overdrive.config.batch as batch
from overdrive.config import Origin
from overdrive.resolving import Resolved
from overdrive.config.schema import RunConfig


@dataclass(frozen=True)
class Settled:
    resolved: Resolved  # the config as it runs, with the origin of every value
    plan: ResumePlan
    accelerator: Any

    @property
    def config(self) -> RunConfig:
        return self.resolved.config


def as_resolved(run: Resolved | RunConfig) -> Resolved:
    """A bare RunConfig (the Python API) as a Resolved whose origins are unknown."""
    return run if isinstance(run, Resolved) else Resolved(config=run, origins={})


def _with_auto(resolved: Resolved, final: RunConfig, device: str) -> Resolved:
    origins = dict(resolved.origins)
    why = Origin("auto", f"training.micro_batch_size=auto: the largest that fits on {device}, agreed by all ranks")
    now, before = final.training, resolved.config.training
    if now.micro_batch_size != before.micro_batch_size:
        origins["training.micro_batch_size"] = why
    if now.gradient_accumulation_steps != before.gradient_accumulation_steps:
        origins["training.gradient_accumulation_steps"] = why
    return replace(resolved, config=final, origins=origins)


def _with_split(resolved: Resolved) -> Resolved:
    """The batch split settled as `resolving.resolve` settles it (a RunConfig built in Python
    was not resolved); a resolved config is already settled, and comes back as it is."""
    config, origin = batch.settle(batch.refused(resolved.config))
    if config is resolved.config:
        return resolved
    origins = {**resolved.origins, batch.ACCUMULATION: origin} if origin else resolved.origins
    return replace(resolved, config=config, origins=origins)


def settle(run: Resolved | RunConfig, force: bool, build: Callable[[RunConfig], Any]) -> Settled:
    """Steps 1 to 4 above; `build(config)` constructs the Accelerator for `config`."""
    resolved = _with_split(as_resolved(run))
    plan = resume_plan(resolved, force)
    resolved = with_plan(resolved, plan)
    if resolved.config.training.micro_batch_size != "auto":
        return Settled(resolved, plan, build(resolved.config))
    from overdrive.memory.model_shape import run_shape
    from overdrive.training.build import autobatch

    shape = run_shape(resolved.config)  # the model's shape, once: every size the estimator tries reads it
    predicted = autobatch.predicted_config(resolved.config, shape=shape)  # integers before any plugin is built
    accelerator = build(predicted)
    final = autobatch.confirm(predicted, accelerator)  # probed on this device, agreed by all ranks
    return Settled(_with_auto(resolved, final, str(accelerator.device)), plan, accelerator)
