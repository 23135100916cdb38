"""What the loop cannot run, refused before any process starts: the model's heads and
tensor-parallel plan against the layout, the adapter's targets, chat data without a template,
read from the model's config alone (no weights); the eval tasks and reward functions a run reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def check_model_layout(cfg: RunConfig) -> None:
    """The model's heads and tensor-parallel plan against parallel.tp_size / sp_size, read
    from its config alone (no weights), and what the loop does not do (sequence parallel),
    before any process starts (launch/job_checks.py, which the cluster writers share)."""
    from overdrive.errors import UserError
    from overdrive.launch.job_checks import layout_problems

    found = layout_problems(cfg)
    if found:
        raise UserError(found)


def check_inputs(cfg: RunConfig) -> None:
    """What a run reads besides its model and data, refused before its output directory is made:
    `eval.tasks` (lm-eval installed, every task known, its data present or readable) and
    `rl.reward_funcs` (every callable importable). Found later, they would stop a run after it
    had written its directory, or after it had trained."""
    if cfg.eval.tasks:
        from overdrive.training import benchmark_eval

        benchmark_eval.check(cfg)
    if cfg.rl.method != "none":
        from overdrive.training import rewards

        rewards.build(cfg.rl.reward_funcs)


def check_fine_tuning(cfg: RunConfig) -> None:
    """`peft.target_modules` against the model's modules (built on the meta device, no weights),
    and chat data's tokenizer has a chat template."""
    from overdrive.training import adapter

    adapter.check(cfg)
    if cfg.data.format == "chat":
        from overdrive.training.tokenizer import build_tokenizer

        build_tokenizer(cfg, (), "")  # a pretrained tokenizer (validated): refused by key without a template
