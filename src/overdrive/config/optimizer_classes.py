"""The optimizer class a run names (`optim.name` through the catalogue, or `optim.class_path`),
imported only when asked, and `optim.kwargs` checked against that class's own signature when
the config loads (did-you-mean), never at step 1."""

from __future__ import annotations

import importlib
import inspect

import overdrive.config.optimizer_catalog as optimizer_catalog
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError

# Keyword arguments overdrive passes itself, from its own keys: `optim.kwargs` may not repeat them.
_OWN_ARGUMENTS = {"params", "lr", "weight_decay", "betas", "eps", "momentum", "nesterov", "fused", "foreach",
                  "warmup_steps"}


def import_class(path: str, key: str = "optim.class_path"):
    """The class named by a dotted import path, or a UserError naming `key`: a relative path,
    a module that fails to import (whatever it raises), a name that is no class."""
    module_name, _, name = path.rpartition(".")
    if path.startswith(".") or not module_name or not name:
        raise UserError(Problem(key, f"{path!r} is not an absolute module.Class path",
                                fix="give a module.Class path, e.g. torch.optim.RAdam"))
    try:
        found = getattr(importlib.import_module(module_name), name)
    except ImportError as error:
        raise UserError(Problem(key, f"cannot import {module_name!r}: {error}",
                                fix="give a module.Class path of an installed package")) from None
    except AttributeError:
        found = None
    except Exception as error:  # the module's own code failed while importing
        raise UserError(Problem(key, f"importing {module_name!r} failed: {type(error).__name__}: {str(error)[:200]}",
                                fix="fix the module, or give another module.Class path")) from None
    if not isinstance(found, type):
        raise UserError(Problem(key, f"{path!r} is not a class", fix="give a module.Class path, e.g. torch.optim.RAdam"))
    return found


def _optimizer_class(path: str, key: str = "optim.class_path"):
    """`import_class`, refusing a class that is no torch optimizer (a module, a model layer)."""
    import torch

    found = import_class(path, key)
    if not issubclass(found, torch.optim.Optimizer):
        raise UserError(Problem(key, f"{path!r} is not an optimizer (not a torch.optim.Optimizer subclass)",
                                fix="give an optimizer class, e.g. torch.optim.RAdam"))
    return found


def optimizer_class(cfg: RunConfig):
    """The class `optim.name` or `optim.class_path` builds (for Muon: torch's Muon)."""
    o = cfg.optim
    if o.class_path:
        return _optimizer_class(o.class_path)
    kind = optimizer_catalog.of(cfg)
    if kind.name == "deepspeed":
        return None  # built by DeepSpeed from the JSON block
    try:
        return import_class(kind.builds, "optim.name")
    except UserError:
        raise UserError(Problem("optim.name", f"{o.name} needs the {kind.package} package, which is not installed",
                                fix=f"pip install {kind.package}, or choose another optim.name")) from None


def kwargs_problems(cfg: RunConfig, where=lambda key: "") -> list[Problem]:
    """`optim.kwargs` against the optimizer's own signature: unknown names, with a did-you-mean."""
    import difflib

    o = cfg.optim
    if not o.kwargs and not o.class_path:
        return []
    try:
        cls = optimizer_class(cfg)
    except UserError as error:
        return [Problem(p.key, p.message, where(p.key), p.fix) for p in error.problems]
    if cls is None:
        return [Problem("optim.kwargs", "the DeepSpeed optimizer takes its settings from the JSON's optimizer "
                        "block", where("optim.kwargs"), "move them into optimizer.params of the DeepSpeed file")] if o.kwargs else []
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return []
    accepted = [name for name in parameters if name not in ("self", "params")]
    problems = []
    for name in o.kwargs:
        if name in _OWN_ARGUMENTS and name in accepted:
            problems.append(Problem(f"optim.kwargs.{name}", "is set by overdrive from its own key", where(f"optim.kwargs.{name}"),
                                    f"set {_own_key(name)} instead"))
        elif name not in accepted:
            close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
            problems.append(Problem(f"optim.kwargs.{name}", f"{cls.__name__} has no argument {name!r}{hint}",
                                    where(f"optim.kwargs.{name}"),
                                    f"its arguments: {', '.join(accepted)}"))
    return problems


def _own_key(name: str) -> str:
    return {"fused": "optim.implementation", "foreach": "optim.implementation",
            "warmup_steps": "scheduler.warmup_steps"}.get(name, f"optim.{name}")
