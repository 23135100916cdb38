"""A real run with tokens planted in a config file, on the command line and in the environment
leaves none of them on the terminal or in any file under its output_dir (resolved.json,
checkpoints' trainer_state.json, tracker logs, the model, the report), single-process and
with launched workers (which get the secrets through their environment, not a file)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import run_cli

TOKENS = {
    "file": "hf_FileTokenAbcdefghijklmnop12",
    "cli": "sk-CliTokenAbcdefghijklmnop34",
    "env": "hf_EnvTokenAbcdefghijklmnop56",
    "env_named": "PlainEnvSecretValue78",   # no token shape: masked by the variable's name
    "url": "UrlPassword9Xyz",
}


def _leaks(out: Path, *texts: str) -> list[str]:
    found = []
    for name, token in TOKENS.items():
        if any(token in text for text in texts):
            found.append(f"{name} on the terminal")
        for path in out.rglob("*"):
            if path.is_file() and token.encode() in path.read_bytes():
                found.append(f"{name} in {path.relative_to(out)}")
    return found


def _run(tmp_path: Path, *extra: str) -> tuple[Path, list[str]]:
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"architecture": {"n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64}},
        "tokenizer": {"vocab_size": 512},
        "data": {"max_bytes": 200000, "max_length": 32, "cache_dir": str(tmp_path / "cache")},
        "training": {"max_steps": 3, "log_every_steps": 1, "eval_every_steps": None, "eval_batches": 1},
        "checkpoint": {"every_steps": 2},
        "parallel": {"deepspeed": {"extra": {"hub_token": TOKENS["file"]}}},
        "output_dir": str(out),
    }))
    env = {"HF_TOKEN": TOKENS["env"], "OVERDRIVE_PARALLEL__DEEPSPEED__EXTRA__AUTH_TOKEN": TOKENS["env_named"],
           "OVERDRIVE_LOGGING__PROGRESS": "false"}
    result = run_cli("train", str(config), "training.max_steps=3", "data.max_bytes=200000",
                     f"parallel.deepspeed.extra.wandb_api_key={TOKENS['cli']}",
                     f"parallel.deepspeed.extra.mirror=https://me:{TOKENS['url']}@example.org/x", *extra,
                     env=env, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = run_cli("report", str(out), "--print", cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-3000:]
    explain = run_cli("explain", "--all", str(config), env=env, cwd=tmp_path)
    assert (out / "resolved.json").is_file() and list(out.rglob("trainer_state.json"))
    return out, _leaks(out, result.stdout, result.stderr, report.stdout, report.stderr, explain.stdout, explain.stderr)


@pytest.mark.slow
def test_a_run_leaves_no_planted_token_anywhere(tmp_path):
    out, leaks = _run(tmp_path)
    assert not leaks, leaks
    assert '"hub_token": "***"' in (out / "resolved.json").read_text()


@pytest.mark.slow
def test_launched_workers_get_secrets_from_their_environment_not_a_file(tmp_path):
    import random

    out, leaks = _run(tmp_path, "launch.num_processes=2", f"launch.main_process_port={random.randint(20000, 60000)}")
    assert not leaks, leaks
