"""`overdrive config`: the interactive wizard that writes a commented run config.

    overdrive config                         # asks, writes overdrive.yaml
    overdrive config -o run.yaml --strategy deepspeed --zero-stage 3   # asks only the rest
    overdrive config --non-interactive --num-processes 2 --mixed-precision bf16 -o run.yaml
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", default="overdrive.yaml", help="run config to write (overdrive.yaml)")
    parser.add_argument("--force", action="store_true", help="overwrite existing files without asking")
    parser.add_argument(
        "--accelerate-default",
        action="store_true",
        help="also write Accelerate's default_config.yaml ($HF_HOME/accelerate/), read by every `accelerate launch`",
    )
    parser.add_argument("--non-interactive", action="store_true", help="ask nothing: flags, else defaults")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    answers = parser.add_argument_group("answers (each one given is not asked)")
    answers.add_argument("--where", help="this-machine | multi-machine")
    answers.add_argument("--machine-type", help="cpu | gpu")
    answers.add_argument("--num-machines", help="machines taking part (multi-machine)")
    answers.add_argument("--machine-rank", help="rank of this machine (multi-machine)")
    answers.add_argument("--main-process-ip", help="address of machine 0 (multi-machine)")
    answers.add_argument("--main-process-port", help="rendezvous port on machine 0")
    answers.add_argument("--num-processes", help="processes in total, across all machines")
    answers.add_argument("--model", help="hub name or local path of the model")
    answers.add_argument("--mixed-precision", help="no | fp16 | bf16 | fp8")
    answers.add_argument("--peft", help="none | lora | qlora (with --model)")
    answers.add_argument("--lora-r", help="LoRA rank (with --peft)")
    answers.add_argument("--strategy", help="ddp | deepspeed | fsdp")
    answers.add_argument("--zero-stage", help="DeepSpeed ZeRO stage 0-3")
    answers.add_argument("--tp-size", help="tensor parallel degree (FSDP; docs/parallelism.md)")
    answers.add_argument("--dp-replicate-size", help="HSDP replicas (FSDP)")
    answers.add_argument("--offload-optimizer", help="none | cpu | nvme (DeepSpeed)")
    answers.add_argument("--offload-param", help="none | cpu | nvme (DeepSpeed ZeRO-3)")
    answers.add_argument("--nvme-path", help="directory for nvme offload")
    answers.add_argument("--reshard-after-forward", help="yes | no (FSDP)")
    answers.add_argument("--fsdp-offload-params", help="yes | no (FSDP)")
    answers.add_argument("--compile", nargs="?", const="inductor", help="use torch.compile with this backend (inductor)")
    answers.add_argument("--no-compile", action="store_true", help="do not use torch.compile")
    answers.add_argument("--accum", help="gradient accumulation steps")


PRESET_NAMES = (
    "where", "machine_type", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
    "num_processes", "model", "mixed_precision", "peft", "lora_r", "strategy", "zero_stage", "offload_optimizer",
    "offload_param", "nvme_path", "reshard_after_forward", "fsdp_offload_params", "tp_size", "dp_replicate_size",
    "compile", "accum",
)


def _presets(args: argparse.Namespace) -> dict:
    preset = {name: getattr(args, name) for name in PRESET_NAMES if getattr(args, name) is not None}
    if args.compile is not None:
        preset["use_compile"] = "yes"
    elif args.no_compile:
        preset["use_compile"] = "no"
    if args.num_machines is not None and args.where is None:
        preset["where"] = "multi-machine" if args.num_machines.strip() not in ("1", "") else "this-machine"
    return preset


def run(args: argparse.Namespace) -> int:
    from rich.text import Text

    from overdrive.wizard import questions as wizard

    from overdrive.wizard import files as wizard_files
    from overdrive.config.env_report import accelerate_default_config_path
    from overdrive.console import get_console, is_interactive
    from overdrive.system.report import hardware
    from overdrive.storage.faults import keep_existing_files

    console = get_console(quiet=args.quiet)
    output = Path(args.output)
    acc_path = accelerate_default_config_path() if args.accelerate_default else None
    if args.non_interactive:
        # Fail before any work: a script must never clobber a file it did not mean to.
        keep_existing_files((output, acc_path), args.force)

    tty = is_interactive() and not args.quiet

    def read(prompt: str) -> str:
        if tty:
            return console.input(Text(prompt, style="bold cyan"))
        return input(prompt)

    def say(message: str) -> None:
        if args.quiet:
            return
        if tty:
            console.print(Text(message, style="yellow"))
        else:
            print(message)

    if not args.non_interactive:  # an existing file is said before any question, not after them all
        output = _confirm_path(output, args, read, say, "run config")
        if output is None:
            say("Nothing written.")
            return 1
    hw = hardware()
    if not args.non_interactive:
        detected = wizard_files.hardware_line(hw)
        console.print(Text(f"Detected: {detected}. Press Enter to take the [default].", style="dim"))
    ask = wizard.Asker(preset=_presets(args), interactive=not args.non_interactive, read=read, say=say)
    answers = wizard.ask_all(ask, hw, suggest=wizard.memory_suggestion)
    unused = [flag for flag in ask.unused_flags() if flag not in ("--use-compile", "--where")]
    if unused:
        say(f"note: {', '.join(unused)} not used with these answers (strategy {answers.strategy})")

    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(wizard_files.render_yaml(answers, hw, str(output)))
    told = get_console(stderr=True, quiet=args.quiet)  # messages on stderr, as every command's
    told.print(f"wrote {output}")
    if acc_path is not None:
        target = _confirm_path(acc_path, args, read, say, "Accelerate default config", allow_other=False)
        if target is not None:
            wizard_files.write_accelerate_default(answers, target)
            told.print(f"wrote {target} (read by every `accelerate launch` on this machine)")
    told.print(f"next: overdrive explain {output}   then: overdrive train {output}")
    return 0


def _confirm_path(path: Path, args, read, say, what: str, allow_other: bool = True):
    """`path` if it may be written, another path the user typed, or None to write nothing."""
    from overdrive.wizard import questions as wizard
    while path.exists() and not args.force:
        ask = wizard.Asker(read=read, say=say)
        if ask("overwrite", f"{path} exists. Overwrite this {what}?", wizard.yes_no, False):
            return path
        if not allow_other:
            return None
        other = ask("other_path", "Write to which path instead?", wizard.text_value(), "", "blank: write nothing")
        if not other:
            return None
        path = Path(other)
    return path
