"""The search space: what the tuner may change, and the one thing it may not (the math).

A candidate takes one option from each dimension. Every option keeps the training itself
unchanged: the global batch (micro x accumulation x processes), the data order, the
optimizer and the schedule are the same in all of them; only how the work is laid out on
the hardware differs. Mixed precision is the one option that changes rounding, and it is
tuned only among the precisions this hardware supports.

Building the space needs no torch (so `overdrive tune` can answer from its cache at once):
the facts about the machine come from `overdrive.system.hardware` and the file system. Pruning by
memory (`fits_by_estimate`) does import torch, to build the model on the meta device.
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import overdrive.config.batch as batch
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError

DIMENSIONS = ("batch", "precision", "checkpointing", "strategy", "compile", "workers", "threads")
# Searched one group after the other, each on the finalists of the one before. The groups
# interact weakly (how fast a layout computes barely depends on how the loader feeds it).
# The host settings come first: on a CPU they decide whether the cores are used well at all
# (two OpenMP threads on a busy two-core machine can be several times slower than one), so
# every layout is then measured as it will run, and cheaply. torch.compile, the most
# expensive thing to measure (its compile time), comes last, tried only on the finalists.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("host", ("workers", "threads")),
    ("layout", ("batch", "precision", "checkpointing", "strategy")),
    ("compile", ("compile",)),
)


@dataclass(frozen=True)
class Option:
    """One value of one dimension: a label, and the dotted keys it sets."""

    dimension: str
    label: str
    values: tuple[tuple[str, Any], ...]
    twin: str = ""
    """For an option that only trades speed for memory (checkpointing on, offload): the
    label of the same option without the trade. When the twin fits, this one is dominated."""
    micro: int = 0
    """A batch option's micro-batch (its `values` set it and the accumulation that keeps the global batch)."""

    @property
    def short(self) -> str:
        """The value alone (`8`, `bf16`, `on`, `zero2`): what `--only dimension=a,b` matches."""
        if self.dimension == "batch":
            return str(self.micro)
        if self.dimension == "strategy":
            return self.label.replace(" ", "_")
        return self.label.split()[-1]


@dataclass
class Candidate:
    options: tuple[Option, ...]  # one per dimension, in DIMENSIONS order
    stage: str = ""
    status: str = "pending"  # pending ok stopped crashed oom timeout pruned dominated skipped
    reason: str = ""
    estimate_bytes: Optional[int] = None
    measurement: Any = None  # trials.Measurement
    trial_s: float = 0.0
    log_tail: str = ""

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(o.label for o in self.options)

    @property
    def label(self) -> str:
        return " / ".join(o.label for o in self.options)

    def option(self, dimension: str) -> Option:
        return self.options[DIMENSIONS.index(dimension)]

    def overrides(self) -> dict[str, Any]:
        return {key: value for o in self.options for key, value in o.values}

    def replace(self, **options: Option) -> "Candidate":
        chosen = [options.get(o.dimension, o) for o in self.options]
        return Candidate(tuple(chosen))


@dataclass(frozen=True)
class Facts:
    """What the machine offers, as far as the space is concerned (no torch needed)."""

    cpu_cores: int
    gpu: bool
    supports_bf16: bool
    compiler: str  # "" when torch.compile's inductor cannot build kernels here
    compile_note: str = ""


def detect_facts(cfg: RunConfig) -> Facts:
    from importlib.util import find_spec

    from overdrive.system import hardware
    hw = hardware.detect(light=True)
    gpu = hw.gpu_count > 0 and not cfg.launch.use_cpu
    compiler, note = "", ""
    if find_spec("torch") is None:
        note = "torch is not installed"
    elif gpu:
        compiler = "triton" if find_spec("triton") else ""
        note = "" if compiler else "inductor needs triton on GPUs, which is not installed"
    else:
        # Inductor writes C++ kernels for the CPU and builds them with the system compiler.
        compiler = next((name for name in ("g++", "c++", "clang++") if shutil.which(name)), "")
        note = "" if compiler else "inductor needs a C++ compiler (g++ or clang++) on the CPU; none found"
    return Facts(hw.cpu_cores, gpu, hw.supports_bf16, compiler, note)


