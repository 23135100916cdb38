"""Preference training, the pure parts: the losses against TRL's (its own functions where TRL
has them as functions, its source reproduced where the loss lives inside a trainer step), the
pairs rendered as TRL's DPOTrainer renders them, the keys' rules, the reference in the plan."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_fixtures import make_preference_data, make_tiny_llama
from overdrive.resolving import resolve
from overdrive.errors import UserError
from overdrive.training.objectives import preference_loss as losses

torch.manual_seed(0)
N = 6
CHOSEN, REJECTED = -torch.rand(N) * 20 - 1, -torch.rand(N) * 20 - 1
REF_CHOSEN, REF_REJECTED = -torch.rand(N) * 20 - 1, -torch.rand(N) * 20 - 1
CHOSEN_LEN, REJECTED_LEN = torch.randint(1, 30, (N,)).float(), torch.randint(1, 30, (N,)).float()


def _trl_dpo_sigmoid(beta):
    """trl/trainer/dpo_trainer.py (1.16) `_compute_loss`, loss_type "sigmoid", reverse KL."""
    delta_score = (CHOSEN - REF_CHOSEN) - (REJECTED - REF_REJECTED)
    return -F.logsigmoid(beta * delta_score)


def _trl_dpo_robust_free_cdpo(beta, eps):
    """The cDPO form TRL's sigmoid loss had (and CPOTrainer's "sigmoid" keeps): label smoothing."""
    logits = (CHOSEN - REF_CHOSEN) - (REJECTED - REF_REJECTED)
    return -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps


def _trl_ipo(beta):
    """dpo_trainer.py, loss_type "ipo": log-ratios over the completion lengths."""
    chosen_avg = (CHOSEN - REF_CHOSEN) / CHOSEN_LEN.clamp(min=1.0)
    rejected_avg = (REJECTED - REF_REJECTED) / REJECTED_LEN.clamp(min=1.0)
    return (chosen_avg - rejected_avg - 1 / (2 * beta)) ** 2


def test_dpo_and_ipo_equal_trls_formulas():
    got = losses.dpo(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1)
    torch.testing.assert_close(got.losses, _trl_dpo_sigmoid(0.1))
    torch.testing.assert_close(got.chosen_rewards, 0.1 * (CHOSEN - REF_CHOSEN))
    torch.testing.assert_close(got.rejected_rewards, 0.1 * (REJECTED - REF_REJECTED))
    smoothed = losses.dpo(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.3, label_smoothing=0.2)
    torch.testing.assert_close(smoothed.losses, _trl_dpo_robust_free_cdpo(0.3, 0.2))
    got = losses.ipo(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, CHOSEN_LEN, REJECTED_LEN, beta=0.5)
    torch.testing.assert_close(got.losses, _trl_ipo(0.5))
    # Equal policy and reference: DPO's loss is ln 2, whatever beta.
    same = losses.dpo(CHOSEN, REJECTED, CHOSEN, REJECTED, beta=0.7)
    torch.testing.assert_close(same.losses, torch.full((N,), math.log(2)))


def _trainer_self(**values):
    return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")), **values)


def test_simpo_equals_trls_cpo_trainer():
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    chosen_avg, rejected_avg = CHOSEN / CHOSEN_LEN, REJECTED / REJECTED_LEN  # CPO averages (average_log_prob)
    trl_self = _trainer_self(alpha=0.0, loss_type="simpo", simpo_gamma=0.7, beta=2.0, label_smoothing=0.1)
    want, want_chosen, want_rejected = CPOTrainer.cpo_loss(trl_self, chosen_avg, rejected_avg)
    got = losses.simpo(CHOSEN, REJECTED, CHOSEN_LEN, REJECTED_LEN, beta=2.0, gamma=0.7, label_smoothing=0.1)
    torch.testing.assert_close(got.losses, want)
    torch.testing.assert_close(got.chosen_rewards, want_chosen)
    torch.testing.assert_close(got.rejected_rewards, want_rejected)


def test_orpo_equals_trls_orpo_trainer():
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    chosen_avg, rejected_avg = CHOSEN / CHOSEN_LEN, REJECTED / REJECTED_LEN
    trl_losses, want_chosen, want_rejected, _, _ = ORPOTrainer.odds_ratio_loss(_trainer_self(beta=0.25), chosen_avg,
                                                                               rejected_avg)
    nll = torch.tensor(1.7)
    got = losses.orpo(CHOSEN, REJECTED, CHOSEN_LEN, REJECTED_LEN, nll, beta=0.25)
    torch.testing.assert_close(got.losses.mean(), nll - trl_losses.mean())  # TRL: policy_nll_loss - losses.mean()
    torch.testing.assert_close(got.chosen_rewards, want_chosen)
    torch.testing.assert_close(got.rejected_rewards, want_rejected)


def test_reward_model_loss_equals_trls_reward_trainer():
    """trl/trainer/reward_trainer.py `compute_loss`: Bradley-Terry, plus the centering term."""
    want = -F.logsigmoid(CHOSEN - REJECTED).mean() + 0.01 * torch.mean((CHOSEN + REJECTED) ** 2)
    got = losses.bradley_terry(CHOSEN, REJECTED, 0.01)
    torch.testing.assert_close(got.losses.mean(), want)
    torch.testing.assert_close(losses.bradley_terry(CHOSEN, REJECTED).losses.mean(),
                               -F.logsigmoid(CHOSEN - REJECTED).mean())


def test_sequence_log_probs_are_the_answer_tokens_cross_entropy():
    logits = torch.randn(2, 7, 11)
    ids = torch.randint(0, 11, (2, 7))
    labels = ids.clone()
    labels[:, :3] = -100
    summed, counts = losses.answer_logps(losses.token_logps(logits, ids), labels)
    want = -F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), reduction="none")
    torch.testing.assert_close(summed, want.view(2, 6).sum(1))
    assert counts.tolist() == [4.0, 4.0]


# ---------------------------------------------------------------- the data


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama") / "base")


def _trl_rendering(tokenizer, row):
    """trl/trainer/dpo_trainer.py `_prepare_dataset.tokenize_fn` (with `add_eos` for text rows)."""
    from trl.data_utils import _tokenize, common_prefix_length

    if isinstance(row["chosen"], list):
        prompt_ids = _tokenize(tokenizer, row["prompt"], add_generation_prompt=True)["input_ids"]
        chosen = _tokenize(tokenizer, row["prompt"] + row["chosen"])["input_ids"]
        rejected = _tokenize(tokenizer, row["prompt"] + row["rejected"])["input_ids"]
    else:
        eos = tokenizer.eos_token
        prompt_ids = _tokenize(tokenizer, row["prompt"])["input_ids"]
        chosen = _tokenize(tokenizer, row["prompt"] + row["chosen"] + eos)["input_ids"]
        rejected = _tokenize(tokenizer, row["prompt"] + row["rejected"] + eos)["input_ids"]
    n = min(common_prefix_length(prompt_ids, chosen), common_prefix_length(prompt_ids, rejected))
    return prompt_ids[:n], chosen[n:], rejected[n:]


@pytest.mark.parametrize("layout", ["conversational", "standard"])
def test_pairs_are_rendered_as_trls_dpo_trainer_renders_them(llama, tmp_path, layout):
    import json

    from transformers import AutoTokenizer

    from overdrive.data.preference import PreferenceEncoder

    tokenizer = AutoTokenizer.from_pretrained(llama)
    path = make_preference_data(tmp_path / "pairs.jsonl", rows=5, layout=layout)
    encoder = PreferenceEncoder(tokenizer, max_length=64)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        prompt, chosen, rejected = _trl_rendering(tokenizer, row)
        assert encoder.render(row) == (prompt, chosen, rejected)
        (chosen_ids, chosen_mask), (rejected_ids, rejected_mask) = encoder.encode(row)
        assert chosen_ids == prompt + chosen and chosen_mask == [0] * len(prompt) + [1] * len(chosen)
        assert rejected_ids == prompt + rejected
    if layout == "conversational":  # the answer ends with the template's end of turn
        assert tokenizer.decode(chosen).endswith("<eos>")


def test_truncation_keeps_the_start_and_a_prompt_filling_the_length_drops_the_pair(llama):
    from transformers import AutoTokenizer

    from overdrive.data.preference import PreferenceEncoder

    tokenizer = AutoTokenizer.from_pretrained(llama)
    row = {"prompt": [{"role": "user", "content": "a b c"}], "chosen": [{"role": "assistant", "content": "the a"}],
           "rejected": [{"role": "assistant", "content": "ok ok ok ok ok ok"}]}
    prompt, _, _ = _trl_rendering(tokenizer, row)
    encoder = PreferenceEncoder(tokenizer, max_length=len(prompt) + 3)
    (chosen, _), (rejected, mask) = encoder.encode(row)
    assert len(rejected) == len(prompt) + 3 and sum(mask) == 3
    assert PreferenceEncoder(tokenizer, max_length=len(prompt)).encode(row) is None
    assert encoder.counts["truncated"] == 1


def _cfg(llama, source, *items):
    return resolve((), cli=[f"model.name_or_path={llama}", f"data.source={source}", "data.format=preference",
                            "preference.method=dpo", "peft.method=lora", *items], env={}).config


def test_missing_chosen_column_and_bad_rows_are_refused_by_key_and_line(llama, tmp_path):
    from overdrive.data.opening import open_splits

    path = make_preference_data(tmp_path / "pairs.jsonl", rows=4)
    with pytest.raises(UserError) as error:
        open_splits(_cfg(llama, path, "data.chosen_column=better"))
    assert error.value.problems[0].key == "data.chosen_column" and "'better'" in error.value.render()
    bad = tmp_path / "bad.jsonl"
    lines = path.read_text().splitlines()
    row = json.loads(lines[2])
    lines[2] = json.dumps({**row, "chosen": 7})  # neither text nor turns
    bad.write_text("\n".join(lines) + "\n")
    splits = open_splits(_cfg(llama, bad))
    with pytest.raises(UserError) as error:
        list(splits.train.batches())
    assert error.value.problems[0].key == "data.chosen_column" and "line 3" in error.value.render()
    # A text answer beside a prompt of turns is one assistant turn (Axolotl's chat_template.default rows)
    lines[2] = json.dumps({**row, "chosen": "the answer is q"})
    bad.write_text("\n".join(lines) + "\n")
    pair = next(open_splits(_cfg(llama, bad)).train.batches()).texts[2]
    assert pair["chosen"] == [{"role": "assistant", "content": "the answer is q"}]


def test_rules_of_the_preference_keys(llama, tmp_path):
    path = make_preference_data(tmp_path / "pairs.jsonl", rows=4)
    with pytest.raises(UserError) as error:
        _cfg(llama, path, "preference.beta=-0.1")
    assert "preference.beta" in error.value.render()
    with pytest.raises(UserError) as error:  # a method without pairs, and pairs without a method
        resolve((), cli=[f"model.name_or_path={llama}", "preference.method=dpo"], env={})
    assert error.value.problems[0].key == "data.format"
    with pytest.raises(UserError) as error:
        resolve((), cli=[f"model.name_or_path={llama}", f"data.source={path}", "data.format=preference"], env={})
    assert error.value.problems[0].key == "preference.method"
    with pytest.raises(UserError) as error:  # a sharded full-parameter policy: no whole frozen copy
        _cfg(llama, path, "peft.method=none", "parallel.strategy=fsdp", "launch.num_processes=2")
    assert error.value.problems[0].key == "preference.precompute_reference"
    _cfg(llama, path, "peft.method=none", "parallel.strategy=fsdp", "launch.num_processes=2",
         "preference.precompute_reference=true")
    with pytest.raises(UserError) as error:  # a continued adapter disabled is the bare base, not the start
        _cfg(llama, path, f"peft.adapter_path={tmp_path / 'sft-adapter'}")
    assert "preference.precompute_reference" in [p.key for p in error.value.problems]
    with pytest.raises(UserError) as error:  # a reward model is a scalar head
        _cfg(llama, path, "preference.method=reward")
    assert error.value.problems[0].key == "model.task"
    _cfg(llama, path, "preference.method=reward", "model.task=sequence-classification")


def test_plan_counts_the_reference_copy_of_full_parameter_dpo(llama, tmp_path):
    from overdrive.memory.model_shape import run_estimate, run_shape

    path = make_preference_data(tmp_path / "pairs.jsonl", rows=4)
    full = _cfg(llama, path, "peft.method=none")
    shape = run_shape(full)
    with_copy = run_estimate(full, "cuda", shape).rows[0]
    terms = [t for t in with_copy.terms if t[1].startswith("reference model")]
    assert terms == [("params_bytes", "reference model: a frozen copy of the weights (preference.method)",
                      4 * shape.params)]
    cached = run_estimate(_cfg(llama, path, "peft.method=none", "preference.precompute_reference=true"),
                          "cuda", shape).rows[0]
    assert with_copy.params_bytes - cached.params_bytes == 4 * shape.params


def test_sweeps_can_search_beta_and_refuse_a_negative_one(llama, tmp_path):
    from overdrive.config.sweep_space import parse_space

    path = make_preference_data(tmp_path / "pairs.jsonl", rows=4)
    good = resolve((), cli=[f"model.name_or_path={llama}", f"data.source={path}", "data.format=preference",
                            "preference.method=dpo", "peft.method=lora"], env={},
                   overrides={"sweep.space": {"preference.beta": {"low": 0.01, "high": 0.5, "log": True}}}).config
    entries, problems = parse_space(good)
    assert [e.key for e in entries] == ["preference.beta"] and not problems
    with pytest.raises(UserError) as error:
        resolve((), cli=[f"model.name_or_path={llama}", f"data.source={path}", "data.format=preference",
                         "preference.method=dpo", "peft.method=lora"], env={},
                overrides={"sweep.space": {"preference.beta": [-0.1, 0.1]}})
    assert "preference.beta" in error.value.render()
