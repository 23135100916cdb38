"""Generated inputs, as a careless or hostile user would type them: config files (YAML, JSON,
broken bytes, duplicate keys), environments and command lines, run through the commands in
this process. Whatever comes in, the exit code is 0 or 2, no traceback reaches the terminal,
and no planted secret appears on stdout, stderr or in a file a command wrote.

The figures (inputs, exit codes, tracebacks, leaked secrets) are printed at the end: run
with `-s` to see them.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from overdrive import cli  # noqa: E402

KEYS = [
    "optim.lr", "optim.weight_decay", "optim.betas", "optim.eps", "training.max_steps", "training.seed",
    "training.micro_batch_size", "training.gradient_clipping", "training.gradient_accumulation_steps",
    "parallel.strategy", "parallel.deepspeed.zero_stage", "parallel.deepspeed.extra.hub_token",
    "parallel.deepspeed.extra.steps_per_print", "parallel.fsdp.version", "model.architecture",
    "model.architecture.n_layer", "model.architecture.api_key", "model.name_or_path", "data.source",
    "launch.num_processes", "launch.main_process_port", "logging.trackers", "output_dir", "extends", "layer",
    "optim.lrr", "trainig.seed", "precision.mixed_precision", "tokenizer.vocab_size", "checkpoint.every_steps",
    "lr", "steps", "seed", "zero", "strategy", "model", "optim", "training",
]
NATIVE_KEYS = ["distributed_type", "compute_environment", "num_processes", "fsdp_config", "deepspeed_config",
               "mixed_precision", "zero_optimization", "train_batch_size", "gradient_clipping", "fp16", "bf16",
               "optimizer", "steps_per_print", "overlap_comm", "wandb"]
ENV_NAMES = [
    "OVERDRIVE_OPTIM__LR", "OVERDRIVE_MODEL__ARCHITECTURE", "OVERDRIVE_PARALLEL__DEEPSPEED__EXTRA__HUB_TOKEN",
    "OVERDRIVE_TRAINING__SEED", "OVERDRIVE_BOGUS__KEY", "OVERDRIVE_OUTPUT_DIR", "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "FSDP_VERSION",
    "FSDP_SHARDING_STRATEGY", "ACCELERATE_NUM_PROCESSES", "HF_TOKEN", "WANDB_API_KEY",
]
FIGURES: Counter = Counter()

alnum = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", min_size=20, max_size=30)
# Secrets by shape: a hub token, an API key, a password inside a URL.
secrets = st.one_of(alnum.map(lambda s: "hf_" + s), alnum.map(lambda s: "sk-" + s),
                    alnum.map(lambda s: f"https://user:{s}@example.org/data"))
plain_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
scalars = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                    st.none(), plain_text, st.sampled_from(["auto", "ddp", "deepspeed", "fsdp", "bf16", "3e-4", "true"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.sampled_from(KEYS + NATIVE_KEYS), inner, max_size=3)),
                      max_leaves=8)


def _secret_path(value: str) -> str:
    return value.split(":", 2)[2].split("@")[0] if value.startswith("https://") else value


@st.composite
def scenarios(draw):
    secret = draw(secrets)
    mapping = draw(st.dictionaries(st.sampled_from(KEYS + NATIVE_KEYS), values, max_size=6))
    where = draw(st.sampled_from(["file", "cli", "env", "file-value"]))
    if where == "file":
        mapping["parallel.deepspeed.extra.hub_token"] = secret
    elif where == "file-value" and mapping:
        mapping[draw(st.sampled_from(sorted(mapping)))] = secret
    form = draw(st.sampled_from(["yaml", "json", "none", "bytes", "duplicate", "deep", "aliases"]))
    if form == "yaml":
        body = yaml.safe_dump(mapping, allow_unicode=True).encode()
    elif form == "json":
        body = json.dumps(mapping, default=str).encode()
    elif form == "bytes":
        body = draw(st.binary(max_size=40)) + yaml.safe_dump(mapping).encode()
    elif form == "duplicate":
        body = (yaml.safe_dump(mapping) + "optim:\n  lr: 0.1\noptim:\n  lr: 0.2\n").encode()
    elif form == "deep":
        depth = draw(st.integers(10, 3000))
        body = f"model:\n  architecture:\n    x: {'[' * depth}{']' * depth}\n".encode()
    elif form == "aliases":
        body = b"a: &a [1, 1, 1, 1, 1, 1, 1, 1]\n" + b"".join(
            f"b{i}: &b{i} [{', '.join(['*a' if i == 0 else f'*b{i - 1}'] * 8)}]\n".encode() for i in range(7))
    else:
        body = None
    suffix = ".json" if form == "json" else ".yaml"
    items = [f"{key}={value}" for key, value in draw(st.lists(st.tuples(st.sampled_from(KEYS), plain_text), max_size=4))]
    if where == "cli":
        items.append(draw(st.sampled_from([f"parallel.deepspeed.extra.hub_token={secret}", f"optim.lr={secret}",
                                           f"data.source={secret}", f"model.architecture={{api_key: {secret}}}"])))
    env = dict(draw(st.lists(st.tuples(st.sampled_from(ENV_NAMES), plain_text), max_size=3)))
    if where == "env":
        env[draw(st.sampled_from(["HF_TOKEN", "OVERDRIVE_PARALLEL__DEEPSPEED__EXTRA__HUB_TOKEN",
                                  "OVERDRIVE_DATA__SOURCE", "WANDB_API_KEY"]))] = secret
    command = draw(st.sampled_from(["explain", "explain --json", "explain --all", "explain --key optim.lr",
                                    "export", "import", "slurm"]))
    # The same file as a config argument, or as Accelerate's own default_config.yaml.
    as_default = body is not None and draw(st.booleans()) and command != "import"
    return secret, body, suffix, items, env, command, as_default


def _run(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    saved = dict(os.environ)
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code if isinstance(exit_.code, int) else 2
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return code, out.getvalue(), err.getvalue()


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(scenarios())
def test_any_input_exits_0_or_2_without_traceback_or_secret(scenario):
    secret, body, suffix, items, env, command, as_default = scenario
    work = Path(tempfile.mkdtemp(prefix="overdrive-prop-"))
    try:
        files = []
        if as_default:
            (work / "hf" / "accelerate").mkdir(parents=True)
            (work / "hf" / "accelerate" / "default_config.yaml").write_bytes(body)
        elif body is not None:
            (work / f"run{suffix}").write_bytes(body)
            files.append(str(work / f"run{suffix}"))
        argv = command.split()
        if argv[0] == "export":
            argv += ["--accelerate", str(work / "out" / "acc.yaml"), "--deepspeed", str(work / "out" / "ds.json")]
        elif argv[0] == "import":
            if not files:
                files = [str(work / "missing.yaml")]
            argv += ["-o", str(work / "out" / "run.yaml")]
            items = []
        environ = {"HF_HOME": str(work / "hf"), **env}
        code, out, err = _run(argv + files + items, environ)
        FIGURES["inputs"] += 1
        FIGURES[f"exit {code}"] += 1
        tracebacks = "Traceback (most recent call last)" in out + err
        FIGURES["tracebacks"] += tracebacks
        written = "".join(p.read_text(errors="replace") for p in work.rglob("*") if p.is_file() and p.parent.name == "out")
        leaked = _secret_path(secret) in out + err + written
        FIGURES["leaked secrets"] += leaked
        assert code in (0, 2), (argv + files + items, env, out[-2000:], err[-2000:])
        assert not tracebacks, err[-3000:]
        assert not leaked, (argv + files + items, env, out[-2000:], err[-2000:], written[-2000:])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def teardown_module(module):
    print(f"\nproperty test figures: {dict(FIGURES)}")
