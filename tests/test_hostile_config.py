"""Config values that would fail inside a library, or train wrongly, are refused by key when
the config loads: before anything is written or started."""

from __future__ import annotations

import pytest

from overdrive.resolving import resolve
from overdrive.errors import UserError


def refused_keys(*cli: str) -> dict[str, str]:
    with pytest.raises(UserError) as error:
        resolve([], cli=list(cli))
    return {p.key: p.message for p in error.value.problems}


def test_optim_class_path_must_import_and_be_an_optimizer(tmp_path, monkeypatch):
    assert "not an optimizer" in refused_keys("optim.class_path=torch.nn.Linear")["optim.class_path"]
    assert "absolute" in refused_keys("optim.class_path=.optim.RAdam")["optim.class_path"]
    (tmp_path / "broken_optimizer_module.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "boom at import" in refused_keys("optim.class_path=broken_optimizer_module.Opt")["optim.class_path"]
    assert resolve([], cli=["optim.class_path=torch.optim.RAdam"]).config.optim.class_path == "torch.optim.RAdam"


def test_empty_target_modules_are_refused(tmp_path):
    from hf_fixtures import make_tiny_llama

    base = make_tiny_llama(tmp_path / "base")
    found = refused_keys(f"model.name_or_path={base}", "peft.method=lora", "peft.target_modules=[]")
    assert list(found) == ["peft.target_modules"]


def test_a_cache_dir_that_names_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    assert "is a file" in refused_keys(f"data.cache_dir={tmp_path / 'file'}")["data.cache_dir"]
    assert "data.cache_dir" in refused_keys(f"data.cache_dir={tmp_path / 'file' / 'below'}")


def test_a_mixture_of_chat_and_text_sources_is_refused_by_key():
    found = refused_keys("data.format=chat", "model.name_or_path=some/model",
                         "data.sources=[{name: talk, source: a.jsonl}, {name: prose, source: b.txt, format: text}]")
    assert "mixes chat and plain" in found["data.sources.1.format"]


def test_a_sweep_grid_is_counted_not_built():
    found = refused_keys("sweep.sampler=grid",
                         "sweep.space={training.seed: {low: 0, high: 4000000000}, training.max_steps: {low: 1, high: 100000000}}")
    assert "400,000,000,100,000,000 points" in found["sweep.space"]
