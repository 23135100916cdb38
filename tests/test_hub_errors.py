"""Hub reads (model, tokenizer, data) that fail: huggingface_hub's own error classes, raised
the way the libraries raise them, become one message naming the key, what was tried and the
fix; with the hub plainly unreachable the read is cache-only and answered at once."""

from __future__ import annotations

import httpx2
import pytest
from huggingface_hub import constants
from huggingface_hub import errors as hub_errors

from overdrive import hub
from overdrive.resolving import resolve
from overdrive.errors import UserError

NAME = "someone/missing-model"


def response(status: int) -> httpx2.Response:
    return httpx2.Response(status, request=httpx2.Request("GET", f"https://huggingface.co/{NAME}/resolve/main/x"))


def wrapped(error: Exception) -> OSError:
    """As Transformers raises it: an OSError whose cause is the hub's error."""
    try:
        raise error
    except Exception as cause:
        try:
            raise OSError(f"could not load {NAME}") from cause
        except OSError as outer:
            return outer


@pytest.fixture
def online(monkeypatch):
    monkeypatch.setattr(hub, "unreachable", lambda: None)


def refusal(error: Exception, **kwargs) -> UserError:
    with pytest.raises(UserError) as caught:
        with hub.reading(kwargs.pop("key", "model.name_or_path"), NAME, **kwargs):
            raise error
    return caught.value


@pytest.mark.parametrize("error, key, says, fix", [
    (hub_errors.RepositoryNotFoundError("404", response=response(404)), "model.name_or_path",
     "the hub has no model repository of that name", "HF_TOKEN"),
    (hub_errors.GatedRepoError("403", response=response(403)), "model.name_or_path", "gated", "accept its terms"),
    (hub_errors.RevisionNotFoundError("404", response=response(404)), "model.revision", "no revision 'v9'",
     "set model.revision"),
    (hub_errors.HFValidationError("bad id"), "model.name_or_path", "neither an existing local path", "check the path"),
    (hub_errors.RemoteEntryNotFoundError("404", response=response(404)), "model.name_or_path", "has no model files",
     "is a model repository"),
])
def test_each_hub_failure_names_its_key_and_fix(online, error, key, says, fix):
    problem = refusal(wrapped(error), revision="v9").problems[0]
    assert problem.key == key and says in problem.message and fix in problem.fix


def test_a_connection_failure_says_what_was_tried(monkeypatch):
    monkeypatch.setattr(hub, "unreachable", lambda: None)
    problem = refusal(wrapped(hub_errors.LocalEntryNotFoundError("not cached"))).problems[0]
    assert "is not in the local cache" in problem.message and "tried the local cache, then the hub" in problem.message
    assert "HF_HUB_OFFLINE=1" in problem.fix and "local directory" in problem.fix
    timeout = refusal(wrapped(httpx2.ConnectTimeout("timed out")), key="tokenizer.name_or_path", what="tokenizer")
    assert timeout.problems[0].key == "tokenizer.name_or_path"


def test_an_unreachable_hub_reads_the_cache_only_then_restores_the_switch(monkeypatch):
    monkeypatch.setattr(hub, "unreachable", lambda: "huggingface.co cannot be resolved: Name or service not known")
    before = constants.HF_HUB_OFFLINE
    seen = []
    with pytest.raises(UserError) as caught:
        with hub.reading("data.source", "someone/corpus", what="data set", revision_key="data.source",
                         cache="/data/cache/datasets"):
            seen.append(constants.HF_HUB_OFFLINE)
            raise ConnectionError("Couldn't reach 'someone/corpus' on the Hub (LocalEntryNotFoundError)")
    assert seen == [True] and constants.HF_HUB_OFFLINE == before
    problem = caught.value.problems[0]
    assert problem.key == "data.source" and "/data/cache/datasets" in problem.message
    assert "cannot be resolved" in problem.message and "tried the local cache only" in problem.message
    assert "--repo-type dataset someone/corpus" in problem.fix


def test_a_local_path_and_other_errors_pass_through(tmp_path, online):
    with hub.reading("model.name_or_path", str(tmp_path)):  # a directory: no probe, no mapping
        pass
    with pytest.raises(KeyError):
        with hub.reading("model.name_or_path", NAME):
            raise KeyError("a bug stays a bug")


def test_the_model_config_of_a_run_refuses_a_missing_hub_model(monkeypatch):
    """Through the real AutoConfig, offline: the message names model.name_or_path."""
    monkeypatch.setattr(hub, "unreachable", lambda: "huggingface.co cannot be resolved (test)")
    from overdrive.training.build.model import model_config

    cfg = resolve([], cli=[f"model.name_or_path={NAME}"]).config
    with pytest.raises(UserError) as caught:
        model_config(cfg)
    assert caught.value.problems[0].key == "model.name_or_path"


def test_an_uncached_name_is_refused_before_anything_heavy_when_the_hub_is_unreachable(monkeypatch, tmp_path):
    monkeypatch.setattr(hub, "unreachable", lambda: "huggingface.co cannot be resolved (test)")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    cfg = resolve([], cli=[f"tokenizer.name_or_path={NAME}"]).config
    with pytest.raises(UserError) as caught:
        hub.refuse_unreadable_names(cfg)
    assert caught.value.problems[0].key == "tokenizer.name_or_path"
    (tmp_path / f"models--{NAME.replace('/', '--')}" / "snapshots" / "abc").mkdir(parents=True)
    hub.refuse_unreadable_names(cfg)  # something cached: the libraries read it (offline) later
