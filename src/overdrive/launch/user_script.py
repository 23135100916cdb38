"""A user's own script (plain Accelerate, Transformers Trainer, TRL), run with the configured
strategy, precision and accumulation on every process.

`overdrive launch` writes the Accelerate YAML and DeepSpeed JSON for the run and turns them
into the environment a bare `Accelerator()` reads, with Accelerate's own launcher code. In
each worker the config also reaches the script's own TrainingArguments and Accelerator calls
(launch/script_values.py), and the CPU workarounds are applied (strategies/cpu.py), both only
while the script runs. A worker that fails writes its error to torch's elastic error file
instead of printing it; the launcher prints it once (launch/elastic.py).
"""

from __future__ import annotations

import os
import warnings
import sys
from pathlib import Path
from typing import Any, Sequence

from overdrive.config.schema import RunConfig
from overdrive.launch.process import secrets_env, STRIPPED_PREFIXES, process_env
from overdrive.launch.workers import (agent_command, check, own_port, port_chosen, refuse_busy_port, resolved_path,
                                     run_agent, worker_command)
from overdrive.strategies import registry


def user_script_env(cfg: RunConfig, files_dir: Path) -> dict[str, str]:
    """The environment a bare `Accelerator()` in a user's script configures itself from.

    Built by Accelerate's own launcher code (`_validate_launch_command` and the
    `prepare_*_env` functions) from the Accelerate YAML and DeepSpeed JSON that
    `overdrive export` writes into `files_dir`, so the variable names and values are exactly
    those `accelerate launch` would set. Added on top: what `accelerate launch` leaves out
    but Accelerate reads (the accumulation for non-DeepSpeed runs), and the CPU facts.
    """
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (prepare_deepspeed_cmd_env, prepare_multi_gpu_env,
                                         prepare_simple_launcher_cmd_env)

    from overdrive.interop import writing as export
    from overdrive.strategies import cpu

    files_dir = files_dir.resolve()
    files_dir.mkdir(parents=True, exist_ok=True)
    acc_path = files_dir / "accelerate.yaml"
    native_file = registry.of(cfg).native_file  # DeepSpeed's JSON, beside the Accelerate YAML
    ds_path = files_dir / native_file if native_file else None
    # What a Trainer owns stays "auto" (batch sizes, accumulation, clipping, precision): the
    # Trainer fills it from its TrainingArguments, which hold the configured values (see
    # script_values.py); for a bare Accelerator(), Accelerate fills it from the variables set
    # below and from the script's DataLoader. Bucket sizes come from the configured model,
    # since the script's model may have no `config` to fill them.
    from overdrive.strategies.deepspeed_config import hidden_size_of

    hidden = hidden_size_of(cfg) if ds_path else None
    export.write(cfg, acc_path, ds_path, batch_auto=True, hidden_size=hidden, trainer_owned_auto=True)

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(STRIPPED_PREFIXES)}
    try:  # Accelerate's functions start from os.environ: start them from a clean one
        args = launch_command_parser().parse_args(["--config_file", str(acc_path), "overdrive-user-script"])
        args, defaults, _ = _validate_launch_command(args)
        # Only ever started by us, on a port chosen by the config: skip their port probe.
        args.main_process_port = cfg.launch.main_process_port
        with warnings.catch_warnings():  # the launcher's rendezvous takes its own port (workers.own_port)
            warnings.filterwarnings("ignore", message=r"Port `\d+` is already in use")
            if args.use_deepspeed:
                args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config) if defaults else ""
                _, env = prepare_deepspeed_cmd_env(args)
            elif args.use_fsdp or args.multi_gpu:
                env = prepare_multi_gpu_env(args)
            else:
                _, env = prepare_simple_launcher_cmd_env(args)
    finally:
        os.environ.update(saved)
    env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(cfg.training.gradient_accumulation_steps)
    # Read by Accelerate's DeepSpeed plugin to fill the "auto" entries of the JSON above (the
    # precision is left out of the YAML when a DeepSpeed file holds the DeepSpeed settings).
    env["ACCELERATE_GRADIENT_CLIPPING"] = str(cfg.training.gradient_clipping or 0.0)
    env["ACCELERATE_MIXED_PRECISION"] = cfg.precision.mixed_precision
    if cpu.construct_with_cpu_flag(cfg):
        env["ACCELERATE_USE_CPU"] = "true"
    env.update(process_env(cfg))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def launch_script(resolved: Any, script: str, script_args: Sequence[str]) -> int:
    """Run a user's script on every configured process (any process count).

    Each worker enters `overdrive launch --worker` (run_user_script below). The agent is
    overdrive.launch.elastic: torch.distributed.run ending with the first failure, once.
    """
    cfg: RunConfig = resolved.config
    check(cfg)
    if cfg.parallel.ep_size > 1:  # the experts are split by overdrive's own loop (strategies/expert_parallel.py)
        from overdrive.errors import Problem, UserError

        raise UserError(Problem("parallel.ep_size", "splits a mixture of experts' experts in `overdrive train`'s own "
                                "loop; a user's script gets a plain data-parallel config",
                                fix="set parallel.ep_size=1 here, and pass DistributedConfig(ep_size=...) to the "
                                    "script's from_pretrained; or train with `overdrive train`"), title="cannot launch")
    chosen = port_chosen(resolved)
    refuse_busy_port(cfg, chosen)
    files_dir = Path(cfg.output_dir) / "launch"
    env = user_script_env(cfg, files_dir)
    env.update(secrets_env(cfg))  # the resolved file below holds them masked
    path = files_dir / resolved_path(cfg).name
    path.write_text(resolved.to_json())
    return run_agent(agent_command(cfg, worker_command("launch", path, script, *script_args), own=own_port(cfg, chosen)),
                     env)


