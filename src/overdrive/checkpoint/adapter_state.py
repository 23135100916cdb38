"""Checkpoints of an adapter run: what is trained and its optimizer state, never the frozen base.

The base is recorded instead (`base_record`: its path or hub name, revision, and a
fingerprint of its files), and a resume onto a base whose files changed is refused. How the
frozen weights are kept out depends on who writes the model's files (strategies/ says which):

    state_dict  Accelerate's own weights file (DDP, one process): a save pre-hook keeps only
                the parameters that require grad; loading is not strict about the rest
    engine      DeepSpeed's `save_checkpoint(exclude_frozen_parameters=True)`, loaded with
                `load_module_strict=False`
    full        FSDP2's distributed checkpoint holds every parameter (Accelerate's save_state
                has no adapter-only form for it); the optimizer state is the adapter's alone
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from overdrive.errors import Problem, UserError

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def base_record(cfg: RunConfig) -> Optional[dict[str, Any]]:
    """The frozen base as a checkpoint refers to it (None without an adapter)."""
    if cfg.peft.method == "none":
        return None
    name = cfg.model.name_or_path
    record: dict[str, Any] = {"name_or_path": name, "revision": cfg.model.revision}
    path = Path(name).expanduser() if name else None  # none: a model built from model.architecture
    if path is not None and path.is_dir():
        digest = hashlib.sha256()
        for f in sorted(p for p in path.iterdir() if p.is_file()):
            st = f.stat()
            digest.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        record["fingerprint"] = digest.hexdigest()
    return record


def check_base(saved: dict, cfg: RunConfig, name: str) -> None:
    """Refuse a resume whose base model's files are not the ones the adapter was trained on."""
    before, now = saved.get("base_model"), base_record(cfg)
    if before and now and before.get("fingerprint") != now.get("fingerprint"):
        raise UserError(Problem("model.name_or_path", f"{name} trained an adapter on {before['name_or_path']}, whose "
                                "files have changed since (sizes or times)",
                                fix="point model.name_or_path at the base the adapter was trained on, or start over "
                                "with checkpoint.resume=never"))


def attach(cfg: RunConfig, accelerator) -> tuple[dict, dict]:
    """(save_state kwargs, load_state kwargs) that keep the frozen base out of the checkpoint;
    registers the pre-hook where Accelerate writes the weights itself."""
    if cfg.peft.method == "none":
        return {}, {}
    from overdrive.strategies.adapter import checkpoint_writer

    how = checkpoint_writer(cfg)
    if how == "engine":
        return {"exclude_frozen_parameters": True}, {"load_module_strict": False}
    if how == "state_dict":
        accelerator.register_save_state_pre_hook(_trainable_only)
        return {}, {"strict": False}
    return {}, {}


def _trainable_only(models: list, weights: list, output_dir: str) -> None:
    for model, state in zip(models, weights):
        keep = {name for name, param in model.named_parameters() if param.requires_grad}
        for key in [k for k in state if k not in keep]:
            del state[key]
