"""Cross-field rules, world-size rules and hardware checks. Every problem at once.

Each rule returns Problems naming the key, where its value was set, and the fix. Hardware
that lacks what is asked for is a warning when explaining (a cluster config can be explained
on a laptop) and an error when training.
"""

from __future__ import annotations

from overdrive.console import counted

from typing import Mapping

from overdrive.config import batch
from overdrive.config.keys import coerce
from overdrive.config.provenance import Setting, set_by_user, where
from overdrive.config.redact import shown
from overdrive.config.schema import RunConfig
from overdrive.config.sweep_space import sweep_rules
from overdrive.errors import Problem
from overdrive.resolving import composition, recipe_rules, validate_gpu
from overdrive.strategies import registry

Chains = Mapping[str, list[Setting]]


def _where(chains: Chains | None, key: str) -> str:
    return where(chains, key, unset="default")


def deepspeed_contradictions(chains: Chains) -> list[Problem]:
    """An explicit value in a DeepSpeed JSON that the run config overrides: DeepSpeed would
    use its own, so overdrive refuses rather than silently keeping either."""
    problems = []
    for key, chain in chains.items():
        winner = chain[-1]
        for setting in chain[:-1]:
            if setting.native == "deepspeed" and coerce(key, setting.value) != coerce(key, winner.value):
                problems.append(Problem(
                    key, f"is {shown(key, winner.value)!r} here but {setting.origin.source}:{setting.origin.line} sets {shown(key, setting.value)!r} explicitly",
                    str(winner.origin), f'make them agree, or write "auto" in {setting.origin.source} so it is filled from the run config'))
                break
    return problems


def strategy_rules(cfg: RunConfig, chains: Chains) -> tuple[list[Problem], list[Problem]]:
    strategy = registry.of(cfg)
    errors, warnings = strategy.setting_problems(cfg, lambda key: _where(chains, key))
    # Settings for a strategy that is not the one chosen: often a stale default config.
    for other in registry.STRATEGIES.values():
        if other is strategy or not other.section:
            continue
        name = other.name
        stray = sorted(k for k in chains if other.owns(k) and set_by_user(chains, k)
                       and not k.startswith("parallel.deepspeed.extra"))
        if stray:
            warnings.append(Problem(stray[0], f"has no effect: parallel.strategy is {cfg.parallel.strategy} "
                                    f"({len(stray)} {name} key(s) set, e.g. here)", _where(chains, stray[0]),
                                    f"set parallel.strategy={name} if you meant it, else remove them"))
    return errors, warnings


def launch_rules(cfg: RunConfig, chains: Chains | None = None) -> list[Problem]:
    """World size and rendezvous rules. Without `chains` (a config already resolved, checked
    again by the launcher) the problems name the key but not where its value came from."""
    launch, problems = cfg.launch, []
    if launch.num_processes % launch.num_machines:
        problems.append(Problem("launch.num_processes", f"{launch.num_processes} processes do not divide evenly over {launch.num_machines} machines",
                                _where(chains, "launch.num_processes"), "num_processes is the total over all machines: make it a multiple of launch.num_machines"))
    if launch.machine_rank >= launch.num_machines:
        problems.append(Problem("launch.machine_rank", f"is {launch.machine_rank}, but there are {counted(launch.num_machines, 'machine')}: ranks go 0..{launch.num_machines - 1}",
                                _where(chains, "launch.machine_rank"), "set launch.machine_rank to this machine's index"))
    if launch.num_machines > 1 and not launch.main_process_ip:
        problems.append(Problem("launch.main_process_ip", "is required with several machines",
                                _where(chains, "launch.num_machines"), "set launch.main_process_ip to the address of machine 0"))
    return problems + elastic_rules(cfg, chains)


