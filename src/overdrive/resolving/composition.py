"""The table of what composes: objective x forward-backward x layout x adapter x attention.

A step is three pieces (DESIGN.md, "One step, composed"): the objective (what a micro-batch's
loss is), the forward-backward (plain, context-parallel, a pipeline schedule) and the strategy
that wraps the model (its layout and adapter). Each row below names a pair of pieces that do
not compose, why, the key to change and the fix. A combination no row names runs, and gives
the one-process losses at the same global batch (the multi-process tests hold that).

    problems(cfg, where)   the rows a config meets, as Problems by key: `explain`, `plan`,
                           `train`, the wizard, `import` and the "next:" hints all ask it
                           (through resolving/validate.py), so they agree
    matrix()               the table over named objectives, layouts and adapters:
                           docs/compatibility.md is generated from it (tests/test_composition.py)

A new objective or layout is a name in `objective_of` / `pieces_of` and its rows here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

from overdrive.config.mesh import layout
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem

TOKEN = frozenset({"text", "chat"})
PAIRS = frozenset({"dpo", "ipo", "orpo", "simpo", "kto"})  # the preference methods on a causal LM
SCALAR = frozenset({"reward", "classification"})
EVERY = TOKEN | PAIRS | SCALAR


@dataclass(frozen=True)
class Row:
    """`objectives` do not compose with `piece`: refused by `key`."""

    objectives: frozenset
    piece: str
    key: str
    why: str
    fix: str


ROWS: tuple[Row, ...] = (
    Row(PAIRS | SCALAR, "pipeline", "parallel.pp_size",
        "the pipeline's last stage computes the token loss of causal LM and chat data; preference pairs and "
        "scalar heads need the whole batch's sequences (and a reference model) at one stage",
        "set parallel.pp_size=1 (shard with FSDP2 or ZeRO instead)"),
    Row(EVERY, "pipeline+adapter", "parallel.pp_size", "adapters (peft.method) are not split into pipeline stages",
        "set parallel.pp_size=1, or peft.method=none"),
    Row(PAIRS | SCALAR, "context-parallel", "parallel.cp_size",
        "context parallel drops the attention mask and splits each row over ranks: a pair's answer log-probs and "
        "a classifier's last-token read need the whole, masked row",
        "set parallel.cp_size=1 (shard with FSDP2 or ZeRO instead)"),
    Row(PAIRS | SCALAR, "sequence-parallel", "parallel.sp_size",
        "sequence parallel (DeepSpeed Ulysses) splits each row over ranks and attends without the padding mask "
        "that pairs and a classifier's last-token read rely on", "set parallel.sp_size=1 (shard with ZeRO instead)"),
    Row(frozenset({"chat"}), "context-parallel+packing", "data.packing",
        "context parallel makes every attention causal over the whole row and drops its mask: packed "
        "conversations would attend to each other", "set data.packing=false (one conversation per row), or "
        "parallel.cp_size=1"),
    Row(SCALAR, "tensor-parallel", "parallel.tp_size",
        "the model's tensor-parallel plan splits its decoder, not the score head a reward model or classifier "
        "adds: the optimizer would step plain and sharded tensors together",
        "set parallel.tp_size=1 (shard with FSDP2 or ZeRO instead)"),
    Row(EVERY, "tensor-parallel+adapter", "parallel.tp_size",
        "PEFT's A and B matrices are plain tensors that Transformers' tp plan does not split, beside base weights "
        "sharded as DTensors", "shard an adapter run with FSDP (parallel.tp_size=1), which shards frozen and "
        "trained tensors alike"),
)


def objective_of(cfg: RunConfig) -> str:
    """The objective a config trains, by the names the table uses."""
    method = cfg.preference.method
    if method != "none":
        return method
    if cfg.model.task == "sequence-classification":
        return "classification"
    return "chat" if cfg.data.format == "chat" else "text"


def pieces_of(cfg: RunConfig) -> set[str]:
    """The forward-backward and layout pieces a config uses, with the pairs the table names."""
    shape, adapter = layout(cfg), cfg.peft.method != "none"
    pieces = {"adapter"} if adapter else set()
    if shape.pp > 1:
        pieces |= {"pipeline"} | ({"pipeline+adapter"} if adapter else set())
    if shape.cp > 1:
        pieces |= {"context-parallel"} | ({"context-parallel+packing"} if cfg.data.packing else set())
    if shape.sp > 1:
        pieces.add("sequence-parallel")
    if shape.tp > 1:
        pieces |= {"tensor-parallel"} | ({"tensor-parallel+adapter"} if adapter else set())
    return pieces


def problems(cfg: RunConfig, where: Callable[[str], str] = lambda key: "") -> list[Problem]:
    """The table's rows this config meets; with `launch.use_cpu` (the config says where it
    trains), an attention kernel that cannot run there too."""
    objective, pieces = objective_of(cfg), pieces_of(cfg)
    found = [Problem(row.key, f"{objective} with {row.piece.replace('+', ' and ')}: {row.why}", where(row.key), row.fix)
             for row in ROWS if objective in row.objectives and row.piece in pieces]
    return found + (attention_problems(cfg, where, on_cpu=True) if cfg.launch.use_cpu else [])


# attn_implementation -> (the package it imports, whether it needs CUDA)
_KERNELS = {"flash_attention_2": ("flash_attn", True), "flash_attention_3": ("flash_attn_interface", True)}


def attention_problems(cfg: RunConfig, where: Callable[[str], str], on_cpu: bool) -> list[Problem]:
    """An attention kernel whose package or device is missing where the run trains (`on_cpu`:
    it trains on CPU processes; this machine's packages either way): refused with the fix, not
    Transformers' ImportError after the model is loaded. Asked before training on this machine
    (resolving/validate.py's hardware_problems: a warning when explaining a GPU config here)."""
    name = cfg.model.attn_implementation
    if name not in _KERNELS:
        return []
    package, cuda = _KERNELS[name]
    if cuda and on_cpu:
        why = "runs on CUDA GPUs only, and this run trains on CPU"
    elif importlib.util.find_spec(package) is None:
        why = f"needs the `{package}` package, which is not installed"
    else:
        return []
    return [Problem("model.attn_implementation", f"{name} {why}", where("model.attn_implementation"),
                    "set model.attn_implementation=sdpa (PyTorch's own fused attention, the same results)"
                    + ("" if cuda and on_cpu else f", or install {package}"))]
