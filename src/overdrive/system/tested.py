"""The tested set of dependency versions (constraints.txt, beside this module) against what
is installed.

The file is the pip constraints file scripts/setup.sh installs: every package at the version the
full suite passed on. `overdrive env` shows each key package's installed version beside the
tested one; `overdrive train` says once, in one line, when a key package differs. A difference is
a warning, never a refusal: a newer release usually works, and where an upstream API changed the
code asks the installed library what it has (strategies/library_features.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata, resources
from typing import Mapping, Optional

# The packages whose version changes what a run does; the rest of the set is what they need.
KEY_PACKAGES = ("torch", "accelerate", "transformers", "peft", "trl", "deepspeed", "datasets", "tokenizers",
                "bitsandbytes", "lm-eval", "optuna", "pydantic")

_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")


def canonical(name: str) -> str:
    """PEP 503's normal form: `lm_eval`, `LM-Eval` and `lm.eval` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def tested_versions(text: Optional[str] = None) -> dict[str, str]:
    """Package (canonical name) -> the exact version pinned in the tested set."""
    if text is None:
        text = resources.files("overdrive.system").joinpath("constraints.txt").read_text()
    pins: dict[str, str] = {}
    for line in text.splitlines():
        match = _PIN.match(line)
        if match:
            pins[canonical(match.group(1))] = match.group(2)
    return pins


def _public(version: str) -> str:
    """The version without its local label: torch's `2.13.0+cpu` is the tested `2.13.0`."""
    return version.split("+", 1)[0]


@dataclass(frozen=True)
class Drift:
    package: str
    installed: Optional[str]  # None: not installed
    tested: str

    def describe(self) -> str:
        return f"{self.package} {self.installed or 'not installed'} (tested {self.tested})"


def installed_version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def drift(installed: Optional[Mapping[str, Optional[str]]] = None,
          tested: Optional[Mapping[str, str]] = None) -> list[Drift]:
    """The key packages whose installed version is not the tested one. A key package that is not
    installed counts only where it is part of every run (torch, accelerate, transformers, ...):
    the optional ones (deepspeed, bitsandbytes, lm-eval) are missing by choice."""
    tested = tested_versions() if tested is None else tested
    found = []
    for package in KEY_PACKAGES:
        want = tested.get(canonical(package))
        if want is None:
            continue
        have = installed.get(package) if installed is not None else installed_version(package)
        if have is None and package in _OPTIONAL:
            continue
        if have is None or _public(have) != _public(want):
            found.append(Drift(package, have, want))
    return found


_OPTIONAL = frozenset({"deepspeed", "bitsandbytes", "lm-eval", "trl"})


def drift_line(found: list[Drift]) -> str:
    """The one line `overdrive train` prints before launching, or "" when nothing differs."""
    if not found:
        return ""
    return ("overdrive: untested versions: " + ", ".join(d.describe() for d in found)
            + "; `overdrive env` compares them, `bash scripts/setup.sh` installs the tested set")
