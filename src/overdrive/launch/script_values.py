"""The configured values inside an unchanged script's TrainingArguments and Accelerator.

`overdrive launch` hands a script the strategy through Accelerate's environment, as
`accelerate launch` does. That is not enough for a Transformers Trainer: it builds its own
Accelerator from its TrainingArguments (accumulation, precision, clipping, batch sizes,
optimizer and schedule values), ignores ACCELERATE_GRADIENT_ACCUMULATION_STEPS, and with
DeepSpeed refuses any DeepSpeed value that differs from its arguments. `accelerate launch`
leaves that to the user (and with DeepSpeed the run dies with "Please correct the following
DeepSpeed config values that mismatch TrainingArguments values").

So, while the script runs in a worker, TrainingArguments' `__post_init__` (also for
subclasses such as TRL's SFTConfig) and `Accelerator.__init__` first apply the config. The
rule, per field of hf/fields.py (per `mixed_precision` / `gradient_accumulation_steps` for a
direct `Accelerator(...)`):

- the config sets the key (any layer above the schema defaults), the script does not (its
  value is the class default): the config's value is used, silently;
- both set it and they differ: the config's value is used, and rank 0 prints, once and
  before the first step, the key, both values, both origins (the config's file:line, the
  script's call file:line) and the value the run uses; with `launch.script_conflicts: error`
  every rank stops instead (exit 2, reported once by the launcher);
- the config leaves the key at its schema default: the script's value is used.

Then the DeepSpeed config, whose Trainer-owned entries overdrive leaves "auto", is filled by
the Trainer from arguments that already hold these values: the two cannot disagree. Scoped
like the CPU workarounds: the replaced methods are put back when the script has run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import traceback
from typing import Any, Iterator, Mapping

from overdrive.config.provenance import Origin
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError

# Where `__new__` leaves, on the instance, what the call passed (popped in __post_init__).
CALL_RECORD = "_overdrive_script_call"
# Accelerate reads these when the DeepSpeed plugin is built inside TrainingArguments: they must
# hold the values the run uses, or the plugin fills "auto" with one value and the Trainer
# checks it against another.
ENV_OF_FIELD = {"gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                "max_grad_norm": "ACCELERATE_GRADIENT_CLIPPING"}


@dataclasses.dataclass
class Conflict:
    key: str
    field: str
    config_value: Any
    config_origin: str
    script_value: Any
    script_call: str

    def describe(self, fatal: bool) -> str:
        outcome = ("launch.script_conflicts is error: the run stops" if fatal else
                   f"the run uses the config's {self.field}={self.config_value!r} "
                   "(launch.script_conflicts: error makes this fatal)")
        return (f"the script and the config disagree on {self.key}\n"
                f"  config: {self.key} -> {self.field}={self.config_value!r}   ({self.config_origin})\n"
                f"  script: {self.field}={self.script_value!r}   ({self.script_call})\n"
                f"  {outcome}")


class ScriptValues:
    """Applies the config to the script's TrainingArguments / Accelerator calls (see module doc)."""

    def __init__(self, cfg: RunConfig, origins: Mapping[str, Origin], script: str) -> None:
        self.cfg, self.origins, self.script = cfg, origins, os.path.abspath(script)
        self.mode = cfg.launch.script_conflicts
        self.reported: set[tuple[str, str]] = set()
        self.rank0 = os.environ.get("RANK", "0") == "0"
        self.refused: list[Conflict] = []

    # ---------------------------------------------------------------- the rule

    def set_by_config(self, key: str) -> bool:
        origin = self.origins.get(key)
        return origin is not None and origin.layer != "default"

    def origin_text(self, key: str) -> str:
        origin = self.origins.get(key)
        return str(origin) if origin else "config"

    def settle(self, field: str, key: str, config_value: Any, script_value: Any, script_set: bool,
               call: str) -> Any:
        """The value the run uses for one field; a conflict is reported or raised."""
        if not self.set_by_config(key):
            return script_value
        if not script_set or _same(script_value, config_value):
            return config_value
        conflict = Conflict(key, field, config_value, self.origin_text(key), script_value, call)
        if self.mode == "error":
            self.refused.append(conflict)
            return config_value
        if self.rank0 and (key, field) not in self.reported:
            self.reported.add((key, field))
            print(f"overdrive: {conflict.describe(fatal=False)}", file=sys.stderr, flush=True)
        return config_value

    def raise_refused(self) -> None:
        """With `launch.script_conflicts: error`: every disagreement of one call, at once."""
        if self.refused:
            refused, self.refused = self.refused, []
            raise UserError([Problem("launch.script_conflicts", c.describe(fatal=True),
                                     fix=f"remove {c.field}= from the script's call, or change {c.key} in the config")
                             for c in refused], title="the script contradicts the run config")

    # ---------------------------------------------------------------- TrainingArguments

    def training_arguments(self, args: Any) -> None:
        """Apply the config to a TrainingArguments (or subclass) before its own __post_init__.

        What the script set is what its call passed (recorded by `__new__` below). Arguments
        made by a library (HfArgumentParser passes every field) count as set where they
        differ from the class default.
        """
        from overdrive.hf.fields import values

        explicit, call, by_user = args.__dict__.pop(CALL_RECORD, (set(), self.call_site(type(args).__name__)[0], False))
        defaults = _field_defaults(type(args))
        for field, config_value in values(self.cfg):
            if not field.launch or not hasattr(args, field.name):
                continue
            script_value = getattr(args, field.name)
            if by_user:
                script_set = field.name in explicit
            else:
                script_set = field.name in defaults and not _same(script_value, defaults[field.name])
            setattr(args, field.name, self.settle(field.name, field.key, config_value, script_value, script_set, call))
        self.raise_refused()
        for name, variable in ENV_OF_FIELD.items():
            value = getattr(args, name, None)
            if value is not None:
                os.environ[variable] = str(value)

    # ---------------------------------------------------------------- Accelerator

    def accelerator_kwargs(self, bound: Mapping[str, Any]) -> dict[str, Any]:
        """A direct `Accelerator(...)` call's arguments, with the config applied."""
        kwargs = dict(bound)
        call, by_user = self.call_site("Accelerator")
        if not by_user:  # made by a library (the Trainer): it passes settled values
            return kwargs
        t, p = self.cfg.training, self.cfg.precision
        if "mixed_precision" in kwargs and kwargs["mixed_precision"] is not None:
            kwargs["mixed_precision"] = self.settle("mixed_precision", "precision.mixed_precision",
                                                    p.mixed_precision, kwargs["mixed_precision"], True, call)
        if "gradient_accumulation_steps" in kwargs and "gradient_accumulation_plugin" not in kwargs:
            kwargs["gradient_accumulation_steps"] = self.settle(
                "gradient_accumulation_steps", "training.gradient_accumulation_steps",
                t.gradient_accumulation_steps, kwargs["gradient_accumulation_steps"], True, call)
        self.raise_refused()
        return kwargs

    def call_site(self, what: str) -> tuple[str, bool]:
        """(`what(...) at file:line`, True) for the innermost caller in the user's own code;
        (`what(...) in <package>`, False) when an installed library made the call."""
        for frame in reversed(traceback.extract_stack()[:-2]):
            kind = _kind(frame.filename)
            if kind == "user":
                return f"{what}(...) at {_shown(frame.filename)}:{frame.lineno}", True
            if kind == "package":
                return f"{what}(...) in {frame.filename}:{frame.lineno}", False
        return f"{what}(...) in {_shown(self.script)}", True


