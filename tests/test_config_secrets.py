"""Secrets are masked by the name's own last word, not by the section it sits in: a
`tokenizer` section, `pad_token_id` and TOKENIZERS_PARALLELISM hold no credential."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from overdrive.config.env_report import is_secret_name, run_variables


def test_credentials_are_told_from_names_that_only_mention_a_token():
    for name in ("parallel.deepspeed.extra.hub_token", "hub_token", "wandb.api_key", "HF_TOKEN", "WANDB_API_KEY",
                 "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "MLFLOW_TRACKING_PASSWORD", "HUB_TOKEN_PATH"):
        assert is_secret_name(name), name
    for name in ("tokenizer.vocab_size", "tokenizer.name_or_path", "model.architecture.pad_token_id",
                 "TOKENIZERS_PARALLELISM", "OVERDRIVE_TOKENIZER__VOCAB_SIZE", "HF_HUB_ENABLE_HF_TRANSFER",
                 "fsdp_bogus_key", "max_tokens"):
        assert not is_secret_name(name), name


@pytest.mark.slow
def test_explain_shows_tokenizer_values():
    result = run_cli("explain", "--all", "tokenizer.vocab_size=4096")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("tokenizer.vocab_size"))
    assert "4096" in line and "***" not in line


@pytest.mark.slow
def test_explain_json_masks_a_hub_token_but_not_pad_token_id():
    result = run_cli("explain", "--json", "model.architecture.pad_token_id=0",
                     "parallel.deepspeed.extra.hub_token=hf_abc")
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)["config"]
    assert config["model"]["architecture"]["pad_token_id"] == 0
    assert config["parallel"]["deepspeed"]["extra"]["hub_token"] == "***" and "hf_abc" not in result.stdout


def test_env_report_lists_tokenizer_variables_as_they_are():
    listed = dict(run_variables({"TOKENIZERS_PARALLELISM": "false", "OVERDRIVE_TOKENIZER__VOCAB_SIZE": "4096",
                                 "HF_TOKEN": "hf_abc"}))
    assert listed == {"TOKENIZERS_PARALLELISM": "false", "OVERDRIVE_TOKENIZER__VOCAB_SIZE": "4096", "HF_TOKEN": "***"}
