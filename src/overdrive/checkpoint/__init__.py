"""Checkpoints you can trust: atomic saves, exact resume, clean stops.

    plan = plan_resume(cfg, force)          # before the accelerator: what to resume, is it allowed
    ckpt = Checkpointer(plan.config, accelerator, scheduler, plan, metrics_path)
    restored = ckpt.restore(loop_state)     # the newest verified checkpoint into loop_state, whole (or a fresh start)
    ...
    if ckpt.due(step): ckpt.save(loop_state)

    store.py        atomic directories, manifests with sha256, finding the newest complete one, pruning
    fingerprint.py  which config changes alter the math, the world size and the global batch
    routes.py       how a checkpoint of another world size or strategy gets in (or why it cannot)
    resume.py       what a run resumes, judged once: the typed plan, handed to the workers whole
    reshard.py      that move: DeepSpeed's universal checkpoint, DCP, set_state_dict
    session.py      save_state / load_state and the trainer's own state
    background.py   checkpoint.async: staged to host memory, written by DCP in the background, sealed atomically
    signals.py      SIGTERM / SIGINT: stop after the step every rank agrees on

The trainer calls these; none of them reads the environment.
"""

from overdrive.checkpoint.resume import (TRAINER_STATE, ResumePlan, describe_resume, judge_resume, plan_resume,
                                         read_state, resume_plan, with_plan)
from overdrive.checkpoint.session import Checkpointer, Restored
from overdrive.checkpoint.signals import StopRequest, cpu_group, kept_note, signal_name, stopping_note
from overdrive.checkpoint.store import checkpoints_dir, latest_complete

__all__ = ["TRAINER_STATE", "Checkpointer", "Restored", "ResumePlan", "StopRequest", "checkpoints_dir", "cpu_group",
           "describe_resume", "judge_resume", "kept_note", "latest_complete", "plan_resume", "read_state",
           "resume_plan", "signal_name", "stopping_note", "with_plan"]