def elastic_rules(cfg: RunConfig, chains: Chains | None = None) -> list[Problem]:
    """launch.min_machines: at most launch.num_machines, and every machine count from min to
    max must keep the global batch with a whole accumulation (a shrink resumes with it)."""
    launch = cfg.launch
    if launch.min_machines is None or launch.min_machines == launch.num_machines:
        return []
    where = _where(chains, "launch.min_machines")
    if launch.min_machines > launch.num_machines:
        return [Problem("launch.min_machines", f"is {launch.min_machines}, above launch.num_machines "
                        f"({launch.num_machines})", where, "the fewest machines the job may go on with: at most "
                        "launch.num_machines")]
    if launch.num_processes % launch.num_machines:
        return []  # reported above
    # The batch split (config/batch.py) says what each machine count would need; data-parallel
    # processes scale with the machines.
    split = batch.split(cfg)
    if split.global_batch is None:
        return []  # micro-batch auto without a global batch: refused where the split is settled
    per_machine = batch.data_parallel_degree(cfg) // launch.num_machines

    def keeps(machines: int) -> bool:
        dp = machines * per_machine
        if split.micro is None:  # auto: the micro-batch is found on the device, per process
            return split.global_batch % dp == 0
        return batch.keeping(split.global_batch, split.micro, dp) is not None
    counts = range(launch.min_machines, launch.num_machines + 1)
    if all(keeps(m) for m in counts):
        return []
    good = [m for m in counts if keeps(m)]
    return [Problem("launch.min_machines", f"{launch.min_machines}..{launch.num_machines} machines: "
                    f"{', '.join(str(m) for m in counts if not keeps(m))} cannot keep the global batch of "
                    f"{split.global_batch} (micro-batch {split.micro or 'auto'} x {counted(per_machine, 'process')} per machine "
                    "x a whole accumulation)", where,
                    f"machine counts that keep it: {', '.join(map(str, good)) or 'none'}; raise launch.min_machines "
                    "or choose a global batch they all divide")]


def training_rules(cfg: RunConfig, chains: Chains) -> list[Problem]:
    warnings = []
    if cfg.scheduler.warmup_steps >= cfg.training.max_steps:
        warnings.append(Problem("scheduler.warmup_steps", f"{cfg.scheduler.warmup_steps} warmup steps >= {cfg.training.max_steps} max_steps: the lr never reaches its peak",
                                _where(chains, "scheduler.warmup_steps"), "lower scheduler.warmup_steps"))
    if cfg.model.from_scratch and not cfg.model.name_or_path:
        warnings.append(Problem("model.from_scratch", "has no effect without model.name_or_path (an inline architecture always starts from scratch)",
                                _where(chains, "model.from_scratch")))
    return warnings


def deepspeed_dict_problems(cfg: RunConfig) -> list[Problem]:
    """The DeepSpeed dict overdrive would hand over, checked before launch: verbatim entries
    in parallel.deepspeed.extra that contradict the run config, or "auto" with nothing to fill."""
    if not registry.of(cfg).deepspeed_config or cfg.training.micro_batch_size == "auto":
        # `auto` is resolved to integers before the plugin is built, and the dict checked then.
        return []
    from overdrive.strategies.deepspeed_config import ds_config  # pure dict work: no torch, no deepspeed

    found: list[Problem] = []
    ds_config(cfg, batch.data_parallel_degree(cfg), problems=found, find_hidden_size=False)
    return found


def layout_rules(cfg: RunConfig, chains: Chains) -> list[Problem]:
    """The N-D layout's rules (strategies/layout.py), each pointing at where its key was set."""
    from dataclasses import replace

    from overdrive.strategies import layout

    return [replace(p, where=p.where or _where(chains, p.key)) for p in layout.problems(cfg)]


