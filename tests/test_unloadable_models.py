"""A model a run names that cannot be loaded as the run would load it: a directory whose weights were left
behind (config.json and tokenizer only), refused for the student, the distillation teacher and any model
read back by their key before the data is read; a vision-language student or teacher for distillation,
whose teacher is a causal LM, refused before either loads. Never a library traceback after the work."""

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


def test_distillation_of_or_from_a_vision_language_model_is_refused_before_either_loads(llama, tmp_path):
    import json

    from overdrive.hf import teacher
    from overdrive.resolving import composition

    cfg = cfg_of("model.name_or_path=org/vlm", "data.format=chat", "distill.teacher=org/teacher")
    assert [p.key for p in composition.problems(cfg, vision=True)] == ["distill.teacher"]
    seeing = tmp_path / "seeing"  # the student's tokenizer, a vision-language config: AutoModelForCausalLM has no class
    shutil.copytree(llama, seeing)
    (seeing / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vocab_size": 37}))
    found = teacher.fit_problems(cfg_of(f"model.name_or_path={llama}", "model.from_scratch=false",
                                        f"distill.teacher={seeing}"))
    assert [p.key for p in found] == ["distill.teacher"] and "vision-language" in found[0].message
