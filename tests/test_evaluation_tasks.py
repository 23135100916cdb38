"""Benchmarks and sample answers in and after a run (eval.*, `overdrive eval`, `overdrive generate`).

The slow tests train one LoRA run of a 2-layer Llama saved locally on conversations whose answer
is always "the answer is yes", with a 20-row multiple-choice task of lm-eval (a task YAML on a
local jsonl, made here) at each evaluation: the task's accuracy in metrics.jsonl is lm-eval's
own `HFLM` on the saved adapter, `overdrive generate` answers as PeftModel's greedy generation does,
token for token, and a small sweep selects its trial by the task's accuracy.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import run_cli, run_here
from hf_fixtures import LETTERS, make_chat_data, make_tiny_llama

from overdrive.config.schema import RunConfig
from overdrive.errors import UserError
from overdrive.hf import benchmarks, generation
from overdrive.resolving import resolve

TASK = "tiny_mc"
ROWS = 20
STEPS = 20
PROMPTS = ["a b c", "x y z"]


def make_mc_task(directory: Path, rows: int = ROWS, seed: int = 0) -> Path:
    """An lm-eval multiple-choice task on a local jsonl: a chat prompt and three answers, the
    first the one the run's data teaches."""
    rng = random.Random(seed)
    data = directory / "mc.jsonl"
    with open(data, "w") as f:
        for _ in range(rows):
            letters = " ".join(rng.choice(LETTERS) for _ in range(6))
            f.write(json.dumps({"question": f"<user> {letters} <eos> <assistant> the answer is",
                                "choices": ["yes", "ok", rng.choice(LETTERS)], "label": 0}) + "\n")
    task = directory / "tiny_mc.yaml"
    task.write_text(f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
                    "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
                    "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
                    "  - metric: brier_score\n    higher_is_better: false\n")  # continuous: every log-likelihood counts
    return task


# ------------------------------------------------------------------ without training


def test_lm_eval_results_become_eval_task_metric_fields():
    results = {"tiny_mc": {"alias": "tiny_mc", "sample_len": 20, "acc,none": 0.35, "acc_stderr,none": 0.1,
                           "acc_norm,none": "N/A"},
               "gsm8k": {"exact_match,strict-match": 0.5, "exact_match,flexible-extract": 0.25}}
    table = benchmarks.numbers(results)
    assert table == {"tiny_mc": {"acc": 0.35, "acc_stderr": 0.1},
                     "gsm8k": {"exact_match_strict-match": 0.5, "exact_match_flexible-extract": 0.25}}
    assert benchmarks.as_metrics(table)["eval/tiny_mc/acc"] == 0.35


def test_a_benchmark_metric_is_a_sweep_objective_only_with_its_task(tmp_path):
    task = make_mc_task(tmp_path)
    resolved = resolve(overrides={"sweep.metric": f"eval/{TASK}/acc", "sweep.direction": "maximize",
                                  "eval.tasks": [str(task)]})
    assert not [w for w in resolved.warnings if w.key == "sweep.metric"]
    assert resolve(overrides={"sweep.metric": "eval/hellaswag/acc_norm", "eval.tasks": ["hellaswag"]})
    with pytest.raises(UserError) as caught:
        resolve(overrides={"sweep.metric": f"eval/{TASK}/acc"})
    assert any(p.key == "sweep.metric" and "eval.tasks" in p.message for p in caught.value.problems)
    with pytest.raises(UserError) as caught:
        resolve(overrides={"sweep.metric": "eval/arc_easy/acc", "eval.tasks": ["hellaswag"]})
    assert any(p.key == "sweep.metric" and "arc_easy" in p.message for p in caught.value.problems)


def test_prompts_and_task_files_are_checked_when_the_config_loads(tmp_path):
    listed = tmp_path / "prompts.txt"
    listed.write_text("first prompt\n\nsecond prompt\n")
    rows = tmp_path / "prompts.jsonl"
    rows.write_text(json.dumps({"prompt": "one"}) + "\n" + json.dumps({"prompt": "two"}) + "\n")
    assert generation.read_prompts(str(listed)) == ["first prompt", "second prompt"]
    assert generation.read_prompts(str(rows)) == ["one", "two"]
    assert generation.read_prompts(["a", "b"]) == ["a", "b"]
    with pytest.raises(UserError) as caught:
        resolve(overrides={"eval.prompts": str(tmp_path / "missing.txt"), "eval.tasks": [str(tmp_path / "no.yaml")]})
    keys = {p.key: p.message for p in caught.value.problems}
    assert "no such file" in keys["eval.prompts"] and "no such task file" in keys["eval.tasks"]
    with pytest.raises(UserError) as caught:
        resolve(overrides={"eval.prompts": ["hi"], "model.task": "sequence-classification"})
    assert any(p.key == "eval.prompts" for p in caught.value.problems)
    assert RunConfig().eval.tasks == [] and RunConfig().eval.prompts is None


