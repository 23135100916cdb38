"""The run config settled once: the resume judged once and handed over, changed values with their origin."""

from __future__ import annotations

import json

from overdrive.resolving import Resolved, resolve
from overdrive.training.build import settle


def resolved_in(tmp_path, *cli):
    return resolve(cli=[f"output_dir={tmp_path / 'run'}", *cli], env={})


def test_the_judgement_travels_in_the_resolved_file_beside_the_shape_it_had(tmp_path):
    judged = settle.judge_resume(resolved_in(tmp_path), force=False)
    data = json.loads(judged.to_json())
    assert {"config", "origins", "origin_records"} <= data.keys()
    assert data["resume"] == {"checkpoint": None, "force": False, "notes": []}
    assert Resolved.from_json(judged.to_json()).resume == data["resume"]


def test_a_worker_takes_the_handed_judgement_while_its_checkpoint_is_still_the_newest(tmp_path):
    resolved = resolved_in(tmp_path)
    handed = Resolved(config=resolved.config, origins=resolved.origins,
                      resume={"checkpoint": None, "force": True, "notes": ["said by the launcher"]})
    plan = settle.resume_plan(handed)
    assert plan.checkpoint is None and plan.notes == ["said by the launcher"] and plan.force
    # Without a handed judgement the worker judges for itself.
    assert settle.resume_plan(resolved).notes == []


def test_the_auto_micro_batch_gets_its_own_origin(tmp_path):
    resolved = resolved_in(tmp_path, "training.micro_batch_size=auto", "training.global_batch_size=16")
    t = resolved.config.training.model_copy(update={"micro_batch_size": 8, "gradient_accumulation_steps": 2})
    final = resolved.config.model_copy(update={"training": t})
    settled = settle._with_auto(resolved, final, "cpu")
    assert settled.config.training.micro_batch_size == 8
    for key in ("training.micro_batch_size", "training.gradient_accumulation_steps"):
        assert settled.origins[key].layer == "auto"
    assert settled.origins["output_dir"] == resolved.origins["output_dir"]


def test_a_bare_run_config_is_settled_too(tmp_path):
    cfg = resolved_in(tmp_path).config
    settled = settle.settle(cfg, False, build=lambda c: "accelerator")
    assert settled.config == cfg and settled.accelerator == "accelerator"
    assert json.loads(settled.resolved.to_json())["config"]["output_dir"] == str(tmp_path / "run")
