"""What is said agrees with what is done: plan's verdict is the layout's asked (a pipeline's
stages, not a data-parallel row), a run whose max_steps make many epochs of its data says so,
and the end-of-run listing names every folder the run wrote."""

from __future__ import annotations

import json

PIPELINE = ["model.architecture.model_type=llama", "model.architecture.num_hidden_layers=4",
            "model.architecture.tie_word_embeddings=false", "parallel.pp_size=2", "launch.num_processes=2",
            "training.gradient_accumulation_steps=4"]


def test_plan_of_a_pipeline_gives_the_verdict_of_its_stages(capsys):
    from overdrive.cli import main

    # The stages need 8.75 and 7.61 GiB; the same model under DDP on each device 15.06 GiB.
    assert main(["plan", *PIPELINE, "--gpu-memory", "10"]) == 0
    text = capsys.readouterr().out
    memory = [line for line in text.splitlines() if line.startswith("memory")][0]
    assert "pipeline" in memory and "DDP" not in memory and "8.75 GiB" in memory, text
    assert "does NOT fit" not in text and "fits in 10 GiB per GPU" in text
    assert main(["plan", *PIPELINE, "--gpu-memory", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pipeline"]["fits"] is True
    assert main(["plan", *PIPELINE, "--gpu-memory", "9"]) == 0
    assert "does NOT fit in 9 GiB" in capsys.readouterr().out
