"""A stored run config (resolved.json, a checkpoint's trainer_state.json) read back into a RunConfig:
config_version written beside it, an older config migrated (defaults for the keys it lacks), and
one that cannot be read refused by file, with exit code 2 from `overdrive report`."""

from __future__ import annotations

import json

import pytest
from conftest import cfg_of, run_here

from overdrive.config import stored
from overdrive.config.stored import CONFIG_VERSION, read_stored
from overdrive.errors import UserError
from overdrive.resolving import Resolved


def _written_before_the_pipeline_axis() -> dict:
    """A config as runs wrote it before config_version, parallel.pp_* and parallel.ep_size existed."""
    config = cfg_of("parallel.strategy=fsdp", "launch.num_processes=2").model_dump(mode="json")
    for key in ("pp_size", "pp_schedule", "pp_microbatches", "pp_stages_per_rank", "ep_size"):
        del config["parallel"][key]
    return {"config": config}


def test_an_older_config_reads_back_with_the_defaults_of_the_keys_it_lacks():
    cfg = read_stored(_written_before_the_pipeline_axis(), "runs/old/resolved.json")
    assert cfg.parallel.strategy == "fsdp" and cfg.launch.num_processes == 2
    assert (cfg.parallel.pp_size, cfg.parallel.pp_schedule, cfg.parallel.ep_size) == (1, "1f1b", 1)
    from overdrive.strategies import pipeline, registry

    assert pipeline.pp_size(cfg) == 1 and registry.of(cfg).label(cfg).startswith("fsdp2")


def test_a_config_that_cannot_be_read_is_refused_naming_the_file_and_key():
    with pytest.raises(UserError) as refused:
        read_stored({"config": {"parallel": {"stratgy": "fsdp"}}}, "runs/x/resolved.json")
    problem = refused.value.problems[0]
    assert (problem.key, problem.where) == ("parallel.stratgy", "runs/x/resolved.json")
    assert "parallel.strategy" in problem.message
    with pytest.raises(UserError, match="1 problem") as newer:
        read_stored({"config_version": CONFIG_VERSION + 1, "config": {}}, "step-3/trainer_state.json")
    assert "newer" in newer.value.problems[0].message and newer.value.problems[0].where == "step-3/trainer_state.json"
    with pytest.raises(UserError):
        read_stored({"steps": 3}, "resolved.json")


def test_renamed_and_dropped_keys_are_migrated_for_configs_older_than_the_change(monkeypatch):
    # The history has no rename yet: the table's rule, shown on a made-up one.
    monkeypatch.setattr(stored, "RENAMED", {2: {"training.seed": ("data.seed", "moved with the data order")}})
    monkeypatch.setattr(stored, "DROPPED", {2: {"logging.color": "always on"}})
    old = {"training": {"seed": 7, "max_steps": 5}, "logging": {"color": False}}
    migrated, notes = stored.migrate(old, 1)
    assert migrated == {"training": {"max_steps": 5}, "data": {"seed": 7}}
    assert notes == ["training.seed -> data.seed: moved with the data order", "logging.color dropped: always on"]
    assert stored.migrate(old, 2)[0] == old  # written after the change: as it is


def test_resolved_json_carries_its_config_version_and_reads_back(tmp_path):
    resolved = Resolved(config=cfg_of("optim.lr=3e-4"), origins={})
    data = json.loads(resolved.to_json())
    assert data["config_version"] == CONFIG_VERSION and set(data) >= {"config", "origins"}
    del data["config_version"], data["config"]["parallel"]["pp_size"]  # as an older overdrive wrote it
    back = Resolved.from_json(json.dumps(data), environ={})
    assert back.config.optim.lr == 3e-4 and back.config.parallel.pp_size == 1


def test_report_reads_an_older_resolved_json_and_refuses_an_unreadable_one(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (run / "resolved.json").write_text(json.dumps(_written_before_the_pipeline_axis()))
    from overdrive.reports.summary import load_run, summarize

    summary = summarize(load_run(run))
    assert summary["strategy"].startswith("fsdp2") and summary["world_size"] == 2
    (run / "resolved.json").write_text(json.dumps({"config": {"training": {"max_steps": "many"}}}))
    result = run_here("report", str(run))
    assert result.returncode == 2 and "resolved.json" in result.stderr and "training.max_steps" in result.stderr
    assert "Traceback" not in result.stderr