def check(cfg: RunConfig, chains: Chains) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings) for a validated config."""
    errors = (batch.problems(cfg, chains) + deepspeed_contradictions(chains) + deepspeed_dict_problems(cfg)
              + layout_rules(cfg, chains))
    strategy_errors, warnings = strategy_rules(cfg, chains)
    sweep_errors, sweep_warnings = sweep_rules(cfg, chains)
    errors += strategy_errors + launch_rules(cfg, chains) + sweep_errors
    errors += recipe_rules.check(cfg, lambda key: _where(chains, key))
    from overdrive.resolving.validate_inputs import input_rules

    errors += validate_gpu.check(cfg, lambda key: _where(chains, key)) + input_rules(cfg, lambda key: _where(chains, key))
    errors += composition.problems(cfg, lambda key: _where(chains, key)) + cpu_rules(cfg, chains)
    from overdrive.resolving.validate_loss import loss_rules

    errors += loss_rules(cfg, lambda key: _where(chains, key))
    warnings += training_rules(cfg, chains) + sweep_warnings + validate_gpu.warnings(cfg, lambda key: _where(chains, key))
    peft_errors, peft_warnings = _peft_rules(cfg, chains)
    preference_errors, preference_warnings = _preference_rules(cfg, chains)
    rl_errors, rl_warnings = _rl_rules(cfg, chains)
    from overdrive.resolving.validate_distill import distill_rules

    distill_errors, distill_warnings = distill_rules(cfg, lambda key: _where(chains, key),
                                                     lambda key: set_by_user(chains, key))
    from overdrive.resolving.validate_resilience import resilience_rules

    resilience_errors, resilience_warnings = resilience_rules(cfg, lambda key: _where(chains, key))
    return (errors + peft_errors + preference_errors + rl_errors + distill_errors + resilience_errors,
            warnings + peft_warnings + preference_warnings + rl_warnings + distill_warnings + resilience_warnings)


def _rl_rules(cfg: RunConfig, chains: Chains) -> tuple[list[Problem], list[Problem]]:
    from overdrive.resolving.validate_rl import rl_rules

    return rl_rules(cfg, lambda key: _where(chains, key), lambda key: set_by_user(chains, key))


def cpu_rules(cfg: RunConfig, chains: Chains) -> list[Problem]:
    """What cannot run on CPU processes (strategies/cpu.py), by key, when the config itself says
    it trains on CPU (`launch.use_cpu`): `explain` refuses what `train` would. Without it, the
    same rules are this machine's (hardware_problems): a warning when explaining a GPU config on
    a laptop, an error before training on it."""
    from overdrive.strategies import cpu

    if not cfg.launch.use_cpu:
        return []
    return [Problem(p.key, p.message, p.where or _where(chains, p.key), p.fix) for p in cpu.problems(cfg)]


def _preference_rules(cfg: RunConfig, chains: Chains) -> tuple[list[Problem], list[Problem]]:
    from overdrive.resolving.validate_preference import preference_rules

    return preference_rules(cfg, lambda key: _where(chains, key), lambda key: set_by_user(chains, key))


def _peft_rules(cfg: RunConfig, chains: Chains) -> tuple[list[Problem], list[Problem]]:
    from overdrive.resolving.validate_peft import peft_rules
    from overdrive.strategies.cpu import on_cpu

    from overdrive.resolving.validate_adapter import adapter_rules

    explicit = {key: set_by_user(chains, key) for key in chains if key.startswith(("peft.", "data.", "tokenizer."))}
    errors, warnings = peft_rules(cfg, lambda key: _where(chains, key), explicit, lambda: on_cpu(cfg))  # torch: qlora only
    # A tool's own default carried by an import (no line of its file) is not the user's choice.
    chosen = {key: yes and not (chains[key][-1].native and chains[key][-1].origin.line is None)
              for key, yes in explicit.items()}
    more_errors, more_warnings = adapter_rules(cfg, lambda key: _where(chains, key), lambda key: chosen.get(key, False))
    return errors + more_errors, warnings + more_warnings


def listed_gpu_ids(text: str) -> list[int] | None:
    """`launch.gpu_ids` as indices ("0,1,3"), or None when it is not a comma list of them."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        return None
    return ids if ids and len(set(ids)) == len(ids) and min(ids) >= 0 else None


