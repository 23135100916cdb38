"""What the layers a user may not know about (Accelerate's default_config.yaml, the
environment) change in a run's config: `overdrive env` lists them."""

from __future__ import annotations

from typing import Any

from overdrive.config.env_report import MASK, is_secret_name
from overdrive.errors import UserError


def _schema_default(key: str) -> Any:
    from overdrive.config.schema import RunConfig

    node: Any = RunConfig()
    for part in key.split("."):
        if isinstance(node, dict):
            node = node.get(part)
        else:
            node = getattr(node, part, None)
        if node is None:
            return None
    return node


def _resolved_value(resolved: Any, key: str) -> Any:
    """The effective value of `key` in whatever shape `resolve()` returns it."""
    for attribute in ("values", "flat"):
        table = getattr(resolved, attribute, None)
        if isinstance(table, dict) and key in table:
            return table[key]
    node = getattr(resolved, "config", resolved)
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if node is None:
            return None
    return node


def layer_changes(layers: tuple[str, ...] = ("accelerate-default", "env")) -> dict[str, Any]:
    """Keys whose effective value comes from `layers`, via the config resolver.

    Returns {"available": bool, "error": str | None, "changes": [{key, value, default, layer,
    where}]}. The mapping from Accelerate's keys to overdrive's belongs to the resolver; when
    it is not importable this reports that instead of guessing.
    """
    from overdrive.resolving.resolve import resolve

    try:
        resolved = resolve(files=(), cli=())
    except UserError as error:
        return {"available": True, "error": "\n".join(f"- {p.render()}" for p in error.problems), "changes": []}
    changes = []
    chains = getattr(resolved, "chains", None) or {}
    for key, origin in sorted(getattr(resolved, "origins", {}).items()):
        # The chain holds every layer's setting for the key, so a value that a higher layer
        # overrides is still reported: it would come back as soon as that layer is gone.
        settings = [s for s in chains.get(key, []) if s.origin.layer in layers]
        if not settings and getattr(origin, "layer", origin) in layers:
            settings = [None]
        for setting in settings:
            layer = setting.origin.layer if setting else getattr(origin, "layer", origin)
            final_layer = getattr(origin, "layer", origin)
            value = _jsonable(setting.value if setting else _resolved_value(resolved, key))
            default = _jsonable(_schema_default(key))
            if value == default:  # restating a default changes nothing: keep the list short
                continue
            if is_secret_name(key):
                value = MASK
            changes.append(
                {
                    "key": key,
                    "value": value,
                    "default": default,
                    "layer": layer,
                    "where": _where(setting.origin if setting else origin),
                    "overridden_by": None if final_layer == layer else str(origin),
                }
            )
    return {"available": True, "error": None, "changes": changes}


def _where(origin: Any) -> str:
    source, line = getattr(origin, "source", None), getattr(origin, "line", None)
    return f"{source}:{line}" if source and line else str(source or "")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, tuple):
        return list(value)
    return value
