"""The package type-checks clean under mypy, at the level pyproject.toml's [tool.mypy] sets
(check_untyped_defs; the heavy libraries not followed; the modules not yet clean listed there
with the error codes they still raise). mypy runs in this process (mypy.api): no interpreter
is started, and its cache (.mypy_cache in the checkout) makes a run after the first take about
a second (a cold one, 20-40 s)."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import REPO


def test_the_package_type_checks_clean(monkeypatch):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed in this environment (the test extra installs it: "
                    "bash scripts/setup.sh, or pip install -e '.[test]')")
    from mypy import api

    monkeypatch.chdir(REPO)  # pyproject.toml's [tool.mypy] names the files from the checkout's root
    out, err, status = api.run([])
    assert status == 0, (out + err)[-6000:]
