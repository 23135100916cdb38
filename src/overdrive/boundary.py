"""The one error boundary of a command: a UserError is its message on stderr and exit code 2;
anything unforeseen is one line naming the command and the private file that holds its
traceback, exit code 1. Every message passes redaction on its way out."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional

from overdrive.errors import UserError


def debug_enabled() -> bool:
    """OVERDRIVE_DEBUG=1: show the traceback of an unexpected error on the terminal too."""
    from overdrive.config.env_report import debug_requested  # the environment is read in config/

    return debug_requested()


def _write_traceback(command: str, text: str) -> Path | None:
    """The full traceback, secrets masked, in a private file the user can attach to a report."""
    import os
    import tempfile
    import time

    from overdrive.config.redact import redact_text

    try:
        fd, name = tempfile.mkstemp(prefix=f"overdrive-crash-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".txt")
        with os.fdopen(fd, "w") as handle:  # mkstemp: readable by this user only
            handle.write(f"command: {redact_text(command)}\n\n{redact_text(text)}")
    except OSError:
        return None
    return Path(name)


def report_unexpected(error: BaseException, command: str) -> int:
    """One line for an error overdrive did not foresee: what, where the traceback went."""
    import traceback

    from overdrive.config.redact import redact_text

    text = "".join(traceback.format_exception(error))
    if debug_enabled():
        print(redact_text(text), file=sys.stderr, end="")
    saved = _write_traceback(command, text)
    where = f"the full traceback is in {saved}" if saved else "the traceback could not be saved"
    summary = redact_text(f"{type(error).__name__}: {error}".splitlines()[0][:300])
    print(f"overdrive: internal error in `{redact_text(command)}`: {summary}; {where} "
          f"(OVERDRIVE_DEBUG=1 prints it here). Please report it.", file=sys.stderr)
    return 1


def render_user_error(error: "UserError") -> str:
    from overdrive.config.redact import redact_text

    return redact_text(error.render())


# Library messages that name nothing the user can change: a kernel of a package overdrive does not
# use (bitsandbytes' CPU 4-bit kernel from the `kernels` hub package, said by every command that
# imports PEFT, even with no 4-bit layer), and deprecations of calls made inside the libraries.
QUIET_LOGS = {"bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community"}
QUIET_WARNINGS = (r"`is_gradient_checkpointing` is deprecated",)


def _starts_otherwise(prefix: str) -> Callable:
    return lambda record: not str(record.msg).startswith(prefix)


def quiet_library_noise() -> None:
    """Filters for QUIET_LOGS and QUIET_WARNINGS, in this process (a command, or a worker: each
    enters through the boundary). Installed before the libraries load: a logger exists by name."""
    import logging
    import warnings

    for name, prefix in QUIET_LOGS.items():
        logger = logging.getLogger(name)
        if not any(getattr(f, "overdrive_quiet", False) for f in logger.filters):
            quiet = _starts_otherwise(prefix)
            quiet.overdrive_quiet = True  # type: ignore[attr-defined]
            logger.addFilter(quiet)
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


def run_reporting_errors(function: Callable, *args, command: str = "overdrive",
                         translate: Optional[Callable[[BaseException], Optional["UserError"]]] = None) -> int:
    """Run a command. UserError: its message on stderr and exit code 2. Anything unforeseen:
    one line naming the command and the file holding the traceback, exit code 1. A
    traceback on the terminal only with OVERDRIVE_DEBUG=1. `translate` turns an unforeseen
    error the user can fix (a full disk) into a UserError."""
    quiet_library_noise()
    try:
        return int(function(*args) or 0)
    except UserError as error:
        print(render_user_error(error), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("overdrive: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `overdrive estimate --json | head`: the reader left. Python's documented remedy:
        # point stdout at devnull so the interpreter's final flush does not fail again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except SystemExit:
        raise
    except Exception as error:  # the boundary: nothing unforeseen reaches the terminal as a traceback
        mapped = translate(error) if translate is not None else None
        if mapped is not None:
            print(render_user_error(mapped), file=sys.stderr)
            return 2
        return report_unexpected(error, command)
