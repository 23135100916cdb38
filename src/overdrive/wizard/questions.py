"""`overdrive config`: a few questions, answered with defaults read off the hardware, turned
into a commented run config (and, on request, Accelerate's own default_config.yaml; the
files themselves are written by wizard_files.py).

Every answer is checked as it is typed and asked again with the reason when it is wrong.
Answers given as flags are not asked; `--non-interactive` takes the default for the rest.
The same parsers check typed answers and flags, so both fail with the same message.
"""

from __future__ import annotations

from overdrive.console import counted

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from overdrive.errors import Problem, UserError
from overdrive.strategies import registry

OFFLOAD = ("none", "cpu", "nvme")


# ---------------------------------------------------------------- parsers: text -> value
# Each raises ValueError with a message that says what would be accepted.


def choice(options: tuple[str, ...]) -> Callable[[str], str]:
    """An option by name, unique prefix, or 1-based number in the list shown."""

    def parse(text: str) -> str:
        text = text.strip().lower()
        numbered = not any(o.isdigit() for o in options)  # "4" must not mean stage 3
        if numbered and text.isdigit() and 1 <= int(text) <= len(options):
            return options[int(text) - 1]
        if text in options:
            return text
        matches = [o for o in options if o.startswith(text)] if text else []
        if len(matches) == 1:
            return matches[0]
        raise ValueError(f"{text!r} is not one of: {', '.join(options)}")

    return parse


