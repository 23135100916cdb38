"""Resolving a run: every layer read (resolve.py, layers.py), every rule checked at once
(validate.py and the rules beside it), the result a Resolved (resolved.py): the RunConfig and
the origin of each value. It stands above strategies/ and interop/, whose rules it asks."""

from overdrive.resolving.resolve import accelerate_default_path, check_for_train, hardware_warnings, load_config, resolve
from overdrive.resolving.resolved import SECRETS_VARIABLE, Resolved

__all__ = ["SECRETS_VARIABLE", "Resolved", "accelerate_default_path", "check_for_train", "hardware_warnings",
           "load_config", "resolve"]
