"""The "next:" lines after a run, built from the user's own command: the same files and
overrides, with only the keys a suggestion changes replaced. A hint that dropped them would
train the embedded default instead of the user's run.

    next_lines(cfg, Path("runs/x"), ["run.yaml", "data.max_bytes=1e6"])
    -> ["  overdrive report runs/x    # ...", "  overdrive explain run.yaml data.max_bytes=1e6 lr=3e-4 ...", ...]
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Sequence


def command(verb: str, items: Sequence[str], changes: Sequence[str] = ()) -> str:
    """`overdrive VERB` with the user's items, minus any override of a key in `changes`, then `changes`."""
    from overdrive.config.keys import expand_alias

    def key_of(item: str) -> str:
        return expand_alias(item.partition("=")[0].strip())

    from overdrive.config.redact import masked_item

    changed = {key_of(change) for change in changes}
    kept = [masked_item(item) for item in items if "=" not in item or key_of(item) not in changed]
    return shlex.join(["overdrive", verb, *kept, *changes])


def accepted(items: Sequence[str], changes: Sequence[str]) -> bool:
    """Whether the config resolves with `changes` over the user's items: a suggestion the run's
    own rules would refuse (DeepSpeed beside pipeline stages) is not offered."""
    from overdrive.errors import UserError
    from overdrive.resolving.inputs import resolve_items

    here = [item for item in items if "=" in item or Path(item).expanduser().exists()]  # a file since moved: left out
    try:
        resolve_items([*here, *changes], tell=False)
    except (UserError, OSError, ValueError):
        return False
    return True


def next_lines(cfg, out: Path, items: Sequence[str]) -> list[str]:
    """What to run next, each line a command that keeps the user's config, then a comment."""
    sharded = f"output_dir={out}-sharded"  # a new directory: the finished run's would be resumed, and is done
    lines = [
        (shlex.join(["overdrive", "report", str(out)]), "loss curves, throughput, MFU, memory"),
        (command("explain", items, ["lr=3e-4"]), "every effective value and the layer that set it"),
    ]
    for changes, comment in ((["parallel.strategy=fsdp", "launch.num_processes=2", sharded],
                              "the same run, sharded over 2 processes"),
                             (["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3", "launch.num_processes=2",
                               sharded], "the same run under DeepSpeed ZeRO-3")):
        if accepted(items, changes):
            lines.append((command("train", items, changes), comment))
    if cfg.checkpoint.save_final_model and cfg.peft.method != "none":
        lines.append((f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({cfg.model.name_or_path!r}), "
                      f"{str(out / 'model')!r})", "the adapter on its base (docs/finetuning.md)"))
    elif cfg.checkpoint.save_final_model:
        lines.append((command("train", items, [f"model.name_or_path={out / 'model'}", f"output_dir={out}-continued"]),
                      "continue from the trained model"))
    return [f"  {line}    # {comment}" for line, comment in lines]
