"""The preference stages of Axolotl, LLaMA-Factory and torchtune configs read onto `preference.*`
(fixtures in tests/fixtures/interop/, after those projects' example files): every mapped key with
its file:line, the data set's layout and columns, and what has no counterpart refused by the file's key."""

from __future__ import annotations

from pathlib import Path

import pytest

from overdrive.errors import UserError
from overdrive.resolving import resolve

FIXTURES = Path(__file__).parent / "fixtures" / "interop"


def line_of(name: str, text: str) -> int:
    return next(i for i, line in enumerate((FIXTURES / name).read_text().splitlines(), 1) if line.strip().startswith(text))


def resolved(path: Path, *cli: str):
    return resolve([path], cli=list(cli), env={}, accelerate_default=False)


def refusal(tmp_path: Path, name: str, text: str) -> tuple[list[str], str]:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UserError) as error:
        resolve([path], env={}, accelerate_default=False)
    return [p.key for p in error.value.problems], error.value.render()


def test_llamafactory_dpo_maps_stage_beta_loss_lora_and_its_sharegpt_pairs(monkeypatch):
    monkeypatch.chdir(FIXTURES)
    r = resolved(Path("llamafactory-lora-dpo.yaml"))
    c, name = r.config, "llamafactory-lora-dpo.yaml"
    assert (c.preference.method, c.preference.beta, c.data.format) == ("dpo", 0.1, "preference")
    assert r.origins["preference.method"].line == line_of(name, "pref_loss:")
    assert r.origins["preference.beta"].line == line_of(name, "pref_beta:")
    assert (c.peft.method, c.peft.r, c.peft.alpha, c.peft.target_modules) == ("lora", 8, 16.0, "all-linear")
    assert (c.data.layout, c.data.messages_column, c.data.chosen_column, c.data.rejected_column) == \
        ("sharegpt", "conversations", "chosen", "rejected")
    assert Path(c.data.source).name == "dpo_en_demo.json" and c.data.max_length == 2048
    assert (c.training.micro_batch_size, c.training.gradient_accumulation_steps, c.optim.lr) == (1, 8, 5e-6)


def test_llamafactory_kto_and_rm_stages(monkeypatch, tmp_path):
    monkeypatch.chdir(FIXTURES)
    r = resolved(Path("llamafactory-lora-kto.yaml"))
    c = r.config
    assert (c.preference.method, c.preference.beta, c.preference.desirable_weight, c.preference.undesirable_weight) == \
        ("kto", 0.1, 1.0, 1.33)
    assert r.origins["preference.undesirable_weight"].line == line_of("llamafactory-lora-kto.yaml", "kto_rejected_weight:")
    assert (c.data.layout, c.data.messages_column, c.data.label_column) == ("messages", "messages", "label")
    text = (FIXTURES / "llamafactory-lora-dpo.yaml").read_text()
    (tmp_path / "rm.yaml").write_text(text.replace("stage: dpo", "stage: rm").replace("pref_loss: sigmoid", "")
                                      .replace("dataset_dir: data", f"dataset_dir: {FIXTURES / 'data'}"))
    c = resolved(tmp_path / "rm.yaml").config
    assert (c.preference.method, c.model.task) == ("reward", "sequence-classification")
    (tmp_path / "alpaca.yaml").write_text(text.replace("dataset: dpo_en_demo", "dataset: dpo_alpaca_demo")
                                          .replace("pref_loss: sigmoid", "pref_loss: simpo\nsimpo_gamma: 0.3")
                                          .replace("dataset_dir: data", f"dataset_dir: {FIXTURES / 'data'}"))
    c = resolved(tmp_path / "alpaca.yaml").config
    assert (c.preference.method, c.preference.simpo_gamma, c.data.layout, c.data.prompt_column, c.data.input_column) == \
        ("simpo", 0.3, "alpaca", "instruction", "input")


@pytest.mark.parametrize("line, key", [("stage: ppo", "stage"), ("pref_loss: hinge", "pref_loss"),
                                       ("pref_ftx: 0.5", "pref_ftx"), ("ref_model: other/model", "ref_model")])
def test_llamafactory_refuses_what_has_no_counterpart_by_key(tmp_path, line, key):
    keys, text = refusal(tmp_path, f"{key}.yaml", f"model_name_or_path: m\nstage: dpo\n{line}\n")
    assert keys == [key] and ("overdrive" in text or "remove" in text)


