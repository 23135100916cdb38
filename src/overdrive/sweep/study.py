"""The Optuna side of a sweep: the storage, the study, its sampler and pruner, and the trials
that are finished, running, or left behind by a process that died.

Several sweep processes (on one machine or many) share one study through its storage. Each
asks Optuna for a trial, and a trial number belongs to the process that asked for it, so no
trial runs twice. How many trials to start is counted from the storage: a trial asked when
`sweep.trials` are already finished or running is told FAIL at once, unrun (`excess`), so
two processes asking at the same moment never add one trial too many.

A trial whose process died stays RUNNING in the storage. Two ways find it:
- Optuna's heartbeat (every process records one per running trial; one silent for
  `GRACE_S` is failed by `optuna.storages.fail_stale_trials`), for any machine;
- on this machine at once: the trial names its sweep process (host, pid, start time), and
  one whose process is gone is failed when the next sweep process looks.
Either way `Retry` queues it again with the same values and the same `output_dir`, so the
run there continues from its last checkpoint.
"""

from __future__ import annotations

import copy
import os
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from overdrive.config.provenance import where
from overdrive.config.schema import RunConfig
from overdrive.config.sweep_space import SpaceEntry
from overdrive.errors import Problem, UserError

HEARTBEAT_S = 15
GRACE_S = 60
RETRIES = 3  # a trial interrupted more often than this is left failed
OWNER = "overdrive:owner"


def quiet_optuna() -> None:
    """Optuna's per-trial log lines and experimental-feature warnings: the sweep prints its own table."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")
    # Heartbeats are recorded by the sweep loop itself (it runs trials with ask and tell).
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


def storage_url(cfg: RunConfig) -> str:
    if cfg.sweep.storage:
        return cfg.sweep.storage
    return f"sqlite:///{Path(cfg.output_dir).expanduser().resolve() / 'sweep.db'}"


def study_name(cfg: RunConfig) -> str:
    return cfg.sweep.study_name or Path(cfg.output_dir).expanduser().resolve().name


def open_storage(cfg: RunConfig, where: str = ""):
    """The RDB storage with heartbeats, or a UserError naming `sweep.storage`."""
    import optuna
    from optuna.storages import RDBStorage

    from overdrive.config.redact import redact_text

    quiet_optuna()
    url = storage_url(cfg)
    _refuse_foreign_sqlite_file(url, where)
    # SQLite shared by several sweep processes: a writer waits for the lock instead of failing at once.
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
    for attempt in range(3):
        try:
            return RDBStorage(url, engine_kwargs=engine, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                              heartbeat_stale_trial_callback=Retry(max_retry=RETRIES, inherit_intermediate_values=True))
        except (Exception, optuna.exceptions.OptunaError) as error:  # SQLAlchemy's and drivers' errors vary by backend
            if _creation_race(error) and attempt < 2:
                time.sleep(1.0)  # another process is creating the same new storage: it is there in a moment
                continue
            reason = redact_text(str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)
            raise UserError(Problem("sweep.storage", f"cannot open {redact_text(url)}: {reason}", where,
                                    "an Optuna storage URL such as sqlite:///path/sweep.db (its directory must exist), "
                                    "postgresql://host/db or mysql://host/db (with its driver installed)")) from None


SQLITE_HEADER = b"SQLite format 3\x00"


def _refuse_foreign_sqlite_file(url: str, where: str) -> None:
    """SQLite makes an empty or missing file a new database: a URL naming a directory or a file
    of the user's that is not a database (a config, an empty placeholder) is refused, not overwritten."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from overdrive.config.redact import redact_text

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return  # RDBStorage names the malformed URL
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return
    path = Path(parsed.database).expanduser()
    if not path.exists():
        return
    if path.is_dir():
        why = f"{path} is a directory"
    else:
        try:
            with path.open("rb") as handle:
                header = handle.read(len(SQLITE_HEADER))
        except OSError as error:
            why = f"{path} cannot be read ({error.strerror or error})"
        else:
            if header == SQLITE_HEADER:
                return
            why = f"{path} exists and is not an SQLite database; it is left as it is"
    raise UserError(Problem("sweep.storage", f"cannot open {redact_text(url)}: {why}", where,
                            "name a new file (e.g. sqlite:///path/sweep.db) or an existing sweep database"))


def _creation_race(error: BaseException) -> bool:
    """Two processes creating one new storage: one of them loses the insert of its schema version."""
    return type(error).__name__ == "IntegrityError" or "database is locked" in str(error)


def distributions(entries: list[SpaceEntry]) -> dict[str, Any]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for e in entries:
        if e.kind == "choice":
            out[e.key] = CategoricalDistribution(list(e.choices))
        elif e.kind == "int":
            out[e.key] = IntDistribution(e.low, e.high, log=e.log, step=e.step or 1)
        else:
            out[e.key] = FloatDistribution(e.low, e.high, log=e.log, step=e.step)
    return out


def sampler(cfg: RunConfig, entries: list[SpaceEntry], trials_so_far: int = 0):
    """The sampler. A seeded one continuing a study is seeded past the trials it already has:
    with the seed alone it would suggest the values of the study's first trials again."""
    import optuna

    s = cfg.sweep
    seed = None if s.seed is None else s.seed + trials_so_far
    if s.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if s.sampler == "grid":
        return optuna.samplers.GridSampler({e.key: e.grid_points() for e in entries}, seed=seed)
    if s.sampler == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def pruner(cfg: RunConfig):
    import optuna

    if cfg.sweep.pruner == "none":
        return optuna.pruners.NopPruner()
    if cfg.sweep.pruner == "hyperband":
        t = cfg.training
        first = t.eval_every_steps if cfg.sweep.metric.startswith(("eval_", "eval/")) and t.eval_every_steps else t.log_every_steps
        return optuna.pruners.HyperbandPruner(min_resource=min(first, t.max_steps), max_resource=t.max_steps)
    return optuna.pruners.MedianPruner()


