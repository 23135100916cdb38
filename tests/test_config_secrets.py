"""Secrets are masked by the key's own name, not by the section it sits in."""

from __future__ import annotations

from conftest import run_cli

from overdrive.config.keys import is_secret


def test_a_section_name_does_not_make_a_secret():
    assert not is_secret("tokenizer.vocab_size") and not is_secret("tokenizer.name_or_path")
    assert is_secret("parallel.deepspeed.extra.hub_token") and is_secret("hub_token") and is_secret("wandb.api_key")


def test_explain_shows_tokenizer_values():
    result = run_cli("explain", "--all", "tokenizer.vocab_size=4096")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("tokenizer.vocab_size"))
    assert "4096" in line and "***" not in line