def nvme_problems(cfg: RunConfig, chains: Chains) -> list[Problem]:
    """DeepSpeed nvme offload writes swap files under nvme_path on every node: it must be a
    writable directory here (DeepSpeed only finds out at its first swap-out)."""
    import os

    ds = cfg.parallel.deepspeed
    if not registry.of(cfg).deepspeed_config or "nvme" not in (ds.offload_optimizer, ds.offload_param) or not ds.nvme_path:
        return []
    path = os.path.expanduser(ds.nvme_path)
    why = ("does not exist" if not os.path.exists(path) else "is not a directory" if not os.path.isdir(path)
           else "is not writable" if not os.access(path, os.W_OK | os.X_OK) else "")
    if not why:
        return []
    return [Problem("parallel.deepspeed.nvme_path", f"{ds.nvme_path} {why}", _where(chains, "parallel.deepspeed.nvme_path"),
                    "point it at a writable directory on a fast local disk (it must exist on every node)")]


def hardware_problems(cfg: RunConfig, chains: Chains, hardware) -> list[Problem]:
    """What this machine cannot do of what the config asks, saying what was detected."""
    problems, detected = [], hardware.describe()
    precision = cfg.precision.mixed_precision
    on_gpu = hardware.gpu_count > 0 and not cfg.launch.use_cpu
    if precision == "fp8" and not hardware.supports_fp8:
        problems.append(Problem("precision.mixed_precision", "fp8 needs a GPU with compute capability 8.9 or newer (Ada, Hopper, Blackwell)",
                                _where(chains, "precision.mixed_precision"), f"use bf16 here; detected: {detected}"))
    if precision == "bf16" and on_gpu and not hardware.supports_bf16:
        problems.append(Problem("precision.mixed_precision", "bf16 needs compute capability 8.0 or newer",
                                _where(chains, "precision.mixed_precision"), f"use fp16; detected: {detected}"))
    # "nccl needs CUDA GPUs" and the other CPU-only refusals live in strategies/cpu.py (the
    # launcher asks the same rules), named here with the file and line each value came from.
    # Judged for the machines the run trains on: `launch.gpus_per_machine` names them, else this one.
    gpus = cfg.launch.gpus_per_machine if cfg.launch.gpus_per_machine is not None else hardware.gpu_count
    if not cfg.launch.use_cpu:  # with use_cpu they are the config's own errors (cpu_rules)
        from overdrive.strategies import cpu

        problems += [Problem(p.key, p.message, _where(chains, p.key), p.fix) for p in cpu.problems(cfg, gpus=gpus)]
        problems += composition.attention_problems(cfg, lambda key: _where(chains, key), on_cpu=gpus == 0)
    problems += nvme_problems(cfg, chains)
    if cfg.launch.gpu_ids != "all" and hardware.gpu_count == 0 and not cfg.launch.use_cpu:
        problems.append(Problem("launch.gpu_ids", f"asks for GPUs {cfg.launch.gpu_ids}", _where(chains, "launch.gpu_ids"),
                                f"remove it or set launch.use_cpu=true; detected: {detected}"))
    usable = hardware.gpu_count
    if cfg.launch.gpu_ids != "all" and on_gpu:
        ids = listed_gpu_ids(cfg.launch.gpu_ids)
        missing = [i for i in ids or [] if i >= hardware.gpu_count]
        if ids is None or missing:
            problems.append(Problem("launch.gpu_ids", f"is {cfg.launch.gpu_ids!r}: " + (
                f"GPU {missing[0]} does not exist (indices go 0..{hardware.gpu_count - 1})" if ids is not None
                else "not a comma list of GPU indices"), _where(chains, "launch.gpu_ids"), f"detected: {detected}"))
        usable = len(ids or [])
    local = cfg.launch.num_processes // max(cfg.launch.num_machines, 1)
    if on_gpu and local > usable:
        which = f"launch.gpu_ids lists {usable}" if cfg.launch.gpu_ids != "all" else counted(usable, "GPU")
        problems.append(Problem("launch.num_processes", f"{local} processes per machine but {which}: two processes "
                                "would share a GPU (NCCL refuses: \"Duplicate GPU detected\")",
                                _where(chains, "launch.num_processes"), f"at most one process per GPU; detected: {detected}"))
    return problems
