"""Sweeps without training: the space checked by key when the config loads, bad input refused
before any trial, the study's bookkeeping (trials too many, trials whose process died),
best.yaml, and the tail of a metrics file a resumed run cuts back."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from overdrive.cli import main
from overdrive.resolving import resolve
from overdrive.config.schema import RunConfig
from overdrive.config.sweep_space import parse_space
from overdrive.errors import UserError

SPACE = {"optim.lr": {"low": 1e-4, "high": 1e-2, "log": True}, "training.micro_batch_size": [4, 8]}


def space_problems_of(space: dict, **sweep) -> dict[str, str]:
    with pytest.raises(UserError) as caught:
        resolve(overrides={"sweep.space": space, **{f"sweep.{k}": v for k, v in sweep.items()}})
    found: dict[str, str] = {}
    for p in caught.value.problems:
        found[p.key] = f"{found.get(p.key, '')} {p.message}".strip()
    return found


def test_a_space_becomes_typed_entries():
    cfg = resolve(overrides={"sweep.space": SPACE}).config
    entries, problems = parse_space(cfg)
    assert problems == []
    lr, micro = entries
    assert (lr.key, lr.kind, lr.low, lr.high, lr.log) == ("optim.lr", "float", 1e-4, 1e-2, True)
    assert (micro.kind, micro.choices) == ("choice", (4, 8))
    cfg = resolve(overrides={"sweep.space": {"max_steps": {"low": 10, "high": 30, "step": 10},
                                             "model.architecture.n_layer": {"low": 1, "high": 3}}}).config
    steps, layers = parse_space(cfg)[0]
    assert (steps.key, steps.kind, steps.grid_points()) == ("training.max_steps", "int", [10, 20, 30])
    assert (layers.kind, layers.grid_points()) == ("int", [1, 2, 3])  # an open mapping's entry: its numbers decide


def test_every_bad_entry_is_refused_by_its_key_at_load():
    found = space_problems_of({
        "optim.lrr": {"low": 1e-4, "high": 1e-2},
        "optim.weight_decay": {"low": 0.5, "high": 0.1},
        "training.micro_batch_size": [4, "big"],
        "training.max_steps": {"low": 0.5, "high": 3},
        "precision.mixed_precision": {"low": 1, "high": 2},
        "optim.eps": {"low": 0.0, "high": 1.0, "log": True},
        "scheduler.warmup_steps": {"low": 1, "hihg": 3},
        "output_dir": ["a", "b"],
        "training.seed": [],
    })
    assert "did you mean `optim.lr`" in found["sweep.space.optim.lrr"]
    assert "empty range" in found["sweep.space.optim.weight_decay"]
    assert "'big'" in found["sweep.space.training.micro_batch_size"]
    assert "whole numbers" in found["sweep.space.training.max_steps"]
    assert "takes no range" in found["sweep.space.precision.mixed_precision"]
    assert "log range needs low above 0" in found["sweep.space.optim.eps"]
    assert "did you mean `high`" in found["sweep.space.scheduler.warmup_steps"]
    assert "cannot be searched" in found["sweep.space.output_dir"]
    assert "empty list" in found["sweep.space.training.seed"]


def test_values_the_schema_refuses_and_the_grid_are_checked_too():
    found = space_problems_of({"lr": {"low": 0.0, "high": 1e-2}, "optim.lr": [1e-3]})
    assert "greater than 0" in found["sweep.space.lr"]  # the schema's own reason (optim.lr > 0)
    assert "names optim.lr again" in found["sweep.space.optim.lr"]
    found = space_problems_of({"optim.lr": {"low": 1e-4, "high": 1e-2}}, sampler="grid")
    assert "without a step" in found["sweep.space.optim.lr"]
    found = space_problems_of({"training.micro_batch_size": [4, 8]}, sampler="grid", trials=3)
    assert "grid has 2 points" in found["sweep.trials"]
    warnings = resolve(overrides={"sweep.space": SPACE, "sweep.metric": "eval_los"}).warnings
    assert any(w.key == "sweep.metric" and "eval_loss" in w.message for w in warnings)


def _sweep_cli(tmp_path, capsys, *items) -> tuple[int, str]:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), "sweep": {"trials": 2, "space": SPACE}}))
    code = main(["sweep", str(config), *items])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("item, key", [
    ("sweep.space={\"optim.lrr\": [0.1]}", "sweep.space.optim.lrr"),
    ("sweep.space={\"optim.lr\": {\"low\": 0.1, \"high\": 0.01}}", "sweep.space.optim.lr"),
    ("sweep.space={\"training.micro_batch_size\": [4, \"x\"]}", "sweep.space.training.micro_batch_size"),
    ("sweep.space={}", "sweep.space"),
    ("sweep.storage=sqlite:////nonexistent-dir/sub/sweep.db", "sweep.storage"),
    ("sweep.storage=nosuchdb://x", "sweep.storage"),
])
def test_bad_input_exits_2_by_key_and_starts_no_trial(tmp_path, capsys, item, key):
    code, err = _sweep_cli(tmp_path, capsys, item)
    assert code == 2, err
    assert f"{key}:" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing made, no trial started


@pytest.mark.parametrize("existing", ["", "output_dir: somewhere\n", None])
def test_a_storage_naming_a_file_that_is_no_database_or_a_directory_is_refused_and_left_alone(tmp_path, capsys, existing):
    target = tmp_path / "mine"
    if existing is None:
        target.mkdir()
    else:
        target.write_text(existing)
    code, err = _sweep_cli(tmp_path, capsys, f"sweep.storage=sqlite:///{target}")
    assert code == 2, err
    assert "sweep.storage:" in err and str(target) in err and "Traceback" not in err
    assert existing is None or target.read_text() == existing
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the study's bookkeeping

def _job(tmp_path, **sweep):
    from overdrive.sweep import make_job

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), "training": {"max_steps": 7},
                                      "sweep": {"space": SPACE, **sweep}}))
    return make_job(resolve([config], cli=["training.seed=3"]), files=[str(config)], cli=["training.seed=3"])


def test_a_trial_whose_sweep_died_is_failed_and_queued_again_with_its_directory(tmp_path):
    import optuna
    from optuna.trial import TrialState

    from overdrive.sweep import open_study
    from overdrive.sweep import study as studies

    job = _job(tmp_path, trials=2)
    (tmp_path / "out").mkdir()
    study = open_study(job)
    trial = study.ask(studies.distributions(job.entries))
    trial.set_user_attr("output_dir", str(tmp_path / "out" / "trial-0000"))
    dead = {"host": studies.me()["host"], "pid": 2**22 + 7, "started": 1.0}  # no such process
    study._storage.set_trial_system_attr(trial._trial_id, studies.OWNER, dead)
    assert studies.reap(study) == [0]
    again = optuna.load_study(study_name=study.study_name, storage=studies.storage_url(job.config))
    first, retry = again.get_trials()
    assert (first.state, retry.state) == (TrialState.FAIL, TrialState.WAITING)
    assert retry.params == first.params and retry.user_attrs["output_dir"].endswith("trial-0000")
    assert studies.OWNER not in retry.system_attrs and retry.system_attrs["failed_trial"] == 0
    # The next ask takes the queued trial; a trial asked when the study is full is one too many.
    taken = study.ask(studies.distributions(job.entries))
    assert taken.number == 1 and taken.params == first.params
    other = study.ask(studies.distributions(job.entries))
    study.tell(taken, 1.0)
    assert not studies.excess(study, other.number, 2)
    assert studies.excess(study, other.number, 1)
    with pytest.raises(UserError, match="sweep.space"):  # the study is continued only with its own space
        open_study(replace(job, entries=job.entries[:1]))


def test_best_yaml_is_the_sweeps_config_with_the_best_values(tmp_path):
    import optuna

    from overdrive.sweep import open_study, outputs
    from overdrive.sweep import study as studies

    job = _job(tmp_path)
    (tmp_path / "out").mkdir()
    study = open_study(job)
    dists = studies.distributions(job.entries)
    for value, params in ((5.0, {"optim.lr": 1e-3, "training.micro_batch_size": 4}),
                          (4.0, {"optim.lr": 3e-3, "training.micro_batch_size": 8})):
        study.add_trial(optuna.create_trial(value=value, params=params, distributions=dists,
                                            user_attrs={"output_dir": "somewhere"}))
    path = outputs.write_best(job, study)
    best = resolve([path])
    assert best.config.optim.lr == 3e-3 and best.config.training.micro_batch_size == 8
    assert best.config.training.max_steps == 7 and best.config.training.seed == 3  # the file's and the command line's
    assert best.origins["optim.lr"].layer == "sweep" and best.origins["optim.lr"].line
    assert best.config.output_dir == str(tmp_path / "out" / "best")


def test_a_tail_reads_again_a_file_cut_back_by_a_resume(tmp_path):
    from overdrive.training.metrics import Tail

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    tail = Tail(path)
    assert [r["step"] for r in tail.records()] == [1, 2, 3]
    path.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")  # truncated to the checkpoint
    with path.open("a") as f:
        f.write(json.dumps({"step": 2, "loss": 0.5}) + "\n")
    assert [r["step"] for r in tail.records()] == [1, 2]


def test_default_config_has_an_empty_sweep_that_train_ignores():
    assert RunConfig().sweep.space == {} and RunConfig().sweep.metric == "eval_loss"


class _Run:
    """A stand-in for a trial process: each poll appends the next metrics line, then exits."""

    pid = 4242

    def __init__(self, output_dir: Path, records: list[dict], code: int):
        self.path, self.records, self.code, self.killed = output_dir / "metrics.jsonl", list(records), code, False

    def poll(self):
        if self.records:
            with self.path.open("a") as f:
                f.write(json.dumps(self.records.pop(0)) + "\n")
            return None
        return self.code

    def kill(self):
        self.killed = True


class _Starter:
    def __init__(self, records: list[dict], code: int = 0):
        self.records, self.code, self.started = records, code, []

    def start(self, task, path, log):
        run = _Run(Path(path).parent, self.records, self.code)
        self.started.append(run)
        return run


RECORDS = [{"step": 2, "loss": 6.0}, {"step": 4, "eval_loss": 5.5}, {"step": 6, "loss": 5.0},
           {"step": 8, "eval_loss": 5.1}]


def test_a_run_is_judged_by_the_last_value_of_its_metric_and_can_be_stopped_on_one(tmp_path):
    from overdrive.sweep.execute import execute

    seen = []
    starter = _Starter(RECORDS)
    done = execute("{}", tmp_path / "a", starter, "eval_loss", on_value=lambda s, v: seen.append((s, v)) or False,
                   poll_s=0)
    assert (done.status, done.value, done.step, seen) == ("finished", 5.1, 8, [(4, 5.5), (8, 5.1)])
    stopped = execute("{}", tmp_path / "b", _Starter(RECORDS), "eval_loss", on_value=lambda s, v: s >= 4, poll_s=0)
    assert (stopped.status, stopped.step) == ("stopped", 4)  # pruned at its first evaluation
    failed = execute("{}", tmp_path / "c", _Starter(RECORDS, code=1), "eval_loss", poll_s=0)
    assert failed.status == "failed" and "exit 1" in failed.reason
    missing = execute("{}", tmp_path / "d", _Starter(RECORDS[:1]), "eval_loss", poll_s=0)
    assert missing.status == "failed" and "no `eval_loss`" in missing.reason and "loss" in missing.reason
    assert all(run.killed for run in starter.started)  # nothing it started outlives it


def test_a_grid_study_told_its_last_trial_ends_without_optunas_stop_error():
    import optuna

    from overdrive.sweep.loop import _tell

    study = optuna.create_study(sampler=optuna.samplers.GridSampler({"x": [1, 2]}))
    for _ in range(2):  # the second tell is the grid's last: GridSampler calls study.stop()
        trial = study.ask({"x": optuna.distributions.CategoricalDistribution([1, 2])})
        _tell(study, trial, float(trial.params["x"]))
    assert len(study.trials) == 2 and all(t.state.name == "COMPLETE" for t in study.trials)
