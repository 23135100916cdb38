"""What each `optim.name` is, described once, for validation, the memory estimator and the builders.

Pure: imports neither torch nor the optimizers' packages, so `explain`, `plan` and `estimate`
stay fast. The builders (training/build/optimizers.py) construct what this names.

`state_bytes` is the optimizer's own state per trainable parameter, in bytes, for a model whose
parameters are split as `Counts` says (Adafactor's factored moments and Muon's split depend on
which parameters are matrices). `elementwise` says the update of each element needs nothing but
that element's own gradient and state (besides the learning rate): such an optimizer gives the
same result on DeepSpeed's flattened ZeRO partitions and on FSDP2's shards as on whole tensors;
one that factors or orthogonalises matrices does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


@dataclass(frozen=True)
class Counts:
    """The trainable parameters, split the way optimizer states care about.

    `matrices` and `matrix_sides` cover every 2-D parameter (sum of rows + columns over them);
    `hidden_matrices` are the 2-D ones inside the transformer blocks (not embeddings, not the head).
    """

    total: float
    matrices: float = 0.0
    matrix_sides: float = 0.0
    hidden_matrices: float = 0.0


@dataclass(frozen=True)
class OptimizerKind:
    name: str
    title: str
    builds: str  # the class that runs, by import path
    package: Optional[str]  # the distribution that provides it, when not torch
    elementwise: bool
    # DeepSpeed's own CPU optimizer for ZeRO-Offload, where one does this optimizer's math.
    deepspeed_cpu: Optional[str]
    # (counts, optim.momentum) -> bytes; the momentum matters to SGD alone (None: its default)
    _state_bytes: Callable[[Counts, Optional[float]], float]
    state_words: str

    def state_bytes(self, counts: Counts, momentum: Optional[float] = None) -> float:
        """Bytes of optimizer state for the whole model (divide by the parameter count for per-parameter);
        `momentum` is `optim.momentum`."""
        return self._state_bytes(counts, momentum)


def _sgd_state(counts: Counts, momentum: Optional[float]) -> float:
    return 4.0 * counts.total if (0.9 if momentum is None else momentum) > 0 else 0.0


def _adafactor_state(counts: Counts, momentum: Optional[float]) -> float:
    # torch Adafactor: a row and a column second-moment vector per matrix, the full second
    # moment for vectors; no first moment.
    return 4.0 * (counts.matrix_sides + (counts.total - counts.matrices))


def _muon_state(counts: Counts, momentum: Optional[float]) -> float:
    # One fp32 momentum buffer on the hidden matrices, AdamW's two on everything else.
    return 4.0 * counts.hidden_matrices + 8.0 * (counts.total - counts.hidden_matrices)


KINDS: dict[str, OptimizerKind] = {k.name: k for k in (
    OptimizerKind("adamw", "AdamW", "torch.optim.AdamW", None, True, "deepspeed.ops.adam.DeepSpeedCPUAdam",
                  lambda c, momentum: 8.0 * c.total, "exp_avg + exp_avg_sq, fp32: 8 bytes/param"),
    OptimizerKind("adam", "Adam", "torch.optim.Adam", None, True, "deepspeed.ops.adam.DeepSpeedCPUAdam",
                  lambda c, momentum: 8.0 * c.total, "exp_avg + exp_avg_sq, fp32: 8 bytes/param"),
    OptimizerKind("sgd", "SGD", "torch.optim.SGD", None, True, None, _sgd_state,
                  "momentum buffer, fp32: 4 bytes/param (0 without momentum)"),
    OptimizerKind("adafactor", "Adafactor", "torch.optim.Adafactor", None, False, None, _adafactor_state,
                  "row + column second moments per matrix, full for vectors: ~4(r+c)/(r*c) bytes/param of a matrix"),
    OptimizerKind("muon", "Muon + AdamW", "torch.optim.Muon", None, False, None, _muon_state,
                  "Muon momentum (4 bytes/param) on hidden matrices, AdamW (8) on the rest"),
    OptimizerKind("lion", "Lion", "lion_pytorch.Lion", "lion-pytorch", True, "deepspeed.ops.lion.DeepSpeedCPULion",
                  lambda c, momentum: 4.0 * c.total, "exp_avg, fp32: 4 bytes/param"),
    OptimizerKind("schedule_free_adamw", "Schedule-free AdamW", "schedulefree.AdamWScheduleFree", "schedulefree",
                  True, None, lambda c, momentum: 8.0 * c.total, "z + exp_avg_sq, fp32: 8 bytes/param"),
    OptimizerKind("adamw_8bit", "8-bit AdamW", "bitsandbytes.optim.AdamW8bit", "bitsandbytes", False, None,
                  lambda c, momentum: 2.0 * c.total, "two 8-bit moments (+ a scale per 256-block): ~2 bytes/param"),
    OptimizerKind("deepspeed", "DeepSpeed's own (the JSON's optimizer block)", "deepspeed", "deepspeed", True, None,
                  lambda c, momentum: 8.0 * c.total, "taken as Adam-like: 8 bytes/param"),
)}
CLASS_PATH = OptimizerKind("class_path", "optim.class_path", "", None, True, None, lambda c, momentum: 8.0 * c.total,
                           "unknown: taken as Adam-like, 8 bytes/param")


def of(cfg: RunConfig) -> OptimizerKind:
    """The optimizer a run config builds."""
    if cfg.optim.class_path:
        return CLASS_PATH
    return KINDS[cfg.optim.name]
