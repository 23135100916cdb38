"""Memory per pipeline stage, and the schedule's bubble, for `plan` (no weights loaded).

A pipeline rank holds its stages' weights, gradients and optimizer state (DDP's bytes per
parameter, from formulas.py, times the stage's parameters: its decoder layers, the
embedding on the first stage, the final norm and head on the last) and the activations of
the microbatches its schedule keeps in flight:

    gpipe              every microbatch: all m forwards run before the first backward
    1f1b               pp - s on stage s (its warm-up forwards, then one in, one out)
    interleaved        Megatron's warm-up of (pp - r - 1) x 2 + (v - 1) x pp, plus one, chunks on rank r

One microbatch is (micro_batch_size x gradient_accumulation_steps) / pp_microbatches samples.
The bubble is strategies/pipeline.py's (pp - 1) / (v m + pp - 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from overdrive.memory.activations import estimate_activations
from overdrive.memory.formulas import model_state_row, uses_autocast
from overdrive.memory.shape import ModelShape, Target, setup_for_run
from overdrive.strategies import pipeline as rules

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def _in_flight(name: str, pp: int, rank: int, microbatches: int, per_rank: int) -> int:
    """Microbatches (of one stage chunk) whose activations rank `rank` holds at its peak."""
    if name == "gpipe":
        return microbatches * per_rank
    if per_rank == 1:
        return min(microbatches, pp - rank)
    return min(microbatches * per_rank, (pp - rank - 1) * 2 + (per_rank - 1) * pp + 1)


def stages(cfg: RunConfig, shape: ModelShape, target: Target = "cuda") -> dict[str, Any]:
    """Per pipeline rank: the bytes of its stages' model state and in-flight activations."""
    pp, per_rank, m = rules.pp_size(cfg), rules.stages_per_rank(cfg), rules.microbatches(cfg)
    name, count = cfg.parallel.pp_schedule, rules.stage_count(cfg)
    micro = cfg.training.micro_batch_size if isinstance(cfg.training.micro_batch_size, int) else 1
    samples = max(micro * cfg.training.gradient_accumulation_steps // m, 1)
    setup = setup_for_run(cfg, target, micro_batch=samples)
    row = model_state_row("ddp", shape, setup)
    per_param = (row.params_bytes + row.grads_bytes + row.optimizer_bytes + row.master_weights_bytes
                 + row.buffers_bytes) / max(shape.params, 1)
    act = estimate_activations(shape, setup, uses_autocast("ddp", setup))
    layer_act = act.layer_input if setup.checkpointing else act.layer
    norm = 2 * shape.hidden if shape.norm == "layernorm" else shape.hidden
    head = shape.vocab * shape.hidden + norm
    embedding = max(shape.root_params - head, 0)
    layers_per_stage = shape.layers // max(count, 1)
    ranks = []
    for rank in range(pp):
        held = rules.stages_of_rank(rank, pp, per_rank, rules.schedule(cfg).v_shape)
        params = layers_per_stage * len(held) * shape.block_params
        params += embedding if 0 in held else 0
        params += head if count - 1 in held else 0
        flight = _in_flight(name, pp, rank, m, per_rank)
        activations = flight * layers_per_stage * layer_act
        if 0 in held:
            activations += flight * act.embeddings
        if count - 1 in held:  # the head's activations and logits, one microbatch's loss gradient
            activations += flight * (act.head + act.logits) + act.loss_backward
        state = round(per_param * params)
        ranks.append({"pp_rank": rank, "stages": held, "parameters": params, "model_state_bytes": state,
                      "activations_bytes": activations, "microbatches_in_flight": flight,
                      "total_bytes": state + activations})
    return {"pp_size": pp, "schedule": name, "microbatches": m, "stages_per_rank": per_rank,
            "samples_per_microbatch": samples, "bubble_fraction": rules.bubble_fraction(pp, m, per_rank),
            "ranks": ranks}


def fits(stages: dict[str, Any], cap: Any, headroom: float, local_processes: int) -> bool:
    """The pipeline layout's own verdict (not a data-parallel row's): each stage rank's memory
    against one device with `headroom` left; on the CPU every local rank draws on one RAM."""
    totals = [r["total_bytes"] for r in stages["ranks"]]
    if cap.kind == "host":
        share = sum(totals) / max(len(totals), 1) * max(local_processes, 1)
        return share <= cap.host_bytes * (1 - headroom)
    return max(totals) <= cap.device_bytes * (1 - headroom)