def run_user_script(resolved_file: str, script: str, script_args: Sequence[str]) -> int:
    """Inside a worker: the script runs as `__main__`, with its own argv.

    The config reaches its TrainingArguments / Accelerator calls and the CPU workarounds
    apply only inside the `with` block. An exception is written to the error file torch's
    agent gives every worker (TORCHELASTIC_ERROR_FILE) rather than printed by each rank:
    the launcher prints the first failure once.
    """
    import runpy

    from overdrive.resolving import Resolved
    from overdrive.errors import UserError
    from overdrive.launch import lifetime, script_values
    from overdrive.strategies import cpu

    resolved = Resolved.from_json(Path(resolved_file).read_text())
    cfg = resolved.config
    # SIGTERM when the agent is gone, then SIGKILL launch.stop_timeout seconds later.
    lifetime.follow_agent(cfg.launch.stop_timeout)
    sys.argv = [script, *script_args]
    from overdrive.launch.process import quiet_deprecated_collectives

    quiet_deprecated_collectives()
    sys.path.insert(0, str(Path(script).resolve().parent))
    code = 0
    try:
        # Order matters: the CPU workaround wraps the config's Accelerator.__init__, which
        # binds the call's arguments against Accelerate's own signature.
        with script_values.applied(cfg, resolved.origins, script), cpu.apply_to_user_accelerators(cfg):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except UserError as error:
        code = 2
        _report(error.render(), "")
    except Exception as error:  # noqa: BLE001 - whatever the script raised, reported once
        import traceback

        code = 1
        tb = error.__traceback__  # from the script's own frames: ours and runpy's say nothing
        while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                                  or tb.tb_frame.f_code.co_filename.startswith("<frozen")):
            tb = tb.tb_next
        _report(f"{type(error).__name__}: {error}", "".join(traceback.format_exception(type(error), error, tb)))
    # The script has finished: run its exit handlers, flush, and leave without interpreter
    # finalisation. Tearing down native thread pools there intermittently aborts a worker
    # that has already done all its work ("terminate called without an active exception",
    # SIGABRT), and the elastic agent then fails the whole job.
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report(message: str, callstack: str) -> None:
    """Into torch's elastic error file (the format its ProcessFailure reads), or to stderr
    when this worker runs without an agent."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        print(callstack or message, file=sys.stderr, flush=True)
        return
    with open(path, "w") as f:
        json.dump({"message": {"message": message, "extraInfo": {"py_callstack": callstack,
                                                                  "timestamp": str(int(time.time()))}}}, f)
