"""Rules of the memory keys around the loss: `training.loss_kernel`, `training.activation_offloading`,
`data.document_mask`. What does not compose is refused here by key, before anything launches.

The loss kernels run inside the LM head's own call (training/step/loss_kernels.py), so a head sharded at
rest (FSDP2, ZeRO-3) is gathered there by the strategy's own hooks, as for the model's own loss.
What does not compose: a tensor-parallel head holds a slice of the vocabulary, a pipeline's last
stage computes its own loss, and context and sequence parallel's shards carry pre-shifted labels.
Those runs keep the model's own loss (`auto` settles on `full`).
"""

from __future__ import annotations

from typing import Callable, Optional

from overdrive.config import loss_kernel as kernels
from overdrive.config import mesh
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem
from overdrive.resolving import composition

KEY = "training.loss_kernel"


def kernel_blocker(cfg: RunConfig, kernel: Optional[str] = None) -> Optional[tuple[str, str]]:
    """(key, why) when `kernel` (the config's training.loss_kernel unless given; chunked or fused)
    cannot run in this config; None when it can. An objective the kernel does not compute is a row
    of the table of what composes (resolving/composition.py), refused by training.loss_kernel itself:
    GRPO takes `chunked` (its per-token log-probs, training/step/loss_kernels.py), not `fused`."""
    kernel = kernel or cfg.training.loss_kernel
    objective = composition.objective_of(cfg)
    piece = "fused loss kernel" if objective in composition.ONLINE and kernel == "fused" else "loss kernel"
    if objective not in composition.TOKEN | composition.ONLINE or piece == "fused loss kernel":
        row = next(r for r in composition.ROWS if r.piece == piece)
        return (KEY, f"{objective}: {row.why}")
    if composition.is_vision(cfg):
        return (KEY, next(r for r in composition.ROWS if r.piece == "vision+loss kernel").why)
    lay = mesh.layout(cfg)
    for axis, key, why in (("tp", "parallel.tp_size", "a tensor-parallel LM head holds a slice of the vocabulary"),
                           ("pp", "parallel.pp_size", "the pipeline's last stage computes the model's own loss"),
                           ("cp", "parallel.cp_size", "context parallel's shards carry pre-shifted labels"),
                           ("sp", "parallel.sp_size", "sequence parallel's shards carry pre-shifted labels")):
        if getattr(lay, axis) > 1:
            return (key, why)
    return None


def kernel_runs(cfg: RunConfig, device_type: str) -> str:
    """The kernel this run computes its token loss with: the one rule train, plan and estimate ask.
    Where a kernel cannot run it is `full`: a refused combination is never counted as saving memory."""
    kernel = kernels.chosen(cfg.training.loss_kernel, device_type)
    if kernel != "full" and kernel_blocker(cfg, kernel) is not None:  # `auto` too: it settles on full there
        return "full"
    return kernel


def rescales_logits(config) -> bool:
    """Whether the model scales its logits after the LM head (Gemma-2's soft-capping, Cohere's logit
    scale): the loss kernels take the head's plain output, so they would compute another loss."""
    return bool(getattr(config, "final_logit_softcapping", None)) or \
        getattr(config, "logit_scale", None) not in (None, 1, 1.0)


def model_rules(cfg: RunConfig, config, where: Callable[[str], str] = lambda key: "") -> list[Problem]:
    """A loss kernel asked for by name against the model's config (no weights): train refuses the same
    model once built (training/step/loss_kernels.py), this says so before launch."""
    kernel = cfg.training.loss_kernel
    if kernel not in ("chunked", "fused") or not rescales_logits(config):
        return []
    return [Problem(KEY, f"{type(config).__name__} rescales its logits after the LM head (soft-capping or a logit "
                    "scale), which the loss kernels leave out", where(KEY), f"set {KEY}=full")]


def loss_rules(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    errors: list[Problem] = []
    kernel = cfg.training.loss_kernel
    if kernel in ("chunked", "fused"):
        blocker = kernel_blocker(cfg)
        if blocker is not None and blocker[0] == KEY:
            pass  # the objective's row of the table of what composes says it (resolving/composition.py)
        elif blocker is not None:
            key, why = blocker
            errors.append(Problem(KEY, f"{kernel} does not compose with this run ({key}): {why}", where(KEY),
                                  f"set {KEY}=full (or auto)"))
        elif kernel == "fused" and not (kernels.liger_installed() or kernels.torch_has_linear_cross_entropy()):
            errors.append(Problem(KEY, "fused needs Liger (on CUDA) or torch >= 2.13's F.linear_cross_entropy",
                                  where(KEY), "pip install 'overdrive[liger]', or set training.loss_kernel=chunked"))
    lay = mesh.layout(cfg)
    if cfg.data.document_mask:
        # Only packed text has documents to keep apart: chat rows are packed apart already (data.packing),
        # preference pairs and RL prompts are never packed, a teacher scores whole rows.
        if (cfg.model.task != "causal-lm" or cfg.data.format in ("chat", "preference", "prompts")
                or cfg.rl.method != "none"):
            errors.append(Problem("data.document_mask", "applies to packed text of a causal LM (packed chat rows "
                                  "already keep conversations apart: data.packing; preference pairs and RL prompts "
                                  "are not packed)", where("data.document_mask"), "set data.document_mask=false"))
        for axis, key in (("cp", "parallel.cp_size"), ("sp", "parallel.sp_size"), ("pp", "parallel.pp_size")):
            if getattr(lay, axis) > 1:
                errors.append(Problem("data.document_mask", f"{key}={getattr(lay, axis)} splits the sequence (or "
                                      "the model) where the per-document positions are not followed",
                                      where("data.document_mask"), f"set data.document_mask=false or {key}=1"))
                break
    if cfg.training.activation_offloading and lay.pp > 1:
        errors.append(Problem("training.activation_offloading", "the pipeline schedule runs the stages' forwards "
                              "itself, around these hooks", where("training.activation_offloading"),
                              "set training.activation_offloading=false or parallel.pp_size=1"))
    return errors