def global_batch(cfg: RunConfig) -> int:
    """Samples per optimizer step over all processes: what every candidate keeps (the settled split's)."""
    return batch.split(batch.settled(cfg)).required_global()


@dataclass
class Space:
    dimensions: dict[str, list[Option]]
    baseline: Candidate  # the configuration as given
    global_batch: int
    world: int
    notes: list[str] = field(default_factory=list)

    def grid(self) -> list[Candidate]:
        """Every combination, the baseline first."""
        combos = [Candidate(tuple(c)) for c in itertools.product(*(self.dimensions[d] for d in DIMENSIONS))]
        return order(combos, self.baseline)

    def variations(self, base: Candidate, dims: Iterable[str]) -> list[Candidate]:
        """`base` with the options of `dims` varied over their whole range (base itself included)."""
        dims = list(dims)
        out = []
        for values in itertools.product(*(self.dimensions[d] for d in dims)):
            out.append(base.replace(**dict(zip(dims, values))))
        return order(out, base)

    def describe(self) -> dict[str, Any]:
        return {"global_batch": self.global_batch, "world": self.world,
                "dimensions": {d: [[o.label, [list(v) for v in o.values]] for o in opts]
                               for d, opts in self.dimensions.items()},
                "baseline": list(self.baseline.key), "notes": self.notes}


def order(candidates: list[Candidate], first: Candidate) -> list[Candidate]:
    """`first` (when present), then larger micro-batches first: they usually compute faster,
    and a fast candidate measured early lets the race stop slower ones sooner."""
    def micro(c: Candidate) -> int:
        return c.option("batch").micro

    rest = [c for c in candidates if c.key != first.key]
    rest.sort(key=lambda c: -micro(c))  # stable: keeps the dimension order otherwise
    return ([c for c in candidates if c.key == first.key][:1]) + rest


def _add(options: list[Option], option: Option) -> None:
    if all(o.label != option.label for o in options):
        options.append(option)


