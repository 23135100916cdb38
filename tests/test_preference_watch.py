"""A preference run can be watched: its progress lines show rewards/accuracies and margins, its
last lines and summary.md carry the preference metrics, and a short run logs often enough to see
them move."""

from __future__ import annotations

import json
from pathlib import Path

from overdrive.resolving import resolve

RECORDS = [{"step": 1, "loss": 0.6931, "rewards/accuracies": 0.0, "rewards/margins": 0.0, "rewards/chosen": 0.0,
            "rewards/rejected": 0.0, "lr": 1e-3},
           {"step": 2, "loss": 0.61, "rewards/accuracies": 0.875, "rewards/margins": 0.21, "rewards/chosen": 0.1,
            "rewards/rejected": -0.11, "lr": 1e-3},
           {"step": 2, "eval_loss": 0.6, "eval_rewards/accuracies": 0.75, "eval_rewards/margins": 0.18}]


def test_the_progress_line_shows_accuracies_and_margins():
    from overdrive.training.telemetry import _format

    line = _format(RECORDS[1])
    assert line.startswith("loss 0.6100  rewards/accuracies 0.8750  rewards/margins 0.2100  lr")
    assert "eval_rewards/accuracies 0.7500" in _format(RECORDS[2])
    assert "rewards" not in _format({"loss": 2.0, "lr": 1e-3})  # other runs' lines unchanged
    assert "kl 0.0300" in _format({"loss": 0.5, "kl": 0.03})  # KTO's


def test_the_last_lines_and_summary_md_carry_the_preference_metrics(tmp_path):
    from overdrive.commands.train import _objective_lines
    from overdrive.reports.summary import load_run, summarize, summary_markdown

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    lines = _objective_lines(tmp_path)
    assert "rewards/accuracies 0.0000 -> 0.8750" in lines and "rewards/margins 0.0000 -> 0.2100" in lines
    run = load_run(tmp_path)
    s = summarize(run)
    assert (s["final_rewards/accuracies"], s["final_eval_rewards/margins"], s["final_kl"]) == (0.875, 0.18, None)
    text = summary_markdown(run, s, [])
    assert "| final rewards/accuracies | 0.875 |" in text and "| final eval rewards/margins | 0.18 |" in text
    assert "kl" not in text  # not recorded: not shown
    assert _objective_lines(tmp_path / "nowhere") == []
    # An RL run's reward, the number its loss does not show
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.0, "reward": r}) + "\n"
                                                    for s, r in ((1, 0.25), (2, 1.0))))
    assert _objective_lines(tmp_path) == ["reward 0.2500 -> 1.0000"]
    assert summarize(load_run(tmp_path))["final_reward"] == 1.0


def test_a_short_run_logs_at_least_about_20_times_unless_told():
    def every(*items: str) -> int:
        return resolve((), cli=list(items), env={}).config.training.log_every_steps

    assert (every("training.max_steps=20"), every("training.max_steps=100"), every("training.max_steps=1000")) == \
        (1, 5, 10)
    assert every("training.max_steps=20", "training.log_every_steps=10") == 10  # set: kept
    r = resolve((), cli=["training.max_steps=20"], env={})
    assert r.origins["training.log_every_steps"].layer == "derived"


def test_a_tool_files_logging_steps_is_kept(monkeypatch):
    fixtures = Path(__file__).parent / "fixtures" / "interop"
    monkeypatch.chdir(fixtures)
    c = resolve([fixtures / "llamafactory-lora-dpo.yaml"], cli=["training.max_steps=20"], env={},
                accelerate_default=False).config
    assert c.training.log_every_steps == 10
