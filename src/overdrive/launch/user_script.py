"""A user's own Accelerate script, run with the configured strategy on every process.

`overdrive launch` writes the Accelerate YAML and DeepSpeed JSON for the run and turns them
into the environment a bare `Accelerator()` reads, with Accelerate's own launcher code.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Sequence

from overdrive.config.schema import RunConfig
from overdrive.launch.process import STRIPPED_PREFIXES, process_env
from overdrive.launch.workers import check, local_port, resolved_path, run_agent, torchrun_args
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
    # Batch sizes stay "auto": the script's own DataLoader decides them. Bucket sizes come
    # from the configured model, since the script's model may have no `config` to fill them.
    from overdrive.interop.deepspeed_config import hidden_size_of

    hidden = hidden_size_of(cfg) if ds_path else None
    export.write(cfg, acc_path, ds_path, batch_auto=True, hidden_size=hidden)

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(STRIPPED_PREFIXES)}
    try:  # Accelerate's functions start from os.environ: start them from a clean one
        args = launch_command_parser().parse_args(["--config_file", str(acc_path), "overdrive-user-script"])
        args, defaults, _ = _validate_launch_command(args)
        # Only ever started by us, on a port chosen by the config: skip their port probe.
        args.main_process_port = cfg.launch.main_process_port
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
    if cpu.construct_with_cpu_flag(cfg):
        env["ACCELERATE_USE_CPU"] = "true"
    env.update(process_env(cfg))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def launch_script(resolved: Any, script: str, script_args: Sequence[str]) -> int:
    """Run a user's Accelerate script on every configured process (any process count).

    Each worker enters `overdrive launch --worker`, which applies the CPU workarounds around
    the script's own `Accelerator()` (strategies/cpu.py) and then runs the script.
    """
    cfg: RunConfig = resolved.config
    check(cfg)
    cfg = local_port(cfg)
    files_dir = Path(cfg.output_dir) / "launch"
    env = user_script_env(cfg, files_dir)
    path = files_dir / resolved_path(cfg).name
    path.write_text(resolved.to_json())
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(cfg),
               "-m", "overdrive.cli", "launch", "--worker", str(path), script, *script_args]
    return run_agent(command, env)


def run_user_script(resolved_file: str, script: str, script_args: Sequence[str]) -> int:
    """Inside a worker: the script runs as `__main__`, with its own argv."""
    import runpy

    from overdrive.config import Resolved
    from overdrive.strategies import cpu

    cfg = Resolved.from_json(Path(resolved_file).read_text()).config
    cpu.apply_to_user_accelerators(cfg)
    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    # The script has finished: run its exit handlers, flush, and leave without interpreter
    # finalisation. Tearing down native thread pools there intermittently aborts a worker
    # that has already done all its work ("terminate called without an active exception",
    # SIGABRT), and the elastic agent then fails the whole job.
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
