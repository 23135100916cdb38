"""The batch split: micro-batch x accumulation x data-parallel degree = global batch.

    settled, origin = settle(cfg, chains)   # once, when the config is resolved
    split(settled).global_batch             # what every consumer reads

The split is settled once, when a config is resolved (`settle`, called by `resolving.resolve`
and again by training/build/settle.py for a RunConfig built in Python): with
`training.global_batch_size` set and an integer micro-batch, the accumulation is derived
from it (global / (micro x data-parallel degree)), as torchtitan and DeepSpeed derive it.
A global batch that does not divide, or an accumulation the user also set that says
otherwise, is refused by key (`problems`). With `training.micro_batch_size: auto` the global
batch is what the auto micro-batch keeps (training/build/autobatch.py splits it on the device).

Train, tune, plan, estimate, resume, DeepSpeed's config and the loaders all read `split(cfg)`
of the settled config: nothing else multiplies the three factors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from overdrive.config import mesh
from overdrive.config.provenance import Origin, Setting, where
from overdrive.errors import Problem, UserError

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

GLOBAL = "training.global_batch_size"
ACCUMULATION = "training.gradient_accumulation_steps"
MICRO = "training.micro_batch_size"


def data_parallel_degree(config: RunConfig) -> int:
    """Processes that each take different samples: the layout's dp_replicate x dp_shard, that is
    world / (pp x tp x cp x sp) (config/mesh.py). The ranks of one pipeline, tensor, context or
    sequence parallel group share a batch."""
    return mesh.layout(config).data_parallel


@dataclass(frozen=True)
class BatchSplit:
    micro: Optional[int]  # None while training.micro_batch_size is auto (settled on the device)
    accumulation: int
    data_parallel: int
    global_batch: Optional[int]  # None only for `auto` without a global batch, refused where it is needed

    @property
    def per_replica(self) -> int:
        """Samples one data-parallel replica takes per optimizer step."""
        g = self.required_global()
        if g % self.data_parallel:
            raise UserError(Problem(GLOBAL, f"{g} does not divide over {_processes(self.data_parallel)}",
                                    fix=f"make it a multiple of {self.data_parallel} (launch.num_processes)"))
        return g // self.data_parallel

    def settled_micro(self) -> int:
        """The micro-batch of a split that trains (`auto` is settled on the device before the parts are built)."""
        if self.micro is None:
            raise UserError(Problem(MICRO, "`auto` must be settled before the run's parts are built",
                                    fix="train() settles it (overdrive.training.build.autobatch); or set an integer"))
        return self.micro

    def required_global(self) -> int:
        if self.global_batch is None:
            raise UserError(Problem(GLOBAL, "is needed with training.micro_batch_size=auto: it is the batch per "
                                    "optimizer step that `auto` keeps while it picks the micro-batch",
                                    fix="set training.global_batch_size (e.g. 64), or an integer micro_batch_size"))
        return self.global_batch

    def describe(self) -> str:
        return (f"micro-batch {self.micro} x accumulation {self.accumulation} x {_processes(self.data_parallel)} "
                f"= {self.global_batch}")


def _processes(n: int) -> str:
    return f"{n} data-parallel process{'' if n == 1 else 'es'}"


def of(micro: int, accumulation: int, data_parallel: int) -> BatchSplit:
    """The one multiplication: the global batch of these three factors."""
    return BatchSplit(int(micro), int(accumulation), int(data_parallel), int(micro) * int(accumulation) * int(data_parallel))


def split(config: RunConfig) -> BatchSplit:
    """The split of a settled config."""
    t = config.training
    dp = data_parallel_degree(config)
    if t.micro_batch_size == "auto":
        return BatchSplit(None, t.gradient_accumulation_steps, dp, t.global_batch_size)
    return of(t.micro_batch_size, t.gradient_accumulation_steps, dp)


def keeping(global_batch: int, micro: int, data_parallel: int) -> Optional[int]:
    """The accumulation that keeps `global_batch` at this micro-batch and data-parallel
    degree, or None when no whole number does (a resume on another world size asks too)."""
    per_step = micro * data_parallel
    return global_batch // per_step if global_batch % per_step == 0 else None


def refused(config: RunConfig, chains: Optional[Mapping[str, list[Setting]]] = None) -> RunConfig:
    """`config`, once `problems` finds nothing: else those problems, raised by key."""
    found = problems(config, chains)
    if found:
        raise UserError(found)
    return config


def settled(config: RunConfig, chains: Optional[Mapping[str, list[Setting]]] = None) -> RunConfig:
    """`settle`, refusing what `problems` finds (a RunConfig built in Python)."""
    return settle(refused(config, chains), chains)[0]


def _explicit(chains: Optional[Mapping[str, list[Setting]]], key: str, value: Any, default: Any) -> bool:
    """Whether the user set `key`; without chains (a RunConfig built in Python) a value other
    than the default counts as set."""
    if chains is None:
        return value != default
    chain = chains.get(key)
    return bool(chain and chain[-1].origin.layer != "default")


def _derived(config: RunConfig) -> Optional[int]:
    """The accumulation `training.global_batch_size` gives, or None (not set, auto, or it does not divide)."""
    t = config.training
    if t.global_batch_size is None or t.micro_batch_size == "auto":
        return None
    return keeping(t.global_batch_size, t.micro_batch_size, data_parallel_degree(config))


def combinations(global_batch: int, micro: int, world: int, limit: int = 8) -> str:
    """The ways to keep `global_batch`, for a refusal: other world sizes at this micro-batch,
    and other micro-batches on this world size."""
    worlds = [w for w in range(1, global_batch // micro + 1) if keeping(global_batch, micro, w)][:limit]
    micros = [m for m in range(1, global_batch // world + 1) if keeping(global_batch, m, world)][:limit]
    parts = []
    if worlds:
        parts.append("with micro-batch {}: {}".format(micro, ", ".join(
            f"launch.num_processes={w} (accumulation {keeping(global_batch, micro, w)})" for w in worlds)))
    if micros:
        parts.append("on {}: {}".format(_plain_processes(world), ", ".join(
            f"{MICRO}={m} (accumulation {keeping(global_batch, m, world)})" for m in micros)))
    else:
        parts.append(f"no micro-batch on {_plain_processes(world)}: {global_batch} is not a multiple of {world}")
    return "; ".join(parts)


def _plain_processes(n: int) -> str:
    return f"{n} process{'' if n == 1 else 'es'}"


def _dividing(global_batch: int, micro: int, dp: int) -> str:
    """What would divide, for a global batch that does not: the nearest global batches, and
    the micro-batches that keep this one."""
    per_step = micro * dp
    near = [g for g in ((global_batch // per_step) * per_step, (global_batch // per_step + 1) * per_step) if g > 0]
    text = f"set {GLOBAL} to a multiple of {per_step}: " + " or ".join(
        f"{g} (accumulation {keeping(g, micro, dp)})" for g in near)
    micros = [m for m in range(global_batch // dp, 0, -1) if keeping(global_batch, m, dp)][:6]
    if micros:
        text += f"; or keep {global_batch} with {MICRO}=" + ", ".join(
            f"{m} (accumulation {keeping(global_batch, m, dp)})" for m in micros)
    return text


def problems(config: RunConfig, chains: Optional[Mapping[str, list[Setting]]] = None) -> list[Problem]:
    """A global batch that does not divide, or contradicts an accumulation also set."""
    t = config.training
    if t.global_batch_size is None:
        return []
    dp, g = data_parallel_degree(config), t.global_batch_size
    if t.micro_batch_size == "auto":
        if g % dp == 0:
            return []
        near = sorted({(g // dp) * dp, (g // dp + 1) * dp} - {0})
        return [Problem(GLOBAL, f"{g} does not divide over {_processes(dp)}", where(chains, GLOBAL),
                        f"set {GLOBAL} to a multiple of {dp}: " + " or ".join(map(str, near)))]
    micro = t.micro_batch_size
    derived = keeping(g, micro, dp)
    if derived is None:
        return [Problem(GLOBAL, f"{g} is not a multiple of micro-batch {micro} x {_processes(dp)} = {micro * dp}: "
                        "no whole accumulation gives it", where(chains, GLOBAL), _dividing(g, micro, dp))]
    given = t.gradient_accumulation_steps
    if given != derived and _explicit(chains, ACCUMULATION, given, 1):
        return [Problem(ACCUMULATION, f"is {given}, but {GLOBAL}={g} / (micro-batch {micro} x {_processes(dp)}) "
                        f"gives {derived}", where(chains, ACCUMULATION),
                        f"set only one of {ACCUMULATION} and {GLOBAL} (or {ACCUMULATION}={derived})")]
    return []


def settle(config: RunConfig, chains: Optional[Mapping[str, list[Setting]]] = None) -> tuple[RunConfig, Optional[Origin]]:
    """`config` with the accumulation derived from `training.global_batch_size`, and the
    origin to record for it (None when nothing was derived). Leaves the config as it is
    when `problems` has something to say: the caller refuses it."""
    derived = _derived(config)
    if derived is None or problems(config, chains):
        return config, None
    t = config.training
    if _explicit(chains, ACCUMULATION, t.gradient_accumulation_steps, 1):
        return config, None  # the user's own value, which agrees: its origin stays theirs
    origin = Origin("derived", f"from {GLOBAL}={t.global_batch_size} / (micro-batch {t.micro_batch_size} x "
                               f"{_processes(data_parallel_degree(config))})")
    if derived == t.gradient_accumulation_steps:
        return config, origin
    training = t.model_copy(update={"gradient_accumulation_steps": derived})
    return config.model_copy(update={"training": training}), origin


def with_split(config: RunConfig, micro: int, accumulation: int) -> RunConfig:
    """`config` with another micro-batch and accumulation (the auto micro-batch's answer, a
    tuner candidate); the global batch is the caller's to keep."""
    training = config.training.model_copy(update={"micro_batch_size": micro, "gradient_accumulation_steps": accumulation})
    return config.model_copy(update={"training": training})


__all__ = ["BatchSplit", "combinations", "data_parallel_degree", "keeping", "of", "problems", "refused", "settle", "settled", "split", "with_split"]