def test_llamafactory_refuses_a_ranking_set_for_sft_and_a_plain_one_for_dpo(tmp_path, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    keys, _ = refusal(tmp_path, "sft.yaml", f"model_name_or_path: m\nstage: sft\ndataset: dpo_en_demo\n"
                      f"dataset_dir: {FIXTURES / 'data'}\n")
    assert keys == ["dataset"]
    keys, _ = refusal(tmp_path, "dpo.yaml", f"model_name_or_path: m\nstage: dpo\ndataset: identity\n"
                      f"dataset_dir: {FIXTURES / 'data'}\n")
    assert keys == ["dataset"]


def test_axolotl_dpo_maps_rl_beta_smoothing_lora_and_its_chat_template_pairs():
    name = "axolotl-dpo-lora.yml"
    r = resolved(FIXTURES / name)
    c = r.config
    assert (c.preference.method, c.preference.beta, c.preference.label_smoothing) == ("dpo", 0.2, 0.05)
    assert r.origins["preference.method"].line == line_of(name, "rl:")
    assert r.origins["preference.beta"].line == line_of(name, "rl_beta:")
    assert r.origins["preference.label_smoothing"].line == line_of(name, "dpo_label_smoothing:")
    assert (c.peft.method, c.peft.r, c.peft.alpha, c.peft.dropout, c.peft.target_modules) == \
        ("lora", 32, 16.0, 0.05, "all-linear")
    assert (c.data.format, c.data.layout, c.data.prompt_column, c.data.chosen_column, c.data.source) == \
        ("preference", "messages", "conversation", "chosen", "dpo_pairs.jsonl")
    assert (c.training.micro_batch_size, c.data.validation_fraction) == (2, 0.05)


def test_axolotl_kto_and_the_other_methods(tmp_path):
    c = resolved(FIXTURES / "axolotl-kto-qlora.yml").config
    assert (c.preference.method, c.preference.beta, c.preference.desirable_weight, c.peft.method) == \
        ("kto", 0.5, 0.2, "qlora")
    base = "base_model: m\nadapter: lora\nmicro_batch_size: 2\ndatasets:\n  - path: p.jsonl\n    type: chatml.intel\n"
    for extra, want in (("rl: orpo\norpo_alpha: 0.2\n", ("orpo", 0.2)), ("rl: ipo\ndpo_beta: 0.3\n", ("ipo", 0.3)),
                        ("rl: simpo\ncpo_alpha: 0\nrl_beta: 2.0\nsimpo_gamma: 0.8\n", ("simpo", 2.0)),
                        ("rl: dpo\ndpo_loss_type: [ipo]\n", ("ipo", 0.1))):
        (tmp_path / "x.yml").write_text(base + extra)
        c = resolved(tmp_path / "x.yml").config
        assert (c.preference.method, c.preference.beta) == want
        assert (c.data.layout, c.data.prompt_column) == ("alpaca", "question")  # chatml.intel's columns
    assert c.preference.simpo_gamma == 0.5
    (tmp_path / "x.yml").write_text(base.replace("chatml.intel", "chat_template.argilla_chat") + "rl: dpo\n")
    assert resolved(tmp_path / "x.yml").config.data.layout == "messages"


@pytest.mark.parametrize("extra, key", [("rl: ppo\n", "rl"), ("rl: simpo\n", "rl"), ("rl: simpo\ncpo_alpha: 1.0\n", "cpo_alpha"),
                                        ("rl: dpo\nrpo_alpha: 1.0\n", "rpo_alpha"), ("rl: dpo\nref_model: x\n", "ref_model"),
                                        ("rl: dpo\ndpo_loss_type: [hinge]\n", "dpo_loss_type"),
                                        ("rl: dpo\ndatasets:\n  - path: p\n    type: chatml.unknown_style\n",
                                         "datasets.0.type")])
def test_axolotl_refuses_what_has_no_counterpart_by_key(tmp_path, extra, key):
    keys, _ = refusal(tmp_path, "x.yml", "base_model: m\nadapter: lora\nmicro_batch_size: 2\n" + extra)
    assert keys == [key]


def test_torchtune_dpo_recipe_maps_its_loss_and_paired_data():
    name = "torchtune-lora-dpo.yaml"
    r = resolved(FIXTURES / name)
    c = r.config
    assert (c.preference.method, c.preference.beta, c.data.format) == ("dpo", 0.05, "preference")
    assert r.origins["preference.beta"].line == line_of(name, "beta:")
    assert (c.data.source, c.data.layout, c.data.prompt_column, c.data.chosen_column, c.data.rejected_column) == \
        ("lvwerra/stack-exchange-paired", "alpaca", "question", "response_j", "response_k")
    assert (c.peft.method, c.peft.r, c.training.micro_batch_size) == ("lora", 8, 4)


def test_torchtune_refuses_another_reference_and_a_ppo_recipe(tmp_path):
    base = ("checkpointer:\n  checkpoint_dir: m\nmodel:\n  _component_: torchtune.models.llama3_1.lora_llama3_1_8b\n"
            "  lora_attn_modules: [q_proj]\n")
    keys, _ = refusal(tmp_path, "ref.yaml", base + "loss:\n  _component_: torchtune.rlhf.loss.DPOLoss\n"
                      "ref_checkpointer:\n  checkpoint_dir: other\n")
    assert keys == ["ref_checkpointer.checkpoint_dir"]
    keys, text = refusal(tmp_path, "ppo.yaml", base + "loss:\n  _component_: torchtune.rlhf.loss.PPOLoss\n")
    assert keys == ["loss._component_"] and "kto" in text


@pytest.mark.parametrize("text, want", [
    ("model_name_or_path: m\nstage: dpo\npref_loss: ipo\npref_beta: 0.3\n", {"method": "ipo", "beta": 0.3}),
    ("model_name_or_path: m\nstage: dpo\npref_loss: orpo\n", {"method": "orpo"}),
    ("model_name_or_path: m\nstage: dpo\ndpo_label_smoothing: 0.1\n", {"method": "dpo", "label_smoothing": 0.1}),
    ("model_name_or_path: m\nstage: kto\nkto_chosen_weight: 2.0\n", {"method": "kto", "desirable_weight": 2.0}),
    ("base_model: m\nmicro_batch_size: 2\nrl: kto\nkto_undesirable_weight: 0.5\n",
     {"method": "kto", "undesirable_weight": 0.5}),
    ("base_model: m\nmicro_batch_size: 2\nrl: dpo\nrl_beta: 0.4\n", {"method": "dpo", "beta": 0.4}),
    ("checkpointer:\n  checkpoint_dir: m\nmodel:\n  _component_: torchtune.models.llama3_1.lora_llama3_1_8b\n"
     "  lora_attn_modules: [q_proj]\nloss:\n  _component_: torchtune.rlhf.loss.SimPOLoss\n  gamma: 0.7\n",
     {"method": "simpo", "beta": 2.0, "simpo_gamma": 0.7}),
    ("checkpointer:\n  checkpoint_dir: m\nmodel:\n  _component_: torchtune.models.llama3_1.lora_llama3_1_8b\n"
     "  lora_attn_modules: [q_proj]\nloss:\n  _component_: torchtune.rlhf.loss.DPOLoss\n  label_smoothing: 0.2\n",
     {"method": "dpo", "beta": 0.1, "label_smoothing": 0.2}),
])
def test_each_mapped_preference_key(tmp_path, text, want):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    r = resolved(path, "peft.method=lora")
    p = r.config.preference
    assert {k: getattr(p, k) for k in want} == want
    for key in want:  # each from the file: a line, or the tool's default named
        assert r.origins[f"preference.{key}"].layer != "default"


def test_torchtune_preference_dataset_reads_its_column_map(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("checkpointer:\n  checkpoint_dir: m\nmodel:\n  _component_: torchtune.models.llama3_1.lora_llama3_1_8b\n"
                    "  lora_attn_modules: [q_proj]\nloss:\n  _component_: torchtune.rlhf.loss.DPOLoss\n"
                    "dataset:\n  _component_: torchtune.datasets.preference_dataset\n  source: json\n"
                    "  data_files: pairs.json\n  column_map:\n    chosen: good\n    rejected: bad\n")
    c = resolved(path).config
    assert (c.data.source, c.data.chosen_column, c.data.rejected_column, c.data.format) == \
        ("pairs.json", "good", "bad", "preference")


def test_axolotl_reward_model_with_its_bradley_terry_rows(tmp_path):
    """After Axolotl's examples/qwen3/reward-model.yaml."""
    path = tmp_path / "rm.yml"
    path.write_text("base_model: m\nmodel_type: AutoModelForSequenceClassification\nnum_labels: 1\nreward_model: true\n"
                    "center_rewards_coefficient: 0.01\ndatasets:\n  - path: argilla/distilabel-intel-orca-dpo-pairs\n"
                    "    type: bradley_terry.chat_template\nmicro_batch_size: 1\n")
    r = resolved(path)
    c = r.config
    assert (c.preference.method, c.model.task, c.preference.center_rewards_coefficient) == \
        ("reward", "sequence-classification", 0.01)
    assert (c.data.layout, c.data.prompt_column, c.data.format) == ("alpaca", "input", "preference")
    assert "num_labels" not in {w.key for w in r.warnings}
