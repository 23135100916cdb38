"""The environment as it bears on a run: which variables are set, where Accelerate looks.

This is one of the few modules allowed to read `os.environ` (library code takes its inputs
from the run config). `overdrive env` and `overdrive config --accelerate-default` call these
functions instead of reading the environment themselves. Values of variables whose name
suggests a credential are never returned, only `***`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping, Optional

# Prefixes of variables read by Accelerate, DeepSpeed, torch, NCCL, the Hugging Face libraries
# or overdrive itself; any of them can change what a run does.
RUN_VARIABLE_PREFIXES = (
    "ACCELERATE_",
    "FSDP_",
    "OVERDRIVE_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "NCCL_",
    "TORCH_",
    "PYTORCH_",
    "CUDA_",
    "DS_",
)
RUN_VARIABLES = frozenset(
    {
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "TOKENIZERS_PARALLELISM",
        "XDG_CACHE_HOME",
        "DEEPSPEED_ACCELERATOR",
    }
)
MASK = "***"
# user:password@ in a URL (HF_ENDPOINT, proxies): the host is useful, the credentials are not.
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")


def _environ(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def process_environment(environ: Optional[Mapping[str, str]] = None) -> Mapping[str, str]:
    """`environ`, or this process's environment: read here (and in launch/, which decides what
    started processes get), so no other package has a hidden input."""
    return _environ(environ)


def local_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """This process's rank on its machine, as torch.distributed.run sets it (0 when alone)."""
    return int(_environ(environ).get("LOCAL_RANK", "0"))


# Words of a name that mark a credential (HF_TOKEN, hub_token, MLFLOW_TRACKING_PASSWORD), and
# the words that make "key" one (WANDB_API_KEY, AWS_ACCESS_KEY_ID; not `fsdp_..._key`).
_CREDENTIAL_WORDS = frozenset({"token", "password", "passwd", "secret", "apikey", "credentials"})
_KEY_KINDS = frozenset({"api", "access", "private", "secret", "auth", "signing", "encryption"})


def is_secret_name(name: str) -> bool:
    """A config key (`parallel.deepspeed.extra.hub_token`) or environment variable (`HF_TOKEN`)
    whose value is a credential, judged by the words of its own name: not by the sections it
    sits in (`tokenizer.*`), nor by a word that only contains one (TOKENIZERS_PARALLELISM)."""
    words = [word for word in re.split(r"[^a-z0-9]+", name.rsplit(".", 1)[-1].lower()) if word]
    if words[-2:] in (["token", "id"], ["token", "ids"]):  # pad_token_id: a number in the vocabulary
        return False
    keyed = any(word == "key" and before in _KEY_KINDS for before, word in zip(words, words[1:]))
    return keyed or any(word in _CREDENTIAL_WORDS for word in words)


def masked_value(name: str, value: str) -> str:
    """The value safe to paste into a public bug report."""
    if is_secret_name(name):
        return MASK
    return _URL_CREDENTIALS.sub(lambda m: m.group("scheme") + MASK + "@", value)


def affects_run(name: str) -> bool:
    return name in RUN_VARIABLES or name.startswith(RUN_VARIABLE_PREFIXES)


def run_variables(environ: Optional[Mapping[str, str]] = None) -> list[tuple[str, str]]:
    """(name, masked value) of every set variable that can change a run, sorted by name."""
    env = _environ(environ)
    return sorted((name, masked_value(name, value)) for name, value in env.items() if affects_run(name))


def hf_home(environ: Optional[Mapping[str, str]] = None) -> Path:
    """`$HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface` (as Accelerate)."""
    env = _environ(environ)
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser()
    cache = env.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache).expanduser() / "huggingface"


def accelerate_default_config_path(environ: Optional[Mapping[str, str]] = None) -> Path:
    """Where `accelerate launch` (and overdrive's second layer) looks for its default config."""
    return hf_home(environ) / "accelerate" / "default_config.yaml"


def debug_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    """`OVERDRIVE_DEBUG` set to anything but empty, 0, false or no."""
    return _environ(environ).get("OVERDRIVE_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def proxy_configured(environ: Optional[Mapping[str, str]] = None) -> bool:
    """An HTTP(S) proxy in the environment: the hub is reached through it, not directly."""
    env = _environ(environ)
    return any(env.get(name) for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                                          "all_proxy"))
