"""Reads from the Hugging Face hub (a model, a tokenizer, a data set): one message for each way
they fail, naming the key, what was tried and the fix. This is the one place that knows
huggingface_hub's error classes; Transformers and datasets wrap them in OSError, so the
whole chain of causes is searched.

    with hub.reading("model.name_or_path", name, what="model"):
        AutoConfig.from_pretrained(name)

Speed without a network: when no file is cached, huggingface_hub retries a failed request
five times with backoff (1+2+4+8+8 s), and Transformers asks for several files, so a machine
without a network waited about 50 s for "couldn't connect". Before the first hub read,
`unreachable()` tries the endpoint once (name resolution and a TCP connect, 3 s at most);
when that plainly fails, reads run with the libraries' offline switch on (the cache only,
answered at once) and the message says why.
"""

from __future__ import annotations

import functools
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional
from urllib.parse import urlparse

from overdrive.errors import Problem, UserError

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

CONNECT_TIMEOUT_S = 3.0


def is_local(name: str) -> bool:
    return Path(name).expanduser().exists()


def looks_local(name: str) -> bool:
    """A name written as a path (./x, ../x, /x, ~/x) or under a directory that exists here: never a hub name."""
    if name.startswith(("./", "../", "/", "~")) or name in (".", ".."):
        return True
    parent = Path(name).expanduser().parent
    return str(parent) not in ("", ".") and parent.is_dir()


# A data set named like a file of rows: a local file (the hub's data sets are named owner/name).
DATA_FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".parquet", ".txt", ".arrow", ".jsonl.gz", ".json.gz")


def missing_local(name: Optional[str], what: str = "model") -> bool:
    """A name written as a local path (or, for a data set, as a data file) that does not exist."""
    if not name or "://" in name or is_local(name):  # a URL is read as one
        return False
    return looks_local(name) or (what == "data set" and name.lower().endswith(DATA_FILE_SUFFIXES))


def refuse_missing_local(key: str, name: Optional[str], what: str = "model") -> None:
    """A local-looking path that does not exist is called that, before any hub lookup."""
    if missing_local(name, what):
        raise UserError(Problem(key, f"{name} does not exist (a local {what} path: nothing was looked up on the hub)",
                                fix=f"check the path (from {Path.cwd()}); a hub name is written owner/name"))


# The files from_pretrained takes weights from: safetensors and torch files, their shard indexes, TF's,
# Flax's and GGUF.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".index.json")


