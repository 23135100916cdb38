"""Resuming in one module: the plan is judged once and reaches the workers whole (route
included), so a worker compares no fingerprints; the loop's state is saved and restored whole."""

from __future__ import annotations

import json

import pytest

from overdrive.checkpoint import fingerprint, resume, store
from overdrive.resolving import Resolved, resolve


def write_checkpoint(cfg, step=4):
    root = store.checkpoints_dir(cfg.output_dir)
    tmp = store.begin(root, step)
    (tmp / resume.TRAINER_STATE).write_text(json.dumps({"lineage": "x", "config": cfg.model_dump(mode="json")}))
    store.commit(tmp, step)


def test_the_plan_is_judged_once_and_handed_to_the_workers_whole(tmp_path, monkeypatch):
    out = tmp_path / "run"
    saved = resolve(cli=[f"output_dir={out}", "training.micro_batch_size=4", "launch.num_processes=2"], env={})
    write_checkpoint(saved.config)
    launcher = resolve(cli=[f"output_dir={out}", "training.micro_batch_size=4"], env={})
    judged = resume.judge_resume(launcher)  # what `overdrive train` does before it starts the workers
    assert judged.config.training.gradient_accumulation_steps == 2  # the global batch of 8, kept on 1 process
    assert judged.origins["training.gradient_accumulation_steps"].layer == "resume"
    assert judged.resume["route"]["how"] == "accelerate"

    handed = Resolved.from_json(judged.to_json())  # what a worker reads
    monkeypatch.setattr(fingerprint, "compare", lambda *a, **k: pytest.fail("a worker compared again"))
    plan = resume.resume_plan(handed)
    assert plan.checkpoint is not None and plan.checkpoint.name == "step-00000004"
    assert plan.route.how == "accelerate" and plan.route.source_world == 2 and plan.route.reshards
    assert plan.config.training.gradient_accumulation_steps == 2 and plan.notes == judged.resume["notes"]


def test_a_hand_off_without_a_route_is_judged_again(tmp_path):
    out = tmp_path / "run"
    cfg = resolve(cli=[f"output_dir={out}"], env={})
    write_checkpoint(cfg.config)
    older = Resolved(config=cfg.config, origins=cfg.origins,
                     resume={"checkpoint": str(store.checkpoints_dir(out) / "step-00000004"), "force": False, "notes": []})
    plan = resume.resume_plan(older)
    assert plan.route is not None and plan.route.how == "as saved"


def test_the_loop_state_is_saved_and_restored_whole():
    from overdrive.training.loop import LoopState

    state = LoopState(step=7, epoch=1, batch_in_epoch=3, tokens_seen=900, nonfinite_in_a_row=1, loss_sum=2.5,
                      micro_steps=2, first_loss=5.0, final_loss=4.0)
    saved = state.state_dict()
    assert "loss_sum" not in saved  # on the device: the checkpoint gathers it from every rank
    again = LoopState()
    again.load_state_dict(json.loads(json.dumps(saved)))
    assert again == LoopState(step=7, epoch=1, batch_in_epoch=3, tokens_seen=900, nonfinite_in_a_row=1,
                              micro_steps=2, first_loss=5.0, final_loss=4.0)


def test_a_data_file_rewritten_in_place_is_a_change_of_the_math_touching_it_is_not(tmp_path):
    from overdrive.errors import UserError

    data, out = tmp_path / "prompts.jsonl", tmp_path / "run"
    data.write_text('{"text": "the first rows"}\n' * 40)
    cfg = resolve(cli=[f"output_dir={out}", f"data.source={data}"], env={}).config
    root = store.checkpoints_dir(cfg.output_dir)
    tmp = store.begin(root, 4)
    (tmp / resume.TRAINER_STATE).write_text(json.dumps({"lineage": "x", "config": cfg.model_dump(mode="json"),
                                                        "data_content": fingerprint.data_content(cfg)}))
    store.commit(tmp, 4)
    data.touch()  # the same bytes: resumed as before
    assert resume.plan_resume(cfg).checkpoint.name == "step-00000004"
    data.write_text('{"text": "other rows, same path"}\n' * 40)  # the config's values cannot show this
    with pytest.raises(UserError) as refused:
        resume.plan_resume(cfg)
    assert fingerprint.DATA_CONTENT in refused.value.render() and "--force" in refused.value.render()
    assert resume.plan_resume(cfg, force=True).checkpoint.name == "step-00000004"
    assert fingerprint.data_content(resolve(cli=["data.source=org/hub-data"], env={}).config) is None
