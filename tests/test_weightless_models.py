"""A model directory whose weights were left behind (config.json and tokenizer only): the student,
the distillation teacher and any model read back are refused by their key before the data is read,
never a library traceback after it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import cfg_of
from overdrive import hub
from overdrive.errors import UserError
from overdrive.resolving.validate_model import model_rules


@pytest.fixture
def weightless(llama: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "weightless"
    shutil.copytree(llama, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    return copy


def test_a_directory_without_weights_is_refused_by_the_key_that_names_it(llama, weightless):
    from overdrive.hf import teacher

    student, _ = model_rules(cfg_of(f"model.name_or_path={weightless}", "data.max_length=32"))
    assert [p.key for p in student] == ["model.name_or_path"] and "no weights" in student[0].message
    assert "model.from_scratch=true" in student[0].fix
    assert model_rules(cfg_of(f"model.name_or_path={weightless}", "data.max_length=32",
                              "model.from_scratch=true")) == ([], [])
    taught = teacher.fit_problems(cfg_of(f"model.name_or_path={llama}", "model.from_scratch=false",
                                         f"distill.teacher={weightless}"))
    assert [p.key for p in taught] == ["distill.teacher"] and "no weights" in taught[0].message


def test_a_read_that_finds_no_weights_is_said_by_its_key_wherever_it_is_read(weightless):
    with pytest.raises(UserError) as error, hub.reading("RUN_OR_MODEL", str(weightless)):
        raise OSError(f"Error no file named model.safetensors, or pytorch_model.bin, found in directory {weightless}.")
    assert error.value.problems[0].key == "RUN_OR_MODEL" and "no weights" in error.value.problems[0].message
    with pytest.raises(OSError), hub.reading("RUN_OR_MODEL", str(weightless.parent)):
        raise OSError("another failure, not about this directory's weights")  # left as it was
