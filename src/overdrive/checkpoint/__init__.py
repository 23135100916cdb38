"""Checkpoints you can trust: atomic saves, exact resume, clean stops.

    plan = plan_resume(cfg, force)          # before the accelerator: what to resume, is it allowed
    ckpt = Checkpointer(plan.config, accelerator, scheduler, plan, metrics_path)
    restored = ckpt.restore(loop_state)     # load the newest verified checkpoint (or start fresh)
    ...
    if ckpt.due(step): ckpt.save(loop_state, loss_sum, micro_steps, extra)

    store.py        atomic directories, manifests with sha256, finding the newest complete one, pruning
    fingerprint.py  which config changes alter the math, the world size and the global batch
    routes.py       how a checkpoint of another world size or strategy gets in (or why it cannot)
    reshard.py      that move: DeepSpeed's universal checkpoint, DCP, set_state_dict
    session.py      save_state / load_state and the trainer's own state
    signals.py      SIGTERM / SIGINT: stop after the step every rank agrees on

The trainer calls these; none of them reads the environment.
"""

from overdrive.checkpoint.session import (TRAINER_STATE, Checkpointer, Restored, ResumePlan, plan_resume,
                                          read_state, with_plan)
from overdrive.checkpoint.signals import StopRequest, cpu_group, signal_name
from overdrive.checkpoint.store import checkpoints_dir, latest_complete

__all__ = ["TRAINER_STATE", "Checkpointer", "Restored", "ResumePlan", "StopRequest", "checkpoints_dir", "cpu_group",
           "latest_complete", "plan_resume", "read_state", "signal_name", "with_plan"]
