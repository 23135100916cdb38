"""A variable that looks like overdrive's but is not read: `OVERDRIVE_TRAINING_MAX_STEPS=5` (one
underscore between section and key) would otherwise be ignored without a word.

    lookalike_warnings({"OVERDRIVE_TRAINING_MAX_STEPS": "5"})
    -> [Problem("training.max_steps", "OVERDRIVE_TRAINING_MAX_STEPS is not read ...", fix="OVERDRIVE_TRAINING__MAX_STEPS=5")]
"""

from __future__ import annotations

from itertools import product
from typing import Mapping, Optional

from overdrive.config import keys
from overdrive.errors import Problem

PREFIX = "OVERDRIVE_"


def meant_key(name: str) -> Optional[str]:
    """The dotted key an OVERDRIVE_ name without `__` spells with single underscores, if one does."""
    words = name[len(PREFIX):].lower().split("_")
    if len(words) < 2 or len(words) > 9:
        return None
    for joins in product(("_", "."), repeat=len(words) - 1):
        key = words[0] + "".join(join + word for join, word in zip(joins, words[1:]))
        if "." in key and keys.is_known(key):
            return key
    return None


def spelled(key: str) -> str:
    return PREFIX + "__".join(part.upper() for part in key.split("."))


def lookalike_warnings(environ: Mapping[str, str]) -> list[Problem]:
    found = []
    for name, value in sorted(environ.items()):
        if not name.startswith(PREFIX) or "__" in name:
            continue
        key = meant_key(name)
        if key is not None:
            found.append(Problem(key, f"{name} is not read: overdrive's variables put two underscores "
                                      "between section and key", f"env {name}", f"{spelled(key)}={value}"))
    return found