def integer(low: int = 0, high: Optional[int] = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"{text.strip()!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise ValueError(f"{value} is out of range: enter a number {bound}")
        return value

    return parse


def yes_no(text: str) -> bool:
    text = text.strip().lower()
    if text in ("y", "yes", "true", "1", "on"):
        return True
    if text in ("n", "no", "false", "0", "off"):
        return False
    raise ValueError(f"{text!r}: answer yes or no")


def text_value(required: bool = False) -> Callable[[str], str]:
    def parse(text: str) -> str:
        text = text.strip()
        if required and not text:
            raise ValueError("an answer is required here")
        return text

    return parse


# ---------------------------------------------------------------- asking


@dataclass
class Asker:
    """Gets one answer: from a flag, from the default (non-interactive), or from the user."""

    preset: dict[str, Any] = field(default_factory=dict)
    interactive: bool = True
    read: Callable[[str], str] = input
    say: Callable[[str], None] = print
    asked: set[str] = field(default_factory=set)
    """Names of the questions that came up: a flag for any other was not used."""

    def __call__(self, name: str, question: str, parse: Callable[[str], Any], default: Any, hint: str = "") -> Any:
        self.asked.add(name)
        flag = f"--{name.replace('_', '-')}"
        if self.preset.get(name) is not None:
            try:
                return parse(str(self.preset[name]))
            except ValueError as error:
                raise UserError(Problem(flag, str(error))) from None
        if not self.interactive:
            if default is None:  # no default: the answer is required, or empty is fine
                try:
                    return parse("")
                except ValueError:
                    raise UserError(Problem(flag, f"required with these answers ({question.rstrip('?')})")) from None
            return default
        shown = _show(default)
        prompt = f"{question}" + (f" ({hint})" if hint else "") + (f" [{shown}]" if shown != "" else "") + ": "
        while True:
            try:
                answer = self.read(prompt)
            except EOFError:
                raise UserError(
                    f"no answer to {question!r}: standard input closed; "
                    "use --non-interactive and flags for scripted use"
                ) from None
            try:
                if not answer.strip() and default is not None:
                    return default
                return parse(answer)
            except ValueError as error:
                self.say(f"  ! {error}. Please try again.")

    def unused_flags(self) -> list[str]:
        return sorted(f"--{n.replace('_', '-')}" for n in self.preset if n not in self.asked)


def _show(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


# ---------------------------------------------------------------- the questions


@dataclass
class Answers:
    where: str = "this-machine"
    machine_type: str = "cpu"
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: Optional[str] = None
    main_process_port: int = 29500
    num_processes: int = 1
    model: Optional[str] = None
    mixed_precision: str = "no"
    strategy: str = "ddp"
    zero_stage: int = 2
    offload_optimizer: str = "none"
    offload_param: str = "none"
    nvme_path: Optional[str] = None
    reshard_after_forward: bool = True
    fsdp_offload_params: bool = False
    tp_size: int = 1
    dp_replicate_size: int = 1
    compile_backend: Optional[str] = None
    accum: int = 1
    peft: str = "none"
    lora_r: int = 16
    notes: list[str] = field(default_factory=list)


def dynamo_backends() -> tuple[str, ...]:
    """The backends Accelerate's dynamo plugin accepts (its DynamoBackend enum), lower-cased."""
    try:
        from accelerate.utils import DynamoBackend

        return tuple(b.value.lower() for b in DynamoBackend if b.value != "NO")
    except Exception:  # accelerate without the enum: the two that exist everywhere
        return ("inductor", "aot_eager", "eager")


def default_precision(hw: dict[str, Any], machine_type: str) -> str:
    gpus = hw.get("gpus") or []
    if machine_type == "gpu":
        if gpus and not all(g["bf16"] for g in gpus):
            return "fp16"  # pre-Ampere GPUs: bf16 is emulated and slow
        return "bf16"
    return "bf16" if hw.get("cpu_bf16_native") else "no"


def ask_all(ask: Asker, hw: dict[str, Any], suggest: Callable[..., Optional[dict]] | None = None) -> Answers:
    """The wizard's questions in order; later defaults depend on earlier answers."""
    a = Answers()
    gpus = hw.get("gpus") or []
    a.where = ask("where", "Where will this run?", choice(("this-machine", "multi-machine")), "this-machine",
                  "this-machine / multi-machine")
    a.machine_type = ask("machine_type", "Which kind of machine?", choice(("cpu", "gpu")),
                         "gpu" if gpus else "cpu", "cpu / gpu")
    if a.machine_type == "gpu" and not gpus:
        a.notes.append("no GPU is visible here: this config is meant for another machine")
        ask.say(f"note: {a.notes[-1]}")
    if a.where == "multi-machine":
        a.num_machines = ask("num_machines", "How many machines?", integer(2), 2)
        a.machine_rank = ask("machine_rank", "Rank of this machine?", integer(0, a.num_machines - 1), 0,
                             f"0 .. {a.num_machines - 1}; 0 is the main one")
        a.main_process_ip = ask("main_process_ip", "IP address or hostname of machine 0?", text_value(True), None)
        a.main_process_port = ask("main_process_port", "Port on machine 0?", integer(1, 65535), 29500)
    per_machine = max(1, len(gpus)) if a.machine_type == "gpu" else 1
    a.num_processes = ask("num_processes", "How many processes in total (all machines)?",
                          _processes(a.num_machines), per_machine * a.num_machines,
                          "one per GPU" if a.machine_type == "gpu" else "each process takes a share of the cores")
    if a.machine_type == "gpu" and gpus and a.num_processes // a.num_machines > len(gpus):
        a.notes.append(f"{a.num_processes // a.num_machines} processes per machine, but {counted(len(gpus), 'GPU')} here")
        ask.say(f"note: {a.notes[-1]}")
    a.model = ask("model", "Model to train (hub name or local path)?", text_value(), "",
                  "blank: the embedded tiny GPT-2 from scratch") or None
    a.mixed_precision = ask("mixed_precision", "Mixed precision?", _precision(a.machine_type),
                            default_precision(hw, a.machine_type), "no / fp16 / bf16 / fp8")
    if a.model:  # an adapter fine-tunes pretrained weights: asked only when there are some
        a.peft = ask("peft", "Fine-tune an adapter instead of every weight?", choice(("none", "lora", "qlora")),
                     "none", "none / lora / qlora (4-bit base)")
        if a.peft != "none":
            a.lora_r = ask("lora_r", "LoRA rank?", integer(1), 16, "r: the adapter's inner width")
    before = len(a.notes)
    tip = suggest(a, hw, ask.say) if (suggest and a.model) else None
    if tip:
        a.notes.append(f"memory estimate: {tip['why']}")
    for note in a.notes[before:]:  # said now: it is the reason for the next default
        ask.say(f"note: {note}")
    a.strategy = ask("strategy", "Parallelism strategy?", choice(registry.NAMES),
                     (tip or {}).get("strategy", "ddp"), "ddp / deepspeed (ZeRO) / fsdp (FSDP2)")
    follow_up = _STRATEGY_QUESTIONS.get(a.strategy)
    if follow_up:
        follow_up(a, ask, tip or {})
    use_compile = ask("use_compile", "Use torch.compile?", yes_no, False, "yes / no")
    if use_compile:
        a.compile_backend = ask("compile", "torch.compile backend?", choice(dynamo_backends()), "inductor")
    a.accum = ask("accum", "Gradient accumulation steps?", integer(1), 1, "micro-batches per optimizer step")
    return a


def _ask_deepspeed(a: Answers, ask: Callable[..., Any], tip: dict[str, Any]) -> None:
    a.zero_stage = int(ask("zero_stage", "DeepSpeed ZeRO stage?", choice(("0", "1", "2", "3")),
                           str(tip.get("zero_stage", 2)),
                           "1: optimizer states, 2: + gradients, 3: + parameters"))
    if a.zero_stage >= 1:
        a.offload_optimizer = ask("offload_optimizer", "Offload optimizer states?", choice(OFFLOAD),
                                  tip.get("offload_optimizer", "none"), "none / cpu / nvme")
    if a.zero_stage == 3:
        a.offload_param = ask("offload_param", "Offload parameters?", choice(OFFLOAD),
                              tip.get("offload_param", "none"), "none / cpu / nvme")
    if "nvme" in (a.offload_optimizer, a.offload_param):
        a.nvme_path = ask("nvme_path", "Directory on a local NVMe disk for offload?", text_value(True), None)


def _ask_fsdp(a: Answers, ask: Callable[..., Any], tip: dict[str, Any]) -> None:
    a.reshard_after_forward = ask("reshard_after_forward", "Free gathered parameters after forward?",
                                  yes_no, True, "yes: ZeRO-3-like, no: ZeRO-2-like, more memory")
    a.fsdp_offload_params = ask("fsdp_offload_params", "Offload parameters to the CPU?", yes_no,
                                tip.get("fsdp_offload_params", False))
    if a.num_processes > 1:  # the N-D layout (docs/parallelism.md); each must divide the processes
        a.tp_size = ask("tp_size", "Tensor parallel degree?", _divisor(a.num_processes), 1,
                        "1: none; splits each layer over this many processes of a machine (Llama-like models)")
        a.dp_replicate_size = ask("dp_replicate_size", "HSDP replicas?", _divisor(a.num_processes // a.tp_size), 1,
                                  "1: shard over every process; the number of machines keeps sharding within one")


# The questions a strategy's own settings section asks (`parallel.<name>`), after the strategy.
_STRATEGY_QUESTIONS = {registry.DEEPSPEED.name: _ask_deepspeed, registry.FSDP.name: _ask_fsdp}


def _divisor(total: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = integer(1, total)(text)
        if total % value:
            raise ValueError(f"{value} does not divide {total} processes")
        return value

    return parse


def _processes(num_machines: int) -> Callable[[str], int]:
    base = integer(1)

    def parse(text: str) -> int:
        value = base(text)
        if value % num_machines:
            raise ValueError(f"{value} processes do not split evenly over {num_machines} machines")
        return value

    return parse


def _precision(machine_type: str) -> Callable[[str], str]:
    base = choice(("no", "fp16", "bf16", "fp8"))

    def parse(text: str) -> str:
        value = base(text)
        if machine_type == "cpu" and value in ("fp16", "fp8"):
            raise ValueError(f"{value} needs a GPU: on a CPU use bf16 or no")
        return value

    return parse


# The estimator's strategy names -> the answers they stand for.
_ESTIMATOR_STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp"},
    "zero1": {"strategy": "deepspeed", "zero_stage": 1},
    "zero2": {"strategy": "deepspeed", "zero_stage": 2},
    "zero3": {"strategy": "deepspeed", "zero_stage": 3},
    "zero2_offload": {"strategy": "deepspeed", "zero_stage": 2, "offload_optimizer": "cpu"},
    "zero3_offload_optimizer": {"strategy": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu"},
    "zero3_offload": {"strategy": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    "fsdp2": {"strategy": "fsdp"},
    "fsdp2_offload": {"strategy": "fsdp", "fsdp_offload_params": True},
}


def _adapter(a: Answers, source) -> Optional[Any]:
    """What an adapter run trains, for the estimate (None for full training)."""
    if a.peft == "none":
        return None
    from overdrive.config.schema_peft import PeftConfig
    from overdrive.memory.adapter import adapter_shape
    from overdrive.memory.model_shape import build_meta_model

    model = build_meta_model(source.config, source.task, source.attn_implementation)
    return adapter_shape(model, PeftConfig(method=a.peft, r=a.lora_r), base_bytes=4)


def memory_suggestion(a: Answers, hw: dict[str, Any], say: Callable[[str], None] = print) -> Optional[dict]:
    """The cheapest strategy that fits, from the memory estimator (`overdrive.memory`).

    Skipped, with a note, when the estimator is not installed, the model's config cannot be
    read (a hub name without network), or the GPUs are on another machine.
    """
    try:
        from overdrive.memory import Setup, estimate
        from overdrive.memory.model_shape import model_shape, resolve_source
        from overdrive.memory.report import Capacity, apply_verdict
    except ImportError:
        return None
    from overdrive.config.schema import RunConfig

    gpus, ram = hw.get("gpus") or [], int(hw.get("ram_bytes") or 0)
    if a.machine_type == "gpu" and not gpus:
        return None  # no device memory to compare with
    if a.machine_type == "gpu":
        device = min(g["memory_bytes"] for g in gpus)
        capacity = Capacity(device, ram, "gpu", f"{device / 2**30:.0f} GiB per GPU")
    else:
        capacity = Capacity(ram, ram, "host", f"{ram / 2**30:.0f} GiB of RAM shared by the processes")
    # The batch the written file will train with: the schema's defaults, as the wizard sets neither.
    defaults = RunConfig()
    precision = a.mixed_precision if a.mixed_precision in ("no", "fp16", "bf16") else "bf16"
    if not Path(a.model).expanduser().exists():
        # A hub name: its config.json comes over the network, which may be slow or absent.
        say(f"reading {a.model}'s config for a memory estimate (Ctrl-C skips it) ...")
    try:
        source = resolve_source(a.model)
        setup = Setup(devices=a.num_processes, precision=precision, micro_batch=defaults.training.micro_batch_size,
                      seq_len=defaults.data.max_length, target="cuda" if a.machine_type == "gpu" else "cpu",
                      adapter=_adapter(a, source))
        best = apply_verdict(estimate(model_shape(source), setup), capacity, nodes=a.num_machines)
    except KeyboardInterrupt:
        a.notes.append(f"memory estimate for {a.model} skipped")
        return None
    except Exception as error:  # an unreadable model must not end the wizard
        if isinstance(error, UserError):
            text = "; ".join(p.message for p in error.problems)
        else:
            text = f"{type(error).__name__}: {error}"
        a.notes.append(f"no memory estimate for {a.model}: {' '.join(text.split())}")
        return None
    if best is None:
        a.notes.append(f"memory estimate: no strategy fits {a.model} in {capacity.source}, even with offload")
        return None
    tip = dict(_ESTIMATOR_STRATEGIES.get(best.strategy, {}))
    if not tip:
        return None
    tip["why"] = (f"{best.label} is the cheapest strategy that fits {a.model}: {best.total_bytes / 2**30:.1f} GiB "
                  f"per process of {capacity.source} (micro-batch {setup.micro_batch} x {setup.seq_len} tokens; "
                  f"check with `overdrive estimate`)")
    return tip
