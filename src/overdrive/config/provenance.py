"""Where a value came from: the types every layer and every native reader produce.

A layer turns its source into `Setting`s (dotted key, value, `Origin`); `LayerOutput`
carries them with the problems found on the way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from overdrive.errors import Problem


@dataclass(frozen=True)
class Origin:
    """Where a value came from: the layer, and the file:line or variable when there is one."""

    layer: str
    source: str = ""
    line: int | None = None

    def __str__(self) -> str:
        if not self.source:
            return self.layer
        return f"{self.layer} {self.source}" + (f":{self.line}" if self.line else "")


@dataclass(frozen=True)
class Setting:
    key: str
    value: Any
    origin: Origin
    # "deepspeed" when the value was written explicitly in a DeepSpeed JSON: DeepSpeed will
    # insist on it, so a different winning value is a contradiction, not an override.
    native: str = ""


@dataclass
class LayerOutput:
    settings: list[Setting] = field(default_factory=list)
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)

    def extend(self, other: "LayerOutput") -> None:
        self.settings += other.settings
        self.errors += other.errors
        self.warnings += other.warnings


def where(chains: Optional[Mapping[str, list[Setting]]], key: str, unset: str = "") -> str:
    """The origin of `key`'s winning value, as text: `unset` where no layer set it, "" where the
    chains are not at hand (a config built in Python, or read back from a resolved file)."""
    if chains is None:
        return ""
    chain = chains.get(key)
    return str(chain[-1].origin) if chain else unset


def set_by_user(chains: Mapping[str, list[Setting]], key: str) -> bool:
    """Whether a layer above the schema's defaults set `key`."""
    chain = chains.get(key)
    return bool(chain and chain[-1].origin.layer != "default")
