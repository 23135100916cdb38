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


def test_a_max_steps_that_makes_many_epochs_of_the_data_is_said():
    from overdrive.config.length import passes_note
    from overdrive.resolving import load_config

    cfg = load_config(cli=["training.max_steps=500"], env={})
    said = passes_note(cfg, samples=1200, global_batch=1200)
    assert len(said) == 1 and "500 epochs" in said[0] and "training.num_epochs" in said[0]
    assert passes_note(cfg, samples=1_000_000, global_batch=8) == []  # 0.004 epochs: nothing to say
    epochs = load_config(cli=["training.num_epochs=300"], env={})
    assert passes_note(epochs, samples=1200, global_batch=8) == []  # the user counted in epochs


def test_the_end_of_run_listing_names_every_folder_the_run_wrote(tmp_path):
    from overdrive.commands.run_listing import listing
    from overdrive.resolving import load_config

    for name in ("checkpoints", "model", "observe", "overdrive"):
        (tmp_path / name).mkdir()
    for name in ("metrics.jsonl", "resolved.json", ".overdrive-lock"):
        (tmp_path / name).write_text("")
    said = listing(load_config(cli=[], env={}), tmp_path)
    assert said.startswith("metrics.jsonl, resolved.json")
    assert "checkpoints/" in said and "model/ (save_pretrained)" in said and "observe/" in said
    assert "overdrive/ (the tracker's logs)" in said and ".overdrive-lock" not in said


def test_the_next_lines_offer_no_run_the_rules_refuse():
    from pathlib import Path

    from overdrive.commands.next_steps import next_lines
    from overdrive.resolving import load_config

    items = [*PIPELINE[:-1], "launch.use_cpu=true"]
    said = "\n".join(next_lines(load_config(cli=items, env={}), Path("runs/p"), items))
    assert "deepspeed" not in said  # DeepSpeed beside pipeline stages is refused by key
    plain = "\n".join(next_lines(load_config(cli=[], env={}), Path("runs/x"), []))
    assert "parallel.strategy=deepspeed" in plain and "parallel.strategy=fsdp" in plain
    # A hint that moves to another strategy leaves the one it leaves behind's own settings out.
    zero3 = ["parallel.strategy=deepspeed", "zero=3", "launch.num_processes=2"]
    [fsdp] = [line for line in next_lines(load_config(cli=zero3, env={}), Path("runs/z"), zero3) if "FSDP2" in line]
    assert "parallel.strategy=fsdp" in fsdp and "zero" not in fsdp.split("#")[0]


def test_a_final_checkpoint_cut_short_is_not_called_complete(tmp_path):
    from dataclasses import replace

    from overdrive.checkpoint.finished import finished
    from overdrive.resolving import resolve

    step = tmp_path / "run" / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (tmp_path / "run" / "model").mkdir()
    (step / "trainer_state.json").write_text(json.dumps({"step": 2, "config": {"training": {"max_steps": 2}}}))
    resolved = resolve([], cli=["training.max_steps=2", f"output_dir={tmp_path / 'run'}"], env={},
                       accelerate_default=False)
    assert finished(replace(resolved, resume={"checkpoint": str(step)})) is None  # no manifest: not whole
