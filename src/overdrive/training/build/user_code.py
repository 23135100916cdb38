"""The user's own code (reward functions, tools) imported and called so that whatever it does ends as
a UserError by its key. `except Exception` is not enough: `sys.exit(0)` in a module raises
SystemExit, which would end `overdrive` silently with that exit code (0 reads as success, and no
model was trained). A real Ctrl-C (KeyboardInterrupt) and a generator's close (GeneratorExit) are
the interpreter's own and pass through.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from overdrive.errors import Problem, UserError

# BaseExceptions that are not the user's code misbehaving: they are let through.
PASSED_THROUGH = (KeyboardInterrupt, GeneratorExit)


def escaped(error: BaseException) -> bool:
    """True for what `except Exception` misses yet the user's code raised (SystemExit, a BaseException of
    its own): it must be refused, not left to end the process."""
    return not isinstance(error, (Exception, *PASSED_THROUGH))


def what_it_did(error: BaseException) -> str:
    """The user's code's failure in words: `called sys.exit(0)` for an exit, `raised T: message` otherwise."""
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r})" if error.code is not None else "called sys.exit()"
    return f"raised {type(error).__name__}: {error}"


def _shadowed(module_name: str) -> tuple[str, str] | None:
    """(the user's file, the module Python imported instead) where a file of the user's on the path has the
    name of a module of Python or an installed package, imported first; None otherwise."""
    import sys
    import sysconfig
    from pathlib import Path

    module = sys.modules.get(module_name)
    taken = getattr(module, "__file__", None) or ("built into Python" if module_name in sys.builtin_module_names
                                                  else None)
    roots = tuple({sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")})
    if taken is None or not (taken == "built into Python" or str(taken).startswith(roots)):
        return None
    top = module_name.split(".")[0]
    for entry in sys.path:
        folder = Path(entry or ".").resolve()
        if str(folder).startswith(roots) or not folder.is_dir():
            continue
        for mine in (folder / f"{top}.py", folder / top):
            if mine.exists():
                return str(mine), str(taken)
    return None


def import_attribute(path: str, module_name: str, attribute: str, key: str) -> Callable[..., Any]:
    """`module_name.attribute`, a callable, or a UserError by `key`: not found, the module failing (or
    exiting) as it is imported, or not callable."""
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        shadowed = _shadowed(module_name) if isinstance(error, AttributeError) else None
        if shadowed is not None:  # json.py beside the config: Python's own json was imported long before
            raise UserError(Problem(key, f"cannot import {path!r}: {shadowed[0]} has the name of a module of Python "
                                    f"or an installed package, which is imported instead ({shadowed[1]})",
                                    fix=f"rename your module (e.g. my_{module_name.split('.')[0]}.py) and the "
                                    "import path")) from None
        raise UserError(Problem(key, f"cannot import {path!r}: {error}",
                                fix="put the module beside the config file or in the working directory (or on "
                                "PYTHONPATH), and check the function's name")) from None
    except BaseException as error:  # the user's module itself fails, or exits, as it is imported
        if isinstance(error, PASSED_THROUGH):
            raise
        said = (f"importing {module_name!r} failed: {type(error).__name__}: {error}" if isinstance(error, Exception)
                else f"{module_name!r} {what_it_did(error)} while being imported")
        raise UserError(Problem(key, said,
                                fix=f"fix the module: importing it must only define functions (python -c "
                                f"'import {module_name}' shows what it does)")) from None
    if not callable(function):
        raise UserError(Problem(key, f"{path!r} is not callable", fix="name a function"))
    return function
