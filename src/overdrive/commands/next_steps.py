"""The "next:" lines after a run, built from the user's own command: the same files and
overrides, with only the keys a suggestion changes replaced. A hint that dropped them would
train the embedded default instead of the user's run.

    next_lines(cfg, Path("runs/x"), ["run.yaml", "data.max_bytes=1e6"])
    -> ["  overdrive report runs/x    # ...", "  overdrive explain run.yaml data.max_bytes=1e6    # ...", ...]
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Callable, Optional, Sequence

from overdrive.config.schema import RunConfig
from overdrive.errors import UserError


def command(verb: str, items: Sequence[str], changes: Sequence[str] = ()) -> str:
    """`overdrive VERB` with the user's items, minus any override of a key in `changes` (and, where
    the changes choose another strategy, of the other strategies' own settings), then `changes`."""
    from overdrive.config.keys import expand_alias
    from overdrive.config.redact import masked_item
    from overdrive.strategies import registry

    def key_of(item: str) -> str:
        return expand_alias(item.partition("=")[0].strip())

    changed = {key_of(change) for change in changes}
    chosen = next((change.partition("=")[2] for change in changes if key_of(change) == "parallel.strategy"), None)
    others = [s for s in registry.STRATEGIES.values() if chosen is not None and s.name != chosen]

    def dropped(key: str) -> bool:
        return key in changed or any(s.owns(key) for s in others)

    kept = [masked_item(item) for item in items if "=" not in item or not dropped(key_of(item))]
    return shlex.join(["overdrive", verb, *kept, *changes])


# Layouts a finished run may try next: (the keys that ask for it, what the line says)
LAYOUTS = (
    (("parallel.strategy=fsdp", "launch.num_processes=2"), "the same run, sharded over 2 processes (FSDP2)"),
    (("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3", "launch.num_processes=2"),
     "the same run under DeepSpeed ZeRO-3"),
)


def _layout_of(cfg: RunConfig) -> tuple:
    p = cfg.parallel
    return p.strategy, p.deepspeed.zero_stage if p.strategy == "deepspeed" else None, cfg.launch.num_processes


def _accepted(items: Sequence[str], changes: Sequence[str]) -> Optional[RunConfig]:
    """The config a hint would run, when `explain` accepts it (None when it refuses it)."""
    from overdrive.resolving.inputs import resolve_items

    kept = shlex.split(command("explain", items, changes))[2:]
    # a file since moved or deleted: the hint is not offered (it would not run as printed)
    try:
        return resolve_items(kept, tell=False).config
    except (UserError, OSError, ValueError):
        return None


def next_lines(cfg: RunConfig, out: Path, items: Sequence[str],
               accepted: Callable[[Sequence[str], Sequence[str]], Optional[RunConfig]] = _accepted) -> list[str]:
    """What to run next, each line a command that keeps the user's config, then a comment. Every
    command is one `explain` accepts (asked through `accepted`) and differs from the run just done."""
    lines = [
        (shlex.join(["overdrive", "report", str(out)]), "loss curves, throughput, MFU, memory"),
        (command("explain", items), "every effective value and the layer that set it"),
    ]
    sharded = f"output_dir={out}-sharded"  # a new directory: the finished run's would be resumed, and is done
    for changes, what in LAYOUTS:
        hinted = accepted(items, changes)
        if hinted is not None and _layout_of(hinted) != _layout_of(cfg):
            lines.append((command("train", items, [*changes, sharded]), what))
    from overdrive.hf.vision import describe

    built = describe(cfg)  # a vision-language model: its own Auto class, and `generate` with an image
    if cfg.checkpoint.save_final_model and cfg.peft.method != "none":
        lines.append((f"PeftModel.from_pretrained({built['auto_class']}.from_pretrained({cfg.model.name_or_path!r}), "
                      f"{str(out / 'model')!r})", "the adapter on its base (docs/finetuning.md)"))
    elif cfg.checkpoint.save_final_model:
        lines.append((command("train", items, [f"model.name_or_path={out / 'model'}", f"output_dir={out}-continued"]),
                      "continue from the trained model"))
    if cfg.checkpoint.save_final_model and cfg.model.task == "causal-lm" and cfg.preference.method != "reward":
        if built["vision"]:
            lines.append((shlex.join(["overdrive", "generate", str(out), "what is in the image?", "--image", "IMAGE"]),
                          "ask the trained model about an image (docs/vision.md)"))
        else:
            lines.append((shlex.join(["overdrive", "generate", str(out)]), "talk to the trained model "
                          "(docs/evaluation.md)"))
    return [f"  {line}    # {comment}" for line, comment in lines]
