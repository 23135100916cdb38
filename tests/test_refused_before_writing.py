"""Every refusal before anything is written: an eval task, its data, or a reward function that
cannot be read stops `train` by key before the output directory, resolved.json or the lock exist;
an evaluation that fails after training never costs the saved model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli, run_here
from hf_fixtures import make_tiny_llama

from overdrive.errors import UserError
from overdrive.hf import task_data

QUICK = ["training.max_steps=2", "launch.use_cpu=true", "logging.trackers=[none]", "logging.progress=false",
         "precision.mixed_precision=no"]


def refused_without_writing(tmp_path: Path, *items: str) -> str:
    out = tmp_path / "out"
    done = run_here("train", f"output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", *QUICK, *items)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "output in" not in done.stdout
    assert not out.exists(), sorted(p.name for p in out.iterdir())  # no directory, resolved.json or lock
    return done.stderr


def task_yaml(directory: Path, data: Path, name: str = "tiny_task") -> Path:
    task = directory / f"{name}.yaml"
    task.write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
                    "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n")
    return task


def test_a_malformed_task_yaml_is_refused_before_the_output_directory_exists(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: [unclosed\n")
    assert "eval.tasks" in refused_without_writing(tmp_path, f"eval.tasks=[{bad}]")


def test_a_task_whose_data_file_is_missing_is_refused_before_training(tmp_path):
    task = task_yaml(tmp_path, tmp_path / "nowhere.jsonl")
    said = refused_without_writing(tmp_path, f"eval.tasks=[{task}]")
    assert "eval.tasks" in said and "nowhere.jsonl" in said and "does not exist" in said


def test_a_reward_module_that_does_not_import_is_refused_before_the_output_directory_exists(tmp_path):
    llama = make_tiny_llama(tmp_path / "base")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w}", "answer": w}) + "\n" for w in ("yes", "ok") * 8))
    said = refused_without_writing(
        tmp_path, f"model.name_or_path={llama}", f"data.source={prompts}", "data.format=prompts", "data.max_length=64",
        "rl.method=grpo", "rl.num_generations=4", "training.micro_batch_size=4",
        "rl.reward_funcs=[{function: no_such_module_here:score}]")
    assert "rl.reward_funcs[0].function" in said and "no_such_module_here" in said


def test_hub_and_url_data_without_a_network_or_cache_are_refused_at_once(monkeypatch):
    from overdrive import hub

    monkeypatch.setattr(hub, "unreachable", lambda: "huggingface.co cannot be resolved")
    spec = {"task": "hub_task", "dataset_path": "someone/not-cached-anywhere"}
    with pytest.raises(UserError) as caught:
        task_data.check_task_data([spec], manager=None, key="--tasks")
    problem = caught.value.problems[0]
    assert problem.key == "--tasks" and "not in the local cache" in problem.message
    assert "hf download --repo-type dataset someone/not-cached-anywhere" in problem.fix
    # a task YAML downloading its data file: refused while its host is plainly unreachable
    monkeypatch.setattr(hub, "url_unreachable", lambda url: "example.com cannot be resolved")
    spec = {"task": "url_task", "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": "https://example.com/never-downloaded-here.jsonl"}}}
    with pytest.raises(UserError) as caught:
        task_data.check_task_data([spec], manager=None, key="eval.tasks")
    assert caught.value.problems[0].key == "eval.tasks" and "example.com cannot be resolved" in str(caught.value)
    # a group's task, and a local file that is there, pass or are named the same way
    task_data.check_task_data([{"group": "g", "task": [{"task": "t", "dataset_path": "json",
                                                          "dataset_kwargs": {"data_files": __file__}}]}], None, "k")


@pytest.mark.slow
def test_a_closing_evaluation_that_fails_keeps_the_saved_model_and_says_so(tmp_path):
    """The task passes every check (its file, its data, its code imports) and fails when it runs:
    its own process_docs raises, as a task's code can."""
    data = tmp_path / "mc.jsonl"
    data.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "label": 0}) + "\n")
    (tmp_path / "failing_docs.py").write_text(
        "def process_docs(dataset):\n    raise RuntimeError('the task code failed')\n")
    task = task_yaml(tmp_path, data)
    task.write_text(task.read_text() + "process_docs: !function failing_docs.process_docs\n")
    out = tmp_path / "out"
    done = run_cli("train", f"output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", *QUICK,
                   f"eval.tasks=[{task}]", cwd=tmp_path)
    said = done.stderr
    assert done.returncode == 1, done.stdout[-2000:] + said[-3000:]
    assert "closing evaluation failed: RuntimeError: the task code failed" in said and "Traceback" not in said
    assert (out / "model" / "config.json").is_file()  # saved before the evaluation
    assert "RuntimeError" in (out / "lm-eval.log").read_text()  # the traceback, kept for whoever looks
