"""What the loop cannot run, refused before any process starts: the model's heads and
tensor-parallel plan against the layout, the adapter's targets, chat data without a template.
Read from the model's config alone (no weights)."""

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


def check_fine_tuning(cfg: RunConfig) -> None:
    """`peft.target_modules` against the model's modules (built on the meta device, no weights),
    and chat data's tokenizer has a chat template."""
    from overdrive.training import adapter

    adapter.check(cfg)
    if cfg.data.format == "chat":
        from overdrive.training.tokenizer import build_tokenizer

        build_tokenizer(cfg, (), "")  # a pretrained tokenizer (validated): refused by key without a template
