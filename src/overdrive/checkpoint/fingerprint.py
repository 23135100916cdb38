"""Is this config the run that wrote the checkpoint? What changed, and does it matter?

A checkpoint records the whole config it was written under. Resuming compares it with the
config given now, key by key, and sorts every difference:

- harmless: logging, evaluation and checkpoint cadence, DataLoader workers, launch details,
  kernels and compilation. Listed, then the run continues.
- math: anything that changes which numbers the run computes (model, tokenizer, data and
  its order, optimizer, schedule, seed, length, precision, the global batch). Refused
  unless `--force`, with each key and why it matters.
- layout: the strategy the checkpoint's files were written by. Its files cannot be read
  by another, so this is refused even with `--force`.

The world size is handled apart: the global batch is kept by changing the accumulation,
and the checkpoint is resharded for the new world size (routes.py says how). A change of
strategy is a layout change unless routes.py knows a reader from the old files into the new
strategy (DDP <-> FSDP2, ZeRO -> FSDP2 or DDP).

The fingerprint is a hash of the math-relevant values only, so two configs with the same
fingerprint train the same numbers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from overdrive.checkpoint import routes
import overdrive.config.batch as batch
from overdrive.config.keys import flatten  # open mappings (model.architecture, deepspeed extra) entry by entry
from overdrive.strategies import registry

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

# key or prefix -> why a change matters. The longest matching entry wins, so an exception
# to a section ("data.num_workers" inside "data.") is written as a longer entry.
_RULES: dict[str, tuple[str, str]] = {
    "model.": ("math", "the model being trained (the saved weights may not even fit it)"),
    "model.gradient_checkpointing": ("harmless", ""),
    "model.attn_implementation": ("harmless", ""),
    "model.trust_remote_code": ("harmless", ""),
    "tokenizer.": ("math", "the token ids the model sees"),
    "data.": ("math", "which samples are trained on, and in what order"),
    "data.num_workers": ("harmless", ""),
    "data.pin_memory": ("harmless", ""),
    "data.cache_dir": ("harmless", ""),
    "peft.": ("math", "the adapter being trained (the saved adapter may not even fit it)"),
    "peft.save_merged": ("harmless", ""),
    "optim.": ("math", "every update from here on"),
    "optim.implementation": ("harmless", ""),
    "scheduler.": ("math", "the learning rate of every remaining step"),
    "training.seed": ("math", "the data order and dropout of every remaining step"),
    "training.max_steps": ("math", "the schedule's length: the learning rate of every remaining step"),
    "training.num_epochs": ("math", "the schedule's length: the learning rate of every remaining step"),
    "training.gradient_clipping": ("math", "every update from here on"),
    "training.": ("harmless", ""),
    "precision.": ("math", "the arithmetic of every remaining step"),
    "parallel.strategy": ("layout", "the checkpoint's files are in the strategy's own format"),
    "parallel.deepspeed.zero_stage": ("layout", "ZeRO stages shard and name their files differently"),
    "parallel.fsdp.version": ("layout", "FSDP versions save in different formats"),
    "parallel.fsdp.state_dict_type": ("layout", "a sharded and a full state dict are different files"),
    # The N-D layout's sizes: routes.py says whether the files move (DCP) or not.
    "parallel.tp_size": ("layout", "tensor-parallel shards are files of their own"),
    "parallel.pp_size": ("layout", "pipeline stages hold the model in parts"),
    "parallel.cp_size": ("layout", "the mesh the checkpoint was sharded over"),
    "parallel.sp_size": ("layout", "the mesh the checkpoint was sharded over"),
    "parallel.dp_replicate_size": ("layout", "the mesh the checkpoint was sharded over"),
    "parallel.dp_shard_size": ("layout", "the mesh the checkpoint was sharded over"),
    "parallel.": ("harmless", ""),
    "compile.": ("harmless", ""),
    "launch.": ("harmless", ""),
    "checkpoint.": ("harmless", ""),
    "logging.": ("harmless", ""),
    "sweep.": ("harmless", ""),
    "eval.": ("harmless", ""),
    "output_dir": ("harmless", ""),
}
# The batch size keys are judged together, as the global batch (see `compare`).
_BATCH_KEYS = {"training.micro_batch_size", "training.gradient_accumulation_steps", "training.global_batch_size",
               "launch.num_processes", "launch.num_machines"}
# Values counted from another key and the data when the run starts (config/length.py): with that key
# set on both sides, the other key decides, and a config not yet counted is not a change.
_COUNTED: dict[str, Callable[[RunConfig], Any]] = {
    "training.max_steps": lambda cfg: cfg.training.num_epochs,
    "scheduler.warmup_steps": lambda cfg: cfg.scheduler.warmup_ratio,
}


def _counted(key: str, config: RunConfig) -> bool:
    """Whether `key`'s value is counted from the data when the run starts (its other key is set)."""
    return key in _COUNTED and _COUNTED[key](config) is not None
MOVED_BY = "moved by"  # a layout change that a reader in routes.py carries across
GLOBAL_BATCH_WHY = "the samples per optimizer step, so every update and the data position"