def test_report_reads_benchmark_lines_as_evaluations_and_draws_them(tmp_path):
    from overdrive.reports.plots import plot_run
    from overdrive.reports.summary import load_run, summarize

    lines = [{"step": 5, "loss": 2.0}, {"step": 10, "loss": 1.5},
             {"step": 10, f"eval/{TASK}/acc": 0.5, f"eval/{TASK}/acc_stderr": 0.1},  # no eval_loss: no split
             {"step": 20, "loss": 1.0}, {"step": 20, f"eval/{TASK}/acc": 0.9, f"eval/{TASK}/acc_stderr": 0.05}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = load_run(tmp_path)
    assert [r["step"] for r in run.train] == [5, 10, 20] and [r["step"] for r in run.evals] == [10, 20]
    assert summarize(run)["benchmarks"] == {f"eval/{TASK}/acc": 0.9}
    written = plot_run(run, tmp_path)
    assert tmp_path / "benchmarks.png" in written


def test_greedy_is_the_models_own_greedy_generation(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_tiny_llama(tmp_path / "llama")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "llama")
    ids = generation.prompt_ids(tokenizer, "a b c")
    assert tokenizer.decode(ids) == "<user> a b c <eos> <assistant>"  # the chat template's user turn
    mine = generation.generated_ids(model, tokenizer, "a b c", generation.Sampling(max_new_tokens=6))
    with torch.no_grad():
        theirs = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6, pad_token_id=0)
    assert mine == theirs[0, len(ids):].tolist() and len(mine) >= 1


# ------------------------------------------------------------------ a run


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("evaluation")
    make_tiny_llama(root / "base")
    make_chat_data(root / "chat.jsonl", rows=80)
    make_mc_task(root)
    return root


def train_items(work: Path, out: str, *extra: str) -> list[str]:
    return ["train", f"model.name_or_path={work / 'base'}", f"data.source={work / 'chat.jsonl'}",
            f"data.cache_dir={work / 'cache'}", "data.format=chat", "data.max_length=64",
            "data.validation_fraction=0.1", "peft.method=lora", "peft.r=4", "peft.alpha=8",
            "training.micro_batch_size=4", "training.log_every_steps=5", "training.eval_batches=2",
            "optim.lr=0.02", "scheduler.name=constant", "scheduler.warmup_steps=0", "precision.mixed_precision=no",
            "launch.use_cpu=true", "logging.trackers=[none]", "logging.progress=false",
            f"eval.tasks=[{work / 'tiny_mc.yaml'}]", f"output_dir={work / out}", *extra]


@pytest.fixture(scope="module")
def lora_run(work) -> Path:
    done = run_cli(*train_items(work, "lora", f"training.max_steps={STEPS}", "training.eval_every_steps=10",
                                f"eval.prompts={json.dumps(PROMPTS)}", "eval.max_new_tokens=5"), cwd=work)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "sample at step 10: a b c ->" in done.stdout + done.stderr
    return work / "lora"