@contextlib.contextmanager
def applied(cfg: RunConfig, origins: Mapping[str, Origin], script: str) -> Iterator[ScriptValues]:
    """TrainingArguments.__post_init__ and Accelerator.__init__ apply the config inside the block."""
    import inspect

    from accelerate import Accelerator
    from transformers import TrainingArguments

    values = ScriptValues(cfg, origins, script)
    post_init, init = TrainingArguments.__dict__["__post_init__"], Accelerator.__dict__["__init__"]
    signature = inspect.signature(init)

    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> None:
        values.training_arguments(self)
        post_init(self, *args, **kwargs)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        explicit = {k: v for k, v in bound.arguments.items() if k not in ("self", "kwargs")}
        explicit.update(bound.arguments.get("kwargs", {}))
        init(self, **values.accelerator_kwargs(explicit))

    _install_recording_new(TrainingArguments)
    TrainingArguments.__post_init__, Accelerator.__init__ = __post_init__, __init__
    _recording.append(values)
    try:
        yield values
    finally:
        _recording.remove(values)
        TrainingArguments.__post_init__, Accelerator.__init__ = post_init, init


# The values of the block a script runs in; empty outside it, where `_recording_new` is inert.
_recording: list[ScriptValues] = []


def _recording_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """TrainingArguments.__new__: the one place that sees which fields the call passed, for
    subclasses too (each dataclass subclass has its own generated __init__)."""
    instance = object.__new__(cls)
    if _recording:
        positional = [f.name for f in dataclasses.fields(cls) if f.init][:len(args)]
        call, by_user = _recording[-1].call_site(cls.__name__)
        instance.__dict__[CALL_RECORD] = ({*positional, *kwargs}, call, by_user)
    return instance


def _install_recording_new(cls: type) -> None:
    """Installed once and left: CPython cannot give a class back its inherited `__new__`. After
    an assigned one is deleted (or object.__new__ assigned), the class still calls object.__new__
    with the call's arguments, and every later TrainingArguments(...) in the process raises
    "object.__new__() takes exactly one argument"."""
    if cls.__dict__.get("__new__") is not _recording_new:
        cls.__new__ = _recording_new


def _shown(path: str) -> str:
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _field_defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _kind(filename: str) -> str:
    """Who wrote the code of a stack frame: "user", "package" (installed), or "skip"
    (overdrive itself, the standard library, generated code such as dataclass __init__)."""
    import sysconfig

    import overdrive

    if filename.startswith("<"):
        return "skip"
    path = os.path.realpath(filename)
    paths = sysconfig.get_paths()
    if any(path.startswith(os.path.realpath(paths[k]) + os.sep) for k in ("purelib", "platlib")):
        return "package"
    own = os.path.realpath(os.path.dirname(overdrive.__file__))
    if path.startswith(own + os.sep) or any(path.startswith(os.path.realpath(paths[k]) + os.sep)
                                            for k in ("stdlib", "platstdlib")):
        return "skip"
    return "user"


def _same(a: Any, b: Any) -> bool:
    if hasattr(a, "value"):  # TrainingArguments turns strings into enums in __post_init__
        a = a.value
    if hasattr(b, "value"):
        b = b.value
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= 1e-12 * max(abs(a), abs(b), 1.0)
    return a == b