def kind_of(key: str) -> tuple[str, str]:
    best = ""
    for rule in _RULES:
        if (key == rule or (rule.endswith(".") and key.startswith(rule))) and len(rule) > len(best):
            best = rule
    return _RULES.get(best, ("math", "an unclassified setting (treated as changing the math)"))


def global_batch(config: RunConfig) -> int:
    """The settled split's global batch (with `auto`, the given one: the micro-batch is found at start-up)."""
    return batch.split(config).required_global()


def sharded(config: RunConfig) -> bool:
    """True when the strategy writes optimizer state (or weights) as one shard per rank."""
    return registry.of(config).checkpoint_per_rank(config)


def fingerprint(config: RunConfig) -> str:
    """sha256 of the values that decide the numbers (math and layout keys, and the global batch)."""
    flat = flatten(config.model_dump(mode="json"))
    kept = {k: v for k, v in flat.items() if k not in _BATCH_KEYS and kind_of(k)[0] != "harmless"
            and not _counted(k, config)}
    kept["global_batch"] = global_batch(config)
    text = json.dumps(kept, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    kind: str  # harmless | math | layout
    why: str = ""

    def render(self) -> str:
        text = f"{self.key}: {self.old!r} -> {self.new!r}"
        return f"{text} ({self.why})" if self.why else text


@dataclass
class Comparison:
    route: routes.Route  # how the checkpoint's files get into this run
    changes: list[Change] = field(default_factory=list)
    # Set when the world size changed and the accumulation must change to keep the global batch.
    accumulation: Optional[int] = None
    world_note: str = ""
    refusal: str = ""  # a world-size or strategy change that cannot be made (not divisible, no reader)

    def of(self, kind: str) -> list[Change]:
        return [c for c in self.changes if c.kind == kind]


_MISSING = object()
DATA_CONTENT = "data files (their content)"  # the change a data file rewritten in place shows as
_CHUNK = 1 << 16


def data_content(config: RunConfig) -> Optional[str]:
    """A digest of the local data files' sizes and sampled bytes (start, middle, end), data.source's and a
    mixture's: a file rewritten at the same path changes it, which the config's values cannot show. None
    where no source is a file here (a hub name, a directory)."""
    from pathlib import Path

    names = [config.data.source, *(entry.source for entry in config.data.sources)]
    files = [Path(n).expanduser() for n in names if n and Path(n).expanduser().is_file()]
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{size}".encode())
        with path.open("rb") as f:
            for at in (0, max(size // 2 - _CHUNK // 2, 0), max(size - _CHUNK, 0)):
                f.seek(at)
                digest.update(f.read(_CHUNK))
    return digest.hexdigest()[:16]


def compare(saved: RunConfig, current: RunConfig) -> Comparison:
    """Every difference between the checkpoint's config (read back: config/stored.py) and this
    one, classified. Both sides are compared as stored: secrets masked (trainer_state.json never
    holds them)."""
    from overdrive.config.redact import redact

    old = flatten(redact(saved.model_dump(mode="json")))
    new = flatten(redact(current.model_dump(mode="json")))
    result = Comparison(route=routes.route(saved, current))
    # The layout changes have a reader (another strategy, or DCP into another mesh): listed, not refused.
    movable = result.route.how in ("across", "dcp", "as saved", "accelerate", "universal")
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, _MISSING), new.get(key, _MISSING)
        if a == b:
            continue
        a = None if a is _MISSING else a
        b = None if b is _MISSING else b
        if key in _BATCH_KEYS:
            result.changes.append(Change(key, a, b, "harmless"))
            continue
        if _counted(key, saved) and _counted(key, current):
            continue  # counted from the data by the same rule on both sides
        kind, why = kind_of(key)
        if kind == "layout" and movable:
            kind, why = "harmless", f"{MOVED_BY} {result.route.reader or 'the same strategy, resharded'}"
        result.changes.append(Change(key, a, b, kind, why))
    if result.route.how == "refused":
        result.refusal = result.route.refusal
        return result

    g_old, g_new = global_batch(saved), global_batch(current)
    w_old, w_new = batch.data_parallel_degree(saved), batch.data_parallel_degree(current)
    micro = current.training.micro_batch_size
    if w_old != w_new:
        if micro == "auto":  # autobatch keeps training.global_batch_size on any world size
            if g_new != g_old:
                result.changes.append(Change("training.global_batch_size", g_old, g_new, "math", GLOBAL_BATCH_WHY))
            return result
        if g_new != g_old:
            result.accumulation = batch.keeping(g_old, micro, w_new)
            if result.accumulation is None:
                result.refusal = (f"the global batch of {g_old} cannot be kept on {w_new} processes with micro-batch "
                                  f"{micro}: {g_old} / ({micro} x {w_new}) is not a whole number. It is kept "
                                  + batch.combinations(g_old, micro, w_new))
                return result
        accumulation = result.accumulation or current.training.gradient_accumulation_steps
        result.world_note = (f"{w_old} -> {w_new} processes: keeping the global batch of {g_old} "
                             f"(micro-batch {micro} x accumulation {accumulation} x {w_new})")
    elif g_new != g_old:
        result.changes.append(Change("global batch (micro x accumulation x processes)", g_old, g_new, "math",
                                     GLOBAL_BATCH_WHY))
    return result