def lm_eval_scores(base: Path, adapter: Path, task: Path) -> tuple[float, float]:
    """lm-eval's own run, as `lm-eval --model hf --model_args pretrained=BASE,peft=ADAPTER` does it."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    lm = HFLM(pretrained=str(base), peft=str(adapter), device="cpu", batch_size=8)
    theirs = simple_evaluate(model=lm, tasks=[load_yaml(str(task), resolve_func=True)],
                             task_manager=TaskManager(include_defaults=False), log_samples=False)
    return theirs["results"][TASK]["acc,none"], theirs["results"][TASK]["brier_score,none"]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_in_run_accuracy_is_lm_evals_own_on_the_saved_adapter(work, lora_run):
    evals = [r for r in records(lora_run) if f"eval/{TASK}/acc" in r]
    assert [r["step"] for r in evals] == [10, STEPS]
    assert all("eval_loss" in r for r in evals)  # one evaluation: the loss and the tasks
    acc, brier = lm_eval_scores(work / "base", lora_run / "model", work / "tiny_mc.yaml")
    assert evals[-1][f"eval/{TASK}/acc"] == acc
    assert evals[-1][f"eval/{TASK}/brier_score"] == pytest.approx(brier, rel=1e-6, abs=1e-9)
    print(f"in-run at step {STEPS}: acc {acc}, brier_score {evals[-1][f'eval/{TASK}/brier_score']!r} "
          f"(lm-eval's own: {brier!r}); at step 10: {evals[0][f'eval/{TASK}/brier_score']!r}")
    assert evals[-1][f"eval/{TASK}/acc"] == 1.0  # the trained answer is the first choice of every row
    # `overdrive eval` of the finished run: the same number, one JSON object.
    done = run_cli("eval", str(lora_run), "--tasks", str(work / "tiny_mc.yaml"), "--json", cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["results"][TASK]["acc"] == evals[-1][f"eval/{TASK}/acc"]
    # and `overdrive report` draws the task
    done = run_cli("report", str(lora_run), cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (lora_run / "report" / "benchmarks.png").is_file()
    assert f"| final `eval/{TASK}/acc` | 1 |" in (lora_run / "report" / "summary.md").read_text()


@pytest.mark.slow
def test_samples_hold_every_prompts_answer_at_each_evaluation(lora_run):
    samples = [json.loads(line) for line in (lora_run / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt"]) for s in samples] == [(step, p) for step in (10, STEPS) for p in PROMPTS]
    assert all(s["answer"] == "the answer is yes" for s in samples if s["step"] == STEPS), samples


@pytest.mark.slow
def test_generate_answers_as_peft_models_greedy_generation(work, lora_run):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = run_cli("generate", str(lora_run), "q r s", "--max-new-tokens", "8", "--json", cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    answered = json.loads(done.stdout)
    tokenizer = AutoTokenizer.from_pretrained(lora_run / "model")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(work / "base"), str(lora_run / "model"))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "q r s"}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        theirs = model.generate(input_ids=torch.tensor([ids]), do_sample=False, max_new_tokens=8, pad_token_id=0)
    assert answered["tokens"] == theirs[0, len(ids):].tolist()
    assert answered["answer"] == "the answer is yes"  # the trained behaviour, on a prompt it never saw
    streamed = run_cli("generate", str(lora_run), "q r s", "--max-new-tokens", "8", cwd=work)
    assert streamed.returncode == 0 and streamed.stdout.strip() == "the answer is yes", streamed.stderr[-2000:]


@pytest.mark.slow  # indexing lm-eval's registry reads its thousands of task files
def test_a_task_name_lm_eval_does_not_know_is_refused_with_the_nearest(tmp_path):
    with pytest.raises(UserError) as caught:
        benchmarks.check_tasks(["arc_easi"], "eval.tasks")
    problem = caught.value.problems[0]
    assert problem.key == "eval.tasks" and "'arc_easy'" in problem.message
    benchmarks.check_tasks([str(make_mc_task(tmp_path))], "eval.tasks")  # a task file
    try:  # a known name: refused, if at all, for its hub data on a machine without a network, never by name
        benchmarks.check_tasks(["arc_easy"], "eval.tasks")
    except UserError as error:
        assert "cannot read its data" in error.render() and "did you mean" not in error.render()


@pytest.mark.slow
def test_a_sweep_judged_by_the_tasks_accuracy_selects_the_trial_that_learned(work):
    """Two trials (a learning rate that teaches the answer, one too small to), judged by
    `eval/tiny_mc/acc` at the end of each: the first is the best, valued at its own last accuracy."""
    import optuna
    import yaml

    config = work / "sweep.yaml"
    # The random sampler at seed 0 draws each choice once in two trials.
    config.write_text(yaml.safe_dump({"sweep": {"trials": 2, "sampler": "random", "seed": 0, "metric": f"eval/{TASK}/acc",
                                                "direction": "maximize", "space": {"optim.lr": [0.02, 1e-6]}}}))
    items = [i for i in train_items(work, "sweep", "training.max_steps=12", "training.eval_every_steps=null",
                                     "checkpoint.save_final_model=false") if i != "train" and not i.startswith("optim.lr")]
    done = run_cli("sweep", str(config), *items, cwd=work, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{work / 'sweep' / 'sweep.db'}")
    values = {t.params["optim.lr"]: t.value for t in study.trials}
    assert values[0.02] == 1.0 and values[1e-6] < 1.0, values
    assert study.best_trial.params["optim.lr"] == 0.02
    best_run = Path(study.best_trial.user_attrs["output_dir"])
    assert [r[f"eval/{TASK}/acc"] for r in records(best_run) if f"eval/{TASK}/acc" in r][-1] == study.best_value
    assert yaml.safe_load((work / "sweep" / "best.yaml").read_text())["optim"]["lr"] == 0.02


@pytest.mark.slow
def test_under_fsdp2_the_shards_are_gathered_and_scored_as_the_saved_adapter(work):
    """Two processes over gloo, the LoRA model sharded by FSDP2: each evaluation gathers the weights
    as the final save does and the main process alone scores and answers."""
    from conftest import free_port

    done = run_cli(*train_items(work, "fsdp2", "training.max_steps=6", "training.eval_every_steps=3",
                                "parallel.strategy=fsdp", "launch.num_processes=2", "training.micro_batch_size=2",
                                f"launch.main_process_port={free_port()}", "eval.prompts=[a b c]",
                                "eval.max_new_tokens=4"), cwd=work, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = work / "fsdp2"
    evals = [r for r in records(run) if f"eval/{TASK}/acc" in r]
    assert [r["step"] for r in evals] == [3, 6]
    acc, brier = lm_eval_scores(work / "base", run / "model", work / "tiny_mc.yaml")
    assert evals[-1][f"eval/{TASK}/acc"] == acc
    assert evals[-1][f"eval/{TASK}/brier_score"] == pytest.approx(brier, rel=1e-6, abs=1e-9)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [3, 6]  # one process answers
    assert not (run / ".eval-model").exists()


@pytest.mark.slow
def test_generate_on_a_terminal_answers_one_prompt_after_another(tmp_path):
    """No PROMPT on a terminal: a conversation, each answer streamed, an empty line to leave; the
    answers are the model's greedy ones."""
    import os
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    pexpect = pytest.importorskip("pexpect")
    make_tiny_llama(tmp_path / "llama")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "llama")
    expected = [generation.answers(model, tokenizer, [prompt], generation.Sampling(max_new_tokens=4))[0]
                for prompt in ("a b", "c d")]
    assert all(expected)  # a random model still writes tokens
    child = pexpect.spawn(sys.executable, ["-m", "overdrive.cli", "generate", str(tmp_path / "llama"),
                                           "--max-new-tokens", "4"], env=dict(os.environ), encoding="utf-8",
                          timeout=120, dimensions=(40, 140))
    for prompt, answer in zip(("a b", "c d"), expected):
        child.expect("> ")
        child.sendline(prompt)
        child.expect_exact(prompt)  # the terminal's echo, then the answer
        child.expect_exact(answer)
    child.expect("> ")
    child.sendline("")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_the_hints_after_a_run_say_how_to_talk_to_the_model(capsys):
    from types import SimpleNamespace

    from overdrive.commands.train import _summary

    cfg = resolve([], cli=["output_dir=runs/x"], accelerate_default=False).config
    _summary(SimpleNamespace(output_dir=Path("runs/x"), first_loss=None, eval={}), cfg, ["run.yaml"])
    assert "overdrive generate runs/x    # talk to the trained model" in capsys.readouterr().out


