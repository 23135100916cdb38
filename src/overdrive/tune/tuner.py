"""The tuner's job: the search space built for a run, the candidates measured in trial processes
(cached by machine and config), and the result assembled into tuned.yaml."""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from overdrive.tune import cache
from overdrive.tune.search import Search, SearchSettings
from overdrive.tune.space import DIMENSIONS, Candidate, Space, build_space, detect_facts
from overdrive.tune.trials import Outcome, TrialPlan
from overdrive.tune.trials import Rung  # noqa: F401  (handed on by the package)

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig



@dataclass
class TuneOptions:
    budget_minutes: Optional[float] = None
    mode: str = "staged"  # or "grid"
    only: Optional[dict[str, list[str]]] = None
    plan: TrialPlan = field(default_factory=TrialPlan)
    eta: int = 3
    finalists: int = 2
    workdir: Optional[Path] = None  # trial directories (a temporary one by default)


@dataclass
class Job:
    resolved: Any  # config.Resolved
    space: Space
    plan: TrialPlan
    settings: SearchSettings
    workdir: Optional[Path] = None

    @property
    def config(self):
        return self.resolved.config

    def inputs(self) -> dict[str, Any]:
        return cache.inputs(self.config, self.space.describe(), self.plan.describe(), self.settings.describe())

    def fingerprint(self) -> str:
        return cache.fingerprint(self.inputs())


def make_job(resolved, options: Optional[TuneOptions] = None) -> Job:
    options = options or TuneOptions()
    cfg = resolved.config
    space = build_space(cfg, detect_facts(cfg), options.only)
    budget = options.budget_minutes * 60 if options.budget_minutes else None
    settings = SearchSettings(mode=options.mode, eta=options.eta, finalists=options.finalists, budget_s=budget,
                              run_steps=cfg.training.max_steps)
    return Job(resolved, space, options.plan, settings, options.workdir)


def lookup(job: Job) -> Optional[dict[str, Any]]:
    """The cached result for exactly these inputs, or None."""
    return cache.load(job.config, job.fingerprint())


def trial_config(job: Job, overrides: dict[str, Any], workdir: Path) -> str:
    """The resolved config (JSON) a trial of these overrides trains, output in `workdir`."""
    from overdrive.resolving import Resolved
    from overdrive.tune.space import apply

    cfg = apply(job.config, {**overrides, **job.plan.overrides(workdir / "out")})
    return Resolved(config=cfg, origins={}).to_json()


def open_starter(job: Job, root: Path):
    """What starts trial processes for this job (close it when done)."""
    return starter_for(job.config, job.plan.runner, root)


def starter_for(cfg: RunConfig, runner: str, root: Path):
    """What starts processes training configs like `cfg`: "fork" (from a warm server under
    `root`) or "spawn" (fresh interpreters). Close it when done."""
    from overdrive.launch import process as launch
    from overdrive.tune import processes

    # The environment an `overdrive train` worker would get (Accelerate's variables removed:
    # the resolved config already holds what they said).
    env = launch.worker_environment(cfg)
    env.update(launch.secrets_env(cfg))  # the trial's resolved JSON holds them masked
    if runner == "spawn":
        return processes.Spawner(env)
    arch = cfg.model.architecture if not cfg.model.name_or_path else {}
    model_type = str(arch.get("model_type", "")).replace("-", "_")
    extra = (f"transformers.models.{model_type}.modeling_{model_type}",) if model_type else ()
    return processes.ForkServer(root, env, extra)


def run(job: Job, log: Callable[[str], None] = lambda _: None, fits=None) -> dict[str, Any]:
    """Measure; return the result (also stored in the cache). `fits` replaces the estimator."""
    from overdrive.errors import Problem, UserError
    from overdrive.tune import output, trials

    root = Path(tempfile.mkdtemp(prefix="overdrive-tune-", dir=job.workdir))
    starter = open_starter(job, root)  # the fork server imports while the estimator works
    counter = itertools.count(1)
    started = time.monotonic()
    try:
        if fits is None:
            from overdrive.tune.space import fits_by_estimate

            fits = fits_by_estimate(job.config)
        log("preparing the data (tokenizer and token cache) once for every trial")
        prepared = trials.prepare(trial_config(job, job.space.baseline.overrides(), root / "prepare"),
                                  root / "prepare", starter)
        if prepared.status != "ok":
            raise UserError(Problem("data.source", f"the data could not be prepared: {prepared.reason}",
                                    fix="run `overdrive train` with the same config to see the whole error"))

        def runner(candidate: Candidate, decide) -> Outcome:
            workdir = root / f"trial-{next(counter):03d}"
            try:
                text = trial_config(job, candidate.overrides(), workdir)
            except ValueError as error:  # pydantic's ValidationError: an option the schema refuses
                return Outcome("crashed", f"invalid config: {str(error).splitlines()[0]}")
            return trials.run_trial(text, workdir, job.plan, starter, decide)

        search = Search(job.space, job.settings, job.plan, runner, fits, log)
        candidates = search.execute()
        ranked = search.ok()
    finally:
        starter.close()
        shutil.rmtree(root, ignore_errors=True)
    result = assemble(job, candidates, ranked, search, time.monotonic() - started)
    key = result["fingerprint"]
    if result["chosen"] is not None:
        output.chart(result, cache.chart_path(job.config, key))
        cache.store(job.config, key, result)
    return result


def space_size(space: Space) -> int:
    size = 1
    for d in DIMENSIONS:
        size *= len(space.dimensions[d])
    return size


def _candidate(c: Candidate, search: Search) -> dict[str, Any]:
    m = c.measurement
    timed = bool(m and m.step_s)
    return {
        "label": c.label, "stage": c.stage, "status": c.status, "reason": c.reason,
        "options": {o.dimension: o.label for o in c.options}, "overrides": c.overrides(),
        "tokens_per_s": m.tokens_per_s() if timed else None,
        "run_tokens_per_s": search.score(c) if timed else None,
        "overhead_s": m.overhead_s() if timed else None,
        "timed_steps": len(m.step_s) if m else 0,
        "peak_memory_mb": m.peak_memory_mb if m else None,
        "estimate_bytes": c.estimate_bytes, "trial_s": round(c.trial_s, 2),
        "measurement": m.to_dict() if m else None, "log_tail": c.log_tail,
    }


def assemble(job: Job, candidates: list[Candidate], ranked: list[Candidate], search: Search,
             seconds: float) -> dict[str, Any]:
    cfg = job.config
    inputs = job.inputs()
    return {
        "fingerprint": cache.fingerprint(inputs), "inputs": inputs, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "mode": job.settings.mode, "global_batch": job.space.global_batch, "world": job.space.world,
        "seq_len": cfg.data.max_length, "run_steps": job.settings.run_steps,
        "space_size": space_size(job.space), "notes": job.space.notes,
        "baseline": job.space.baseline.label, "chosen": ranked[0].label if ranked else None,
        "trials": search.trials, "measured": sum(1 for c in candidates if c.measurement and c.measurement.step_s),
        "search_s": round(seconds, 1),
        "candidates": [_candidate(c, search) for c in candidates],
    }