def batch_options(global_batch_size: int, world: int, baseline_micro: Optional[int], most: int = 4) -> list[Option]:
    per_rank = batch.BatchSplit(None, 1, world, global_batch_size).per_replica
    divisors = [m for m in range(per_rank, 0, -1) if per_rank % m == 0][:most]
    if baseline_micro and baseline_micro not in divisors:
        divisors.append(baseline_micro)
    return [Option("batch", f"micro {m} x accum {per_rank // m}",
                   (("training.micro_batch_size", m), ("training.gradient_accumulation_steps", per_rank // m)), micro=m)
            for m in divisors]


def _strategy_option(name: str) -> Option:
    if name == "ddp":
        return Option("strategy", "ddp", (("parallel.strategy", "ddp"),))
    if name.startswith("zero"):
        stage = int(name[4])
        offload_opt = "cpu" if "offload" in name else "none"
        offload_param = "cpu" if name == "zero3_offload" else "none"
        label = name.replace("_", " ")
        return Option("strategy", label, (("parallel.strategy", "deepspeed"), ("parallel.deepspeed.zero_stage", stage),
                                          ("parallel.deepspeed.offload_optimizer", offload_opt),
                                          ("parallel.deepspeed.offload_param", offload_param)),
                      twin=f"zero{stage}" if "offload" in name else "")
    offload = name == "fsdp2_offload"
    return Option("strategy", name.replace("_", " "), (("parallel.strategy", "fsdp"),
                  ("parallel.fsdp.reshard_after_forward", True), ("parallel.fsdp.offload_params", offload)),
                  twin="fsdp2" if offload else "")


def _fsdp_baseline(cfg: RunConfig) -> Option:
    f = cfg.parallel.fsdp
    return Option("strategy", "fsdp2" + (" offload" if f.offload_params else ""),
                  (("parallel.strategy", "fsdp"), ("parallel.fsdp.reshard_after_forward", f.reshard_after_forward),
                   ("parallel.fsdp.offload_params", f.offload_params)))


def _deepspeed_baseline(cfg: RunConfig) -> Option:
    from overdrive.strategies import registry

    ds = cfg.parallel.deepspeed
    return Option("strategy", registry.of(cfg).estimator_row(cfg).replace("_", " ") + ("" if ds.zero_stage else " (stage 0)"),
                  (("parallel.strategy", "deepspeed"), ("parallel.deepspeed.zero_stage", ds.zero_stage),
                   ("parallel.deepspeed.offload_optimizer", ds.offload_optimizer),
                   ("parallel.deepspeed.offload_param", ds.offload_param)))


# The configuration as given, as an option of the strategy dimension: by the strategy's name.
_BASELINES = {"ddp": lambda cfg: _strategy_option("ddp"), "fsdp": _fsdp_baseline, "deepspeed": _deepspeed_baseline}


def _baseline_strategy(cfg: RunConfig) -> Option:
    from overdrive.strategies import registry

    return _BASELINES[registry.of(cfg).name](cfg)


def _refuses_optimizer(cfg: RunConfig, option: Option) -> bool:
    from overdrive.resolving.recipe_rules import optimizer_problems

    found = optimizer_problems(apply(cfg, dict(option.values)), lambda key: "")
    return any(problem.key == "optim.name" for problem in found)


def build_space(cfg: RunConfig, facts: Facts, only: Optional[dict[str, list[str]]] = None) -> Space:
    """The space for this run on this machine. `only` narrows a dimension to some labels
    (the benchmark's reduced space; tests), always keeping the baseline's option."""
    cfg = batch.settled(cfg)  # a RunConfig built in Python: its accumulation derived as resolve() would
    split = batch.split(cfg)
    world, gb = cfg.launch.num_processes, split.required_global()
    local = max(world // max(cfg.launch.num_machines, 1), 1)
    t, notes = cfg.training, []
    dims: dict[str, list[Option]] = {d: [] for d in DIMENSIONS}
    base: dict[str, Option] = {}

    micro = t.micro_batch_size if isinstance(t.micro_batch_size, int) else None
    dims["batch"] = batch_options(gb, split.data_parallel, micro)
    base["batch"] = next((o for o in dims["batch"] if o.micro == micro),
                         dims["batch"][0])

    precisions = ["no", "bf16" if facts.supports_bf16 or not facts.gpu else "fp16"]
    if not facts.gpu:
        notes.append("precision: no and bf16 (autocast on the CPU has no fp16 training path)")
    current = cfg.precision.mixed_precision
    base["precision"] = Option("precision", current, (("precision.mixed_precision", current),))
    for name in precisions:
        _add(dims["precision"], Option("precision", name, (("precision.mixed_precision", name),)))
    _add(dims["precision"], base["precision"])

    off = Option("checkpointing", "ckpt off", (("model.gradient_checkpointing", False),))
    on = Option("checkpointing", "ckpt on", (("model.gradient_checkpointing", True),), twin="ckpt off")
    dims["checkpointing"] = [off, on]
    base["checkpointing"] = on if cfg.model.gradient_checkpointing else off

    base["strategy"] = _baseline_strategy(cfg)
    from overdrive.strategies import layout

    if layout.layout(cfg).has_axes:
        # Each axis needs its strategy (strategies/layout.py): the layout is the user's choice, kept.
        notes.append(f"strategy: kept, the layout ({layout.layout(cfg).describe()}) decides it")
        names = []
    elif world == 1:
        notes.append("strategy: one process, so plain data parallel (ZeRO and FSDP shard over processes)")
        names = ["ddp"]
    else:
        names = ["ddp", "zero1", "zero2", "zero3", "fsdp2"]
        if facts.gpu:  # offloading to the CPU from the CPU moves nothing
            names += ["zero2_offload", "zero3_offload_optimizer", "zero3_offload", "fsdp2_offload"]
    for name in names:
        _add(dims["strategy"], _strategy_option(name))
    _add(dims["strategy"], base["strategy"])
    # The optimizer is the user's and never changes: strategies it cannot run under are left out.
    runnable = [o for o in dims["strategy"] if o.label == base["strategy"].label or not _refuses_optimizer(cfg, o)]
    if len(runnable) < len(dims["strategy"]):
        notes.append(f"strategy: only those optim.name={cfg.optim.name} runs under")
    dims["strategy"] = runnable

    none = Option("compile", "eager", (("compile.backend", None),))
    base["compile"] = none if not cfg.compile.backend else Option(
        "compile", cfg.compile.backend, (("compile.backend", cfg.compile.backend),))
    dims["compile"] = [none]
    if facts.compiler:
        _add(dims["compile"], Option("compile", "inductor", (("compile.backend", "inductor"),)))
    else:
        notes.append(f"compile: eager only ({facts.compile_note})")
    _add(dims["compile"], base["compile"])

    cores = max(facts.cpu_cores // local, 1)
    workers = [0, 1] if cores <= 4 else [0, 2]
    base["workers"] = Option("workers", f"workers {cfg.data.num_workers}", (("data.num_workers", cfg.data.num_workers),))
    for n in workers:
        _add(dims["workers"], Option("workers", f"workers {n}", (("data.num_workers", n),)))
    _add(dims["workers"], base["workers"])

    configured = cfg.launch.threads_per_process
    if facts.gpu:
        dims["threads"] = [Option("threads", f"threads {configured or 'auto'}",
                                  (("launch.threads_per_process", configured),))]
        base["threads"] = dims["threads"][0]
    else:
        # All cores, or half of them (leaves room for loader workers and the OS).
        for n in dict.fromkeys([cores, max(cores // 2, 1)]):
            _add(dims["threads"], Option("threads", f"threads {n}", (("launch.threads_per_process", n),)))
        base["threads"] = Option("threads", f"threads {configured or cores}",
                                 (("launch.threads_per_process", configured or cores),))
        _add(dims["threads"], base["threads"])

    for name, labels in (only or {}).items():
        if name not in dims:
            raise UserError(Problem("", f"unknown tuning dimension {name!r}; choose from {', '.join(DIMENSIONS)}"))
        kept = [o for o in dims[name] if o.label in labels or o.short in labels or o.label == base[name].label]
        dims[name] = kept or [base[name]]
    baseline = Candidate(tuple(next(o for o in dims[d] if o.label == base[d].label) for d in DIMENSIONS))
    return Space(dims, baseline, gb, world, notes)


# ------------------------------------------------------------------ configs and memory

def apply(cfg: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """`cfg` with dotted overrides set; validated again (a frozen config is never mutated)."""
    data = cfg.model_dump(mode="python")
    for key, value in overrides.items():
        node = data
        *parents, last = key.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
    return RunConfig.model_validate(data)


def fits_by_estimate(cfg: RunConfig, gpu_memory_gib: Optional[float] = None) -> Callable[[Candidate], tuple[bool, int]]:
    """A function telling, per candidate, whether the estimator says it fits, and its bytes.

    Builds the model once on the meta device (no weights); each candidate is then arithmetic.
    """
    from overdrive.memory import report
    from overdrive.memory.model_shape import run_estimate, run_shape

    shape = run_shape(cfg)
    capacity = report.detect_capacity(gpu_memory_gib)
    target = "cpu" if capacity.kind == "host" else "cuda"

    verdicts: dict[tuple[str, ...], tuple[bool, int]] = {}

    def check(candidate: Candidate) -> tuple[bool, int]:
        if candidate.key in verdicts:
            return verdicts[candidate.key]
        run = apply(cfg, candidate.overrides())
        est = run_estimate(run, target, shape)
        report.apply_verdict(est, capacity, nodes=run.launch.num_machines)
        row = est.rows[0]
        verdicts[candidate.key] = bool(row.fits), int(row.total_bytes + row.host_bytes)
        return verdicts[candidate.key]

    return check


def prune(candidates: list[Candidate], check: Callable[[Candidate], tuple[bool, int]], space: Space) -> list[Candidate]:
    """Mark what cannot fit (`pruned`) and what a cheaper twin beats (`dominated`); return the rest.

    Dominated: checkpointing on while the same candidate with it off fits (recomputation is
    pure extra work), and offload while the same strategy without it fits.
    """
    for c in candidates:
        fits, c.estimate_bytes = check(c)
        if not fits:
            c.status, c.reason = "pruned", "estimated not to fit in memory"
            continue
        for o in c.options:
            twin = next((x for x in space.dimensions[o.dimension] if x.label == o.twin), None) if o.twin else None
            if twin is not None and check(c.replace(**{o.dimension: twin}))[0]:
                c.status, c.reason = "dominated", f"{o.twin} fits: {o.label} would only add work"
                break
    return [c for c in candidates if c.status == "pending"]
