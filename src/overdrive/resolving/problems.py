"""pydantic's validation errors as overdrive's problems, by dotted key and origin."""

from __future__ import annotations

from typing import Mapping

from pydantic import ValidationError

from overdrive.config.provenance import Setting
from overdrive.errors import Problem

def pydantic_problems(error: ValidationError, chains: Mapping[str, list[Setting]]) -> list[Problem]:
    from overdrive.config.redact import shown

    # One bad value in a Union field yields one error per member: report it once, saying
    # what each member would have accepted.
    messages: dict[str, list[str]] = {}
    for item in error.errors():
        loc = [str(part) for part in item["loc"] if not str(part).startswith(("function-", "literal["))]
        # Union members add their type name to loc ("int", "literal['auto']"): keep the key only.
        while loc and ".".join(loc) not in chains and ".".join(loc[:-1]) in chains:
            loc = loc[:-1]
        key = ".".join(loc)
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            from overdrive.config.keys import suggest

            message = "unknown key" + suggest(key)
        messages.setdefault(key, []).append(message if not messages.get(key) else message.lower())
    problems = []
    for key, texts in messages.items():
        chain = chains.get(key)
        if chain is None:  # an entry inside a list value (data.sources.0.weight): the list's origin
            owner = next((k for k in sorted(chains, key=len, reverse=True) if key.startswith(k + ".")), None)
            if owner is not None:
                problems.append(Problem(key, "; or ".join(dict.fromkeys(texts)), str(chains[owner][-1].origin)))
                continue
        where = str(chain[-1].origin) if chain else ""
        got = f" (got {shown(key, chain[-1].value)!r})" if chain else ""
        problems.append(Problem(key, "; or ".join(dict.fromkeys(texts)) + got, where))
    return problems


