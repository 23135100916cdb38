"""The tested set of versions (src/overdrive/system/constraints.txt) against pyproject.toml's
ranges, the drift `overdrive env` and `overdrive train` say, and the code right on an Accelerate
without MS-AMP (1.16 removed it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import REPO, cfg_of, run_here
from packaging.requirements import Requirement

from overdrive.errors import UserError
from overdrive.system import tested

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the suite runs on 3.11
    tomllib = pytest.importorskip("tomli")

# The extras scripts/setup.sh installs, beside the base dependencies and DeepSpeed.
INSTALLED_EXTRAS = ("test", "tensorboard", "eval", "deepspeed")


def _requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra, extra_lines in project["optional-dependencies"].items():
        lines += extra_lines if extra in INSTALLED_EXTRAS else []
    return [Requirement(line) for line in lines]


def test_every_dependency_is_pinned_in_the_tested_set_within_pyproject_s_range():
    pins = tested.tested_versions()
    unpinned, outside = [], []
    for requirement in _requirements():
        version = pins.get(tested.canonical(requirement.name))
        if version is None:
            unpinned.append(requirement.name)
        elif not requirement.specifier.contains(version, prereleases=True):
            outside.append(f"{requirement.name}=={version} not in {requirement.specifier}")
    assert not unpinned, f"not in constraints.txt: {unpinned}"
    assert not outside, f"the tested set and pyproject.toml's ranges disagree: {outside}"


def test_every_key_package_is_pinned_and_setup_installs_the_file():
    pins = tested.tested_versions()
    assert [p for p in tested.KEY_PACKAGES if tested.canonical(p) not in pins] == []
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "src/overdrive/system/constraints.txt" in setup and "-c " in setup


def test_drift_names_what_differs_and_ignores_local_labels():
    pins = {"torch": "2.13.0", "accelerate": "1.15.0", "transformers": "5.24.0", "deepspeed": "0.19.8"}
    installed = {"torch": "2.13.0+cpu", "accelerate": "1.16.0", "transformers": "5.24.0", "deepspeed": None}
    found = tested.drift(installed, pins)
    assert [(d.package, d.installed, d.tested) for d in found] == [("accelerate", "1.16.0", "1.15.0")]
    line = tested.drift_line(found)
    assert line.startswith("overdrive: untested versions: accelerate 1.16.0 (tested 1.15.0)")
    assert "\n" not in line
    assert tested.drift_line(tested.drift({**installed, "accelerate": "1.15.0"}, pins)) == ""
    # A key package every run needs, missing, is drift; an optional one (deepspeed) is not.
    assert [d.package for d in tested.drift({"torch": None}, {"torch": "2.13.0"})] == ["torch"]


def test_env_json_lists_installed_beside_tested_and_marks_the_differences(monkeypatch):
    import overdrive.system.report as report

    real = report.versions()
    monkeypatch.setattr(report, "versions", lambda: {**real, "accelerate": "9.9.9"})
    result = run_here("env", "--json", "--no-hardware")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["versions"]["accelerate"] == "9.9.9"
    assert data["tested_versions"]["accelerate"] == tested.tested_versions()["accelerate"]
    assert "accelerate" in data["untested"]
    markdown = run_here("env", "--no-hardware").stdout
    row = next(line for line in markdown.splitlines() if line.startswith("| accelerate |"))
    assert "9.9.9" in row and "differs" in row


def test_ms_amp_is_refused_by_key_where_accelerate_has_none(monkeypatch):
    from overdrive.strategies import library_features

    monkeypatch.setattr(library_features, "msamp_supported", lambda: False)
    with pytest.raises(UserError) as error:
        cfg_of("precision.mixed_precision=fp8", "precision.fp8.backend=MSAMP", "parallel.strategy=deepspeed")
    problem = next(p for p in error.value.problems if p.key == "precision.fp8.backend")
    assert "MS-AMP" in problem.message and "TE" in problem.fix and "AO" in problem.fix
    assert library_features.deepspeed_plugin_fp8_kwargs(False, "O1") == {}


def test_the_deepspeed_plugin_accepts_what_is_passed_on_the_installed_accelerate():
    pytest.importorskip("deepspeed")
    from overdrive.strategies.deepspeed import plugin

    ds = plugin(cfg_of("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2"), 2)
    assert ds.zero_stage == 2


def test_tested_versions_ship_with_the_package():
    assert (Path(tested.__file__).parent / "constraints.txt").is_file()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert "system/constraints.txt" in pyproject