def describe(cfg: RunConfig, entries: list[SpaceEntry]) -> dict[str, Any]:
    """What a study is judged and searched by: recorded with it, compared when it is continued."""
    space = {e.key: (list(e.choices) if e.kind == "choice" else
                     {"kind": e.kind, "low": e.low, "high": e.high, "log": e.log, "step": e.step}) for e in entries}
    return {"metric": cfg.sweep.metric, "direction": cfg.sweep.direction, "space": space}


def open_study(cfg: RunConfig, entries: list[SpaceEntry], storage, chains=None):
    """Create the study, or continue it if it exists with the same metric, direction and space."""
    import optuna

    name = study_name(cfg)
    study = optuna.create_study(storage=storage, study_name=name, direction=cfg.sweep.direction,
                                sampler=sampler(cfg, entries), pruner=pruner(cfg), load_if_exists=True)
    so_far = len(study.get_trials(deepcopy=False))
    if so_far and cfg.sweep.seed is not None:
        study.sampler = sampler(cfg, entries, so_far)
    mine = describe(cfg, entries)
    recorded = study.user_attrs.get("overdrive")
    if recorded is None:
        study.set_user_attr("overdrive", mine)
        return study
    for field in ("metric", "direction", "space"):
        if recorded.get(field) != mine[field]:
            key = f"sweep.{field}"
            raise UserError(Problem(key, f"study {name!r} in {storage_url_shown(cfg)} was started with {field} "
                                    f"{recorded.get(field)!r}; this config has {mine[field]!r}",
                                    where(chains, key),
                                    f"keep {key} as the study has it to continue it, or set sweep.study_name to start another"))
    return study


def storage_url_shown(cfg: RunConfig) -> str:
    from overdrive.config.redact import redact_text

    return redact_text(storage_url(cfg))


# ------------------------------------------------------------------ counting and claiming

@dataclass(frozen=True)
class Tally:
    finished: int  # COMPLETE or PRUNED
    running: int
    waiting: int  # queued again after an interruption
    failed: int


def tally(study) -> Tally:
    from optuna.trial import TrialState as S

    states = [t.state for t in study.get_trials(deepcopy=False)]
    return Tally(sum(s in (S.COMPLETE, S.PRUNED) for s in states), states.count(S.RUNNING), states.count(S.WAITING),
                 states.count(S.FAIL))


def excess(study, number: int, target: int) -> bool:
    """Whether trial `number` is one too many: `target` trials with lower numbers are already
    finished or running. Every process judges the same way, so the lowest numbers win."""
    from optuna.trial import TrialState as S

    ahead = [t for t in study.get_trials(deepcopy=False, states=(S.COMPLETE, S.PRUNED, S.RUNNING)) if t.number < number]
    return len(ahead) >= target


# ------------------------------------------------------------------ processes that died

def _started(pid: int) -> Optional[float]:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid())}


def claim(study, trial, trial_pid: Optional[int] = None) -> None:
    """Mark the trial as this process's (and, once started, its training process's)."""
    owner = me()
    if trial_pid is not None:
        owner.update(trial_pid=trial_pid, trial_started=_started(trial_pid))
    study._storage.set_trial_system_attr(trial._trial_id, OWNER, owner)
    study._storage.record_heartbeat(trial._trial_id)


def _gone(pid: Optional[int], started: Optional[float]) -> bool:
    if pid is None:
        return False
    now = _started(pid)
    return now is None or (started is not None and abs(now - started) > 1.0)  # a new process with a reused pid


class Retry:
    """Optuna's RetryHeartbeatStaleTrialCallback, minus the dead process's claim on the copy."""

    def __init__(self, max_retry: int, inherit_intermediate_values: bool):
        from optuna.storages import RetryHeartbeatStaleTrialCallback

        self._retry = RetryHeartbeatStaleTrialCallback(max_retry=max_retry,
                                                       inherit_intermediate_values=inherit_intermediate_values)

    def __call__(self, study, trial) -> None:
        trial = copy.deepcopy(trial)
        trial.system_attrs.pop(OWNER, None)
        self._retry(study, trial)


def fail_and_retry(study, trial_id: int) -> bool:
    """FAIL a running trial and queue it again; False if another process got there first."""
    import optuna
    from optuna.trial import TrialState

    storage = study._storage
    try:
        if not storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
            return False
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    storage.get_heartbeat_stale_trial_callback()(study, copy.deepcopy(storage.get_trial(trial_id)))
    return True


def reap(study) -> list[int]:
    """Fail (and queue again) the running trials whose process is gone; their numbers."""
    from optuna.storages import fail_stale_trials
    from optuna.trial import TrialState

    from overdrive.tune.processes import kill_tree

    before = {t._trial_id for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    fail_stale_trials(study)
    host = socket.gethostname()
    found: list[int] = []
    for t in study.get_trials(deepcopy=False):
        if t._trial_id in before and t.state == TrialState.FAIL:
            found.append(t.number)  # failed by the heartbeat just now
        owner = t.system_attrs.get(OWNER) or {}
        if t.state != TrialState.RUNNING or owner.get("host") != host or not _gone(owner.get("pid"), owner.get("started")):
            continue
        if owner.get("trial_pid") is not None and not _gone(owner["trial_pid"], owner.get("trial_started")):
            kill_tree(owner["trial_pid"])  # its sweep died; the training it started must not write on
        if fail_and_retry(study, t._trial_id):
            found.append(t.number)
    return found