def weightless_local(key: str, name: Optional[str], fix: str) -> Optional[Problem]:
    """A local model directory with a config.json and no weight file (a config saved alone, a copy that
    left the weights behind): Transformers would fail only when the model is built, after the data."""
    path = Path(name).expanduser() if name else None
    if path is None or not (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
        return None
    if any(child.name.endswith(_WEIGHT_SUFFIXES) for child in path.iterdir()):
        return None
    return Problem(key, f"{name} has a config.json but no weights (no model.safetensors, pytorch_model.bin "
                   "or shards of them)", fix=fix)


@functools.lru_cache(maxsize=None)
def unreachable() -> Optional[str]:
    """Why the hub cannot be reached, when that is plain at once; None when it answers, or when
    a proxy stands between (then the libraries decide)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    return url_unreachable(constants.ENDPOINT)


@functools.lru_cache(maxsize=None)
def url_unreachable(url: str) -> Optional[str]:
    """Why the host of an http(s) URL cannot be reached, when that is plain at once (its name does
    not resolve, nothing answers); None when it answers, or when a proxy stands between."""
    from overdrive.config.env_report import proxy_configured  # the environment is read in config/

    if proxy_configured():
        return None
    parsed = urlparse(url)
    host, port = parsed.hostname or "huggingface.co", parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except socket.gaierror as error:
        return f"{host} cannot be resolved: {error.strerror or error}"
    except OSError as error:
        return f"{host}:{port} cannot be reached: {error.strerror or error}"
    return None


@contextmanager
def _offline() -> Iterator[None]:
    """The libraries' own offline switch, for the duration of one read (module state, not the
    environment: Transformers and huggingface_hub read `constants.HF_HUB_OFFLINE` per call,
    datasets keeps its own copy)."""
    import sys

    from huggingface_hub import constants

    modules = [constants] + ([sys.modules["datasets"].config] if "datasets" in sys.modules else [])
    before = [m.HF_HUB_OFFLINE for m in modules]
    for module in modules:
        module.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for module, value in zip(modules, before):
            module.HF_HUB_OFFLINE = value


@contextmanager
def cache_only_when_unreachable() -> Iterator[None]:
    """Reads inside made cache-only at once when the hub is plainly unreachable (a library that
    reads the hub itself, lm-eval's data sets: no 50 s of retries before the same failure)."""
    if unreachable():
        import datasets  # noqa: F401  (imported first, so its own copy of the switch is set too)

        with _offline():
            yield
    else:
        yield


def dataset_cached(name: str) -> bool:
    """Whether a hub data set has files in the hub cache or a prepared copy in datasets' own cache."""
    if cached(name, "data set"):
        return True
    from datasets import config as datasets_config

    # datasets' prepared copies: <HF_DATASETS_CACHE>/<owner>___<name>
    root = Path(datasets_config.HF_DATASETS_CACHE)
    return (root / name.replace("/", "___")).is_dir()


def _chain(error: Optional[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found.append(error)
        error = error.__cause__ or error.__context__
    return found


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _transport(error: BaseException) -> bool:
    """A connection that failed or timed out (the HTTP client's classes are matched by name:
    huggingface_hub's client library has changed between versions)."""
    names = {kind.__name__ for kind in type(error).__mro__}
    return isinstance(error, (ConnectionError, TimeoutError)) or bool(names & {"ConnectError", "TimeoutException",
                                                                              "NetworkError"})


def _first(chain: list[BaseException], kind: type) -> Optional[BaseException]:
    return next((e for e in chain if isinstance(e, kind)), None)


def explain(error: BaseException, key: str, name: str, *, what: str = "model", revision: Optional[str] = None,
            revision_key: str = "model.revision", offline_why: Optional[str] = None,
            cache: Optional[str] = None) -> Optional[Problem]:
    """The Problem for a failed hub read of `name` (set by `key`), or None when `error` is not one."""
    from huggingface_hub import errors as hub_errors

    chain = _chain(error)
    text = " ".join(str(e) for e in chain)
    page = f"https://huggingface.co/{'datasets/' if what == 'data set' else ''}{name}"
    local = "a local directory (a save_pretrained output)" if what != "data set" else "a local file or directory"
    if _first(chain, hub_errors.GatedRepoError):
        return Problem(key, f"{name} is a gated {what} repository: it needs approved access and a token",
                       fix=f"accept its terms at {page}, then put a token in HF_TOKEN (or run `hf auth login`); "
                       f"or give {local}")
    if _first(chain, hub_errors.RevisionNotFoundError):
        return Problem(revision_key, f"{name} has no revision {revision!r}",
                       fix=f"set {revision_key} to a branch, tag or commit of {page}")
    if _first(chain, hub_errors.HFValidationError):
        return Problem(key, f"{name!r} is neither an existing local path nor a hub name (owner/name)",
                       fix=f"check the path, or give {local}")
    if _first(chain, hub_errors.RepositoryNotFoundError):
        return Problem(key, f"{name!r} is not a local path, and the hub has no {what} repository of that name "
                       "(or it is private and no token was given)",
                       fix=f"check the name; for a private repository put a token in HF_TOKEN; or give {local}")
    if _first(chain, hub_errors.DisabledRepoError):
        return Problem(key, f"{name} is disabled on the hub", fix=f"use another {what}, or {local}")
    offline = _first(chain, hub_errors.OfflineModeIsEnabled) or _first(chain, hub_errors.LocalEntryNotFoundError)
    network = any(_transport(e) for e in chain) or "couldn't connect" in text.lower() or "couldn't reach" in text.lower()
    if offline or network or offline_why:
        why = offline_why or (unreachable() if not offline else None) or "the hub did not answer"
        tried = "the local cache only" if offline_why else "the local cache, then the hub"
        return Problem(key, f"{what} {name!r} is not in the local cache ({cache or _cache_dir()}) and {why} "
                       f"(tried {tried})",
                       fix=f"give {local}; or fill the cache on a machine with a network (`hf download "
                       f"{'--repo-type dataset ' if what == 'data set' else ''}{name}`) and set HF_HUB_OFFLINE=1 here")
    entry = _first(chain, hub_errors.EntryNotFoundError)
    if entry is not None or "does not appear to have a file named" in text:
        return Problem(key, f"{name} has no {what} files where they were looked for: {chain[0]}".splitlines()[0],
                       fix=f"check that {name} is a {what} repository, or give {local}")
    status = _first(chain, hub_errors.HfHubHTTPError)
    if status is not None:
        return Problem(key, f"the hub refused reading {name}: {str(status).splitlines()[0]}",
                       fix=f"try again later, or give {local}")
    return None


def cached(name: str, what: str = "model") -> bool:
    """Whether the local hub cache holds any snapshot of `name` (a directory look, no library)."""
    from huggingface_hub import constants

    kind = "datasets" if what == "data set" else "models"
    snapshots = Path(constants.HF_HUB_CACHE) / f"{kind}--{name.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def refuse_if_unreadable(key: str, name: Optional[str], what: str = "model") -> None:
    """Before anything heavy is imported or built: a hub name that cannot be read now (the hub
    plainly unreachable and nothing of it cached) is refused at once."""
    refuse_missing_local(key, name, what)
    if not name or is_local(name):
        return
    why = unreachable()
    if why and not cached(name, what):
        from huggingface_hub.errors import LocalEntryNotFoundError

        problem = explain(LocalEntryNotFoundError(f"{name} is not cached"), key, name, what=what, offline_why=why)
        raise UserError(problem, title=f"cannot read the {what} {name!r}")


def refuse_unreadable_names(cfg: RunConfig) -> None:
    """The run's model and tokenizer names, checked as `refuse_if_unreadable` says."""
    refuse_if_unreadable("model.name_or_path", cfg.model.name_or_path)
    refuse_if_unreadable("tokenizer.name_or_path", cfg.tokenizer.name_or_path, "tokenizer")


def refuse_missing_data(cfg: RunConfig) -> None:
    """A data file the run reads that is not here: said before the libraries load, never as hub
    advice (`train`; explain, plan and export take a config meant for another machine)."""
    refuse_missing_local("data.source", cfg.data.source, "data set")
    for index, entry in enumerate(cfg.data.sources):
        refuse_missing_local(f"data.sources.{index}.source", entry.source, "data set")


@contextmanager
def reading(key: str, name: Optional[str], *, what: str = "model", revision: Optional[str] = None,
            revision_key: str = "model.revision", cache: Optional[str] = None) -> Iterator[None]:
    """A hub read of `name` inside: cache-only at once when the hub is plainly unreachable, and
    every hub failure one message naming `key` (exit 2). A local path is read as it is."""
    refuse_missing_local(key, name, what)
    if not name or is_local(name):
        try:
            yield
        except OSError:  # a directory whose weights were left behind: said by key, where any model is read
            weightless = weightless_local(key, name, "give a save_pretrained directory that holds the weights")
            if weightless is None:
                raise
            raise UserError(weightless) from None
        return
    if what != "data set":  # datasets keeps its own cache (under data.cache_dir): it decides
        refuse_if_unreadable(key, name, what)
    why = unreachable()
    try:
        if why:
            with _offline():
                yield
        else:
            yield
    except UserError:
        raise
    except Exception as error:
        problem = explain(error, key, name, what=what, revision=revision, revision_key=revision_key,
                          offline_why=why, cache=cache)
        if problem is None:
            raise
        raise UserError(problem, title=f"cannot read the {what} {name!r}") from None