def test_a_resumed_run_answers_again_from_its_checkpoint_without_repeating_lines(tmp_path):
    from overdrive.training import benchmark_eval

    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"step": s, "prompt": "p", "answer": "a"}) + "\n" for s in (10, 20, 30)))
    benchmark_eval._drop_from(samples, 20)  # the run resumed from step 10's checkpoint evaluates step 20 again
    assert [json.loads(line)["step"] for line in samples.read_text().splitlines()] == [10]


def test_generate_with_empty_piped_input_is_refused_before_a_model_loads(monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    done = run_here("generate", "no/such-model-anywhere")
    assert done.returncode == 2 and "PROMPT" in done.stderr and "pipe it in" in done.stderr, done.stderr


@pytest.mark.slow
def test_generate_reads_its_prompt_from_piped_input_without_library_noise(tmp_path):
    """`echo PROMPT | overdrive generate MODEL`: the piped text is the prompt, answered as given as
    an argument; no weight-loading bar on stderr."""
    import subprocess
    import sys

    make_tiny_llama(tmp_path / "llama")
    command = [sys.executable, "-m", "overdrive.cli", "generate", str(tmp_path / "llama"), "--max-new-tokens", "4",
               "--json"]
    piped = subprocess.run(command, input="a b\n", capture_output=True, text=True, timeout=300)
    given = subprocess.run(command + ["a b"], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert piped.returncode == 0, piped.stderr[-2000:]
    assert json.loads(piped.stdout) == json.loads(given.stdout)
    assert "Loading weights" not in piped.stderr and "it/s" not in piped.stderr, piped.stderr
